"""The child that asks the GPU drivers for `prepare.gpu.query`, bounded.

Run as a script (`python -I -S _query.py`), never imported for its work:
`-I -S` keep the package, the cwd and site-packages off its path, so it
starts with the standard library and imports only pynvml, from the one
directory the parent found it in. The request comes on stdin as one JSON
object; the answer goes to stdout as one JSON line.

A card that fell off the bus can leave an NVML call (or a read of the
amdgpu driver's sysfs files) blocked in the kernel, where even SIGKILL
waits until the call returns. So, as `prepare/data/_list_root.py` does for
a dead mount, this process does not ask the drivers itself: it forks a
worker that does, and waits for it at most the request's `limit`. The
worker says which call it is about to make before each one, so a call that
never returns is named. Past the limit this process SIGKILLs the worker,
reaps it if it died (a worker in user space does at once), and answers
`{"timeout": CALL}` on time either way; a worker wedged in the kernel dies
when its call returns, an orphan that holds nothing of the parent's.

The worker records answers, not meanings: every call it made, keyed by the
call and its arguments, with the value or the error the driver gave. The
parent replays them through its own code (prepare.gpu.nvml, prepare.gpu.amd),
which makes every decision; so this script asks exactly what that code
will ask, in the same order, and no more.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import sys
import time
from typing import Any, NoReturn

# nvml.h return codes the worker acts on.
_NOT_SUPPORTED = 3
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_ARGUMENT_VERSION_MISMATCH = 25

# What the worker may say before the parent stops listening: its record is
# kilobytes; a driver answering megabytes of text is not one to believe.
_MAX_LINE = 4 << 20
# How long a SIGKILLed worker gets to be reaped before this process leaves
# it to init (a worker wedged in the kernel).
_REAP_S = 0.5


def main() -> None:
    request = json.loads(sys.stdin.read(_MAX_LINE))
    limit = float(request["limit"])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _work(request, w)
    os.close(w)
    answer = _listen(r, pid, time.monotonic() + limit)
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def _listen(r: int, pid: int, deadline: float) -> dict[str, Any]:
    """The worker's record, or what became of it."""
    pending = b""
    call = "starting"
    while True:
        left = deadline - time.monotonic()
        ready = select.select([r], [], [], left)[0] if left > 0 else []
        if not ready:
            _kill(pid)
            return {"timeout": call}
        chunk = os.read(r, 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            text = line.decode("utf-8", "replace")
            if text.startswith("> "):
                call = text[2:]
            elif text.startswith("= "):
                os.waitpid(pid, 0)
                record: dict[str, Any] = json.loads(text[2:])
                return {"done": record}
        if len(pending) > _MAX_LINE:
            _kill(pid)
            return {"died": "it wrote more than the record can hold", "call": call}
    _, status = os.waitpid(pid, 0)
    how = f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    return {"died": how, "call": call}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    until = time.monotonic() + _REAP_S
    while time.monotonic() < until:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.01)


