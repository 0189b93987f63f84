"""The run directory: the run's project tree, writable by the training user.

floDl builds and runs in a local copy of the published tree, so a trainer
writes its checkpoints and `runs/` relative to its cwd. The fetched tree
here is a store path, read-only: a binary started in it fails with EROFS
after admission, when the controller's window has started. So the run gets
a copy of the tree, as published, in a directory of the state directory
that the training user owns: `<state>/runs/<source>.<run>/`, with `cwd`
inside it as in the tree. The store keeps the build's input; the copy is
the run's to write.

- One a run: keyed by the training source (its URL, as the GC roots are)
  and the run (its id and the tree's NAR hash), so a re-dial of the same run
  finds its directory and what the last attempt's training wrote in it,
  and a new publish gets a fresh one.
- Pruned: making a run's directory removes the other runs' directories of
  the same source. The current run's is kept; another source's (a second
  join loop on the same state directory) is never touched.
- Root never writes inside a directory the training user owns: a new
  directory is built beside (`runs/.new.<random>`, root's, mode 0700, no
  one else can enter it), copied by directory fds, never following a
  symlink (the tree's symlinks are copied as symlinks), chowned, then
  renamed into place. A directory is removed by first renaming it to
  `runs/.old.<random>` (in `runs/`, which is root's alone), then by
  `shutil.rmtree`, which walks by fd and does not follow a symlink the
  training user planted. Nothing of root's is handed over: every entry of
  the copy is the training user's, with setuid and setgid bits dropped.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from prepare.fail import Fail
from prepare.host import state as state_dir

if TYPE_CHECKING:
    from prepare.build.realise import Built
    from prepare.build.source import Source

RUNS = "runs"
# Bounds on a copy: a tree past them is not a project directory.
MAX_ENTRIES = 200_000
MAX_DEPTH = 128
_NEW = ".new."
_OLD = ".old."


@dataclass(frozen=True)
class Owner:
    """Whom the run directory belongs to: the training user. `uid` None:
    fdl-prepare is not root and the directory is its own user's."""

    name: str
    uid: int | None
    gid: int | None


def name_for(source_url: str, run_id: str | None, nar_hash: str | None) -> str:
    """`<source>.<run>`: hex digests, so no byte of the URL or the run id
    (the publisher's) reaches a file name."""
    source = hashlib.sha256(source_url.encode()).hexdigest()[:16]
    run = hashlib.sha256(f"{run_id or ''}\0{nar_hash or ''}".encode()).hexdigest()[:16]
    return f"{source}.{run}"


def provide(state: str, built: Built, source: Source, owner: Owner, notes: list[str]) -> Built:
    """`built` with its binary's cwd in the run's own directory, made (or
    kept from the last attempt of the same run) and the source's older
    runs' directories pruned."""
    assert built.bin is not None
    fetched = source.fetched
    name = name_for(fetched.url, source.recipe.run_id, fetched.nar_hash)
    runs = os.path.join(state, RUNS)
    closed = _closed_to(owner, state)
    if closed is not None:
        notes.append(
            f"no run directory: {owner.name}, who runs the training, cannot pass through {closed} (above the state "
            f"directory {state}), so the run's cwd stays the fetched tree, read-only ({built.bin.cwd}); a run that "
            "writes to its cwd fails there. Set state_dir (--state-dir) under directories every user may pass "
            "through (root's default, /var/lib/fdl-prepare, is)"
        )
        return built
    try:
        with state_dir.opened_dir(state, "state directory") as state_fd:
            with contextlib.suppress(FileExistsError):
                os.mkdir(RUNS, 0o755, dir_fd=state_fd)
            with state_dir.opened_dir(RUNS, "state directory's run directories", dir_fd=state_fd) as runs_fd:
                if stat.S_IMODE(os.fstat(runs_fd).st_mode) & (stat.S_IWGRP | stat.S_IWOTH):
                    os.fchmod(runs_fd, 0o755)
                kept = _usable(runs_fd, runs, name, owner)
                if not kept:
                    _make(runs_fd, runs, name, fetched.store_path, owner)
                pruned = _prune(runs_fd, runs, name)
    except OSError as err:
        raise Fail(
            "state.run-dir",
            f"the run directory {os.path.join(runs, name)} (the run's project tree, writable by "
            f"{owner.name}) could not be made: {os.strerror(err.errno or 0)} "
            f"({errno.errorcode.get(err.errno or 0, err.errno)}). It holds a copy of the training source, so it "
            f"needs as much free space as the tree: free space in {state}, or set state_dir (--state-dir) to a "
            "file system that has it",
        ) from None
    where = os.path.normpath(os.path.join(runs, name, source.recipe.cwd))
    notes.append(
        f"run directory {where}: "
        + ("kept from the last attempt of this run" if kept else f"a writable copy of the run's tree, {owner.name}'s")
        + (f"; {pruned} older run director{'y' if pruned == 1 else 'ies'} of this source removed" if pruned else "")
    )
    return replace(built, bin=replace(built.bin, cwd=where))


