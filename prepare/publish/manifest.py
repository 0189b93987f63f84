"""The run manifest a publish writes, last: its presence in the tree is the
commit point, so it is removed before anything is built and written
atomically, under a name nobody can guess, once every variant is in the
cache."""

from __future__ import annotations

import contextlib
import os
import posixpath
import secrets
import socket
import time
from collections.abc import Sequence

from prepare.build.manifest import parse, read
from prepare.fail import Fail
from prepare.host import human
from prepare.nix import caches
from prepare.publish.spec import PublishSpec


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


def _toml(value: str) -> str:
    # A JSON string is a TOML basic string (same escapes, \\uXXXX included).
    import json

    return json.dumps(value, ensure_ascii=False)


def text(spec: PublishSpec, run_id: str, rev: str | None, to: str, variants: Sequence[str]) -> str:
    host = socket.gethostname()
    origin = f"{host}:{os.path.abspath(spec.source)}" + (f"@{rev}" if rev else "")
    lines = [
        f"# Written by `fdl-prepare publish` on {host}: the commit point of run {run_id}.",
        f"# Variants {', '.join(variants)} are built, signed and in {caches.uri(to)}.",
        f"bin = {_toml(posixpath.normpath(spec.bin.strip()))}",
        f"cwd = {_toml(posixpath.normpath(spec.cwd.strip()))}",
        # An empty build line says "none" and outranks a box's own.
        f"build = {_toml(spec.build or '')}",
        f"args = [{', '.join(_toml(a) for a in spec.args)}]",
        *([] if spec.smoke is None else [f"smoke = [{', '.join(_toml(a) for a in spec.smoke)}]"]),
        f"run = {_toml(run_id)}",
        "built = true",
        f"published_epoch = {int(time.time())}",
        f"origin = {_toml(origin)}",
        "",
    ]
    text = "\n".join(lines)
    # What the boxes will read, read back before it is written.
    parse(text)
    return text


def write(path: str, text: str) -> None:
    # A name nobody can guess, created afresh and never through a link:
    # whoever else may write the tree cannot plant a file or a symlink for
    # this write to go through.
    tmp = f"{path}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise Fail(
            "publish.tree-unwritable",
            f"cannot write the run manifest {path}: {human.oserror(err)}; the outputs are in the cache, so a "
            "publish once the tree is writable only writes it",
        ) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    with contextlib.suppress(OSError):
        directory = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def remove(path: str, notes: list[str]) -> None:
    try:
        previous = read(os.path.dirname(path))
    except Fail:
        previous = None  # broken or unreadable: it goes all the same
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as err:
        raise Fail(
            "publish.tree-unwritable",
            f"cannot remove the previous run manifest {path}: {human.oserror(err)}. It must go before anything is "
            "built, so no box runs it meanwhile: make the tree writable for this user",
        ) from None
    run = previous.run if previous is not None and previous.run else "without a run id"
    notes.append(
        f"removed the previous manifest (run {run}) from {path}: boxes that fetch this tree wait until the "
        "publish writes the new one"
    )
