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
"""

from __future__ import annotations

import difflib
import errno
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from datetime import date, datetime, time
from pathlib import Path
from typing import Any

from prepare import human
from prepare.fail import permanent
from prepare.spec import DataSpec, PrepareSpec, SourceSpec, SshSpec

CONFIG_ENV = "FDL_PREPARE_CONFIG"
DEFAULT_PATH = Path("/etc/fdl/prepare.toml")
FLAKE_ENV = "FDL_PREPARE_FLAKE"
STATE_ENV = "STATE_DIRECTORY"

DEFAULT_LIST_TIMEOUT_S = PrepareSpec.list_timeout_s

# The flag for each [join] key (dotted below `join`), as the CLI spells them.
# Messages about a flag's value name the flag, so an operator who never
# wrote a config is not sent looking for one.
FLAG_NAMES: dict[str, str] = {
    "data_path": "--data-path",
    "data_source": "--data-source",
    "libtorch": "--libtorch",
    "devices": "--devices",
    "cpu_only": "--cpu-only",
    "flake": "--flake",
    "state_dir": "--state-dir",
    "list_timeout": "--list-timeout",
    "build_timeout": "--build-timeout",
    "source.from": "--source",
    "source.cwd": "--source-cwd",
    "source.build": "--source-build",
    "source.bin": "--source-bin",
    "ssh.target": "--ssh-target",
    "ssh.port": "--ssh-port",
    "ssh.user": "--ssh-user",
    "ssh.identity_file": "--identity-file",
    "ssh.options": "--ssh-option",
}


# -- finding the file ----------------------------------------------------------


def find_path(flag: str | None, env: Mapping[str, str], *, default: Path = DEFAULT_PATH) -> Path | None:
    """--config PATH, else $FDL_PREPARE_CONFIG, else `default` if present,
    else None (no file: flags and defaults only). A file named by the flag or
    the variable must exist: a typo there would otherwise drop the whole
    config without a word."""
    if flag is not None:
        if not flag.strip():
            raise permanent("--config is empty: give the path of a TOML file, or drop --config")
        path = Path(flag)
        if not os.path.exists(path):
            raise permanent(
                f"--config {flag}: no such file; fix the path, or drop --config to use "
                f"${CONFIG_ENV} or {default}"
            )
        return path
    named = env.get(CONFIG_ENV)
    if named:
        path = Path(named)
        if not os.path.exists(path):
            raise permanent(
                f"{CONFIG_ENV}={named}: no such file; fix the path, or unset {CONFIG_ENV} "
                f"(in a systemd unit, its Environment= line) to use {default}"
            )
        return path
    # lexists: a dangling symlink at the default place is a broken install,
    # not an absent config, and load() will say so.
    if os.path.lexists(default):
        return default
    return None


# -- loading the file ----------------------------------------------------------


def load(path: Path | str) -> dict[str, Any]:
    """Read, parse and validate `path`; return its [join] table as plain
    nested dicts ({} when the file has no [join]). Raises a permanent Fail
    for an unreadable file, bytes that are not UTF-8, a TOML syntax error
    (with line and column), and any key or value [join] does not take."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    path = Path(path)
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise permanent(f"config {path} is a directory; name the TOML file itself") from None
    except OSError as exc:
        raise permanent(f"config {path} cannot be read: {human.oserror(exc)}; {_read_fix(path, exc)}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise permanent(
            f"config {path}, line {line}: byte 0x{raw[exc.start]:02x} is not UTF-8, and TOML files "
            f"must be UTF-8: re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8 {path} > {path}.utf8 "
            f"&& mv {path}.utf8 {path})"
        ) from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise permanent(_syntax_message(path, text, exc)) from None

    if "join" not in doc:
        typo = next((k for k in doc if _looks_like_join(k)), None)
        if typo is not None:
            raise permanent(
                f"config {path}: there is a [{typo}] table but no [join]; "
                f"did you mean [join]? fdl-prepare reads only [join]"
            )
        return {}
    join = doc["join"]
    if not isinstance(join, dict):
        shown = "an array of tables ([[join]])" if isinstance(join, list) else f"{_show(join)}"
        raise permanent(
            f"config {path}{_at(_line_of(text, ('join',)))}: join must be a table written [join], "
            f"got {shown}"
        )
    problems = _validate(join, _file_namer(text))
    if problems:
        raise permanent(_problems_message(f"config {path}", problems))
    return _plain(join)


