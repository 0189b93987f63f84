"""What an earlier attempt settled, so a warm attempt evaluates nothing.

A re-dial runs `prepare` before every dial for the life of the box, and on
the production flake every evaluation walks nixpkgs (seconds). When nothing
that decides the outputs has changed since an attempt that succeeded, the
outputs are the ones it built: the record under the state directory keeps
them, keyed by everything that decides them:

- the flake as resolved and locked, with its inputs (`Nix.flake_identity`);
- the system and the contract version;
- the variant chosen, and the training source's NAR hash and the merged
  recipe the flake was given (the outputs' key; none without a source).

The flake's variant metadata is kept under the flake's key alone, so an
attempt after a new publish of the training source (the common re-dial)
chooses its variant without evaluating and evaluates once, to build. After
the flake itself changed (a new nixpkgs, a new toolchain pin), the variant
is chosen from the recorded metadata and the build names them by digest
(`variants_digest`, nix/CONTRACT.md `ifVariants`): one evaluation again,
and none that builds anything if the new flake's variants are not those.

Any doubt means the normal path, never a wrong answer: a missing,
truncated, oversized or malformed record, a key that differs, an out-link
under `<state>/gcroots` that is gone or points elsewhere, or a store path
that no longer exists (garbage-collected). The record is written whole to a
new file and renamed over the old one, under the state lock, and opened
without following links: a reader sees the old record or the new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from prepare.build.outputs import store_paths

# 2: the outputs name their source's URL (a re-dial of the same source fetches it
# beside the flake's resolution).
VERSION = 2
NAME = "warm.json"
# A record is a few KiB; anything larger is not one of ours.
MAX_BYTES = 1 << 20


def key(*parts: object) -> str:
    """A stable digest of JSON-able parts."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def variants_digest(contract: int, variants: Any) -> str:
    """The digest nix/contract.nix names `ifVariants` by:
    `builtins.hashString "sha256" (builtins.toJSON { contract; variants; })`.
    Nix's JSON has its keys sorted and no spaces, and the metadata are
    strings, lists and nulls, so the same bytes come from the JSON Nix
    printed for them. Where they would not, the attribute is missing and the
    build takes the normal path: a wrong digest costs an evaluation, never a
    wrong build."""
    both = {"contract": contract, "variants": variants}
    text = json.dumps(both, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Outputs:
    """A build that succeeded: its key, and Nix's results for it."""

    key: str
    results: list[dict[str, Any]]
    # The training source as the spec named it (None: no source).
    source_url: str | None = None


@dataclass(frozen=True)
class Record:
    flake_key: str
    variants: Any  # the flake's `fdl.variants`, as Nix printed it
    outputs: Outputs | None = None

    def to_json(self) -> dict[str, Any]:
        made = None
        if self.outputs is not None:
            made = {"key": self.outputs.key, "results": self.outputs.results, "source_url": self.outputs.source_url}
        # "plan" is the file's own name for them (VERSION 2).
        return {"version": VERSION, "flake_key": self.flake_key, "variants": self.variants, "plan": made}


def load(state: str) -> Record | None:
    """The record, or None at the first doubt."""
    try:
        fd = os.open(os.path.join(state, NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(raw) > MAX_BYTES:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return _parse(data)


def _parse(data: Any) -> Record | None:
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return None
    flake_key = data.get("flake_key")
    if not isinstance(flake_key, str) or "variants" not in data:
        return None
    made = None
    raw_plan = data.get("plan")
    if raw_plan is not None:
        if not isinstance(raw_plan, dict) or not isinstance(raw_plan.get("key"), str):
            return None
        results = raw_plan.get("results")
        if not isinstance(results, list) or not all(_result_ok(r) for r in results):
            return None
        # A build of ours always has a derivation (libtorch) among its results.
        if not any("drvPath" in r for r in results):
            return None
        source_url = raw_plan.get("source_url")
        if source_url is not None and not isinstance(source_url, str):
            return None
        made = Outputs(key=raw_plan["key"], results=results, source_url=source_url)
    return Record(flake_key=flake_key, variants=data["variants"], outputs=made)


def _result_ok(result: Any) -> bool:
    if not isinstance(result, dict):
        return False
    if "path" in result:
        return _store_path(result["path"])
    outputs = result.get("outputs")
    return (
        isinstance(result.get("drvPath"), str)
        and isinstance(outputs, dict)
        and bool(outputs)
        and all(_store_path(p) for p in outputs.values())
    )


def _store_path(path: Any) -> bool:
    return isinstance(path, str) and path.startswith("/nix/store/") and "/" not in path[len("/nix/store/") :]


def save(state: str, record: Record) -> None:
    """Write the record whole, then rename it into place. A record that
    cannot be written only costs the next attempt an evaluation."""
    tmp = os.path.join(state, f".{NAME}.{os.urandom(8).hex()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(record.to_json(), handle, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, os.path.join(state, NAME))
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def forget(state: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(state, NAME))


def still_there(results: list[dict[str, Any]], out_link: str) -> bool:
    """Whether every output of a recorded build is still in the store and
    still held by one of the out-links the build left (`run`, `run-1`, ...).
    Nix writes an out-link only for a complete output, and a garbage
    collection removes only what no root holds."""
    paths = store_paths(results)
    directory, base = os.path.split(out_link)
    held: set[str] = set()
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    for name in names:
        if name == base or name.startswith(base + "-"):
            with contextlib.suppress(OSError):
                held.add(os.readlink(os.path.join(directory, name)))
    return all(path in held and os.path.exists(path) for path in paths)
