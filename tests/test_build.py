"""Steps 4 to 7 against real Nix: the nixpkgs-free test flake, training
sources in temp git repositories, every fault triggered for real."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from nix_fixtures import (
    BUILD,
    DIGEST,
    MANIFEST,
    NIX_CONFIG,
    box_settings,
    build,
    builds_follow_tmpdir,
    manifest_text,
    procs_left,
    procs_with,
    require_nix,
    small_disk,
    trainer,
    valid_path,
)

from prepare.build import workspace
from prepare.fail import Fail
from prepare.nix import urls
from prepare.plan import default_state_dir
from prepare.spec import PrepareSpec, SourceSpec

pytestmark = pytest.mark.nix

REPO = Path(__file__).resolve().parent.parent


def spec(
    flake: str,
    state: str,
    source: str | None = None,
    *,
    libtorch: str | None = "cpu",
    cpu_only: bool = True,
    **box: str,
) -> PrepareSpec:
    """A build spec; `box` are the box's own [join.source] fields."""
    return PrepareSpec(
        source=SourceSpec(from_=source, **box) if source is not None or box else None,
        libtorch=libtorch,
        cpu_only=cpu_only,
        flake=flake,
        state_dir=state,
    )


def run(s: PrepareSpec, events: list | None = None, *, gate: bool = False):
    notes: list[str] = []
    steps = ("gate", *BUILD) if gate else BUILD
    got = build(s, notes, progress=(events.append if events is not None else None), steps=steps)
    return got, notes


