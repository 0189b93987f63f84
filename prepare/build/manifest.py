"""The run manifest (`.fdl-run.toml`) and the recipe it makes with the box's own.

A publish writes `.fdl-run.toml` at the root of the training source tree last:
its presence is the commit point. Everything in it belongs to the run (which
binary, built how, with which arguments), so it outranks the box's
`[join.source]` field by field; a field it leaves out keeps the box's value,
so a box can carry defaults that a publish does not have to repeat.

A broken manifest is transient, not permanent: the publisher fixes it with the
next publish, and a box in a persist loop should pick that up by itself.
Broken values in the box's own config are permanent: only an operator
changes those.

Pure: reading a file, parsing and merging. No subprocesses.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import sys
from dataclasses import dataclass
from typing import Any

from prepare.fail import Fail
from prepare.host import human

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FILENAME = ".fdl-run.toml"

_FIELDS = ("bin", "cwd", "build", "args", "smoke", "run", "built", "published_epoch", "origin")
_TYPES: dict[str, tuple[type, str]] = {
    "bin": (str, "a string (a name or a path relative to cwd)"),
    "cwd": (str, "a string (a directory relative to the source root)"),
    "build": (str, "a string (a shell line)"),
    "args": (list, "a list of strings"),
    "smoke": (list, "a list of strings (the smoke run's arguments; [] runs none)"),
    "run": (str, "a string (the run's identity)"),
    "built": (bool, "true or false"),
    "published_epoch": (int, "an integer (seconds since the epoch)"),
    "origin": (str, "a string"),
}


@dataclass(frozen=True)
class Manifest:
    bin: str | None = None
    cwd: str | None = None
    build: str | None = None
    args: tuple[str, ...] | None = None
    smoke: tuple[str, ...] | None = None
    run: str | None = None
    built: bool | None = None
    published_epoch: int | None = None
    origin: str | None = None
    # Keys this version does not know: ignored (a newer publisher may add
    # fields), but named in a note so a typo does not go unnoticed.
    unknown: tuple[str, ...] = ()


@dataclass(frozen=True)
class Recipe:
    """What the flake builds and how the run starts: the manifest merged over the box."""

    bin: str
    cwd: str = "."
    build: str | None = None
    args: tuple[str, ...] | None = None
    # The smoke run's arguments: the manifest's where it has them (the
    # publisher knows its binary), else the box's. Not part of the build.
    smoke: tuple[str, ...] | None = None
    run_id: str | None = None
    built: bool | None = None
    published_epoch: int | None = None
    origin: str | None = None
    has_manifest: bool = False
    # The fields whose value came from the manifest: a bad one is fixed by
    # the next publish (transient), a bad box value by an operator (permanent).
    from_manifest: frozenset[str] = frozenset()

    def flake_input(self, libtorch: str, contract: int) -> dict[str, Any]:
        """The flake's `recipe.json` (nix/CONTRACT.md): what the build needs of
        the recipe, under the contract; the run's own fields stay here."""
        return {"contract": contract, "libtorch": libtorch, "cwd": self.cwd, "build": self.build, "bin": self.bin}


