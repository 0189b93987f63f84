"""Reason codes: README.md's table, `prepare.fail.Reason` and the places
that raise a Fail say the same thing.

The code is read as Python (ast), not grepped: a reason is whatever string
reaches `reason=` (or a reason map, or a fetch's `unreachable=`), and its
kind is the function that raised it (`permanent`, `transient`) or the
`permanent=` it was given. A reason documented but raised nowhere, raised
but documented nowhere, or raised with a kind the table does not give, fails
here."""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

import pytest

from prepare import nix_diagnosis
from prepare.fail import Fail, Reason, permanent, transient

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "prepare"
ROW = re.compile(r"^\| `([a-z]+\.[a-z-]+)` \| (permanent|transient) \| (.+) \|$")


def documented() -> dict[str, str]:
    """reason -> kind, from README.md's "Reason codes" table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Reason codes\n", 1)[1].split("\n## ", 1)[0]
    rows = [ROW.match(line) for line in section.splitlines() if line.startswith("| `")]
    assert all(rows), [line for line in section.splitlines() if line.startswith("| `") and not ROW.match(line)]
    table = {m.group(1): m.group(2) for m in rows if m}
    assert len(table) == len(rows), "a reason is listed twice"
    return table


def _name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def raised() -> tuple[dict[str, set[str]], set[str]]:
    """(reason -> the kinds it is raised with, where the kind is plain in
    the code; every reason given anywhere, kind known or not)."""
    kinds: dict[str, set[str]] = {}
    given: set[str] = set()
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "fail.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            # A fetch's reason, handed down to the diagnosis of a failed fetch.
            if "unreachable" in kw:
                for r in _strings(kw["unreachable"]):
                    given.add(r)
                    kinds.setdefault(r, set()).add("transient")
            if "reason" not in kw:
                continue
            reasons = _strings(kw["reason"])
            given.update(reasons)
            kind = None
            if _name(node) in ("permanent", "transient"):
                kind = _name(node)
            elif isinstance(kw.get("permanent"), ast.Constant):
                kind = "permanent" if kw["permanent"].value else "transient"  # type: ignore[union-attr]
            for r in reasons:
                if kind is not None:
                    kinds.setdefault(r, set()).add(kind)
        for node in ast.walk(tree):
            # Default values of `unreachable: Reason = "..."` parameters.
            if isinstance(node, ast.arguments):
                for arg, default in zip(node.kwonlyargs, node.kw_defaults, strict=True):
                    if arg.arg == "unreachable" and isinstance(default, ast.Constant):
                        given.add(default.value)
    # The Nix diagnosis: a category's reason from the map, its kind from the
    # Diagnosis(category, permanent, ...) calls that make it.
    category_kind: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse((PACKAGE / "nix_diagnosis.py").read_text())):
        if isinstance(node, ast.Call) and _name(node) == "Diagnosis" and len(node.args) >= 2:
            category, perm = node.args[0], node.args[1]
            if isinstance(category, ast.Constant) and isinstance(perm, ast.Constant):
                category_kind.setdefault(category.value, set()).add("permanent" if perm.value else "transient")
    for category, reason in nix_diagnosis.REASONS.items():
        given.add(reason)
        kinds.setdefault(reason, set()).update(category_kind[category])
    return kinds, given


def used_anywhere() -> set[str]:
    """Every string constant of the package outside fail.py's list."""
    found: set[str] = set()
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name != "fail.py":
            found.update(_strings(ast.parse(path.read_text())))
    return found


def test_the_readme_documents_exactly_the_reasons_the_code_can_name():
    assert set(documented()) == set(typing.get_args(Reason))


def test_every_reason_raised_in_the_package_is_documented():
    _, given = raised()
    assert given, "no reason found: the scan is broken"
    assert sorted(given - set(documented())) == []


def test_every_documented_reason_is_raised_somewhere():
    _, given = raised()
    unused = set(documented()) - given
    assert sorted(unused) == []
    # And not only in a comment's company: it is a string the package holds.
    assert set(documented()) <= used_anywhere()


def test_each_reason_is_raised_with_the_kind_the_readme_gives_it():
    table = documented()
    kinds, _ = raised()
    wrong = {r: sorted(k) for r, k in kinds.items() if k != {table.get(r)}}
    assert wrong == {}


def test_every_nix_diagnosis_category_has_a_reason():
    categories = set(nix_diagnosis._FIXES)
    assert categories == set(nix_diagnosis.REASONS)


@pytest.mark.parametrize(
    ("fail", "kind"),
    [
        (permanent("x", reason="config.invalid"), "permanent"),
        (transient("y", reason="source.not-published"), "transient"),
    ],
)
def test_a_fail_carries_its_reason_into_json_beside_kind_and_message(fail: Fail, kind: str):
    assert fail.to_json() == {"kind": kind, "reason": fail.reason, "message": fail.message}
    assert fail.reason in repr(fail)


def test_a_fetch_of_the_training_source_is_source_unreachable_and_any_other_fetch_nix_fetch():
    diagnosis = nix_diagnosis.Diagnosis("fetch", False, "unable to download 'https://x': Couldn't resolve host")
    assert nix_diagnosis.failure(diagnosis, "fetching x").reason == "nix.fetch"
    fail = nix_diagnosis.failure(diagnosis, "fetching x", unreachable="source.unreachable")
    assert fail.reason == "source.unreachable" and not fail.permanent
    builder = nix_diagnosis.Diagnosis("build-users", True, "the group 'nixbld' specified in 'build-users-group'")
    assert nix_diagnosis.failure(builder, "building", unreachable="source.unreachable").reason == (
        "nix.build-users-missing"
    )
