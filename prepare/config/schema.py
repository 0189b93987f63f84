"""A [join]-shaped table checked against the field table: every unknown
key (with a suggestion for the key meant) and every bad value (with a hint
for how to write it), in the order they appear, each named as its source
names it: `join.ssh.port (line 4)` for the file, `--ssh-port
(join.ssh.port)` for a flag.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from prepare.config.fields import FOREIGN_BY_KEY, FOREIGN_RULES, Table
from prepare.config.kinds import BOOLEAN, BUILD_SECONDS, DEVICES, LIST_SECONDS, PORT, SECONDS, Kind, kind_of, show


class Checked(dict[str, Any]):
    """A [join] table whose every key and value was checked where it entered
    (the file, by `load`, each problem with its line): `resolve` takes it as
    it is, and no value of it is checked twice. floDl's own keys (`foreign`,
    their full names) were checked and taken out: they are `fdl join`'s."""

    foreign: tuple[str, ...] = ()


# (full key, line or None) for a dotted key below join.
Namer = Callable[[str], "tuple[str, int | None]"]


def validate(join: Mapping[str, Any], name: Namer, table: Table, *, flags: bool = False) -> list[str]:
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
                f"{full}{at(line)} = {show(node)}: expected a table, written [join.{sub}] "
                f"on a line of its own with its keys below it, got {kind_of(node)}",
            )
            continue
        for key, value in node.items():
            dotted = f"{sub}.{key}" if sub else key
            if not sub and key in table.subtables:
                continue
            full, line = name(dotted)
            f = schema.get(key)
            foreign = None if flags else FOREIGN_BY_KEY.get(dotted)
            if f is None and foreign is not None:
                problem = foreign.kind.check(value)
                if problem:
                    problem_at(line, f"{full}{at(line)} = {foreign.kind.show(value)}: {problem}")
                continue
            if f is None:
                if flags:
                    # A caller bug, not an operator's typo: no flag has this name.
                    raise ValueError(f"unknown flag key {dotted!r}")
                problem_at(line, f"unknown key {full}{at(line)}; {_suggest(sub, key, table)}")
                continue
            if value is None and flags:
                continue
            problem = f.kind.check(value)
            if problem:
                problem_at(
                    line, f"{full}{at(line)} = {f.kind.show(value)}: {problem}{_hint(f.kind, key, value, flags)}"
                )
    if not flags:
        for rule in FOREIGN_RULES:
            said = rule(join, name)
            if said is not None:
                problem_at(*said)
    return [text for _, text in sorted(found, key=lambda item: item[0])]


def split_foreign(join: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The [join] table without floDl's own keys, and their full names."""
    kept = {k: v for k, v in join.items() if k not in FOREIGN_BY_KEY}
    return kept, tuple(f"join.{k}" for k in join if k in FOREIGN_BY_KEY)


def foreign_note(where: str, names: tuple[str, ...]) -> str:
    """The one note that says which of floDl's keys a config holds, and
    that they are left to `fdl join`."""
    said = ", ".join(f"{n} ({FOREIGN_BY_KEY[n.partition('.')[2]].meaning})" for n in names)
    return f"{where}: {said}: `fdl join`'s, left to it; fdl-prepare does not act on them"


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
    theirs = [] if sub else difflib.get_close_matches(key, list(FOREIGN_BY_KEY), n=1, cutoff=0.75)
    if theirs:
        return f"did you mean join.{theirs[0]}, `fdl join`'s ({FOREIGN_BY_KEY[theirs[0]].meaning})? {valid}"
    for other, other_schema in table.tables.items():
        if other == sub:
            continue
        close = difflib.get_close_matches(key, list(other_schema), n=1, cutoff=0.75)
        if close:
            where = f"join.{other}.{close[0]}" if other else f"join.{close[0]}"
            return f"did you mean {where}? {valid}"
    return valid


def flag_namer(table: Table) -> Namer:
    def name(dotted: str) -> tuple[str, int | None]:
        flag = table.flag_names.get(dotted)
        return (f"{flag} (join.{dotted})" if flag else f"join.{dotted}"), None

    return name


def problems_message(where: str, problems: list[str]) -> str:
    if len(problems) == 1:
        return f"{where}: {problems[0]}"
    return f"{where}: {len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems)


def at(line: int | None) -> str:
    return f" (line {line})" if line is not None else ""
