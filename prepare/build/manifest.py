"""floDl's run manifest (`.fdl-run.yml`) and the recipe it makes with the box's own.

The manifest is floDl's file (flodl-cli's `source::Manifest`, written by
`fdl publish` and by `fdl-prepare publish`), read here field for field with
floDl's defaults: `bin` is required, `args` absent is `[]`, `built` absent
is false, every other field absent is "not said". Its presence at the root
of the published tree is the commit point: a publish removes it first and
writes it last, after the digest sidecar (prepare.build.digest).

Everything in it belongs to the run (which binary, built how, with which
arguments), so it outranks the box's `[join.source]` field by field; a field
it leaves out keeps the box's value. What the run manifest does not carry
stays the box's: the smoke run's arguments above all, which floDl's manifest
has no field for (and floDl's reader, like older floDl workers' strict one,
must read every manifest a publish writes).

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
import re
import stat
from dataclasses import dataclass
from typing import Any, TypeGuard

import yaml

from prepare.fail import Fail
from prepare.host import human

try:  # libyaml's parser when PyYAML was built with it: faster, same events
    from yaml import CSafeLoader as _SafeBase
except ImportError:  # pragma: no cover - a PyYAML without libyaml
    from yaml import SafeLoader as _SafeBase  # type: ignore[assignment]

# floDl's names (flodl-cli/src/source.rs MANIFEST_FILE, source_set.rs DIGEST_FILE).
FILENAME = ".fdl-run.yml"
DIGEST_FILE = ".fdl-run.sha256"

# floDl's `Manifest` fields, in the order floDl writes them, and its digest's.
FIELDS = ("cwd", "build", "bin", "args", "origin", "rustc", "published_epoch", "run", "built", "digest")
DIGEST_FIELDS = ("sha256", "files", "bytes")
_STRINGS = {
    "bin": "a string (the artifact, a path relative to cwd)",
    "cwd": "a string (a directory relative to the source root)",
    "build": "a string (a shell line)",
    "origin": "a string (where the publisher got the tree)",
    "rustc": "a string (`rustc -V` on the publisher)",
    "run": "a string (the run's identity)",
}

# A manifest is a few hundred bytes; a larger "manifest" is not one.
MAX_BYTES = 1 << 20
# floDl's manifest is two levels deep (digest's mapping in the top one); a
# YAML of thousands of nested levels is built to exhaust a parser.
MAX_DEPTH = 16
# YAML nodes in one manifest: 1 MiB of `[[],[],...]` is a quarter million.
MAX_NODES = 50_000
# The unknown keys a note names; the rest are counted.
NOTED_UNKNOWN = 8
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Digest:
    """floDl's `TreeDigest`: the sha256 of the sidecar's bytes (hex), and the
    number of files and bytes it lists."""

    sha256: str
    files: int
    bytes: int


@dataclass(frozen=True)
class Manifest:
    bin: str
    cwd: str | None = None
    build: str | None = None
    args: tuple[str, ...] = ()
    origin: str | None = None
    rustc: str | None = None
    published_epoch: int | None = None
    run: str | None = None
    built: bool = False
    digest: Digest | None = None
    # Keys this version does not know: ignored (a newer floDl may add
    # fields), but named in a note so a typo does not go unnoticed. At most
    # NOTED_UNKNOWN of them, and how many there were in all.
    unknown: tuple[str, ...] = ()
    unknown_count: int = 0


@dataclass(frozen=True)
class Recipe:
    """What the flake builds and how the run starts: the manifest merged over the box."""

    bin: str
    cwd: str = "."
    build: str | None = None
    args: tuple[str, ...] | None = None
    # The smoke run's arguments: the box's (`[join.source] smoke`). floDl's
    # manifest has no such field. Not part of the build.
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


# -- YAML, bounded ---------------------------------------------------------------------------------


class _Refused(yaml.YAMLError):
    """A YAML construct a manifest has no use for and a hostile one abuses."""


def _int(loader: Any, node: yaml.ScalarNode) -> int:
    # YAML 1.2's integers: `017` is seventeen (YAML 1.1 read it as octal).
    text = str(loader.construct_scalar(node)).replace("_", "")
    return int(text, 0) if text[:2] in ("0o", "0x") else int(text, 10)


class _Loader(_SafeBase):
    """The safe loader with YAML 1.2's core schema, as floDl's serde_yaml_ng
    reads: `yes`, `on` and `no` are strings, not booleans. Keys must be
    strings, each once: PyYAML keeps the last of two equal keys, serde
    refuses them, and a manifest whose second `bin` silently wins would
    build another binary than the one a reader sees first."""

    yaml_implicit_resolvers: dict[Any, Any] = {}

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):
            raise _Refused(f"expected a mapping, found a {type(node).__name__}")
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                raise _Refused(f"a key that is not a string ({_short(repr(key))}, line {key_node.start_mark.line + 1})")
            if key in out:
                raise _Refused(f"the key {_short(repr(key))} twice (line {key_node.start_mark.line + 1})")
            out[key] = self.construct_object(value_node, deep=deep)
        return out


# YAML 1.2's core schema: what a plain scalar is, when it is not a string.
_CORE: tuple[tuple[str, str, str | list[str]], ...] = (
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("int", r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$", "-+0123456789"),
    (
        "float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
    ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
)
for _tag, _pattern, _first in _CORE:
    _Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))
_Loader.add_constructor("tag:yaml.org,2002:int", _int)


def _load(text: str) -> Any:
    """The one document in `text`. Before anything is built, the event
    stream is walked once: an alias or an anchor is refused (a manifest
    has no use for one, and a few lines of aliases expand to billions of
    nodes), and so is nesting past MAX_DEPTH or more than MAX_NODES nodes.
    The walk is a loop over events, so depth costs no stack."""
    depth = nodes = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(f"an alias (*{_short(str(event.anchor))}{_line(event.start_mark)})")
        if isinstance(event, yaml.NodeEvent):
            nodes += 1
            if event.anchor is not None:
                raise _Refused(f"an anchor (&{_short(str(event.anchor))}{_line(event.start_mark)})")
            if nodes > MAX_NODES:
                raise _Refused(f"more than {MAX_NODES} values")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _Refused(f"lists or mappings nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _line(mark: Any) -> str:
    return f", line {mark.line + 1}" if mark is not None else ""


def _short(text: str, limit: int = 80) -> str:
    text = human.printable(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- parsing ---------------------------------------------------------------------------------------


def _invalid(where: str, problem: str) -> Fail:
    return Fail("source.manifest-invalid", f"the run manifest {where} {problem}: publish a fixed {FILENAME}")


def parse(text: str, where: str = FILENAME) -> Manifest:
    """Parse a manifest's text. Every problem is a transient Fail naming the
    file and the key, because the fix is a new publish."""
    if "\0" in text:
        # YAML has no NUL; no path or argument the kernel takes holds one.
        raise _invalid(where, f"has a NUL character (\\u0000) on line {text[: text.index(chr(0))].count(chr(10)) + 1}")
    try:
        table = _load(text)
    except _Refused as refused:
        raise _invalid(where, f"holds {refused}, which a run manifest never does") from None
    except yaml.YAMLError as bad:
        shown = human.printable(str(bad).replace("\n", " "))
        raise _invalid(where, f"is not valid YAML ({shown[:300]})") from None
    except (ValueError, OverflowError, RecursionError) as bad:
        raise _invalid(where, f"holds a value YAML cannot read ({_short(str(bad))})") from None
    if not isinstance(table, dict):
        got = "nothing" if table is None else f"a {_kind(table)}"
        raise _invalid(where, f"holds {got}, not a mapping of keys (bin, args, run, ...)")
    values: dict[str, Any] = {}
    for key in FIELDS:
        value = table.get(key)
        if key == "bin" and value is None:
            raise _invalid(where, "has no bin (the artifact the run starts, relative to cwd); floDl requires it")
        if value is None:
            continue  # floDl's Option fields: null is absent
        values[key] = _value(key, value, where)
    unknown = sorted(k for k in table if k not in FIELDS)
    digest_table = table.get("digest")
    if isinstance(digest_table, dict):
        unknown += sorted(f"digest.{k}" for k in digest_table if k not in DIGEST_FIELDS)
    return Manifest(
        **values,
        unknown=tuple(_short(k, 60) for k in unknown[:NOTED_UNKNOWN]),
        unknown_count=len(unknown),
    )


def _kind(value: Any) -> str:
    return {dict: "mapping", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(value), type(value).__name__
    )


def _value(key: str, value: Any, where: str) -> Any:
    def wrong(expected: str) -> Fail:
        return _invalid(where, f"has {key} = {_short(repr(value), 200)}, expected {expected}")

    if key in _STRINGS:
        if not isinstance(value, str):
            raise wrong(_STRINGS[key])
        _bounded(key, [value], where)
        return value
    if key == "args":
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise wrong("a list of strings (the binary's arguments)")
        _bounded(key, value, where)
        return tuple(value)
    if key == "built":
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if key == "published_epoch":
        if not _count(value):
            raise wrong("a whole number of seconds since the epoch")
        return value
    # digest
    if not isinstance(value, dict):
        raise wrong("a mapping of sha256, files and bytes")
    sha, files, size = (value.get(k) for k in DIGEST_FIELDS)
    counts: dict[str, int] = {}
    if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
        raise _invalid(where, f"has digest.sha256 = {_short(repr(sha))}, expected 64 lowercase hex digits")
    for name, number in (("files", files), ("bytes", size)):
        if not _count(number):
            raise _invalid(where, f"has digest.{name} = {_short(repr(number))}, expected a whole number")
        counts[name] = number
    return Digest(sha256=sha, files=counts["files"], bytes=counts["bytes"])


def _count(value: Any) -> TypeGuard[int]:
    # floDl's u64 and usize.
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64


def _bounded(key: str, items: list[str], where: str) -> None:
    # A NUL ends every path and argument the kernel takes: no command line
    # or path could carry the value as written.
    if any("\0" in item for item in items):
        raise _invalid(where, f"has a NUL character (\\u0000) in {key}, which no path or argument can hold")
    # The same bounds as the box's own values (prepare.config.fields): past
    # them, the kernel would refuse the command line (E2BIG).
    long = _too_long(key, items)
    if long:
        raise _invalid(where, f"has {key} {long}")


def _too_long(key: str, items: list[str]) -> str | None:
    from prepare.config.kinds import LIMITS, MAX_LIST_BYTES, MAX_STRING_BYTES, too_long

    total = 0
    for index, item in enumerate(items):
        long = too_long(item, MAX_STRING_BYTES, "value")
        if long:
            return f"{'item ' + str(index) + ' that ' if key == 'args' else 'that '}{long}"
        total += len(item.encode("utf-8", "surrogatepass")) + 1
    if total > MAX_LIST_BYTES:
        return f"holding {total} bytes in all, past the {MAX_LIST_BYTES // 1024} KiB a list may (limits: {LIMITS})"
    return None


# -- writing ---------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Quotes every string that YAML 1.1 or 1.2 would read as anything else
    (`yes`, `0o17`, `~`), so floDl, this reader and any other read the
    strings that were written."""


