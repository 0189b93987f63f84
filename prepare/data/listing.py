"""Proving a dataset root is a listable directory, without hanging on it.

A dead sshfs mount answers `stat` by never answering, so the root is only
ever looked at from a child process (`prepare/data/_list_root.py`) that
`prepare.host.proc` kills at `list_timeout_s`. A thread would not do: a thread
stuck in the kernel on a dead mount cannot be cancelled and keeps the
process from exiting.
"""

from __future__ import annotations

import errno
import sys

from prepare.data import _list_root
from prepare.data.url import Source
from prepare.fail import Fail
from prepare.host import proc

# How much longer than the listing itself the child may take to start and
# answer before it is killed (it never touches the mount, so this is only a
# bound on a machine too loaded to start Python).
CHILD_GRACE_S = 10.0

# Errors that describe the path itself: retrying cannot change them. Anything
# else from a listing (EIO, ENOTCONN, ESTALE, ETIMEDOUT, ...) is the far side
# of a mount misbehaving, which the next attempt may not meet.
_PATH_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENAMETOOLONG})


class Disconnected(Fail):
    """The mount's FUSE process is gone (ENOTCONN)."""


def verify(path: str, timeout: float, *, mounted_from: Source | None, foreign: bool = False) -> None:
    """Prove `path` is a listable directory, from a killable child.

    `mounted_from` None: a bare `data_path`, whose faults are the operator's
    to fix (permanent). Otherwise the root of a mount of that source, or
    (`foreign`) of some other mount found where that source belongs."""
    python = sys.executable or "python3"
    what, fix = _wording(path, mounted_from, foreign)
    hung = Fail(
        "data.dead-mount",
        f"listing {what} {path} did not finish within {timeout:g}s: a dead or wedged mount "
        f"(the far side stopped answering). It may come back; if it does not, drop it with "
        f"`fusermount -u -z {path}` (or `sudo umount -l {path}`) and run again.",
    )
    try:
        # By file path: -I leaves the package off sys.path, and the child
        # needs nothing but the standard library.
        done = proc.run(
            [python, "-I", "-S", _list_root.__file__, path, repr(float(timeout))],
            timeout=timeout + CHILD_GRACE_S,
            cwd="/",
        )
    except proc.TimedOut:
        raise hung from None
    except proc.Missing:
        raise Fail(
            "host.python-missing", f"cannot check {what} {path}: the Python interpreter {python!r} is not runnable"
        ) from None
    except proc.ExecFailed as failed:
        raise Fail(
            "data.check-failed",
            f"cannot check {what} {path}: the check could not be started ({failed}); the next attempt retries",
        ) from None

    words = done.stdout.strip().split(" ", 2)
    if not done.ok or len(words) < 2:
        raise Fail(
            "data.check-failed",
            f"checking {what} {path} failed (the check exited {done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[:500]}",
        )
    stage, code = words[0], int(words[1]) if words[1].lstrip("-").isdigit() else 0
    reason = words[2] if len(words) > 2 else ""
    if stage == "ok":
        return
    if stage == "timeout":
        raise hung
    raise _refused(path, stage, code, reason, what, fix)


def _wording(path: str, mounted_from: Source | None, foreign: bool) -> tuple[str, str]:
    """How the messages name the root, and the fix they offer for it."""
    if mounted_from is None:
        return "dataset root", (
            "provision it (create or mount it), point `data_path` at a directory that exists, "
            "or set `data_source` so fdl-prepare mounts it there"
        )
    if foreign:
        return "the dataset root", (
            f"unmount it (`fusermount -u {path}` or `sudo umount {path}`) so data_source `{mounted_from.url}` "
            f"can be mounted there"
        )
    return "the mounted dataset root", f"check the remote directory named by data_source `{mounted_from.url}`"


def _refused(path: str, stage: str, code: int, reason: str, what: str, fix: str) -> Fail:
    """The Fail for a listing the kernel answered with an error."""
    if stage == "notdir":
        return Fail("data.root-unusable", f"{what} {path} is not a directory; {fix}.")
    if code == errno.ENOENT:
        return Fail("data.root-unusable", f"{what} {path} does not exist; {fix}.")
    # The kernel answers ENOTCONN once a FUSE daemon is gone, and
    # ECONNABORTED to the first requests after an abort.
    if code in (errno.ENOTCONN, errno.ECONNABORTED):
        return Disconnected(
            "data.dead-mount",
            f"{what} {path} is a FUSE mount whose process is gone ({reason}); "
            f"`fusermount -u -z {path}` drops it, then run again.",
        )
    if code in _PATH_ERRNOS:
        return Fail("data.root-unusable", f"{what} {path} cannot be listed: {reason} (errno {code}); {fix}.")
    return Fail(
        "data.dead-mount",
        f"{what} {path} cannot be listed: {reason} (errno {code}), a fault of the mount or the far "
        f"side that may clear; if it persists, `fusermount -u -z {path}` and run again.",
    )
