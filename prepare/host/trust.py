"""Whether root may act on what a file says: who could have written it.

fdl-prepare runs as root and does what its config says: an ssh option such
as `ProxyCommand` runs a command, a flake builds whatever it names. A config
that another user can edit, or that sits in a directory another user can
write (and so can swap the file for one of their own), hands that user
root. The same holds for the state directory, whose entries root writes and
removes: a directory another user can write is one where a symlink can send
those writes anywhere.

The rule is the one OpenSSH and sudo apply to their own files: every
directory on the way to the file, and the file itself, is owned by root or
the running user and writable by nobody else. A directory others may write
is accepted only when it is sticky (/tmp, /nix/store) and the entry in it is
ours, since then nobody else can rename or remove that entry. Symlinks are
followed as the kernel follows them, and each directory they lead through
is held to the same rule.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from prepare.host import human

# The kernel's own bound on symlinks followed in one lookup.
_MAX_LINKS = 40


@dataclass(frozen=True)
class Doubt:
    """Why a path cannot be trusted: the entry at fault and the fix."""

    path: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path} {self.why}: {self.fix}"


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def doubt(path: str, *, final_dir: bool = False) -> Doubt | None:
    """The first reason another user could have put words into `path`, or
    None when only root and this user could have. Each directory traversed
    (through symlinks too), and the file, must be owned by root or this user
    and writable by neither group nor others, unless the directory is
    sticky and the entry in it is owned by root or this user. A path that
    does not exist yet is judged as far as it exists."""
    me = human.user()
    pending = [p for p in os.path.abspath(path).split("/") if p]
    current = "/"
    try:
        parent = os.lstat("/")
    except OSError:
        return None
    found = _dir_doubt("/", parent, me)
    if found is not None:
        return found
    links = 0
    while pending:
        name = pending.pop(0)
        if name == ".":
            continue
        if name == "..":
            current = os.path.dirname(current)
            parent = os.lstat(current)
            continue
        entry = os.path.join(current, name)
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            return None
        except OSError as err:
            if err.errno in (errno.EACCES, errno.ENOTDIR):
                return None  # the caller's own open says so, in its words
            raise
        open_dir = bool(parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
        if open_dir and not _trusted_owner(st.st_uid):
            # A sticky directory protects only what is ours in it.
            return Doubt(
                entry,
                f"is owned by {_owner(st.st_uid)}, in {current}, which others may write",
                f"only root or {me} may own what root reads from there: move it to a directory only root can "
                f"write (e.g. /etc/fdl), or `sudo chown root: {entry}`",
            )
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                return Doubt(entry, "leads through more than 40 symlinks", "point the setting at the file itself")
            target = os.readlink(entry)
            if target.startswith("/"):
                current = "/"
                parent = os.lstat("/")
            pending = [p for p in target.split("/") if p] + pending
            continue
        last = not pending
        if stat.S_ISDIR(st.st_mode) and (not last or final_dir):
            found = _dir_doubt(entry, st, me)
        else:
            found = _file_doubt(entry, st, me) if last else None
        if found is not None:
            return found
        current, parent = entry, st
    return None


def _dir_doubt(path: str, st: os.stat_result, me: str) -> Doubt | None:
    if not _trusted_owner(st.st_uid):
        return Doubt(
            path,
            f"is a directory owned by {_owner(st.st_uid)}, who could replace what is in it",
            f"`sudo chown root: {path}`, or use a place under a directory only root owns (e.g. /etc/fdl)",
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return Doubt(
            path,
            f"is a directory writable by {_whom(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o}), who could "
            "replace what is in it",
            f"`sudo chmod go-w {path}`, or use a place under a directory only root can write (e.g. /etc/fdl)",
        )
    return None


def _file_doubt(path: str, st: os.stat_result, me: str) -> Doubt | None:
    if st.st_uid != os.geteuid():
        return Doubt(
            path,
            f"is owned by {_owner(st.st_uid)}, not {me}, who runs it",
            f"`sudo chown {me}: {path}`, after reading it through",
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return Doubt(
            path,
            f"is writable by {_whom(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o})",
            f"`sudo chmod go-w {path}`, after reading it through",
        )
    return None


def _whom(mode: int) -> str:
    both = mode & stat.S_IWGRP and mode & stat.S_IWOTH
    return "its group and others" if both else ("its group" if mode & stat.S_IWGRP else "others")


def enterable_by_others(path: str) -> bool:
    """Whether a user with no particular rights can reach into `path` (the
    smoke run's user, Nix's build users): every directory on the way must
    grant others search (x)."""
    current = os.path.realpath(path)
    while True:
        try:
            st = os.stat(current)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or not st.st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(current)
        if parent == current:
            return True
        current = parent


def open_above(path: str) -> Doubt | None:
    """The first directory of `path` (itself and every one above it, each
    read with lstat) that someone other than root and this user may write,
    a sticky one (/tmp) included, or None when there is none.

    Where Nix builds with its sandbox off, a build reads what lies above its
    directory: cargo takes `.cargo/config.toml` from every parent (a
    `rustc-wrapper` there runs as the build), and a sticky directory lets
    any user add that entry. So unlike `doubt`, stickiness is no excuse
    here. A group may write only when it is root's."""
    real = os.path.realpath(path)
    chain = [real]
    while chain[-1] != "/":
        chain.append(os.path.dirname(chain[-1]))
    for current in reversed(chain):
        try:
            st = os.lstat(current)
        except OSError as err:
            return Doubt(current, f"cannot be read ({human.oserror(err)})", "make it a directory only root can write")
        if not stat.S_ISDIR(st.st_mode):
            return Doubt(current, "is not a directory (it changed under us)", "make it a directory only root can write")
        if not _trusted_owner(st.st_uid):
            return Doubt(
                current, f"is owned by {_owner(st.st_uid)}", f"`sudo chown root: {current}`, or use another place"
            )
        if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != 0):
            return Doubt(
                current,
                f"is writable by {_whom(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o})",
                "builds go where no directory above them is writable by others",
            )
    return None
