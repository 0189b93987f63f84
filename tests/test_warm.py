"""A re-dial that evaluates nothing: what an earlier attempt settled is kept
under the state directory (prepare/build/record.py) and trusted only while it
still holds. Every count here comes from a `nix` shim that logs each call
and runs the real one: an evaluation is a call of `nix eval` or `nix build`
(a build of a flake attribute evaluates the flake)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from nix_fixtures import MANIFEST, NIX_CONFIG, build, manifest_text, procs_left, trainer

from prepare.build import record
from prepare.build.choose import CONTRACT
from prepare.fail import Fail
from prepare.nix import runner as nix_mod
from prepare.spec import Prepared, PrepareSpec, SourceSpec

pytestmark = pytest.mark.nix

EVALUATING = ("eval", "build")


class Counting:
    """A `nix` that logs its subcommands (and when each started) before
    running the real one; `delay(word, s)` holds each call whose argv
    holds `word` that long first."""

    def __init__(self, tmp_path: Path) -> None:
        self.real = shutil.which("nix")
        assert self.real is not None
        self.log = tmp_path / "nix-calls.jsonl"
        self.program = str(tmp_path / "bin" / "nix")
        Path(self.program).parent.mkdir(exist_ok=True)
        self.delay("", 0)

    def delay(self, word: str, seconds: float) -> None:
        hold = f'case " $* " in *" {word} "*) sleep {seconds};; esac\n' if seconds else ""
        Path(self.program).write_text(
            "#!/bin/sh\n"
            # One write of a whole line to a file opened for appending: two
            # calls at once (a fetch beside a resolution) log two lines.
            "python3 -c 'import json,os,sys,time; line = json.dumps([time.time(), sys.argv[2:]]) + chr(10); "
            "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT); os.write(fd, line.encode())' "
            f'{self.log} "$@"\n' + hold + f'exec {self.real} "$@"\n'
        )
        Path(self.program).chmod(0o755)

    def timed_calls(self) -> list[tuple[float, list[str]]]:
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        self.log.unlink()
        return [(t, argv) for t, argv in map(json.loads, lines)]

    def calls(self) -> list[list[str]]:
        return [argv for _, argv in self.timed_calls()]

    def evaluations(self) -> int:
        subcommands = [
            next((a for a in argv if a in ("eval", "build", "flake", "--version")), "") for argv in self.calls()
        ]
        return sum(1 for s in subcommands if s in EVALUATING)


@pytest.fixture
def nix(tmp_path: Path, nix_env: dict[str, str]) -> Counting:
    return Counting(tmp_path)


def attempt(nix: Counting, spec: PrepareSpec, notes: list[str] | None = None, events: list | None = None) -> Prepared:
    return build(
        spec, notes if notes is not None else [], progress=events.append if events is not None else None,
        nix_program=nix.program,
    )  # fmt: skip


def cpu_spec(flake: str, state: str, source: str | None, **box: str) -> PrepareSpec:
    return PrepareSpec(
        source=SourceSpec(from_=source, **box) if source is not None else None,
        libtorch="cpu",
        cpu_only=True,
        flake=flake,
        state_dir=state,
    )


def built_names(events: list[dict]) -> list[str]:
    return [e["name"] for e in events if e["type"] == "build-start"]


# -- the counts ----------------------------------------------------------------------


def test_a_warm_attempt_evaluates_nothing_and_prepares_the_same(nix, make_flake, state_dir, git_source):
    flake = make_flake(heavy=600000)
    src = git_source(trainer())
    spec = cpu_spec(flake, state_dir, src.url)
    first = attempt(nix, spec)
    assert nix.evaluations() == 2  # a box never seen: the variants before the source is fetched, then the build

    notes: list[str] = []
    events: list[dict] = []
    second = attempt(nix, spec, notes, events)
    assert nix.evaluations() == 0
    assert second == first
    assert not [e for e in events if e["type"] in ("build-start", "download-start", "substitute-start")]
    assert any(n.startswith("nothing evaluated:") and "--refresh" in n for n in notes)
    assert "nothing built, nothing downloaded" in notes


def test_a_new_commit_on_the_source_ref_evaluates_once_and_builds_only_the_training(
    nix, test_flake, state_dir, git_source
):
    src = git_source(trainer())
    spec = cpu_spec(test_flake, state_dir, src.url)
    first = attempt(nix, spec)
    nix.calls()
    src.commit(trainer(), "a new publish")
    events: list[dict] = []
    second = attempt(nix, spec, events=events)
    assert nix.evaluations() == 1
    assert second.bin != first.bin and second.libtorch == first.libtorch
    assert [n for n in built_names(events)] == ["fdl-test-training-cpu"]


def test_a_changed_box_recipe_evaluates_once(nix, test_flake, state_dir, git_source):
    # No manifest `build`: the box's own recipe decides it.
    src = git_source(trainer(manifest={"bin": "train"}))
    build_line = "printf '#!/bin/sh\\necho %s\\n' > train && chmod +x train"
    first = attempt(nix, cpu_spec(test_flake, state_dir, src.url, build=build_line % "one"))
    nix.calls()
    second = attempt(nix, cpu_spec(test_flake, state_dir, src.url, build=build_line % "two"))
    assert nix.evaluations() == 1
    assert second.bin != first.bin
    assert subprocess.run([second.bin.path], capture_output=True, text=True).stdout.strip() == "two"


def test_a_changed_variant_evaluates_once(nix, make_flake, state_dir, git_source):
    flake = make_flake(
        extra_nix="""toolchain: {
  cpu2 = { cuda = null; archs = [ ]; package = toolchain.mkLibtorch { label = "cpu2"; }; };
}
"""
    )
    src = git_source(trainer())
    spec = replace(cpu_spec(flake, state_dir, src.url), cpu_only=False)
    attempt(nix, spec)
    nix.calls()
    got = attempt(nix, replace(spec, libtorch="cpu2"))
    assert nix.evaluations() == 1
    assert got.libtorch is not None and got.libtorch.variant == "cpu2"


CPU3 = 'toolchain: { cpu3 = { cuda = null; archs = [ ]; package = toolchain.mkLibtorch { label = "cpu3"; }; }; }\n'


def test_a_changed_flake_with_the_same_variants_evaluates_once(nix, make_flake, state_dir, git_source):
    src = git_source(trainer())
    flake = make_flake(heavy=1000)
    spec = cpu_spec(flake, state_dir, src.url)
    first = attempt(nix, spec)
    nix.calls()
    # A new tree (a new identity), the same variants: what a nixpkgs bump is.
    Path(flake.removeprefix("path:"), "heavy.nix").write_text("2000\n")
    notes: list[str] = []
    events: list[dict] = []
    second = attempt(nix, spec, notes, events)
    calls = nix.calls()
    gated = [a for argv in calls for a in argv if ".ifVariants." in a]
    # libtorch, the binary and its dependency artefacts (nix/cargo-split.nix).
    assert len(gated) == 3 and gated[1].endswith(".training") and gated[2].endswith(".trainingDeps"), calls
    assert sum(1 for argv in calls if "eval" in argv or "build" in argv) == 1, calls
    assert second == first and not built_names(events)
    assert attempt(nix, spec) == first and nix.evaluations() == 0


def test_a_changed_flake_with_other_variants_takes_the_normal_path_and_builds_nothing_first(
    nix, make_flake, state_dir, git_source
):
    src = git_source(trainer())
    flake = make_flake()
    spec = cpu_spec(flake, state_dir, src.url)
    first = attempt(nix, spec)
    nix.calls()
    # One more variant: the recorded ones still serve the box, but they are
    # not the flake's any more, so the build's evaluation refuses...
    Path(flake.removeprefix("path:"), "extra.nix").write_text(CPU3)
    events: list[dict] = []
    second = attempt(nix, spec, events=events)
    # ... and the variants are evaluated, then built as usual: the gated
    # build, the variants, the build.
    assert nix.evaluations() == 3
    assert second == first and not built_names(events)
    assert attempt(nix, spec) == first and nix.evaluations() == 0


def test_a_changed_flake_that_no_longer_has_the_variant_is_refused_before_any_build(
    nix, make_flake, state_dir, git_source
):
    src = git_source(trainer())
    flake = make_flake(extra_nix=CPU3)
    spec = replace(cpu_spec(flake, state_dir, src.url), cpu_only=False, libtorch="cpu3")
    attempt(nix, spec)
    nix.calls()
    Path(flake.removeprefix("path:"), "extra.nix").unlink()
    events: list[dict] = []
    with pytest.raises(Fail) as refused:
        attempt(nix, spec, events=events)
    assert refused.value.kind == "permanent" and refused.value.reason == "libtorch.unknown-variant"
    assert not built_names(events) and not [e for e in events if e["type"] == "download-start"]


def test_a_flake_from_before_if_variants_gets_the_normal_path(nix, make_flake, state_dir, git_source):
    src = git_source(trainer())
    flake = make_flake()
    spec = cpu_spec(flake, state_dir, src.url)
    first = attempt(nix, spec)
    nix.calls()
    contract = Path(flake.removeprefix("path:"), "nix", "contract.nix")
    text = contract.read_text()
    cut = text.index("  ifVariants.")
    end = text.index("\n  };\n", cut) + len("\n  };\n")
    contract.write_text(text[:cut] + text[end:])
    assert attempt(nix, spec) == first
    assert nix.evaluations() == 3


def test_a_changed_flake_is_evaluated_afresh_when_the_recorded_variants_cannot_serve(
    nix, make_flake, state_dir, git_source
):
    src = git_source(trainer())
    flake = make_flake()
    attempt(nix, cpu_spec(flake, state_dir, src.url))
    nix.calls()
    # The same flake with one more variant, which the spec now asks for: the
    # recorded variants cannot tell whether it serves the box.
    Path(flake.removeprefix("path:"), "extra.nix").write_text(CPU3)
    spec = replace(cpu_spec(flake, state_dir, src.url), cpu_only=False, libtorch="cpu3")
    got = attempt(nix, spec)
    assert nix.evaluations() == 2  # its variants (before the source is fetched), then the build
    assert got.libtorch is not None and got.libtorch.variant == "cpu3"
    attempt(nix, spec)
    assert nix.evaluations() == 0


def test_the_runners_digest_is_the_name_the_flake_gives_if_variants(nix_env, make_flake):
    flake = make_flake(extra_nix=CPU3)
    fdl = f"{flake}#legacyPackages.{nix_mod.system()}.fdl"
    state = Path(flake.removeprefix("path:")).parent / "state-digest"
    state.mkdir()
    runner = nix_mod.Nix(str(state))
    got = runner.eval_json(fdl, apply="f: { names = builtins.attrNames f.ifVariants; inherit (f) variants; }")
    assert got["names"] == [record.variants_digest(CONTRACT, got["variants"])]
    # ... and any other metadata (or contract) names another attribute.
    assert record.variants_digest(CONTRACT, {**got["variants"], "cpu3": {}}) not in got["names"]
    assert record.variants_digest(CONTRACT + 1, got["variants"]) not in got["names"]


# -- the two resolutions side by side -------------------------------------------------


def test_a_re_dial_fetches_the_source_beside_the_flakes_resolution(nix, test_flake, state_dir, git_source):
    src = git_source(trainer())
    spec = cpu_spec(test_flake, state_dir, src.url)
    first = attempt(nix, spec)
    nix.calls()
    nix.delay("metadata", 2)
    assert attempt(nix, spec) == first
    started = {argv[argv.index("flake") + 1]: t for t, argv in nix.timed_calls() if "flake" in argv}
    assert started["prefetch"] - started["metadata"] < 1.5, started


def test_a_first_attempt_fetches_nothing_before_the_gate(nix, test_flake, state_dir, git_source):
    spec = cpu_spec(test_flake, state_dir, git_source(trainer()).url)
    nix.delay("metadata", 1)
    attempt(nix, spec)
    order = [argv[argv.index("flake") + 1] if "flake" in argv else argv[-1] for argv in nix.calls()]
    assert order.index("prefetch") > order.index("metadata"), order
    evaluated = next(i for i, argv in enumerate(order) if argv.endswith(".fdl"))
    assert order.index("prefetch") > evaluated, order


def test_a_refused_re_dial_leaves_no_fetch_running(nix, test_flake, state_dir, git_source):
    spec = cpu_spec(test_flake, state_dir, git_source(trainer()).url)
    attempt(nix, spec)
    nix.calls()
    nix.delay("prefetch", 30)
    started = time.monotonic()
    with pytest.raises(Fail) as refused:
        attempt(nix, replace(spec, cpu_only=False, libtorch="no-such-variant"))
    assert refused.value.reason == "libtorch.unknown-variant"
    assert time.monotonic() - started < 20
    assert not procs_left("sleep 30"), "the fetch started beside the resolution outlived the refusal"


def test_refresh_evaluates_anyway_and_records_afresh(nix, test_flake, state_dir, git_source):
    src = git_source(trainer())
    spec = cpu_spec(test_flake, state_dir, src.url)
    first = attempt(nix, spec)
    nix.calls()
    again = attempt(nix, replace(spec, refresh=True))
    assert nix.evaluations() == 2 and again == first
    assert attempt(nix, spec) == first and nix.evaluations() == 0


def test_a_libtorch_only_build_is_warm_too(nix, test_flake, state_dir):
    spec = cpu_spec(test_flake, state_dir, None)
    first = attempt(nix, spec)
    nix.calls()
    assert attempt(nix, spec) == first
    assert nix.evaluations() == 0


# -- any doubt means the normal path ----------------------------------------------------


def _warm(nix: Counting, spec: PrepareSpec) -> Prepared:
    first = attempt(nix, spec)
    nix.calls()
    return first


def test_a_deleted_out_link_means_the_normal_path_and_the_link_back(nix, test_flake, state_dir, git_source):
    spec = cpu_spec(test_flake, state_dir, git_source(trainer()).url)
    first = _warm(nix, spec)
    roots = Path(state_dir) / "gcroots"
    victim = sorted(roots.iterdir())[0]
    victim.unlink()
    assert attempt(nix, spec) == first
    assert nix.evaluations() == 1
    assert victim.is_symlink()


def test_a_collected_store_path_means_the_normal_path_and_a_rebuild(nix, test_flake, state_dir, git_source):
    spec = cpu_spec(test_flake, state_dir, git_source(trainer()).url)
    first = _warm(nix, spec)
    assert first.bin is not None
    training = str(Path(first.bin.path).parent.parent)
    # What a garbage collection does once nothing holds the path: the
    # out-link goes first (it is the root), then the path itself.
    for link in (Path(state_dir) / "gcroots").iterdir():
        if os.readlink(link) == training:
            link.unlink()
    done = subprocess.run(
        ["nix-store", "--delete", training],
        capture_output=True,
        text=True,
        env={**os.environ, "NIX_CONFIG": NIX_CONFIG},
    )
    assert done.returncode == 0, done.stderr
    events: list[dict] = []
    again = attempt(nix, spec, events=events)
    assert again == first and os.path.exists(training)
    assert nix.evaluations() == 1
    assert built_names(events) == ["fdl-test-training-cpu"]


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],
        lambda text: "not json at all",
        lambda text: json.dumps({**json.loads(text), "version": 99}),
        lambda text: json.dumps({**json.loads(text), "plan": {"key": "x", "results": [{"path": "/etc/passwd"}]}}),
        lambda text: "[" * 100000,
        lambda text: "",
    ],
    ids=["truncated", "garbage", "other-version", "foreign-path", "deep", "empty"],
)
def test_a_damaged_record_means_the_normal_path_and_the_right_answer(
    nix, test_flake, state_dir, git_source, damage: Callable[[str], str]
):
    spec = cpu_spec(test_flake, state_dir, git_source(trainer()).url)
    first = _warm(nix, spec)
    path = Path(state_dir) / record.NAME
    path.write_text(damage(path.read_text()))
    assert attempt(nix, spec) == first
    assert nix.evaluations() >= 1
    # ... and the record is whole again.
    assert attempt(nix, spec) == first and nix.evaluations() == 0


def test_a_record_reached_through_a_symlink_is_not_read(nix, test_flake, state_dir, git_source, tmp_path):
    spec = cpu_spec(test_flake, state_dir, git_source(trainer()).url)
    first = _warm(nix, spec)
    path = Path(state_dir) / record.NAME
    elsewhere = tmp_path / "planted.json"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    assert attempt(nix, spec) == first
    assert nix.evaluations() >= 1
    assert not path.is_symlink()


# -- concurrency ---------------------------------------------------------------------


_WRITER = """
import os, sys
from prepare.build import record
state, stop = sys.argv[1], sys.argv[2]
small = record.Record("a" * 64, {"cpu": {"label": "cpu"}})
large = record.Record(
    "b" * 64,
    {f"v{i}": {"label": f"v{i}", "archs": ["8.6"] * 50} for i in range(200)},
    record.Outputs("k", [{"drvPath": "/nix/store/x-a.drv", "outputs": {"out": "/nix/store/x-a"}}]),
)
while not os.path.exists(stop):
    record.save(state, large)
    record.save(state, small)
