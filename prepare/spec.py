"""What a caller asks for (`PrepareSpec`) and what it gets back (`Prepared`).

Plain frozen dataclasses: a join loop builds a spec once and calls `prepare`
on every attempt, so nothing here may carry state between attempts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from prepare.fail import Fail

# Defaults a step acts on, written here once: the field table gives them
# as its defaults and its help, the plan applies them.
# Where nixpkgs' addDriverRunpath bakes the host's driver libraries into a
# Nix-built program (prepare.gpu.driver_dir).
DRIVER_DIR = "/run/opengl-driver/lib"
# Where a data_source is mounted when data_path does not say.
DATA_MOUNTPOINT = "/flodl/data"

# What the long steps (downloads, builds) say while they run, as plain
# dicts (prepare.cli.progress lists the types), and what receives them: the
# library never prints, a CLI or a join loop decides how to show them.
Event = dict[str, Any]
Progress = Callable[[Event], None]


@dataclass(frozen=True)
class DataSpec:
    """The dataset source root. Nothing set: ship nothing, check nothing.
    `data_path` alone: a root provisioning already placed. `data_source`:
    an `sshfs://[user@]host[:port]/abs/path` mounted read-only at `data_path`
    (default DATA_MOUNTPOINT, `/flodl/data`)."""

    data_path: str | None = None
    data_source: str | None = None


@dataclass(frozen=True)
class SshSpec:
    """The box's ssh block. Its `options` go first on every ssh/sshfs argv:
    OpenSSH keeps the first value it sees, so the operator's choices win."""

    target: str | None = None
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class SourceSpec:
    """The box's own recipe for the training source (`[join.source]`).
    A published run manifest (floDl's `.fdl-run.yml`) in the fetched tree outranks
    every field it sets; a field it omits keeps the value here."""

    from_: str | None = None  # `from` in TOML; a flake URL
    cwd: str | None = None
    build: str | None = None
    bin: str | None = None
    # Arguments of one run of the built binary before prepare succeeds
    # (prepare.smoke); None or empty: no smoke run.
    smoke: tuple[str, ...] | None = None


@dataclass(frozen=True)
class NixSpec:
    """The box's binary caches (`[join.nix]`): what a publish pushed there is
    substituted instead of built. Passed to every nix call as options, never
    taken from a flake's nixConfig: what a box trusts is the box's own word,
    never something it fetched."""

    # Store URLs added to the box's own substituters (nix.conf's stay).
    substituters: tuple[str, ...] = ()
    # `name:base64` public keys; a path from a cache is accepted only when
    # signed by one of these (or one in nix.conf).
    trusted_public_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Origin:
    """Where a resolved value came from, as messages name it: a flag
    (`--state-dir`), a key of the config file (`join.state_dir`), an
    environment variable (`STATE_DIRECTORY`), or the built-in default."""

    kind: Literal["flag", "file", "environment", "default"]
    name: str
    # The value it gave, in the spec's form: a spec changed since (with
    # dataclasses.replace) no longer holds it, and the origin no longer holds.
    value: Any = None
    note: str | None = None

    def __str__(self) -> str:
        if self.kind == "file":
            return f"{self.name} in the config"
        if self.kind == "environment":
            return f"${self.name}, {self.note}" if self.note else f"${self.name}"
        return self.name


@dataclass(frozen=True)
class PrepareSpec:
    data: DataSpec = field(default_factory=DataSpec)
    ssh: SshSpec = field(default_factory=SshSpec)
    source: SourceSpec | None = None
    nix: NixSpec = field(default_factory=NixSpec)
    # "auto", a variant label the flake provides ("cpu", "cu128", ...), or None
    # for no libtorch at all.
    libtorch: str | None = None
    # Indices this box offers to the run, in its vendor's numbering, applied after the masks.
    devices: tuple[int, ...] | None = None
    # How many healthy GPUs the box must offer: a fleet that knows its boxes
    # have 8 cards stops one that lost a card off the bus, or has a sick one.
    expect_gpus: int | None = None
    cpu_only: bool = False
    # Where the host's NVIDIA libraries are linked for Nix-built programs on
    # a box that is not NixOS (prepare.gpu.driver_dir): the path nixpkgs'
    # addDriverRunpath bakes into them.
    driver_dir: str = DRIVER_DIR
    flake: str | None = None
    # Where GC roots for built outputs live; None picks a per-user default.
    state_dir: str | None = None
    # A dead network mount must not hang prepare: listing the source root
    # gives up after this many seconds (transient).
    list_timeout_s: float = 10.0
    # A card that fell off the bus can leave a driver call blocked for good:
    # the GPU survey gives up after this many seconds (transient).
    gpu_timeout_s: float = 30.0
    # A build stuck past this many seconds is abandoned (transient). None: no limit.
    build_timeout_s: float | None = None
    # The smoke run is stopped after this many seconds (transient).
    smoke_timeout_s: float = 60.0
    # Who the smoke run runs as when fdl-prepare is root (prepare.host.confine):
    # never root, the training source's code is not the operator's;
    # "dynamic", a uid of the run's own.
    smoke_user: str = "dynamic"
    # The training user: whom floDl's data plane runs as (`fdl join` and its
    # ranks). Set, step 3 proves that user's dataset cache and stage, and the
    # smoke run runs as it (prepare.host.training_user); None: fdl-prepare's
    # own user, as before.
    user: str | None = None
    # Ignore what earlier attempts settled (<state>/warm.json): evaluate the
    # flake and build as on a first attempt, then record afresh.
    refresh: bool = False
    # Where each value came from, by spec path ("state_dir", "ssh.port"), when
    # the config resolved it from flags, a file and the environment; empty for
    # a spec built in code. Not part of equality: the same values from a flag
    # or from the file are the same spec.
    origins: Mapping[str, Origin] = field(default_factory=dict, compare=False, repr=False)

    @property
    def wants_build(self) -> bool:
        return self.source is not None or self.libtorch is not None

    def origin(self, path: str) -> Origin | None:
        """Where the value at the spec path `path` came from; None when that
        is not known, or the spec no longer holds the value it came with."""
        origin = self.origins.get(path)
        value: Any = self
        for part in path.split("."):
            value = getattr(value, part, None)
        if origin is None or origin.value != value:
            return None
        return origin


