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


def open_lock(path: str) -> int:
    """An fd on the lock file at `path`, created if it is missing."""
    # Read-only is enough for flock, and works on a file another user created
    # in a sticky directory. Opening with O_CREAT an existing file owned by
    # someone else there fails under fs.protected_regular, so create only
    # when it is missing. Never through a symlink, and never a device or a
    # FIFO (opening one can block or act), whoever put it there: the mount
    # lock lives in a directory every user can write.
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
            return fd
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o644)
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
) -> Iterator[None]:
    """Hold the lock at `path` for the body, waiting at most `wait_s` for it.

    The caller words the failures, so each names its own lock and fix:
    `cannot_open` turns an error opening the file into the Fail to raise,
    and `stuck` is the message of the transient Fail when the wait runs out.
    A busy lock is said at once through `waiting` (a progress step; it gets
    the line to show), and the wait it cost goes to `notes`, when given."""
    try:
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
