"""The smoke run of the built binary: once, with a timeout, before prepare
succeeds. A program that, like a Nix-built one, looks for libcuda.so.1 only
in the driver directory (tests/driver_fixtures.py) passes when the driver
directory holds it and fails, permanently and with the loader's words, when
it does not; a timeout and any other failure are transient. Through the
pipeline, the example trainer (a Rust crate over the real libtorch) takes
one training step from its run manifest's smoke run, and the same crate
linked without a RUNPATH to libtorch fails it permanently."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from driver_fixtures import smoke_binary
from nix_fixtures import manifest_text
from nvml_fixtures import ampere_pair

from prepare import smoke
from prepare.fail import Fail
from prepare.pipeline import prepare
from prepare.spec import Binary, PrepareSpec, SourceSpec

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "trainer"


def script(path: Path, body: str) -> Binary:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return Binary(path=str(path), cwd=str(path.parent))


def fail_of(binary: Binary, args: list[str], timeout: float = 30) -> Fail:
    with pytest.raises(Fail) as failed:
        smoke.run(binary, args, timeout, [])
    return failed.value


# -- a program built like a Nix one --------------------------------------------------------


def test_a_binary_that_finds_libcuda_in_the_driver_directory_passes(driver_libraries, tmp_path):
    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "libcuda.so.1").symlink_to(driver_libraries.build / "libcuda.so.1")
    train = smoke_binary(driver_libraries, driver, tmp_path / "bin" / "train")
    notes: list[str] = []
    smoke.run(Binary(str(train), str(tmp_path)), [], 30, notes)
    assert len(notes) == 1 and notes[0].startswith(f"smoke run `{train}` (in {tmp_path}) passed in ")


def test_a_binary_whose_libcuda_is_not_in_the_driver_directory_fails_permanently_with_the_loaders_words(
    driver_libraries, tmp_path
):
    driver = tmp_path / "driver"
    driver.mkdir()
    train = smoke_binary(driver_libraries, driver, tmp_path / "bin" / "train")
    fail = fail_of(Binary(str(train), str(tmp_path)), ["--smoke"])
    assert fail.permanent and fail.reason == "smoke.loader"
    message = fail.message
    assert message.startswith(f"smoke run `{train} --smoke` (in {tmp_path}): the loader could not start it (exit 127)")
    assert "error while loading shared libraries: libcuda.so.1: cannot open shared object file" in message
    assert "driver_dir" in message and "/run/opengl-driver/lib" in message


def test_the_driver_directory_kept_by_the_gate_is_where_the_binary_finds_the_hosts_driver(driver_host, tmp_path):
    """The whole chain: the host's libcuda, registered with its linker cache,
    linked into the driver directory by the step, loaded from there by a
    binary that never reads the cache; gone from the host, the box stops
    at the gate, and the binary no longer starts."""
    driver_host.install("570.86.15")
    driver = driver_host.root / "driver"
    train = driver_host.smoke_binary(driver)
    binary = Binary(str(train), str(driver_host.root))
    assert "links" in driver_host.ensure(driver)
    smoke.run(binary, [], 30, [])

    driver_host.remove("cuda")
    assert driver_host.ensure(driver)["fail"]["reason"] == "gpu.no-driver"
    fail = fail_of(binary, [])
    assert fail.reason == "smoke.loader" and "libcuda.so.1" in fail.message


# -- kinds ------------------------------------------------------------------------------------


def test_a_smoke_run_past_its_timeout_is_transient_with_its_last_lines(tmp_path):
    binary = script(tmp_path / "train", "echo 'initialising CUDA' >&2\nexec sleep 30\n")
    fail = fail_of(binary, ["--smoke"], timeout=0.5)
    assert not fail.permanent and fail.reason == "smoke.timeout"
    assert "did not finish within 0.5s" in fail.message and "initialising CUDA" in fail.message
    assert "smoke_timeout (--smoke-timeout)" in fail.message


def test_a_binary_that_starts_and_fails_is_transient_with_the_last_lines_of_its_output(tmp_path):
    lines = "".join(f"echo 'line {i}'\n" for i in range(40))
    binary = script(tmp_path / "train", lines + "echo 'CUDA error: no kernel image is available' >&2\nexit 1\n")
    fail = fail_of(binary, ["--smoke"])
    assert not fail.permanent and fail.reason == "smoke.failed"
    assert "exited 1" in fail.message and "CUDA error: no kernel image is available" in fail.message
    assert "line 39" in fail.message and "line 20" not in fail.message
    assert "publish again" in fail.message


def test_a_binary_that_is_not_there_is_permanent(tmp_path):
    fail = fail_of(Binary(str(tmp_path / "no-such-train"), str(tmp_path)), [])
    assert fail.permanent and fail.reason == "smoke.loader"
    assert str(tmp_path / "no-such-train") in fail.message


def test_the_binary_runs_in_its_cwd_with_the_arguments_given(tmp_path):
    binary = script(tmp_path / "train", '[ "$(pwd)" = "$1" ] && [ "$2" = "two words" ]\n')
    smoke.run(binary, [str(tmp_path), "two words"], 30, [])


# -- through the pipeline ----------------------------------------------------------------------


@pytest.fixture
def shared_stage() -> Iterator[Path]:
    """A stage the Nix build users can enter (see test_end_to_end)."""
    stage = Path(tempfile.mkdtemp(prefix="fdl-smoke-stage-", dir="/tmp"))
    stage.chmod(0o1777)
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def example_files() -> dict[str, str | None]:
    """The example trainer's source as published: every tracked file of it."""
    files: dict[str, str | None] = {}
    for path in sorted(EXAMPLE.rglob("*")):
        rel = path.relative_to(EXAMPLE)
        if path.is_file() and "target" not in rel.parts:
            files[str(rel)] = path.read_text()
    return files


