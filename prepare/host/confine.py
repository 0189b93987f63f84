"""The smoke run's confinement: the training source's code, run as the training would.

The training source is written by whoever publishes a run, not by the
box's operator, and fdl-prepare runs as root. So the smoke run (the one
time fdl-prepare executes that code itself) gets nothing of root's:

- as root, it runs as `smoke_user` (default `nobody`, which Debian and
  NixOS both have), with that user's primary group and, as supplementary
  groups, only those the GPU device nodes need where the box has them
  (`render`, `video`: AMD's /dev/kfd and /dev/dri are root:render 0660,
  NVIDIA's /dev/nvidia* are 0666). A user that is root (uid 0) is refused;
- no capabilities: the bounding set dropped while root may still drop it,
  then the uid changed (which clears the effective, permitted and ambient
  sets), then the inheritable set cleared, then `no_new_privs`, so no
  setuid program or file capability gives any back;
- a clean environment: PATH, the locale, the GPU masks and the driver's
  variables (`CLEAN_ENV`, `CLEAN_PREFIXES`), and HOME and TMPDIR set to a
  directory of its own, made for the run and removed after it. Nothing
  else of the caller's (tokens, keys, NIX_*, SSH_AUTH_SOCK) reaches it;
- a PID namespace whose init is the smoke binary: when it ends, after a
  success, a failure or a timeout, the kernel kills everything it started,
  a child that called setsid() or double-forked included, since none can
  leave the namespace. Where no PID namespace can be made (not root, or a
  container without CAP_SYS_ADMIN), the helper is a child subreaper
  instead: whatever the binary leaves behind is reparented to it, and it
  kills and reaps all of it before it exits. Only a SIGKILL of fdl-prepare
  itself then leaves a daemonised grandchild running; the namespace has no
  such gap.

Not root, fdl-prepare runs the binary as itself, with the same clean
environment, capabilities cleared, `no_new_privs` and the subreaper.

The work is done by this file run as a script (`python -I -S confine.py
CONFIG -- ARGV`, by `prepare.host.proc`): a fresh, single-threaded interpreter
may fork freely, which a threaded caller (a join loop) may not. It needs
nothing but the standard library, since `-I` keeps the package off its
path. It reports on the status fd it is given, one line per fact: `mode
pidns|reaper`, then `exec <errno>` or `setup <step> <errno>` if the binary
never started, and `done` at the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import stat
import sys
import time
from dataclasses import dataclass
from typing import Any, NoReturn

# The user the smoke run runs as, when fdl-prepare is root.
DEFAULT_USER = "nobody"
# Supplementary groups the GPU device nodes need, where they exist.
GPU_GROUPS = ("render", "video")
# What a training run needs of the caller's environment, and nothing else.
CLEAN_ENV = frozenset(
    {
        "PATH",
        "LANG",
        "LANGUAGE",
        "TZ",
        # Nix-built programs find the locales through it on NixOS.
        "LOCALE_ARCHIVE",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "ROCR_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",
        "HSA_OVERRIDE_GFX_VERSION",
    }
)
CLEAN_PREFIXES = ("LC_", "NVIDIA_")

# linux/sched.h, linux/prctl.h, linux/capability.h
_CLONE_NEWPID = 0x20000000
_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAPABILITY_VERSION_3 = 0x20080522

# Signals that ask the helper to stop the run (a timeout, an interrupt).
_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# How long the helper keeps killing what the run left (reaper mode): a
# process stuck in the kernel (a dead mount) cannot be killed at all.
_SWEEP_S = 5.0


def clean_env(environ: dict[str, str] | os._Environ[str], home: str) -> dict[str, str]:
    """The smoke run's environment: the caller's PATH, locale, GPU masks and
    driver variables, and `home` as HOME and TMPDIR."""
    env = {k: v for k, v in environ.items() if k in CLEAN_ENV or k.startswith(CLEAN_PREFIXES)}
    env.setdefault("PATH", "/run/current-system/sw/bin:/usr/local/bin:/usr/bin:/bin")
    env["HOME"] = home
    env["TMPDIR"] = home
    return env


def config(
    *, uid: int | None, gid: int | None, groups: tuple[int, ...], env: dict[str, str], status_fd: int, pidns: bool
) -> str:
    """The helper's first argument. The environment travels in it, not as
    the helper's own: Python coerces a C locale at start (PEP 538) by
    setting LC_CTYPE, which the run must not inherit."""
    settings = {"uid": uid, "gid": gid, "groups": list(groups), "env": env, "status": status_fd, "pidns": pidns}
    return json.dumps(settings, sort_keys=True)


# -- the library side ------------------------------------------------------------------------


@dataclass(frozen=True)
class Confinement:
    """Who the smoke run runs as, and the home made for it. `uid` None: as
    this process's own user (fdl-prepare is not root)."""

    user: str
    uid: int | None
    gid: int | None
    groups: tuple[int, ...]
    group_names: tuple[str, ...]
    home: str
    env: dict[str, str]

    def describe(self, mode: str | None) -> str:
        """How it ran, for the note: the user and groups, and the containment."""
        who = f"as {self.user}" if self.uid is not None else f"as {self.user} (fdl-prepare is not root)"
        groups = f" with {', '.join(self.group_names)}" if self.group_names else ""
        within = {"pidns": "in a PID namespace of its own", "reaper": "under a subreaper"}.get(mode or "", "")
        return f"{who}{groups}, no capabilities, a clean environment{', ' + within if within else ''}"


