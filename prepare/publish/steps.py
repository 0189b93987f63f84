"""`fdl-prepare publish`: build once on the controller, substitute everywhere.

A fleet of a hundred boxes must not compile the same training binary a
hundred times. The controller (or a CI job) builds the run's outputs for
each libtorch variant through the very flake and contract the boxes use,
signs them, copies them with their closure to a binary cache (any store URL
`nix copy` takes), and only then writes the run manifest. A box whose
`[join.nix]` names that cache and trusts that key evaluates the same
derivations and substitutes them.

The order is the point:

1. Checks that cost nothing: the tree, the recipe, the variants named, the
   cache URL, the key file (its name and mode only: the key is never read
   here, never on a command line, never in a message), the run's
   arguments.
2. Checks that take Nix, still before anything is touched: the state
   directory, the flake (resolved once and pinned, as a box pins it) and
   its variants, the tree fetched through Nix as a box fetches it (a git
   checkout as its committed HEAD, by revision: uncommitted changes are not
   published; any other directory as it is) and the recipe's cwd in it.
   Any of them failing leaves the live manifest, and the fleet's run, alone.
3. `.fdl-run.yml` is removed from the tree. The manifest is the commit
   point: a box that fetches mid-publish, or after a failed one, finds none
   and waits (transient) instead of training something nobody built or
   validated.
4. For each variant, in the order given: build (the same step a box runs,
   with GC roots per variant under the publish's state directory), sign the
   closure, copy it to the cache. A failure names the variant and the step,
   and leaves no manifest.
5. floDl's two run files, each written atomically: the digest sidecar
   `.fdl-run.sha256` (every file of the tree as fetched, hashed: what a box,
   or a floDl worker, checks its fetch against), then the manifest, last:
   `run` (fresh), `built: true`, `published_epoch`, the recipe, the digest.
   Neither is an input of the build: the flake filters both out of the
   source the training derivation sees, so writing them changes no
   derivation and the boxes substitute what was pushed.
6. A git source: `--commit` commits the two run files alone on top of the
   commit that was built, `--push` pushes them too; with neither, the files
   are written and the summary says what to run.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING
from urllib.parse import quote

from prepare.build import choose, digest, outputs, realise, variants, workspace
from prepare.build.manifest import DIGEST_FILE, FILENAME, Recipe
from prepare.build.plan import BuildPlan
from prepare.build.source import Source
from prepare.config.kinds import ARGUMENTS, STORE_URLS
from prepare.fail import Fail
from prepare.nix import caches
from prepare.plan import default_state_dir, plan
from prepare.publish import git, manifest
from prepare.publish.spec import Output, Published, PublishSpec
from prepare.spec import PrepareSpec, SourceSpec

if TYPE_CHECKING:
    from prepare.spec import Progress


class _Step(Fail):
    """A failure inside one variant's step, already worded as such."""


def publish(
    spec: PublishSpec,
    notes: list[str],
    progress: Progress | None = None,
    *,
    nix_program: str = "nix",
    env: Mapping[str, str] | None = None,
) -> Published:
    """Build, sign and copy every variant, then write the manifest. Raises
    Fail (naming the variant and the step); on any failure, or an
    interruption, the tree holds no manifest."""
    root, labels, to = _check(spec, notes)
    manifest_path = os.path.join(root, FILENAME)
    rev = git.rev(root, notes)
    url = source_url(root, rev)
    # The build as a box plans it: the flake and the source URL pinned, the
    # recipe's values checked, the state directory named.
    build = plan(
        PrepareSpec(
            source=SourceSpec(
                from_=url, cwd=spec.cwd, build=spec.build if spec.build and spec.build.strip() else None, bin=spec.bin
            ),
            libtorch=labels[0],
            flake=spec.flake,
            state_dir=spec.state_dir or os.path.join(default_state_dir(env or os.environ)[0], "publish"),
            build_timeout_s=spec.build_timeout_s,
        ),
        env,
    ).build
    assert build is not None
    timings: dict[str, float] = {}
    made: dict[str, Output] = {}
    started = time.monotonic()
    # Everything that can be checked is, before the live manifest goes: the
    # state directory, Nix, the flake and its variants, the tree as the
    # boxes fetch it and the recipe's cwd in it. A typo must not take the
    # fleet's current run offline.
    with ExitStack() as held:
        ws = workspace.open(build, notes, progress, held, nix_program=nix_program, env=env)
        flake = choose.pin(ws, build.flake)
        known = variants.parse_variants(choose.evaluate(ws, flake, "--flake"), build.flake)
        missing = [v for v in labels if v not in known]
        if missing:
            raise Fail(
                "publish.invalid",
                f"--variant {', '.join(repr(v) for v in missing)}: not a variant of the flake {build.flake!r}, "
                f"which has: {', '.join(sorted(known))}. Publish the variants the boxes pick (their libtorch)",
            )
        ws.step("fetch", f"training source {url}")
        fetched = ws.nix.prefetch(url, doing=f"fetching the training source {url!r}", unreachable="source.unreachable")
        source = Source(fetched=fetched, recipe=_recipe(spec, fetched.store_path))
        manifest.remove(manifest_path, notes)
        for label in labels:
            made[label] = _variant(ws, build, flake, known[label], source, to, spec.signing_key, timings, notes)
        timings["variants"] = round(time.monotonic() - started, 4)
    if rev is not None:
        # The manifest must sit on the tree that was built: a commit made
        # meanwhile would make it describe one nobody built.
        git.same_head(root, rev)
    # The tree the boxes fetch, as fetched here: its files, hashed.
    hashing = time.monotonic()
    sidecar, tree_digest = digest.compute(source.fetched.store_path, digest.tree_files(source.fetched.store_path))
    timings["digest"] = round(time.monotonic() - hashing, 4)
    run_id = manifest.new_run_id()
    text = manifest.text(spec, run_id, rev, to, list(made), tree_digest)
    manifest.write(os.path.join(root, DIGEST_FILE), sidecar, "the digest sidecar")
    manifest.write(manifest_path, text)
    notes.append(
        f"tree: {tree_digest.files} files, {tree_digest.bytes} bytes, sha256 {tree_digest.sha256[:12]}... in "
        f"{DIGEST_FILE} (boxes check their fetch against it)"
    )
    notes.append(f"run {run_id}: manifest written to {manifest_path}")
    commit, pushed, next_step = git.commit_and_push(root, rev, run_id, commit=spec.commit, push=spec.push)
    return Published(
        run_id=run_id,
        manifest=manifest_path,
        to=to,
        outputs=made,
        rev=rev,
        commit=commit,
        pushed=pushed,
        next_step=next_step,
        timings=timings,
    )