@pytest.fixture
def example_source(git_source):
    """The example trainer (a Rust crate over the real libtorch) as a
    published source, its manifest as shipped: it asks for `--smoke`."""
    return git_source(example_files())


# A training source the test flake builds with /bin/sh, whose `train
# --smoke` loads what a CUDA binary links the way the loader would: from the
# driver directory, the one place a Nix-built program looks for
# libcuda.so.1 (nixpkgs' addDriverRunpath). A missing one is reported in the
# loader's words, so fdl-prepare's smoke run reads it as a real binary's.
DRIVER_PROBE = r"""
cat > train <<'SCRIPT'
#!/bin/sh
if [ "${1:-}" = --smoke ]; then
    [ -e /run/opengl-driver/lib/libcuda.so.1 ] || {
        echo "$0: error while loading shared libraries: libcuda.so.1: cannot open shared object file: No such file or directory" >&2
        exit 127
    }
fi
echo "driver probe: libcuda.so.1 loads"
SCRIPT
chmod +x train
"""


@pytest.fixture
def driver_probe_source(git_source):
    return git_source(
        {
            "build.sh": DRIVER_PROBE,
            ".fdl-run.toml": manifest_text(bin="train", build="/bin/sh build.sh", smoke=["--smoke"]),
        }
    )


@pytest.fixture
def box(monkeypatch, tmp_path, shared_stage) -> None:
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(shared_stage))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _spec(test_flake: str, state_dir: str, url: str, **kw: object) -> PrepareSpec:
    source = SourceSpec(from_=url, smoke=kw.pop("smoke", None))  # type: ignore[arg-type]
    return PrepareSpec(source=source, flake=test_flake, state_dir=state_dir, **kw)  # type: ignore[arg-type]


@pytest.mark.nix
def test_the_example_trainers_smoke_run_takes_a_training_step_before_prepare_succeeds(
    nix_env, torch_flake, state_dir, example_source, box
):
    notes: list[str] = []
    done = prepare(_spec(torch_flake, state_dir, example_source.url, libtorch="cpu", cpu_only=True), notes)
    assert done.bin is not None
    assert list(done.timings)[-2:] == ["build", "smoke"]
    passed = [n for n in notes if n.startswith(f"smoke run `{done.bin.path} --smoke`") and " passed in " in n]
    assert len(passed) == 1, notes
    # The step's own last line: forward, backward and SGD through libtorch.
    before, after = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", passed[0]).groups())  # type: ignore[union-attr]
    assert after < before and "one training step (forward, backward, SGD)" in passed[0]


