"""Reason codes: `prepare.fail.REASONS` is the one table (each code, its
kind, its meaning), docs/REASONS.md's table is that table row for row, and
README.md's short table names every family of it; the kind of a Fail is
its reason's. A reason in the table that
the package names nowhere is a dead row."""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

import pytest

from prepare.fail import PERMANENT, REASONS, TRANSIENT, Fail, Reason
from prepare.nix import diagnosis as nix_diagnosis

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "prepare"
ROW = re.compile(r"^\| `([a-z]+\.[a-z-]+)` \| (permanent|transient) \| (.+) \|$")


DOC = ROOT / "docs" / "REASONS.md"


def documented() -> list[tuple[str, str, str]]:
    """(reason, kind, meaning), in order, from docs/REASONS.md's table."""
    text = DOC.read_text()
    section = text.split("\n## The table\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| `")]
    rows = [ROW.match(line) for line in lines]
    assert all(rows), [line for line, row in zip(lines, rows, strict=True) if not row]
    return [(m.group(1), m.group(2), m.group(3)) for m in rows if m]


def table_rows() -> list[tuple[str, str, str]]:
    return [(reason, row.kind, row.meaning) for reason, row in REASONS.items()]


def test_the_readme_table_is_the_reason_table_row_for_row():
    expected = "\n".join(f"| `{r}` | {kind} | {meaning} |" for r, kind, meaning in table_rows())
    assert documented() == table_rows(), f"docs/REASONS.md's rows should read:\n{expected}"


def families() -> list[str]:
    """The families README.md's "Exit codes and reasons" table names, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Exit codes and reasons\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `([a-z]+)\.\*` \|", section, re.MULTILINE)]


def test_the_readme_names_every_family_of_reasons_once_in_the_tables_order():
    in_order = list(dict.fromkeys(reason.split(".")[0] for reason in REASONS))
    assert families() == in_order


def test_the_table_lists_exactly_the_reasons_the_type_allows_in_its_order():
    assert list(REASONS) == list(typing.get_args(Reason))


def test_every_reason_of_the_table_is_named_in_the_package():
    named: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "fail.py":
            tree = ast.parse(path.read_text())
            named.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    assert sorted(set(REASONS) - named) == []


@pytest.mark.parametrize("reason", list(REASONS))
def test_a_fails_kind_is_its_reasons(reason: Reason):
    fail = Fail(reason, "said")
    assert fail.kind == REASONS[reason].kind in (PERMANENT, TRANSIENT)
    assert fail.permanent is (fail.kind == PERMANENT)
    assert str(fail) == fail.message == "said"


def test_a_reason_the_table_does_not_hold_is_a_bug_where_it_is_raised():
    with pytest.raises(ValueError, match="config.typo"):
        Fail("config.typo", "x")  # type: ignore[arg-type]


@pytest.mark.parametrize("reason", ["config.invalid", "source.not-published"])
def test_a_fail_carries_its_reason_into_json_beside_kind_and_message(reason: Reason):
    fail = Fail(reason, "x")
    assert fail.to_json() == {"kind": fail.kind, "reason": reason, "message": "x"}
    assert reason in repr(fail)


def test_every_cause_of_the_nix_diagnosis_is_a_row_of_its_table_but_the_one_explain_tells_apart():
    causes = {v for v in vars(nix_diagnosis).values() if isinstance(v, nix_diagnosis.Cause)}
    assert causes - {row.cause for row in nix_diagnosis.ROWS} == {nix_diagnosis.FLAKE_BUILDER}
    # Each cause has a name of its own: the rows of one cause share it.
    assert len({c.category for c in causes}) == len(causes)


def test_a_fetch_of_the_training_source_is_source_unreachable_and_any_other_fetch_nix_fetch():
    diagnosis = nix_diagnosis.Diagnosis(nix_diagnosis.FETCH_FAILED, "unable to download 'https://x': no host")
    assert nix_diagnosis.failure(diagnosis, "fetching x").reason == "nix.fetch"
    fail = nix_diagnosis.failure(diagnosis, "fetching x", unreachable="source.unreachable")
    assert fail.reason == "source.unreachable" and not fail.permanent
    builder = nix_diagnosis.Diagnosis(nix_diagnosis.BUILD_USERS, "the group 'nixbld' specified in 'build-users-group'")
    assert nix_diagnosis.failure(builder, "building", unreachable="source.unreachable").reason == (
        "nix.build-users-missing"
    )