def kinds(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def built_names(events: list[dict]) -> list[str]:
    return [e["name"] for e in events if e["type"] == "build-start"]


def expect_fail(s: PrepareSpec, events: list | None = None) -> Fail:
    with pytest.raises(Fail) as caught:
        run(s, events)
    return caught.value


# -- configuration refused before any nix call ----------------------------------


def test_nix_missing_from_path_is_permanent_and_names_the_install(monkeypatch, test_flake, state_dir, git_source):
    src = git_source(trainer())
    monkeypatch.setenv("PATH", "/nonexistent-bin")
    fail = expect_fail(spec(test_flake, state_dir, src.url))
    assert fail.permanent
    assert "nix is not installed" in fail.message
    assert "apt-get install nix-bin" in fail.message


def test_no_flake_is_permanent_and_names_the_flag(state_dir):
    fail = expect_fail(PrepareSpec(libtorch="cpu", cpu_only=True, flake=None, state_dir=state_dir))
    assert fail.permanent
    assert "--flake" in fail.message and "flake" in fail.message


def test_a_git_source_without_a_ref_is_permanent_and_names_source_from(nix_env, test_flake, state_dir, git_source):
    src = git_source(trainer())
    url = f"git+file://{src.path}"
    events: list[dict] = []
    fail = expect_fail(spec(test_flake, state_dir, url), events=events)
    assert fail.permanent
    assert "source.from" in fail.message and url in fail.message and "ref=" in fail.message
    assert not any(e["type"] in ("download-start", "build-start") for e in events)


def test_an_unwritable_state_dir_is_permanent_and_names_state_dir(nix_env, test_flake, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    fail = expect_fail(spec(test_flake, str(blocker / "state")))
    assert fail.permanent
    assert "--state-dir" in fail.message


# -- evaluation ---------------------------------------------------------------------


def test_a_flake_with_a_syntax_error_is_permanent(nix_env, make_flake, state_dir):
    flake = make_flake(flake_nix="{ outputs = { self }: { legacyPackages = ; }; }\n")
    fail = expect_fail(spec(flake, state_dir))
    assert fail.permanent
    assert "syntax error" in fail.message
    assert "--flake" in fail.message


def test_a_flake_missing_the_fdl_attribute_is_permanent(nix_env, make_flake, state_dir):
    flake = make_flake(
        flake_nix="{ outputs = { self }: { legacyPackages.x86_64-linux = { }; legacyPackages.aarch64-linux = { }; }; }\n"
    )
    fail = expect_fail(spec(flake, state_dir))
    assert fail.permanent
    assert "does not provide attribute" in fail.message
    assert "CONTRACT.md" in fail.message


def test_an_unknown_variant_is_permanent_and_lists_the_flakes_variants(nix_env, test_flake, state_dir):
    fail = expect_fail(spec(test_flake, state_dir, libtorch="rocm61", cpu_only=False))
    assert fail.permanent
    assert "'rocm61'" in fail.message
    assert "cpu" in fail.message and "cu128" in fail.message
    assert "--libtorch" in fail.message


def test_cpu_only_refuses_a_cuda_variant_before_anything_is_fetched(nix_env, test_flake, state_dir, git_source):
    src = git_source(trainer())
    events: list[dict] = []
    fail = expect_fail(spec(test_flake, state_dir, src.url, libtorch="cu128", cpu_only=True), events=events)
    # Refused by the plan, before step 4: no event at all, no state directory.
    assert fail.reason == "config.invalid"
    assert "cpu_only (from PrepareSpec.cpu_only)" in fail.message and '"cu128"' in fail.message
    assert events == [] and os.listdir(state_dir) == []


def test_a_variant_not_covering_the_fake_nvml_card_fails_before_any_fetch(
    nix_env, test_flake, state_dir, git_source, nvml_box
):
    from nvml_fixtures import pascal_card

    from prepare.pipeline import prepare

    nvml_box(pascal_card())
    src = git_source(trainer())
    events: list[dict] = []
    s = spec(test_flake, state_dir, src.url, libtorch="cu128", cpu_only=False)
    with pytest.raises(Fail) as caught:
        prepare(s, [], progress=events.append)
    fail = caught.value
    assert fail.permanent
    assert "GPU 0" in fail.message and "GTX 1080 Ti" in fail.message and "6.1" in fail.message
    assert "7.5, 8.0, 8.6, 9.0, 10.0, 12.0" in fail.message
    assert "--devices" in fail.message and "--libtorch" in fail.message
    # Nothing fetched, nothing built: the only step reached is the evaluation.
    assert [e["name"] for e in events if e["type"] == "step"] == ["evaluate"]
    assert not any(e["type"].startswith(("download", "build", "substitute")) for e in events)
    assert sum(e.get("bytes", 0) for e in events if e["type"] == "download-done") == 0
    assert not os.path.exists(os.path.join(state_dir, "recipe"))


def test_auto_picks_cu128_for_an_ampere_box_and_cpu_for_cpu_only(nix_env, test_flake, state_dir, nvml_box):
    from nvml_fixtures import ampere_pair

    nvml_box(ampere_pair())
    s = spec(test_flake, state_dir, libtorch="auto", cpu_only=False)
    got, notes = run(s, gate=True)
    assert got.libtorch.variant == "cu128"
    assert os.path.isfile(os.path.join(got.libtorch.path, "lib", "libtorch.so"))
    assert any("picked cu128" in n for n in notes)

    got, _ = run(spec(test_flake, state_dir, libtorch="auto", cpu_only=True))
    assert got.libtorch.variant == "cpu"


# -- fetching the source ---------------------------------------------------------------


def test_a_source_on_a_closed_loopback_port_is_transient(nix_env, test_flake, state_dir):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Closed once the socket is gone: the connection is refused.
    url = f"git+http://127.0.0.1:{port}/train.git?ref=main"
    fail = expect_fail(spec(test_flake, state_dir, url))
    assert not fail.permanent
    assert url in fail.message and "source.from" in fail.message


def test_a_ref_that_does_not_exist_yet_is_transient(nix_env, test_flake, state_dir, git_source):
    src = git_source(trainer())
    fail = expect_fail(spec(test_flake, state_dir, f"git+file://{src.path}?ref=not-pushed-yet"))
    assert not fail.permanent


# -- the manifest ----------------------------------------------------------------------


def test_no_manifest_and_no_bin_is_transient_and_names_publishing_and_source_bin(
    nix_env, test_flake, state_dir, git_source
):
    src = git_source(trainer(manifest={}))
    events: list[dict] = []
    fail = expect_fail(spec(test_flake, state_dir, src.url), events=events)
    assert not fail.permanent
    assert "fdl publish" in fail.message and "source.bin" in fail.message and "--source-bin" in fail.message
    assert not any(e["type"] == "build-start" for e in events)


def test_a_published_manifest_outranks_the_boxs_own_recipe(nix_env, test_flake, state_dir, git_source):
    src = git_source(
        {
            **trainer(
                manifest={
                    "bin": "published",
                    "cwd": "app",
                    "build": "printf '#!/bin/sh\\necho published\\n' > published && chmod +x published",
                    "args": ["--epochs", "3"],
                    "run": "run-77",
                    "built": True,
                    "published_epoch": int(time.time()) - 300,
                    "origin": "controller-a",
                }
            ),
            "app/keep": "x\n",
        }
    )
    box = {"bin": "boxbin", "cwd": ".", "build": "exit 9"}
    got, notes = run(spec(test_flake, state_dir, src.url, **box))
    assert os.path.basename(got.bin.path) == "published"
    assert subprocess.run([got.bin.path], capture_output=True, text=True).stdout.strip() == "published"
    # The published tree's `app`, in the run's writable copy (prepare.build.rundir).
    assert got.bin.cwd.startswith(os.path.join(state_dir, "runs") + "/") and got.bin.cwd.endswith("/app")
    assert os.path.isfile(os.path.join(got.bin.cwd, "keep"))
    assert got.args == ("--epochs", "3")
    assert got.run_id == "run-77"
    assert any("run run-77" in n and "published 5m ago" in n and "controller-a" in n for n in notes)
    assert not any("NOT built" in n for n in notes)


def test_a_manifest_that_omits_a_field_keeps_the_boxs_value(nix_env, test_flake, state_dir, git_source):
    # The manifest names the binary only; the build line comes from the box.
    src = git_source(trainer(manifest={"bin": "fromthebox", "run": "r1", "built": False}))
    box_build = "printf '#!/bin/sh\\necho box\\n' > fromthebox && chmod +x fromthebox"
    got, notes = run(spec(test_flake, state_dir, src.url, build=box_build, bin="ignored"))
    assert os.path.basename(got.bin.path) == "fromthebox"
    assert subprocess.run([got.bin.path], capture_output=True, text=True).stdout.strip() == "box"
    assert any("NOT built by the publisher" in n for n in notes)
    assert got.args == ()  # floDl's default: a manifest without args runs the binary with none


def test_the_box_recipe_alone_builds_when_nothing_is_published(nix_env, test_flake, state_dir, git_source):
    src = git_source(trainer(manifest={}))
    got, notes = run(
        spec(test_flake, state_dir, src.url, bin="train", build="printf '#!/bin/sh\\n' > train && chmod +x train")
    )
    assert os.access(got.bin.path, os.X_OK)
    assert got.run_id is None and got.args is None
    assert any("no run manifest" in n for n in notes)


def test_a_published_cwd_missing_from_the_tree_is_transient_and_a_box_cwd_permanent(
    nix_env, test_flake, state_dir, git_source
):
    src = git_source(trainer(manifest={"bin": "train", "cwd": "not-there", "build": "true"}))
    fail = expect_fail(spec(test_flake, state_dir, src.url))
    assert not fail.permanent
    assert fail.reason == "source.manifest-invalid"
    assert "'not-there'" in fail.message and MANIFEST in fail.message

    src = git_source(trainer(manifest={}))
    fail = expect_fail(spec(test_flake, state_dir, src.url, bin="train", cwd="not-there"))
    assert fail.permanent
    assert "--source-cwd" in fail.message


def published(files: dict[str, str], tmp_path: Path, **fields: object) -> dict[str, str]:
    """`files` with floDl's two run files, as `fdl publish` writes them."""
    from prepare.build import digest

    tree = tmp_path / "published"
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    sidecar, tree_digest = digest.compute(str(tree), digest.tree_files(str(tree)))
    table = {**fields, "digest": {"sha256": tree_digest.sha256, "files": tree_digest.files, "bytes": tree_digest.bytes}}
    return {**files, DIGEST: sidecar, MANIFEST: manifest_text(**table)}


def test_a_published_tree_is_checked_against_its_digest_before_anything_is_built(
    nix_env, test_flake, state_dir, git_source, tmp_path
):
    line = "printf '#!/bin/sh\\necho trained\\n' > train && chmod +x train"
    files = published(trainer(manifest={}), tmp_path, bin="train", build=line, run="r-1", built=True)
    src = git_source(files)
    got, notes = run(spec(test_flake, state_dir, src.url))
    assert got.run_id == "r-1" and any("the fetched tree matches its digest (1 file," in n for n in notes)

    # A fetch across a re-publish: the tree changed under the manifest.
    src.commit({"README": "the next publish's tree\n", "extra.rs": "// new\n"}, "half a re-publish")
    events: list[dict] = []
    fail = expect_fail(spec(test_flake, state_dir, src.url), events=events)
    assert fail.reason == "source.digest-mismatch" and not fail.permanent
    assert "README differs" in fail.message and "extra.rs is not in the published set" in fail.message
    assert not any(e["type"] == "build-start" for e in events)


def test_a_tree_with_the_sidecar_and_no_manifest_is_a_publish_under_way_even_for_a_box_with_a_bin(
    nix_env, test_flake, state_dir, git_source, tmp_path
):
    files = published(trainer(manifest={}), tmp_path, bin="train")
    del files[MANIFEST]
    src = git_source(files)
    fail = expect_fail(spec(test_flake, state_dir, src.url, bin="train", build="true"))
    assert fail.reason == "source.not-published" and not fail.permanent
    assert "a publish is under way" in fail.message and DIGEST in fail.message


# -- building -------------------------------------------------------------------------------


def test_a_builder_that_exits_3_is_transient_and_shows_its_log(nix_env, test_flake, state_dir, git_source):
    src = git_source(trainer(build="echo compiling the model; echo kaboom >&2; exit 3"))
    events: list[dict] = []
    fail = expect_fail(spec(test_flake, state_dir, src.url), events=events)
    assert not fail.permanent
    assert "exit code 3" in fail.message
    assert "kaboom" in fail.message
    done = [e for e in events if e["type"] == "build-done"]
    assert done and done[-1]["outcome"] == "failed"


def test_a_flake_error_holding_terminal_escapes_is_permanent_and_quoted_escaped(nix_env, make_flake, state_dir):
    # Text from Nix reaches the operator's terminal only as text: an OSC
    # sequence (retitles a terminal window), a bell, a right-to-left override.
    flake = make_flake(
        flake_nix='{ outputs = { self }: { legacyPackages = throw "bad\x1b]0;owned\x07 flake\u202eekalf"; }; }\n'
    )
    fail = expect_fail(spec(flake, state_dir))
    assert fail.permanent and fail.reason == "nix.evaluation"
    assert all(c not in fail.message for c in ("\x1b", "\x07", "\u202e"))
    assert "bad\\x1b]0;owned\\x07 flake\\u202eekalf" in fail.message


@pytest.fixture(params=["TMPDIR", "build-dir"])
def small_build_disk(request, monkeypatch):  # type: ignore[no-untyped-def]
    """A 4 MiB tmpfs where this Nix makes a build's directory, and the
    setting that put it there: TMPDIR, where Nix builds under it (2.8,
    2.26), or Nix's build-dir (2.26 and later have the setting; from 2.30
    it is where builds go, /nix/var/nix/builds unless nix.conf says)."""
    setting = request.param
    if setting == "TMPDIR" and not builds_follow_tmpdir():
        pytest.skip("Nix 2.30 and later make no build's directory under TMPDIR: the build-dir case is theirs")
    if setting == "build-dir" and "build-dir" not in box_settings():
        pytest.skip("this Nix has no build-dir setting (2.8): it builds under TMPDIR, the TMPDIR case")
    # Nix 2.30 and later refuse a build-dir that others can write, or one
    # under such a directory (/tmp).
    # Private for TMPDIR too: builds run under no directory others can write
    # (prepare.build.workspace.build_root), so a TMPDIR under /tmp is set aside.
    with small_disk(private=True) as point:
        if setting == "TMPDIR":
            monkeypatch.setenv("TMPDIR", str(point))
        else:
            monkeypatch.setenv("NIX_CONFIG", f"{NIX_CONFIG}build-dir = {point}\n")
        yield point, setting


def test_a_full_build_disk_during_the_build_is_permanent_naming_that_disk_not_the_training_source(
    nix_env, test_flake, state_dir, git_source, small_build_disk
):
    point, setting = small_build_disk
    src = git_source(trainer(build="head -c 8000000 /dev/zero > weights.bin && printf '#!/bin/sh\\n' > train"))
    fail = expect_fail(spec(test_flake, state_dir, src.url))
    assert fail.permanent and fail.reason == "nix.no-space", fail.message
    where = f"TMPDIR={point}" if setting == "TMPDIR" else f"Nix's build-dir {point}"
    assert f"the disk Nix builds on is full (the build directory, under {where})" in fail.message
    assert f"df -h {point}" in fail.message and "No space left on device" in fail.message
    assert "fix the training source" not in fail.message
    # The attempt's own directory went with it, on the disk it filled.
    assert not list(point.glob("fdl-prepare-nix.*"))


def test_a_build_past_its_timeout_is_transient(nix_env, test_flake, state_dir, git_source):
    from dataclasses import replace

    # A length no other process on the box sleeps: the check below is by name.
    marker = f"30.{os.getpid()}1"
    src = git_source(trainer(build=f"sleep {marker}"))
    start = time.monotonic()
    fail = expect_fail(replace(spec(test_flake, state_dir, src.url), build_timeout_s=2))
    assert time.monotonic() - start < 25
    assert not fail.permanent
    assert "timed out" in fail.message and "--build-timeout" in fail.message
    assert not procs_left(f"sleep {marker}")


def test_a_fixed_output_hash_mismatch_is_permanent(nix_env, make_flake, state_dir):
    flake = make_flake(
        extra_nix="""toolchain: {
  pinned = {
    cuda = null;
    archs = [ ];
    package = toolchain.fixedOutput {
      name = "pinned-libtorch";
      text = "not what the pin says";
      hash = "sha256-AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    };
  };
}
"""
    )
    fail = expect_fail(spec(flake, state_dir, libtorch="pinned", cpu_only=False))
    assert fail.permanent
    assert "hash mismatch" in fail.message
    assert "hash" in fail.message.split("Fix:")[1]


def test_an_assertion_failing_in_the_flake_is_permanent(nix_env, make_flake, state_dir):
    flake = make_flake(
        extra_nix="""toolchain: {
  asserted = {
    cuda = null;
    archs = [ ];
    package = assert builtins.pathExists "/nonexistent/fdl-toolkit"; toolchain.mkLibtorch { label = "asserted"; };
  };
}
"""
    )
    events: list[dict] = []
    fail = expect_fail(spec(flake, state_dir, libtorch="asserted", cpu_only=False), events=events)
    assert fail.permanent
    assert "assertion" in fail.message and "failed" in fail.message
    assert not any(e["type"] == "build-start" for e in events)


def test_a_build_without_a_source_builds_libtorch_only(nix_env, test_flake, state_dir):
    got, _ = run(spec(test_flake, state_dir))
    assert got.bin is None and got.args is None and got.run_id is None
    assert got.libtorch.variant == "cpu"
    assert os.path.realpath(os.path.join(state_dir, "gcroots", "run")) == got.libtorch.path


def test_prepares_of_two_sources_on_one_state_directory_never_prune_each_others_roots(
    nix_env, test_flake, state_dir, git_source
):
    # Two join loops on one box, each with its own training source: the
    # second must not take the roots of the binary the first reported.
    first, _ = run(spec(test_flake, state_dir, git_source(trainer()).url))
    other = git_source(trainer(build="printf '#!/bin/sh\\necho other\\n' > train && chmod +x train"))
    second, _ = run(spec(test_flake, state_dir, other.url))
    assert first.bin is not None and second.bin is not None and first.bin != second.bin
    roots = os.path.join(state_dir, "gcroots")
    held = {os.readlink(os.path.join(roots, n)) for n in os.listdir(roots)}
    for got in (first, second):
        assert got.bin is not None
        assert os.path.dirname(os.path.dirname(got.bin.path)) in held
        assert source_root_of(got.bin.cwd, held) is not None
    assert source_root_of(first.bin.cwd, held) != source_root_of(second.bin.cwd, held)


def source_root_of(run_cwd: str, held: set[str]) -> str | None:
    """The rooted store copy of the training source the run directory
    `run_cwd` (a writable copy under <state>/runs, prepare.build.rundir)
    was made from: the store keeps the build's input."""
    mine = sorted(os.listdir(run_cwd))
    found = [
        t
        for t in held
        if t.endswith("-source") and sorted(os.listdir(t)) == mine and not filecmp.dircmp(t, run_cwd).diff_files
    ]
    return found[0] if len(found) == 1 else None


def test_built_outputs_are_gc_roots_under_the_state_dir(nix_env, test_flake, state_dir, git_source):
    src = git_source(trainer())
    got, _ = run(spec(test_flake, state_dir, src.url))
    roots = os.path.join(state_dir, "gcroots")
    targets = {os.readlink(os.path.join(roots, n)) for n in os.listdir(roots)}
    training = os.path.dirname(os.path.dirname(got.bin.path))
    assert {got.libtorch.path, training} <= targets
    assert source_root_of(got.bin.cwd, targets) is not None
    # Nix registered them: the store's own list of roots names our links.
    listed = subprocess.run(
        ["nix-store", "--gc", "--print-roots"],
        capture_output=True,
        text=True,
        env={**os.environ, "NIX_CONFIG": NIX_CONFIG},
    ).stdout
    assert os.path.join(roots, "run") in listed


def test_a_redial_after_a_new_commit_rebuilds_only_the_training_derivation(nix_env, test_flake, state_dir, git_source):
    src = git_source(trainer())
    first, _ = run(spec(test_flake, state_dir, src.url))
    src.commit({"model.txt": f"a new layer {time.time_ns()}\n"}, "new layer")
    events: list[dict] = []
    second, notes = run(spec(test_flake, state_dir, src.url), events=events)
    assert built_names(events) == ["fdl-test-training-cpu"]
    assert second.libtorch == first.libtorch
    assert second.bin.path != first.bin.path
    assert os.path.isfile(os.path.join(second.bin.cwd, "model.txt"))
    assert any("already in the store: libtorch cpu" in n for n in notes)


def test_a_redial_sees_a_new_commit_on_a_remote_ref_at_once(nix_env, test_flake, state_dir, git_source, git_http):
    """Nix resolves a remote ref from its cache for an hour (tarball-ttl);
    the runner's fetch must not, or a re-dial right after a publish would
    build the previous commit."""
    src = git_source(trainer())
    remote = git_http(src)
    first, _ = run(spec(test_flake, state_dir, remote.url))
    src.commit({"model.txt": f"published just now {time.time_ns()}\n"}, "publish")
    remote.publish()
    events: list[dict] = []
    second, _ = run(spec(test_flake, state_dir, remote.url), events=events)
    assert os.path.isfile(os.path.join(second.bin.cwd, "model.txt"))
    assert built_names(events) == ["fdl-test-training-cpu"]
    assert second.bin.path != first.bin.path


def test_a_second_run_with_nothing_changed_builds_and_downloads_nothing(nix_env, test_flake, state_dir, git_source):
    from prepare.pipeline import prepare

    src = git_source(trainer())
    s = spec(test_flake, state_dir, src.url)
    first = prepare(s, [])
    events: list[dict] = []
    notes: list[str] = []
    second = prepare(s, notes, progress=events.append)
    assert second == first
    assert not [e for e in events if e["type"] in ("build-start", "substitute-start")]
    assert sum(e.get("bytes", 0) for e in events if e["type"] == "download-done") == 0
    assert not [e for e in events if e["type"] == "download-start"]
    assert "nothing built, nothing downloaded" in notes


def test_sigterm_during_a_build_leaves_no_out_link_to_a_partial_output(nix_env, test_flake, state_dir, git_source):
    src = git_source(trainer())
    first, _ = run(spec(test_flake, state_dir, src.url))
    roots = os.path.join(state_dir, "gcroots")
    before = {n: os.readlink(os.path.join(roots, n)) for n in os.listdir(roots)}

    marker = f"{time.time_ns() % 100000 + 100}.{os.getpid()}"
    src.commit(
        {MANIFEST: manifest_text(bin="train", build=f"sleep {marker}; printf '#!/bin/sh\\n' > train; chmod +x train")},
        "slow build",
    )
    argv = [
        sys.executable,
        "-m",
        "prepare",
        "--cpu-only",
        "--libtorch",
        "cpu",
        "--flake",
        test_flake,
        "--source",
        src.url,
        "--state-dir",
        state_dir,
    ]
    child = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NIX_CONFIG": NIX_CONFIG},
        cwd=str(REPO),
    )
    try:
        deadline = time.monotonic() + 60
        while not procs_with(f"sleep {marker}"):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.1)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130, err
    deadline = time.monotonic() + 10
    while procs_with(f"sleep {marker}") or procs_with(f"--out-link {roots}"):
        assert time.monotonic() < deadline, procs_with(marker)
        time.sleep(0.1)
    after = {n: os.readlink(os.path.join(roots, n)) for n in os.listdir(roots)}
    assert after == before
    assert all(valid_path(target) for target in after.values())
    assert os.path.realpath(first.bin.path) == first.bin.path and os.access(first.bin.path, os.X_OK)