def _work(request: dict[str, Any], w: int) -> NoReturn:
    """The worker: the only process that calls into the drivers."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    out = os.fdopen(w, "w", encoding="utf-8", errors="replace")

    def say(call: str) -> None:
        out.write(f"> {call}\n")
        out.flush()

    record: dict[str, Any] = {"amd": None, "nvml": None}
    try:
        if request.get("amd") is not None:
            record["amd"] = _amd(request["amd"], say)
        if request.get("nvml") is not None:
            record["nvml"] = _nvml(request["nvml"], say)
    except BaseException as err:  # noqa: BLE001 - the parent is told, whatever it was
        record = {"crashed": f"{type(err).__name__}: {err}"}
    out.write("= " + json.dumps(record) + "\n")
    out.flush()
    os._exit(0)


# --- AMD: the files prepare.gpu.amd reads, recorded ------------------------


def _amd(paths: dict[str, str], say: Any) -> dict[str, Any]:
    ops: dict[str, Any] = {}

    def record(op: str, path: str, action: Any) -> Any:
        say(f"{op} {path}")
        try:
            value = action(path)
        except OSError as err:
            ops[f"{op} {path}"] = {"e": err.errno or errno.EIO, "s": err.strerror or str(err)}
            return None
        ops[f"{op} {path}"] = {"v": value}
        return value

    topology, drm, kfd, render = paths["topology"], paths["drm"], paths["kfd"], paths["render"]
    entries = record("listdir", topology, os.listdir)
    if entries is None:
        return {"ops": ops}
    any_gpu = False
    for node in sorted(int(e) for e in entries if e.isdigit()):
        text = record("read", f"{topology}/{node}/properties", _read)
        if text is None:
            continue
        props = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                props[parts[0]] = int(parts[1])
        if props.get("simd_count", 0) <= 0:
            continue
        minor = props.get("drm_render_minor") or None
        if minor is None:
            continue
        record("read", f"{drm}/renderD{minor}/device/product_name", _read)
        record("read", f"{drm}/renderD{minor}/device/mem_info_vram_total", _read)
        node_path = render.format(minor=minor)
        record("open", node_path, _open)
        record("exists", f"{drm}/renderD{minor}", os.path.exists)
        any_gpu = True
    if any_gpu:
        record("open", kfd, _open)
    return {"ops": ops}


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read(1 << 16)


def _open(path: str) -> None:
    """Open read-write and close: the ROCm runtime's own first contact."""
    os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))


# --- NVIDIA: the NVML calls prepare.gpu.nvml and prepare.gpu.health make -----