@pytest.mark.nix
def test_a_binary_whose_libtorch_is_out_of_its_reach_fails_the_smoke_run_permanently_with_the_loaders_words(
    nix_env, torch_flake, state_dir, git_source, box
):
    # Built as a merged root in the build directory leaves it: linked against
    # libtorch there, with no RUNPATH to the store's (no NIX_LDFLAGS).
    files = example_files()
    files[".fdl-run.toml"] = manifest_text(
        bin="target/release/train",
        build="NIX_LDFLAGS= /usr/bin/cargo build --release --offline",
        smoke=["--smoke"],
    )
    source = git_source(files)
    with pytest.raises(Fail) as failed:
        prepare(_spec(torch_flake, state_dir, source.url, libtorch="cpu", cpu_only=True), [])
    fail = failed.value
    assert fail.permanent and fail.reason == "smoke.loader"
    assert "error while loading shared libraries: libtorch_cpu.so: cannot open shared object file" in fail.message
    assert "the loader could not start it" in fail.message


@pytest.mark.nix
def test_a_cuda_build_on_a_box_without_the_driver_directory_stops_at_the_smoke_run(
    nix_env, test_flake, state_dir, driver_probe_source, box, nvml_box
):
    if os.path.exists("/run/opengl-driver/lib/libcuda.so.1"):
        pytest.skip("this machine has a driver directory holding libcuda.so.1")
    nvml_box(ampere_pair())
    with pytest.raises(Fail) as failed:
        prepare(_spec(test_flake, state_dir, driver_probe_source.url, libtorch="cu128"), [])
    fail = failed.value
    assert fail.permanent and fail.reason == "smoke.loader"
    assert "libcuda.so.1: cannot open shared object file" in fail.message
    assert "driver directory" in fail.message


@pytest.mark.nix
def test_the_manifests_smoke_outranks_the_boxs_and_an_empty_one_runs_nothing(
    nix_env, test_flake, state_dir, git_source, box
):
    build = (
        'printf \'#!/bin/sh\\n[ "$1" = --ok ] || { echo "bad smoke: $*" >&2; exit 4; }\\n\' > train && chmod +x train'
    )
    published = git_source({".fdl-run.toml": manifest_text(bin="train", build=build, smoke=["--ok"])})
    spec = _spec(test_flake, state_dir, published.url, libtorch="cpu", cpu_only=True, smoke=("--wrong",))
    notes: list[str] = []
    prepare(spec, notes)
    assert any(n.startswith("smoke run ") and "--ok` " in n for n in notes), notes

    unpublished = git_source({".fdl-run.toml": manifest_text(bin="train", build=build)})
    with pytest.raises(Fail) as failed:
        prepare(_spec(test_flake, state_dir, unpublished.url, libtorch="cpu", cpu_only=True, smoke=("--wrong",)), [])
    assert failed.value.reason == "smoke.failed" and "bad smoke: --wrong" in failed.value.message

    silenced = git_source({".fdl-run.toml": manifest_text(bin="train", build=build, smoke=[])})
    notes = []
    done = prepare(_spec(test_flake, state_dir, silenced.url, libtorch="cpu", cpu_only=True, smoke=("--wrong",)), notes)
    assert "smoke" not in done.timings and not any(n.startswith("smoke run") for n in notes)


# -- the recipe ---------------------------------------------------------------------------


def test_a_manifests_smoke_is_a_list_of_strings_and_a_bad_one_waits_for_the_next_publish():
    from prepare import manifest

    assert manifest.parse('bin = "train"\nsmoke = ["--smoke", "--steps", "1"]\n').smoke == ("--smoke", "--steps", "1")
    with pytest.raises(Fail) as failed:
        manifest.parse('bin = "train"\nsmoke = "--smoke"\n')
    assert not failed.value.permanent and failed.value.reason == "source.manifest-invalid"
    assert "smoke" in failed.value.message


def test_the_recipe_takes_the_manifests_smoke_else_the_boxs():
    from prepare import manifest

    box = SourceSpec(from_="path:/x", bin="train", smoke=("--box",))
    assert manifest.merge(box, manifest.parse("smoke = []\n"), "path:/x").smoke == ()
    assert manifest.merge(box, manifest.parse('smoke = ["--run"]\n'), "path:/x").smoke == ("--run",)
    assert manifest.merge(box, manifest.parse('bin = "train"\n'), "path:/x").smoke == ("--box",)
    assert manifest.merge(box, None, "path:/x").smoke == ("--box",)
    # Not part of the build: the flake gets the same recipe either way.
    with_smoke = manifest.merge(box, None, "path:/x").flake_input("cpu", 1)
    without = manifest.merge(SourceSpec(from_="path:/x", bin="train"), None, "path:/x").flake_input("cpu", 1)
    assert with_smoke == without