def _looks_like_join(key: str) -> bool:
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
    head = f"config {path}, line {line}, column {col}: invalid TOML: {reason}" if line else (
        f"config {path}: invalid TOML: {reason}"
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
    flag_names: Mapping[str, str] = FLAG_NAMES,
) -> PrepareSpec:
    """Merge flags over the file over environment defaults over built-in
    defaults, field by field, into a PrepareSpec.

    `file` is the [join] table (as `load` returns it); `flags` has the same
    nested shape, with None or a missing key meaning "not given". A given
    list (ssh.options, devices) replaces the file's list; an empty list is
    given and empty. Both are validated; a bad value is a permanent Fail
    naming the flag or the key."""
    problems = _validate(file, lambda key: (f"join.{key}", None))
    if problems:
        raise permanent(_problems_message("config", problems))
    given = _drop_none(flags)
    problems = _validate(given, _flag_namer(flag_names), flags=True)
    if problems:
        raise permanent(_problems_message("flags", problems))

    def pick(key: str, env_name: str | None = None, default: Any = None) -> tuple[Any, str | None]:
        """(value, where it came from) for the dotted `key`."""
        value = _get(given, key)
        if value is not None:
            return value, flag_names.get(key, key)
        value = _get(file, key)
        if value is not None:
            return value, f"join.{key} in the config"
        if env_name is not None:
            value = env_value(env, env_name)
            if value:
                return value, f"${env_name}"
        return default, None

    data = DataSpec(data_path=pick("data_path")[0], data_source=pick("data_source")[0])
    options = pick("ssh.options")[0]
    ssh = SshSpec(
        target=pick("ssh.target")[0],
        port=pick("ssh.port")[0],
        user=pick("ssh.user")[0],
        identity_file=pick("ssh.identity_file")[0],
        options=tuple(options) if options is not None else (),
    )
    source = None
    if isinstance(file.get("source"), Mapping) or isinstance(given.get("source"), Mapping):
        source = SourceSpec(
            from_=pick("source.from")[0],
            cwd=pick("source.cwd")[0],
            build=pick("source.build")[0],
            bin=pick("source.bin")[0],
        )
    devices = pick("devices")[0]
    cpu_only, cpu_origin = pick("cpu_only", default=False)
    libtorch, libtorch_origin = pick("libtorch")
    if cpu_only and libtorch is not None and libtorch not in ("cpu", "auto"):
        raise permanent(
            f"cpu_only (from {cpu_origin}) allows only the cpu libtorch, but libtorch is "
            f"{_show(libtorch)} (from {libtorch_origin}): set libtorch to \"cpu\" or \"auto\", "
            f"or drop cpu_only on a box with a GPU"
        )
    list_timeout = pick("list_timeout", default=DEFAULT_LIST_TIMEOUT_S)[0]
    build_timeout = pick("build_timeout")[0]
    return PrepareSpec(
        data=data,
        ssh=ssh,
        source=source,
        libtorch=libtorch,
        devices=tuple(devices) if devices is not None else None,
        cpu_only=bool(cpu_only),
        flake=pick("flake", FLAKE_ENV)[0],
        state_dir=pick("state_dir", STATE_ENV)[0],
        list_timeout_s=float(list_timeout),
        build_timeout_s=float(build_timeout) if build_timeout is not None else None,
    )


# Where each [join] key lives on a PrepareSpec, for messages about a spec
# built in code rather than read from a file.
_SPEC_FIELDS = {
    "data_path": "data.data_path",
    "data_source": "data.data_source",
    "list_timeout": "list_timeout_s",
    "build_timeout": "build_timeout_s",
    "source": "source",
    "source.from": "source.from_",
    "ssh": "ssh",
}


