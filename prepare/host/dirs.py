"""Step 3: the node-local directories a run writes to.

The dataset cache (`$HOME/.flodl/data`) and the disk stage (the temp dir)
are checked here, after the GPU gate and the dataset root and before any
build: an unwritable stage discovered after a cold build has wasted the
build, and discovered after the dial it has burned the admission window.

Writability is proven by writing, fsyncing and removing a probe file, never
inferred from permission bits: mode bits say nothing about a read-only
mount, a full filesystem, a quota, an immutable attribute or root squash on
NFS, and root passes every permission check anyway. The fsync matters on
filesystems with delayed allocation, where a full disk only shows at flush.

Every failure here is permanent: no retry makes a read-only mount writable
or frees a disk, so a persist loop must stop and say what to change.

No `df` or `stat -f`: they hang on a dead network mount, and the
filesystem type and free space are one read of /proc and one statvfs away.

With a training user (`user`, prepare.host.training_user) the directories
are that user's: the cache under its home from the password database, and
both are created and probed by a child that has become that user before it
touches them (`_as_user`). Root never walks a path the user can change, so
a symlink the user planted in its own home leads root nowhere, and the cache
is the user's because the user made it.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
import threading
from dataclasses import dataclass

from prepare.fail import Fail
from prepare.host import human, mounts
from prepare.host.training_user import TrainingUser
from prepare.notes import warning

# Below this the cache or stage is likely to fill during a run: worth a note,
# not a refusal, because a small dataset fits in much less.
LOW_SPACE_BYTES = 1 << 30

# Filesystems whose pages live in RAM: everything staged or cached there
# competes with the training process for memory and is gone at reboot.
RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})

PROBE_PREFIX = ".fdl-prepare-probe-"

# Large enough to need a real block on every filesystem (a tiny write can sit
# in an inode's inline data and never meet a full disk).
_PROBE_BYTES = b"fdl-prepare writability probe\n" * 140

# The order tempfile.gettempdir() consults them in.
STAGE_ENV = ("TMPDIR", "TEMP", "TMP")
STAGE_DEFAULT = "/tmp"


@dataclass(frozen=True)
class LocalDirs:
    cache: str
    stage: str
    # What an attempt would create (only a check, which creates nothing,
    # leaves any): the dataset cache, when it is missing.
    missing: tuple[str, ...] = ()


def check(notes: list[str], *, change: bool = True, user: TrainingUser | None = None) -> LocalDirs:
    """Create the dataset cache, find the stage, prove both writable.

    Raises a permanent `Fail` naming the directory, the error, the variable
    that chose it and the command that fixes it. Appends notes for a
    RAM-backed directory, less than 1 GiB free, and an unset HOME.

    `change` False (`fdl-prepare check`): nothing is created. A missing
    cache is judged by the directory it would be created in, which must
    take the probe (written and removed, as every probe is).

    `user`: the training user's directories, proven as that user."""
    if user is not None:
        return _check_for(user, notes, change=change)
    home, home_origin = _home(notes)
    cache = os.path.join(home, ".flodl", "data")
    what = f"dataset cache {cache}"
    missing: tuple[str, ...] = ()
    if change:
        _create(cache, what, home_origin)
        _probe(cache, what, home_origin)
    else:
        anchor = _nearest_existing(cache)
        if not os.path.isdir(cache):
            if not os.path.isdir(anchor):
                err = OSError(errno.ENOTDIR if anchor != cache else errno.EEXIST, "Not a directory")
                raise _unusable(cache, what, home_origin, err, creating=True)
            probe(anchor, what, home_origin, creating=cache)
            missing = (cache,)
        else:
            _probe(cache, what, home_origin)

    stage, stage_origin = _stage()
    _probe(stage, f"stage directory {stage}", stage_origin)

    _observe(_nearest_existing(cache), "dataset cache", "cached datasets", home_origin, notes)
    _observe(stage, "stage directory", "staged files", stage_origin, notes)
    return LocalDirs(cache=cache, stage=stage, missing=missing)


