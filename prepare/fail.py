"""Why preparation stopped, and whether trying again could help.

The permanent/transient split is the product: a persist loop or systemd's
restart loop retries a transient Fail (the far side of a mount is down, nothing
is published yet) and stops on a permanent one (no GPU, a spec that does not
parse), so a misprovisioned box stops instead of hot-looping.

A fleet controller needs more than the split to act on a box (page the
hardware team for a sick card, the platform team for a broken Nix, the
publisher for a missing run): every Fail carries a `reason`, a stable code
chosen where the Fail is raised, and the reason decides the kind. `REASONS`
is the one table of them: each code, its kind and what it means. A call site
names only the reason and the message (`raise Fail("gpu.no-device", ...)`),
so no two places can give one reason two kinds. The codes are also a
`Literal`, so mypy refuses one that is not listed, and docs/REASONS.md's
table is this table, row for row (tests/test_reasons.py compares the two). The message stays the operator's; the reason is the machine's, and
never changes wording.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Reason = Literal[
    # the configuration: file, flags, a PrepareSpec built in code
    "config.missing",
    "config.unreadable",
    "config.invalid",
    "config.untrusted",
    "config.credentials-in-url",
    # the GPU gate
    "gpu.nvml-module-missing",
    "gpu.no-driver",
    "gpu.driver-not-loaded",
    "gpu.driver-mismatch",
    "gpu.driver-too-old",
    "gpu.driver-dir-unwritable",
    "gpu.driver-dir-untrusted",
    "gpu.no-access",
    "gpu.not-ready",
    "gpu.nvml-failed",
    "gpu.query-timeout",
    "gpu.query-failed",
    "gpu.no-device",
    "gpu.device-absent",
    "gpu.device-unhealthy",
    "gpu.unusable",
    "gpu.unhealthy",
    "gpu.fabric-not-ready",
    "gpu.masked",
    "gpu.expected-missing",
    # the dataset root
    "data.mountpoint-unusable",
    "data.identity-unreadable",
    "data.identity-unusable",
    "data.sshfs-missing",
    "data.unreachable",
    "data.host-key",
    "data.dead-mount",
    "data.root-unusable",
    "data.check-failed",
    "host.python-missing",
    # node-local directories and locks
    "dirs.no-home",
    "dirs.unwritable",
    "state.untrusted",
    "state.run-dir",
    "lock.busy",
    # Nix itself, and what a nix call said
    "nix.missing",
    "nix.too-old",
    "nix.broken",
    "nix.timeout",
    "nix.evaluation",
    "nix.fetch",
    "nix.host-key",
    "nix.bad-url",
    "nix.build-failed",
    "nix.build-killed",
    "nix.flake-build-failed",
    "nix.hash-mismatch",
    "nix.no-space",
    "nix.build-users-missing",
    "nix.build-dir",
    "nix.builds-as-root",
    "nix.daemon-unreachable",
    "nix.daemon-refused",
    "nix.store-not-writable",
    "nix.cache-untrusted",
    "nix.unknown",
    # the training source and its run manifest
    "source.unreachable",
    "source.not-published",
    "source.manifest-invalid",
    "source.digest-mismatch",
    "source.cwd-escapes",
    "source.missing",
    "source.host-key",
    "source.rsync-missing",
    "source.git-dependency",
    "source.no-cargo-lock",
    "source.unsupported-file",
    # the flake's side of the contract, and the libtorch variant
    "flake.contract-mismatch",
    "flake.contract-broken",
    "libtorch.unknown-variant",
    "libtorch.no-variant",
    "libtorch.arch-uncovered",
    "libtorch.wrong-vendor",
    # the smoke run of the built binary
    "smoke.loader",
    "smoke.timeout",
    "smoke.failed",
    "smoke.confinement",
    # fdl-prepare publish
    "publish.invalid",
    "publish.tree-unwritable",
    "publish.git-missing",
    "publish.git-timeout",
    "publish.git-failed",
    "publish.head-moved",
    "publish.push-failed",
    "publish.signing-failed",
    "publish.cache-refused",
    "publish.cache-unreachable",
]

Kind = Literal["permanent", "transient"]
# Retrying cannot help: report and stop, even under a persist loop.
PERMANENT: Kind = "permanent"
# The next attempt may work: back off and retry.
TRANSIENT: Kind = "transient"


class Row(NamedTuple):
    kind: Kind
    # As docs/REASONS.md's table says it (Markdown).
    meaning: str


REASONS: dict[Reason, Row] = {
    # the configuration: file, flags, a PrepareSpec built in code
    "config.missing": Row(
        PERMANENT, "`--config` or `$FDL_PREPARE_CONFIG` names a file that does not exist (or `--config` is empty)"
    ),
    "config.unreadable": Row(PERMANENT, "the config file is a directory or cannot be read"),
    "config.invalid": Row(
        PERMANENT,
        "a value, key, syntax or combination in the config file, the flags or a `PrepareSpec` is wrong (including `data_path`, `data_source`, `source.*`, `flake`, `libtorch` with `cpu_only`, options ssh refuses)",
    ),
    "config.untrusted": Row(
        PERMANENT,
        "run as root, the config file (or a directory above it) is writable by someone other than root, or owned by another user: it could make root run anything",
    ),
    "config.credentials-in-url": Row(
        PERMANENT,
        "a URL (`source.from`, `flake`, a substituter) carries a password or token, in its user-info or its query (`access_token=`, `token=`, `password=`, a signature), which would reach command lines and messages: use Nix's `netrc-file` or `access-tokens`",
    ),
    # the GPU gate
    "gpu.nvml-module-missing": Row(PERMANENT, "the Python module `pynvml` (`nvidia-ml-py`) is not installed"),
    "gpu.no-driver": Row(
        PERMANENT,
        "no NVIDIA driver: `libnvidia-ml.so.1` is not found, or the kernel module is loaded and the host's linker cache lists no `libnvidia-ml.so.1` or `libcuda.so.1`",
    ),
    "gpu.driver-not-loaded": Row(PERMANENT, "the NVIDIA kernel module is not loaded"),
    "gpu.driver-mismatch": Row(
        PERMANENT,
        "the user-space driver libraries and the loaded kernel module are different driver versions (reboot after an upgrade)",
    ),
    "gpu.driver-too-old": Row(PERMANENT, "the driver's NVML lacks a function `nvidia-ml-py` needs"),
    "gpu.driver-dir-unwritable": Row(
        PERMANENT,
        "the driver directory (`driver_dir`, default `/run/opengl-driver/lib`) cannot be created or written on a box that is not NixOS",
    ),
    "gpu.driver-dir-untrusted": Row(
        PERMANENT,
        "the driver directory is not one fdl-prepare may keep: a symlink, reached through one, a file, owned by another user, writable by others, or the host's own library directory; or NVML would be loaded from a place others could change",
    ),
    "gpu.no-access": Row(
        PERMANENT,
        "this user or container cannot open the GPU device nodes (`/dev/nvidia*`, `/dev/kfd`, `/dev/dri/renderD*`)",
    ),
    "gpu.not-ready": Row(
        TRANSIENT,
        "NVML says the driver, or a card the box needs, is not ready yet (early in boot, a reset in progress: NOT_READY or TIMEOUT)",
    ),
    "gpu.nvml-failed": Row(PERMANENT, "NVML failed in a way not listed here; the message has NVML's own words"),
    "gpu.query-timeout": Row(
        TRANSIENT,
        "a GPU driver did not answer the survey within `gpu_timeout` (an NVML call or an amdgpu sysfs read blocked: a card fallen off the bus, a wedged driver); the message names the call",
    ),
    "gpu.query-failed": Row(TRANSIENT, "the child process that asks the GPU drivers died or gave no answer"),
    "gpu.no-device": Row(PERMANENT, "the driver is loaded but reports no GPU"),
    "gpu.device-absent": Row(PERMANENT, "`devices` (`--devices`) names an index the box does not have"),
    "gpu.device-unhealthy": Row(
        PERMANENT,
        "a card `devices` (`--devices`) names is unusable or sick: the box stops rather than train without it",
    ),
    "gpu.unusable": Row(PERMANENT, "every GPU failed its queries (lost, broken)"),
    "gpu.unhealthy": Row(
        PERMANENT,
        "no healthy GPU is left: each is unusable, or sick (a pending row remap or page retirement, uncorrectable ECC errors, a failed NVLink fabric registration, compute mode Prohibited): reset the GPU, reboot, or replace it",
    ),
    "gpu.fabric-not-ready": Row(
        TRANSIENT,
        "no GPU is ready yet: a card's NVLink fabric is still being set up by the fabric manager (NVSwitch systems)",
    ),
    "gpu.masked": Row(
        PERMANENT,
        "the masks (`CUDA_VISIBLE_DEVICES`, `ROCR_VISIBLE_DEVICES`, `HIP_VISIBLE_DEVICES`, `devices`) leave no usable GPU",
    ),
    "gpu.expected-missing": Row(
        PERMANENT,
        "fewer healthy GPUs than `expect_gpus` (`--expect-gpus`): cards missing from the driver's list, unusable, sick or masked",
    ),
    # the dataset root
    "data.mountpoint-unusable": Row(PERMANENT, "the `data_path` mountpoint is not a directory, or cannot be created"),
    "data.identity-unreadable": Row(
        PERMANENT, "the ssh identity file for the mount (or an `rsync://` source) cannot be read"
    ),
    "data.identity-unusable": Row(
        PERMANENT,
        "ssh will not use the identity file: others can read it, or it has a passphrase and no agent holds it",
    ),
    "data.sshfs-missing": Row(PERMANENT, "`data_source` needs sshfs, which is not installed"),
    "data.unreachable": Row(
        TRANSIENT, "the sshfs mount failed or timed out (the far side is down, refused, or does not answer)"
    ),
    "data.host-key": Row(
        PERMANENT,
        "ssh refused the data host's key: none known and strict checking on, or another than `known_hosts` holds (`ssh-keyscan`, then record it)",
    ),
    "data.dead-mount": Row(TRANSIENT, "the dataset root hangs or its FUSE process is gone (a dead mount)"),
    "data.root-unusable": Row(PERMANENT, "the dataset root does not exist, is not a directory, or cannot be listed"),
    "data.check-failed": Row(TRANSIENT, "the child process that lists the dataset root failed"),
    "host.python-missing": Row(PERMANENT, "the Python interpreter cannot be started for the listing child"),
    # node-local directories and locks
    "dirs.no-home": Row(PERMANENT, "`HOME` is relative, or unset with no home in the password database"),
    "dirs.unwritable": Row(
        PERMANENT,
        "a directory this box must write (the dataset cache, the stage, the state directory, a lock's directory) is missing, not a directory, or not writable",
    ),
    "state.untrusted": Row(
        PERMANENT,
        "the state directory or an entry in it is a symlink, of the wrong type, owned by another user, or writable by others; or it is `/` or on a pseudo file system (`/proc`, `/sys`, `/dev`), or holds entries fdl-prepare did not make (its `recipe/` included)",
    ),
    "state.run-dir": Row(
        PERMANENT,
        "the run's writable project directory or the hand-off (`current/`, `prepared.json`) cannot be written in "
        "the state directory: no space, or a tree past the bounds of a project directory",
    ),
    "lock.busy": Row(TRANSIENT, "another fdl-prepare held a lock (the state lock, a mount lock) past the wait"),
    # Nix itself, and what a nix call said
    "nix.missing": Row(PERMANENT, "`nix` is not on `PATH`"),
    "nix.too-old": Row(PERMANENT, "`nix` is older than 2.8"),
    "nix.broken": Row(PERMANENT, "`nix --version` fails"),
    "nix.timeout": Row(TRANSIENT, "a nix call (or the build) ran past its time limit"),
    "nix.evaluation": Row(PERMANENT, "the flake does not evaluate (syntax, missing attribute, assertion)"),
    "nix.fetch": Row(TRANSIENT, "fetching an input of the flake failed (network, DNS, git)"),
    "nix.host-key": Row(
        PERMANENT,
        "ssh (under git) refused a git host's key: unknown to `known_hosts`, or changed (`ssh-keyscan`, then record it)",
    ),
    "nix.bad-url": Row(PERMANENT, "Nix cannot parse a URL (`source.from`, `flake`, or an input the flake declares)"),
    "nix.build-failed": Row(TRANSIENT, "the training build failed: the next publish may fix it"),
    "nix.build-killed": Row(
        TRANSIENT,
        "a build was killed by a signal from outside it (the OOM killer, an operator, a shutdown), whichever build it was",
    ),
    "nix.flake-build-failed": Row(PERMANENT, "a build the flake itself provides (libtorch, its toolchain) failed"),
    "nix.hash-mismatch": Row(PERMANENT, "a fixed-output derivation's pinned hash is wrong"),
    "nix.no-space": Row(
        PERMANENT,
        "the Nix store's disk is full, or the disk a build writes in (under `TMPDIR`; from Nix 2.30 its `build-dir`)",
    ),
    "nix.build-users-missing": Row(
        PERMANENT, "Nix's build users group does not exist (Debian's `nix-bin` without `nix-setup-systemd`)"
    ),
    "nix.build-dir": Row(
        PERMANENT,
        "Nix's build users cannot enter the directory builds run in, Nix refuses it, or every place for it has a "
        "directory above it that others can write",
    ),
    "nix.builds-as-root": Row(
        PERMANENT, "Nix would run the training build as root (fdl-prepare is root and `build-users-group` is empty)"
    ),
    "nix.daemon-unreachable": Row(TRANSIENT, "the Nix daemon's socket is missing or not answering"),
    "nix.daemon-refused": Row(PERMANENT, "the Nix daemon refuses this user"),
    "nix.store-not-writable": Row(PERMANENT, "this user cannot write the Nix store"),
    "nix.cache-untrusted": Row(PERMANENT, "the Nix daemon ignores the box's binary caches for this user"),
    "nix.unknown": Row(TRANSIENT, "nix failed without saying why, or printed nothing readable"),
    # the training source and its run manifest
    "source.unreachable": Row(
        TRANSIENT, "fetching the training source (`source.from`) failed: network, DNS, git, a ref not there yet"
    ),
    "source.not-published": Row(
        TRANSIENT,
        "the training source has no run manifest and the box declares no `bin`, or has the digest sidecar "
        "without the manifest (mid-publish): nothing is published yet",
    ),
    "source.manifest-invalid": Row(
        TRANSIENT, "the run manifest `.fdl-run.yml` cannot be read or has a bad value: the next publish fixes it"
    ),
    "source.digest-mismatch": Row(
        TRANSIENT,
        "the fetched tree does not match its manifest's digest (`.fdl-run.sha256`): fetched across a re-publish",
    ),
    "source.cwd-escapes": Row(PERMANENT, "the recipe's `cwd` leads out of the fetched source tree through a symlink"),
    "source.missing": Row(
        TRANSIENT,
        "a `file://` or `rsync://` source's directory is not there (yet): a mount coming up, a tree not yet published",
    ),
    "source.host-key": Row(
        PERMANENT, "an `rsync://` source's host has a host key ssh does not know or one other than known_hosts holds"
    ),
    "source.rsync-missing": Row(PERMANENT, "a `file://` or `rsync://` source needs rsync, which is not installed"),
    "source.git-dependency": Row(
        TRANSIENT,
        "the training source's Cargo.lock has git dependencies, which a box cannot fetch by a hash: the publisher publishes or vendors them and publishes again",
    ),
    "source.no-cargo-lock": Row(
        TRANSIENT, "the training source is a cargo project without Cargo.lock: the publisher commits it and publishes"
    ),
    "source.unsupported-file": Row(
        PERMANENT,
        "the training source holds a file Nix cannot copy into the store (a FIFO, a socket, a device node)",
    ),
    # the flake's side of the contract, and the libtorch variant
    "flake.contract-mismatch": Row(PERMANENT, "the flake speaks another contract version than this fdl-prepare"),
    "flake.contract-broken": Row(
        PERMANENT,
        "the flake's `fdl` outputs do not follow the contract (no variants, malformed metadata, no training binary)",
    ),
    "libtorch.unknown-variant": Row(PERMANENT, "`libtorch` names a variant the flake does not have"),
    "libtorch.no-variant": Row(PERMANENT, '`libtorch = "auto"` finds no variant for this box\'s cards'),
    "libtorch.arch-uncovered": Row(PERMANENT, "the chosen variant ships no kernel for an offered card"),
    "libtorch.wrong-vendor": Row(PERMANENT, "the chosen variant is for the other vendor's GPUs"),
    # the smoke run of the built binary
    "smoke.loader": Row(
        PERMANENT,
        "the smoke run's binary cannot be started: the loader cannot find a library it links (the driver's `libcuda.so.1` not in the driver directory, a library missing from the closure), or it is missing",
    ),
    "smoke.timeout": Row(TRANSIENT, "the smoke run did not finish within `smoke_timeout`"),
    "smoke.failed": Row(
        TRANSIENT,
        "the smoke run started and exited non-zero, or its arguments were more than the kernel takes (E2BIG): the training source's to fix",
    ),
    "smoke.confinement": Row(
        PERMANENT,
        "the smoke run could not be confined (a step of becoming `smoke_user` failed: fdl-prepare lacks CAP_SETUID, CAP_SETGID or CAP_SETPCAP; its own /proc and /tmp could not be mounted; or it could have reached a terminal), so the binary was not run",
    ),
    # fdl-prepare publish
    "publish.invalid": Row(
        PERMANENT,
        "a publish argument is wrong (source, `--variant`, `--to`, `--signing-key` or one others can read, `--cwd`, `--smoke`, `--arg`, the git checkout)",
    ),
    "publish.tree-unwritable": Row(PERMANENT, "the run manifest cannot be removed or written in the source tree"),
    "publish.git-missing": Row(PERMANENT, "the source is a git checkout and git is not installed"),
    "publish.git-timeout": Row(TRANSIENT, "a git command of the publish did not finish in time"),
    "publish.git-failed": Row(PERMANENT, "`git commit` of the manifest failed"),
    "publish.head-moved": Row(TRANSIENT, "the checkout's `HEAD` moved during the publish"),
    "publish.push-failed": Row(TRANSIENT, "`git push` of the manifest failed"),
    "publish.signing-failed": Row(PERMANENT, "`nix store sign` failed (the key file, or this user may not sign)"),
    "publish.cache-refused": Row(PERMANENT, "the cache refused the copy, or `--to` names no store Nix can write"),
    "publish.cache-unreachable": Row(TRANSIENT, "the cache could not be reached or the copy broke off"),
}


class Fail(Exception):
    """Preparation stopped. `message` is written for an operator: it quotes the
    bad value, names the field or flag to change, and the command that fixes it.
    `reason` is the stable code a controller acts on (docs/REASONS.md);
    the kind (`permanent`, `kind`) follows from it."""

    def __init__(self, reason: Reason, message: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"{reason!r} is not a reason of prepare.fail.REASONS")
        super().__init__(reason, message)
        self.reason: Reason = reason
        self.message = message

    @property
    def kind(self) -> Kind:
        return REASONS[self.reason].kind

    @property
    def permanent(self) -> bool:
        return self.kind == PERMANENT

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "reason": self.reason, "message": self.message}

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"Fail({self.reason!r}, {self.message!r})"
