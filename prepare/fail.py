"""Why preparation stopped, and whether trying again could help.

The permanent/transient split is the product: a persist loop or systemd's
restart loop retries a transient Fail (the far side of a mount is down, nothing
is published yet) and stops on a permanent one (no GPU, a spec that does not
parse), so a misprovisioned box stops instead of hot-looping.

A fleet controller needs more than the split to act on a box (page the
hardware team for a sick card, the platform team for a broken Nix, the
publisher for a missing run): every Fail also carries a `reason`, a stable
code chosen where the Fail is raised. The codes are a `Literal`, so mypy
refuses one that is not listed here, and README.md's "Reason codes" table
documents each with its kind (tests/test_reasons.py holds the two together
and checks that each code is raised with the kind documented). The message
stays the operator's; the reason is the machine's, and never changes wording.
"""

from __future__ import annotations

from typing import Literal

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
    "gpu.no-device",
    "gpu.device-absent",
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
    "nix.flake-build-failed",
    "nix.hash-mismatch",
    "nix.no-space",
    "nix.build-users-missing",
    "nix.build-dir",
    "nix.daemon-unreachable",
    "nix.daemon-refused",
    "nix.store-not-writable",
    "nix.cache-untrusted",
    "nix.unknown",
    # the training source and its run manifest
    "source.unreachable",
    "source.not-published",
    "source.manifest-invalid",
    "source.cwd-escapes",
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


class Fail(Exception):
    """Preparation stopped. `message` is written for an operator: it quotes the
    bad value, names the field or flag to change, and the command that fixes it.
    `reason` is the stable code a controller acts on (README: Reason codes)."""

    def __init__(self, message: str, *, permanent: bool, reason: Reason) -> None:
        super().__init__(message)
        self.message = message
        self.permanent = permanent
        self.reason: Reason = reason

    @property
    def kind(self) -> str:
        return "permanent" if self.permanent else "transient"

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "reason": self.reason, "message": self.message}

    def __repr__(self) -> str:
        return f"Fail({self.message!r}, permanent={self.permanent}, reason={self.reason!r})"


def permanent(message: str, *, reason: Reason) -> Fail:
    """Retrying cannot help: report and stop, even under a persist loop."""
    return Fail(message, permanent=True, reason=reason)


def transient(message: str, *, reason: Reason) -> Fail:
    """The next attempt may work: back off and retry."""
    return Fail(message, permanent=False, reason=reason)