# -- the training user's -----------------------------------------------------

# Run by a fresh interpreter that root starts and that becomes the user
# before it touches a path (it imports nothing after that: the interpreter's
# own files may be root's alone). It prints "ok", "ok missing" (check mode:
# the cache is not there, and where it would be made takes the probe), or
# "fail STEP ERRNO PATH".
_AS_USER = r"""
import os, sys
name, uid, gid, mode, path, probe_name = sys.argv[1:7]
data = "fdl-prepare writability probe\n" * 140
if os.geteuid() != int(uid):
    os.initgroups(name, int(gid))
    os.setgid(int(gid))
    os.setuid(int(uid))
step, where, said = "create", path, "ok"
try:
    if mode == "create":
        os.makedirs(path, exist_ok=True)
    elif mode == "check" and not os.path.isdir(path):
        where = path
        while where != "/" and not os.path.lexists(where):
            where = os.path.dirname(where)
        if not os.path.isdir(where):
            raise NotADirectoryError(20, "Not a directory", where)
        said = "ok missing"
        path = where
    step, where = "write", path
    probe = os.path.join(path, probe_name)
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data.encode())
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        step = "remove"
        os.unlink(probe)
except OSError as exc:
    print("fail", step, exc.errno or 0, where)
    sys.exit(1)
print(said)
"""

# A dead network home can hang a write for ever: past this, the step stops.
AS_USER_TIMEOUT_S = 60.0


def _check_for(user: TrainingUser, notes: list[str], *, change: bool) -> LocalDirs:
    if not os.path.isabs(user.home):
        raise Fail(
            "dirs.no-home",
            f"the training user {user.name} (user, --user) has the home {user.home!r} in the password database, "
            f"which is not an absolute path, so there is no place for its dataset cache ($HOME/.flodl/data): give "
            f"it a home (sudo usermod -d /home/{user.name} -m {user.name})",
        )
    origin = f"the home of the training user {user.name} (user, --user) in the password database"
    var = f"{user.name}'s home (sudo usermod -d DIR -m {user.name})"
    cache = os.path.join(user.home, ".flodl", "data")
    what = f"dataset cache {cache}"
    said = _as_user(user, "create" if change else "check", cache, what, origin, var)
    missing = (cache,) if said == "ok missing" else ()
    stage, stage_origin = _stage()
    _as_user(user, "probe", stage, f"stage directory {stage}", stage_origin, _var(stage_origin, "TMPDIR"))
    _observe(_nearest_existing(cache), "dataset cache", "cached datasets", origin, notes)
    _observe(stage, "stage directory", "staged files", stage_origin, notes)
    return LocalDirs(cache=cache, stage=stage, missing=missing)


