"""Step 7: libtorch, the training binary and the fetched tree made real in
the store by one `nix build`, with out-links under `<state>/gcroots/`.

The out-links are GC roots, so a garbage collection never deletes what a
prepared run is about to use. Nix writes an out-link only once its output
is complete, so a build stopped midway (SIGTERM, timeout) leaves the
previous links, each to a complete output. The recipe reaches the build as
`recipe.json` in a directory under the state directory (`--override-input
recipe path:<dir>`), which keeps evaluation pure; the source by store path
and NAR hash, as fetched.

What `Binary.cwd` means here: the fetched source tree at the recipe's
`cwd` (`<source store path>/<cwd>`), the directory the build ran in. It is
read-only (a store path, kept alive by the `source` GC root), so step 7
then hands the run a writable copy of that tree instead
(prepare.build.rundir), where relative paths in the run's arguments
resolve as they did on the publisher's machine.

These are the plain parts; whether a build is needed at all is the warm
path's decision (prepare.build.warm).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prepare.build import outputs, variants
from prepare.build.choose import CONTRACT
from prepare.fail import Fail
from prepare.nix.log import Log, store_name
from prepare.spec import Binary, Libtorch

if TYPE_CHECKING:
    from prepare.build.source import Source
    from prepare.build.workspace import Workspace
    from prepare.nix.runner import DryRun


@dataclass(frozen=True)
class Built:
    """What the build made, and what the run needs of it."""

    libtorch: Libtorch
    bin: Binary | None
    args: tuple[str, ...] | None
    run_id: str | None
    # The smoke run's arguments (the recipe's), for step 8.
    smoke: tuple[str, ...] | None = None
    # The variant built: the one chosen, or the one chosen anew when the
    # flake did not bear out a prediction (prepare.build.warm).
    variant: variants.Variant | None = None
    # The training build's dependency artefacts (nix/cargo-split.nix), when
    # it had them apart: rooted with the rest, pushed by a publish.
    deps: str | None = None


def recipe_input(variant: variants.Variant, source: Source | None) -> dict[str, Any] | None:
    """The flake's `recipe.json` for this variant and source (nix/CONTRACT.md);
    None without a source."""
    return None if source is None else source.recipe.flake_input(variant.label, CONTRACT)


def run_links(source_url: str) -> str:
    """The name of a prepare's out-links (`<state>/gcroots/<name>`, `-1`,
    ...): one set per training source. A prepare of another source on the
    same state directory (two join loops on one box) replaces and prunes
    only its own set, never the roots of the binary the other reported."""
    return "run." + hashlib.sha256(source_url.encode()).hexdigest()[:16]


def realise(
    ws: Workspace,
    fdl: str,
    variant: variants.Variant,
    source: Source | None,
    out_link: str,
    timeout_s: float | None,
) -> tuple[list[dict[str, Any]], Log]:
    """One `nix build` of the variant's libtorch from the flake's `fdl`
    attribute set, and with a source, the training binary and the fetched
    tree (pinned by store path and NAR hash, the recipe passed as a flake
    input). Returns Nix's results and the log of the call."""
    installables, overrides = _request(ws.state, fdl, variant, source)
    ws.step("build", ", ".join(_short(i) for i in installables))
    return ws.nix.build(
        installables,
        out_link=out_link,
        overrides=overrides,
        timeout_s=timeout_s,
        source_path=source.fetched.store_path if source is not None else None,
        doing=f"building libtorch {variant.label}"
        + (f" and the training binary from {source.fetched.url!r}" if source is not None else ""),
    )


def dry_run(ws: Workspace, fdl: str, variant: variants.Variant, source: Source | None, scratch: str) -> DryRun:
    """What `realise` would build and substitute, asked of Nix with the
    same installables and inputs (`nix build --dry-run`): nothing is built
    and no out-link made. The recipe goes to `scratch` (a directory of the
    check's own, gone after it): the flake input copies it by content, so
    the derivations are the attempt's."""
    installables, overrides = _request(scratch, fdl, variant, source)
    ws.step("dry run", ", ".join(_short(i) for i in installables))
    return ws.nix.dry_run(
        installables,
        overrides=overrides,
        source_path=source.fetched.store_path if source is not None else None,
        doing=f"asking what building libtorch {variant.label}"
        + (f" and the training binary from {source.fetched.url!r}" if source is not None else "")
        + " would build (nix build --dry-run)",
    )


def _request(
    recipe_home: str, fdl: str, variant: variants.Variant, source: Source | None
) -> tuple[list[str], dict[str, str]]:
    """The installables and input overrides of the build: libtorch, and
    with a source the training binary and the fetched tree, the recipe
    written under `recipe_home`."""
    installables = [f"{fdl}.libtorch.{variants.nix_attr(variant.label)}"]
    overrides: dict[str, str] = {}
    recipe = recipe_input(variant, source)
    if source is not None and recipe is not None:
        recipe_dir = outputs.write_recipe(recipe_home, recipe)
        overrides = {"source": source.fetched.pinned_url, "recipe": f"path:{recipe_dir}"}
        # trainingDeps: the dependencies built apart (nix/cargo-split.nix),
        # rooted with the binary so the next change of the source finds
        # them in the store.
        installables += [f"{fdl}.training", f"{fdl}.trainingDeps", source.fetched.store_path]
    return installables, overrides


def built(
    flake: str,
    variant: variants.Variant,
    source: Source | None,
    results: list[dict[str, Any]],
    log: Log,
    notes: list[str],
) -> Built:
    """What the build made, told apart, and what the run needs of it; what
    it built, downloaded or found already there goes in `notes`."""
    recipe = source.recipe if source is not None else None
    try:
        libtorch_path, training_path = outputs.identify(results, recipe.bin if recipe else None)
    except ValueError as odd:
        raise Fail(
            "nix.unknown",
            f"building libtorch {variant.label}: nix build printed no JSON result of a known shape ({odd}); "
            "the next attempt retries",
        ) from None
    outputs.note_build(log, results, variant.label, libtorch_path, training_path, notes)
    libtorch = Libtorch(path=libtorch_path, variant=variant.label)
    if source is None or recipe is None:
        return Built(libtorch=libtorch, bin=None, args=None, run_id=None, variant=variant)
    if training_path is None:
        raise Fail(
            "flake.contract-broken",
            f"the flake {flake!r} built no training output holding bin/{os.path.basename(recipe.bin)}: "
            "its fdl.training does not follow the contract (nix/CONTRACT.md: install the recipe's bin to $out/bin/)",
        )
    binary = Binary(
        path=os.path.join(training_path, "bin", os.path.basename(recipe.bin)),
        cwd=os.path.normpath(os.path.join(source.fetched.store_path, recipe.cwd)),
    )
    return Built(
        libtorch=libtorch,
        bin=binary,
        args=recipe.args,
        run_id=recipe.run_id,
        smoke=recipe.smoke,
        variant=variant,
        deps=outputs.deps_path(results, training_path),
    )


def _short(installable: str) -> str:
    if "#" not in installable:
        return store_name(installable)
    attr = installable.rsplit("#", 1)[-1].rsplit(".fdl.", 1)[-1]
    return attr.split('".', 1)[-1] if attr.startswith("ifVariants.") else attr
