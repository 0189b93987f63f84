"""The warm path: steps 5 and 7 when an earlier attempt settled them.

A re-dial runs `prepare` before every dial for the life of the box, and on
the production flake every evaluation walks nixpkgs (seconds). What an
attempt that succeeded settled is in `<state>/warm.json`
(prepare.build.record), and this module decides from it, around the plain
steps (prepare.build.choose, prepare.build.realise), which of three ways
an attempt goes:

- the flake, as locked, is the one recorded: its variants are what it
  said then, and the choice is made from them without an evaluation; when
  the training source, the recipe and the variant are also the recorded
  ones and their outputs are still in the store, nothing is evaluated or
  built at all;
- the flake changed (a new nixpkgs, a new toolchain pin) on a box that has
  been through the gate before: the variant is *predicted* from the
  variants recorded, and the build asks for its outputs under
  `ifVariants.<digest of those variants>` (nix/CONTRACT.md), an attribute
  the new flake has only while its variants are exactly those. The choice
  is then the one its own metadata give, and the build's evaluation is the
  attempt's only one; the prediction's notes are added only once the build
  bears it out. Otherwise that evaluation fails before anything is built,
  and the normal way is taken;
- the normal way: the variants evaluated, the variant chosen, the build.

On a re-dial of the source the box built before, the source's fetch is
started beside the flake's resolution rather than after it: the two
resolutions are the bulk of a warm attempt. A box that has never fetched it
keeps the gate's order (nothing fetched before the gate).

Any doubt means the normal way, never a wrong answer (prepare.build.record).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prepare.build import choose, outputs, realise, record
from prepare.build.plan import BuildPlan
from prepare.build.source import start_fetch
from prepare.fail import Fail
from prepare.nix import caches
from prepare.nix.log import Log

if TYPE_CHECKING:
    from prepare.build.source import Source
    from prepare.build.variants import Variant
    from prepare.build.workspace import Workspace
    from prepare.gpu.devices import Gpus
    from prepare.nix.runner import PendingFetch

# What a failed build of a prediction says: the flake has no
# `ifVariants.<digest>` for those variants (or predates it).
_NOT_BORNE_OUT = ("nix.evaluation", "nix.unknown")


@dataclass(frozen=True)
class Choice:
    """Step 5's result: the variant, and what it was chosen from."""

    variant: Variant
    flake: choose.Flake
    # The flake's variant metadata the choice was made from, recorded with
    # the outputs.
    variants: Any
    # The earlier attempt's record, when it is of this flake as locked.
    recorded: record.Record | None = None
    # A prediction: the digest of the recorded variants it was made from,
    # and what it said, added to the notes only once the build bears it out.
    predicted: str | None = None
    said: tuple[str, ...] = ()
    # The training source's fetch, started beside the flake's resolution.
    fetch: PendingFetch | None = None


def choose_variant(plan: BuildPlan, ws: Workspace, gpus: Gpus | None, notes: list[str], held: ExitStack) -> Choice:
    """Step 5: the variant and its coverage of the offered cards, from the
    record where it can say, else by evaluation."""
    known = None if plan.refresh else record.load(ws.state)
    started = _early_fetch(plan, ws, known, held)
    flake = choose.pin(ws, plan.flake)
    if flake.key is None:
        known = None
    if plan.libtorch is None and not plan.cpu_only:
        notes.append('libtorch not set: choosing automatically (libtorch = "auto")')
    if known is not None and known.flake_key == flake.key:
        # This flake, as locked, was evaluated by an earlier attempt, which
        # checked its contract: its variants are what it said then.
        variant = choose.choose(plan, known.variants, gpus, notes)
        return Choice(variant, flake, known.variants, recorded=known, fetch=started)
    if known is not None:
        said: list[str] = []
        try:
            variant = choose.choose(plan, known.variants, gpus, said)
        except Fail:
            pass  # the recorded variants do not serve this box; the new flake's might
        else:
            digest = record.variants_digest(choose.CONTRACT, known.variants)
            return Choice(variant, flake, known.variants, predicted=digest, said=tuple(said), fetch=started)
    raw = choose.evaluate(ws, flake)
    return Choice(choose.choose(plan, raw, gpus, notes), flake, raw, fetch=started)


def build(
    plan: BuildPlan, ws: Workspace, choice: Choice, source: Source | None, gpus: Gpus | None, notes: list[str]
) -> realise.Built:
    """Step 7: the outputs the record holds, when they are still in the
    store; else the build, then the record of it."""
    out_link = os.path.join(ws.state, "gcroots", realise.run_links(source.fetched.url) if source else "run")
    variant, variants = choice.variant, choice.variants
    key = _outputs_key(choice.flake, variant, source)
    known = choice.recorded
    if (
        key is not None
        and known is not None
        and known.outputs is not None
        and known.outputs.key == key
        and record.still_there(known.outputs.results, out_link)
    ):
        notes.append(
            "nothing evaluated: the flake, the training source, the recipe and the variant are those of an "
            f"earlier attempt, whose outputs are still in the store ({os.path.join(ws.state, record.NAME)}; "
            "--refresh evaluates anyway)"
        )
        return realise.built(plan.flake, variant, source, known.outputs.results, Log(), notes)

    if choice.predicted is None:
        results, log = realise.realise(ws, choice.flake.fdl, variant, source, out_link, plan.build_timeout_s)
    else:
        gated = f'{choice.flake.fdl}.ifVariants."{choice.predicted}"'
        try:
            results, log = realise.realise(ws, gated, variant, source, out_link, plan.build_timeout_s)
            notes.extend(choice.said)
        except Fail as fail:
            if fail.reason not in _NOT_BORNE_OUT:
                raise
            # The flake's variants are not the recorded ones (or it predates
            # `ifVariants`): nothing was built. The normal way: evaluate
            # them, choose and check coverage anew, and build what that gives.
            variants = choose.evaluate(ws, choice.flake)
            variant = choose.choose(plan, variants, gpus, notes)
            key = _outputs_key(choice.flake, variant, source)
            results, log = realise.realise(ws, choice.flake.fdl, variant, source, out_link, plan.build_timeout_s)
    outputs.prune_links(out_link, outputs.store_paths(results))
    built = realise.built(plan.flake, variant, source, results, log, notes)
    if choice.flake.key is not None and key is not None:
        url = None if source is None else source.fetched.url
        made = record.Outputs(key=key, results=results, source_url=url)
        record.save(ws.state, record.Record(choice.flake.key, variants, made))
    else:
        record.forget(ws.state)
    caches.note(log, plan.nix.substituters, notes)
    return built


def _early_fetch(plan: BuildPlan, ws: Workspace, known: record.Record | None, held: ExitStack) -> PendingFetch | None:
    """The source's fetch, started now when the record says this box built
    this source before; stopped with the attempt if no step waits for it."""
    box = plan.source
    if known is None or known.outputs is None or box is None or known.outputs.source_url != box.from_:
        return None
    assert box.from_ is not None
    started = start_fetch(ws, box.from_)
    held.callback(started.stop)
    return started


def _outputs_key(flake: choose.Flake, variant: Variant, source: Source | None) -> str | None:
    """What decides a build's outputs (prepare.build.record); None when the
    flake's identity could not be told."""
    if flake.key is None:
        return None
    nar_hash = None if source is None else source.fetched.nar_hash
    return record.key(flake.key, variant.label, nar_hash, realise.recipe_input(variant, source))