# -- checks before anything is touched ---------------------------------------------------------


def _check(spec: PublishSpec, notes: list[str]) -> tuple[str, tuple[str, ...], str]:
    root = os.path.abspath(spec.source)
    if not os.path.isdir(root):
        raise Fail(
            "publish.invalid", f"the training source {spec.source!r} is not a directory: give the tree to publish"
        )
    if any(c.isspace() or not c.isprintable() for c in root):
        raise Fail(
            "publish.invalid",
            f"the training source {root!r} contains whitespace or a control character, which Nix refuses in a URL: "
            "move or link it to a path without them",
        )
    if any(c in "?#%" for c in root) and not os.path.exists(os.path.join(root, ".git")):
        raise Fail(
            "publish.invalid",
            f"the training source {root!r} has a '?', '#' or '%' in its path: a `path:` URL would read it as a "
            "query or a fragment (Nix does not decode one), and the boxes would fetch another tree. Move or link "
            "it to a path without them, or publish it as a git checkout",
        )
    for name, value, allow_dot in (("--bin", spec.bin, False), ("--cwd", spec.cwd, True)):
        _relative(name, value, allow_dot, spec.cwd)
    variants = tuple(dict.fromkeys(v.strip() for v in spec.variants))
    if not variants or any(not v for v in variants):
        raise Fail(
            "publish.invalid",
            "no --variant given: name each libtorch variant the boxes use (--variant cpu --variant cu128)",
        )
    if "auto" in variants:
        raise Fail(
            "publish.invalid",
            '--variant "auto" is a box\'s choice, made from its cards: publish the variants themselves '
            "(--variant cpu --variant cu128)",
        )
    to = spec.to.strip()
    problem = STORE_URLS.check([to])
    if problem:
        raise Fail("publish.invalid", f"--to {spec.to!r}: {problem}")
    key = spec.signing_key
    if not os.path.isfile(key) or not os.access(key, os.R_OK):
        raise Fail(
            "publish.invalid",
            f"--signing-key {key!r} is not a readable file: give the secret key file the boxes' "
            "trusted_public_keys belong to (`nix key generate-secret --key-name NAME > FILE`, and "
            "`nix key convert-secret-to-public < FILE` for the boxes)",
        )
    st = os.stat(key)
    if st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        # Whoever read it can sign anything every box runs as root.
        raise Fail(
            "publish.invalid",
            f"--signing-key {key!r} can be read by other users (mode {stat.S_IMODE(st.st_mode):04o}): whoever has "
            "read it can sign paths every box trusts, and boxes run them as root. Treat it as leaked: make a new "
            f"key pair (`nix key generate-secret --key-name NAME > FILE`, `chmod 600 FILE`), give the boxes its "
            "public half (nix.trusted_public_keys) in place of the old one, and publish again",
        )
    problem = ARGUMENTS.check(list(spec.args))
    if problem is not None:
        raise Fail("publish.invalid", f"--arg: {problem}")
    if (spec.commit or spec.push) and not os.path.exists(os.path.join(root, ".git")):
        raise Fail(
            "publish.invalid",
            f"--commit/--push need a git checkout, and {root} is not one: drop them; boxes that fetch this "
            "directory see the manifest on their next attempt",
        )
    if spec.push and not spec.commit:
        notes.append("--push commits the manifest first (--commit is implied)")
    return root, variants, to


