"""The run files a publish writes, floDl's two (flodl-cli's publish.rs):
the digest sidecar `.fdl-run.sha256` first, the manifest `.fdl-run.yml`
last. The manifest's presence in the tree is the commit point, so it is
removed before anything is built and written atomically, under a name
nobody can guess, once every variant is in the cache.

Only floDl's fields go in the manifest, so a floDl worker (whose older
readers refuse an unknown field) trains from this publish as from `fdl
publish`'s. The smoke run's arguments, which floDl has no field for, stay
each box's own (`[join.source] smoke`)."""

from __future__ import annotations

import contextlib
import os
import posixpath
import secrets
import socket
import time

from prepare.build.manifest import Digest, Manifest, dump, read
from prepare.fail import Fail
from prepare.host import human
from prepare.nix import caches
from prepare.publish.spec import PublishSpec


def new_run_id() -> str:
    # floDl's form: a fresh 16-byte nonce, hex. It rides each worker's join
    # hello, and the join window refuses a cohort mixing ids.
    return secrets.token_hex(16)


def text(spec: PublishSpec, run_id: str, rev: str | None, to: str, variants: list[str], digest: Digest) -> str:
    host = socket.gethostname()
    origin = f"{host}:{os.path.abspath(spec.source)}" + (f"@{rev}" if rev else "")
    cwd = posixpath.normpath(spec.cwd.strip())
    header = (
        f"# Written by `fdl-prepare publish` on {human.printable(host)}: the commit point of run {run_id}.\n"
        f"# Variants {', '.join(variants)} are built, signed and in {caches.uri(to)}.\n"
        "# floDl's run manifest: a worker merges it over its own config. Do not hand-edit: the next publish\n"
        "# overwrites it, and its presence is what tells a worker the run is ready.\n"
    )
    return dump(
        Manifest(
            # floDl's defaults: no cwd is the root, no build is the default
            # cargo release build (the flake's, as here).
            cwd=None if cwd == "." else cwd,
            build=spec.build if spec.build and spec.build.strip() else None,
            bin=posixpath.normpath(spec.bin.strip()),
            args=spec.args,
            origin=origin,
            # `rustc -V` of the toolchain that built: the flake's, which the
            # contract does not report, so this publish says nothing rather
            # than the version of some other rustc on this host.
            rustc=None,
            published_epoch=int(time.time()),
            run=run_id,
            built=True,
            digest=digest,
        ),
        header,
    )


def write(path: str, text: str, what: str = "the run manifest") -> None:
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
            f"cannot write {what} {path}: {human.oserror(err)}; the outputs are in the cache, so a publish once "
            "the tree is writable only writes the run files",
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
    run = human.printable(previous.run) if previous is not None and previous.run else "without a run id"
    notes.append(
        f"removed the previous manifest (run {run}) from {path}: boxes that fetch this tree wait until the "
        "publish writes the new one"
    )