# -- URLs that follow the working directory, or cannot be the flake -------------------


def _no_nix_spent(events: list[dict]) -> bool:
    return not events


def test_a_source_url_with_whitespace_is_refused_before_any_nix_call(nix_env, test_flake, state_dir, tmp_path):
    events: list[dict] = []
    url = f"path:{tmp_path}/a src"
    fail = expect_fail(spec(test_flake, state_dir, url), events=events)
    assert fail.permanent
    assert "whitespace" in fail.message and "source.from" in fail.message and "--source" in fail.message
    assert _no_nix_spent(events)


@pytest.mark.parametrize("url", ["path:", "path:relative/dir", "path:./relative/dir"])
def test_an_empty_or_relative_path_source_is_permanent_and_shows_an_absolute_one(
    nix_env, test_flake, state_dir, tmp_path, monkeypatch, url
):
    """Nix resolves it against the working directory: under systemd that is
    `/`, and `path:` copies the whole filesystem into the store. Here the
    working directory holds a publishable tree, which Nix would happily
    build from."""
    cwd = tmp_path / "cwd"
    (cwd / "relative" / "dir").mkdir(parents=True)
    for where in (cwd, cwd / "relative" / "dir"):
        for rel, text in trainer().items():
            (where / rel).write_text(text)
    monkeypatch.chdir(cwd)
    events: list[dict] = []
    fail = expect_fail(spec(test_flake, state_dir, url), events=events)
    assert fail.permanent
    assert "source.from" in fail.message and "--source" in fail.message
    assert "working directory" in fail.message
    assert f'"path:{cwd}' in fail.message or '"path:/srv/train"' in fail.message
    assert _no_nix_spent(events)


