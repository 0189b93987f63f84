"""Step 1, the GPU gate: refuse a box that has no usable GPU, before anything
expensive happens.

The bar is *any usable device*, not *nothing to report*: a box with one broken
card beside two good ones is trainable, so a device whose queries fail is
marked unusable (and noted) instead of failing the box. What fails the box is
permanent, because no retry can fix it: no driver, a driver that is not
loaded, a user-space library that does not match the kernel module, no
permission on /dev/nvidia*, no usable device left after the masks, or
`devices` naming a card that is not there. Only NVML saying it is not ready
yet (early in boot) is transient.

NVML rather than the CUDA driver API: NVML is the driver's management library,
answers in milliseconds and creates no CUDA context, so the gate holds nothing
on the cards while the run is being prepared. `pynvml` (the `nvidia-ml-py`
distribution) is imported inside the functions that use it, so `import
prepare` and `--help` never load it, and `cpu_only` never touches it at all.

Health, not just presence: a card NVML lists and answers for can still be
unable to train (a pending row remap, uncorrectable ECC errors, an NVLink
fabric that is not up, compute mode Prohibited; prepare.health reads them).
Such a card is a note and is not offered; with no healthy card left the
gate stops (permanent), unless a card's fabric is still being set up, which
the next attempt may find done (transient).

Masks, in order:

1. `CUDA_VISIBLE_DEVICES`, read as CUDA reads it: a comma-separated list of
   indices, `GPU-` UUIDs (any prefix that matches exactly one card) and `MIG-`
   ids; set but empty, or `-1`, means no device; parsing stops at the first
   entry that is invalid (unknown index or UUID, an ambiguous prefix,
   anything else), and every entry after it is ignored. The visible devices
   keep the variable's order. Two readings are ours where CUDA documents
   nothing: a repeated GPU stops parsing (both readings agree unless
   entries follow the repeat), and surrounding spaces are ignored.
   Indices are NVML's, which is PCI bus order; CUDA's default order is
   fastest first, so on a box with different cards the two can disagree
   unless the run sets `CUDA_DEVICE_ORDER=PCI_BUS_ID` (noted).
2. `devices` (`--devices`): the NVML indices, as `nvidia-smi` and
   `fdl-prepare gpus` number them, that this box offers to the run.

AMD: the same image serves NVIDIA and AMD boxes, so the gate also surveys
the AMD GPUs the amdgpu driver publishes (prepare.amd, its masks
ROCR_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES, and its permission checks on
/dev/kfd and the render nodes). Any usable device of either vendor passes.
On a box with AMD GPUs, NVML missing or unable to reach an NVIDIA kernel
module is a note, not a failure; with no AMD GPU either, the NVIDIA messages
are what they always were. `devices` takes each vendor's own indices (NVML's
for NVIDIA, ROCm's for AMD), as each vendor's runtime numbers its cards.

MIG: a `MIG-<uuid>` entry is looked up among the MIG instances NVML lists
under each card in MIG mode, and maps to its parent card: the gate's unit is
the physical card (its compute capability decides the libtorch variant), so
the parent is what gets offered, with a note that the run only gets that
instance's share. The pre-R470 form `MIG-GPU-<uuid>/<gi>/<ci>` maps to the
card named by its GPU UUID; its instance ids are not checked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from prepare.fail import Fail, permanent, transient

if TYPE_CHECKING:
    from prepare.amd import AmdDevice, AmdGpus
    from prepare.health import Check
    from prepare.spec import PrepareSpec

NVIDIA = "nvidia"
AMD = "amd"
# prepare.driver_dir.DEFAULT, without importing it for `import prepare.gate`.
DRIVER_DIR = "/run/opengl-driver/lib"


@dataclass(frozen=True)
class Device:
    index: int
    name: str | None
    uuid: str | None
    capability: tuple[int, int] | None
    memory_total: int | None  # bytes
    usable: bool
    error: str | None  # why the device is unusable
    # What NVML says of its fitness to train (prepare.health); empty when it
    # was not read (an unusable card).
    health: tuple[Check, ...] = ()

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
    # The AMD GPUs (prepare.amd); None where the amdgpu driver publishes no
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

    def offered_indices_for(self, vendor: str | None) -> tuple[int, ...]:
        if vendor == AMD:
            return () if self.amd is None else self.amd.offered_indices
        return self.offered_indices

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


# NVML return codes this module treats specially (values from nvml.h; the
# names exist in every pynvml this package supports, but reading them off
# the module would import it at import time).
_NO_PERMISSION = 4
_NOT_SUPPORTED = 3
_DRIVER_NOT_LOADED = 9
_TIMEOUT = 10
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_LIB_RM_VERSION_MISMATCH = 18
_NOT_READY = 27

_CPU_ONLY = "or, for a CPU-only worker, pass --cpu-only (cpu_only = true under [join])"


class NvmlUnusable(Fail):
    """NVML cannot be used at all; `said` is its own answer, short enough
    for a note on a box whose GPUs are AMD's."""

    def __init__(self, fail: Fail, said: str) -> None:
        super().__init__(fail.message, permanent=fail.permanent, reason=fail.reason)
        self.said = said


