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

The work is done by prepare/host/confine_helper.py run as a script, by
`prepare.host.proc` (`command` here gives its command line): a fresh,
single-threaded interpreter may fork freely, which a threaded caller (a
join loop) may not. This module is the library's side: who the run is,
its home and its environment.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from prepare.host.trust import enterable_by_others

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
