"""floDl's tree digest: the `.fdl-run.sha256` sidecar and the manifest's `digest`.

A publish lists the tree's files, hashes each into a sidecar in
`sha256sum` format (`<hex>  <path>` a line, `/`-joined paths, sorted:
`sha256sum -c .fdl-run.sha256` checks it by hand), writes the sidecar, and
records the sidecar's own hash (and its file and byte counts) in the
manifest, which it writes last (flodl-cli/src/source_set.rs).

A box checks the fetched tree against it before building: the sidecar
hashes to `digest.sha256`, every file it lists hashes as listed, and no
file outside it is in the tree, where "the tree" is what floDl's
`tree_files` walks: regular files, not `target/` at any depth (a build's
output), not the two run files at the root. Like floDl's walk, a symlink
is no file of the tree (neither listed by a publish nor counted as
unlisted); a listed path that is a symlink is hashed through it, as floDl
hashes it, but only where it leads to a regular file inside the tree: root
reads nothing of this box's on a published tree's word.

Every mismatch is transient (`source.digest-mismatch`): the usual cause
is a fetch that straddled a re-publish, and the next attempt fetches a
coherent tree. The message names the files (the first few, and how many
more), so a mismatch that persists reads as what it is.

Bounded: MAX_FILES files, MAX_TREE_BYTES bytes hashed, a sidecar of at
most MAX_SIDECAR_BYTES; past a bound the tree is refused, transient, with
the bound named.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Sequence

from prepare.build.manifest import DIGEST_FILE, FILENAME, Digest, Manifest, read_file
from prepare.fail import Fail
from prepare.host import human

MAX_FILES = 100_000
MAX_ENTRIES = 4 * MAX_FILES
MAX_TREE_BYTES = 16 << 30
# A line is 64 hex digits, two spaces, a path and a newline.
MAX_SIDECAR_BYTES = 64 << 20
# Problems a message names (floDl's count); the rest are counted.
SHOWN = 5
_CHUNK = 1 << 20


class _Outside(Exception):
    """A listed path that is, or passes through, a symlink leading out of the tree."""


def _mismatch(problem: str) -> Fail:
    return Fail("source.digest-mismatch", problem)


def _shown(rel: str) -> str:
    text = human.printable(rel)
    return text if len(text) <= 200 else text[:197] + "..."


def tree_files(tree: str) -> list[str]:
    """The files of `tree` a digest covers, relative, `/`-joined, sorted:
    regular files, never through a symlink, not under a directory named
    `target` at any depth, not the root's run files. At most MAX_FILES,
    else a Fail naming the bound. Walked with a stack: depth costs no
    recursion."""
    out: list[str] = []
    pending = [""]
    # Every entry counts, directories too: a million empty directories cost
    # a walk what a million files would.
    seen = 0
    while pending:
        rel_dir = pending.pop()
        where = os.path.join(tree, rel_dir) if rel_dir else tree
        try:
            entries = list(os.scandir(where))
        except OSError as err:
            raise _mismatch(
                f"cannot list {where} to check it against its digest: {human.oserror(err)}; the next attempt "
                "fetches the tree again"
            ) from None
        seen += len(entries)
        if seen > MAX_ENTRIES:
            raise _mismatch(
                f"the training source holds more than {MAX_ENTRIES} files and directories: past what a box walks "
                "to check a digest. Publish a smaller tree (a cargo project's own files)"
            )
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if entry.is_dir(follow_symlinks=False):
                if entry.name != "target":
                    pending.append(rel)
            elif entry.is_file(follow_symlinks=False):
                if not rel_dir and entry.name in (FILENAME, DIGEST_FILE):
                    continue
                out.append(rel)
                if len(out) > MAX_FILES:
                    raise _mismatch(
                        f"the training source holds more than {MAX_FILES} files outside target/: past what a box "
                        "checks against a digest. Publish a smaller tree (a cargo project's own files)"
                    )
    out.sort()
    return out


def _safe_rel(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and "\0" not in rel and not rel.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _hash(tree: str, real_root: str, rel: str, budget: list[int]) -> tuple[str, int]:
    """The sha256 (hex) and size of the regular file `rel` under `tree`,
    through symlinks only while they stay inside it; `budget` is the bytes
    left to hash. OSError when it is missing or not a regular file."""
    path = os.path.join(tree, rel)
    real = os.path.realpath(path)
    if not real.startswith(real_root.rstrip("/") + "/"):
        raise _Outside(real)
    # Looked at before it is opened: opening a device can act on it.
    if not stat.S_ISREG(os.lstat(real).st_mode):
        raise OSError(errno.EINVAL, "not a regular file", path)
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        digest = hashlib.sha256()
        size = 0
        while True:
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                break
            size += len(chunk)
            budget[0] -= len(chunk)
            if budget[0] < 0:
                raise _mismatch(
                    f"the training source's files hold more than {MAX_TREE_BYTES >> 30} GiB: past what a box "
                    "hashes to check a digest. Publish a smaller tree (a cargo project's own files)"
                )
            digest.update(chunk)
    finally:
        os.close(fd)
    return digest.hexdigest(), size


def compute(tree: str, files: Sequence[str]) -> tuple[str, Digest]:
    """The sidecar's text for `files` under `tree` and the digest the
    manifest records (floDl's `source_set::digest`)."""
    real_root = os.path.realpath(tree)
    budget = [MAX_TREE_BYTES]
    lines: list[str] = []
    total = 0
    for rel in files:
        if "\n" in rel or "\r" in rel:
            # The sidecar is a line a file: no reader could tell where it ends.
            raise Fail(
                "publish.invalid",
                f"the training source holds a file whose name has a line break ('{_shown(rel)}'), which the digest "
                f"sidecar {DIGEST_FILE} (a line a file) cannot list: rename it",
            )
        try:
            hexdigest, size = _hash(tree, real_root, rel, budget)
        except (OSError, _Outside) as err:
            why = "leads out of the tree" if isinstance(err, _Outside) else human.oserror(err)
            raise Fail(
                "publish.invalid", f"cannot hash {os.path.join(tree, rel)} of the tree as fetched: {why}"
            ) from None
        lines.append(f"{hexdigest}  {rel}\n")
        total += size
    sidecar = "".join(lines)
    return sidecar, Digest(sha256=hashlib.sha256(sidecar.encode("utf-8")).hexdigest(), files=len(files), bytes=total)


def verify(tree: str, manifest: Manifest) -> list[str]:
    """Check the fetched `tree` against `manifest.digest`; the notes to
    print. A manifest without a digest (floDl's older ones) checks nothing,
    as floDl's worker does, and says so."""
    expected = manifest.digest
    if expected is None:
        return [f"{FILENAME} carries no digest: the fetched tree is not checked against what was published"]
    if expected.files > MAX_FILES or expected.bytes > MAX_TREE_BYTES:
        raise _mismatch(
            f"{FILENAME} lists {expected.files} files, {expected.bytes} bytes: past what a box checks against a "
            f"digest ({MAX_FILES} files, {MAX_TREE_BYTES >> 30} GiB). Publish a smaller tree (a cargo project's "
            "own files)"
        )
    sidecar_path = os.path.join(tree, DIGEST_FILE)
    try:
        raw = read_file(sidecar_path, MAX_SIDECAR_BYTES)
    except OSError as err:
        why = "it is a symlink" if err.errno == errno.ELOOP else human.oserror(err)
        raise _mismatch(
            f"the fetched tree carries a run manifest with a digest but no readable {DIGEST_FILE} ({why}): "
            "fetched mid-publish? The next attempt fetches a coherent tree"
        ) from None
    got = hashlib.sha256(raw).hexdigest()
    if got != expected.sha256:
        raise _mismatch(
            f"{DIGEST_FILE} does not match {FILENAME} (sidecar {got[:12]}..., manifest digest "
            f"{expected.sha256[:12]}...): the tree and its manifest are from different publishes; the next "
            "attempt fetches a coherent one"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _mismatch(f"{DIGEST_FILE} is not UTF-8: publish again (floDl writes it as UTF-8)") from None
    real_root = os.path.realpath(tree)
    budget = [MAX_TREE_BYTES]
    listed: set[str] = set()
    problems: list[str] = []
    # Lines as floDl's `str::lines` reads them: split at \n, a trailing \r
    # dropped; no other character ends one.
    for line in text.split("\n"):
        hexdigest, sep, rel = line.removesuffix("\r").partition("  ")
        if not sep:
            continue  # floDl skips a line without the two-space separator
        if len(listed) >= MAX_FILES:
            raise _mismatch(f"{DIGEST_FILE} lists more than {MAX_FILES} files: past what a box checks")
        listed.add(rel)
        if not _safe_rel(rel):
            problems.append(f"'{_shown(rel)}' is not a path inside the tree")
            continue
        try:
            actual, _ = _hash(tree, real_root, rel, budget)
        except _Outside:
            problems.append(f"{_shown(rel)} leads out of the tree through a symlink (not followed)")
            continue
        except FileNotFoundError:
            problems.append(f"{_shown(rel)} is missing")
            continue
        except OSError as err:
            problems.append(f"{_shown(rel)} cannot be read ({human.oserror(err)})")
            continue
        if actual != hexdigest:
            problems.append(f"{_shown(rel)} differs")
    for rel in tree_files(tree):
        if rel not in listed:
            problems.append(f"{_shown(rel)} is not in the published set")
    if problems:
        more = len(problems) - SHOWN
        raise _mismatch(
            f"the fetched tree does not match what was published ({len(problems)} file"
            f"{'s' if len(problems) != 1 else ''}): {'; '.join(problems[:SHOWN])}"
            + (f"; and {more} more" if more > 0 else "")
            + ". A fetch that straddled a re-publish: the next attempt fetches a coherent tree; if this persists, "
            "the tree is not what was published: publish again"
        )
    files = f"{len(listed)} file{'s' if len(listed) != 1 else ''}"
    return [f"the fetched tree matches its digest ({files}, sha256 {expected.sha256[:12]}...)"]