for _tag, _pattern, _first in _CORE:
    _Dumper.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))


def dump(manifest: Manifest, header: str = "") -> str:
    """The manifest as floDl writes it: its fields in its order, a field
    that is not set left out (serde's `skip_serializing_if`), `bin`,
    `args` and `built` always there; no key floDl's struct lacks."""
    table: dict[str, Any] = {}
    for key in FIELDS:
        value = getattr(manifest, key)
        if key == "args":
            table[key] = list(value)
        elif key == "digest" and value is not None:
            table[key] = {"sha256": value.sha256, "files": value.files, "bytes": value.bytes}
        elif value is not None:
            table[key] = value
    body = yaml.dump(
        table, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1 << 30
    )
    text = header + body
    parse(text)  # what the boxes will read, read back before it is written
    return text


# -- the file --------------------------------------------------------------------------------------


def read(source_root: str) -> Manifest | None:
    """The manifest at the root of a fetched source tree, or None if it has none.

    Bytes that are not UTF-8 are a malformed manifest like any other
    (transient, the next publish fixes it), not text to decode with
    replacement characters: a garbled run id would pass silently."""
    path = os.path.join(source_root, FILENAME)
    try:
        raw = read_file(path, MAX_BYTES)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise Fail(
                "source.manifest-invalid",
                f"the run manifest {path} is a symlink: a manifest is a file of the published tree, and root reads "
                f"nothing outside it: publish {FILENAME} as a plain file",
            ) from None
        if err.errno == errno.EINVAL:
            raise Fail(
                "source.manifest-invalid",
                f"the run manifest {path} is not a regular file (a FIFO, a device or a socket): publish {FILENAME} "
                "as a plain file",
            ) from None
        raise Fail("source.manifest-invalid", f"cannot read the run manifest {path}: {human.oserror(err)}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        line = raw[: bad.start].count(b"\n") + 1
        raise Fail(
            "source.manifest-invalid",
            f"the run manifest {path} is not UTF-8 (byte 0x{raw[bad.start]:02x} on line {line}): floDl writes "
            f"UTF-8; publish a fixed {FILENAME}",
        ) from None
    return parse(text, where=path)


def read_file(path: str, limit: int) -> bytes:
    """A run file's bytes: never through a symlink (a published tree could
    point it at any file of this box, or at /dev/zero), never a device or a
    FIFO, and never more than `limit` (EFBIG past it)."""
    # Looked at before it is opened: opening a device can act on it.
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise OSError(errno.EINVAL, "not a regular file", path)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), path)
    return b"".join(chunks)