def _nvml_fail(err: Exception, during: str) -> NvmlUnusable:
    code = getattr(err, "value", None)
    said = f"NVML said {str(err)!r} (error {code}) {during}"
    return NvmlUnusable(_nvml_fail_message(said, code), said)


def _nvml_fail_message(said: str, code: int | None) -> Fail:
    """An NVML error that stops the whole gate, as a Fail naming the fix."""
    if code == _LIBRARY_NOT_FOUND:
        return permanent(
            "GPU gate: no NVIDIA driver is installed: the NVML library libnvidia-ml.so.1 was not found "
            f"({said}). Install the driver, which ships it (Debian: `sudo apt install nvidia-driver` "
            "from non-free; Ubuntu: `sudo ubuntu-drivers install`, or `sudo apt install nvidia-utils-<branch>` "
            f"beside the kernel module), {_CPU_ONLY}.",
            reason="gpu.no-driver",
        )
    if code == _DRIVER_NOT_LOADED:
        return permanent(
            f"GPU gate: the NVIDIA kernel driver is not loaded ({said}). Load it with `sudo modprobe nvidia`; "
            "right after installing a driver, reboot. If it will not load, `sudo dmesg | grep -i nvidia` says "
            f"why (Secure Boot refusing an unsigned module is common), {_CPU_ONLY}.",
            reason="gpu.driver-not-loaded",
        )
    if code == _LIB_RM_VERSION_MISMATCH:
        return permanent(
            f"GPU gate: driver/library version mismatch ({said}): the user-space NVML library and the loaded "
            "kernel module come from different driver versions, which is what a driver upgrade leaves until "
            "the next boot. Reboot (or reload the modules: `sudo rmmod nvidia_uvm nvidia_drm nvidia_modeset "
            "nvidia && sudo modprobe nvidia`).",
            reason="gpu.driver-mismatch",
        )
    if code == _NO_PERMISSION:
        return permanent(
            f"GPU gate: no permission to use the GPUs ({said}): this user cannot open /dev/nvidia*. "
            "`ls -l /dev/nvidia*` shows the owning group; add the user to it (usually "
            "`sudo usermod -aG video $USER`, then log in again) or run the worker as a user that has it; "
            "in a container, pass the devices in (the NVIDIA container toolkit).",
            reason="gpu.no-access",
        )
    if code == _FUNCTION_NOT_FOUND:
        return permanent(
            f"GPU gate: the installed driver's NVML lacks a function nvidia-ml-py needs ({said}): the driver "
            "is older than this nvidia-ml-py. Upgrade the NVIDIA driver, or install an nvidia-ml-py "
            "whose major version matches the driver's CUDA version.",
            reason="gpu.driver-too-old",
        )
    if code in (_NOT_READY, _TIMEOUT):
        return transient(
            f"GPU gate: NVML is not ready yet ({said}): the driver is still coming up (early in boot, or "
            "the fabric manager has not started). The next attempt may work; if it keeps failing, see "
            "`nvidia-smi` and `systemctl status nvidia-fabricmanager`.",
            reason="gpu.not-ready",
        )
    return permanent(
        f"GPU gate: NVML failed ({said}). `nvidia-smi` shows the driver's own view of the problem; "
        f"fix the driver, {_CPU_ONLY}.",
        reason="gpu.nvml-failed",
    )


def _device_hint(code: int | None, index: int) -> str:
    if code == _GPU_IS_LOST:
        return f"A lost GPU needs a reset (`sudo nvidia-smi -r -i {index}`) or a reboot."
    if code == _NO_PERMISSION:
        return f"Check the permissions of /dev/nvidia{index}."
    return f"`nvidia-smi -q -i {index}` shows the driver's view; `sudo dmesg | grep -i xid` shows GPU faults."


