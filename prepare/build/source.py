"""Step 6: the training source, fetched, and the recipe it brings.

The source is fetched once per attempt (`nix flake prefetch`), which
re-resolves a moving ref, so a re-dial after a new publish sees the new
commit. The build then gets *that* tree by store path and NAR hash
(`--override-input source path:<store>?narHash=`), never the URL: the ref
cannot move between fetch and build. On a re-dial of the source the box
built before, the fetch was started beside the flake's resolution, in step
5 (prepare.build.warm), and is only waited for here.

The run manifest (floDl's `.fdl-run.yml`) is read from the fetched tree,
the tree is checked against the manifest's digest (prepare.build.digest),
and the manifest is merged over the box's own recipe (the manifest wins:
everything in it belongs to the run); the recipe's `cwd` must be a
directory of that tree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from prepare.build import crate, digest, manifest, transport
from prepare.fail import Fail
from prepare.nix import urls
from prepare.nix.runner import PendingFetch, Prefetched

if TYPE_CHECKING:
    from prepare.build.workspace import Workspace
    from prepare.spec import SourceSpec


@dataclass(frozen=True)
class Source:
    """The training source as fetched, and the recipe it brings."""

    fetched: Prefetched
    recipe: manifest.Recipe


def start_fetch(ws: Workspace, url: str) -> PendingFetch:
    """The training source's fetch, started: its `result` is step 6's,
    named by `url` as the box spells it (the warm path's record compares
    that). floDl's spellings take a step first (prepare.build.transport):
    the copy of a `file://` or `rsync://` tree, which Nix then fetches as
    a `path:`, or the commit of a `git+...#<ref>`. A failure to start is
    the fetch's, raised by `result` (step 6), not by whoever started it
    early (prepare.build.warm)."""
    try:
        return _start_fetch(ws, url)
    except Fail as fail:
        return PendingFetch(partial(_raise, fail), lambda: None)


def _raise(fail: Fail) -> Prefetched:
    raise fail


def _start_fetch(ws: Workspace, url: str) -> PendingFetch:
    ref = urls.parse_source(url)
    doing = f"fetching the training source {url!r} (source.from, --source)"
    env = transport.git_env(ref, ws.ssh, ws.nix.env)

    def prefetch(nix_url: str) -> Prefetched:
        pending = ws.nix.start_prefetch(nix_url, doing=doing, unreachable="source.unreachable", env=env)
        return replace(pending.result(), url=url)

    if ref.copied:
        dest = transport.tree_dir(ws.state, ws.scratch, ref)
        pull = transport.start_pull(ref, dest, ws.ssh)

        def copied() -> Prefetched:
            transport.finish_pull(pull, ref, dest, ws.ssh)
            return prefetch(f"path:{dest}")

        return PendingFetch(copied, pull.stop)
    if ref.kind == "git-ref":
        asking = transport.start_resolve(ref, ws.ssh, env or ws.nix.env)
        return PendingFetch(lambda: prefetch(transport.finish_resolve(asking, ref)), asking.stop)
    assert ref.nix_url is not None
    started = ws.nix.start_prefetch(ref.nix_url, doing=doing, unreachable="source.unreachable", env=env)
    return PendingFetch(lambda: replace(started.result(), url=url), started.stop)


def fetch(ws: Workspace, box: SourceSpec, started: PendingFetch | None, notes: list[str]) -> Source:
    """The source `box` names, fetched (or the fetch `started` already,
    waited for), and its run manifest merged over `box`, the box's own
    recipe."""
    url = box.from_
    assert url is not None  # the plan refused a source without one
    ws.step("fetch", f"training source {url}")
    fetched = (started or start_fetch(ws, url)).result()
    _note_fetched(fetched, notes)
    found = manifest.read(fetched.store_path)
    if found is not None:
        notes.extend(digest.verify(fetched.store_path, found))
    recipe = manifest.merge(box, found, url, mid_publish=found is None and manifest.mid_publish(fetched.store_path))
    manifest.check_tree(recipe, fetched.store_path, url)
    crate.check_lock(fetched.store_path, recipe.cwd, url, from_manifest="cwd" in recipe.from_manifest)
    notes.extend(manifest.notes_for(recipe, found, time.time()))
    return Source(fetched=fetched, recipe=recipe)


def _note_fetched(fetched: Prefetched, notes: list[str]) -> None:
    rev = (fetched.locked or {}).get("rev") if fetched.locked else None
    notes.append(
        f"training source {fetched.url} fetched: {fetched.store_path}"
        + (f" (rev {str(rev)[:12]})" if rev else "")
        + f", {fetched.nar_hash}"
    )