def _nvml(request: dict[str, Any], say: Any) -> dict[str, Any]:
    sys.path.insert(0, request["pynvml_dir"])
    try:
        import pynvml
    except ImportError as err:
        return {"missing": str(err)}
    answers: dict[str, Any] = {}
    handles: dict[str, Any] = {}

    def ask(key: str, call: Any, *args: Any, token: str | None = None) -> tuple[bool, Any]:
        """Make one call and record its answer; a handle is recorded as
        `token`, the name the parent's replay gives it."""
        say(key)
        try:
            value = call(*args)
        except pynvml.NVMLError as err:
            answers[key] = {"e": getattr(err, "value", None), "s": str(err)}
            return False, None
        if isinstance(value, bytes):  # an older pynvml's strings
            value = value.decode("utf-8", "replace")
        answers[key] = {"v": token if token is not None else value}
        return True, value

    def code(key: str) -> int | None:
        got = answers.get(key, {})
        return got.get("e") if isinstance(got, dict) else None

    if not _init(pynvml, request, answers, say):
        return {"answers": answers}
    try:
        ask("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion)
        ask("nvmlSystemGetCudaDriverVersion", pynvml.nvmlSystemGetCudaDriverVersion)
        ok, count = ask("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)
        if not ok:
            return {"answers": answers}
        for i in range(int(count)):
            ok, h = ask(f"nvmlDeviceGetHandleByIndex {i}", pynvml.nvmlDeviceGetHandleByIndex, i, token=f"h{i}")
            if not ok:
                continue
            handles[f"h{i}"] = h
            # The rule prepare.gpu.nvml._survey_device applies: health is
            # read only of a card whose identity queries all answered.
            failed = False
            for name, call, optional in (
                ("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, True),
                ("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, False),
                ("nvmlDeviceGetCudaComputeCapability", pynvml.nvmlDeviceGetCudaComputeCapability, False),
                ("nvmlDeviceGetMemoryInfo", lambda x: {"total": int(pynvml.nvmlDeviceGetMemoryInfo(x).total)}, True),
            ):
                ok, _ = ask(f"{name} h{i}", call, h)
                if not ok and not (optional and code(f"{name} h{i}") == _NOT_SUPPORTED):
                    failed = True
            if not failed:
                _health(pynvml, h, f"h{i}", ask, code)
        if request.get("mig"):
            _mig(pynvml, handles, ask)
    finally:
        say("nvmlShutdown")
        # Not contextlib.suppress: importing contextlib costs every survey ~20 ms.
        try:  # noqa: SIM105
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return {"answers": answers}


def _init(pynvml: Any, request: dict[str, Any], answers: dict[str, Any], say: Any) -> bool:
    """nvmlInit, with NVML from the driver directory when the loader finds
    none (prepare.gpu.nvml._init says why); the parent has judged whether
    that library may be loaded."""
    say("nvmlInit")
    try:
        pynvml.nvmlInit()
        answers["nvmlInit"] = {"v": None}
        return True
    except pynvml.NVMLError as err:
        answers["nvmlInit"] = {"e": getattr(err, "value", None), "s": str(err)}
        if getattr(err, "value", None) != _LIBRARY_NOT_FOUND:
            return False
    preload = request.get("preload")
    if not preload:
        return False
    if not request.get("preload_trusted"):
        answers["nvmlInit"] = {"untrusted": preload}
        return False
    import ctypes  # pynvml has imported it already

    try:
        ctypes.CDLL(preload, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    say("nvmlInit")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        answers["nvmlInit"] = {"e": getattr(err, "value", None), "s": str(err)}
        return False
    answers["nvmlInit"] = {"v": None}
    return True


def _health(pynvml: Any, h: Any, token: str, ask: Any, code: Any) -> None:
    """The calls of prepare.gpu.health.read, in its order; after a lost GPU
    it asks nothing more, as it does."""
    calls = (
        ("nvmlDeviceGetRemappedRows", lambda: list(pynvml.nvmlDeviceGetRemappedRows(h))),
        ("nvmlDeviceGetRetiredPagesPendingStatus", lambda: int(pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h))),
        ("nvmlDeviceGetTotalEccErrors", lambda: int(pynvml.nvmlDeviceGetTotalEccErrors(h, 1, 0))),
        ("fabric", lambda: _fabric(pynvml, h)),
        ("nvmlDeviceGetComputeMode", lambda: int(pynvml.nvmlDeviceGetComputeMode(h))),
    )
    for name, call in calls:
        key = f"{name} {token}"
        ask(key, call)
        if code(key) == _GPU_IS_LOST:
            return


def _fabric(pynvml: Any, h: Any) -> dict[str, Any]:
    """The fabric info through the versioned call where the driver and
    pynvml have it, else the original one (drivers before it existed); the
    state as read (prepare.gpu.health keeps its low byte), and NVML's words
    for the status."""
    import ctypes  # pynvml has imported it already

    versioned = getattr(pynvml, "nvmlDeviceGetGpuFabricInfoV", None)
    struct = getattr(pynvml, "c_nvmlGpuFabricInfoV_t", None)
    info: Any = None
    if versioned is not None and struct is not None:
        info = struct()
        try:
            versioned(h, ctypes.byref(info))
        except pynvml.NVMLError as err:
            if getattr(err, "value", None) not in (_FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH):
                raise
            info = None
    if info is None:
        info = pynvml.c_nvmlGpuFabricInfo_t()
        pynvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
    status = int(info.status)
    try:
        said: str | None = str(pynvml.nvmlErrorString(status))
    except pynvml.NVMLError:
        said = None
    return {"state": int(info.state), "status": status, "said": said}


def _mig(pynvml: Any, handles: dict[str, Any], ask: Any) -> None:
    """The calls of prepare.gpu.nvml._mig_instances, in its order."""
    for token, h in sorted(handles.items(), key=lambda item: int(item[0][1:])):
        ok, mode = ask(f"nvmlDeviceGetMigMode {token}", lambda x: list(pynvml.nvmlDeviceGetMigMode(x)), h)
        if not ok or mode[0] != 1:
            continue
        ok, slots = ask(f"nvmlDeviceGetMaxMigDeviceCount {token}", pynvml.nvmlDeviceGetMaxMigDeviceCount, h)
        if not ok:
            continue
        for slot in range(int(slots)):
            mig_token = f"{token}m{slot}"
            key = f"nvmlDeviceGetMigDeviceHandleByIndex {token} {slot}"
            ok, mig = ask(key, pynvml.nvmlDeviceGetMigDeviceHandleByIndex, h, slot, token=mig_token)
            if ok:
                ask(f"nvmlDeviceGetUUID {mig_token}", pynvml.nvmlDeviceGetUUID, mig)


if __name__ == "__main__":
    main()
