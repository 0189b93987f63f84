"""The configuration's one field table: every [join] key, its flag, where it
lands on a PrepareSpec, how its value is checked, its default, its
environment fallback, its help text, and the type the NixOS module gives it.

Everything else derives from `TABLE`: the CLI's options (`prepare.cli`), the
TOML schema, the precedence in `resolve`, the checks a spec built in code
gets (`prepare.plan`), the unknown-key suggestions (`config.schema`), and
the NixOS module's `settings.join` options (`prepare.config.fields_json`
exports the table to nix/fields.json, which nix/module.nix reads). Adding a
key is one `Field` here, one attribute on the spec for the step that reads
it, and `python -m prepare.config.fields_json > nix/fields.json` (a test
says so when the committed file is stale).

Rules that involve more than one field (`RULES`) live here too, and the plan
runs them the same way on a resolved config and on a spec a join loop built
itself, so neither path can refuse what the other lets through.

This module is imported on every start of the CLI, to build its options:
it must stay as cheap as the CLI's own imports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prepare.config.kinds import (
    ARGUMENTS,
    BOOLEAN,
    BUILD_SECONDS,
    COUNT,
    DATA_PATH,
    DEVICES,
    DRIVER_PATH,
    FLODL_ARGS,
    FLODL_CONTROLLER,
    FLODL_HOST,
    FLODL_PATH,
    FLODL_SHARE,
    FLODL_TOKEN,
    IDENTITY,
    LIBTORCH,
    LIST_SECONDS,
    PORT,
    PUBLIC_KEYS,
    SMOKE_SECONDS,
    SMOKE_USER,
    SSH_HOST,
    SSH_USER,
    STATE_PATH,
    STORE_URLS,
    STRING,
    STRINGS,
    URL,
    USER,
    Kind,
    show,
)
from prepare.spec import DATA_MOUNTPOINT, DRIVER_DIR, PrepareSpec

FLAKE_ENV = "FDL_PREPARE_FLAKE"
STATE_ENV = "STATE_DIRECTORY"

# -- fields --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Env:
    """An environment variable that gives a field its default when neither a
    flag nor the file sets it."""

    name: str
    # Said after the variable in messages, where its name alone would not say who set it.
    note: str | None = None
    # A variable holding a list whose first entry is the value.
    separator: str | None = None

    def read(self, env: Mapping[str, str]) -> str | None:
        """The value, None when unset or empty."""
        value = env.get(self.name)
        if value and self.separator is not None:
            value = value.split(self.separator, 1)[0]
        return value or None


@dataclass(frozen=True)
class Field:
    # Dotted below [join]: "ssh.port" is `port` in [join.ssh].
    key: str
    flag: str
    # The attribute path on PrepareSpec: "ssh.port", "data.data_path".
    spec: str
    kind: Kind
    help: str
    metavar: str | None = None
    # The spec's own default, which resolve gives when nothing else does.
    default: Any = None
    env: Env | None = None
    # The type nix/module.nix gives settings.join.<key>, as a `lib.types`
    # expression (exported to nix/fields.json, which the module reads); None
    # where the module decides the key itself (it declares `flake`, and
    # refuses the others in settings, saying what decides them).
    nix: str | None = None

    @property
    def table(self) -> str:
        """The sub-table of [join] the key is in, "" for [join] itself."""
        return self.key.rpartition(".")[0]

    @property
    def name(self) -> str:
        """The key inside its table."""
        return self.key.rpartition(".")[2]

    @property
    def param(self) -> str:
        """The key as a Python identifier, for the CLI's parameters."""
        return self.key.replace(".", "_")