def parse(text: str, where: str = FILENAME) -> Manifest:
    """Parse a manifest's text. Every problem is a transient Fail naming the
    file and the key, because the fix is a new publish."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as bad:
        raise Fail(
            "source.manifest-invalid", f"the run manifest {where} is not valid TOML ({bad}): publish a fixed {FILENAME}"
        ) from None
    except RecursionError:
        raise Fail(
            "source.manifest-invalid",
            f"the run manifest {where} nests arrays or tables thousands of levels deep, past what can be read: "
            f"publish a fixed {FILENAME}",
        ) from None
    values: dict[str, Any] = {}
    for key in _FIELDS:
        if key not in table:
            continue
        value = table[key]
        want, described = _TYPES[key]
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if ok and key in ("args", "smoke"):
            ok = all(isinstance(a, str) for a in value)
        if not ok:
            shown = repr(value)
            shown = shown if len(shown) <= 200 else shown[:197] + "..."
            raise Fail(
                "source.manifest-invalid",
                f"the run manifest {where} has {key} = {shown}, expected {described}: publish a fixed {FILENAME}",
            )
        items = value if key in ("args", "smoke") else [value]
        # A NUL ends every path and argument the kernel takes: no command
        # line or path could carry the value as written.
        if any("\0" in item for item in items if isinstance(item, str)):
            raise Fail(
                "source.manifest-invalid",
                f"the run manifest {where} has a NUL character (\\u0000) in {key}, which no path or argument can "
                f"hold: publish a fixed {FILENAME}",
            )
        # The same bounds as the box's own values (prepare.config.fields): past
        # them, the kernel would refuse the command line (E2BIG).
        long = _too_long(key, items)
        if long:
            raise Fail(
                "source.manifest-invalid", f"the run manifest {where} has {key} {long}: publish a fixed {FILENAME}"
            )
        values[key] = tuple(value) if key in ("args", "smoke") else value
    unknown = tuple(sorted(k for k in table if k not in _FIELDS))
    return Manifest(**values, unknown=unknown)


def _too_long(key: str, items: list[Any]) -> str | None:
    from prepare.config.kinds import LIMITS, MAX_LIST_BYTES, MAX_STRING_BYTES, too_long

    total = 0
    for index, item in enumerate(items):
        if not isinstance(item, str):
            continue
        long = too_long(item, MAX_STRING_BYTES, "value")
        if long:
            return f"{'item ' + str(index) + ' that ' if key in ('args', 'smoke') else 'that '}{long}"
        total += len(item.encode("utf-8", "surrogatepass")) + 1
    if total > MAX_LIST_BYTES:
        return f"holding {total} bytes in all, past the {MAX_LIST_BYTES // 1024} KiB a list may (limits: {LIMITS})"
    return None


def read(source_root: str) -> Manifest | None:
    """The manifest at the root of a fetched source tree, or None if it has none.

    Bytes that are not UTF-8 are a malformed manifest like any other
    (transient, the next publish fixes it), not text to decode with
    replacement characters: a garbled run id would pass silently."""
    path = os.path.join(source_root, FILENAME)
    try:
        raw = _read_file(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise Fail(
                "source.manifest-invalid",
                f"the run manifest {path} is a symlink: a manifest is a file of the published tree, and root reads "
                f"nothing outside it: publish {FILENAME} as a plain file",
            ) from None
        raise Fail("source.manifest-invalid", f"cannot read the run manifest {path}: {human.oserror(err)}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        line = raw[: bad.start].count(b"\n") + 1
        raise Fail(
            "source.manifest-invalid",
            f"the run manifest {path} is not UTF-8 (byte 0x{raw[bad.start]:02x} on line {line}): TOML is UTF-8; "
            f"publish a fixed {FILENAME}",
        ) from None
    return parse(text, where=path)


# A manifest is a few hundred bytes; a larger "manifest" is not one.
MAX_BYTES = 1 << 20


def _read_file(path: str) -> bytes:
    """The manifest's bytes: never through a symlink (a published tree could
    point it at any file of this box, or at /dev/zero), never a device or a
    FIFO, and never more than MAX_BYTES."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        raw = b""
        while len(raw) <= MAX_BYTES:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            raw += chunk
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), path)
    return raw


def _relative(value: str, key: str, from_manifest: bool, *, allow_dot: bool, cwd: str = ".") -> str:
    """cwd and bin name places inside the source tree: an absolute path, or
    one climbing out of the tree, would build or run something the pinned
    tree does not contain. `bin` is floDl's, relative to `cwd`, and may
    climb out of it (`../target/release/NAME`: a workspace member's binary
    is in the workspace's target/), never out of the source root."""
    norm = posixpath.normpath(value.strip()) if value.strip() else ""
    climbs = norm == ".." or norm.startswith("../")
    if climbs and key == "bin":
        inside = posixpath.normpath(posixpath.join(cwd, norm))
        climbs = inside == ".." or inside.startswith("../") or inside == "."
    bad = not norm or posixpath.isabs(norm) or climbs or (norm == "." and not allow_dot)
    if not bad:
        return norm
    rule = (
        "a path relative to the source root, without '..'"
        if key == "cwd"
        else f"a path relative to cwd ({cwd!r}) that stays inside the source, e.g. 'target/release/NAME'"
    )
    if from_manifest:
        raise Fail(
            "source.manifest-invalid",
            f"the run manifest {FILENAME} has {key} = {value!r}; it must be {rule}: publish a fixed {FILENAME}",
        )
    raise Fail("config.invalid", f"source.{key} = {value!r} must be {rule}: fix [join.source] {key} (--source-{key})")


def merge(box: Any, manifest: Manifest | None, source_url: str) -> Recipe:
    """Field by field, the manifest's value where it has one, else the box's.

    No manifest and no `bin` on the box means nothing has been published yet:
    transient, so a box provisioned ahead of the first publish waits for it."""
    box_values = {
        "bin": getattr(box, "bin", None),
        "cwd": getattr(box, "cwd", None),
        "build": getattr(box, "build", None),
    }
    got: dict[str, Any] = {}
    origin_of: dict[str, bool] = {}
    for key in ("bin", "cwd", "build"):
        mine = getattr(manifest, key) if manifest is not None else None
        if mine is not None:
            got[key], origin_of[key] = mine, True
        else:
            got[key], origin_of[key] = box_values[key], False
    if not got["bin"]:
        if manifest is None:
            raise Fail(
                "source.not-published",
                f"the training source {source_url!r} has no run manifest ({FILENAME} at its root) and the box "
                "declares no binary: nothing is published yet. Publish the run (`fdl publish` writes the "
                f"manifest), or set source.bin (--source-bin) to build without one",
            )
        raise Fail(
            "source.manifest-invalid",
            f"the run manifest {FILENAME} in {source_url!r} names no bin and the box declares none: publish a "
            f"manifest with bin, or set source.bin (--source-bin)",
        )
    cwd = _relative(got["cwd"], "cwd", origin_of["cwd"], allow_dot=True) if got["cwd"] else "."
    bin_ = _relative(got["bin"], "bin", origin_of["bin"], allow_dot=False, cwd=cwd)
    build = got["build"] if got["build"] and got["build"].strip() else None
    return Recipe(
        bin=bin_,
        cwd=cwd,
        build=build,
        args=manifest.args if manifest is not None else None,
        smoke=manifest.smoke if manifest is not None and manifest.smoke is not None else getattr(box, "smoke", None),
        run_id=manifest.run if manifest is not None else None,
        built=manifest.built if manifest is not None else None,
        published_epoch=manifest.published_epoch if manifest is not None else None,
        origin=manifest.origin if manifest is not None else None,
        has_manifest=manifest is not None,
        from_manifest=frozenset(k for k, mine in origin_of.items() if mine),
    )


