"""Asking the GPU drivers, without hanging on them.

A card that fell off the bus, or a driver in a bad state, can leave an NVML
call or a read of the amdgpu driver's sysfs files blocked for good, and with
it `fdl-prepare gpus` (a Slurm or NHC health check that then gives no
verdict) and every attempt. So neither this process nor a thread of it ever
calls the drivers: one child process (`prepare/gpu/_query.py`) makes every
call of the survey, both vendors', under a deadline, and hands back the
answers; prepare.gpu.nvml and prepare.gpu.amd replay them through the same
code that judged live answers. One child for the whole survey, started with
`-I -S` and importing only pynvml: the warm path pays one Python start
(bench/gpu_query.py measures it). A driver that does not answer within the
deadline is `gpu.query-timeout`, transient: the next attempt asks again.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prepare.fail import Fail
from prepare.host import proc

# How long the drivers get to answer the whole survey. NVML's first call
# initialises every card when no persistence daemon holds them (seconds on a
# box of eight), so this is generous; a Slurm or NHC check that must answer
# sooner sets `gpu_timeout`.
QUERY_TIMEOUT_S = 30.0
# How much longer than the deadline the child may take to start, answer
# and exit before it is killed itself: it only waits, so this bounds a box
# too loaded to start Python.
CHILD_GRACE_S = 10.0

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_query.py")
# The child's answer is kilobytes; more is not an answer.
_MAX_ANSWER = 8 << 20


@dataclass(frozen=True)
class Answers:
    """What the drivers answered. `amd`: every sysfs read and open
    prepare.gpu.amd makes, keyed "<op> <path>" (None: not asked). `nvml`:
    every NVML call keyed by call and arguments (None: pynvml is not
    installed, so nothing was asked; {"missing": why} where the child could
    not import it). `preload`: the Fail loading NVML from the driver
    directory would be, when the child found it had to and may not."""

    amd: Mapping[str, Any] | None
    nvml: Mapping[str, Any] | None
    preload: Fail | None = None


def ask(
    *, amd: dict[str, str] | None, driver_dir: str | None, mig: bool, timeout: float, nvml_path: str | None = None
) -> Answers:
    """Every call of one survey, in one child, within `timeout` seconds.
    `amd`: the paths prepare.gpu.amd reads (None: ask nothing of AMD);
    `driver_dir`: ask NVML, with the driver directory's NVML as the
    fallback (None: ask nothing of NVIDIA), or `nvml_path` (already judged
    trustworthy) in its stead; `mig`: list MIG instances too.
    Raises a Fail (transient) when the drivers do not answer in time or
    the child fails."""
    request: dict[str, Any] = {"limit": float(timeout), "amd": amd, "nvml": None}
    preload_fail: Fail | None = None
    if driver_dir is not None:
        spec = importlib.util.find_spec("pynvml")
        if spec is not None and spec.origin:
            from prepare.gpu.driver_dir import nvml_in

            path, preload_fail = (nvml_path, None) if nvml_path is not None else nvml_in(driver_dir)
            request["nvml"] = {
                "pynvml_dir": os.path.dirname(spec.origin),
                "preload": path,
                "preload_trusted": preload_fail is None,
                "mig": mig,
            }
    if amd is None and request["nvml"] is None:
        return Answers(None, None)
    python = sys.executable or "python3"
    try:
        done = proc.run(
            [python, "-I", "-S", SCRIPT],
            timeout=timeout + CHILD_GRACE_S,
            cwd="/",
            stdin=json.dumps(request),
            max_stdout=_MAX_ANSWER,
        )
    except proc.TimedOut:
        raise _timeout(timeout, None) from None
    except proc.Missing:
        raise Fail(
            "host.python-missing",
            f"GPU gate: cannot ask the GPU drivers: the Python interpreter {python!r} is not runnable",
        ) from None
    except proc.ExecFailed as failed:
        raise _failed(f"the query process could not be started ({failed})") from None
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        said = (done.stderr or done.stdout).strip()[-500:]
        raise _failed(f"the query process exited {done.returncode} without an answer: {said!r}")
    if "timeout" in answer:
        raise _timeout(timeout, str(answer["timeout"]))
    if "died" in answer:
        raise _failed(f"the query process's worker died ({answer['died']}) during {_words(str(answer.get('call')))}")
    record = answer.get("done")
    if not isinstance(record, dict) or "crashed" in record:
        crashed = record.get("crashed") if isinstance(record, dict) else record
        raise _failed(f"the query process failed: {str(crashed)[:500]}")
    nvml = record.get("nvml")
    return Answers(record.get("amd"), nvml if request["nvml"] is not None else None, preload_fail)


def _timeout(timeout: float, call: str | None) -> Fail:
    what = "the query process did not answer" if call is None else f"{_words(call)} never returned"
    return Fail(
        "gpu.query-timeout",
        f"GPU gate: the GPU driver did not answer within {timeout:g}s ({what}): a card that fell off the bus "
        "or a driver in a bad state does this. The query was stopped and the next attempt asks again; "
        "`sudo dmesg | grep -i -e xid -e nvrm -e amdgpu` shows the driver's view (Xid 79: a card fell off the "
        "bus). If it persists, reboot the box, then reseat or replace the card; gpu_timeout (--gpu-timeout) "
        "sets the deadline.",
    )


def _failed(why: str) -> Fail:
    return Fail(
        "gpu.query-failed",
        f"GPU gate: asking the GPU drivers failed: {why}. The next attempt asks again; if it keeps failing, "
        "`nvidia-smi` or `sudo dmesg | grep -i -e nvrm -e amdgpu` shows the driver's view.",
    )


def _words(call: str) -> str:
    """A recorded call as a message names it: `nvmlDeviceGetName h3` is
    nvmlDeviceGetName on GPU 3, `read PATH` reading PATH."""
    verb, _, rest = call.partition(" ")
    if verb in ("read", "open", "listdir", "exists"):
        return {"read": "reading", "open": "opening", "listdir": "listing", "exists": "looking for"}[verb] + f" {rest}"
    args = rest.split()
    if verb == "nvmlDeviceGetHandleByIndex" and args:
        return f"{verb} for GPU {args[0]}"
    if args and args[0].startswith("h"):
        card, _, mig = args[0][1:].partition("m")
        return f"{verb} on GPU {card}" + (f" (MIG slot {mig})" if mig else "")
    return call


class Recorded:
    """The sysfs and device files prepare.gpu.amd reads, answered from what
    the child recorded: each raises the OSError the child met."""

    def __init__(self, ops: Mapping[str, Any]) -> None:
        self._ops = ops

    def _get(self, op: str, path: str) -> Any:
        got = self._ops.get(f"{op} {path}")
        if not isinstance(got, dict):
            raise OSError(errno.EIO, "not read by the query process")
        if "e" in got:
            code = got["e"] if isinstance(got["e"], int) else errno.EIO
            raise OSError(code, str(got.get("s") or os.strerror(code)))
        return got.get("v")

    def listdir(self, path: str) -> list[str]:
        return [str(e) for e in self._get("listdir", path) or []]

    def read(self, path: str) -> str:
        return str(self._get("read", path) or "")

    def try_open(self, path: str) -> OSError | None:
        try:
            self._get("open", path)
        except OSError as err:
            return err
        return None

    def exists(self, path: str) -> bool:
        try:
            return bool(self._get("exists", path))
        except OSError:
            return False
