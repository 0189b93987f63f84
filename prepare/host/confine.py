"""The smoke run's confinement: the training source's code, run as the training would.

The training source is written by whoever publishes a run, not by the
box's operator, and fdl-prepare runs as root. So the smoke run (the one
time fdl-prepare executes that code itself) gets nothing of root's:

- as root, it runs as the training user (`user`) when one is set, else
  as `smoke_user`: by default `dynamic`, a uid of the run's own that no
  user, group or process of the box has; a named one with that user's
  primary group. As supplementary
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

The work is done by prepare/host/confine_helper.py run as a script, by
`prepare.host.proc` (`command` here gives its command line): a fresh,
single-threaded interpreter may fork freely, which a threaded caller (a
join loop) may not. This module is the library's side: who the run is,
its home and its environment.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from prepare.host.trust import enterable_by_others

# The user the smoke run runs as, when fdl-prepare is root: `dynamic`, a
# uid of its own for the run (DYNAMIC_UIDS), not `nobody`, which the box's
# other daemons share (their files, an NFS export's squashed ones).
DYNAMIC = "dynamic"
DEFAULT_USER = DYNAMIC
# The uids (and gids, the same numbers) a dynamic smoke run takes: none a
# user or group of the box has, none a process runs as, each held by a
# lock for the run. Inside the range systemd leaves unused (between
# systemd-homed's 60001-60513 and nspawn's and DynamicUser's from 60514),
# above useradd's UID_MAX (60000).
DYNAMIC_UIDS = (60600, 60699)
# Nix's build users' group (its default, and NixOS's): a smoke run as one
# of them could write into a build running now.
NIX_BUILD_GROUP = "nixbld"
_NIX_BUILD_USER = re.compile(r"nixbld\d*")


def is_nix_build_user(name: str, gid: int) -> bool:
    """Whether `name` (primary group `gid`) is one of Nix's build users: by
    the name Debian's and NixOS's setup give them, or by membership of the
    build group. The daemon runs other people's builds as them."""
    import grp

    if _NIX_BUILD_USER.fullmatch(name):
        return True
    try:
        builders = grp.getgrnam(NIX_BUILD_GROUP)
    except KeyError:
        return False
    return gid == builders.gr_gid or name in builders.gr_mem


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


def clean_env(environ: dict[str, str] | os._Environ[str], home: str) -> dict[str, str]:
    """The smoke run's environment: the caller's PATH, locale, GPU masks and
    driver variables, and `home` as HOME and TMPDIR."""
    env = {k: v for k, v in environ.items() if k in CLEAN_ENV or k.startswith(CLEAN_PREFIXES)}
    env.setdefault("PATH", "/run/current-system/sw/bin:/usr/local/bin:/usr/bin:/bin")
    env["HOME"] = home
    env["TMPDIR"] = home
    return env


def command(confinement: Confinement, status_fd: int, argv: list[str], *, pidns: bool = True) -> list[str]:
    """The helper's command line that runs `argv` confined, reporting on
    `status_fd` (prepare/host/confine_helper.py reads it back in this
    order). The environment travels in it as KEY=VALUE words, not as the
    helper's own: Python coerces a C locale at start (PEP 538) by setting
    LC_CTYPE, which the run must not inherit."""
    from prepare.host import confine_helper

    c = confinement
    ids = ["-" if c.uid is None else str(c.uid), "-" if c.gid is None else str(c.gid)]
    groups = ",".join(str(g) for g in c.groups) or "-"
    env = [f"{k}={v}" for k, v in sorted(c.env.items())]
    helper = [sys.executable or "python3", "-I", "-S", confine_helper.__file__]
    return [*helper, *ids, groups, str(status_fd), "1" if pidns else "0", *env, "--", *argv]


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
    # The lock that holds a dynamic uid for the run (let go by `leave`).
    held: int | None = None

    def describe(self, mode: str | None) -> str:
        """How it ran, for the note: the user and groups, and the containment."""
        if self.held is not None:
            who = f"as uid {self.uid}, one of its own"
        else:
            who = f"as {self.user}" if self.uid is not None else f"as {self.user} (fdl-prepare is not root)"
        groups = f" with {', '.join(self.group_names)}" if self.group_names else ""
        within = {
            "private": "in a PID namespace of its own, with its own /proc, /tmp, /var/tmp and /dev/shm",
            "pidns": "in a PID namespace of its own",
            "reaper": "under a subreaper",
        }.get(mode or "", "")
        return f"{who}{groups}, no capabilities, a clean environment{', ' + within if within else ''}"