def age(published_epoch: int, now: float) -> str:
    """ "5m ago" style, coarse on purpose: it is read by a person deciding
    whether a box picked up the publish they just made."""
    delta = int(now - published_epoch)
    if delta < -60:
        return f"{_span(-delta)} in the future (is this box's clock right?)"
    delta = max(delta, 0)
    if delta < 60:
        return f"{delta}s ago"
    return f"{_span(delta)} ago"


def _span(seconds: int) -> str:
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        hours, rest = divmod(seconds, 3600)
        return f"{hours}h{rest // 60:02d}m" if rest >= 60 and hours < 10 else f"{hours}h"
    return f"{seconds // 86400}d"


def notes_for(recipe: Recipe, manifest: Manifest | None, now: float) -> list[str]:
    """What an operator wants to know about the publish this box will run.
    The manifest's strings are the publisher's: escaped, so that a `run`
    or `origin` can neither forge a line of ours nor drive a terminal."""
    if manifest is None:
        return [f"no run manifest ({FILENAME}): building with the box's own recipe (bin {recipe.bin!r})"]
    run_id = human.printable(recipe.run_id) if recipe.run_id else None
    parts = [f"run {run_id}" if run_id else "run manifest without a run id"]
    if recipe.published_epoch is not None:
        parts.append(f"published {age(recipe.published_epoch, now)}")
    if recipe.origin:
        parts.append(f"from {human.printable(recipe.origin)}")
    out = [", ".join(parts)]
    if recipe.built is False:
        out.append(
            f"run {run_id or '(no id)'} was NOT built by the controller (built = false in {FILENAME}): "
            "this box's build is the first one"
        )
    if manifest.unknown:
        unknown = ", ".join(human.printable(k) for k in manifest.unknown)
        out.append(f"{FILENAME} has keys this fdl-prepare does not know, ignored: {unknown}")
    return out


def check_tree(recipe: Recipe, source_root: str, source_url: str) -> None:
    """`cwd` must be a directory of the fetched tree. Checked here, before
    the build, because the flake's own refusal is an evaluation error
    (permanent), while a publish that names a missing directory is fixed by
    the next publish.

    A `cwd` that leads out of the tree through a symlink is permanent
    whoever set it: the build and the run would work in a directory of this
    box that no publish pinned (the run's `cwd` is handed on as the
    symlink's path), and retrying builds it again the same way."""
    where = os.path.join(source_root, recipe.cwd)
    if os.path.isdir(where):
        real_root = os.path.realpath(source_root)
        real = os.path.realpath(where)
        if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
            origin = (
                f"the run manifest {FILENAME} in {source_url!r} has"
                if "cwd" in recipe.from_manifest
                else "source.cwd (--source-cwd) is"
            )
            raise Fail(
                "source.cwd-escapes",
                f"{origin} cwd = {recipe.cwd!r}, which leads out of the training source through a symlink (to "
                f"{real}): a build and a run work inside the tree that was published. Publish a tree whose cwd is "
                f"a directory of its own (and, for a box's value, fix [join.source] cwd), then restart the unit",
            )
        return
    if "cwd" in recipe.from_manifest:
        raise Fail(
            "source.manifest-invalid",
            f"the run manifest {FILENAME} in {source_url!r} has cwd = {recipe.cwd!r}, which is not a directory of "
            f"the published tree: publish a fixed {FILENAME}",
        )
    raise Fail(
        "config.invalid",
        f"source.cwd = {recipe.cwd!r} is not a directory of the training source {source_url!r}: fix [join.source] "
        "cwd (--source-cwd), or publish a manifest that sets it",
    )


def check_box(box: Any) -> None:
    """The box's own recipe values, checked before anything is fetched: a bad
    value there is permanent whatever gets published."""
    if box is None:
        return
    cwd = getattr(box, "cwd", None)
    if cwd is not None:
        cwd = _relative(cwd, "cwd", False, allow_dot=True)
    value = getattr(box, "bin", None)
    if value is not None:
        # Judged against the box's cwd; a manifest's cwd is judged again at merge.
        _relative(value, "bin", False, allow_dot=False, cwd=cwd or ".")