def enter(user: str, environ: dict[str, str] | os._Environ[str] | None = None) -> Confinement:
    """Resolve `user` (as root) and make the run's home. Raises a permanent
    Fail for a user that does not exist or is root. The caller must `leave`."""
    import grp
    import pwd

    from prepare.fail import Fail

    environ = os.environ if environ is None else environ
    if os.geteuid() != 0:
        me = _name(os.geteuid())
        home = _make_home(None, None, environ)
        return Confinement(me, None, None, (), (), home, clean_env(environ, home))
    fix = (
        "set smoke_user in [join] (--smoke-user) to an unprivileged user that exists on this box (the default, "
        f"{DEFAULT_USER!r}, does on Debian and NixOS), or create it (`sudo useradd --system --no-create-home "
        "--shell /usr/sbin/nologin fdl-smoke`)"
    )
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise Fail(
            "config.invalid",
            f"smoke_user = {user!r} is not a user of this box: the smoke run executes the training source's code, "
            f"and never as root. Fix: {fix}",
        ) from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise Fail(
            "config.invalid",
            f"smoke_user = {user!r} is root (uid {entry.pw_uid}, gid {entry.pw_gid}): the smoke run executes the "
            f"training source's code, which must never run as root. Fix: {fix}",
        )
    groups: list[int] = []
    names: list[str] = []
    for name in GPU_GROUPS:
        try:
            found = grp.getgrnam(name).gr_gid
        except KeyError:
            continue
        if found != 0 and found not in groups:
            groups.append(found)
            names.append(name)
    home = _make_home(entry.pw_uid, entry.pw_gid, environ)
    return Confinement(user, entry.pw_uid, entry.pw_gid, tuple(groups), tuple(names), home, clean_env(environ, home))


def leave(confinement: Confinement) -> None:
    """Remove the run's home (never through a link: rmtree walks by fd)."""
    import shutil

    shutil.rmtree(confinement.home, ignore_errors=True)


def _name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _enterable(path: str) -> bool:
    """Whether every directory on the way to `path` lets others search it."""
    current = os.path.realpath(path)
    while True:
        try:
            st = os.stat(current)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or not st.st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(current)
        if parent == current:
            return True
        current = parent


def _make_home(uid: int | None, gid: int | None, environ: dict[str, str] | os._Environ[str]) -> str:
    """A directory of the run's own, 0700, under a temporary directory it
    can reach (root's TMPDIR may be /tmp/user/0, which it cannot)."""
    import tempfile

    from prepare.fail import Fail
    from prepare.host import human

    candidates = [environ.get("TMPDIR") or "", "/tmp", "/var/tmp"]
    usable = [c for c in candidates if c and (uid is None or _enterable(c))]
    for where in dict.fromkeys(usable):
        try:
            home = tempfile.mkdtemp(prefix="fdl-smoke-", dir=where)
        except OSError:
            continue
        try:
            if uid is not None and gid is not None:
                os.chown(home, uid, gid)
        except OSError as err:
            os.rmdir(home)
            raise Fail(
                "dirs.unwritable",
                f"cannot give the smoke run a home of its own in {where}: chown failed ({human.oserror(err)})",
            ) from None
        return home
    raise Fail(
        "dirs.unwritable",
        f"no temporary directory the smoke run's user can use (tried {', '.join(c for c in candidates if c)}): "
        "make /tmp enterable and writable (`chmod 1777 /tmp`), or set TMPDIR to one that is",
    )


# -- the helper, run as a script ---------------------------------------------------------------


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


def _become(cfg: dict[str, Any], args: list[str], life: int, err: int) -> NoReturn:
    """The run itself (PID 1 of its namespace, where there is one): drop
    everything, then exec. Any step that fails is reported, and nothing
    runs."""
    libc = _libc()
    step = "signals"
    try:
        for signum in (*_STOPPING, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        uid, gid = cfg["uid"], cfg["gid"]
        if uid is not None:
            step = "groups"
            os.setgroups(cfg["groups"])
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
        os.execve(args[0], args, cfg["env"])
    except OSError as failed:
        _say(err, f"{'exec' if step == 'exec' else 'setup ' + step.replace(' ', '_')} {failed.errno or 0}")
    except BaseException:  # noqa: BLE001 (nothing may run after a failed step)
        _say(err, f"setup {step.replace(' ', '_')} 0")
    os._exit(127)


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
    cfg = json.loads(argv[1])
    args = argv[3:]
    status = int(cfg["status"])
    libc = _libc()
    mode = "reaper"
    if cfg.get("pidns") and libc.unshare(_CLONE_NEWPID) == 0:
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
