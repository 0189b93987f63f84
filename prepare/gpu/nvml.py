"""The NVIDIA survey, through NVML: every card, its health, and the
CUDA_VISIBLE_DEVICES mask, for the gate (prepare.gpu.gate) and `fdl-prepare gpus`.

NVML rather than the CUDA driver API: NVML is the driver's management library,
answers in milliseconds and creates no CUDA context, so the gate holds nothing
on the cards while the run is being prepared. This process never calls it:
`pynvml` (the `nvidia-ml-py` distribution) is imported and called only in the
query child, under a deadline (prepare.gpu.query), and what it answered is
replayed here (`Replay`) through the code that judges it; `cpu_only` never
asks at all.

A card whose queries fail is marked unusable (and noted), not fatal: the
gate's bar is any usable card. What makes NVML unusable as a whole is an
`NvmlUnusable`, a Fail naming the fix.

`CUDA_VISIBLE_DEVICES`, read as CUDA reads it: a comma-separated list of
indices, `GPU-` UUIDs (any prefix that matches exactly one card) and `MIG-`
ids; set but empty, or `-1`, means no device; parsing stops at the first
entry that is invalid (unknown index or UUID, an ambiguous prefix, anything
else), and every entry after it is ignored. The visible devices keep the
variable's order. Two readings are ours where CUDA documents nothing: a
repeated GPU stops parsing (both readings agree unless entries follow the
repeat), and surrounding spaces are ignored. Indices are NVML's, which is
PCI bus order; CUDA's default order is fastest first, so on a box with
different cards the two can disagree unless the run sets
`CUDA_DEVICE_ORDER=PCI_BUS_ID` (noted).

MIG: a `MIG-<uuid>` entry is looked up among the MIG instances NVML lists
under each card in MIG mode, and maps to its parent card: the gate's unit is
the physical card (its compute capability decides the libtorch variant), so
the parent is what gets offered, with a note that the run only gets that
instance's share. The pre-R470 form `MIG-GPU-<uuid>/<gi>/<ci>` maps to the
card named by its GPU UUID; its instance ids are not checked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from prepare.fail import Fail
from prepare.gpu.devices import Device, Gpus, cpu_only
from prepare.notes import warning

if TYPE_CHECKING:
    from prepare.gpu.health import Check

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


class NvmlUnusable(Fail):
    """NVML cannot be used at all; `said` is its own answer, short enough
    for a note on a box whose GPUs are AMD's."""

    def __init__(self, fail: Fail, said: str) -> None:
        super().__init__(fail.reason, fail.message)
        self.said = said


def _nvml_fail(err: Exception, during: str) -> NvmlUnusable:
    code = getattr(err, "value", None)
    said = f"NVML said {str(err)!r} (error {code}) {during}"
    return NvmlUnusable(_nvml_fail_message(said, code), said)


def _nvml_fail_message(said: str, code: int | None) -> Fail:
    """An NVML error that stops the whole gate, as a Fail naming the fix."""
    if code == _LIBRARY_NOT_FOUND:
        return Fail(
            "gpu.no-driver",
            "GPU gate: no NVIDIA driver is installed: the NVML library libnvidia-ml.so.1 was not found "
            f"({said}). Install the driver, which ships it (Debian: `sudo apt install nvidia-driver` "
            "from non-free; Ubuntu: `sudo ubuntu-drivers install`, or `sudo apt install nvidia-utils-<branch>` "
            f"beside the kernel module), {cpu_only()}.",
        )
    if code == _DRIVER_NOT_LOADED:
        return Fail(
            "gpu.driver-not-loaded",
            f"GPU gate: the NVIDIA kernel driver is not loaded ({said}). Load it with `sudo modprobe nvidia`; "
            "right after installing a driver, reboot. If it will not load, `sudo dmesg | grep -i nvidia` says "
            f"why (Secure Boot refusing an unsigned module is common), {cpu_only()}.",
        )
    if code == _LIB_RM_VERSION_MISMATCH:
        return Fail(
            "gpu.driver-mismatch",
            f"GPU gate: driver/library version mismatch ({said}): the user-space NVML library and the loaded "
            "kernel module come from different driver versions, which is what a driver upgrade leaves until "
            "the next boot. Reboot (or reload the modules: `sudo rmmod nvidia_uvm nvidia_drm nvidia_modeset "
            "nvidia && sudo modprobe nvidia`).",
        )
    if code == _NO_PERMISSION:
        return Fail(
            "gpu.no-access",
            f"GPU gate: no permission to use the GPUs ({said}): this user cannot open /dev/nvidia*. "
            "`ls -l /dev/nvidia*` shows the owning group; add the user to it (usually "
            "`sudo usermod -aG video $USER`, then log in again) or run the worker as a user that has it; "
            "in a container, pass the devices in (the NVIDIA container toolkit).",
        )
    if code == _FUNCTION_NOT_FOUND:
        return Fail(
            "gpu.driver-too-old",
            f"GPU gate: the installed driver's NVML lacks a function nvidia-ml-py needs ({said}): the driver "
            "is older than this nvidia-ml-py. Upgrade the NVIDIA driver, or install an nvidia-ml-py "
            "whose major version matches the driver's CUDA version.",
        )
    if code in (_NOT_READY, _TIMEOUT):
        return Fail(
            "gpu.not-ready",
            f"GPU gate: NVML is not ready yet ({said}): the driver is still coming up (early in boot, or "
            "the fabric manager has not started). The next attempt may work; if it keeps failing, see "
            "`nvidia-smi` and `systemctl status nvidia-fabricmanager`.",
        )
    return Fail(
        "gpu.nvml-failed",
        f"GPU gate: NVML failed ({said}). `nvidia-smi` shows the driver's own view of the problem; "
        f"fix the driver, {cpu_only()}.",
    )


