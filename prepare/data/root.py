"""Step 2: the dataset source root.

Three shapes, and the empty one is the common case:

- nothing declared: ship nothing, check nothing (the training binary keeps
  its own default, which is what a run that never mentions data expects);
- `data_path` alone: a root provisioning already placed. Verified to be a
  listable directory and shipped absolute, lexically: the path is handed to
  this host's ranks, and resolving symlinks would silently replace what the
  operator declared. A relative one (or one starting with `~`) was refused
  by the plan (prepare.plan) rather than resolved: it would mean the cwd of
  whoever started us, which under systemd is `/`;
- `data_source = "sshfs://[user@]host[:port]/abs/path"`: mounted read-only at
  `data_path` (default `/flodl/data`) unless something is mounted there
  already, which is reused (and named, when it is not the configured source).

Read-only is the invariant, not a precaution: ranks read the source root and
never write it (anything missing goes to the node-local cache), so `ro` puts
the kernel behind what was only a convention.

The mount outlives the attempt and the run: it is provisioning state, and it
is what makes the next attempt cheap (it finds the mount and reuses it).

Nothing here may hang. A dead sshfs mount answers `stat` by never answering,
so "is something mounted there" is read from /proc/self/mountinfo, and the
mountpoint itself is only ever looked at from a child process that
`prepare.host.proc` kills at `list_timeout_s` (`prepare.data.listing`).

Where the rest lives: the `sshfs://` grammar and the sshfs command line in
`prepare.data.url`, making or reusing the mount in `prepare.data.mount`, the
bounded listing in `prepare.data.listing` (its child is `prepare/data/_list_root.py`),
the lock file itself in `prepare.host.locks`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prepare.fail import Fail
from prepare.spec import SshSpec

if TYPE_CHECKING:
    from prepare.data.url import Source

# How long a second prepare waits for the first to finish mounting before it
# gives up (transient) rather than queueing forever behind a wedged one.
LOCK_GRACE_S = 15.0


@dataclass(frozen=True)
class DataPlan:
    """The dataset root's part of the plan (prepare.plan): `path` absolute
    and lexical (None: nothing declared), the mountpoint when `source` is
    set; `source` the `sshfs://` source parsed, with the tunnel's defaults;
    the ssh block the mount uses; and what resolving the source said."""

    path: str | None = None
    source: Source | None = None
    ssh: SshSpec = field(default_factory=SshSpec)
    list_timeout_s: float = 10.0
    notes: tuple[str, ...] = ()


# -- the step ----------------------------------------------------------------


def ensure(plan: DataPlan, notes: list[str]) -> str | None:
    """Put the dataset source root in place and return its absolute path,
    or None when nothing is declared."""
    notes.extend(plan.notes)
    if plan.path is None:
        return None
    # Imported here: a box that declares no dataset (every CPU worker's
    # re-dial, say) pays nothing for the mount and listing machinery.
    from prepare.data import listing, mount

    if plan.source is None:
        listing.verify(plan.path, plan.list_timeout_s, mounted_from=None)
        return plan.path
    with _mount_lock(plan.path, plan.list_timeout_s):
        mount.establish(plan.source, plan.path, plan.ssh, plan.list_timeout_s, notes)
    return plan.path


def check(plan: DataPlan, notes: list[str]) -> tuple[str | None, str, str]:
    """Step 2 of `fdl-prepare check`: what `ensure` would settle, settled
    without mounting. A bare `data_path` is listed as an attempt lists it;
    a mount already at the mountpoint is judged as `ensure` judges it; an
    sshfs source not mounted yet is reached with sftp, with the options
    the mount would use (prepare.data.mount.reach). Returns the path, a
    verdict ("ok", "would mount", "would remount", "skipped") and what it
    found; raises what the attempt would."""
    notes.extend(plan.notes)
    if plan.path is None:
        return None, "skipped", "no dataset root declared (data_path, data_source): the run keeps its own default"
    from prepare.data import listing, mount

    if plan.source is None:
        listing.verify(plan.path, plan.list_timeout_s, mounted_from=None)
        return plan.path, "ok", f"{plan.path} is a listable directory"
    verdict, said = mount.inspect(plan.source, plan.path, plan.ssh, plan.list_timeout_s, notes)
    return plan.path, verdict, said


# -- one mounter at a time ---------------------------------------------------


def _lock_dir() -> str:
    """The directory of the mount locks: one no one else can create in or
    open a lock of. A lock another user can open is a lock they can hold
    (a shared flock is enough), and every attempt would then wait its bound
    and fail `lock.busy`, blaming another fdl-prepare: so not /run/lock,
    which every user can write. Root's is `locks.ROOT_DIR`; another user's is
    its runtime directory, else one of its own under the temporary
    directory. Made 0700 when missing; `locks.private_dir` holds it to
    that. Root and a service user no longer share one: each serialises its
    own mounts (two users cannot mount at one data_path anyway)."""
    import tempfile

    from prepare.host import locks

    if os.geteuid() == 0:
        return locks.ROOT_DIR
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "fdl-prepare")
    return os.path.join(tempfile.gettempdir(), f"fdl-prepare-locks.{os.geteuid()}")


def lock_path(mountpoint: str) -> str:
    import hashlib

    key = hashlib.sha256(os.fsencode(mountpoint)).hexdigest()[:16]
    return os.path.join(_lock_dir(), f"fdl-prepare-mount.{key}.lock")


@contextmanager
def _mount_lock(mountpoint: str, list_timeout_s: float) -> Iterator[None]:
    """Two prepares on one box must not both mount: the second would stack a
    second sshfs on the first. The lock is keyed by the mountpoint, lives
    outside it, and is released by the kernel if its holder dies."""
    from prepare.data import listing, mount
    from prepare.host import human, locks

    path = lock_path(mountpoint)
    # What a holder can spend: a mount, its verbose retry or a remount of a
    # dead mount, and the listings around them, all bounded.
    wait = 3 * mount.MOUNT_TIMEOUT_S + 3 * (list_timeout_s + listing.CHILD_GRACE_S) + LOCK_GRACE_S

    def cannot_open(err: OSError) -> Fail:
        shown = human.printable(path)
        if err.errno in (errno.EISDIR, errno.EINVAL):
            fix = f"it is not a lock file (a directory or a device is in its place): remove it (`sudo rm -r {shown}`)"
        elif isinstance(err, locks.NotPrivate):
            fix = str(err)
        else:
            fix = f"make {human.printable(os.path.dirname(path))} a directory of this user's, mode 0700"
        return Fail(
            "dirs.unwritable",
            f"cannot open the mount lock {shown} for data_path {human.printable(mountpoint)}: "
            f"{human.oserror(err)}; {fix}",
        )

    with locks.held(
        path,
        wait,
        private=True,
        cannot_open=cannot_open,
        stuck=(
            f"another fdl-prepare has held the mount lock for {mountpoint} ({path}) for "
            f"over {wait:g}s; it is probably stuck mounting. Retry later."
        ),
    ):
        yield
