"""The TOML config, its validation, and the one place precedence lives.

    path = find_path(flag, os.environ)          # --config, $FDL_PREPARE_CONFIG, /etc/fdl/prepare.toml
    table = load(path) if path else {}          # the [join] table, validated
    spec = resolve(table, flags, os.environ)    # flags > file > environment > built-in

Precedence lives in `resolve` alone so that each rule is stated once and
tested once: a flag beats the file, the file beats a default taken from the
environment (`FDL_PREPARE_FLAKE`, which the nix app sets to its own flake,
and systemd's `STATE_DIRECTORY`), and those beat the built-in defaults.
Merging is per field, including inside [join.source] and [join.ssh]: a flag
for one field leaves the file's other fields alone. A list given as a flag
(`--ssh-option`, `--devices`) replaces the file's list rather than extending
it, so what the command line shows is what runs.

A bad config is a permanent Fail: a persist loop retrying it would hot-loop
on a typo. Every message names the full key (`join.ssh.port`) or the flag,
quotes the bad value, names the file, and says what to write instead. The
file may hold tables for other tools; only [join] is read, but inside it an
unknown key is an error, because a misspelt key silently ignored is a box
that does something the operator did not ask for.

Which keys there are, their flags, checks, defaults and environment
fallbacks is not written here: it is the field table in `prepare.config.fields`,
and this module only applies it, so no key needs an edit here.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import stat
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from prepare.config.fields import (
    BOOLEAN,
    BUILD_SECONDS,
    DEVICES,
    LIST_SECONDS,
    PORT,
    RULES,
    SECONDS,
    TABLE,
    Env,
    Field,
    Kind,
    Table,
    kind_of,
    show,
    value_at,
)

# Named through the config by the steps and the tests.
from prepare.config.fields import FLAKE_ENV as FLAKE_ENV
from prepare.config.fields import STATE_ENV as STATE_ENV
from prepare.config.fields import parse_devices as parse_devices
from prepare.fail import Fail
from prepare.host import human
from prepare.spec import Origin, PrepareSpec

CONFIG_ENV = "FDL_PREPARE_CONFIG"
DEFAULT_PATH = Path("/etc/fdl/prepare.toml")
# A config is a few hundred bytes; a file far larger is the wrong file.
MAX_CONFIG_BYTES = 1 << 20
# /dev/null's device numbers, the same on every Linux.
_DEV_NULL = (1, 3)

# The flag for each [join] key (dotted below `join`), as the CLI spells them.
# Messages about a flag's value name the flag, so an operator who never
# wrote a config is not sent looking for one.
FLAG_NAMES: dict[str, str] = TABLE.flag_names


# -- finding the file ----------------------------------------------------------


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


# -- loading the file ----------------------------------------------------------


def load(path: Path | str, *, table: Table = TABLE) -> dict[str, Any]:
    """Read, parse and validate `path`; return its [join] table as plain
    nested dicts ({} when the file has no [join]). Raises a permanent Fail
    for an unreadable file, bytes that are not UTF-8, a TOML syntax error
    (with line and column), and any key or value [join] does not take."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    path = Path(path)
    raw = _read(path)
    if raw is None:
        return {}
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
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise Fail("config.invalid", _syntax_message(path, text, exc)) from None
    except RecursionError:
        raise Fail("config.invalid", _too_deep(path)) from None
    try:
        return _join_table(path, text, doc, table)
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


def _join_table(path: Path, text: str, doc: dict[str, Any], table: Table) -> dict[str, Any]:

    if "join" not in doc:
        typo = next((k for k in doc if _looks_like_join(k)), None)
        if typo is not None:
            raise Fail(
                "config.invalid",
                f"config {path}: there is a [{typo}] table but no [join]; "
                f"did you mean [join]? fdl-prepare reads only [join]",
            )
        return {}
    join = doc["join"]
    if not isinstance(join, dict):
        shown = "an array of tables ([[join]])" if isinstance(join, list) else f"{show(join)}"
        raise Fail(
            "config.invalid",
            f"config {path}{_at(_line_of(text, ('join',)))}: join must be a table written [join], got {shown}",
        )
    problems = _validate(join, _file_namer(text), table)
    if problems:
        raise Fail("config.invalid", _problems_message(f"config {path}", problems))
    plain: dict[str, Any] = _plain(join)
    return plain


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


