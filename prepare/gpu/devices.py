"""What a GPU survey found: the cards of each vendor, their health, and
which of them a box offers to the run after the masks. prepare.gpu.nvml fills
it for NVIDIA cards, prepare.gpu.amd for AMD ones; prepare.gpu.gate decides on it."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prepare.gpu.amd import AmdDevice, AmdGpus
    from prepare.gpu.health import Check

NVIDIA = "nvidia"
AMD = "amd"

# What a message that stops the gate offers a box that should never have
# been gated: a CPU-only worker. It is a command's words, not the gate's:
# an attempt takes --cpu-only, `fdl-prepare gpus` (a health check of the
# cards) does not, and says what fits it instead (prepare.cli.app).
CPU_ONLY = "or, for a CPU-only worker, pass --cpu-only (cpu_only = true under [join])"
CPU_ONLY_ADVICE: ContextVar[str] = ContextVar("cpu_only_advice", default=CPU_ONLY)


def cpu_only() -> str:
    """The advice for a CPU-only worker, in the running command's words."""
    return CPU_ONLY_ADVICE.get()


@dataclass(frozen=True)
class Device:
    index: int
    name: str | None
    uuid: str | None
    capability: tuple[int, int] | None
    memory_total: int | None  # bytes
    usable: bool
    error: str | None  # why the device is unusable
    # What NVML says of its fitness to train (prepare.gpu.health); empty when it
    # was not read (an unusable card).
    health: tuple[Check, ...] = ()
    # The driver answered NOT_READY or TIMEOUT for it (a card still coming
    # up, a reset in progress): unusable now, and the next attempt may find
    # it ready, as the same answer at the driver's start-up is.
    waiting: bool = False

    @property
    def problems(self) -> tuple[Check, ...]:
        """What makes the card sick: a person must act before it can train."""
        return tuple(c for c in self.health if c.state == "sick")

    @property
    def not_ready(self) -> tuple[Check, ...]:
        """What the card waits for (its NVLink fabric): the next attempt may find it ready."""
        return tuple(c for c in self.health if c.state == "not-ready")

    @property
    def healthy(self) -> bool:
        """Usable, and nothing known to stop a run on it: what the gate offers."""
        return self.usable and not self.problems and not self.not_ready

    def health_line(self) -> str:
        """What is wrong with the card, for a note or a Fail; "" when nothing is."""
        return "; ".join(c.line() for c in self.problems + self.not_ready)

    @property
    def capability_label(self) -> str | None:
        return None if self.capability is None else f"{self.capability[0]}.{self.capability[1]}"

    def label(self) -> str:
        return f"GPU {self.index} ({self.name or 'name unknown'})"

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "uuid": self.uuid,
            "capability": self.capability_label,
            "memory_total": self.memory_total,
            "usable": self.usable,
            "error": self.error,
        }


@dataclass(frozen=True)
class Gpus:
    driver_version: str | None
    cuda_driver_version: tuple[int, int] | None
    # Every surveyed device, in NVML index order.
    devices: tuple[Device, ...]
    # Healthy devices (usable, nothing known to stop a run) that survive
    # CUDA_VISIBLE_DEVICES then `devices`, in CUDA_VISIBLE_DEVICES order.
    offered: tuple[Device, ...]
    # The raw CUDA_VISIBLE_DEVICES (None: unset), and the indices it leaves
    # visible in its own order (None: unset, every device visible).
    cuda_visible_devices: str | None = None
    visible: tuple[int, ...] | None = None
    # `devices` as applied by `check` (None: not applied, or not set).
    devices_mask: tuple[int, ...] | None = None
    notes: tuple[str, ...] = ()
    # The AMD GPUs (prepare.gpu.amd); None where the amdgpu driver publishes no
    # KFD topology.
    amd: AmdGpus | None = None
    # What NVML said when it could not be used on a box of AMD GPUs.
    nvidia_error: str | None = None

    @property
    def offered_indices(self) -> tuple[int, ...]:
        return tuple(d.index for d in self.offered)

    @property
    def amd_offered(self) -> tuple[AmdDevice, ...]:
        return () if self.amd is None else self.amd.offered

    @property
    def vendors_offered(self) -> tuple[str, ...]:
        return tuple(v for v, cards in ((NVIDIA, self.offered), (AMD, self.amd_offered)) if cards)

    @property
    def primary_vendor(self) -> str | None:
        """The vendor whose cards a run uses when nothing else decides: the
        only one offered, else the one with more cards (NVIDIA on a tie)."""
        if not self.vendors_offered:
            return None
        return AMD if len(self.amd_offered) > len(self.offered) else NVIDIA

    def offered_for(self, vendor: str | None) -> tuple[str | None, tuple[int, ...]]:
        """The vendor whose cards a run uses, and their indices in its
        numbering: `vendor`, the built libtorch's, when it has one; else (a
        CPU build, which leaves the cards idle but offered, or none) the
        primary vendor's, the numbering `auto` favours."""
        vendor = vendor or self.primary_vendor
        if vendor == AMD:
            return vendor, () if self.amd is None else self.amd.offered_indices
        return vendor, self.offered_indices

    def masked_by(self, index: int) -> str | None:
        """Which mask hides a device: "CUDA_VISIBLE_DEVICES", "devices", or None."""
        if self.visible is not None and index not in self.visible:
            return "CUDA_VISIBLE_DEVICES"
        if self.devices_mask is not None and index not in self.devices_mask:
            return "devices"
        return None

    def to_json(self) -> dict[str, Any]:
        offered = set(self.offered_indices)
        cuda = self.cuda_driver_version
        return {
            "driver_version": self.driver_version,
            "cuda_driver_version": None if cuda is None else f"{cuda[0]}.{cuda[1]}",
            "cuda_visible_devices": self.cuda_visible_devices,
            "devices_mask": None if self.devices_mask is None else list(self.devices_mask),
            "devices": [
                {**d.to_json(), "offered": d.index in offered, "masked_by": self.masked_by(d.index)}
                for d in self.devices
            ],
            "offered": list(self.offered_indices),
            # Beside "devices", one entry a card, so a device's own entry keeps its shape.
            "health": [
                {"index": d.index, "healthy": d.healthy, "checks": [c.to_json() for c in d.health]}
                for d in self.devices
            ],
            "nvidia_error": self.nvidia_error,
            "amd": None if self.amd is None else self.amd.to_json(),
            "notes": list(self.notes),
        }
