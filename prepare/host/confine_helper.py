"""The smoke run's confinement, done: this file is run as a script
(`python -I -S confine_helper.py UID GID GROUPS STATUS_FD PIDNS KEY=VALUE...
-- ARGV`, the command line prepare.host.confine.command makes), a fresh,
single-threaded interpreter that may fork freely, which a threaded caller
(a join loop) may not. What it does and why is prepare/host/confine.py's
docstring.

It needs nothing but the standard library, since `-I` keeps the package
off its path, and it runs on every attempt, a warm one included: so it
imports only the cheapest modules (not json, dataclasses or typing, which
together cost more than the interpreter's own start). It reports on the
status fd it is given, one line per fact: `mode pidns|reaper`, then `exec
<errno>` or `setup <step> <errno>` if the binary never started, and `done`
at the end. The mode is `private` where the run also has a mount
namespace of its own (its own /proc, /tmp, /var/tmp and /dev/shm).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import select
import signal
import sys
import time

# mypy reads the annotations; the interpreter never imports typing for them.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

# linux/sched.h, linux/prctl.h, linux/capability.h, linux/mount.h
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNS = 0x00020000
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAPABILITY_VERSION_3 = 0x20080522
# linux/close_range.h
_CLOSE_RANGE_CLOEXEC = 1 << 2

# Where the run may leave files for the next one, or read another's: each
# gets a fresh tmpfs in the run's mount namespace, gone with it. Their size
# is tmpfs's own default (half the RAM), said explicitly; /dev/shm is where
# a PyTorch DataLoader keeps its shared memory, which can be gigabytes.
_PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
_TMPFS_OPTIONS = b"mode=1777,size=50%"
# Bounds on the run, generous for a training step, tight for a fork bomb or
# a disk filler: processes and threads of its user (a dynamic uid's are its
# own; `nobody`'s count the box's other nobody processes too), the size of
# any one file it writes, and no core dump (of another's code, in a place
# root chose). No RLIMIT_AS: CUDA reserves address space far past the RAM.
_LIMITS = (("RLIMIT_NPROC", 8192), ("RLIMIT_FSIZE", 64 << 30), ("RLIMIT_CORE", 0))

# Signals that ask the helper to stop the run (a timeout, an interrupt).
_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# How long the helper keeps killing what the run left (reaper mode): a
# process stuck in the kernel (a dead mount) cannot be killed at all.
_SWEEP_S = 5.0


class _Stop(Exception):
    """A stop was asked for (SIGTERM from a timeout, SIGINT, SIGHUP)."""


def _on_stop(signum: int, frame: Any) -> None:
    raise _Stop()


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, step: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{step}: {os.strerror(err)}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return 63


def _say(fd: int, line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, (line + "\n").encode())


class Settings:
    """What prepare.host.confine.command put on the command line."""

    def __init__(self, words: list[str]) -> None:
        uid, gid, groups, status, pidns = words[:5]
        end = words.index("--")
        self.uid = None if uid == "-" else int(uid)
        self.gid = None if gid == "-" else int(gid)
        self.groups = [] if groups == "-" else [int(g) for g in groups.split(",")]
        self.status = int(status)
        self.pidns = pidns == "1"
        # Set by main: whether the run has a mount namespace of its own.
        self.private = False
        self.env = dict(word.split("=", 1) for word in words[5:end])
        self.args = words[end + 1 :]


def _become(cfg: Settings, args: list[str], life: int, err: int) -> NoReturn:
    """The run itself (PID 1 of its namespace, where there is one): drop
    everything, then exec. Any step that fails is reported, and nothing
    runs."""
    libc = _libc()
    step = "signals"
    try:
        step = "terminal"
        _no_terminal(libc)
        step = "signals"
        for signum in (*_STOPPING, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        uid, gid = cfg.uid, cfg.gid
        if cfg.private:
            step = "mounts"
            _private_mounts(libc, cfg)
        step = "limits"
        for name, value in _LIMITS:
            which = getattr(resource, name)
            hard = resource.getrlimit(which)[1]
            if hard != resource.RLIM_INFINITY and hard < value:
                value = hard
            resource.setrlimit(which, (value, value))
        if uid is not None and gid is not None:
            step = "groups"
            os.setgroups(cfg.groups)
            step = "gid"
            os.setresgid(gid, gid, gid)
            # Only while still root: dropping the bounding set takes CAP_SETPCAP.
            step = "bounding"
            for cap in range(_last_cap() + 1):
                _check(libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), step)
            step = "uid"
            os.setresuid(uid, uid, uid)
        step = "ambient"
        if libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            _check(-1, step)
        step = "capabilities"
        header, data = _CapHeader(_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
        _check(libc.capset(ctypes.byref(header), data), step)
        step = "no_new_privs"
        _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), step)
        # After the uid change, which clears it.
        step = "parent death signal"
        _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), step)
        if select.select([life], [], [], 0)[0]:
            # The helper died before the signal was set: nobody waits.
            os._exit(128 + signal.SIGKILL)
        step = "exec"
        os.execve(args[0], args, cfg.env)
    except OSError as failed:
        _say(err, f"{'exec' if step == 'exec' else 'setup ' + step.replace(' ', '_')} {failed.errno or 0}")
    except BaseException:  # noqa: BLE001 (nothing may run after a failed step)
        _say(err, f"setup {step.replace(' ', '_')} 0")
    os._exit(127)


def _mount(libc: Any, source: bytes | None, target: str, kind: bytes | None, flags: int, data: bytes | None) -> None:
    if libc.mount(source, target.encode(), kind, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _private_mounts(libc: Any, cfg: Settings) -> None:
    """In the run's own mount namespace (PID 1 of its PID namespace, still
    root): nothing it mounts reaches the host, a /proc of its own namespace
    (no other process of the box to read or write, whoever runs it), and a
    fresh /tmp, /var/tmp and /dev/shm, where its home is made again, so that
    nothing it leaves there outlives it, even a SIGKILL of fdl-prepare."""
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE, None)
    _mount(libc, b"proc", "/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
    for where in _PRIVATE_DIRS:
        if os.path.isdir(where) and not os.path.islink(where):
            _mount(libc, b"tmpfs", where, b"tmpfs", _MS_NOSUID | _MS_NODEV, _TMPFS_OPTIONS)
    home = cfg.env.get("HOME", "")
    if os.path.dirname(home) in _PRIVATE_DIRS and not os.path.lexists(home):
        os.mkdir(home, 0o700)
        if cfg.uid is not None and cfg.gid is not None:
            os.chown(home, cfg.uid, cfg.gid)


def _no_terminal(libc: Any) -> None:
    """Make sure the run can reach no terminal: prepare.host.proc starts the
    helper in a session of its own (no controlling terminal, so /dev/tty
    cannot be opened) with pipes and /dev/null on 0-2. Checked here, for
    any other caller: a terminal on a descriptor, or a controlling one, is a
    step that failed, and the run does not start. Every other descriptor is
    closed at exec, whoever opened it."""
    for fd in (0, 1, 2):
        if os.isatty(fd):
            raise OSError(0, f"descriptor {fd} is a terminal")
    try:
        tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        pass
    else:
        os.close(tty)
        raise OSError(0, "it has a controlling terminal")
    if libc.close_range(3, 0xFFFFFFFF, _CLOSE_RANGE_CLOEXEC) != 0:
        # Before Linux 5.11: one at a time.
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if int(name) > 2:
                    os.set_inheritable(int(name), False)


def _children(me: int) -> list[int]:
    pids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{task}/children", encoding="ascii") as handle:
                pids += [int(p) for p in handle.read().split()]
        return pids
    except (OSError, ValueError):
        pass
    # Without CONFIG_PROC_CHILDREN: every process's parent, from its stat.
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as handle:
                fields = handle.read().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 1 and fields[1] == str(me):
            pids.append(int(name))
    return pids


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _sweep() -> None:
    """Kill and reap everything the run left, which a subreaper inherits:
    a killed process's own children come to us next, round after round."""
    me = os.getpid()
    deadline = time.monotonic() + _SWEEP_S
    while time.monotonic() < deadline:
        _reap()
        left = _children(me)
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def main(argv: list[str]) -> NoReturn:
    cfg = Settings(argv[1:])
    args = cfg.args
    status = cfg.status
    libc = _libc()
    mode = "reaper"
    if cfg.pidns and libc.unshare(_CLONE_NEWPID | _CLONE_NEWNS) == 0:
        mode = "private"
        cfg.private = True
    elif cfg.pidns and libc.unshare(_CLONE_NEWPID) == 0:
        mode = "pidns"
    else:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    life_r, life_w = os.pipe()
    err_r, err_w = os.pipe()
    signal.pthread_sigmask(signal.SIG_BLOCK, set(_STOPPING))
    for signum in _STOPPING:
        signal.signal(signum, _on_stop)
    pid = os.fork()
    if pid == 0:
        os.close(life_w)
        os.close(err_r)
        os.close(status)
        _become(cfg, args, life_r, err_w)
    os.close(life_r)
    os.close(err_w)
    _say(status, f"mode {mode}")
    stopped = False
    code = 0
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_STOPPING))
        failed = b""
        while chunk := os.read(err_r, 256):
            failed += chunk
        if failed:
            _say(status, failed.decode("ascii", "replace").strip())
        _, code = os.waitpid(pid, 0)
    except _Stop:
        stopped = True
    signal.pthread_sigmask(signal.SIG_BLOCK, set(_STOPPING))
    if stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _, code = os.waitpid(pid, 0)
    # In a PID namespace the kernel killed the rest when its init ended.
    if mode == "reaper":
        _sweep()
    _say(status, "done")
    if os.WIFSIGNALED(code):
        os._exit(128 + os.WTERMSIG(code))
    os._exit(os.WEXITSTATUS(code))


if __name__ == "__main__":
    main(sys.argv)