def survey(env: Mapping[str, str] | None = None, *, driver_dir: str = DRIVER_DIR) -> Gpus:
    """Ask NVML about every NVIDIA device and the amdgpu driver about every
    AMD one, then apply each vendor's masks from `env` (default: this
    process's environment). Raises a Fail when NVML itself cannot be used
    and the box has no AMD GPU; a device whose queries fail is only marked
    unusable. NVML is what the loader finds, else the one in `driver_dir`
    (prepare.driver_dir), as a Nix-built program finds the driver."""
    env = os.environ if env is None else env
    from prepare import amd as amd_mod

    amd = amd_mod.survey(env)
    try:
        gpus = _survey_nvidia(env, driver_dir)
    except NvmlUnusable as fail:
        # One image serves NVIDIA and AMD boxes: on an AMD box the NVML
        # library is missing, or installed with no NVIDIA kernel module to
        # talk to. Not ready yet is another matter: the next attempt may
        # find NVIDIA cards, and auto would pick another libtorch.
        if not fail.permanent or amd is None or not amd.devices:
            raise
        note = f"NVIDIA: no usable NVML on this box of AMD GPUs ({fail.said}): only the AMD GPUs are surveyed."
        gpus = Gpus(None, None, devices=(), offered=(), nvidia_error=fail.said, notes=(note,))
    if amd is None:
        return gpus
    return replace(gpus, amd=amd, notes=gpus.notes + amd.notes)