@dataclass(frozen=True)
class Libtorch:
    path: str
    variant: str


@dataclass(frozen=True)
class Binary:
    path: str
    cwd: str


@dataclass(frozen=True)
class Prepared:
    data_path: str | None = None
    libtorch: Libtorch | None = None
    bin: Binary | None = None
    args: tuple[str, ...] | None = None
    run_id: str | None = None
    # The devices offered to the run (after masks), as the run's runtime
    # numbers them: NVIDIA's as CUDA ordinals in a process under this
    # CUDA_VISIBLE_DEVICES (what floDl's `devices:` and ranks take), AMD's in
    # ROCm's numbering; None when the gate was skipped.
    devices: tuple[int, ...] | None = None
    # Whose numbering `devices` is in: "nvidia" (CUDA's) or "amd" (ROCm's);
    # None when the gate was skipped.
    gpu_vendor: str | None = None
    # NVIDIA's offered devices by NVML index (nvidia-smi's), in the order of
    # `devices`; None for AMD or when the gate was skipped.
    nvml_indices: tuple[int, ...] | None = None
    # Seconds spent in each step, in pipeline order. Not part of equality:
    # two attempts that prepared the same thing are the same Prepared.
    timings: dict[str, float] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.args is not None:
            out["args"] = list(self.args)
        if self.devices is not None:
            out["devices"] = list(self.devices)
        if self.nvml_indices is not None:
            out["nvml_indices"] = list(self.nvml_indices)
        return out


@dataclass(frozen=True)
class StepCheck:
    """One step's verdict in a check: `verdict` is "ok" (settled as an
    attempt would), "would ..." (what an attempt would change: "would
    mount", "would create", "would build", "would substitute", "would
    run"), "skipped" (not wanted, as an attempt would skip it), "failed"
    (where the attempt would stop) or "not checked" (after that); `detail`
    says what was found."""

    verdict: str
    detail: str = ""

    def to_json(self) -> dict[str, str]:
        return {"verdict": self.verdict, "detail": self.detail}


# What a step's verdict says an attempt would do, for the check's last line.
_DOES = {
    "ok": "",
    "skipped": "",
    "would mount": "mount the dataset root",
    "would remount": "mount the dataset root again",
    "would create": "create what is missing",
    "would build": "build {build} derivation(s){also}",
    "would substitute": "substitute {substitute} path(s)",
    "would run": "run the smoke step",
}


@dataclass(frozen=True)
class Checked:
    """What `check` found: each step's verdict, in pipeline order after the
    plan's; the store paths the build would substitute from a cache and
    the derivations it would build; and the Fail an attempt would stop on
    (None: it would prepare the box)."""

    steps: dict[str, StepCheck]
    substitute: tuple[str, ...] = ()
    build: tuple[str, ...] = ()
    # As Nix said it (2.34: "1.2 GiB download, 4.5 GiB unpacked").
    download: str | None = None
    fail: Fail | None = None
    timings: dict[str, float] = field(default_factory=dict, compare=False)

    # How many of each list a person is shown (--json has them all).
    LISTED: ClassVar[int] = 20

    @property
    def ready(self) -> bool:
        return self.fail is None

    def summary(self) -> str:
        """The last line for people: what an attempt would do, or where it would stop."""
        if self.fail is not None:
            where = next((name for name, step in self.steps.items() if step.verdict == "failed"), "the plan")
            return f"not ready: an attempt would stop at {where} ({self.fail.kind}, {self.fail.reason})"
        changes = [_DOES.get(step.verdict, step.verdict.removeprefix("would ")) for step in self.steps.values()]
        also = f" and substitute {len(self.substitute)} path(s)" if self.substitute else ""
        done = [
            change.format(build=len(self.build), substitute=len(self.substitute), also=also)
            for change in changes
            if change
        ]
        if not done:
            return "ready: an attempt would prepare this box, and change nothing on it"
        return "ready: an attempt would prepare this box; on the way it would " + ", ".join(done)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "check",
            "schema": 1,
            "ready": self.ready,
            "steps": {name: step.to_json() for name, step in self.steps.items()},
            "substitute": list(self.substitute),
            "build": list(self.build),
            "download": self.download,
            "fail": None if self.fail is None else self.fail.to_json(),
            "timings": dict(self.timings),
        }
