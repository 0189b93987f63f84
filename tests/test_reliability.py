"""docs/RELIABILITY.md, the fault matrix, held to the suite: neither can
drift from the other.

Every row names a test that exists, key words that test (or its file)
checks, and a kind its name does not contradict; every test whose name says
it ends in a kind of failure has a row; the counts the document states are
the table's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MATRIX = REPO / "docs" / "RELIABILITY.md"
TESTS = REPO / "tests"

KINDS = {
    "permanent",
    "transient",
    "permanent / transient",
    "bug",
    "interrupted",
    "killed",
    "note",
    "refused at evaluation",
}
# Test names that say a kind of failure: each needs a row.
SAYS_A_KIND = re.compile(r"permanent|transient|exits_70|interrupt")


def rows() -> list[dict[str, object]]:
    found = []
    for line in MATRIX.read_text().splitlines():
        if not line.startswith("| ") or "`tests/" not in line:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 5, line
        fault, test, kind, words, trigger = cells
        path, _, name = test.strip("`").partition("::")
        found.append(
            {
                "fault": fault,
                "file": path,
                "name": name,
                "kind": kind,
                "words": re.findall(r"`([^`]+)`", words),
                "trigger": trigger,
            }
        )
    return found


def _tests_of(path: Path) -> dict[str, str]:
    """Each test function of a file, with its source (decorators included)."""
    src = path.read_text()
    lines = src.splitlines()
    out = {}
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out[node.name] = "\n".join(lines[first - 1 : node.end_lineno])
    return out


ROWS = rows()


def test_the_matrix_has_rows_and_names_no_test_twice():
    assert len(ROWS) > 100
    named = [(r["file"], r["name"]) for r in ROWS]
    assert len(named) == len(set(named))


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['name']}" for r in ROWS])
def test_each_row_names_a_test_that_exists_and_checks_the_key_words(row):
    path = REPO / str(row["file"])
    assert path.is_file(), row["file"]
    tests = _tests_of(path)
    assert row["name"] in tests, f"{row['file']} has no {row['name']}"
    source, whole = tests[str(row["name"])], path.read_text()
    assert row["words"], "a row needs key words"
    for word in row["words"]:  # type: ignore[attr-defined]
        assert word in source or word in whole, f"{word!r} is not checked in {row['file']}"
    assert row["kind"] in KINDS, row["kind"]
    name = str(row["name"])
    for kind in ("permanent", "transient"):
        if kind in name:
            assert kind in str(row["kind"]), f"{name} says {kind}, the matrix says {row['kind']}"
    if "exits_70" in name:
        assert row["kind"] == "bug"
    assert row["trigger"]


def test_every_test_that_says_a_kind_of_failure_has_a_row():
    listed = {(r["file"], r["name"]) for r in ROWS}
    missing = [
        f"tests/{path.name}::{name}"
        for path in sorted(TESTS.glob("test_*.py"))
        for name in _tests_of(path)
        if SAYS_A_KIND.search(name) and (f"tests/{path.name}", name) not in listed
    ]
    assert not missing, "add these to docs/RELIABILITY.md:\n" + "\n".join(missing)


def test_the_counts_the_matrix_states_are_its_own():
    text = MATRIX.read_text()
    found = re.search(r"\*\*(\d+) fault cases; (\d+) of them are triggered for real\*\*", text)
    assert found, "the matrix states its counts"
    real = sum(1 for r in ROWS if str(r["trigger"]).startswith("real"))
    assert (int(found.group(1)), int(found.group(2))) == (len(ROWS), real)
    others = re.search(r"the other (\d+) use a stand-in", text)
    assert others and int(others.group(1)) == len(ROWS) - real