def _survey_nvidia(env: Mapping[str, str], driver_dir: str) -> Gpus:
    try:
        import pynvml
    except ImportError:  # a declared dependency, but a box of AMD GPUs does without it
        raise NvmlUnusable(
            permanent(
                f"GPU gate: the Python module pynvml is missing: `pip install nvidia-ml-py`, {_CPU_ONLY}.",
                reason="gpu.nvml-module-missing",
            ),
            "the Python module pynvml is missing",
        ) from None

    try:
        _init(pynvml, driver_dir)
    except pynvml.NVMLError as err:
        raise _nvml_fail(err, "at nvmlInit") from None

    notes: list[str] = []
    try:
        driver = _optional(pynvml, pynvml.nvmlSystemGetDriverVersion, "the driver version", notes)
        cuda_raw = _optional(pynvml, pynvml.nvmlSystemGetCudaDriverVersion, "the driver's CUDA version", notes)
        cuda = None if cuda_raw is None else (int(cuda_raw) // 1000, (int(cuda_raw) % 1000) // 10)
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as err:
            raise _nvml_fail(err, "counting devices (nvmlDeviceGetCount)") from None
        surveyed = [_survey_device(pynvml, i) for i in range(count)]
        devices = tuple(d for d, _, _ in surveyed)
        handles = {d.index: h for d, h, _ in surveyed if h is not None}
        codes = {d.index: code for d, _, code in surveyed}

        mig: list[tuple[str, int]] | None = None

        def mig_instances() -> list[tuple[str, int]]:
            nonlocal mig
            if mig is None:
                mig = _mig_instances(pynvml, handles)
            return mig

        raw = env.get("CUDA_VISIBLE_DEVICES")
        visible, parse_notes = parse_visible_devices(raw, devices, mig_instances)
    finally:
        # Nothing useful to do if it fails: the survey already has its answers.
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()

    for d in devices:
        if not d.usable:
            notes.append(
                f"{d.label()}, {d.uuid or 'UUID unknown'}, is unusable and will not be offered: "
                f"{d.error}. {_device_hint(codes[d.index], d.index)}"
            )
        elif d.problems:
            notes.append(
                f"{d.label()}, {d.uuid or 'UUID unknown'}, is unhealthy and will not be offered: {d.health_line()}."
            )
        elif d.not_ready:
            notes.append(
                f"{d.label()}, {d.uuid or 'UUID unknown'}, is not ready and will not be offered: {d.health_line()}."
            )
    notes.extend(parse_notes)
    if visible is not None:
        hidden = [d for d in devices if d.index not in visible]
        if hidden:
            notes.append(f"CUDA_VISIBLE_DEVICES={raw!r} hides " + ", ".join(d.label() for d in hidden) + ".")
        if _uses_indices(raw) and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and _mixed(devices):
            notes.append(
                f"CUDA_VISIBLE_DEVICES={raw!r} names cards by index, read here in NVML's PCI bus order; "
                "CUDA's default order is fastest first, so on this box of different cards the run may "
                "see other cards unless it sets CUDA_DEVICE_ORDER=PCI_BUS_ID (or use GPU- UUIDs)."
            )
    order = visible if visible is not None else tuple(range(len(devices)))
    offered = tuple(devices[i] for i in order if devices[i].healthy)
    return Gpus(
        driver_version=driver,
        cuda_driver_version=cuda,
        devices=devices,
        offered=offered,
        cuda_visible_devices=raw,
        visible=visible,
        notes=tuple(notes),
    )


def check(spec: PrepareSpec, notes: list[str]) -> Gpus | None:
    """The pipeline step: survey, apply `devices`, and refuse a box that
    offers no usable GPU. Every note gathered is appended to `notes`, also
    when a Fail is raised."""
    if spec.cpu_only:
        notes.append("GPU gate skipped: cpu_only is set, so only the cpu libtorch variant can be used.")
        if spec.devices is not None:
            listed = ",".join(str(i) for i in spec.devices)
            notes.append(f"devices ({listed}) is ignored with cpu_only: no GPU is offered to the run.")
        if spec.expect_gpus is not None:
            notes.append(f"expect_gpus ({spec.expect_gpus}) is ignored with cpu_only: no GPU is checked.")
        return None

    from prepare import driver_dir

    # Before NVML: on a box that is not NixOS, this is also where a
    # Nix-built fdl-prepare finds NVML itself.
    driver_dir.ensure(spec.driver_dir, notes)
    gpus = survey(driver_dir=spec.driver_dir)
    notes.extend(gpus.notes)
    devices = gpus.devices
    amd = gpus.amd
    amd_devices = () if amd is None else amd.devices
    if not devices and not amd_devices:
        raise permanent(
            f"GPU gate: NVML reports no NVIDIA device (driver {gpus.driver_version or 'version unknown'} is "
            "loaded). `nvidia-smi -L` and `lspci | grep -i nvidia` show what the machine has; a container "
            f"needs the GPUs passed in (the NVIDIA container toolkit), {_CPU_ONLY}.",
            reason="gpu.no-device",
        )

    if spec.devices is not None:
        wanted = tuple(dict.fromkeys(spec.devices))
        amd_count = 0 if amd is None else amd.runtime_count
        absent = [i for i in wanted if not (0 <= i < len(devices) or 0 <= i < amd_count)]
        if absent and amd is None:
            raise permanent(
                f"GPU gate: devices = {list(spec.devices)} (--devices) names "
                + ", ".join(f"GPU {i}" for i in absent)
                + f", but this box has {len(devices)} device(s), indices 0-{len(devices) - 1}. Change devices in [join] "
                "(or --devices) to indices that exist; `fdl-prepare gpus` lists them.",
                reason="gpu.device-absent",
            )
        if absent:
            have = [
                f"{count} {vendor} GPU(s), indices 0-{count - 1}"
                for vendor, count in (("NVIDIA", len(devices)), ("AMD", amd_count))
                if count
            ]
            raise permanent(
                f"GPU gate: devices = {list(spec.devices)} (--devices) names "
                + ", ".join(f"GPU {i}" for i in absent)
                + f", but this box has {' and '.join(have) or 'no GPU the runtimes can see'} (each vendor numbers "
                "its own from 0, as its runtime does). Change devices in [join] (or --devices) to indices that "
                "exist; `fdl-prepare gpus` lists them.",
                reason="gpu.device-absent",
            )
        kept = tuple(d for d in gpus.offered if d.index in wanted)
        gpus = replace(gpus, offered=kept, devices_mask=wanted)
        dropped: list[str] = [d.label() for d in devices if d.usable and gpus.masked_by(d.index) == "devices"]
        if amd is not None:
            amd = amd.with_devices(wanted)
            gpus = replace(gpus, amd=amd)
            dropped += [d.label() for d in amd.devices if d.usable and amd.masked_by(d.index) == "devices"]
        if dropped:
            line = f"devices = {list(wanted)} (--devices) leaves out " + ", ".join(dropped) + "."
            notes.append(line)
            gpus = replace(gpus, notes=gpus.notes + (line,))

    usable = [d for d in devices if d.usable]
    usable_amd = [d for d in amd_devices if d.usable]
    if not usable and not usable_amd:
        nvidia_why = (
            "every device failed its queries: "
            + "; ".join(f"{d.label()}: {d.error}" for d in devices)
            + f". `nvidia-smi -q` shows the driver's view, `sudo dmesg | grep -i xid` shows GPU faults; "
            f"a lost GPU needs a reset (`sudo nvidia-smi -r`) or a reboot, {_CPU_ONLY}."
        )
        if amd is None or not amd_devices:
            raise permanent("GPU gate: no usable GPU: " + nvidia_why, reason="gpu.unusable")
        message = "GPU gate: no usable GPU: " + _no_usable_amd(amd) + "."
        if devices:
            message += " NVIDIA: " + nvidia_why
        elif gpus.nvidia_error is not None:
            message += f" No NVIDIA GPU either ({gpus.nvidia_error})."
        # A ROCm runtime that cannot open the device nodes is this user's or
        # this container's access, not the cards.
        raise permanent(message, reason="gpu.no-access" if amd.blocked is not None else "gpu.unusable")
    # Usable NVIDIA cards the masks leave, none of them healthy: what stops
    # the box is the cards' health, not the masks.
    left = [d for d in usable if gpus.masked_by(d.index) is None]
    if not gpus.offered and not gpus.amd_offered and left:
        raise _no_healthy(gpus, left)
    if not gpus.offered and not gpus.amd_offered:
        masks = []
        if gpus.cuda_visible_devices is not None and (devices or amd is None):
            masks.append(f"CUDA_VISIBLE_DEVICES={gpus.cuda_visible_devices!r}")
        if amd is not None:
            if amd.rocr_visible_devices is not None:
                masks.append(f"ROCR_VISIBLE_DEVICES={amd.rocr_visible_devices!r}")
            if amd.hip_from is not None and f"{amd.hip_from}={amd.hip_visible_devices!r}" not in masks:
                masks.append(f"{amd.hip_from}={amd.hip_visible_devices!r}")
        if gpus.devices_mask is not None:
            masks.append(f"devices = {list(gpus.devices_mask)} (--devices)")
        variables = (
            "CUDA_VISIBLE_DEVICES"
            if amd is None
            else "CUDA_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES"
        )
        from prepare.amd import labels

        raise permanent(
            "GPU gate: every usable GPU is masked: "
            + (" then ".join(masks) or "the masks")
            + " leave none of "
            + ", ".join([d.label() for d in usable] + ([labels(usable_amd)] if usable_amd else []))
            + f". Fix {variables} in the worker's environment (unset "
            + ("it" if amd is None else "them")
            + " to see every card) or devices in [join] (--devices); `fdl-prepare gpus` lists the cards and what "
            "masks them.",
            reason="gpu.masked",
        )
    if spec.expect_gpus is not None:
        _check_expected(gpus, spec.expect_gpus)
    if amd is not None:
        # The same image serves either vendor: say which cards this box offers.
        lines = [_offered_note(gpus)]
        if amd.blocked is not None and amd_devices:
            lines.insert(0, f"AMD: no AMD GPU is usable: {amd.blocked}.")
        notes.extend(lines)
        gpus = replace(gpus, notes=gpus.notes + tuple(lines))
    return gpus


def _check_expected(gpus: Gpus, expected: int) -> None:
    """`expect_gpus`: the box must offer that many healthy cards of the
    vendor its run uses. Each one short is named: missing from the driver's
    list (fallen off the bus), unusable, sick, not ready, or masked."""
    vendor = gpus.primary_vendor
    offered: tuple[int, ...]
    short: list[str] = []
    not_ready = 0
    if vendor == AMD and gpus.amd is not None:
        amd = gpus.amd
        offered = amd.offered_indices
        count, name, lister = amd.runtime_count, "AMD", "the ROCm runtime"
        for a in amd.devices:
            if a.index is not None and a.index in offered:
                continue
            why = f"unusable: {a.error}" if not a.usable else f"masked by {amd.masked_by(a.index) or 'the masks'}"
            short.append(f"{a.label()} is {why}")
    else:
        offered = gpus.offered_indices
        count, name, lister = len(gpus.devices), "NVIDIA", "NVML"
        for d in gpus.devices:
            if d.index in offered:
                continue
            if not d.usable:
                short.append(f"{d.label()} is unusable: {d.error}")
            elif d.problems or d.not_ready:
                short.append(f"{d.label()}: {d.health_line()}")
                not_ready += bool(d.not_ready and not d.problems)
            else:
                short.append(f"{d.label()} is masked by {gpus.masked_by(d.index) or 'the masks'}")
    if len(offered) >= expected:
        return
    if count < expected:
        gone = f"GPU {count}" if expected - count == 1 else f"GPUs {count}-{expected - 1}"
        short.append(
            f"{gone} {'is' if expected - count == 1 else 'are'} missing: {lister} lists {count} "
            f"{name} GPU{'s' if count != 1 else ''}"
        )
    said = (
        f"GPU gate: expect_gpus = {expected} (--expect-gpus), but this box offers {len(offered)} healthy {name} "
        f"GPU{'s' if len(offered) != 1 else ''}"
        + (f" ({', '.join(str(i) for i in offered)})" if offered else "")
        + ": "
        + "; ".join(short)
        + ". "
    )
    if len(offered) + not_ready >= expected:
        raise transient(
            said + "The cards still setting up their NVLink fabric may be ready on the next attempt, which retries.",
            reason="gpu.fabric-not-ready",
        )
    raise permanent(
        said + "A card missing from the list has usually fallen off the bus: `lspci | grep -i -e nvidia -e amd` shows "
        "what the machine has, `sudo dmesg | grep -i -e xid -e nvrm -e amdgpu` why (Xid 79: fallen off the bus); "
        "reboot, then reseat or replace it. Fix a sick card as said above, or change expect_gpus in [join] "
        "(--expect-gpus) or the masks if this box is meant to offer fewer; `fdl-prepare gpus` lists the cards.",
        reason="gpu.expected-missing",
    )


def _card_states(gpus: Gpus) -> str:
    """Each NVIDIA card and what keeps it from the run, for a Fail."""
    parts = []
    for d in gpus.devices:
        if not d.usable:
            parts.append(f"{d.label()} is unusable: {d.error}")
        elif d.problems or d.not_ready:
            parts.append(f"{d.label()}: {d.health_line()}")
        elif gpus.masked_by(d.index) is not None:
            parts.append(f"{d.label()} is healthy but masked by {gpus.masked_by(d.index)}")
        else:
            parts.append(f"{d.label()} is healthy")
    return "; ".join(parts)


def _no_healthy(gpus: Gpus, left: Sequence[Device]) -> Fail:
    """The masks leave usable cards and none is healthy. A card whose
    NVLink fabric is still being set up may be ready on the next attempt
    (transient); otherwise a person must reset, reboot or replace (permanent)."""
    if any(d.not_ready for d in left):
        return transient(
            "GPU gate: no GPU is ready to train yet: "
            + _card_states(gpus)
            + ". The next attempt retries; `nvidia-smi -q | grep -i -A3 fabric` shows each card's fabric state.",
            reason="gpu.fabric-not-ready",
        )
    return permanent(
        "GPU gate: no healthy GPU: "
        + _card_states(gpus)
        + ". `nvidia-smi -q -i <index>` shows the driver's view of a card, `sudo dmesg | grep -i xid` its faults; "
        f"{_CPU_ONLY}.",
        reason="gpu.unhealthy",
    )


def _no_usable_amd(amd: AmdGpus) -> str:
    if amd.blocked is not None:
        return amd.blocked
    return (
        "every AMD GPU is unusable: "
        + "; ".join(f"{d.label()}: {d.error}" for d in amd.devices)
        + f". `ls -l /dev/kfd /dev/dri` and `sudo dmesg | grep -i amdgpu` show what is wrong, {_CPU_ONLY}"
    )


def _offered_note(gpus: Gpus) -> str:
    parts = []
    if gpus.offered:
        parts.append("NVIDIA GPU " + ", ".join(str(i) for i in gpus.offered_indices))
    if gpus.amd_offered:
        targets = ", ".join(dict.fromkeys(d.target or "target unknown" for d in gpus.amd_offered))
        parts.append("AMD GPU " + ", ".join(str(d.index) for d in gpus.amd_offered) + f" ({targets})")
    line = "GPU gate: offering " + " and ".join(parts) + " to the run"
    if len(parts) == 2:
        return line + (
            "; one libtorch build serves one vendor's cards, so the libtorch variant decides which the run uses."
        )
    if not gpus.offered:
        return line + "; no NVIDIA GPU" + (f" ({gpus.nvidia_error})." if gpus.nvidia_error else " is offered.")
    return line + "; no AMD GPU is offered."


def format_table(gpus: Gpus) -> str:
    """The survey as aligned plain text: one row per device, its status
    saying whether it is offered, masked (and by what) or unusable (and why).
    A box with AMD GPUs gets a second table, numbered as ROCm numbers them."""
    if gpus.amd is None:
        return _nvidia_table(gpus)
    nvidia = f"NVIDIA: none ({gpus.nvidia_error})" if gpus.nvidia_error is not None else _nvidia_table(gpus)
    return nvidia + "\n\n" + _amd_table(gpus.amd)


def _aligned(head: str, rows: Sequence[tuple[str, ...]], last: str) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]) - 1)]
    lines = [head]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    lines.append(last)
    return "\n".join(lines)