# -- resolving: the one place precedence lives ----------------------------------


def resolve(
    file: Mapping[str, Any],
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    table: Table = TABLE,
) -> PrepareSpec:
    """Merge flags over the file over environment defaults over built-in
    defaults, field by field, into a PrepareSpec that records where each
    value came from (`PrepareSpec.origin`).

    `file` is the [join] table (as `load` returns it); `flags` has the same
    nested shape, with None or a missing key meaning "not given". A given
    list (ssh.options, devices) replaces the file's list; an empty list is
    given and empty. Both are validated; a bad value is a permanent Fail
    naming the flag or the key, and so is a combination of values that
    cannot work together (RULES)."""
    problems = _validate(file, lambda key: (f"join.{key}", None), table)
    if problems:
        raise Fail("config.invalid", _problems_message("config", problems))
    given = _drop_none(flags)
    problems = _validate(given, _flag_namer(table), table, flags=True)
    if problems:
        raise Fail("config.invalid", _problems_message("flags", problems))

    values: dict[str, Any] = {}
    origins: dict[str, Origin] = {}
    # Spec groups (source) whose table the file or the flags have: an
    # optional group is built only then, even with nothing set inside.
    present: set[str] = set()
    for f in table.fields:
        origin = _pick(f, given, file, env)
        value = f.kind.to_spec(origin.value) if origin.value is not None else None
        values[f.spec] = value
        origins[f.spec] = replace(origin, value=value)
        if f.table and (isinstance(file.get(f.table), Mapping) or isinstance(given.get(f.table), Mapping)):
            present.add(f.spec.partition(".")[0])
    spec = _build(table.spec_type, values, present, origins)
    _check_rules(spec)
    return spec


def _pick(f: Field, given: Mapping[str, Any], file: Mapping[str, Any], env: Mapping[str, str]) -> Origin:
    """The value `f` takes, with where it came from (still in the TOML's
    form: the caller converts it)."""
    value = _get(given, f.key)
    if value is not None:
        return Origin("flag", f.flag, value)
    value = _get(file, f.key)
    if value is not None:
        return Origin("file", f"join.{f.key}", value)
    if f.env is not None:
        value = f.env.read(env)
        if value:
            return Origin("environment", f.env.name, value, note=f.env.note)
    return Origin("default", "the default", f.default)


def _build(
    spec_type: type[PrepareSpec], values: Mapping[str, Any], present: set[str], origins: Mapping[str, Origin]
) -> PrepareSpec:
    """The spec from values by spec path. A group ("ssh.port" is in the
    group ssh) is built with its own class, read off the spec's annotations;
    one the spec declares optional (source) stays None unless present."""
    hints = typing.get_type_hints(spec_type)
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        group, _, attr = path.partition(".")
        if attr:
            groups.setdefault(group, {})[attr] = value
        else:
            top[path] = value
    for group, attrs in groups.items():
        declared = typing.get_args(hints[group])
        optional = type(None) in declared
        cls = next(t for t in declared if t is not type(None)) if optional else hints[group]
        top[group] = cls(**attrs) if group in present or not optional else None
    return spec_type(**top, origins=origins)


# -- a spec built in code ----------------------------------------------------------------


def check_spec(spec: PrepareSpec, *, table: Table = TABLE) -> PrepareSpec:
    """The same checks a config file gets, for a PrepareSpec a join loop
    built itself: a wrong type or range, or values that cannot work together,
    is a permanent Fail naming the spec field, before any step runs, never a
    traceback from deep inside one. Returns the spec with its values in the
    form resolve gives them (a URL without surrounding spaces)."""
    problems = _shape_problems(spec, table)
    if problems:
        raise Fail("config.invalid", _problems_message("PrepareSpec", problems))
    for f in table.fields:
        value = value_at(spec, f.spec)
        if value is None:
            if f.default is not None:
                # The steps read it as the default's type: a None there is
                # a crash deep inside a step, not "unset".
                problems.append(
                    f"PrepareSpec.{f.spec} = None: {f.kind.check(None)}; leave it out for the default "
                    f"{f.kind.show(f.default)}"
                )
            continue
        problem = f.kind.check(value)
        if problem:
            # No TOML spelling hints for a value that came from code.
            problems.append(f"PrepareSpec.{f.spec} = {f.kind.show(value)}: {problem}")
    if problems:
        raise Fail("config.invalid", _problems_message("PrepareSpec", problems))
    spec = _normalised(spec, table)
    _check_rules(spec)
    return spec