FIELDS: tuple[Field, ...] = (
    Field(
        key="data_path",
        flag="--data-path",
        spec="data.data_path",
        kind=DATA_PATH,
        metavar="PATH",
        nix="nullOr str",
        help=f"Dataset root (or where to mount data_source; default {DATA_MOUNTPOINT}).",
    ),
    Field(
        key="data_source",
        flag="--data-source",
        spec="data.data_source",
        kind=URL,
        metavar="URL",
        nix="nullOr str",
        help="sshfs://[user@]host[:port]/abs/path, mounted read-only at --data-path.",
    ),
    Field(
        key="libtorch",
        flag="--libtorch",
        spec="libtorch",
        kind=LIBTORCH,
        metavar="VARIANT",
        nix="nullOr str",
        help="libtorch variant: auto, cpu, cu126, cu128, rocm7.0, ... (whatever the flake provides); floDl's "
        "spellings 12.6, 12.8, rocm70, 7.0, rocm71 and 7.1 name the same builds.",
    ),
    Field(
        key="devices",
        flag="--devices",
        spec="devices",
        kind=DEVICES,
        metavar="LIST",
        nix="nullOr (listOf ints.unsigned)",
        help="GPU indices this box offers, e.g. 0,1, or all (every one, as leaving it out), numbered as the run's "
        "runtime numbers them after its masks, as floDl's devices are: CUDA's ordinals (the cards "
        "CUDA_VISIBLE_DEVICES leaves, in its order), ROCm's for AMD cards.",
    ),
    Field(
        key="expect_gpus",
        flag="--expect-gpus",
        spec="expect_gpus",
        kind=COUNT,
        metavar="N",
        nix="nullOr ints.positive",
        help="Healthy GPUs this box must offer (after the masks); fewer is permanent, naming the missing or sick ones.",
    ),
    Field(
        key="cpu_only",
        flag="--cpu-only",
        spec="cpu_only",
        kind=BOOLEAN,
        default=False,
        nix="bool",
        help="Skip the GPU gate (CPU-only workers, demos); only the cpu libtorch is allowed.",
    ),
    # Not in the module's settings: on NixOS the system keeps the driver directory (the module says so).
    Field(
        key="driver_dir",
        flag="--driver-dir",
        spec="driver_dir",
        kind=DRIVER_PATH,
        metavar="DIR",
        default=DRIVER_DIR,
        help="Where links to the host's NVIDIA libraries are kept for Nix-built programs on a box that is not NixOS. "
        f"Default: {DRIVER_DIR} (nixpkgs' addDriverRunpath).",
    ),
    # The module declares settings.join.flake itself, defaulting to its own `flake` option.
    Field(
        key="flake",
        flag="--flake",
        spec="flake",
        kind=URL,
        metavar="URL",
        env=Env(FLAKE_ENV),
        help="Flake providing libtorch variants and the training build. Default: $FDL_PREPARE_FLAKE.",
    ),
    # Under the module, systemd's StateDirectory= decides it (the module says so).
    Field(
        key="state_dir",
        flag="--state-dir",
        spec="state_dir",
        kind=STATE_PATH,
        metavar="DIR",
        # systemd joins several StateDirectory= entries with ':'; the first is the unit's own.
        env=Env(STATE_ENV, note="systemd's StateDirectory=", separator=":"),
        help="Where GC roots of built outputs live. Default: $STATE_DIRECTORY (systemd), else a per-user directory.",
    ),
    Field(
        key="list_timeout",
        flag="--list-timeout",
        spec="list_timeout_s",
        kind=LIST_SECONDS,
        metavar="SECONDS",
        default=10.0,
        nix="nullOr (numbers.between 0.1 3600)",
        help="Give up listing the dataset root after this long (dead mount). Default: 10.",
    ),
    Field(
        key="gpu_timeout",
        flag="--gpu-timeout",
        spec="gpu_timeout_s",
        kind=LIST_SECONDS,
        metavar="SECONDS",
        default=30.0,
        nix="nullOr (numbers.between 0.1 3600)",
        help="Give up on GPU drivers that have not answered the survey after this long (transient). Default: 30.",
    ),
    Field(
        key="build_timeout",
        flag="--build-timeout",
        spec="build_timeout_s",
        kind=BUILD_SECONDS,
        metavar="SECONDS",
        nix="nullOr (numbers.between 1 2592000)",
        help="Abandon a build running longer than this (transient).",
    ),
    Field(
        key="smoke_timeout",
        flag="--smoke-timeout",
        spec="smoke_timeout_s",
        kind=SMOKE_SECONDS,
        metavar="SECONDS",
        default=60.0,
        nix="nullOr (numbers.between 1 86400)",
        help="Stop the smoke run of the built binary after this long (transient). Default: 60.",
    ),
    Field(
        key="smoke_user",
        flag="--smoke-user",
        spec="smoke_user",
        kind=SMOKE_USER,
        metavar="USER",
        default="dynamic",
        nix="nullOr str",
        help="The unprivileged user the smoke run runs as when fdl-prepare is root (never root itself, nor one of "
        "Nix's build users); `dynamic`, the default, is a uid of the run's own (60600-60699, none the box uses). "
        "It gets only the render and video groups for the GPUs, no capabilities and a clean environment.",
    ),
    Field(
        key="user",
        flag="--user",
        spec="user",
        kind=USER,
        metavar="USER",
        nix="nullOr str",
        help="The training user: the account floDl's data plane (fdl join and its ranks) runs as. Step 3 then "
        "proves that user's dataset cache (~/.flodl/data, its home from the password database, created owned by "
        "it) and the stage writable by that user, and the smoke run runs as it instead of smoke_user. Never root "
        "or a Nix build user. Unset: the directories of the user fdl-prepare runs as.",
    ),
    Field(
        key="refresh",
        flag="--refresh",
        spec="refresh",
        kind=BOOLEAN,
        default=False,
        nix="nullOr bool",
        help="Evaluate and build as if nothing were known from earlier attempts (the warm-path record is ignored).",
    ),
    Field(
        key="source.from",
        flag="--source",
        spec="source.from_",
        kind=URL,
        metavar="URL",
        nix="nullOr str",
        help="Training source: floDl's file:///abs, rsync://[user@]host:/abs or git+...#<ref>, or a flake URL.",
    ),
    Field(
        key="source.cwd",
        flag="--source-cwd",
        spec="source.cwd",
        kind=STRING,
        metavar="DIR",
        nix="nullOr str",
        help="Directory inside the source the build and run use.",
    ),
    Field(
        key="source.build",
        flag="--source-build",
        spec="source.build",
        kind=STRING,
        metavar="CMD",
        nix="nullOr str",
        help="Build line for the source.",
    ),
    Field(
        key="source.bin",
        flag="--source-bin",
        spec="source.bin",
        kind=STRING,
        metavar="NAME",
        nix="nullOr str",
        help="The training binary the build installs.",
    ),
    Field(
        key="source.smoke",
        flag="--smoke",
        spec="source.smoke",
        kind=ARGUMENTS,
        metavar="ARG",
        nix="nullOr (listOf str)",
        help="Argument of one run of the built binary before the box counts as prepared, repeatable (the box's "
        "own: floDl's run manifest has no smoke).",
    ),
    Field(
        key="ssh.target",
        flag="--ssh-target",
        spec="ssh.target",
        kind=SSH_HOST,
        metavar="HOST",
        nix="nullOr str",
        help="ssh host of the controller tunnel (the join loop dials it); a data_source on this host takes "
        "--ssh-user and --ssh-port as its defaults.",
    ),
    Field(
        key="ssh.port",
        flag="--ssh-port",
        spec="ssh.port",
        kind=PORT,
        metavar="PORT",
        nix="nullOr (ints.between 1 65535)",
        help="ssh port on --ssh-target; the port of a data_source on that host that names none.",
    ),
    Field(
        key="ssh.user",
        flag="--ssh-user",
        spec="ssh.user",
        kind=SSH_USER,
        metavar="USER",
        nix="nullOr str",
        help="ssh user on --ssh-target; the user of a data_source on that host that names none.",
    ),
    Field(
        key="ssh.identity_file",
        flag="--identity-file",
        spec="ssh.identity_file",
        kind=IDENTITY,
        metavar="PATH",
        nix="nullOr str",
        help="ssh identity file (used for the sshfs mount).",
    ),
    Field(
        key="ssh.options",
        flag="--ssh-option",
        spec="ssh.options",
        kind=STRINGS,
        metavar="OPT",
        default=(),
        nix="nullOr (listOf str)",
        help="ssh -o option, repeatable; replaces the file's list. These come first, so they win.",
    ),
    # What a publish pushed (`fdl-prepare publish --to`) is substituted from
    # these instead of built; both are added to nix.conf's own lists.
    Field(
        key="nix.substituters",
        flag="--substituter",
        spec="nix.substituters",
        kind=STORE_URLS,
        metavar="URL",
        default=(),
        nix="nullOr (listOf str)",
        help="Binary cache to substitute builds from (a store URL), repeatable; replaces the file's list.",
    ),
    Field(
        key="nix.trusted_public_keys",
        flag="--trusted-public-key",
        spec="nix.trusted_public_keys",
        kind=PUBLIC_KEYS,
        metavar="KEY",
        default=(),
        nix="nullOr (listOf str)",
        help="Public key (name:base64) cached paths must be signed with, repeatable; replaces the file's list.",
    ),
)


