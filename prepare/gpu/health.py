"""Whether an NVIDIA card that NVML lists can train: health, not just presence.

A card can enumerate, answer every query the survey makes, and still fail
the first CUDA call of a run. What NVML can tell beforehand, per card:

- **Row remapping** (Ampere and later): a remap pending since an
  uncorrectable memory error is applied only by a GPU reset, and until then
  the bad row is still in use; a remapping that failed means the card is out
  of spare rows. `nvmlDeviceGetRemappedRows`.
- **Retired pages** (the same for Volta and older, which retire pages
  instead): pages pending retirement are retired at the next reset.
  `nvmlDeviceGetRetiredPagesPendingStatus`.
- **Uncorrectable ECC errors** since the driver loaded (the volatile
  counter; a reset or reboot clears it): the card's memory returned bad data
  and CUDA contexts on it were lost. `nvmlDeviceGetTotalEccErrors`.
- **The NVLink fabric** on NVSwitch systems (HGX H100/H200, GB200): until
  the fabric manager has registered a card, CUDA refuses it
  (`cudaErrorSystemNotReady`). Still being set up is worth another attempt
  (the fabric manager trains NVLink at boot); set up with an error is not.
  `nvmlDeviceGetGpuFabricInfoV`, else the older `nvmlDeviceGetGpuFabricInfo`.

The calls are made by the query child (prepare.gpu.query), under a deadline;
`read` judges its answers, replayed through prepare.gpu.nvml.Replay.
- **Compute mode** `Prohibited`: no process may create a CUDA context.
  `nvmlDeviceGetComputeMode`.

Many parts answer a query with NVML_ERROR_NOT_SUPPORTED (GeForce cards have
no ECC, pre-Ampere cards no row remapper, PCIe cards no fabric), and an older
driver may lack a function (FUNCTION_NOT_FOUND): that is *unknown*, never
sick. Only a lost GPU (GPU_IS_LOST) makes the card unusable, as any other
query failing that way does in the survey; another error reading one of
these leaves that check unknown rather than dropping a card on a doubt.

These are a handful of NVML calls per card, microseconds each: the gate
stays as cheap as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

# nvml.h values (see prepare.gpu.nvml for why they are not read off pynvml).
_NOT_SUPPORTED = 3
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_ARGUMENT_VERSION_MISMATCH = 25
_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_VOLATILE_ECC = 0
_FEATURE_ENABLED = 1
_COMPUTEMODE_PROHIBITED = 2
_COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
_FABRIC_NOT_SUPPORTED = 0
_FABRIC_NOT_STARTED = 1
_FABRIC_IN_PROGRESS = 2
_FABRIC_COMPLETED = 3

State = Literal["ok", "sick", "not-ready", "unknown"]


@dataclass(frozen=True)
class Check:
    """One health check of one card: `state` ok, sick (not offered; needs a
    person), not-ready (not offered; the next attempt may find it ready) or
    unknown (the card or driver does not report it: offered)."""

    name: str
    state: State
    detail: str
    # What fixes it, for sick and not-ready.
    action: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"check": self.name, "state": self.state, "detail": self.detail, "action": self.action}

    def line(self) -> str:
        return f"{self.detail}: {self.action}" if self.action else self.detail


class Lost(Exception):
    """The GPU fell off the bus while its health was read."""

    def __init__(self, said: str) -> None:
        super().__init__(said)
        self.said = said


def _reset(index: int) -> str:
    return f"reset the GPU (`sudo nvidia-smi -r -i {index}`, with nothing running on it) or reboot the box"


def read(pynvml: Any, handle: Any, index: int) -> tuple[Check, ...]:
    """Every check of one card, in a fixed order. Raises Lost when NVML says
    the GPU is lost: the survey marks such a card unusable."""

    def ask(name: str, call: Callable[[], Any]) -> tuple[Any, Check | None]:
        """The answer, or the check as unknown (with why) when there is none."""
        try:
            return call(), None
        except pynvml.NVMLError as err:
            code = getattr(err, "value", None)
            said = f"{err} (NVML error {code})"
            if code == _GPU_IS_LOST:
                raise Lost(said) from None
            if code in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                return None, Check(name, "unknown", f"{name}: not reported by this card or driver")
            return None, Check(name, "unknown", f"{name}: could not be read ({said})")

    return (
        _remapped_rows(ask, pynvml, handle, index),
        _retired_pages(ask, pynvml, handle, index),
        _ecc(ask, pynvml, handle, index),
        _fabric(ask, pynvml, handle, index),
        _compute_mode(ask, pynvml, handle, index),
    )


Ask = Callable[[str, Callable[[], Any]], tuple[Any, "Check | None"]]


def _remapped_rows(ask: Ask, pynvml: Any, handle: Any, index: int) -> Check:
    name = "row remapping"
    got, unknown = ask(name, lambda: pynvml.nvmlDeviceGetRemappedRows(handle))
    if unknown is not None:
        return unknown
    corrected, uncorrected, pending, failed = (int(v) for v in got)
    if failed:
        return Check(
            name,
            "sick",
            f"row remapping failed ({uncorrected} rows remapped for uncorrectable errors, {corrected} for "
            "correctable ones): the card has no spare rows left for its bad memory",
            "replace the card (NVIDIA treats a row-remapping failure as grounds for RMA)",
        )
    if pending:
        return Check(
            name,
            "sick",
            f"a row remap is pending ({uncorrected} rows remapped for uncorrectable errors, {corrected} for "
            "correctable ones): the bad row stays in use until the GPU is reset",
            _reset(index),
        )
    return Check(name, "ok", f"no row remap pending ({uncorrected + corrected} rows remapped)")


def _retired_pages(ask: Ask, pynvml: Any, handle: Any, index: int) -> Check:
    name = "retired pages"
    got, unknown = ask(name, lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
    if unknown is not None:
        return unknown
    if int(got) == _FEATURE_ENABLED:
        return Check(
            name,
            "sick",
            "memory pages are pending retirement: they stay in use until the GPU is reset",
            _reset(index) + "; if pages keep being retired, replace the card",
        )
    return Check(name, "ok", "no page pending retirement")


def _ecc(ask: Ask, pynvml: Any, handle: Any, index: int) -> Check:
    name = "ECC"
    got, unknown = ask(
        name, lambda: pynvml.nvmlDeviceGetTotalEccErrors(handle, _MEMORY_ERROR_TYPE_UNCORRECTED, _VOLATILE_ECC)
    )
    if unknown is not None:
        return unknown
    count = int(got)
    if count:
        return Check(
            name,
            "sick",
            f"{count} uncorrectable ECC error{'s' if count != 1 else ''} since the driver loaded: the card's "
            "memory returned bad data",
            _reset(index) + "; if they come back, replace the card",
        )
    return Check(name, "ok", "no uncorrectable ECC error since the driver loaded")


def _fabric(ask: Ask, pynvml: Any, handle: Any, index: int) -> Check:
    name = "fabric"
    # The versioned call where the driver and pynvml have it, else the
    # original one (prepare.gpu._query makes them).
    info, unknown = ask(name, lambda: pynvml.fabric_info(handle))
    if unknown is not None:
        return unknown
    # nvml.h declares the state one byte wide; pynvml reads it as a c_uint,
    # whose other three bytes are the struct's padding, which a driver need
    # not zero.
    state = int(info.state) & 0xFF
    status = int(info.status)
    fm = "`systemctl status nvidia-fabricmanager` and `journalctl -u nvidia-fabricmanager` say why"
    if state == _FABRIC_NOT_SUPPORTED:
        return Check(name, "ok", "not part of an NVLink fabric")
    if state in (_FABRIC_NOT_STARTED, _FABRIC_IN_PROGRESS):
        started = "has not started" if state == _FABRIC_NOT_STARTED else "is in progress"
        return Check(
            name,
            "not-ready",
            f"NVLink fabric registration {started}: CUDA refuses the card until the fabric manager has registered it",
            "wait for nvidia-fabricmanager (it trains NVLink at boot); the next attempt may find it ready. If it "
            f"stays so, {fm}; it must be installed and running, at the driver's own version",
        )
    if state == _FABRIC_COMPLETED and status != 0:
        said = "unknown" if info.said is None else repr(str(info.said))
        return Check(
            name,
            "sick",
            f"NVLink fabric registration failed (NVML status {said}, error {status})",
            f"{fm}; restart it (`sudo systemctl restart nvidia-fabricmanager`), or reboot the box",
        )
    if state == _FABRIC_COMPLETED:
        return Check(name, "ok", "NVLink fabric registered")
    return Check(name, "unknown", f"fabric state {state} is not one this fdl-prepare knows")


def _compute_mode(ask: Ask, pynvml: Any, handle: Any, index: int) -> Check:
    name = "compute mode"
    got, unknown = ask(name, lambda: pynvml.nvmlDeviceGetComputeMode(handle))
    if unknown is not None:
        return unknown
    mode = int(got)
    label = _COMPUTE_MODES.get(mode, str(mode))
    if mode == _COMPUTEMODE_PROHIBITED:
        return Check(
            name,
            "sick",
            "compute mode is Prohibited: no process may create a CUDA context on it",
            f"`sudo nvidia-smi -i {index} -c DEFAULT` (a setting someone made; it does not survive a reboot "
            "unless something sets it again)",
        )
    return Check(name, "ok", f"compute mode {label}")
