"""The one place that starts subprocesses.

Every step that runs a program (sshfs, ls on a network mount, nix) goes
through `run`, so timeouts, missing executables and interruption behave the
same everywhere, and tests have one seam to reason about.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO


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
    """The executable is not on PATH, or the given path does not exist or
    is not a program that can be run."""

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


# How long the output is still read once the program itself has exited. A
# grandchild it left behind (a daemon that kept our pipes, a listing wedged
# on a dead mount that even SIGKILL cannot end) must not hold the caller.
_DRAIN_S = 2.0
# How long an interrupted program gets to exit on SIGTERM before SIGKILL.
_STOP_GRACE_S = 10.0


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
    return start(argv, timeout=timeout, env=env, cwd=cwd, stdin=stdin, on_stderr_line=on_stderr_line).wait()


def start(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: str | None = None,
    on_stderr_line: Callable[[str], None] | None = None,
) -> Running:
    """Start `argv` and return at once; `wait` finishes it as `run` would.
    For two programs that may run side by side: the caller must `wait` for
    (or `stop`) what it started, on every path, its exceptions included.
    The timeout counts from the start."""
    argv = [os.fspath(a) for a in argv]
    program = argv[0]
    search_path = (env or os.environ).get("PATH")
    resolved = program if os.sep in program else which(program, path=search_path)
    if resolved is None or not os.path.isfile(resolved) or not os.access(resolved, os.X_OK):
        raise Missing(program)
    try:
        child = subprocess.Popen(
            [resolved, *argv[1:]],
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            # Its own process group, and it dies with us (both in the hook).
            preexec_fn=_child_setup(),
        )
    except OSError:
        # Gone between the lookup and the exec, not executable by us, or not
        # a program at all (ENOEXEC): in each case there is nothing to run.
        raise Missing(program) from None
    # Everything after the start stops the program if it fails, an
    # interruption that lands while the readers start included.
    try:
        return Running(tuple(argv), child, timeout, stdin, on_stderr_line)
    except BaseException:
        _stop(child)
        raise


class Running:
    """A program `start` started: its output is read as it comes."""

    def __init__(
        self,
        argv: tuple[str, ...],
        child: subprocess.Popen[bytes],
        timeout: float | None,
        stdin: str | None,
        on_stderr_line: Callable[[str], None] | None,
    ) -> None:
        self.argv = argv
        self._child = child
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._out: list[bytes] = []
        self._err: list[str] = []
        self._on_stderr_line = on_stderr_line
        assert child.stdout is not None and child.stderr is not None
        self._readers = [_thread(_read_all, child.stdout, self._out.append)]
        self._readers.append(_thread(_read_lines, child.stderr, self._take_err))
        if stdin is not None:
            assert child.stdin is not None
            _thread(_write_all, child.stdin, stdin.encode())

    def _take_err(self, line: str) -> None:
        self._err.append(line)
        if self._on_stderr_line is not None:
            self._on_stderr_line(line.rstrip("\n"))

    def wait(self) -> Completed:
        """Its exit status and output; TimedOut past its deadline. If the
        caller is interrupted meanwhile, the program is stopped first."""
        child = self._child
        # A timer kills it at the deadline: Popen.wait(timeout=) polls with
        # sleeps of up to 50 ms, which every call on the warm path would pay.
        expired = threading.Event()
        timer = None
        if self._deadline is not None:
            timer = threading.Timer(max(0.0, self._deadline - time.monotonic()), self._expire, (expired,))
            timer.daemon = True
            timer.start()
        try:
            child.wait()
        except BaseException:
            _stop(child)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            for reader in self._readers:
                reader.join(_DRAIN_S)
        stderr = "".join(self._err)
        if expired.is_set():
            # Killed at the deadline, or it outran the signal: past its time
            # either way.
            raise TimedOut(self.argv, self._timeout or 0.0, stderr)
        code = child.returncode
        # Killed by a signal from outside (OOM killer, an operator): report it
        # as the shell would, 128 + signal number.
        returncode = 128 - code if code < 0 else code
        stdout = b"".join(self._out).decode("utf-8", "replace")
        return Completed(self.argv, returncode, stdout, stderr)

    def _expire(self, expired: threading.Event) -> None:
        expired.set()
        if self._child.returncode is None:
            _signal_group(self._child, signal.SIGKILL)

    def stop(self) -> None:
        """Stop it (its whole group) and reap it: for a caller that no
        longer wants what it started."""
        if self._child.poll() is None:
            _stop(self._child)
        for reader in self._readers:
            reader.join(_DRAIN_S)


def _thread(target: Callable[..., None], *args: object) -> threading.Thread:
    # Daemon threads: one still blocked on a pipe a wedged grandchild holds
    # open must not keep the process alive at exit.
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _read_all(pipe: IO[bytes], take: Callable[[bytes], None]) -> None:
    with pipe:
        while chunk := os.read(pipe.fileno(), 65536):
            take(chunk)


def _read_lines(pipe: IO[bytes], take: Callable[[str], None]) -> None:
    with pipe:
        for raw in pipe:
            take(raw.decode("utf-8", "replace"))


def _write_all(pipe: IO[bytes], data: bytes) -> None:
    # The program may exit without reading what it was given.
    with contextlib.suppress(BrokenPipeError, OSError), pipe:
        pipe.write(data)


# prctl(2) option: the signal a child gets when the thread that forked it dies.
_PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None = None


def _child_setup() -> Callable[[], None]:
    """A preexec hook for the child.

    It leads a process group of its own, so a timeout or an interruption
    reaches the grandchildren too (a shell's `sleep`, sshfs's ssh) instead
    of leaving them holding our pipes open.

    It dies with us even when we are SIGKILLed (no handler runs then): an
    orphaned nix would go on and rewrite the out-links after the state lock
    is gone. The kernel SIGKILLs it when the thread that started it dies
    (ours, which waits for it in `run`); the hook then makes sure that has
    not already happened between fork and here. The setting is cleared in
    the child's own children and across a setuid exec, so an sshfs daemon
    (forked by sshfs) and a wedged listing grandchild outlive us, as they
    must."""
    global _prctl
    if _prctl is None:
        import ctypes

        # Resolved before the fork: the child only makes the call.
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl = _prctl
    parent = os.getpid()

    def hook() -> None:
        os.setpgid(0, 0)
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(128 + signal.SIGKILL)

    return hook


def _signal_group(child: subprocess.Popen[bytes], signum: int) -> None:
    # The group may be gone already: nothing left to signal.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signum)


def _stop(child: subprocess.Popen[bytes]) -> None:
    """Stop the child's group while the caller unwinds. Nothing raised here
    may replace the caller's exception."""
    _signal_group(child, signal.SIGTERM)
    try:
        child.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(child, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=_STOP_GRACE_S)