class Table:
    """The fields, and the lookups the config and the CLI derive from them.
    `spec_type` is the class a resolved config becomes."""

    def __init__(self, fields: Sequence[Field], spec_type: type[PrepareSpec] = PrepareSpec) -> None:
        self.fields = tuple(fields)
        self.spec_type = spec_type
        for attr in ("key", "flag", "spec", "param"):
            seen = [getattr(f, attr) for f in self.fields]
            twice = sorted({v for v in seen if seen.count(v) > 1})
            if twice:
                raise ValueError(f"two fields share the {attr} {twice[0]!r}")
        self.by_key = {f.key: f for f in self.fields}
        # [join] first, then its sub-tables, each with its keys in table order.
        self.tables: dict[str, dict[str, Field]] = {"": {}}
        for f in self.fields:
            self.tables.setdefault(f.table, {})[f.name] = f
        self.subtables = [t for t in self.tables if t]
        self.flag_names = {f.key: f.flag for f in self.fields}
        self.envs = {f.env.name: f.env for f in self.fields if f.env is not None}


TABLE = Table(FIELDS)


# -- floDl's keys --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Foreign:
    """A key of floDl's `join:` block (flodl-cli's WorkerJoin) that only
    `fdl join` acts on: one config serves both tools, so fdl-prepare takes
    it, checks its type as floDl would, and leaves it to `fdl join`."""

    key: str
    kind: Kind
    # What it is to `fdl join`, for the note that says it is left alone.
    meaning: str


