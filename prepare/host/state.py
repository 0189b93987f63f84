"""The state directory, which root writes and removes in: opened, never followed.

`<state>` holds what the build steps keep between attempts: the GC roots
(`gcroots/`), the recipe handed to the flake (`recipe/recipe.json`), the
state lock, the warm-path record, the empty flake registry and the cached
Nix version; and the hand-off to `fdl join` (prepare.handoff): the runs'
writable project directories (`runs/`), the links to the current binary
(`current/`) and the last Prepared (`prepared.json`). fdl-prepare runs as
root and replaces and prunes entries here, so an entry that is a symlink
would send those writes, and the recipe's stray removal, wherever the link
points.

It is never `/` or a directory of a pseudo file system (/proc, /sys,
/dev, cgroups: nothing there is a place to keep state, and writing there
can do harm), and never a directory holding entries fdl-prepare does not
know: a state directory pointed at a directory of someone else's (`/srv`,
a home) is refused, naming what is there, rather than having its
`recipe/` or `gcroots/` taken for ours. Leftover temporary files of ours
(a write stopped by SIGKILL) are removed.

So the directory and every entry of ours in it are looked at with lstat
and opened with O_NOFOLLOW (through a directory fd), must be of the type we
keep there and owned by the running user, and the directory must be
writable by nobody else, since anyone who can write it can swap an entry
for a link between our check and our use. Anything else is a permanent
Fail naming the entry and the fix, never a traceback and never a write
through a link. New files are written under a random name opened with
O_EXCL and renamed into place, so no name is there for anyone to plant
first.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from prepare.fail import Fail
from prepare.host import human

# Our entries and their types: True for a directory, False for a file.
# `gcroots` is made here, the rest when first written.
ENTRIES = {
    "gcroots": True,
    "recipe": True,
    "lock": False,
    "warm.json": False,
    "flake-registry.json": False,
    "nix-version.json": False,
    "nix-tmp": False,
    "sources": True,
    # The hand-off to `fdl join` (prepare.handoff): the runs' project
    # directories (each the training user's, below root's `runs/`), the
    # stable links to the current binary, and the last Prepared.
    "runs": True,
    "current": True,
    "prepared.json": False,
}
# Entries ours that are not vetted as ENTRIES are: a publish's own state
# directory (`<state>/publish`, vetted when a publish uses it).
OTHER_ENTRIES = frozenset({"publish"})
# What `write_at` names a file while it writes it, in the state directory,
# and what earlier versions named one (`recipe.json.<pid>.tmp`): one left
# by a write stopped by SIGKILL is ours, and goes.
_OURS = "|".join(re.escape(n) for n in (*ENTRIES, "recipe.json"))
_TMP_NAME = re.compile(rf"\.(?:{_OURS})\.[0-9a-f]{{16}}\.tmp|(?:{_OURS})\.[0-9]+\.tmp")
# The recipe directory holds the recipe alone (the flake input copies all of it).
RECIPE_FILE = "recipe.json"
# File systems that are no place for state: the kernel's views of itself.
PSEUDO_FS = frozenset(
    {
        "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore",
        "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs", "efivarfs", "autofs", "binfmt_misc", "selinuxfs",
        "nsfs", "rpc_pipefs", "nfsd",
    }
)  # fmt: skip
_PSEUDO_TREES = ("/proc", "/sys", "/dev")

# Read with O_NOFOLLOW and written by renaming a new file over it
# (prepare.build.record): a symlink there is never followed, only replaced, and
# means no more than a missing record (evaluate as usual).
REPLACED_BY_RENAME = frozenset({"warm.json"})

ENTRY_NAMES = {
    "gcroots": "GC roots",
    "recipe": "recipe directory",
    "lock": "lock",
    "warm.json": "warm-path record",
    "flake-registry.json": "empty flake registry",
    "nix-version.json": "cached Nix version",
    "nix-tmp": "record of Nix's build directories",
    "sources": "copies of training sources",
    "runs": "run directories",
    "current": "links to the current run",
    "prepared.json": "last Prepared",
}

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a file"
    return "a special file (device, FIFO or socket)"


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _wrong_type(path: str, found: int, want_dir: bool, what: str) -> Fail:
    want = "a directory" if want_dir else "a file"
    remove = f"rm {path}" if stat.S_ISLNK(found) or not stat.S_ISDIR(found) else f"rm -r {path}"
    return Fail(
        "state.untrusted",
        f"{path}, the {what}, is {_kind(found)}, where fdl-prepare keeps {want}: it is not fdl-prepare's, and "
        f"root does not write through it. Look at it, then remove it (`{remove}`); the next attempt recreates it",
    )


def _not_owned(path: str, uid: int, what: str) -> Fail:
    me = human.user()
    return Fail(
        "state.untrusted",
        f"{path}, the {what}, is owned by {_owner(uid)}, not {me}, who runs fdl-prepare: whoever owns it could "
        f"point what is written there elsewhere. `sudo chown -R {me}: {path}` if it is yours to take, or set "
        "state_dir (--state-dir) to a directory of this user's",
    )


def open_dir(path: str, what: str, *, owned: bool = True, dir_fd: int | None = None) -> int:
    """An fd on the directory at `path` (relative to `dir_fd` if given),
    refusing a symlink, anything that is not a directory, and (`owned`) a
    directory this user does not own."""
    try:
        fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                found = os.lstat(path, dir_fd=dir_fd).st_mode
            except OSError:
                found = stat.S_IFLNK
            raise _wrong_type(path, found, True, what) from None
        raise
    st = os.fstat(fd)
    if owned and st.st_uid != os.geteuid():
        os.close(fd)
        raise _not_owned(path, st.st_uid, what)
    return fd


@contextmanager
def opened_dir(path: str, what: str, *, owned: bool = True, dir_fd: int | None = None) -> Iterator[int]:
    fd = open_dir(path, what, owned=owned, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def vet(state: str, origin: str, var: str, *, change: bool = True) -> bool:
    """Create the state directory if missing, and refuse it (permanent)
    when it, or one of our entries in it, could send root's writes
    elsewhere: a symlink, the wrong type, another owner, or a directory
    others may write. `origin` says where the path came from and `var`
    what moves it, for the messages. Creates `gcroots/`.

    `change` False (`fdl-prepare check`): the same judgement, with nothing
    made or removed. A missing directory is judged by the place it would
    be made in (that place must take a probe file, written and removed);
    returns whether the directory exists."""
    from prepare.host import dirs

    what = f"state directory {state}"
    _refuse_system(state, origin, var)
    if not change and not os.path.lexists(state):
        anchor = dirs.nearest_existing(state)
        if not os.path.isdir(anchor):
            raise dirs.unusable(state, what, origin, OSError(errno.ENOTDIR, "Not a directory"), creating=True, var=var)
        dirs.probe(anchor, what, origin, var=var, creating=state)
        return False
    try:
        if change:
            os.makedirs(os.path.dirname(state), exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(state, 0o755)
    except OSError as err:
        raise dirs.unusable(state, what, origin, err, creating=True, var=var) from None
    if os.geteuid() == 0:
        from prepare.host import trust

        found = trust.doubt(state, final_dir=True)
        if found is not None:
            raise Fail(
                "state.untrusted",
                f"the state directory {state} (from {origin}) is not trusted: {found.path} {found.why}. Root "
                f"writes, replaces and removes entries there, so only root may be able to change it. Fix: "
                f"{found.fix}, or set {var} to a directory only root can write",
            )
    try:
        fd = open_dir(state, f"state directory (from {origin})")
    except OSError as err:
        raise dirs.unusable(state, what, origin, err, var=var) from None
    try:
        mode = os.fstat(fd).st_mode
        # Root's state directory is writable by root alone. Another user's
        # may be group-writable: with a umask of 002 (Ubuntu's for users)
        # that group is the user's own, and the directory is the user's.
        if mode & (stat.S_IWGRP | stat.S_IWOTH if os.geteuid() == 0 else stat.S_IWOTH):
            raise Fail(
                "state.untrusted",
                f"the state directory {state} (from {origin}) is writable by others than its owner (mode "
                f"{stat.S_IMODE(mode):04o}): they could swap its entries for symlinks where root writes and "
                f"removes. `sudo chmod go-w {state}`, or set {var} to a directory of this user's",
            )
        _vet_entries(state, fd, change=change)
    except OSError as err:
        raise dirs.unusable(state, what, origin, err, var=var) from None
    finally:
        os.close(fd)
    return True


def _refuse_system(state: str, origin: str, var: str) -> None:
    """`/` and the pseudo file systems are never a state directory."""
    from prepare.host import mounts

    path = os.path.normpath(os.path.abspath(state))
    why = None
    if path == "/":
        why = "is the root directory"
    elif any(path == tree or path.startswith(tree + "/") for tree in _PSEUDO_TREES):
        why = f"is under /{path.split('/')[1]}, the kernel's view of itself"
    else:
        try:
            mount = mounts.containing(path)
        except OSError:
            mount = None
        if mount is not None and mount.fstype in PSEUDO_FS:
            why = f"is on a {mount.fstype} file system (mounted at {mount.mount_point}), the kernel's view of itself"
    if why is not None:
        raise Fail(
            "state.untrusted",
            f"the state directory {state} (from {origin}) {why}: no place for fdl-prepare's GC roots, lock and "
            f"records. Set {var} to a directory of its own (the default for root is /var/lib/fdl-prepare)",
        )


def _vet_entries(state: str, fd: int, *, change: bool = True) -> None:
    names = os.listdir(fd)
    strays = [n for n in names if n not in ENTRIES and n not in OTHER_ENTRIES and not _TMP_NAME.fullmatch(n)]
    if strays:
        shown = ", ".join(sorted(strays)[:8]) + (f" and {len(strays) - 8} more" if len(strays) > 8 else "")
        raise Fail(
            "state.untrusted",
            f"the state directory {state} holds entries fdl-prepare did not make ({shown}): it is not fdl-prepare's "
            f"directory, and root must not write, replace or remove in someone else's. Point state_dir "
            f"(--state-dir) at a directory of its own (a new or empty one; root's default is "
            f"/var/lib/fdl-prepare), or move those entries out",
        )
    for name in names:
        if change and _TMP_NAME.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):
                    os.unlink(name, dir_fd=fd)
    for name, want_dir in ENTRIES.items():
        path = os.path.join(state, name)
        try:
            st = os.lstat(name, dir_fd=fd)
        except FileNotFoundError:
            if name != "gcroots" or not change:
                continue
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=fd)
            st = os.lstat(name, dir_fd=fd)
        if stat.S_ISLNK(st.st_mode) and name in REPLACED_BY_RENAME:
            continue
        if stat.S_ISDIR(st.st_mode) != want_dir or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            raise _wrong_type(path, st.st_mode, want_dir, f"state directory's {ENTRY_NAMES[name]}")
        if st.st_uid != os.geteuid():
            raise _not_owned(path, st.st_uid, f"state directory's {ENTRY_NAMES[name]}")
        if name == "recipe":
            recipe_strays(path, fd)


def recipe_strays(path: str, state_fd: int) -> None:
    """Refuse (permanent) a recipe directory that holds anything but the
    recipe: it is not one fdl-prepare made, and nothing in it is removed."""
    with opened_dir("recipe", "state directory's recipe directory", dir_fd=state_fd) as fd:
        strays = sorted(n for n in os.listdir(fd) if n != RECIPE_FILE)
    if strays:
        shown = ", ".join(strays[:8]) + (f" and {len(strays) - 8} more" if len(strays) > 8 else "")
        raise Fail(
            "state.untrusted",
            f"{path}, the state directory's recipe directory, holds what fdl-prepare never writes there ({shown}): "
            "it is not fdl-prepare's, and nothing in it is removed. Look at it, then move it away; or point "
            "state_dir (--state-dir) at a directory of fdl-prepare's own",
        )


def write_at(
    directory: int,
    name: str,
    data: bytes,
    *,
    tmp_dir: int | None = None,
    mode: int = 0o644,
    owner: tuple[int, int] | None = None,
) -> None:
    """Replace the file `name` in the directory open at `directory` with
    `data`, whole: written under a random name (in `tmp_dir`, default the
    same directory) opened with O_EXCL | O_NOFOLLOW, synced, renamed into
    place, given to `owner` (uid, gid) first when one is named. On any
    error the temporary file is gone and the OSError raised."""
    where = directory if tmp_dir is None else tmp_dir
    tmp = f".{name}.{os.urandom(8).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=where)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if owner is not None:
                os.fchown(fd, *owner)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=where, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=where)
        raise


def write_file(path: str, data: bytes, what: str) -> None:
    """`write_at` for the file at `path`, whose directory is opened without
    following a symlink (whose owner `vet` judges, where it is ours)."""
    with opened_dir(os.path.dirname(path) or ".", what, owned=False) as fd:
        write_at(fd, os.path.basename(path), data)
