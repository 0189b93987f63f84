"""Two prepares on one box, one at a time: a lock file, waited for within a bound.

Both places that serialise prepares (the mount at a `data_path`, the state
directory of a build) want the same of a lock: `flock`, so the kernel lets
go of it when its holder dies and no stale pid file outlives a crash; a
busy lock waited for, because once the holder is done the waiter's own run
is cheap; and a bound on that wait, so a stuck holder becomes a transient
Fail naming the lock instead of a silent hang.

Lock files are never removed: unlinking a lock another process may be about
to take breaks the exclusion.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prepare.fail import Fail
from prepare.host import human

# The first pause between tries, doubled up to the last: a lock freed soon
# is taken soon, and a long wait does not spin.
_FIRST_PAUSE_S = 0.05
_LAST_PAUSE_S = 1.0


# Where root keeps its locks (the mount locks, the smoke run's uids): a
# directory only root can create in or open anything of, on /run (a tmpfs:
# no lock outlives a boot).
ROOT_DIR = "/run/fdl-prepare/locks"


class NotPrivate(OSError):
    """A lock directory that someone else could create in or open locks of."""


def private_dir(path: str) -> None:
    """Make `path` (mode 0700) when missing, and hold it to being a real
    directory of this user's that no one else may enter: whoever can open a
    lock file can hold it, and whoever can create in its directory can put
    a directory, a FIFO or a lock of their own where the lock goes."""
    parent = os.path.dirname(path)
    with contextlib.suppress(FileExistsError):
        os.makedirs(parent, 0o755, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    shown = human.printable(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotPrivate(errno.ENOTDIR, f"{shown} is not a directory: remove it (`sudo rm {shown}`)")
    if st.st_uid != os.geteuid():
        raise NotPrivate(
            errno.EPERM,
            f"{shown} is owned by uid {st.st_uid}, not this user: someone else made it, and could hold every lock "
            f"in it. Remove it (`sudo rm -r {shown}`); fdl-prepare makes it again, mode 0700",
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        # Ours: tighten it, as it should have been made.
        os.chmod(path, 0o700, follow_symlinks=False)


def open_lock(path: str) -> int:
    """An fd on the lock file at `path`, created (0600) if it is missing."""
    # Read-only is enough for flock. Create only when it is missing (O_EXCL),
    # never through a symlink, and never open a device or a FIFO (opening
    # one can block or act), whoever put it there.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    while True:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            pass
        else:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                os.close(fd)
                code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
                raise OSError(code, "not a regular file (a lock file is one)", path)
            if stat.S_IMODE(mode) & 0o077:
                # One an earlier version made 0644: another user who can
                # open it can hold it. Ours to tighten (another's is not).
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o600)
            return fd
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o600)
        return fd


@contextmanager
def held(
    path: str,
    wait_s: float,
    *,
    cannot_open: Callable[[OSError], Fail],
    stuck: str,
    waiting: Callable[[str], None] | None = None,
    notes: list[str] | None = None,
    private: bool = False,
) -> Iterator[None]:
    """Hold the lock at `path` for the body, waiting at most `wait_s` for it.

    The caller words the failures, so each names its own lock and fix:
    `cannot_open` turns an error opening the file into the Fail to raise,
    and `stuck` is the message of the transient Fail when the wait runs out.
    A busy lock is said at once through `waiting` (a progress step; it gets
    the line to show), and the wait it cost goes to `notes`, when given.
    `private`: the lock's directory is made and held to `private_dir`."""
    try:
        if private:
            private_dir(os.path.dirname(path))
        fd = open_lock(path)
    except OSError as err:
        raise cannot_open(err) from None
    try:
        if not _try(fd):
            if waiting is not None:
                waiting(f"another fdl-prepare holds {path}; waiting for it (up to {human.duration(wait_s)})")
            waited = _wait(fd, wait_s, stuck)
            if notes is not None:
                notes.append(f"another fdl-prepare held {path}: waited {waited:.1f}s for it")
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _wait(fd: int, wait_s: float, stuck: str) -> float:
    """Take the lock within `wait_s`, or raise `stuck`; return the seconds waited."""
    start = time.monotonic()
    deadline = start + wait_s
    pause = _FIRST_PAUSE_S
    while not _try(fd):
        left = deadline - time.monotonic()
        if left <= 0:
            raise Fail("lock.busy", stuck)
        time.sleep(min(pause, left))
        pause = min(pause * 2, _LAST_PAUSE_S)
    return time.monotonic() - start