"""


def test_a_reader_never_sees_a_half_written_record(tmp_path):
    # Records of very different sizes, written over each other as fast as
    # another process can while this one reads: every read is one whole
    # record, and both are seen many times (the race really ran).
    import sys

    state, stop = tmp_path / "state", tmp_path / "stop"
    state.mkdir()
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(state), str(stop)],
        env={**os.environ, "PYTHONPATH": str(Path(record.__file__).resolve().parents[2])},
    )
    seen: dict[str, int] = {}
    torn: list[object] = []
    try:
        deadline = time.monotonic() + 30
        while not (state / record.NAME).exists():
            assert time.monotonic() < deadline and writer.poll() is None, "the writer never wrote a record"
            time.sleep(0.01)
        while min(seen.get("a" * 64, 0), seen.get("b" * 64, 0)) < 50 and time.monotonic() < deadline:
            got = record.load(str(state))
            if got is None:
                if (state / record.NAME).exists():
                    torn.append(got)
                continue
            whole = got.variants == {"cpu": {"label": "cpu"}} or len(got.variants) == 200
            if not whole:
                torn.append(got)
            seen[got.flake_key] = seen.get(got.flake_key, 0) + 1
    finally:
        stop.touch()
        writer.wait(timeout=30)
    assert not torn, torn[:1]
    assert min(seen.values()) >= 50 and len(seen) == 2, seen
    assert not [n for n in os.listdir(state) if n.endswith(".tmp")]


def test_two_concurrent_attempts_on_one_state_directory_agree(nix_env, test_flake, state_dir, git_source):
    spec = cpu_spec(test_flake, state_dir, git_source(trainer()).url)
    results: list[Prepared] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            results.append(build(spec, []))
        except BaseException as error:  # noqa: BLE001 - reported below, with the assertion
            errors.append(error)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 2 and results[0] == results[1]
    assert record.load(state_dir) is not None


def test_a_manifest_changed_without_a_new_commit_is_not_missed(nix, test_flake, state_dir, tmp_path):
    # A path: source edited in place: its NAR hash changes, so does the key.
    tree = tmp_path / "tree"
    tree.mkdir()
    line = "printf '#!/bin/sh\\necho %s\\n' > train && chmod +x train"
    (tree / MANIFEST).write_text(manifest_text(bin="train", build=line % "a"))
    spec = cpu_spec(test_flake, state_dir, f"path:{tree}")
    first = attempt(nix, spec)
    nix.calls()
    (tree / MANIFEST).write_text(manifest_text(bin="train", build=line % "b"))
    second = attempt(nix, spec)
    assert nix.evaluations() == 1 and second.bin != first.bin
    assert subprocess.run([second.bin.path], capture_output=True, text=True).stdout.strip() == "b"


SWAPPED = (
    'toolchain: { cpu = { cuda = null; archs = [ ]; package = toolchain.mkLibtorch { label = "cpu-swapped"; }; }; }\n'
)


def test_a_flake_changed_between_its_resolution_and_the_build_then_rolled_back_never_reports_the_other_flakes_outputs(
    nix, make_flake, state_dir, git_source, tmp_path
):
    """The record's key comes from one resolution of the flake (`nix flake
    metadata`); the build must build that resolution, never the flake's URL
    resolved again: a flake changed in between, then rolled back, would
    otherwise leave the other tree's outputs under this tree's key, and
    every later attempt would report them."""
    src = git_source(trainer())
    flake = make_flake()
    directory = Path(flake.removeprefix("path:"))
    swap = tmp_path / "swap-once"
    swap.write_text(SWAPPED)
    # A nix that, right after the flake's first resolution, changes the flake.
    shim = Path(nix.program)
    shim.write_text(
        "#!/bin/sh\n"
        f'{nix.real} "$@"; rc=$?\n'
        f'case " $* " in *" flake metadata "*) [ -e {swap} ] && mv {swap} {directory / "extra.nix"};; esac\n'
        "exit $rc\n"
    )
    spec = cpu_spec(flake, state_dir, src.url)
    first = attempt(nix, spec)
    assert (directory / "extra.nix").exists(), "the flake was not changed between the two resolutions"
    (directory / "extra.nix").unlink()  # rolled back: the flake the key came from
    second = attempt(nix, spec)
    fresh = attempt(nix, replace(spec, refresh=True))
    assert first.libtorch is not None and "cpu-swapped" not in first.libtorch.path
    assert second.libtorch == fresh.libtorch and second.bin == fresh.bin