@pytest.mark.parametrize("url", ["git+file:?ref=main", "git+file:relative?ref=main"])
def test_an_empty_or_relative_git_file_source_is_permanent(nix_env, test_flake, state_dir, url):
    events: list[dict] = []
    fail = expect_fail(spec(test_flake, state_dir, url), events=events)
    assert fail.permanent
    assert "source.from" in fail.message and "--source" in fail.message
    assert '"git+file:///' in fail.message
    assert _no_nix_spent(events)


@pytest.mark.parametrize("flake", ["path:", "."])
def test_a_flake_that_follows_the_working_directory_is_permanent(nix_env, make_flake, state_dir, monkeypatch, flake):
    """From inside a checkout of the flake, `--flake path:` (or `.`) works
    by accident; from systemd's `/` it copies the filesystem."""
    monkeypatch.chdir(make_flake().removeprefix("path:"))
    events: list[dict] = []
    fail = expect_fail(spec(flake, state_dir), events=events)
    assert fail.permanent
    assert "flake" in fail.message and "--flake" in fail.message
    assert "working directory" in fail.message and '"path:/' in fail.message
    assert _no_nix_spent(events)


def test_a_flake_url_with_a_fragment_is_permanent_before_any_nix_call(nix_env, test_flake, state_dir):
    events: list[dict] = []
    fail = expect_fail(spec(f"{test_flake}#legacyPackages", state_dir), events=events)
    assert fail.permanent
    assert "#legacyPackages" in fail.message and f'"{test_flake}"' in fail.message and "--flake" in fail.message
    assert _no_nix_spent(events)