@functools.cache
def _groups(table: Table) -> dict[str, tuple[type, bool]]:
    """Each group of the spec (`data`, `ssh`, `source`, `nix`): its class,
    and whether it may be None."""
    hints = typing.get_type_hints(table.spec_type)
    out: dict[str, tuple[type, bool]] = {}
    for f in table.fields:
        group, dot, _ = f.spec.partition(".")
        if not dot or group in out:
            continue
        declared = typing.get_args(hints[group])
        optional = type(None) in declared
        cls = next(t for t in declared if t is not type(None)) if optional else hints[group]
        out[group] = (cls, optional)
    return out


def _shape_problems(spec: Any, table: Table) -> list[str]:
    """A spec built in code whose groups are not the classes it declares
    (a dict, a string, None) would fail inside a step with an
    AttributeError: say which field instead."""
    if not isinstance(spec, table.spec_type):
        return [f"expected a {table.spec_type.__name__}, got {type(spec).__name__}"]
    problems = []
    for group, (cls, optional) in _groups(table).items():
        value = getattr(spec, group, None)
        if value is None and optional:
            continue
        if not isinstance(value, cls):
            got = "None" if value is None else type(value).__name__
            problems.append(
                f"PrepareSpec.{group} = {_short_repr(value)}: expected a {cls.__name__} "
                f"(PrepareSpec({group}={cls.__name__}(...))), got {got}"
            )
    if not isinstance(spec.origins, Mapping):
        problems.append(f"PrepareSpec.origins = {_short_repr(spec.origins)}: expected a mapping; leave it out")
    return problems


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _normalised(spec: PrepareSpec, table: Table) -> PrepareSpec:
    """`spec` with every value in the form Kind.to_spec gives it; the very
    same spec when they all are (as a resolved one's are)."""
    changes: dict[str, dict[str, Any]] = {}
    for f in table.fields:
        value = value_at(spec, f.spec)
        if value is None:
            continue
        normal = f.kind.to_spec(value)
        if normal != value or type(normal) is not type(value):
            group, _, attr = f.spec.rpartition(".")
            changes.setdefault(group, {})[attr] = normal
    top = changes.pop("", {})
    # The spec nests one level deep (ssh.port), so groups are plain attributes.
    for group, attrs in changes.items():
        top[group] = replace(getattr(spec, group), **attrs)
    return replace(spec, **top) if top else spec


