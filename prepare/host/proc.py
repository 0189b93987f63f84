"""The one place that starts subprocesses.

Every step that runs a program (sshfs, ls on a network mount, nix) goes
through `run`, so timeouts, missing executables and interruption behave the
same everywhere, and tests have one seam to reason about.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from prepare.host.confine import Confinement


@dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    # Bytes of stdout and lines of stderr left out to keep within the caps
    # (`max_stdout`, STDERR_BYTES): the start is what goes.
    stdout_cut: int = 0
    stderr_cut: int = 0
    # How a confined run was contained: "private", "pidns" or "reaper" (prepare.host.confine).
    confined: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class ExecFailed(Exception):
    """The program could not be started: `errno` says why (fork failing for
    want of memory or processes, a file busy being written, ...)."""

    def __init__(self, program: str, err: int | None = None) -> None:
        why = f": {os.strerror(err)} ({errno.errorcode.get(err, err)})" if err else ""
        super().__init__(f"{program}{why}")
        self.program = program
        self.errno = err


class Missing(ExecFailed):
    """The executable is not on PATH, or the given path does not exist or
    is not a program that can be run."""


class TooLong(ExecFailed):
    """The kernel refused the command line (E2BIG): an argument longer than
    it takes one (MAX_ARG_STRLEN, 128 KiB), or all of them with the
    environment past ARG_MAX."""


class ConfinementFailed(ExecFailed):
    """A confined program (prepare.host.confine) was not started because one step
    of dropping its privileges failed: `step` names it."""

    def __init__(self, program: str, step: str, err: int | None) -> None:
        super().__init__(program, err)
        self.step = step


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
# One wait for both pipes, and only while one is still open.
_DRAIN_S = 2.0
# How long an interrupted program gets to exit on SIGTERM before SIGKILL.
_STOP_GRACE_S = 10.0
# How long a confined program's helper gets to kill and reap the run
# after a timeout before its whole group is killed.
_CONFINED_GRACE_S = 8.0

# What is kept of a program's output, whatever it prints: memory stays flat
# and a message quoting it stays short. stdout is kept whole up to
# OUTPUT_BYTES (nix's JSON) unless the caller asks for less; stderr, read a
# line at a time (nix's log records), keeps its last lines, each cut at
# LINE_BYTES.
OUTPUT_BYTES = 16 << 20
STDERR_BYTES = 256 << 10
STDERR_LINES = 4000
LINE_BYTES = 64 << 10
_CUT = " ... (cut)"

# Exec failures that mean "there is no program to run here".
_MISSING = {errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ENOEXEC, errno.EISDIR, errno.ELOOP, errno.EPERM}


# Who is told of each program as it starts (the CLI's --verbose prints
# them): process-wide rather than a parameter of every step, since every
# step runs its programs through here and here alone.
_watchers: list[Callable[[Sequence[str]], None]] = []


@contextlib.contextmanager
def watching(watcher: Callable[[Sequence[str]], None]) -> Iterator[None]:
    """Call `watcher` with the argv of each program started in the body (as
    the caller gave it: a confined run's wrapper is not shown)."""
    _watchers.append(watcher)
    try:
        yield
    finally:
        _watchers.remove(watcher)


def _announce(argv: Sequence[str]) -> None:
    for watcher in list(_watchers):
        # A display that fails must not stop the program it shows.
        with contextlib.suppress(Exception):
            watcher(argv)


def which(program: str, path: str | None = None) -> str | None:
    return shutil.which(program, path=path)


def exec_failed(program: str, err: int | None, step: str | None = None) -> ExecFailed:
    """The exception for a program that could not be started, by cause."""
    if step is not None:
        return ConfinementFailed(program, step, err)
    if err == errno.E2BIG:
        return TooLong(program, err)
    if err is None or err in _MISSING or err == errno.ENAMETOOLONG:
        return Missing(program, err)
    return ExecFailed(program, err)


def run(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: str | None = None,
    on_stderr_line: Callable[[str], None] | None = None,
    max_stdout: int = OUTPUT_BYTES,
    confine: Confinement | None = None,
) -> Completed:
    """Run `argv` to completion and return its exit status and output.

    A non-zero exit is not an exception: callers classify failures from what
    the program said, not from its exit code alone. `on_stderr_line` sees each
    stderr line as it arrives (nix's internal-json progress). If the caller is
    interrupted (SIGINT, SIGTERM turned into an exception), the child is
    terminated before the exception propagates, so nothing keeps running in
    the background of a process that has given up.

    A program that cannot be started raises `Missing`, `TooLong` or another
    `ExecFailed`; `confine` (prepare.host.confine) runs it unprivileged, in a
    clean environment, with everything it starts stopped when it ends.
    """
    return start(
        argv, timeout=timeout, env=env, cwd=cwd, stdin=stdin, on_stderr_line=on_stderr_line,
        max_stdout=max_stdout, confine=confine,
    ).wait()  # fmt: skip


def start(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: str | None = None,
    on_stderr_line: Callable[[str], None] | None = None,
    max_stdout: int = OUTPUT_BYTES,
    confine: Confinement | None = None,
) -> Running:
    """Start `argv` and return at once; `wait` finishes it as `run` would.
    For two programs that may run side by side: the caller must `wait` for
    (or `stop`) what it started, on every path, its exceptions included.
    The timeout counts from the start."""
    argv = [os.fspath(a) for a in argv]
    program = argv[0]
    if confine is not None:
        env = confine.env
    search_path = (env or os.environ).get("PATH")
    resolved = program if os.sep in program else which(program, path=search_path)
    if resolved is None or not os.path.isfile(resolved) or not os.access(resolved, os.X_OK):
        raise Missing(program)
    command = [resolved, *argv[1:]]
    _announce(argv)
    status: tuple[int, int] | None = None
    if confine is not None:
        from prepare.host.confine import command as confined

        status = os.pipe()
        command = confined(confine, status[1], command)
    try:
        child = subprocess.Popen(
            command,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            pass_fds=(status[1],) if status is not None else (),
            # Its own process group (a session of its own, confined), and
            # it dies with us (both in the hook).
            preexec_fn=_child_setup(session=confine is not None),
        )
    except OSError as err:
        # Gone between the lookup and the exec, not executable by us, not a
        # program at all (ENOEXEC), a command line past the kernel's limit
        # (E2BIG), or no memory or process left to fork: each said apart.
        if status is not None:
            os.close(status[0])
        raise exec_failed(program, err.errno) from None
    finally:
        if status is not None:
            os.close(status[1])
    # Everything after the start stops the program if it fails, an
    # interruption that lands while the readers start included.
    try:
        return Running(tuple(argv), child, timeout, stdin, on_stderr_line, max_stdout, status[0] if status else None)
    except BaseException:
        _stop(child)
        raise


class _Tail:
    """The last `cap` bytes of what was added, in at most twice that."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.cut = 0

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.cap:
            self._trim()

    def _trim(self) -> None:
        extra = len(self.data) - self.cap
        if extra > 0:
            del self.data[:extra]
            self.cut += extra

    def value(self) -> bytes:
        self._trim()
        return bytes(self.data)


class _Lines:
    """The last lines of stderr, within STDERR_LINES and STDERR_BYTES."""

    def __init__(self) -> None:
        self.lines: deque[str] = deque()
        self.size = 0
        self.cut = 0
        self.lock = threading.Lock()

    def add(self, line: str) -> None:
        with self.lock:
            self.lines.append(line)
            self.size += len(line)
            while len(self.lines) > STDERR_LINES or (self.size > STDERR_BYTES and len(self.lines) > 1):
                self.size -= len(self.lines.popleft())
                self.cut += 1

    def text(self) -> str:
        with self.lock:
            return "".join(self.lines)


class Running:
    """A program `start` started: its output is read as it comes."""

    def __init__(
        self,
        argv: tuple[str, ...],
        child: subprocess.Popen[bytes],
        timeout: float | None,
        stdin: str | None,
        on_stderr_line: Callable[[str], None] | None,
        max_stdout: int = OUTPUT_BYTES,
        status: int | None = None,
    ) -> None:
        self.argv = argv
        self._child = child
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._out = _Tail(max_stdout)
        self._err = _Lines()
        self._on_stderr_line = on_stderr_line
        self._status = status
        self._backstop: threading.Timer | None = None
        assert child.stdout is not None and child.stderr is not None
        self._readers = [_thread(_read_all, child.stdout, self._out.add)]
        self._readers.append(_thread(_read_lines, child.stderr, self._take_err))
        if stdin is not None:
            assert child.stdin is not None
            _thread(_write_all, child.stdin, stdin.encode())

    def _take_err(self, line: str) -> None:
        self._err.add(line)
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
            if self._backstop is not None:
                self._backstop.cancel()
            _drain(self._readers)
        stderr = self._err.text()
        said = self._read_status()
        if expired.is_set():
            # Killed at the deadline, or it outran the signal: past its time
            # either way.
            raise TimedOut(self.argv, self._timeout or 0.0, stderr)
        mode = None
        for line in said:
            word, _, rest = line.partition(" ")
            if word == "mode":
                mode = rest
            elif word in ("exec", "setup"):
                step, _, number = rest.rpartition(" ") if word == "setup" else ("", "", rest)
                err = int(number) if number.isdigit() else None
                raise exec_failed(self.argv[0], err or None, step if word == "setup" else None)
        code = child.returncode
        # Killed by a signal from outside (OOM killer, an operator): report it
        # as the shell would, 128 + signal number.
        returncode = 128 - code if code < 0 else code
        stdout = self._out.value().decode("utf-8", "replace")
        return Completed(self.argv, returncode, stdout, stderr, self._out.cut, self._err.cut, mode)

    def _read_status(self) -> list[str]:
        """What a confined program's helper said (prepare.host.confine); [] for
        any other program. Its writers are closed once it has exited."""
        if self._status is None:
            return []
        fd, self._status = self._status, None
        data = b""
        try:
            os.set_blocking(fd, False)
            while len(data) < 4096 and (chunk := os.read(fd, 4096)):
                data += chunk
        except (BlockingIOError, OSError):
            pass
        finally:
            os.close(fd)
        return data.decode("ascii", "replace").splitlines()

    def _expire(self, expired: threading.Event) -> None:
        expired.set()
        if self._child.returncode is not None:
            return
        if self._status is not None:
            # A confined program: its helper kills the run (and in reaper
            # mode everything it left) and exits; its group only if it
            # does not.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self._child.pid, signal.SIGTERM)
            self._backstop = threading.Timer(_CONFINED_GRACE_S, self._kill_if_running)
            self._backstop.daemon = True
            self._backstop.start()
            return
        _signal_group(self._child, signal.SIGKILL)

    def _kill_if_running(self) -> None:
        # Only while it has not been reaped: its pid, and so its group's,
        # may be another process's once it has.
        if self._child.returncode is None:
            _signal_group(self._child, signal.SIGKILL)

    def stop(self) -> None:
        """Stop it (its whole group) and reap it: for a caller that no
        longer wants what it started."""
        if self._child.poll() is None:
            _stop(self._child)
        _drain(self._readers)
        self._read_status()


def _drain(readers: Sequence[threading.Thread]) -> None:
    """Wait for the readers to reach the end of their pipes, both within one
    _DRAIN_S: only a grandchild that still holds a pipe makes this wait."""
    deadline = time.monotonic() + _DRAIN_S
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))


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
    """Each line to `take`, decoded, with its newline; a line longer than
    LINE_BYTES is cut there and the rest of it skipped, so a program that
    prints a gigabyte without a newline costs no more than one that does."""
    pending = bytearray()
    skipping = False
    with pipe:
        while chunk := os.read(pipe.fileno(), 65536):
            start = 0
            while True:
                end = chunk.find(b"\n", start)
                piece = chunk[start:] if end < 0 else chunk[start:end]
                if not skipping:
                    pending += piece
                    if len(pending) > LINE_BYTES:
                        take(pending[:LINE_BYTES].decode("utf-8", "replace") + _CUT + "\n")
                        pending.clear()
                        skipping = True
                if end < 0:
                    break
                if skipping:
                    skipping = False
                else:
                    take(pending.decode("utf-8", "replace") + "\n")
                    pending.clear()
                start = end + 1
        if pending and not skipping:
            take(pending.decode("utf-8", "replace"))


def _write_all(pipe: IO[bytes], data: bytes) -> None:
    # The program may exit without reading what it was given.
    with contextlib.suppress(BrokenPipeError, OSError), pipe:
        pipe.write(data)


# prctl(2) option: the signal a child gets when the thread that forked it dies.
_PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None = None


def _child_setup(*, session: bool = False) -> Callable[[], None]:
    """A preexec hook for the child.

    It leads a process group of its own, so a timeout or an interruption
    reaches the grandchildren too (a shell's `sleep`, sshfs's ssh) instead
    of leaving them holding our pipes open. With `session` (the confined
    smoke run), a session of its own, whose group it leads: a session has
    no controlling terminal until its leader opens one, and the helper
    never does, so nothing under it can open /dev/tty, push keystrokes into
    the operator's shell (TIOCSTI) or write escapes to the terminal, whose
    descriptors it never gets either (stdin /dev/null, stdout and stderr
    pipes).

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
        if session:
            os.setsid()
        else:
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