def _nvidia_table(gpus: Gpus) -> str:
    cuda = gpus.cuda_driver_version
    head = (
        f"NVIDIA driver {gpus.driver_version or 'unknown'}, "
        f"CUDA {'unknown' if cuda is None else f'{cuda[0]}.{cuda[1]}'}"
    )
    if not gpus.devices:
        return f"{head}\nno NVIDIA device"
    offered = set(gpus.offered_indices)
    rows = [("IDX", "NAME", "UUID", "CC", "MEMORY", "STATUS")]
    for d in gpus.devices:
        if not d.usable:
            status = f"unusable: {d.error}"
        elif d.problems:
            status = "unhealthy, not offered: " + "; ".join(c.detail for c in d.problems)
        elif d.not_ready:
            status = "not ready, not offered: " + "; ".join(c.detail for c in d.not_ready)
        elif d.index in offered:
            status = "offered"
        else:
            status = f"masked by {gpus.masked_by(d.index) or 'the masks'}"
        rows.append(
            (str(d.index), d.name or "-", d.uuid or "-", d.capability_label or "-", _gib(d.memory_total), status)
        )
    return _aligned(head, rows, "offered: " + (", ".join(str(i) for i in gpus.offered_indices) or "none"))


def format_health(gpus: Gpus) -> str:
    """Each NVIDIA card's health checks, a line a card, with what fixes a
    sick one; "" on a box without NVIDIA cards."""
    if not gpus.devices:
        return ""
    lines = ["NVIDIA health (NVML):"]
    for d in gpus.devices:
        if not d.health:
            lines.append(f"  GPU {d.index}: not read ({d.error or 'unusable'})")
            continue
        verdict = "sick" if d.problems else "not ready" if d.not_ready else "ok"
        lines.append(f"  GPU {d.index}: {verdict}: " + "; ".join(c.detail for c in d.health))
        lines += [f"    fix ({c.name}): {c.action}" for c in d.problems + d.not_ready if c.action]
    return "\n".join(lines)