def _device_hint(code: int | None, index: int) -> str:
    if code in (_NOT_READY, _TIMEOUT):
        return (
            "The driver says the card is not ready (still coming up, or a reset in progress): the next "
            f"attempt may find it ready; if it stays so, `nvidia-smi -q -i {index}` shows the driver's view."
        )
    if code == _GPU_IS_LOST:
        return f"A lost GPU needs a reset (`sudo nvidia-smi -r -i {index}`) or a reboot."
    if code == _NO_PERMISSION:
        return f"Check the permissions of /dev/nvidia{index}."
    return f"`nvidia-smi -q -i {index}` shows the driver's view; `sudo dmesg | grep -i xid` shows GPU faults."


def survey(env: Mapping[str, str], answers: Mapping[str, Any] | None, untrusted: Fail | None = None) -> Gpus:
    """Every NVIDIA card NVML lists, each marked usable or not with why,
    and CUDA_VISIBLE_DEVICES from `env` applied, judged from the answers
    the query child recorded (prepare.gpu.query; None: pynvml is not
    installed). Raises NvmlUnusable when NVML itself cannot be used, and
    `untrusted` when NVML had to come from a driver directory it may not
    be loaded from."""
    if answers is None or "missing" in answers:
        # A declared dependency, but a box of AMD GPUs does without it.
        raise NvmlUnusable(
            Fail(
                "gpu.nvml-module-missing",
                f"GPU gate: the Python module pynvml is missing: `pip install nvidia-ml-py`, {cpu_only()}.",
            ),
            "the Python module pynvml is missing",
        )
    pynvml = Replay(answers.get("answers") or {}, untrusted)
    try:
        pynvml.nvmlInit()
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
                warning(
                    f"{d.label()}, {d.uuid or 'UUID unknown'}, is unusable and will not be offered: "
                    f"{d.error}. {_device_hint(codes[d.index], d.index)}"
                )
            )
        elif d.problems:
            notes.append(
                warning(
                    f"{d.label()}, {d.uuid or 'UUID unknown'}, is unhealthy and will not be offered: {d.health_line()}."
                )
            )
        elif d.not_ready:
            notes.append(
                warning(
                    f"{d.label()}, {d.uuid or 'UUID unknown'}, is not ready and will not be offered: {d.health_line()}."
                )
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
        waiting = codes[0] in (_NOT_READY, _TIMEOUT)
        return Device(index, None, None, None, None, usable=False, error=errors[0], waiting=waiting), None, codes[0]
    name = ask(pynvml.nvmlDeviceGetName, handle, optional=True)
    uuid = ask(pynvml.nvmlDeviceGetUUID, handle)
    capability = ask(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    memory = ask(pynvml.nvmlDeviceGetMemoryInfo, handle, optional=True)
    checks: tuple[Check, ...] = ()
    if not errors:
        from prepare.gpu import health

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
        waiting=bool(codes) and codes[0] in (_NOT_READY, _TIMEOUT),
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
        notes.append(warning(f"could not read {what} from NVML: {err} (NVML error {getattr(err, 'value', '?')})."))
        return None


def _uses_indices(value: str | None) -> bool:
    return any(e.strip().isdigit() for e in (value or "").split(","))


def _mixed(devices: Sequence[Device]) -> bool:
    return len({(d.name, d.capability) for d in devices}) > 1


def wants_mig(env: Mapping[str, str]) -> bool:
    """Whether CUDA_VISIBLE_DEVICES names a MIG instance, so the query
    lists them (it costs NVML calls on every card in MIG mode)."""
    return any(e.strip().startswith("MIG-") for e in (env.get("CUDA_VISIBLE_DEVICES") or "").split(","))


class ReplayError(Exception):
    """An NVML error the query child recorded, as pynvml's NVMLError
    carries one: `value` the code, str() NVML's words."""

    def __init__(self, value: int | None, said: str) -> None:
        super().__init__(said)
        self.value = value
        self.said = said

    def __str__(self) -> str:
        return self.said


class Replay:
    """The pynvml calls this module and prepare.gpu.health make, answered
    from what the query child recorded (prepare.gpu._query), so the code
    that judges the answers is the same whoever made the calls. A handle is
    the child's token for it ("h2": GPU 2)."""

    NVMLError = ReplayError

    def __init__(self, answers: Mapping[str, Any], untrusted: Fail | None = None) -> None:
        self._answers = answers
        self._untrusted = untrusted

    def _get(self, *key: object) -> Any:
        name = " ".join(str(k) for k in key)
        got = self._answers.get(name)
        if not isinstance(got, dict):
            # The child asks what this code asks; a call it did not make is
            # this code's own fault, and only that card's.
            raise ReplayError(None, f"{name} was not asked of the driver")
        if "e" in got:
            code = got["e"] if isinstance(got["e"], int) else None
            raise ReplayError(code, str(got.get("s") or "Unknown Error"))
        return got.get("v")

    def nvmlInit(self) -> None:
        got = self._answers.get("nvmlInit")
        if isinstance(got, dict) and "untrusted" in got and self._untrusted is not None:
            raise self._untrusted
        self._get("nvmlInit")

    def nvmlShutdown(self) -> None:
        """The child shut NVML down itself."""

    def nvmlSystemGetDriverVersion(self) -> Any:
        return self._get("nvmlSystemGetDriverVersion")

    def nvmlSystemGetCudaDriverVersion(self) -> Any:
        return self._get("nvmlSystemGetCudaDriverVersion")

    def nvmlDeviceGetCount(self) -> Any:
        return self._get("nvmlDeviceGetCount")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self._get("nvmlDeviceGetHandleByIndex", index)

    def nvmlDeviceGetName(self, handle: str) -> Any:
        return self._get("nvmlDeviceGetName", handle)

    def nvmlDeviceGetUUID(self, handle: str) -> Any:
        return self._get("nvmlDeviceGetUUID", handle)

    def nvmlDeviceGetCudaComputeCapability(self, handle: str) -> Any:
        return self._get("nvmlDeviceGetCudaComputeCapability", handle)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        got = self._get("nvmlDeviceGetMemoryInfo", handle)
        return SimpleNamespace(total=int(got["total"]))

    def nvmlDeviceGetRemappedRows(self, handle: str) -> Any:
        return self._get("nvmlDeviceGetRemappedRows", handle)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: str) -> Any:
        return self._get("nvmlDeviceGetRetiredPagesPendingStatus", handle)

    def nvmlDeviceGetTotalEccErrors(self, handle: str, *_counter: int) -> Any:
        """Uncorrected errors, volatile counter: the one count asked."""
        return self._get("nvmlDeviceGetTotalEccErrors", handle)

    def fabric_info(self, handle: str) -> Any:
        """The NVLink fabric state and status (and NVML's words for the
        status), from the versioned call or the original one."""
        got = self._get("fabric", handle)
        return SimpleNamespace(state=int(got["state"]), status=int(got["status"]), said=got.get("said"))

    def nvmlDeviceGetComputeMode(self, handle: str) -> Any:
        return self._get("nvmlDeviceGetComputeMode", handle)

    def nvmlDeviceGetMigMode(self, handle: str) -> Any:
        return self._get("nvmlDeviceGetMigMode", handle)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: str) -> Any:
        return self._get("nvmlDeviceGetMaxMigDeviceCount", handle)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: str, slot: int) -> Any:
        return self._get("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
