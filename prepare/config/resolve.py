"""The one place precedence lives: flags, the file and the environment
resolved into a PrepareSpec that records where each value came from.

    spec = resolve(table, flags, os.environ)   # flags > file > environment > built-in

Precedence lives in `resolve` alone so that each rule is stated once and
tested once: a flag beats the file, the file beats a default taken from the
environment (`FDL_PREPARE_FLAKE`, which the nix app sets to its own flake,
and systemd's `STATE_DIRECTORY`), and those beat the built-in defaults.
Merging is per field, including inside [join.source] and [join.ssh]: a flag
for one field leaves the file's other fields alone. A list given as a flag
(`--ssh-option`, `--devices`) replaces the file's list rather than extending
it, so what the command line shows is what runs.

Which keys there are, their flags, checks, defaults and environment
fallbacks is not written here: it is the field table in `prepare.config.fields`,
and this module only applies it, so no key needs an edit here.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from prepare.config.fields import RULES, TABLE, Field, Table, value_at
from prepare.config.schema import Checked, flag_namer, problems_message, validate
from prepare.fail import Fail
from prepare.spec import Origin, PrepareSpec


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
    given and empty. Each value is checked where it enters, once: the
    file's by `load` (a table built in code, here), a flag's and a
    variable's here, naming the flag or the variable. What a combination of
    values cannot do (RULES), like every other check of the spec as a whole,
    is the plan's (prepare.plan), on the library's path and this one alike."""
    if not isinstance(file, Checked):
        problems = validate(file, lambda key: (f"join.{key}", None), table)
        if problems:
            raise Fail("config.invalid", problems_message("config", problems))
    given = _drop_none(flags)
    problems = validate(given, flag_namer(table), table, flags=True)
    if problems:
        raise Fail("config.invalid", problems_message("flags", problems))

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
    return _build(table.spec_type, values, present, origins)


def _pick(f: Field, given: Mapping[str, Any], file: Mapping[str, Any], env: Mapping[str, str]) -> Origin:
    """The value `f` takes, with where it came from (still in the TOML's
    form: the caller converts it)."""
    value = _get(given, f.key)
    if value is not None:
        return Origin("flag", f.flag, value)
    value = _get(file, f.key)
    if value is not None:
        return Origin("file", f"join.{f.key}", value)
    return from_environment(f, env) or Origin("default", "the default", f.default)


def from_environment(f: Field, env: Mapping[str, str]) -> Origin | None:
    """`f`'s default from the environment, checked where it enters (naming
    the variable); None when the field has none, or it is unset or empty."""
    value = f.env.read(env) if f.env is not None else None
    if not value or f.env is None:
        return None
    origin = Origin("environment", f.env.name, value, note=f.env.note)
    problem = f.kind.check(value)
    if problem is not None:
        raise Fail("config.invalid", f"environment: {origin} ({f.key}) = {f.kind.show(value)}: {problem}")
    return origin


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


def checked(spec: PrepareSpec, *, table: Table = TABLE) -> PrepareSpec:
    """A spec as the plan takes it (prepare.plan calls this, and nothing
    else does): each value a join loop set in code checked as a config
    file's would be (a wrong type or range is a permanent Fail naming the
    spec field, never a traceback from deep inside a step), and the rules
    across fields (RULES) for every spec, resolved or not. A value that
    came through `resolve` (its origin still holds) was checked where it
    entered and is not checked again. Returns the spec with its values in
    the form resolve gives them (a URL without surrounding spaces)."""
    problems = _shape_problems(spec, table)
    if problems:
        raise Fail("config.invalid", problems_message("PrepareSpec", problems))
    for f in table.fields:
        if spec.origin(f.spec) is not None:
            continue
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
        raise Fail("config.invalid", problems_message("PrepareSpec", problems))
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