def _amd_table(amd: AmdGpus) -> str:
    head = "AMD (amdgpu KFD topology)" + (
        f", HSA_OVERRIDE_GFX_VERSION: kernels for {amd.gfx_override}" if amd.gfx_override else ""
    )
    if not amd.devices:
        return f"{head}\nno AMD GPU with compute units"
    if amd.blocked is not None:
        head += f"\nno AMD GPU is usable: {amd.blocked}"
    offered = set(amd.offered_indices)
    # IDX is ROCm's number (devices, ROCR_VISIBLE_DEVICES); RUN is the
    # device number the run sees after the masks.
    rows = [("IDX", "RUN", "NAME", "GFX", "UUID", "PCI", "MEMORY", "STATUS")]
    for d in amd.devices:
        if not d.usable:
            status = f"unusable: {d.error}"
        elif d.index in offered:
            status = "offered"
        else:
            status = f"masked by {amd.masked_by(d.index) or 'the masks'}"
        run = amd.run_index(d.index) if d.index in offered else None
        gfx = d.gfx or "-"
        if d.target is not None and d.target != d.gfx:
            gfx = f"{gfx}->{d.target}"
        rows.append(
            (
                "-" if d.index is None else str(d.index),
                "-" if run is None else str(run),
                d.name or "-",
                gfx,
                d.uuid or "-",
                d.pci or "-",
                _gib(d.memory_total),
                status,
            )
        )
    return _aligned(head, rows, "offered (AMD): " + (", ".join(str(i) for i in amd.offered_indices) or "none"))