def test_check_flake_url_takes_the_flakes_the_runner_is_given():
    for url in (
        "path:/nix/store/abc-source?narHash=sha256-x",
        "github:owner/fdl-prepare",
        "git+file:///srv/fdl?ref=main&dir=tests/flake",
        "/srv/fdl-prepare",
    ):
        assert urls.check_flake_url(f"  {url} ") == url


# -- the state directory: where it came from ---------------------------------------------


def _blocked(tmp_path: Path) -> Path:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    return blocker / "state"


def test_an_unwritable_state_dir_from_state_directory_is_named_as_the_units(test_flake, tmp_path, monkeypatch):
    monkeypatch.setenv("STATE_DIRECTORY", f"{_blocked(tmp_path)}:/var/lib/other")
    fail = expect_fail(spec(test_flake, None))
    assert fail.permanent
    assert "(from $STATE_DIRECTORY" in fail.message
    assert "from state_dir, --state-dir" not in fail.message and "the default for" not in fail.message
    assert "--state-dir" in fail.message  # what moves it


def test_a_state_dir_the_config_took_from_state_directory_is_named_as_the_units(test_flake, tmp_path, monkeypatch):
    from dataclasses import replace

    from prepare import config

    blocked = str(_blocked(tmp_path))
    monkeypatch.setenv("STATE_DIRECTORY", blocked)
    resolved = config.resolve({}, {}, dict(os.environ))
    assert resolved.state_dir == blocked
    # The resolved spec says where its state_dir came from; build reconstructs nothing.
    fail = expect_fail(replace(resolved, flake=test_flake, libtorch="cpu", cpu_only=True))
    assert "(from $STATE_DIRECTORY" in fail.message