def enter(user: str, environ: dict[str, str] | os._Environ[str] | None = None) -> Confinement:
    """Resolve `user` (as root) and make the run's home. Raises a permanent
    Fail for a user that does not exist or is root. The caller must `leave`."""
    import pwd

    from prepare.fail import Fail

    environ = os.environ if environ is None else environ
    _remove_left_homes(environ)
    if os.geteuid() != 0:
        me = _name(os.geteuid())
        home = _make_home(None, None, environ)
        return Confinement(me, None, None, (), (), home, clean_env(environ, home))
    groups, names = _gpu_groups()
    if user == DYNAMIC:
        uid, held = _dynamic_uid()
        try:
            home = _make_home(uid, uid, environ)
        except BaseException:
            os.close(held)
            raise
        return Confinement(f"uid {uid}", uid, uid, groups, names, home, clean_env(environ, home), held)
    fix = (
        f"set smoke_user in [join] (--smoke-user) to {DYNAMIC!r} (the default: a uid of the run's own) or to an "
        "unprivileged user that exists on this box, or create one (`sudo useradd --system --no-create-home "
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
    if is_nix_build_user(user, entry.pw_gid):
        raise Fail(
            "config.invalid",
            f"smoke_user = {user!r} is one of Nix's build users (group {NIX_BUILD_GROUP}): a smoke run as it could "
            f"write into a build running now, whose output every later attempt trusts. Fix: {fix}",
        )
    home = _make_home(entry.pw_uid, entry.pw_gid, environ)
    return Confinement(user, entry.pw_uid, entry.pw_gid, groups, names, home, clean_env(environ, home))


def _gpu_groups() -> tuple[tuple[int, ...], tuple[str, ...]]:
    import grp

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
    return tuple(groups), tuple(names)


def _dynamic_uid() -> tuple[int, int]:
    """A uid of DYNAMIC_UIDS no user, group or process of the box has, and
    the fd of the lock that holds it for this run (two attempts at once
    never share one). A permanent Fail when every one is taken."""
    import fcntl
    import grp
    import pwd

    from prepare.fail import Fail
    from prepare.host import human, locks

    try:
        locks.private_dir(locks.ROOT_DIR)
    except OSError as err:
        raise Fail(
            "dirs.unwritable",
            f"cannot hold a uid for the smoke run: {locks.ROOT_DIR}: {err.strerror or human.oserror(err)}",
        ) from None
    running = _uids_running()
    low, high = DYNAMIC_UIDS
    for uid in range(low, high + 1):
        if uid in running:
            continue
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(uid)
            continue
        except KeyError:
            pass
        try:
            fd = locks.open_lock(os.path.join(locks.ROOT_DIR, f"smoke-uid.{uid}"))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return uid, fd
    raise Fail(
        "config.invalid",
        f"no uid of {low}-{high} is free for the smoke run (each is a user or group of this box, runs a process, or "
        f"is held by another smoke run): free some, or set smoke_user (--smoke-user) to an unprivileged user",
    )


def _uids_running() -> set[int]:
    """Every uid a process of the box runs as (real, effective, saved, fs)."""
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/status", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            # The Uid: line is in the first lines; one read of raw bytes
            # costs a third of a line-by-line text read.
            head = os.read(fd, 4096)
        except OSError:
            continue
        finally:
            os.close(fd)
        start = head.find(b"\nUid:")
        if start >= 0:
            line = head[start + 5 : head.find(b"\n", start + 1)]
            found.update(int(u) for u in line.split() if u.isdigit())
    return found


def leave(confinement: Confinement) -> None:
    """Remove the run's home (never through a link: rmtree walks by fd),
    and let go of its uid."""
    import shutil

    shutil.rmtree(confinement.home, ignore_errors=True)
    if confinement.held is not None:
        os.close(confinement.held)


# A run's home is named for the fdl-prepare that made it, so the next
# attempt can tell one a SIGKILL left (its maker is gone) from one in use.
HOME_PREFIX = "fdl-smoke-"


def _remove_left_homes(environ: dict[str, str] | os._Environ[str]) -> None:
    """The homes of smoke runs whose fdl-prepare is gone (it was SIGKILLed
    before `leave`), each a real directory, removed without following a
    link."""
    import shutil

    for where in dict.fromkeys(c for c in (environ.get("TMPDIR") or "", "/tmp", "/var/tmp") if c):
        try:
            names = os.listdir(where)
        except OSError:
            continue
        for name in names:
            pid = name[len(HOME_PREFIX) :].partition("-")[0]
            if not name.startswith(HOME_PREFIX) or not pid.isdigit():
                continue
            try:
                os.kill(int(pid), 0)
                continue
            except ProcessLookupError:
                pass
            except OSError:
                continue
            shutil.rmtree(os.path.join(where, name), ignore_errors=True)


def _name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _make_home(uid: int | None, gid: int | None, environ: dict[str, str] | os._Environ[str]) -> str:
    """A directory of the run's own, 0700, under a temporary directory it
    can reach (root's TMPDIR may be /tmp/user/0, which it cannot)."""
    import tempfile

    from prepare.fail import Fail
    from prepare.host import human

    candidates = [environ.get("TMPDIR") or "", "/tmp", "/var/tmp"]
    usable = [c for c in candidates if c and (uid is None or enterable_by_others(c))]
    for where in dict.fromkeys(usable):
        try:
            home = tempfile.mkdtemp(prefix=f"{HOME_PREFIX}{os.getpid()}-", dir=where)
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