def _as_user(user: TrainingUser, mode: str, path: str, what: str, origin: str, var: str) -> str:
    """Run `_AS_USER` as `user` on `path`; its "ok" word, or the Fail its
    error calls for. As that user already, the same in a child: one way."""
    import sys

    from prepare.host import proc

    name = f"{PROBE_PREFIX}{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}"
    argv = [sys.executable or "python3", "-I", "-S", "-c", _AS_USER, user.name, str(user.uid), str(user.gid)]
    argv += [mode, path, name]
    try:
        done = proc.run(argv, timeout=AS_USER_TIMEOUT_S, env={}, cwd="/")
    except proc.TimedOut:
        raise Fail(
            "dirs.unwritable",
            f"{what} (from {origin}): writing a probe there as {user.name} did not finish within "
            f"{AS_USER_TIMEOUT_S:g}s: the filesystem under it hangs (a dead network home?); check "
            f"`ls {os.path.dirname(path)}` and its mount",
        ) from None
    except proc.ExecFailed as failed:
        raise Fail(
            "dirs.unwritable", f"{what}: could not start a process as {user.name} to prove it ({failed})"
        ) from None
    words = done.stdout.split()
    if done.ok and words[:1] == ["ok"]:
        return " ".join(words)
    if len(words) >= 4 and words[0] == "fail" and words[2].isdigit():
        step, code, where = words[1], int(words[2]), done.stdout.split(" ", 3)[3].rstrip("\n")
        err = OSError(code, os.strerror(code) if code else "failed")
        if step == "remove":
            raise Fail(
                "dirs.unwritable",
                f"{what} (from {origin}): the probe was written but cannot be removed by {user.name}: "
                f"{human.oserror(err)}; check the directory's permissions and mount options",
            )
        creating = step == "create" or where != path
        link = _link_below(path, user.home) if code in (errno.EACCES, errno.EPERM) else None
        if link is not None:
            raise Fail(
                "dirs.unwritable",
                f"{what} (from {origin}) {'cannot be created' if creating else 'is not writable'} by {user.name}: "
                f"{human.oserror(err)}; {link[0]} is a symbolic link (to {link[1]}), and the training user's "
                f"directories are made and probed as {user.name}, never by root through its links: remove the "
                f"link (sudo rm {link[0]}) and the cache is made there, owned by {user.name}",
            )
        raise _unusable(path if creating else where, what, origin, err, creating=creating, var=var, who=user.name)
    raise Fail(
        "dirs.unwritable",
        f"{what}: the probe run as {user.name} exited {done.returncode}"
        + (f": {human.printable(done.stderr.strip()[-400:])}" if done.stderr.strip() else "")
        + f"; check that {user.name} can run {sys.executable}",
    )


# -- where the directories are ---------------------------------------------


def _home(notes: list[str]) -> tuple[str, str]:
    """HOME, or the password database's home for this uid when HOME is unset
    (a systemd unit without User= or with a stripped environment). Returns
    the directory and how to change it, for messages."""
    home = os.environ.get("HOME")
    if home:
        if not os.path.isabs(home):
            raise Fail(
                "dirs.no-home",
                f"HOME={home!r} is not an absolute path, so the dataset cache "
                f"($HOME/.flodl/data) would move with the working directory: "
                f"set HOME to an absolute path (Environment=HOME=/var/lib/fdl in a systemd unit)",
            )
        return home, f"HOME={home}"
    uid = os.getuid()
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        entry = None
    if entry is None or not entry.pw_dir or not os.path.isabs(entry.pw_dir):
        raise Fail(
            "dirs.no-home",
            f"HOME is unset and uid {uid} has no home directory in the password "
            f"database, so there is no place for the dataset cache ($HOME/.flodl/data): "
            f"set HOME to a writable directory (Environment=HOME=/var/lib/fdl in a systemd unit)",
        )
    notes.append(
        warning(
            f"HOME is unset: the dataset cache goes under {entry.pw_dir}, the home of "
            f"{entry.pw_name} (uid {uid}) in the password database; set HOME to choose another place"
        )
    )
    return entry.pw_dir, f"HOME (unset; {entry.pw_dir} is {entry.pw_name}'s home in the password database)"