def check_spec(spec: PrepareSpec) -> None:
    """The same checks a config file gets, for a PrepareSpec a join loop
    built itself: a wrong type or range is a permanent Fail naming the spec
    field, before any step runs, never a traceback from deep inside one."""
    table: dict[str, Any] = {
        "data_path": spec.data.data_path,
        "data_source": spec.data.data_source,
        "libtorch": spec.libtorch,
        "devices": list(spec.devices) if isinstance(spec.devices, tuple) else spec.devices,
        "cpu_only": spec.cpu_only,
        "flake": spec.flake,
        "state_dir": spec.state_dir,
        "list_timeout": spec.list_timeout_s,
        "build_timeout": spec.build_timeout_s,
        "ssh": {
            "target": spec.ssh.target,
            "port": spec.ssh.port,
            "user": spec.ssh.user,
            "identity_file": spec.ssh.identity_file,
            "options": list(spec.ssh.options) if isinstance(spec.ssh.options, tuple) else spec.ssh.options,
        },
    }
    if spec.source is not None:
        table["source"] = {
            "from": spec.source.from_,
            "cwd": spec.source.cwd,
            "build": spec.source.build,
            "bin": spec.source.bin,
        }
    given = _drop_none(table)
    given["ssh"] = {k: v for k, v in table["ssh"].items() if v is not None and v != []}

    def name(dotted: str) -> tuple[str, int | None]:
        sub, _, key = dotted.rpartition(".")
        if dotted in _SPEC_FIELDS:
            return f"PrepareSpec.{_SPEC_FIELDS[dotted]}", None
        if sub:
            return f"PrepareSpec.{_SPEC_FIELDS.get(sub, sub)}.{key}", None
        return f"PrepareSpec.{dotted}", None

    # flags=True: no TOML spelling hints for a value that came from code.
    problems = _validate(given, name, flags=True)
    if problems:
        raise permanent(_problems_message("PrepareSpec", problems))


def env_value(env: Mapping[str, str], name: str) -> str | None:
    """A default from the environment, None when unset or empty."""
    value = env.get(name)
    if not value:
        return None
    if name == STATE_ENV:
        # systemd joins several StateDirectory= entries with ':'; the first is
        # the unit's own.
        value = value.split(":", 1)[0]
    return value or None


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


def parse_devices(text: str, *, field: str = "--devices") -> list[int]:
    """`0,1` -> [0, 1], for a flag or an environment variable. Bad input is a
    permanent Fail naming `field`."""
    parts = [p.strip() for p in text.split(",")]
    # isascii: str.isdigit() also admits digits such as '²' that int() refuses.
    if not text.strip() or any(not (p.isascii() and p.isdigit()) for p in parts):
        raise permanent(
            f"{field} {_show(text)}: expected comma-separated device indices such as {field} 0,1 "
            f"(omit it to offer every visible device)"
        )
    return [int(p) for p in parts]


# -- the schema --------------------------------------------------------------------

