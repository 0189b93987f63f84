"""What one `nix build` of step 7 is given and what it leaves: the recipe
directory handed to the flake, the out-links kept as GC roots, which result
is libtorch and which the training binary, and the notes that say what was
built, downloaded or already there.

Nix does not keep the installables' order in its JSON result, nor in the
names of the out-links (nix/CONTRACT.md): everything here tells the outputs
apart by what they are, never by position.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from prepare.host import dirs, human
from prepare.host.state import RECIPE_FILE, opened_dir, recipe_strays, write_at
from prepare.nix.log import Log, store_name


def write_recipe(state: str, recipe: dict[str, Any]) -> str:
    """recipe.json, alone in its directory (the flake input copies the whole
    directory into the store), replaced atomically.

    Written as root, so nothing here follows a link (prepare.host.state): the
    directory is opened with O_NOFOLLOW, the new file gets a random name in
    the state directory, created with O_EXCL, and a failed write (a full
    disk) leaves no temporary file behind. A recipe directory holding
    anything else is not one fdl-prepare made: it is refused, and nothing in
    it removed. Every failure is a permanent Fail."""
    directory = os.path.join(state, "recipe")
    what = "state directory's recipe directory"
    data = (json.dumps(recipe, sort_keys=True, indent=2) + "\n").encode()
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o755)
        with opened_dir(state, "state directory") as state_fd:
            recipe_strays(directory, state_fd)
            with opened_dir(directory, what) as fd:
                write_at(fd, RECIPE_FILE, data, tmp_dir=state_fd)
    except OSError as err:
        raise dirs.unusable(
            directory, f"the recipe handed to the flake ({directory}/recipe.json)", "the state directory", err,
            var="state_dir (--state-dir)",
        ) from None  # fmt: skip
    return directory


def store_paths(results: list[dict[str, Any]]) -> set[str]:
    """Every store path the build results name: what the out-links may keep."""
    paths: set[str] = set()
    for result in results:
        if "path" in result:
            paths.add(result["path"])
        for path in (result.get("outputs") or {}).values():
            paths.add(path)
    return paths


def prune_links(out_link: str, paths: set[str]) -> None:
    """Drop out-links left by an earlier attempt that built more things
    (`run-3` from a build with one more output): they would pin old
    outputs forever."""
    directory, base = os.path.split(out_link)
    for name in os.listdir(directory):
        if name != base and not name.startswith(base + "-"):
            continue
        link = os.path.join(directory, name)
        if os.path.islink(link) and os.readlink(link) not in paths:
            with contextlib.suppress(OSError):
                os.unlink(link)


def identify(results: list[dict[str, Any]], bin_: str | None) -> tuple[str, str | None]:
    """Which result is libtorch and which the training binary. Nix does not
    keep the installables' order in its JSON, so the training output is the
    one that holds the recipe's bin (the contract says it installs it to
    $out/bin/), and libtorch is the other derivation. Raises ValueError
    when the results hold no derivation at all (an unexpected shape)."""
    built = [r for r in results if "drvPath" in r]
    if not built:
        raise ValueError(f"no derivation among the build results: {json.dumps(results)[:200]}")
    training = None
    if bin_ is not None and len(built) > 1:
        name = os.path.basename(bin_)
        holding = [r for r in built if os.path.exists(os.path.join(r["outputs"].get("out", ""), "bin", name))]
        if len(holding) > 1:
            holding = [r for r in holding if "libtorch" not in store_name(r["drvPath"])] or holding[:1]
        if holding:
            training = holding[0]
    rest = [r for r in built if r is not training and not _is_deps(r, training)]
    libtorch = rest[0] if rest else built[0]
    outputs = libtorch.get("outputs") or {}
    libtorch_path = outputs.get("out") or next(iter(outputs.values()))
    training_path = (training.get("outputs") or {}).get("out") if training else None
    return libtorch_path, training_path


def _out(result: dict[str, Any]) -> str:
    outputs = result.get("outputs") or {}
    return str(outputs.get("out") or next(iter(outputs.values()), ""))


def _is_deps(result: dict[str, Any], training: dict[str, Any] | None) -> bool:
    """The training build's dependencies (the flake's `trainingDeps`,
    nix/CONTRACT.md): cargo's target/ and nothing else; or, for a source
    built in one derivation, the training derivation again."""
    if training is not None and result.get("drvPath") == training.get("drvPath"):
        return True
    out = _out(result)
    try:
        return sorted(os.listdir(out)) == ["target"]
    except OSError:
        return False


def deps_path(results: list[dict[str, Any]], training_path: str | None) -> str | None:
    """The dependency artefacts the training build was built on, when the
    build had them apart (nix/cargo-split.nix); None otherwise."""
    for result in results:
        if "drvPath" in result and _out(result) != training_path and _is_deps(result, None):
            return _out(result)
    return None


def note_build(
    log: Log, results: list[dict[str, Any]], label: str, libtorch_path: str, training_path: str | None, notes: list[str]
) -> None:
    built_drvs = {a.fields[0] for a in log.builds() if a.fields}
    substituted = {a.fields[0] for a in log.substitutions() if a.fields}
    already: list[str] = []
    made: list[str] = []
    fetched: list[str] = []
    for result in results:
        if "drvPath" not in result:
            continue
        outputs = set((result.get("outputs") or {}).values())
        if libtorch_path in outputs:
            what = f"libtorch {label}"
        elif training_path in outputs:
            what = "the training binary"
        elif _is_deps(result, None):
            what = "the training build's dependencies"
        else:
            what = store_name(result["drvPath"])
        if result["drvPath"] in built_drvs:
            made.append(what)
        elif outputs & substituted:
            fetched.append(what)
        else:
            already.append(what)
    other = sorted(store_name(d) for d in built_drvs if d not in {r.get("drvPath") for r in results})
    if already:
        notes.append(f"already in the store: {', '.join(already)}")
    if made or other:
        seconds = sum((a.stopped or a.started) - a.started for a in log.builds())
        notes.append(f"built: {', '.join(made + other)} ({seconds:.1f}s of builds)")
    if fetched or log.transfers():
        notes.append(
            f"downloaded: {human.size(log.bytes_downloaded)} in {len(log.transfers())} transfer(s)"
            + (f" ({', '.join(fetched)} from a binary cache)" if fetched else "")
        )
    elif not made and not other:
        notes.append("nothing built, nothing downloaded")
