"""The training source's own defects, found before the flake is evaluated.

A cargo project with no Cargo.lock cannot be built offline the same way on
every box, and the flake refuses it at evaluation (nix/cargo.nix), which is
a permanent failure: the flake's. But the lock is the publisher's to
commit, and the next publish fixes it, so it is the source's reason, and
transient, like a build that does not compile. Read from the fetched tree
(a store path) without following a symlink out of it.
"""

from __future__ import annotations

import os
import posixpath
import stat

from prepare.fail import Fail


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
    Cargo.lock at or above it; a tree with no Cargo.toml at `cwd` is the
    build line's business."""
    if not _is_file(os.path.join(source_root, cwd, "Cargo.toml")):
        return
    if lock_dir(source_root, cwd) is not None:
        return
    where = "the run manifest's cwd" if from_manifest else "source.cwd"
    raise Fail(
        "source.no-cargo-lock",
        f"the training source {source_url!r} has a Cargo.toml in {where} {cwd!r} and no Cargo.lock there or in any "
        "directory above it: every box builds offline, from the dependencies the lock pins. The publisher commits "
        "Cargo.lock (`cargo generate-lockfile` in the crate or workspace root) and publishes again; the next "
        "attempt picks that up",
    )