def _gib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**30:.1f} GiB"


def parse_visible_devices(
    value: str | None,
    devices: Sequence[Device],
    mig_instances: Callable[[], Sequence[tuple[str, int]]] = lambda: (),
) -> tuple[tuple[int, ...] | None, list[str]]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: the visible NVML indices in the
    variable's order (None when it is unset), and notes on what was ignored.
    `mig_instances` lists (MIG UUID, parent index) pairs; it is only called
    when an entry is a MIG id, since listing them costs NVML calls."""
    if value is None:
        return None, []
    notes: list[str] = []
    if value.strip() == "":
        notes.append("CUDA_VISIBLE_DEVICES is set and empty: CUDA sees no device.")
        return (), notes
    visible: list[int] = []
    for position, raw in enumerate(value.split(",")):
        entry = raw.strip()
        index, why = _resolve_entry(entry, devices, mig_instances)
        if index is not None and entry.startswith("MIG-"):
            notes.append(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} is a MIG instance of {devices[index].label()}: "
                "the gate offers that card, and the run gets only the instance's share of its memory "
                "and multiprocessors."
            )
            if index not in visible:
                visible.append(index)
            continue
        if index is not None and index in visible:
            index, why = None, f"it repeats GPU {index}"
        if index is None:
            if position == 0 and entry == "-1":
                notes.append("CUDA_VISIBLE_DEVICES=-1: CUDA sees no device.")
            else:
                notes.append(
                    f"CUDA_VISIBLE_DEVICES={value!r}: parsing stops at {entry!r} ({why}); as in CUDA, it "
                    "and every entry after it are ignored."
                )
            break
        visible.append(index)
    return tuple(visible), notes


def _resolve_entry(
    entry: str, devices: Sequence[Device], mig_instances: Callable[[], Sequence[tuple[str, int]]]
) -> tuple[int | None, str]:
    if entry == "":
        return None, "an empty entry"
    if entry.isdigit() and entry.isascii():
        n = int(entry)
        if n < len(devices):
            return n, ""
        return None, f"there is no GPU {n} on this box of {len(devices)}"
    if entry.startswith("-") and entry[1:].isdigit():
        return None, "a negative index"
    if entry.startswith("GPU-"):
        return _by_prefix(entry, [(d.uuid, d.index) for d in devices if d.uuid], "GPU")
    if entry.startswith("MIG-"):
        rest = entry[len("MIG-") :]
        if rest.startswith("GPU-"):
            parts = rest.split("/")
            if len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
                return None, "a pre-R470 MIG id must be MIG-GPU-<uuid>/<gpu instance>/<compute instance>"
            return _by_prefix(parts[0], [(d.uuid, d.index) for d in devices if d.uuid], "GPU")
        return _by_prefix(entry, list(mig_instances()), "MIG instance")
    return None, "not an index, a GPU- UUID or a MIG- id"


def _by_prefix(prefix: str, candidates: Sequence[tuple[str, int]], what: str) -> tuple[int | None, str]:
    exact = [index for uuid, index in candidates if uuid == prefix]
    if exact:
        return exact[0], ""
    matches = [index for uuid, index in candidates if uuid.startswith(prefix)]
    if len(matches) == 1:
        return matches[0], ""
    if not matches:
        return None, f"no {what} has a UUID starting with it"
    return None, "it is ambiguous, matching " + ", ".join(f"GPU {i}" for i in matches) + ": give more of the UUID"


def _init(pynvml: Any, driver_dir: str) -> None:
    """nvmlInit, with NVML from the driver directory when the loader finds
    none: a pip-installed fdl-prepare gets the host's through its linker
    cache, a Nix-built one (whose glibc never reads that cache) through the
    directory, as every other Nix-built program does."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        if getattr(err, "value", None) != _LIBRARY_NOT_FOUND:
            raise
        from prepare import driver_dir as driver_dir_mod

        if not driver_dir_mod.preload_nvml(driver_dir):
            raise
        pynvml.nvmlInit()


