"""floDl's fdl.yml as a config: its `join:` block, read as `fdl join` reads it.

floDl reads fdl.yml with serde_yaml, which speaks YAML 1.2: `yes`, `on`
and `2024-01-01` are strings there, and `1:30` is not a number. PyYAML's
safe loader speaks YAML 1.1, where they are a boolean, a date and 90; read
with it as it comes, a value `fdl join` refuses would pass here. So the
loader below resolves plain scalars as YAML 1.2's core schema does, and
what floDl would refuse is refused here first, with its line.

The file may be anyone's, so reading it is bounded: its size by the
caller (`prepare.config.file`), its nodes and its depth here, and an alias
(`*name`) is refused outright, since a few lines of anchors can stand for
billions of values once walked ("billion laughs"), and no join block needs
one. A key set twice is refused as serde_yaml refuses it, not silently
taken as PyYAML takes the last.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from prepare.config.file import MAX_YAML_DEPTH, MAX_YAML_NODES, _looks_like_join
from prepare.config.kinds import show
from prepare.config.schema import Namer, at
from prepare.fail import Fail


class _Loader(yaml.SafeLoader):
    """The safe loader, with YAML 1.2 core schema scalars."""


_Loader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp)
        for tag, regexp in resolvers
        if tag.rsplit(":", 1)[-1] not in ("bool", "int", "float", "timestamp")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    return int(text, 16) if text.startswith("0x") else int(text, 10)


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def join_block(path: Path, text: str) -> tuple[dict[str, Any] | None, Namer]:
    """The `join:` block of the fdl.yml `text` (None when it has none) and
    a namer giving each of its keys' lines. A permanent Fail for a file that
    is not YAML, or is out of bounds."""
    loader = _Loader(text)
    try:
        try:
            node = loader.get_single_node()
            lines: dict[str, int] = {}
            if node is None:
                return None, _namer(lines)
            _bounded(path, node)
            if not isinstance(node, yaml.MappingNode):
                raise Fail(
                    "config.invalid",
                    f"config {path}, line {node.start_mark.line + 1}: an fdl.yml is a mapping of keys (join:, "
                    f"commands:, ...), got {_node_kind(node)}: point --config at floDl's fdl.yml, or at a TOML "
                    "config",
                )
            join_node = _join_node(path, node, lines)
            if join_node is None:
                keys = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)]
                typo = next((k for k in keys if _looks_like_join(k)), None)
                if typo is not None:
                    raise Fail(
                        "config.invalid",
                        f"config {path}: there is a {typo}: block but no join:; did you mean join:? fdl-prepare "
                        "reads only join:",
                    )
                return None, _namer(lines)
            join = loader.construct_document(join_node)
        except yaml.YAMLError as exc:
            raise Fail("config.invalid", _syntax_message(path, text, exc)) from None
        except RecursionError:
            raise Fail("config.invalid", _too_deep(path)) from None
    finally:
        loader.dispose()
    if join is None:
        return {}, _namer(lines)
    if not isinstance(join, dict):
        raise Fail(
            "config.invalid",
            f"config {path}{at(lines.get(''))}: join must be a mapping of floDl's join keys (controller:, "
            f"data_path:, source:, ...), got {show(join)[:200]}",
        )
    return join, _namer(lines)


def _namer(lines: dict[str, int]) -> Namer:
    def name(dotted: str) -> tuple[str, int | None]:
        shown = ".".join(
            p if re.fullmatch(r"[A-Za-z0-9_-]+", p) else json.dumps(p) for p in ("join", *dotted.split("."))
        )
        return shown, lines.get(dotted)

    return name


def _join_node(path: Path, root: Any, lines: dict[str, int]) -> Any:
    """The node of `join:`, after refusing a key set twice in it (or `join`
    itself twice); `lines` gets each key's line, by dotted key."""
    found = None
    for key, value in root.value:
        if isinstance(key, yaml.ScalarNode) and key.value == "join":
            if found is not None:
                raise Fail("config.invalid", _twice(path, "join", key))
            found = value
            lines[""] = key.start_mark.line + 1
    if found is None:
        return None
    _walk_keys(path, found, "", lines)
    return found


def _walk_keys(path: Path, node: yaml.Node, prefix: str, lines: dict[str, int]) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag != "tag:yaml.org,2002:str":
            where = f"join.{prefix}" if prefix else "join"
            raise Fail(
                "config.invalid",
                f"config {path}, line {key.start_mark.line + 1}: a key of {where} is {_node_kind(key)}, and floDl's "
                "keys are names (controller, data_path, ...): write the key as a name",
            )
        dotted = f"{prefix}.{key.value}" if prefix else key.value
        if key.value in seen:
            raise Fail("config.invalid", _twice(path, f"join.{dotted}", key))
        seen.add(key.value)
        lines[dotted] = key.start_mark.line + 1
        if not prefix:
            _walk_keys(path, value, dotted, lines)


def _bounded(path: Path, root: yaml.Node) -> None:
    """Refuse aliases, and a document past MAX_YAML_NODES or MAX_YAML_DEPTH,
    walking the composed nodes without recursion. An alias is seen as a node
    met twice: the composer hands the anchored node itself to each."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if id(node) in seen:
            raise Fail(
                "config.invalid",
                f"config {path}, line {node.start_mark.line + 1}: a YAML alias (*name) repeats an anchored value; "
                "floDl's join block has no use for one, and a few can stand for billions of values: write the "
                "value out",
            )
        seen.add(id(node))
        if len(seen) > MAX_YAML_NODES or depth > MAX_YAML_DEPTH:
            raise Fail("config.invalid", _too_deep(path))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack.append((key, depth + 1))
                stack.append((value, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, depth + 1) for item in node.value)


def _twice(path: Path, key: str, node: yaml.Node) -> str:
    return (
        f"config {path}, line {node.start_mark.line + 1}: {key} is set twice (`fdl join` refuses a key set twice): "
        "keep the one you mean"
    )


def _too_deep(path: Path) -> str:
    return (
        f"config {path} has more values, or nests them deeper, than any fdl.yml ({MAX_YAML_NODES} values, "
        f"{MAX_YAML_DEPTH} levels at most): is it the right file? point --config at floDl's fdl.yml"
    )


def _node_kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return f"the value {json.dumps(str(node.value))[:80]}"


def _syntax_message(path: Path, text: str, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return f"config {path}: invalid YAML: {problem}"
    lines = text.split("\n")
    source = lines[mark.line] if 0 <= mark.line < len(lines) else ""
    return (
        f"config {path}, line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {problem}"
        f"\n    {source[:200]}\n    {' ' * min(mark.column, 200)}^"
    )