@pytest.mark.parametrize(
    ("where", "named"),
    [("file", "(from join.state_dir in the config)"), ("flag", "(from --state-dir)")],
)
def test_a_state_dir_the_config_took_from_the_file_or_a_flag_is_named_as_that(
    test_flake, tmp_path, monkeypatch, where, named
):
    from dataclasses import replace

    from prepare import config

    blocked = str(_blocked(tmp_path))
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "unit-state"))
    file = {"state_dir": blocked if where == "file" else "/elsewhere"}
    flags = {"state_dir": blocked} if where == "flag" else {}
    resolved = config.resolve(file, flags, dict(os.environ))
    fail = expect_fail(replace(resolved, flake=test_flake, libtorch="cpu", cpu_only=True))
    assert named in fail.message and "$STATE_DIRECTORY" not in fail.message


def test_a_state_dir_changed_after_resolving_is_not_named_by_its_old_origin(test_flake, tmp_path, monkeypatch):
    from dataclasses import replace

    from prepare import config

    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "unit-state"))
    resolved = config.resolve({}, {}, dict(os.environ))
    fail = expect_fail(
        replace(resolved, flake=test_flake, libtorch="cpu", cpu_only=True, state_dir=str(_blocked(tmp_path)))
    )
    assert "(from state_dir, --state-dir)" in fail.message


def test_an_unwritable_state_dir_from_xdg_state_home_is_named_so(test_flake, tmp_path, monkeypatch):
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(_blocked(tmp_path)))
    fail = expect_fail(spec(test_flake, None))
    assert fail.permanent
    assert "(from $XDG_STATE_HOME)" in fail.message


def test_an_unwritable_state_dir_given_by_flag_is_named_as_the_flag(test_flake, tmp_path, monkeypatch):
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "unit-state"))
    fail = expect_fail(spec(test_flake, str(_blocked(tmp_path))))
    assert "(from state_dir, --state-dir)" in fail.message