def _closed_to(owner: Owner, state: str) -> str | None:
    """The first directory from `/` to `state` that `owner` may not pass
    through (its search bit, for them), or None."""
    if owner.uid is None:
        return None
    import grp
    import pwd

    try:
        name = pwd.getpwuid(owner.uid).pw_name
        groups = {owner.gid} | {g.gr_gid for g in grp.getgrall() if name in g.gr_mem}
    except KeyError:
        groups = {owner.gid}
    path = "/"
    for part in [p for p in os.path.abspath(state).split("/") if p]:
        path = os.path.join(path, part)
        try:
            st = os.stat(path)
        except OSError:
            return path
        if st.st_uid == owner.uid:
            bit = stat.S_IXUSR
        elif st.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return path
    return None


def _usable(runs_fd: int, runs: str, name: str, owner: Owner) -> bool:
    """Whether the run's directory from an earlier attempt can be kept: a
    directory (not a link), the training user's. Anything else there is
    moved aside and removed."""
    try:
        st = os.lstat(name, dir_fd=runs_fd)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode) and st.st_uid == (os.geteuid() if owner.uid is None else owner.uid):
        return True
    _remove(runs_fd, runs, name)
    return False


def _make(runs_fd: int, runs: str, name: str, tree: str, owner: Owner) -> None:
    tmp = f"{_NEW}{os.urandom(8).hex()}"
    os.mkdir(tmp, 0o700, dir_fd=runs_fd)
    try:
        with (
            state_dir.opened_dir(tree, "training source", owned=False) as src_fd,
            state_dir.opened_dir(tmp, "new run directory", dir_fd=runs_fd) as dst_fd,
        ):
            _copy(src_fd, dst_fd, owner, [0], 0, os.path.join(runs, name))
            os.fchmod(dst_fd, 0o755)
            _own(dst_fd, owner)
        os.rename(tmp, name, src_dir_fd=runs_fd, dst_dir_fd=runs_fd)
    except BaseException:
        _remove(runs_fd, runs, tmp, moved=True)
        raise


def _copy(src_fd: int, dst_fd: int, owner: Owner, count: list[int], depth: int, where: str) -> None:
    if depth > MAX_DEPTH:
        raise _too_big(where, f"directories nested deeper than {MAX_DEPTH}")
    for name in os.listdir(src_fd):
        count[0] += 1
        if count[0] > MAX_ENTRIES:
            raise _too_big(where, f"more than {MAX_ENTRIES} entries")
        st = os.lstat(name, dir_fd=src_fd)
        mode = stat.S_IMODE(st.st_mode) & 0o755
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(name, 0o700, dir_fd=dst_fd)
            with (
                state_dir.opened_dir(name, "training source", owned=False, dir_fd=src_fd) as sub_src,
                state_dir.opened_dir(name, "new run directory", dir_fd=dst_fd) as sub_dst,
            ):
                _copy(sub_src, sub_dst, owner, count, depth + 1, where)
                os.fchmod(sub_dst, mode | 0o700)
                _own(sub_dst, owner)
        elif stat.S_ISREG(st.st_mode):
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
            try:
                dst = os.open(
                    name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst_fd
                )
                try:
                    with os.fdopen(src, "rb", closefd=False) as reader, os.fdopen(dst, "wb", closefd=False) as writer:
                        shutil.copyfileobj(reader, writer, 1 << 20)
                    os.fchmod(dst, mode | 0o600)
                    _own(dst, owner)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
        elif stat.S_ISLNK(st.st_mode):
            # As published: a link is the publisher's, copied, never followed.
            os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dst_fd)
            if owner.uid is not None:
                os.chown(
                    name, owner.uid, owner.gid if owner.gid is not None else -1, dir_fd=dst_fd, follow_symlinks=False
                )
        # A store path holds nothing else (no device, FIFO or socket).


def _own(fd: int, owner: Owner) -> None:
    if owner.uid is not None:
        os.fchown(fd, owner.uid, owner.gid if owner.gid is not None else -1)


def _too_big(where: str, what: str) -> Fail:
    return Fail(
        "state.run-dir",
        f"the run directory {where} was not made: the training source's tree has {what}, past what a run's project "
        "directory holds. Publish the project, not its data (the dataset root is data_path / data_source)",
    )


def _prune(runs_fd: int, runs: str, keep: str) -> int:
    """Remove the other runs' directories of the same source, and what an
    attempt stopped midway left (`.new.*`, `.old.*`). Returns how many runs'
    directories went."""
    source = keep.split(".", 1)[0] + "."
    pruned = 0
    for entry in os.listdir(runs_fd):
        if entry.startswith((_NEW, _OLD)):
            _remove(runs_fd, runs, entry, moved=True)
        elif entry != keep and entry.startswith(source):
            _remove(runs_fd, runs, entry)
            pruned += 1
    return pruned


def _remove(runs_fd: int, runs: str, name: str, *, moved: bool = False) -> None:
    """Remove `name` from runs/: first renamed to a name of root's in a
    directory that is root's alone, then removed by fd (shutil.rmtree opens
    each directory with O_NOFOLLOW and checks it is the one it looked at),
    never following a link inside it."""
    if not moved:
        aside = f"{_OLD}{os.urandom(8).hex()}"
        try:
            os.rename(name, aside, src_dir_fd=runs_fd, dst_dir_fd=runs_fd)
        except FileNotFoundError:
            return
        name = aside
    try:
        st = os.lstat(name, dir_fd=runs_fd)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        # By path: every component of it is root's (the state directory is
        # vetted, runs/ and the name aside are root's).
        shutil.rmtree(os.path.join(runs, name))
    else:
        os.unlink(name, dir_fd=runs_fd)