def _survey_device(pynvml: Any, index: int) -> tuple[Device, Any, int | None]:
    """One device: every query is tried, the first failure that matters is
    kept as the reason the device is unusable. A name or memory size the
    part does not report (NOT_SUPPORTED: integrated and unified-memory
    parts) is unknown, not broken."""
    errors: list[str] = []
    codes: list[int | None] = []

    def ask(call: Callable[..., Any], *args: Any, optional: bool = False) -> Any:
        try:
            return call(*args)
        except pynvml.NVMLError as err:
            if not (optional and getattr(err, "value", None) == _NOT_SUPPORTED):
                errors.append(f"{call.__name__}: {err} (NVML error {getattr(err, 'value', '?')})")
                codes.append(getattr(err, "value", None))
            return None

    handle = ask(pynvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        return Device(index, None, None, None, None, usable=False, error=errors[0]), None, codes[0]
    name = ask(pynvml.nvmlDeviceGetName, handle, optional=True)
    uuid = ask(pynvml.nvmlDeviceGetUUID, handle)
    capability = ask(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    memory = ask(pynvml.nvmlDeviceGetMemoryInfo, handle, optional=True)
    checks: tuple[Check, ...] = ()
    if not errors:
        from prepare import health

        try:
            checks = health.read(pynvml, handle, index)
        except health.Lost as lost:
            errors.append(f"reading its health: {lost.said}")
            codes.append(_GPU_IS_LOST)
    device = Device(
        index=index,
        name=name,
        uuid=uuid,
        capability=None if capability is None else (int(capability[0]), int(capability[1])),
        memory_total=None if memory is None else int(memory.total),
        usable=not errors,
        error=errors[0] if errors else None,
        health=checks,
    )
    return device, handle, (codes[0] if codes else None)


def _mig_instances(pynvml: Any, handles: Mapping[int, Any]) -> list[tuple[str, int]]:
    """(MIG UUID, parent index) for every instance of every card in MIG mode.
    A card that does not support MIG answers NOT_SUPPORTED; a card whose MIG
    queries fail simply contributes no instances, and a MIG- entry naming
    one of its instances then stops parsing like any unknown id."""
    found: list[tuple[str, int]] = []
    for index, handle in sorted(handles.items()):
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
            if current != 1:
                continue
            slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        except pynvml.NVMLError:
            continue
        for slot in range(slots):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                found.append((pynvml.nvmlDeviceGetUUID(mig), index))
            except pynvml.NVMLError:
                continue  # an empty slot (NOT_FOUND)
    return found


def _optional(pynvml: Any, call: Callable[[], Any], what: str, notes: list[str]) -> Any:
    try:
        return call()
    except pynvml.NVMLError as err:
        notes.append(f"could not read {what} from NVML: {err} (NVML error {getattr(err, 'value', '?')}).")
        return None


def _uses_indices(value: str | None) -> bool:
    return any(e.strip().isdigit() for e in (value or "").split(","))


def _mixed(devices: Sequence[Device]) -> bool:
    return len({(d.name, d.capability) for d in devices}) > 1