Checker = Callable[[Any], "str | None"]


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, (datetime, date, time)):
        return "a date/time"
    return type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _string(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"expected a string, got {_kind(value)}"
    if not value.strip():
        return "expected a non-empty string; leave it out to keep it unset"
    return None


def _boolean(value: Any) -> str | None:
    if isinstance(value, bool):
        return None
    return f"expected true or false (unquoted), got {_kind(value)}"


def _port(value: Any) -> str | None:
    if not _is_int(value):
        return f"expected an integer port from 1 to 65535, got {_kind(value)}"
    if not 1 <= value <= 65535:
        return "expected a port from 1 to 65535"
    return None


def _seconds(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a number of seconds greater than 0, got {_kind(value)}"
    if not math.isfinite(value) or value <= 0:
        return "expected a finite number of seconds greater than 0"
    return None


def _devices(value: Any) -> str | None:
    if not isinstance(value, (list, tuple)):
        return f"expected an array of device indices such as [0, 1], got {_kind(value)}"
    if not value:
        return (
            "an empty list offers no device at all; leave it out to offer every visible device, "
            "or set cpu_only for a box without one"
        )
    for item in value:
        if not _is_int(item):
            return f"expected device indices (integers from 0), but {_show(item)} is {_kind(item)}"
        if item < 0:
            return f"expected device indices from 0 up, got {item}"
    seen = [d for i, d in enumerate(value) if d in value[:i]]
    if seen:
        return f"device {seen[0]} is listed twice"
    return None


def _strings(value: Any) -> str | None:
    if not isinstance(value, (list, tuple)):
        return f'expected an array of strings such as ["ServerAliveInterval=15"], got {_kind(value)}'
    for item in value:
        if not isinstance(item, str):
            return f"expected an array of strings, but {_show(item)} is {_kind(item)}"
        if not item.strip():
            return "expected non-empty strings, got an empty one"
    return None


_SOURCE: dict[str, Checker] = {"from": _string, "cwd": _string, "build": _string, "bin": _string}
_SSH: dict[str, Checker] = {
    "target": _string,
    "port": _port,
    "user": _string,
    "identity_file": _string,
    "options": _strings,
}
_JOIN: dict[str, Checker] = {
    "data_path": _string,
    "data_source": _string,
    "libtorch": _string,
    "devices": _devices,
    "cpu_only": _boolean,
    "flake": _string,
    "state_dir": _string,
    "list_timeout": _seconds,
    "build_timeout": _seconds,
}
_TABLES: dict[str, dict[str, Checker]] = {"": _JOIN, "source": _SOURCE, "ssh": _SSH}

# How to write each kind of value in TOML, for the "write it as" hint.
_EXAMPLES: dict[Checker, str] = {
    _boolean: "true",
    _port: "22",
    _seconds: "30",
    _devices: "[0, 1]",
    _strings: '["ServerAliveInterval=15"]',
}

# (full key, line or None) for a dotted key below join.
Namer = Callable[[str], "tuple[str, int | None]"]


def _validate(table: Mapping[str, Any], name: Namer, *, flags: bool = False) -> list[str]:
    """Every problem in `table`, in the order they appear in the file."""
    found: list[tuple[int, str]] = []

    def problem_at(line: int | None, text: str) -> None:
        found.append((line if line is not None else 1 << 30, text))

    for sub, schema in _TABLES.items():
        node = table if not sub else table.get(sub)
        if node is None:
            continue
        if not isinstance(node, Mapping):
            full, line = name(sub)
            problem_at(
                line,
                f"{full}{_at(line)} = {_show(node)}: expected a table, written [join.{sub}] "
                f"on a line of its own with its keys below it, got {_kind(node)}"
            )
            continue
        for key, value in node.items():
            dotted = f"{sub}.{key}" if sub else key
            if not sub and key in ("source", "ssh"):
                continue
            full, line = name(dotted)
            check = schema.get(key)
            if check is None:
                if flags:
                    # A caller bug, not an operator's typo: no flag has this name.
                    raise ValueError(f"unknown flag key {dotted!r}")
                problem_at(line, f"unknown key {full}{_at(line)}; {_suggest(sub, key)}")
                continue
            if value is None and flags:
                continue
            problem = check(value)
            if problem:
                problem_at(line, f"{full}{_at(line)} = {_show(value)}: {problem}{_hint(check, key, value, flags)}")
    return [text for _, text in sorted(found, key=lambda item: item[0])]


def _hint(check: Checker, key: str, value: Any, flags: bool) -> str:
    if flags:
        return ""
    if check is _string and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f'; quote it: {key} = "{value}"'
    if check is _strings and isinstance(value, str):
        return f"; write it as a list: {key} = [{_show(value)}]"
    if isinstance(value, str) and check in _EXAMPLES:
        how = "as a list" if check is _devices else "without quotes"
        return f"; write it {how}: {key} = {_unquoted(check, value) or _EXAMPLES[check]}"
    if check is _devices and _is_int(value):
        return f"; write it as a list: {key} = [{value}]"
    return ""


def _unquoted(check: Checker, value: str) -> str | None:
    """What the operator meant by a quoted value, when that is clear."""
    text = value.strip()
    if check is _boolean and text.lower() in ("true", "false"):
        return text.lower()
    if check in (_port, _seconds) and re.fullmatch(r"\d+(\.\d+)?", text):
        return text
    if check is _devices and re.fullmatch(r"\d+(\s*,\s*\d+)*", text):
        return "[" + ", ".join(p.strip() for p in text.split(",")) + "]"
    return None


def _suggest(sub: str, key: str) -> str:
    here = f"[join.{sub}]" if sub else "[join]"
    schema = _TABLES[sub]
    valid = f"{here} takes: {', '.join(k for k in schema)}" + (
        "" if sub else ", and the tables [join.source] and [join.ssh]"
    )
    for other, other_schema in _TABLES.items():
        if other != sub and key in other_schema:
            where = f"join.{other}.{key}" if other else f"join.{key}"
            table = f"[join.{other}]" if other else "[join]"
            return f"did you mean {where}? {key} belongs in {table}"
    close = difflib.get_close_matches(key, list(schema) + ([] if sub else list(_TABLES)[1:]), n=1, cutoff=0.6)
    if close:
        return f"did you mean join.{sub + '.' if sub else ''}{close[0]}? {valid}"
    for other, other_schema in _TABLES.items():
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


def _flag_namer(flag_names: Mapping[str, str]) -> Namer:
    def name(dotted: str) -> tuple[str, int | None]:
        flag = flag_names.get(dotted)
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


def _show(value: Any) -> str:
    """A value as it would be written in TOML, so the operator recognises it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    return repr(value)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value