def source_url(root: str, rev: str | None) -> str:
    """The flake URL a box would fetch the tree by: a git checkout by its
    path, percent-encoded (Nix decodes a git+file: URL's path), and the
    commit; any other directory as `path:` (whose path Nix 2.8 does not
    decode: `_check` refuses one that would need it)."""
    if rev is not None:
        path = quote(root, safe="/")
        # Nix 2.8 takes a git+file: URL whose path it had to decode for a
        # remote one, and fetches a remote's default branch for a bare rev:
        # `ref=HEAD` names where the commit is (any branch, or none).
        ref = "" if path == root else "ref=HEAD&"
        return f"git+file://{path}?{ref}rev={quote(rev, safe='')}"
    return f"path:{root}"


def _relative(name: str, value: str, allow_dot: bool, cwd: str) -> None:
    norm = posixpath.normpath(value.strip()) if value.strip() else ""
    climbs = norm == ".." or norm.startswith("../")
    if climbs and name == "--bin":
        # floDl's bin: a workspace member's is `../target/release/NAME`.
        inside = posixpath.normpath(posixpath.join(cwd.strip() or ".", norm))
        climbs = inside in ("..", ".") or inside.startswith("../")
    if not norm or posixpath.isabs(norm) or climbs or (norm == "." and not allow_dot):
        what = (
            "a directory relative to the source root, without '..'"
            if name == "--cwd"
            else "a path relative to --cwd that stays inside the source"
        )
        raise Fail("publish.invalid", f"{name} {value!r} must be {what}")


def _recipe(spec: PublishSpec, tree: str) -> Recipe:
    cwd = posixpath.normpath(spec.cwd.strip())
    if not os.path.isdir(os.path.join(tree, cwd)):
        raise Fail(
            "publish.invalid", f"--cwd {spec.cwd!r} is not a directory of the training source (as fetched: {tree})"
        )
    return Recipe(
        bin=posixpath.normpath(spec.bin.strip()),
        cwd=cwd,
        build=spec.build if spec.build and spec.build.strip() else None,
        args=spec.args,
        has_manifest=True,
    )


# -- the flake ------------------------------------------------------------------------------------


def _variant(
    ws: workspace.Workspace,
    build: BuildPlan,
    flake: choose.Flake,
    variant: variants.Variant,
    source: Source,
    to: str,
    key_file: str,
    timings: dict[str, float],
    notes: list[str],
) -> Output:
    """Build (the box's step 7, with GC roots of its own per variant), sign
    and copy one variant; a failure names it and the step."""
    label = variant.label
    with _step(label, "build", timings):
        out_link = os.path.join(ws.state, "gcroots", f"publish-{label}")
        results, log = realise.realise(ws, flake.fdl, variant, source, out_link, build.build_timeout_s)
        outputs.prune_links(out_link, outputs.store_paths(results))
        built = realise.built(build.flake, variant, source, results, log, notes)
        caches.note(log, build.nix.substituters, notes)
    if built.bin is None:
        raise Fail(
            "flake.contract-broken",
            f"variant {label}: the build made no training binary; the flake breaks the contract",
        )
    training = os.path.dirname(os.path.dirname(built.bin.path))
    # The dependency artefacts too: a box building a changed source on
    # this lock and toolchain substitutes them and compiles only its crate.
    paths = [built.libtorch.path, training] + ([built.deps] if built.deps else [])
    with _step(label, "sign", timings):
        ws.step("sign", f"{label}: the closure of {', '.join(os.path.basename(p) for p in paths)}")
        ws.nix.sign(paths, key_file, doing=f"signing the {label} outputs with --signing-key {key_file}")
    with _step(label, "copy", timings):
        ws.step("copy", f"{label} to {caches.uri(to)}")
        log = ws.nix.copy(paths, to, doing=f"copying the {label} outputs to {caches.uri(to)} (--to)")
    copied = len(log.copies())
    notes.append(
        f"variant {label}: built, signed and copied to {caches.uri(to)}"
        + (f" ({copied} path{'s' if copied != 1 else ''} new there)" if copied else " (all there already)")
        + f": {training}"
    )
    return Output(libtorch=built.libtorch.path, training=training, bin=built.bin.path)


@contextlib.contextmanager
def _step(label: str, name: str, timings: dict[str, float]) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    except _Step:
        raise
    except Fail as fail:
        raise _Step(
            fail.reason,
            f"publish stopped at variant {label}, step {name}; no manifest was written, so boxes wait for the "
            f"next publish: {fail.message}",
        ) from None
    finally:
        timings[f"{label}.{name}"] = round(time.monotonic() - started, 4)
