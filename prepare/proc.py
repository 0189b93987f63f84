"""The one place that starts subprocesses.

Every step that runs a program (sshfs, ls on a network mount, nix) goes
through `run`, so timeouts, missing executables and interruption behave the
same everywhere, and tests have one seam to reason about. Built on `sh`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Missing(Exception):
    """The executable is not on PATH (or the given path does not exist)."""

    def __init__(self, program: str) -> None:
        super().__init__(program)
        self.program = program


class TimedOut(Exception):
    """The program ran past its timeout and was killed."""

    def __init__(self, argv: Sequence[str], timeout: float, stderr: str) -> None:
        super().__init__(f"{argv[0]} timed out after {timeout:g}s")
        self.argv = tuple(argv)
        self.timeout = timeout
        self.stderr = stderr


def which(program: str, path: str | None = None) -> str | None:
    return shutil.which(program, path=path)


def run(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: str | None = None,
    on_stderr_line: Callable[[str], None] | None = None,
) -> Completed:
    """Run `argv` to completion and return its exit status and output.

    A non-zero exit is not an exception: callers classify failures from what
    the program said, not from its exit code alone. `on_stderr_line` sees each
    stderr line as it arrives (nix's internal-json progress). If the caller is
    interrupted (SIGINT, SIGTERM turned into an exception), the child is
    terminated before the exception propagates, so nothing keeps running in
    the background of a process that has given up.
    """
    argv = [os.fspath(a) for a in argv]
    program = argv[0]
    search_path = (env or os.environ).get("PATH")
    resolved = program if os.sep in program else which(program, path=search_path)
    if resolved is None or not os.path.exists(resolved):
        raise Missing(program)

    err_lines: list[str] = []

    def take_err(line: str) -> None:
        err_lines.append(line)
        if on_stderr_line is not None:
            on_stderr_line(line.rstrip("\n"))

    # Imported here, not at the top: `sh` pulls in asyncio (~0.1 s), which the
    # steps that never start a program (and --help) should not pay for.
    import sh

    try:
        command = sh.Command(resolved)
    except sh.CommandNotFound:
        raise Missing(program) from None
    running = command(
        *argv[1:],
        # Dies with us even when we are SIGKILLed (no handler runs then):
        # an orphaned nix would go on and rewrite the out-links after the
        # state lock is gone.
        _preexec_fn=_die_with_parent(),
        _bg=True,
        _bg_exc=False,
        _ok_code=list(range(256)),
        _env=dict(env) if env is not None else None,
        _cwd=cwd,
        _in=stdin,
        _err=take_err,
        _decode_errors="replace",
        _return_cmd=True,
        # Its own process group, so a timeout or an interruption reaches the
        # grandchildren too (a shell's `sleep`, sshfs's ssh) instead of
        # leaving them holding our pipes open.
        _new_group=True,
    )
    # Our own timer rather than sh's `_timeout`: sh polls for it every 0.1 s,
    # which added that much to every bounded call on the warm path.
    timed_out = threading.Event()
    timer = None
    if timeout is not None:
        timer = threading.Timer(timeout, _kill_on_timeout, (running, timed_out))
        timer.daemon = True
        timer.start()
    try:
        running.wait()
    except sh.SignalException as died:
        if timed_out.is_set():
            raise TimedOut(argv, timeout or 0.0, "".join(err_lines)) from None
        # Killed by a signal from outside (OOM killer, an operator): report it
        # as the shell would, 128 + signal number.
        return Completed(tuple(argv), 128 + abs(died.exit_code), _text(died.stdout), "".join(err_lines))
    except BaseException:
        _stop(running)
        raise
    finally:
        if timer is not None:
            timer.cancel()
    if timed_out.is_set():
        # Killed at the deadline but exited on its own terms first (it caught
        # or outran the signal): still past its time.
        raise TimedOut(argv, timeout or 0.0, "".join(err_lines))
    return Completed(tuple(argv), running.exit_code, _text(running.stdout), "".join(err_lines))


# prctl(2) option: the signal a child gets when the thread that forked it dies.
_PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None = None


def _die_with_parent() -> Callable[[], None]:
    """A preexec hook for the child: ask the kernel to SIGKILL it when the
    thread that started it dies (ours, which waits for it in `run`), then
    make sure that has not already happened between fork and here. The
    setting is cleared in the child's own children and across a setuid
    exec, so an sshfs daemon (forked by sshfs) and a wedged listing
    grandchild outlive us, as they must."""
    global _prctl
    if _prctl is None:
        import ctypes

        # Resolved before the fork: the child only makes the call.
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl = _prctl
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(128 + signal.SIGKILL)

    return hook


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return data


def _kill_on_timeout(running: Any, timed_out: threading.Event) -> None:
    timed_out.set()
    # Gone already: nothing left to kill.
    with contextlib.suppress(ProcessLookupError):
        running.signal_group(signal.SIGKILL)


def _stop(running: Any) -> None:
    """Stop the child's group while the caller unwinds. Nothing raised here
    may replace the caller's exception: sh reports the child's death by our
    SIGTERM as an exception of its own, and a group can be gone already."""
    import sh

    try:
        running.signal_group(signal.SIGTERM)
        running.wait(timeout=10)
    except (sh.SignalException, ProcessLookupError):
        return
    except sh.TimeoutException:
        with contextlib.suppress(ProcessLookupError):
            running.signal_group(signal.SIGKILL)
