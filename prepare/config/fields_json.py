"""The field table as nix/fields.json, the one file both sides read.

nix/module.nix builds its `settings.join` options from that file (through
nix/fields.nix), so no option type is written twice: a Field's `nix` type,
its help text, its default and an example reach the module from here. The
file is committed (a flake evaluates it without Python) and a test fails
when it differs from what this module writes now:

    python -m prepare.config.fields_json > nix/fields.json

A type is written in Field.nix as a `lib.types` expression
("nullOr (listOf ints.unsigned)") and exported both as that text and as a
tree Nix can apply without parsing: a name is a path into `lib.types`
("ints.unsigned"); an application is a list, the function's name first,
then its arguments, each a type or a number (["nullOr", ["listOf",
"ints.unsigned"]], ["numbers.between", 1, 86400]).

Not imported by the CLI: only the command above and the tests run it.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from prepare.config.fields import TABLE, Field, Table

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Named by where this module is, so the command follows it if it moves.
COMMAND = f"python -m {__spec__.name} > nix/fields.json"

# A type tree: a name, or [function, argument, ...] with numbers or trees as arguments.
Tree = Any

_TOKEN = re.compile(r"\s*(?:(\()|(\))|(-?\d+(?:\.\d+)?)(?![\w.])|([A-Za-z_][\w.]*))")


def type_tree(expression: str) -> Tree:
    """A `lib.types` expression as a tree; ValueError for anything else
    (a string or a list literal, a lambda): the table names types, nothing more."""
    tokens: list[tuple[str, Any]] = []
    pos = 0
    while pos < len(expression.rstrip()):
        m = _TOKEN.match(expression, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"nix type {expression!r}: cannot read it from {expression[pos:]!r}")
        opened, closed, number, name = m.groups()
        if opened:
            tokens.append(("(", None))
        elif closed:
            tokens.append((")", None))
        elif number is not None:
            tokens.append(("number", float(number) if "." in number else int(number)))
        else:
            tokens.append(("name", name))
        pos = m.end()

    def application(i: int) -> tuple[Tree, int]:
        terms: list[Tree] = []
        while i < len(tokens) and tokens[i][0] != ")":
            kind, value = tokens[i]
            if kind == "(":
                inner, i = application(i + 1)
                if i >= len(tokens):
                    raise ValueError(f"nix type {expression!r}: a '(' is never closed")
                terms.append(inner)
            else:
                terms.append(value)
            i += 1
        if not terms:
            raise ValueError(f"nix type {expression!r}: empty parentheses")
        if len(terms) == 1:
            return terms[0], i
        if not isinstance(terms[0], str):
            raise ValueError(f"nix type {expression!r}: {terms[0]!r} is applied, but only a type's name can be")
        return terms, i

    tree, end = application(0)
    if end != len(tokens):
        raise ValueError(f"nix type {expression!r}: a ')' closes nothing")
    if not isinstance(tree, (str, list)):
        raise ValueError(f"nix type {expression!r}: a number is not a type")
    return tree


def _json_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _example(f: Field) -> Any:
    """The kind's example (TOML text) as a value, None where it has none."""
    if f.kind.example is None:
        return None
    return tomllib.loads(f"x = {f.kind.example}")["x"]


def entry(f: Field) -> dict[str, Any]:
    return {
        "key": f.key,
        "table": f.table,
        "name": f.name,
        "flag": f.flag,
        "nix": f.nix,
        "type": type_tree(f.nix) if f.nix is not None else None,
        "default": _json_value(f.default),
        "description": f.help,
        "example": _example(f),
    }


def module_table(table: Table = TABLE) -> dict[str, Any]:
    """What nix/fields.json holds: every field, typed or not, in table order
    ([join] first, then each sub-table), so the module can also tell a key it
    decides itself from one the table gained since."""
    return {
        "generated": f"from prepare/config/fields.py by `{COMMAND}`; edit the table, not this file",
        "tables": table.subtables,
        "fields": [entry(f) for t in table.tables.values() for f in t.values()],
    }


def render(table: Table = TABLE) -> str:
    return json.dumps(module_table(table), indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
