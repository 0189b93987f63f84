"""The training source's own defects, found before the flake is evaluated.

A cargo project with no Cargo.lock, or one whose lock names a git
dependency (which the lock pins by commit, not by a hash the store can
check), cannot be built offline the same way on every box, and the flake
refuses it at evaluation (nix/cargo.nix), which is a permanent failure: the
flake's. But the lock is the publisher's to fix, and the next publish
fixes it, so both are the source's reasons, and transient, like a build
that does not compile. Read from the fetched tree (a store path) without
following a symlink out of it.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
import sys

from prepare.fail import Fail
from prepare.host import human

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# A Cargo.lock of thousands of crates is a few hundred KiB; past this it is
# not read (the flake's own check still stands behind it).
MAX_LOCK_BYTES = 16 << 20
# How many git dependencies a message names before it counts the rest.
_SHOWN = 5


def _is_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def lock_dir(source_root: str, cwd: str) -> str | None:
    """Where cargo would take Cargo.lock from for the crate at `cwd`:
    `cwd` or the nearest directory above it, never above the source root
    (relative to it); None when there is none."""
    here = posixpath.normpath(cwd)
    while True:
        if _is_file(os.path.join(source_root, here, "Cargo.lock")):
            return here
        if here in (".", ""):
            return None
        here = posixpath.dirname(here) or "."


def check_lock(source_root: str, cwd: str, source_url: str, *, from_manifest: bool) -> None:
    """Refuse (transient, the source's) a cargo project at `cwd` with no
    Cargo.lock at or above it, or whose lock has git dependencies; a tree
    with no Cargo.toml at `cwd` is the build line's business."""
    if not _is_file(os.path.join(source_root, cwd, "Cargo.toml")):
        return
    where = "the run manifest's cwd" if from_manifest else "source.cwd"
    found = lock_dir(source_root, cwd)
    if found is not None:
        _check_git_dependencies(os.path.join(source_root, found, "Cargo.lock"), source_url)
        return
    raise Fail(
        "source.no-cargo-lock",
        f"the training source {source_url!r} has a Cargo.toml in {where} {cwd!r} and no Cargo.lock there or in any "
        "directory above it: every box builds offline, from the dependencies the lock pins. The publisher commits "
        "Cargo.lock (`cargo generate-lockfile` in the crate or workspace root) and publishes again; the next "
        "attempt picks that up",
    )


def _check_git_dependencies(lock: str, source_url: str) -> None:
    """Refuse (transient, the source's) a Cargo.lock with git dependencies:
    the lock pins them by commit, which the flake cannot fetch by a hash it
    checks, and a fetch at evaluation would run git as root with root's
    credentials. Nothing unreadable is decided here: the flake's own check
    (nix/cargo.nix) stands behind this one."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        raw = os.read(fd, MAX_LOCK_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_LOCK_BYTES:
        return
    try:
        table = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return
    packages = table.get("package")
    if not isinstance(packages, list):
        return
    git = [
        f"{p.get('name')} {p.get('version')} ({_without_credentials(p['source'])})"
        for p in packages
        if isinstance(p, dict) and isinstance(p.get("source"), str) and p["source"].startswith("git+")
    ]
    if not git:
        return
    shown = ", ".join(human.printable(g) for g in git[:_SHOWN])
    more = f", and {len(git) - _SHOWN} more" if len(git) > _SHOWN else ""
    raise Fail(
        "source.git-dependency",
        f"the training source {source_url!r} has git dependencies in its Cargo.lock: {shown}{more}. A box fetches "
        "crates only by the hash Cargo.lock records, which a git dependency lacks (and a git fetch while the "
        "flake is evaluated would run as root, with root's credentials). The publisher publishes the crate to a "
        "registry, or vendors it into the source as a path dependency, and publishes again; the next attempt "
        "picks that up",
    )


def _without_credentials(url: str) -> str:
    """A git source as Cargo.lock records it, less any user-info: a token
    in a URL is no message's business."""
    return re.sub(r"^([a-z+]+://)[^/@]*@", r"\1", url)