def test_the_default_state_dir_reads_state_directory_as_the_config_does():
    unit = {"STATE_DIRECTORY": "/var/lib/a:/var/lib/b"}
    assert default_state_dir(unit, uid=1000) == ("/var/lib/a", "$STATE_DIRECTORY, systemd's StateDirectory=")
    # An empty first entry is no StateDirectory= at all (Env.read): not "",
    # which abspath would turn into the working directory.
    got = default_state_dir({"STATE_DIRECTORY": ":/var/lib/b", "XDG_STATE_HOME": "/x"}, uid=1000)
    assert got == ("/x/fdl-prepare", "$XDG_STATE_HOME")
    assert default_state_dir({"HOME": "/home/u"}, uid=1000)[0] == "/home/u/.local/state/fdl-prepare"
    assert default_state_dir({}, uid=0) == ("/var/lib/fdl-prepare", "the default for root")


def test_a_relative_state_directory_from_systemd_is_refused_naming_the_variable():
    with pytest.raises(Fail) as caught:
        default_state_dir({"STATE_DIRECTORY": "var/lib/fdl"}, uid=0)
    assert caught.value.reason == "config.invalid"
    assert "$STATE_DIRECTORY, systemd's StateDirectory= (state_dir)" in caught.value.message
    assert "is a relative path" in caught.value.message


# -- two prepares, one state directory ----------------------------------------------------


def _in_thread(call, timeout: float):
    """Run `call` in a thread and give up on it after `timeout`: a lock wait
    without a bound would otherwise hang the test run."""
    import threading

    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still waiting after {timeout}s"
    return box


def test_a_prepare_waits_for_another_holding_the_state_lock_and_says_so(nix_env, test_flake, state_dir, lock_holder):
    lock = os.path.join(state_dir, "lock")
    lock_holder(lock, 1.5)
    events: list[dict] = []
    start = time.monotonic()
    got, notes = run(spec(test_flake, state_dir), events=events)
    assert time.monotonic() - start >= 1.0
    assert got.libtorch.variant == "cpu"
    waits = [e for e in events if e["type"] == "step" and e["name"] == "wait"]
    assert len(waits) == 1 and lock in waits[0]["detail"] and "another fdl-prepare" in waits[0]["detail"]
    # Said before anything else: after the step's start, the wait is the first thing shown.
    assert events[0]["type"] == "step-start" and events[0]["name"] == "state"
    assert events[1] is waits[0]
    assert any(lock in n and "waited" in n for n in notes)


def test_a_free_state_lock_is_taken_without_a_word(nix_env, test_flake, state_dir):
    events: list[dict] = []
    _, notes = run(spec(test_flake, state_dir), events=events)
    assert not [e for e in events if e.get("name") == "wait"]
    assert not any("waited" in n for n in notes)


def test_a_state_lock_held_past_the_bound_is_transient_and_names_the_lock_file(
    nix_env, test_flake, state_dir, lock_holder, monkeypatch
):
    monkeypatch.setattr(workspace, "LOCK_WAIT_S", 1.0)
    lock = os.path.join(state_dir, "lock")
    lock_holder(lock, 600)
    start = time.monotonic()
    box = _in_thread(lambda: run(spec(test_flake, state_dir)), 30)
    assert time.monotonic() - start >= 1.0
    fail = box.get("error")
    assert isinstance(fail, Fail), box
    assert not fail.permanent
    assert lock in fail.message and "another fdl-prepare" in fail.message


def test_the_state_lock_wait_is_bounded_by_build_timeout_when_it_is_set(
    nix_env, test_flake, state_dir, lock_holder, monkeypatch
):
    from dataclasses import replace

    monkeypatch.setattr(workspace, "LOCK_MARGIN_S", 0.5)
    lock = os.path.join(state_dir, "lock")
    lock_holder(lock, 600)
    start = time.monotonic()
    box = _in_thread(lambda: run(replace(spec(test_flake, state_dir), build_timeout_s=1)), 30)
    assert time.monotonic() - start >= 1.5
    fail = box.get("error")
    assert isinstance(fail, Fail) and not fail.permanent and lock in fail.message
    assert workspace.lock_wait_s(None) == workspace.LOCK_WAIT_S
    assert workspace.lock_wait_s(600) == 600 + workspace.LOCK_MARGIN_S


# -- nix build printing JSON of a shape no Nix prints ------------------------------------------


@pytest.mark.parametrize(
    "printed",
    [
        "[]",
        "{}",
        '"/nix/store/not-a-list"',
        '[{"path": "/nix/store/00000000000000000000000000000000-only-a-path"}]',
        '[{"drvPath": 3, "outputs": {}}]',
        '[{"drvPath": "/nix/store/x.drv", "outputs": ["not", "a", "map"]}]',
        "[" * 100000 + "]" * 100000,
    ],
    ids=["empty-list", "object", "string", "no-derivation", "drvpath-number", "outputs-list", "nested-100000"],
)
def test_nix_build_json_of_an_unexpected_shape_is_transient_not_a_traceback(
    nix_env, test_flake, state_dir, tmp_path, printed
):
    real = require_nix()
    (tmp_path / "printed.json").write_text(printed)
    shim = tmp_path / "nix"
    # The real nix for everything but `build`, which answers with the JSON
    # under test and exits 0, as a nix with another output format would.
    shim.write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do [ "$a" = build ] && exec cat {tmp_path / "printed.json"}; done\n'
        f'exec {real} "$@"\n'
    )
    shim.chmod(0o755)
    with pytest.raises(Fail) as caught:
        build(spec(test_flake, state_dir), [], nix_program=str(shim))
    fail = caught.value
    assert not fail.permanent
    assert "no JSON result of a known shape" in fail.message and "the next attempt retries" in fail.message