def mid_publish(source_root: str) -> bool:
    """A digest sidecar without a manifest: a publish writes the sidecar
    first and the manifest last, so this tree is one caught between them
    (or left by a publish that failed there)."""
    return os.path.lexists(os.path.join(source_root, DIGEST_FILE))


# -- the recipe ------------------------------------------------------------------------------------


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
            f"the run manifest {FILENAME} has {key} = {_short(repr(value))}; it must be {rule}: publish a fixed "
            f"{FILENAME}",
        )
    raise Fail("config.invalid", f"source.{key} = {value!r} must be {rule}: fix [join.source] {key} (--source-{key})")


def merge(box: Any, manifest: Manifest | None, source_url: str, *, mid_publish: bool = False) -> Recipe:
    """Field by field, the manifest's value where it has one, else the box's.

    No manifest is "nothing published" (transient, so a box provisioned
    ahead of the first publish waits for it) when the box declares no
    `bin`, and always when the tree is caught mid-publish (`mid_publish`:
    its digest sidecar without a manifest)."""
    if manifest is None and mid_publish:
        raise Fail(
            "source.not-published",
            f"the training source {source_url!r} has a digest sidecar ({DIGEST_FILE}) but no run manifest "
            f"({FILENAME}): a publish is under way (it writes the manifest last), or one failed before the end. The "
            "next attempt fetches again; if this persists, publish again (`fdl publish` or `fdl-prepare publish`)",
        )
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
            f"the run manifest {FILENAME} in {source_url!r} has an empty bin: publish a manifest whose bin names "
            "the artifact",
        )
    cwd = _relative(got["cwd"], "cwd", origin_of["cwd"], allow_dot=True) if got["cwd"] else "."
    bin_ = _relative(got["bin"], "bin", origin_of["bin"], allow_dot=False, cwd=cwd)
    build = got["build"] if got["build"] and got["build"].strip() else None
    return Recipe(
        bin=bin_,
        cwd=cwd,
        build=build,
        args=manifest.args if manifest is not None else None,
        smoke=getattr(box, "smoke", None),
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


def notes_for(recipe: Recipe, manifest: Manifest | None, now: float, toolchain: str | None = None) -> list[str]:
    """What an operator wants to know about the publish this box will run.
    The manifest's strings are the publisher's: escaped, so that a `run`
    or `origin` can neither forge a line of ours nor drive a terminal.

    `toolchain` is the rustc this box's flake builds with, when the flake
    says (the contract does not expose it yet: then the manifest's `rustc`
    is reported as the publisher's, compared with nothing)."""
    if manifest is None:
        return [f"no run manifest ({FILENAME}): building with the box's own recipe (bin {recipe.bin!r})"]
    run_id = human.printable(recipe.run_id) if recipe.run_id else None
    parts = [f"run {run_id}" if run_id else "run manifest without a run id"]
    if recipe.published_epoch is not None:
        parts.append(f"published {age(recipe.published_epoch, now)}")
    if recipe.origin:
        parts.append(f"from {_short(recipe.origin, 200)}")
    out = [", ".join(parts)]
    if recipe.built is False:
        out.append(
            f"run {run_id or '(no id)'} was NOT built by the publisher (built: false in {FILENAME}): "
            "this box's build is the first one"
        )
    if manifest.rustc is not None:
        theirs = _short(manifest.rustc, 120)
        if toolchain is None:
            out.append(f"the publisher built with {theirs} (advisory; this box builds with its flake's Rust)")
        elif toolchain not in manifest.rustc:
            out.append(
                f"the publisher built with {theirs}, this box's flake builds with rustc {_short(toolchain, 60)} "
                "(advisory: each box compiles its own binary; a toolchain too old fails at compile time)"
            )
    if manifest.unknown_count:
        unknown = ", ".join(manifest.unknown)
        more = manifest.unknown_count - len(manifest.unknown)
        out.append(
            f"{FILENAME} has {manifest.unknown_count} key{'s' if manifest.unknown_count != 1 else ''} this "
            f"fdl-prepare does not know, ignored: {unknown}" + (f" and {more} more" if more > 0 else "")
        )
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