FOREIGN: tuple[Foreign, ...] = (
    Foreign("controller", FLODL_CONTROLLER, "the controller it dials"),
    Foreign("token", FLODL_TOKEN, "its admission token"),
    Foreign("bin", FLODL_PATH, "a training binary run as given"),
    Foreign("host", FLODL_HOST, "the host name in its join hello"),
    Foreign("persist", BOOLEAN, "its re-dial loop"),
    Foreign("args", FLODL_ARGS, "the training binary's arguments"),
    Foreign("gpu_ram_share", FLODL_SHARE, "an integrated GPU's share of RAM"),
    Foreign("sig_probe", BOOLEAN, "its model-signature probe"),
)
FOREIGN_BY_KEY = {f.key: f for f in FOREIGN}


def _bin_or_source(
    join: Mapping[str, Any], name: Callable[[str], tuple[str, int | None]]
) -> tuple[int | None, str] | None:
    """floDl's rule: `bin` and `source` answer the same question (where the
    training binary comes from), so a block with both is refused."""
    if "bin" not in join or not isinstance(join.get("source"), Mapping):
        return None
    full, line = name("bin")
    where = f" (line {line})" if line is not None else ""
    return line, (
        f"{full}{where} and [join.source] both name this box's training binary, which `fdl join` refuses: keep "
        "join.source to have it fetched and built here, or join.bin to run a binary as given (fdl-prepare then "
        "builds nothing)"
    )


# Rules of floDl's over its own keys and ours, checked where the file is.
FOREIGN_RULES = (_bin_or_source,)

# The keys of ours that floDl's `join:` block has too, with the same name
# and nesting; every other key of ours is fdl-prepare's alone, and `fdl
# join` refuses a block that holds one (its WorkerJoin denies unknown
# fields), so an fdl.yml may not carry it (prepare.config.file).
SHARED_WITH_FLODL = frozenset(
    {
        "data_path",
        "data_source",
        "libtorch",
        "devices",
        "source.from",
        "source.cwd",
        "source.build",
        "source.bin",
        "ssh.target",
        "ssh.port",
        "ssh.user",
        "ssh.identity_file",
        "ssh.options",
    }
)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"ssh.port": 22} -> {"ssh": {"port": 22}}: dotted keys in the [join]
    table's shape, as the file has them."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        table, _, name = key.rpartition(".")
        (out.setdefault(table, {}) if table else out)[name] = value
    return out


def value_at(obj: Any, path: str) -> Any:
    """The value at a dotted attribute path, None where a step of it is None."""
    for part in path.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part, None)
    return obj


# -- rules across fields ---------------------------------------------------------------------------

# Names where a spec value came from ("--cpu-only", "join.libtorch in the
# config", "PrepareSpec.libtorch"), given its spec path.
Where = Callable[[str], str]
Rule = Callable[[PrepareSpec, Where], "str | None"]


def _cpu_only_takes_the_cpu_libtorch(spec: PrepareSpec, where: Where) -> str | None:
    if spec.cpu_only and spec.libtorch is not None and spec.libtorch not in ("cpu", "auto"):
        return (
            f"cpu_only (from {where('cpu_only')}) allows only the cpu libtorch, but libtorch is "
            f'{show(spec.libtorch)} (from {where("libtorch")}): set libtorch to "cpu" or "auto", '
            f"or drop cpu_only on a box with a GPU"
        )
    return None


def _a_data_source_is_not_mounted_over_the_root(spec: PrepareSpec, where: Where) -> str | None:
    path = spec.data.data_path
    if spec.data.data_source is not None and path is not None and path.rstrip("/") == "":
        return (
            f"data_path {path!r} (from {where('data.data_path')}) cannot be the mountpoint of data_source: it would "
            f"cover the whole machine. Set `data_path` to an empty directory such as {DATA_MOUNTPOINT}."
        )
    return None


RULES: tuple[Rule, ...] = (_cpu_only_takes_the_cpu_libtorch, _a_data_source_is_not_mounted_over_the_root)
