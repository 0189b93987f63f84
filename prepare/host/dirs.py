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

No subprocesses: `df` and `stat -f` hang on a dead network mount, and the
filesystem type and free space are one read of /proc and one statvfs away.
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


def check(notes: list[str], *, change: bool = True) -> LocalDirs:
    """Create the dataset cache, find the stage, prove both writable.

    Raises a permanent `Fail` naming the directory, the error, the variable
    that chose it and the command that fixes it. Appends notes for a
    RAM-backed directory, less than 1 GiB free, and an unset HOME.

    `change` False (`fdl-prepare check`): nothing is created. A missing
    cache is judged by the directory it would be created in, which must
    take the probe (written and removed, as every probe is)."""
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
    path: str, what: str, origin: str, exc: OSError, *, creating: bool = False, var: str | None = None
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
        user = human.user()
        if creating:
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