def _stage() -> tuple[str, str]:
    """The temp dir as tempfile.gettempdir() would pick it, minus its silent
    fallback: gettempdir skips a TMPDIR that does not exist and carries on
    with /tmp, so a typo in a unit file would stage gigabytes somewhere the
    operator did not choose. Here the first variable that is set must hold."""
    for name in STAGE_ENV:
        value = os.environ.get(name)
        if value:
            path = os.path.abspath(value)
            origin = f"{name}={value}"
            break
    else:
        path = STAGE_DEFAULT
        origin = f"the default {STAGE_DEFAULT} (TMPDIR, TEMP and TMP are unset; set TMPDIR to choose)"
    if human.printable(path) != path:
        # Every message naming it would print it: a newline there forges a
        # whole line of our output.
        raise Fail(
            "dirs.unwritable",
            f"stage directory {human.printable(path)} (from {human.printable(origin)}) has a control character "
            f"(or one that hides text); point {_var(origin, 'TMPDIR')} at a plain path",
        )
    try:
        st = os.stat(path)
    except OSError as exc:
        if path == STAGE_DEFAULT and not origin.startswith(STAGE_ENV):
            fix = f"create it (sudo mkdir -m 1777 {path}) or set TMPDIR to an existing directory"
        else:
            fix = f"create it (mkdir -p {path}) or point {_var(origin, 'TMPDIR')} at an existing directory"
        raise Fail(
            "dirs.unwritable", f"stage directory {path} (from {origin}) cannot be used: {human.oserror(exc)}; {fix}"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise Fail(
            "dirs.unwritable",
            f"stage directory {path} (from {origin}) is not a directory; point {_var(origin, 'TMPDIR')} at a directory",
        )
    return path, origin


# -- proving writability -----------------------------------------------------


def prove_writable(path: str, what: str, origin: str, *, var: str) -> None:
    """Create `path` if needed and prove it writable, for directories of
    other steps (the build's state directory); `var` is the setting that
    moves it, named in the fix."""
    _create(path, what, origin, var=var)
    _probe(path, what, origin, var=var)


def _create(path: str, what: str, origin: str, *, var: str | None = None) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise _unusable(path, what, origin, exc, creating=True, var=var) from None


def probe(directory: str, what: str, origin: str, *, var: str | None = None, creating: str | None = None) -> None:
    """`_probe`, for a check of other steps (the state directory): with
    `creating`, `directory` is where that missing directory would be made,
    and a failure says it cannot be created."""
    _probe(directory, what, origin, var=var, creating=creating)


def nearest_existing(path: str) -> str:
    """`path`, or the nearest directory above it that exists."""
    return _nearest_existing(path)


def _probe(directory: str, what: str, origin: str, *, var: str | None = None, creating: str | None = None) -> None:
    """Write, fsync and remove a probe. The name carries pid and thread id so
    concurrent prepares (a persist loop racing a manual run, or threads of
    one join loop) never touch each other's probe, and a random tail with
    O_EXCL so a recycled pid cannot collide with a leftover either."""
    name = f"{PROBE_PREFIX}{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}"
    path = os.path.join(directory, name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise _unusable(creating or directory, what, origin, exc, creating=creating is not None, var=var) from None
    failure: Fail | None = None
    try:
        try:
            view = memoryview(_PROBE_BYTES)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        failure = _unusable(creating or directory, what, origin, exc, creating=creating is not None, var=var)
    finally:
        # The file was created, so it is removed whatever happened to the write:
        # a half-written probe on a full disk is exactly the one to clean up.
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if failure is None:
                failure = Fail(
                    "dirs.unwritable",
                    f"{what} (from {origin}): the probe {path} was written but cannot be "
                    f"removed: {human.oserror(exc)}; remove it by hand (rm -f {path}) and check "
                    f"the directory's permissions and mount options",
                )
    if failure is not None:
        raise failure


def unusable(
    path: str, what: str, origin: str, exc: OSError, *, creating: bool = False, var: str | None = None
) -> Fail:
    """The permanent Fail for a directory that cannot be created or
    written, worded from the error: for directories of other steps (the
    build's state directory), where `var` is the setting that moves it."""
    return _unusable(path, what, origin, exc, creating=creating, var=var)


def _unusable(
    path: str,
    what: str,
    origin: str,
    exc: OSError,
    *,
    creating: bool = False,
    var: str | None = None,
    who: str | None = None,
) -> Fail:
    verb = "cannot be created" if creating else "is not writable"
    var = var or _var(origin, "TMPDIR")
    code = exc.errno
    anchor = _nearest_existing(path)
    mount = _mount_of(anchor)
    mountpoint = mount.mount_point if mount else anchor
    if code == errno.EROFS:
        fix = (
            f"the filesystem mounted at {mountpoint} is read-only: "
            f"sudo mount -o remount,rw {mountpoint}, or point {var} at a writable filesystem"
        )
    elif code in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(anchor)
        room = f" ({human.size(free)} free)" if free is not None else ""
        fix = (
            f"the filesystem mounted at {mountpoint}{room} is full or over quota: free space there "
            f"(du -xsh {mountpoint}/* | sort -h shows what fills it), or point {var} at a "
            f"filesystem with room"
        )
    elif code in (errno.EACCES, errno.EPERM):
        user = who or human.user()
        if creating and who is not None:
            fix = (
                f"{user} may not create it in {anchor}: a home should be its user's (sudo chown {user}: {anchor} "
                f"when {anchor} is {user}'s home), or point {var} at a directory {user} owns"
            )
        elif creating:
            fix = (
                f"{user} may not create it in {anchor}: "
                f"sudo mkdir -p {path} && sudo chown {user} {path}, or point {var} at a "
                f"directory {user} owns"
            )
        else:
            fix = (
                f"{user} may not write there: sudo chown {user} {path}, or point {var} at a "
                f"directory {user} owns (if it is already owned by {user}, check "
                f"lsattr -d {path} for the immutable attribute)"
            )
    elif code in (errno.ENOTDIR, errno.EEXIST):
        blocker = _file_in_the_way(path)
        fix = (
            f"{blocker} is a file, not a directory: move it aside (mv {blocker} {blocker}.bak), "
            f"or point {var} elsewhere"
        )
    else:
        fix = f"check {path} and the filesystem under it, or point {var} at another directory"
    return Fail("dirs.unwritable", f"{what} (from {origin}) {verb}: {human.oserror(exc)}; {fix}")


def _link_below(path: str, top: str) -> tuple[str, str] | None:
    """The first component of `path` below `top` that is a symbolic link,
    and where it points, read without following it."""
    rel = os.path.relpath(path, top)
    if rel.startswith(os.pardir):
        return None
    current = top
    for part in rel.split(os.sep):
        current = os.path.join(current, part)
        try:
            if os.path.islink(current):
                return current, os.readlink(current)
        except OSError:
            return None
    return None


def _nearest_existing(path: str) -> str:
    while path and not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path or "/"


def _file_in_the_way(path: str) -> str:
    """The first component of `path` that exists but is not a directory."""
    parts = os.path.abspath(path).split(os.sep)
    current = os.sep
    for part in parts[1:]:
        current = os.path.join(current, part)
        if os.path.lexists(current) and not os.path.isdir(current):
            return current
        if not os.path.lexists(current):
            break
    return path


# -- notes -------------------------------------------------------------------


def _observe(path: str, label: str, contents: str, origin: str, notes: list[str]) -> None:
    mount = _mount_of(path)
    var = _var(origin, "TMPDIR")
    if mount is not None and mount.fstype in RAM_FILESYSTEMS:
        notes.append(
            warning(
                f"{label} {path} is on {mount.fstype} (mounted at {mount.mount_point}): {contents} spend RAM "
                f"the run may need and vanish at reboot; point {var} at a disk-backed directory"
            )
        )
    free = _free_bytes(path)
    if free is not None and free < LOW_SPACE_BYTES:
        where = f"the filesystem mounted at {mount.mount_point}" if mount else "its filesystem"
        notes.append(
            warning(
                f"{label} {path} has {human.size(free)} free on {where} (under 1 GiB): {contents} may "
                f"fill it mid-run; free space there or point {var} at a larger filesystem"
            )
        )


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _mount_of(path: str) -> mounts.Mount | None:
    try:
        return mounts.containing(path)
    except OSError:
        return None  # no /proc: the notes that need the mount are skipped


# -- wording -----------------------------------------------------------------


def _var(origin: str, fallback: str) -> str:
    head = origin.split("=", 1)[0].split(" ", 1)[0]
    return head if head in ("HOME", *STAGE_ENV) else fallback