# -- kinds that stop a box rather than loop it -------------------------------------------------


@pytest.mark.parametrize(
    ("field", "url"),
    [("source.from", "path:/"), ("source.from", "git+file:///?ref=main"), ("flake", "path:/"), ("flake", "path:///")],
)
def test_the_root_directory_as_a_source_or_flake_is_permanent(state_dir, field, url):
    s = spec("path:/srv/fdl", state_dir, url) if field == "source.from" else spec(url, state_dir)
    fail = expect_fail(s)
    assert fail.permanent and f"{field} = {url!r} names the root directory" in fail.message


def test_a_manifest_cwd_that_is_a_symlink_out_of_the_tree_stops_the_box(nix_env, test_flake, state_dir, tmp_path):
    # A path: source copied into the store keeps its symlink: the build and
    # the run would work in /etc. Retrying does that again: permanent.
    tree = tmp_path / "train"
    tree.mkdir()
    (tree / "escape").symlink_to("/etc")
    (tree / MANIFEST).write_text(manifest_text(bin="train", cwd="escape"))
    fail = expect_fail(spec(test_flake, state_dir, f"path:{tree}"))
    assert fail.permanent
    assert "leads out of the training source through a symlink (to /etc)" in fail.message


BUILD_LOG_RSS = """
import json, resource, sys
from prepare import pipeline
from prepare.fail import Fail
from prepare.plan import plan
from prepare.spec import PrepareSpec, SourceSpec
spec = PrepareSpec(source=SourceSpec(from_=sys.argv[1]), libtorch="cpu", cpu_only=True, flake=sys.argv[2],
                   state_dir=sys.argv[3])
steps = [step for step in pipeline.STEPS if step.name in ("state", "variant", "source", "build")]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    pipeline.run(plan(spec), [], steps=steps)
    message = ""
except Fail as fail:
    message = fail.message
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_kib": after - before, "message": message}))
"""


def test_a_builder_printing_megabytes_of_log_is_transient_and_the_preparers_memory_stays_flat(
    nix_env, test_flake, state_dir, git_source
):
    # An 8 MB line without a newline, then 200,000 short ones, then the failure.
    build = (
        "head -c 8000000 /dev/zero | tr '\\\\0' x; echo; i=0; while [ $i -lt 200000 ]; do echo \"line $i\"; "
        "i=$((i+1)); done; echo 'the real reason' >&2; exit 3"
    )
    src = git_source(trainer(build=build))
    done = subprocess.run(
        [sys.executable, "-c", BUILD_LOG_RSS, src.url, test_flake, state_dir], cwd=str(REPO), capture_output=True,
        text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    print(f"resident set grew {got['grew_kib'] / 1024:.1f} MiB; message {len(got['message'])} characters")
    assert got["grew_kib"] < 64 * 1024
    assert "the real reason" in got["message"] and len(got["message"]) < 16384


KILLED_WITH_A_SIBLING = r"""toolchain:
let
  system = (toolchain.mkLibtorch { label = "probe"; }).system;
  step = name: script: derivation {
    inherit name system;
    builder = "/bin/sh";
    args = [ "-c" script ];
  };
  # Killed as the OOM killer kills: SIGKILL, from outside the build (the
  # test, by the sleep's unique length): inside the sandbox the builder is
  # its PID namespace's init, which no signal from within can kill.
  # /usr/bin/sleep: the sandbox lends /usr and /bin/sh, not /bin (merged /usr).
  first = step "oom-killed-first" "echo first started; exec /usr/bin/sleep 611.5";
  # Still running when the first dies: Nix stops it, and its activity ends first.
  sibling = step "sibling-nix-stopped" "echo sibling started; /usr/bin/sleep 60; echo > $out";
in
{
  killed = {
    cuda = null;
    archs = [ ];
    package = derivation {
      name = "fdl-test-libtorch-killed";
      inherit system;
      builder = "/bin/sh";
      args = [ "-c" "echo ${first} ${sibling} > $out; echo > $dev" ];
      outputs = [ "out" "dev" ];
    };
  };
}
"""


def test_a_flake_build_killed_by_a_signal_is_transient_and_names_the_build_that_died_first(
    nix_env, make_flake, state_dir, monkeypatch
):
    # Two builds side by side, so there is a sibling for Nix to stop.
    monkeypatch.setenv("NIX_CONFIG", nix_env["NIX_CONFIG"] + "max-jobs = 2\n")
    flake = make_flake(extra_nix=KILLED_WITH_A_SIBLING)
    stop = threading.Event()

    def kill_the_first_once_both_run() -> None:
        while not stop.is_set():
            first = procs_with("sleep 611.5")
            if first and procs_with("sleep 60"):
                time.sleep(0.5)
                for pid, _ in first:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_first_once_both_run, daemon=True)
    killer.start()
    start = time.monotonic()
    try:
        fail = expect_fail(spec(flake, state_dir, libtorch="killed", cpu_only=False))
    finally:
        stop.set()
        killer.join(timeout=10)
    assert time.monotonic() - start < 50
    assert (fail.reason, fail.permanent) == ("nix.build-killed", False), fail.message
    assert "signal 9" in fail.message
    said, fix = fail.message.split("Fix:")
    assert "oom-killed-first" in fix and "sibling-nix-stopped" not in fix
    assert "last lines of the oom-killed-first build log:\n  first started" in said
    assert "oom" in fix.lower() and "retries" in fix
    assert not procs_left("/usr/bin/sleep 60")
