"""The config file: found, read safely, parsed, and its [join] table
checked against the field table, every problem with its line.

    path = find_path(flag, os.environ)   # --config, $FDL_PREPARE_CONFIG, /etc/fdl/prepare.toml
    table = load(path) if path else {}   # the [join] table, checked

Two formats, told apart by the name: TOML (`[join]`), and floDl's own
fdl.yml (a `.yml` or `.yaml` file; its `join:` block, with floDl's key
names and nesting, the rest of the file ignored), so one file can serve
`fdl join` and fdl-prepare. Both go through the same checks and messages.
floDl's keys that only `fdl join` acts on (`controller`, `token`, ...) are
checked, taken out and named in one note; in an fdl.yml, a key that is
fdl-prepare's alone is refused, since `fdl join` refuses a block that
holds a key it does not know.

A bad config is a permanent Fail: a persist loop retrying it would hot-loop
on a typo. Every message names the full key (`join.ssh.port`), its line,
quotes the bad value, names the file, and says what to write instead. The
file may hold tables for other tools; only [join] is read, but inside it an
unknown key is an error, because a misspelt key silently ignored is a box
that does something the operator did not ask for.

Reading is the file's one hazard: it is opened without blocking (a FIFO
would wait for a writer for ever), checked to be a regular file of a
config's size before it is read (/dev/zero never ends), and, as root,
refused when anyone but root could have written it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prepare.config.fields import SHARED_WITH_FLODL, TABLE, Table
from prepare.config.kinds import show
from prepare.config.schema import Checked, Namer, at, foreign_note, problems_message, split_foreign, validate
from prepare.fail import Fail
from prepare.host import human

CONFIG_ENV = "FDL_PREPARE_CONFIG"
DEFAULT_PATH = Path("/etc/fdl/prepare.toml")
# A config is a few hundred bytes; a file far larger is the wrong file.
MAX_CONFIG_BYTES = 1 << 20
# /dev/null's device numbers, the same on every Linux.
_DEV_NULL = (1, 3)


def find_path(flag: str | None, env: Mapping[str, str], *, default: Path = DEFAULT_PATH) -> Path | None:
    """--config PATH, else $FDL_PREPARE_CONFIG, else `default` if present,
    else None (no file: flags and defaults only). A file named by the flag or
    the variable must exist: a typo there would otherwise drop the whole
    config without a word."""
    if flag is not None:
        if not flag.strip():
            raise Fail("config.missing", "--config is empty: give the path of a TOML file, or drop --config")
        path = Path(flag)
        if not os.path.exists(path):
            raise Fail(
                "config.missing",
                f"--config {flag}: no such file; fix the path, or drop --config to use ${CONFIG_ENV} or {default}",
            )
        return path
    named = env.get(CONFIG_ENV)
    if named:
        path = Path(named)
        if not os.path.exists(path):
            raise Fail(
                "config.missing",
                f"{CONFIG_ENV}={named}: no such file; fix the path, or unset {CONFIG_ENV} "
                f"(in a systemd unit, its Environment= line) to use {default}",
            )
        return path
    # lexists: a dangling symlink at the default place is a broken install,
    # not an absent config, and load() will say so.
    if os.path.lexists(default):
        return default
    return None


YAML_SUFFIXES = (".yml", ".yaml")
# An fdl.yml's join block is a dozen keys; a document of more nodes than
# this, or nested deeper, is not one anyone wrote by hand.
MAX_YAML_NODES = 20_000
MAX_YAML_DEPTH = 64


def is_yaml(path: Path | str) -> bool:
    return Path(path).suffix.lower() in YAML_SUFFIXES


def load(path: Path | str, *, table: Table = TABLE, notes: list[str] | None = None) -> Checked:
    """Read, parse and validate `path`; return its [join] table as plain
    nested dicts ({} when the file has no [join]). Raises a permanent Fail
    for an unreadable file, bytes that are not UTF-8, a TOML syntax error
    (with line and column), and any key or value [join] does not take:
    each value of the file is checked here, where it enters, with its line,
    and `resolve` takes the table as it is. A `.yml`/`.yaml` file is read as
    floDl's fdl.yml. floDl's keys that only `fdl join` acts on are named in
    one note, appended to `notes`."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    path = Path(path)
    raw = _read(path)
    if raw is None:
        return Checked()
    _check_trust(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise Fail(
            "config.invalid",
            f"config {path}, line {line}: byte 0x{raw[exc.start]:02x} is not UTF-8, and TOML files "
            f"must be UTF-8: re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8 {path} > {path}.utf8 "
            f"&& mv {path}.utf8 {path})",
        ) from None
    if is_yaml(path):
        from prepare.config import yaml_file

        join, namer = yaml_file.join_block(path, text)
        if join is None:
            return Checked()
        return _checked(path, join, namer, table, notes, yaml=True)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise Fail("config.invalid", _syntax_message(path, text, exc)) from None
    except RecursionError:
        raise Fail("config.invalid", _too_deep(path)) from None
    try:
        return _join_table(path, text, doc, table, notes)
    except RecursionError:
        # Parsed, but nested deeper than the checks below (and the messages
        # that quote values) can walk.
        raise Fail("config.invalid", _too_deep(path)) from None


def _too_deep(path: Path) -> str:
    return (
        f"config {path} nests arrays or tables too deeply to be read (thousands of levels); no [join] key takes "
        "more than a list of plain values: fix or replace the file"
    )


def _read(path: Path) -> bytes | None:
    """The file's bytes, from a regular file of a config's size; None for
    /dev/null, the usual way to say "no config" (`--config /dev/null`).
    Opened without blocking (a FIFO would wait for a writer for ever) and
    checked before it is read: /dev/zero never ends, and another device or
    a FIFO is no config anyone wrote."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except IsADirectoryError:
        raise Fail("config.unreadable", f"config {path} is a directory; name the TOML file itself") from None
    except OSError as exc:
        raise Fail(
            "config.unreadable", f"config {path} cannot be read: {human.oserror(exc)}; {_read_fix(path, exc)}"
        ) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise Fail("config.unreadable", f"config {path} is a directory; name the TOML file itself")
        if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == _DEV_NULL:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise Fail(
                "config.unreadable",
                f"config {path} is {_file_type(st.st_mode)}, not a regular file: a config is a TOML file; point "
                f"--config / ${CONFIG_ENV} at one",
            )
        if st.st_size > MAX_CONFIG_BYTES:
            raise Fail(
                "config.unreadable",
                f"config {path} is {human.size(st.st_size)}, more than any config ({human.size(MAX_CONFIG_BYTES)} "
                f"at most): is it the right file? point --config / ${CONFIG_ENV} at the TOML file with [join]",
            )
        chunks = []
        left = MAX_CONFIG_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        raw = b"".join(chunks)
    except OSError as exc:
        raise Fail(
            "config.unreadable", f"config {path} cannot be read: {human.oserror(exc)}; {_read_fix(path, exc)}"
        ) from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise Fail(
            "config.unreadable",
            f"config {path} grew past {human.size(MAX_CONFIG_BYTES)} while it was read: point --config / "
            f"${CONFIG_ENV} at a TOML file that is not being written",
        )
    return raw


def _check_trust(path: Path) -> None:
    """As root, a config only root could have written: root does what it
    says (an ssh option such as ProxyCommand runs a command, a flake builds
    what it names), so whoever can edit it, or swap it, owns the box.
    Another user's own config is theirs to trust."""
    if os.geteuid() != 0:
        return
    from prepare.host import trust

    found = trust.doubt(str(path))
    if found is not None:
        raise Fail(
            "config.untrusted",
            f"config {path} is not trusted: {found.path} {found.why}. fdl-prepare runs as root and does what "
            f"its config says (an ssh option such as ProxyCommand runs a command), so only root may be able to "
            f"change it. Fix: {found.fix}",
        )


def _file_type(mode: int) -> str:
    for test, name in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _join_table(path: Path, text: str, doc: dict[str, Any], table: Table, notes: list[str] | None) -> Checked:
    if "join" not in doc:
        typo = next((k for k in doc if _looks_like_join(k)), None)
        if typo is not None:
            raise Fail(
                "config.invalid",
                f"config {path}: there is a [{typo}] table but no [join]; "
                f"did you mean [join]? fdl-prepare reads only [join]",
            )
        return Checked()
    join = doc["join"]
    if not isinstance(join, dict):
        shown = "an array of tables ([[join]])" if isinstance(join, list) else f"{show(join)}"
        raise Fail(
            "config.invalid",
            f"config {path}{at(_line_of(text, ('join',)))}: join must be a table written [join], got {shown}",
        )
    return _checked(path, join, _file_namer(text), table, notes)


def _checked(
    path: Path, join: Mapping[str, Any], namer: Namer, table: Table, notes: list[str] | None, *, yaml: bool = False
) -> Checked:
    problems: list[str] = []
    if yaml:
        # Reported with the rest, and kept from the checks below, which
        # would only say the same key is fine.
        join, problems = _without_ours_alone(join, namer, table)
    problems += validate(join, namer, table)
    if problems:
        raise Fail("config.invalid", problems_message(f"config {path}", problems))
    kept, foreign = split_foreign(join)
    checked = Checked(_plain(kept))
    checked.foreign = foreign
    if foreign and notes is not None:
        notes.append(foreign_note(f"config {path}", foreign))
    return checked


_SHARED_TABLES = frozenset(k.partition(".")[0] for k in SHARED_WITH_FLODL if "." in k)


def _without_ours_alone(join: Mapping[str, Any], namer: Namer, table: Table) -> tuple[dict[str, Any], list[str]]:
    """An fdl.yml's join block without the keys that are fdl-prepare's
    alone, and a problem for each: `fdl join` denies a field it does not
    know, so a file holding one would stop it."""
    kept: dict[str, Any] = {}
    found: list[str] = []
    for key, value in join.items():
        if key in table.subtables and isinstance(value, Mapping):
            if key not in _SHARED_TABLES:
                found.append(key)
                continue
            inner = {
                k: v for k, v in value.items() if f"{key}.{k}" in SHARED_WITH_FLODL or f"{key}.{k}" not in table.by_key
            }
            found += [f"{key}.{k}" for k in value if k not in inner]
            kept[key] = inner
        elif key in table.by_key and key not in SHARED_WITH_FLODL:
            found.append(key)
        else:
            kept[key] = value
    problems: list[tuple[int, str]] = []
    for dotted in found:
        full, line = namer(dotted)
        f = table.by_key.get(dotted)
        how = f"give it as a flag ({f.flag})" if f is not None else "give its values as flags"
        problems.append(
            (
                line or 0,
                f"{full}{at(line)} is fdl-prepare's alone, and `fdl join` refuses a join block holding a key it "
                f"does not know, so this fdl.yml would stop it: {how}, or keep fdl-prepare's own keys in a TOML "
                "config ([join] in /etc/fdl/prepare.toml)",
            )
        )
    return kept, [text for _, text in sorted(problems, key=lambda p: p[0])]


def _looks_like_join(key: str) -> bool:
    import difflib  # only for a config with a key that is not known

    low = key.lower()
    return low == "join" or sorted(low) == sorted("join") or difflib.SequenceMatcher(None, low, "join").ratio() >= 0.8


def _read_fix(path: Path, exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"let this user read it (sudo chmod a+r {path}, or chgrp it to this user's group)"
    return f"check {path}, or point --config / ${CONFIG_ENV} at another file"


_AT = re.compile(r"^(?P<reason>.*?)\s*\(at (?:line (?P<line>\d+), column (?P<col>\d+)|end of document)\)\s*$", re.S)


def _syntax_message(path: Path, text: str, exc: Exception) -> str:
    reason = getattr(exc, "msg", None)
    line = getattr(exc, "lineno", None)
    col = getattr(exc, "colno", None)
    found = _AT.match(str(exc))
    if found:
        reason = reason or found["reason"]
        if line is None:
            if found["line"]:
                line, col = int(found["line"]), int(found["col"])
            else:
                lines = text.split("\n")
                line, col = len(lines), len(lines[-1]) + 1
    reason = reason or str(exc)
    lines = text.split("\n")
    source = lines[line - 1] if line is not None and 0 < line <= len(lines) else None
    head = (
        f"config {path}, line {line}, column {col}: invalid TOML: {reason}"
        if line
        else (f"config {path}: invalid TOML: {reason}")
    )
    hint = _syntax_hint(reason, source)
    if hint:
        head += f" ({hint})"
    if source is not None and col is not None:
        head += f"\n    {source}\n    {' ' * (col - 1)}^"
    return head


def _syntax_hint(reason: str, source: str | None) -> str | None:
    if reason.startswith("Invalid value") and source is not None and "=" in source:
        value = source.split("=", 1)[1].strip()
        if value and (value[0].isalpha() or value[0] in "/.~") and value not in ("true", "false"):
            return f'strings need double quotes: {source.split("=", 1)[0].strip()} = "{value}"'
    if reason.startswith("Cannot overwrite a value"):
        return "a key is set twice"
    if reason.startswith("Illegal character '\\n'") or reason.startswith("Unterminated string"):
        return "a string is missing its closing quote"
    if reason.startswith("Cannot declare"):
        return "a table header appears twice; merge the two"
    return None


def _file_namer(text: str) -> Namer:
    def name(dotted: str) -> tuple[str, int | None]:
        path = ("join", *dotted.split("."))
        shown = ".".join(p if re.fullmatch(r"[A-Za-z0-9_-]+", p) else json.dumps(p) for p in path)
        return shown, _line_of(text, path)

    return name


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(?:#.*)?$")


_ASSIGN = re.compile(r"^\s*([A-Za-z0-9_\-\"'. ]+?)\s*=")


def _split_key(key: str) -> tuple[str, ...]:
    return tuple(part.strip().strip("\"'") for part in key.split("."))


def _line_of(text: str, path: tuple[str, ...]) -> int | None:
    """Best effort: the line where the dotted key `path` is set or its table
    declared. Inline tables and multi-line strings can hide it; then None."""
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.split("\n"), start=1):
        header = _HEADER.match(line)
        if header:
            table = _split_key(header[1])
            if table == path:
                return number
            continue
        assign = _ASSIGN.match(line)
        if assign and table + _split_key(assign[1]) == path:
            return number
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