def _check_rules(spec: PrepareSpec) -> None:
    """RULES, for a resolved spec (naming flags, keys and variables) and one
    built in code (naming its fields) alike."""

    def where(path: str) -> str:
        origin = spec.origin(path)
        return str(origin) if origin is not None else f"PrepareSpec.{path}"

    problems = [problem for rule in RULES if (problem := rule(spec, where)) is not None]
    if len(problems) == 1:
        raise Fail("config.invalid", problems[0])
    if problems:
        raise Fail("config.invalid", f"{len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems))


def env_value(env: Mapping[str, str], name: str) -> str | None:
    """A default from the environment, None when unset or empty; read as
    the field it is the default of reads it."""
    return TABLE.envs.get(name, Env(name)).read(env)


def _get(table: Mapping[str, Any], dotted: str) -> Any:
    node: Any = table
    for part in dotted.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _drop_none(flags: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if isinstance(value, Mapping):
            inner = {k: v for k, v in value.items() if v is not None}
            if inner:
                out[key] = inner
        elif value is not None:
            out[key] = value
    return out


# -- the schema, from the field table ----------------------------------------------------------

# (full key, line or None) for a dotted key below join.
Namer = Callable[[str], "tuple[str, int | None]"]


def _validate(join: Mapping[str, Any], name: Namer, table: Table, *, flags: bool = False) -> list[str]:
    """Every problem in the [join] table `join`, in the order they appear in the file."""
    found: list[tuple[int, str]] = []

    def problem_at(line: int | None, text: str) -> None:
        found.append((line if line is not None else 1 << 30, text))

    for sub, schema in table.tables.items():
        node = join if not sub else join.get(sub)
        if node is None:
            continue
        if not isinstance(node, Mapping):
            full, line = name(sub)
            problem_at(
                line,
                f"{full}{_at(line)} = {show(node)}: expected a table, written [join.{sub}] "
                f"on a line of its own with its keys below it, got {kind_of(node)}",
            )
            continue
        for key, value in node.items():
            dotted = f"{sub}.{key}" if sub else key
            if not sub and key in table.subtables:
                continue
            full, line = name(dotted)
            f = schema.get(key)
            if f is None:
                if flags:
                    # A caller bug, not an operator's typo: no flag has this name.
                    raise ValueError(f"unknown flag key {dotted!r}")
                problem_at(line, f"unknown key {full}{_at(line)}; {_suggest(sub, key, table)}")
                continue
            if value is None and flags:
                continue
            problem = f.kind.check(value)
            if problem:
                problem_at(
                    line, f"{full}{_at(line)} = {f.kind.show(value)}: {problem}{_hint(f.kind, key, value, flags)}"
                )
    return [text for _, text in sorted(found, key=lambda item: item[0])]


def _hint(kind: Kind, key: str, value: Any, flags: bool) -> str:
    if flags:
        return ""
    if (
        kind.flag_type is str
        and kind.example is None
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    ):
        return f'; quote it: {key} = "{value}"'
    if kind.flag_type is list and isinstance(value, str):
        return f"; write it as a list: {key} = {kind.show([value])}"
    if isinstance(value, str) and kind.example is not None:
        how = "as a list" if kind is DEVICES else "without quotes"
        return f"; write it {how}: {key} = {_unquoted(kind, value) or kind.example}"
    if kind is DEVICES and isinstance(value, int) and not isinstance(value, bool):
        return f"; write it as a list: {key} = [{value}]"
    return ""


def _unquoted(kind: Kind, value: str) -> str | None:
    """What the operator meant by a quoted value, when that is clear."""
    text = value.strip()
    if kind is BOOLEAN and text.lower() in ("true", "false"):
        return text.lower()
    if kind in (PORT, SECONDS, LIST_SECONDS, BUILD_SECONDS) and re.fullmatch(r"\d+(\.\d+)?", text):
        return text
    if kind is DEVICES and re.fullmatch(r"\d+(\s*,\s*\d+)*", text):
        return "[" + ", ".join(p.strip() for p in text.split(",")) + "]"
    return None


def _suggest(sub: str, key: str, table: Table) -> str:
    here = f"[join.{sub}]" if sub else "[join]"
    schema = table.tables[sub]
    subtables = " and ".join(f"[join.{t}]" for t in table.subtables)
    valid = f"{here} takes: {', '.join(schema)}" + ("" if sub else f", and the tables {subtables}")
    for other, other_schema in table.tables.items():
        if other != sub and key in other_schema:
            where = f"join.{other}.{key}" if other else f"join.{key}"
            within = f"[join.{other}]" if other else "[join]"
            return f"did you mean {where}? {key} belongs in {within}"
    import difflib  # only for a config with a key that is not known

    close = difflib.get_close_matches(key, list(schema) + ([] if sub else table.subtables), n=1, cutoff=0.6)
    if close:
        return f"did you mean join.{sub + '.' if sub else ''}{close[0]}? {valid}"
    for other, other_schema in table.tables.items():
        if other == sub:
            continue
        close = difflib.get_close_matches(key, list(other_schema), n=1, cutoff=0.75)
        if close:
            where = f"join.{other}.{close[0]}" if other else f"join.{close[0]}"
            return f"did you mean {where}? {valid}"
    return valid


def _file_namer(text: str) -> Namer:
    def name(dotted: str) -> tuple[str, int | None]:
        path = ("join", *dotted.split("."))
        shown = ".".join(p if re.fullmatch(r"[A-Za-z0-9_-]+", p) else json.dumps(p) for p in path)
        return shown, _line_of(text, path)

    return name


def _flag_namer(table: Table) -> Namer:
    def name(dotted: str) -> tuple[str, int | None]:
        flag = table.flag_names.get(dotted)
        return (f"{flag} (join.{dotted})" if flag else f"join.{dotted}"), None

    return name


def _problems_message(where: str, problems: list[str]) -> str:
    if len(problems) == 1:
        return f"{where}: {problems[0]}"
    return f"{where}: {len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems)


# -- locating a key in the text, for line numbers ------------------------------------

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


def _at(line: int | None) -> str:
    return f" (line {line})" if line is not None else ""


# -- small helpers --------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
