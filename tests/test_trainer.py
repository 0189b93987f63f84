"""The training half for real: the example trainer (examples/trainer, a Rust
crate whose build.rs follows floDl's flodl-sys: LIBTORCH_PATH only, a C++17
shim, torch/torch_cpu/c10) built by the test flake the way the production
flake builds a floDl crate (no build line: `cargo build --release --offline`,
LIBTORCH_PATH a root made in the build directory, the RUNPATH at libtorch's
lib/ in the store), against the real libtorch from PyTorch's CPU wheel, with
the host's cargo and C++ compiler; then run from the store.

Also the cargo side of the contract that needs no libtorch: workspaces,
path dependencies, Cargo.lock where cargo keeps it, and the refusals.

Needs the wheel in the store (scripts/setup) or a way to fetch it; skips,
naming why, without. Debian's cargo (scripts/setup) builds the crates.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from nix_fixtures import NIX_CONFIG, nix_system, sandbox_paths

pytestmark = pytest.mark.nix

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "trainer"
FDL = f"legacyPackages.{nix_system()}.fdl"
FLAGS = ["--extra-experimental-features", "nix-command flakes", "--no-eval-cache"]
CARGO = "/usr/bin/cargo"
LOSS = re.compile(r"loss (\d+\.\d+) -> (\d+\.\d+)")


@pytest.fixture
def env(nix_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    registry = tmp_path / "registry.json"
    registry.write_text('{"flakes":[],"version":2}')
    return {**nix_env, "NIX_CONFIG": nix_env["NIX_CONFIG"] + f"\nflake-registry = {registry}\n"}


def nix(env: dict[str, str], *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nix", *FLAGS, *args], env=env, capture_output=True, text=True, timeout=timeout)


def prefetch(env: dict[str, str], tree: Path) -> str:
    done = nix(env, "flake", "prefetch", "--json", f"path:{tree}")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    return f"path:{found['storePath']}?narHash={found['hash']}"


def overrides(env: dict[str, str], tree: Path, directory: Path, **recipe: object) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "recipe.json").write_text(json.dumps({"contract": 2, **recipe}))
    return [
        "--no-write-lock-file",
        *("--override-input", "source", prefetch(env, tree)),
        *("--override-input", "recipe", f"path:{directory}"),
    ]


def example_recipe() -> dict[str, object]:
    from prepare.build import manifest as manifest_mod

    manifest = manifest_mod.read(str(EXAMPLE))
    assert manifest is not None
    return {"libtorch": "cpu", "cwd": manifest.cwd or ".", "build": manifest.build, "bin": manifest.bin}


def example_copy(dest: Path, nonce: str | None = None) -> Path:
    """The example trainer's source, without a target/ a local build left;
    a nonce file makes it a source the store has never built."""
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("target"))
    if nonce is not None:
        (dest / "NONCE").write_text(nonce + "\n")
    return dest


def build(env: dict[str, str], flake: str, tree: Path, tmp: Path, *extra: str, **recipe: object) -> dict[str, str]:
    done = nix(
        env,
        "build",
        "--json",
        "--no-link",
        *extra,
        f"{flake}#{FDL}.libtorch.cpu",
        f"{flake}#{FDL}.training",
        *overrides(env, tree, tmp / "recipe", **recipe),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # Nix orders the JSON by derivation path, not as asked.
    paths = [entry["outputs"]["out"] for entry in json.loads(done.stdout)]
    training = next(p for p in paths if "-fdl-test-training-" in p)
    libtorch = next(p for p in paths if p != training)
    # The headers' output, which the build used and the runtime must not hold.
    dev = nix(env, "eval", "--raw", "--no-write-lock-file", f"{flake}#{FDL}.libtorch.cpu.dev.outPath")
    assert dev.returncode == 0, dev.stderr
    return {"libtorch": libtorch, "dev": dev.stdout, "training": training}


def runpath(binary: str) -> list[str]:
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True, check=True).stdout
    found = re.search(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[([^\]]*)\]", dynamic)
    return found.group(1).split(":") if found else []


def smoke(binary: str, *, as_user: int | None = None) -> subprocess.CompletedProcess[str]:
    """`train --smoke` with an empty environment (no LD_LIBRARY_PATH, no
    HOME, no PATH), optionally as an unprivileged user, from /."""
    argv = [binary, "--smoke"]
    if as_user is not None:
        argv = [shutil.which("setpriv") or "setpriv", f"--reuid={as_user}", f"--regid={as_user}", "--clear-groups"]
        argv += [binary, "--smoke"]
    return subprocess.run(argv, env={}, cwd="/", capture_output=True, text=True, timeout=120)


_BUILT: dict[str, dict[str, str]] = {}


@pytest.fixture
def built_example(env, torch_flake, tmp_path) -> dict[str, str]:
    """The example trainer from the repository, built once per session."""
    if torch_flake not in _BUILT:
        _BUILT[torch_flake] = build(env, torch_flake, example_copy(tmp_path / "example"), tmp_path, **example_recipe())
    return _BUILT[torch_flake]


# --- the real build -------------------------------------------------------------------------


def test_a_crate_whose_build_rs_reads_only_libtorch_path_builds_and_its_smoke_step_trains(built_example):
    binary = f"{built_example['training']}/bin/train"

    ran = smoke(binary)

    assert ran.returncode == 0, ran.stderr
    before, after = map(float, LOSS.search(ran.stdout).groups())  # type: ignore[union-attr]
    assert after < before
    assert "one training step (forward, backward, SGD) with libtorch 2.13.0" in ran.stdout
    # Found through its RUNPATH alone: libtorch's lib/ in the store.
    assert runpath(binary) == [f"{built_example['libtorch']}/lib"]


def test_the_built_binary_runs_from_the_store_as_an_unprivileged_user_with_a_clean_environment(built_example):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run the binary as another user")

    ran = smoke(f"{built_example['training']}/bin/train", as_user=65534)

    assert ran.returncode == 0, ran.stderr
    assert LOSS.search(ran.stdout)


def test_the_training_closure_holds_libtorchs_libraries_and_not_its_headers(built_example):
    closure = subprocess.run(
        ["nix-store", "-qR", built_example["training"]],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "NIX_CONFIG": NIX_CONFIG},
    ).stdout.split()

    assert built_example["libtorch"] in closure
    assert built_example["dev"] and built_example["dev"] not in closure
    assert (
        Path(built_example["dev"]) / "include" / "torch" / "csrc" / "api" / "include" / "torch" / "torch.h"
    ).is_file()
    assert not any((Path(path) / "include" / "torch").exists() for path in closure)
    assert (Path(built_example["libtorch"]) / "lib" / "libtorch_cpu.so").is_file()


def test_the_example_trains_for_the_runs_epochs_on_the_dataset_root_when_given_and_on_synthetic_data_else(
    built_example, tmp_path
):
    root = tmp_path / "data"
    root.mkdir()
    rows = "\n".join(f"{i / 50:.3f},{(i % 7) / 7:.3f},{0.5 * i / 50 - (i % 7) / 14:.4f}" for i in range(200))
    (root / "train.csv").write_text("x1,x2,y\n" + rows + "\n")
    binary = f"{built_example['training']}/bin/train"

    on_data = subprocess.run([binary, "--epochs", "3", "--data", str(root)], env={}, capture_output=True, text=True)
    synthetic = subprocess.run([binary, "--epochs", "2"], env={}, capture_output=True, text=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    no_rows = subprocess.run([binary, "--data", str(empty)], env={}, capture_output=True, text=True)

    assert on_data.returncode == 0, on_data.stderr
    assert f"2 inputs, 3 epoch(s) on 200 rows from {root}" in on_data.stdout
    assert [int(m) for m in re.findall(r"epoch (\d+)/3", on_data.stdout)] == [1, 2, 3]
    assert synthetic.returncode == 0 and "2 epoch(s) on 1024 synthetic rows" in synthetic.stdout
    losses = [float(x) for x in re.findall(r", loss (\d+\.\d+)", synthetic.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert no_rows.returncode == 1 and "holds no *.csv file" in no_rows.stderr


def test_a_second_attempt_with_nothing_changed_builds_and_downloads_nothing(env, torch_flake, built_example, tmp_path):
    done = nix(
        env,
        "build",
        "--json",
        "--no-link",
        "--log-format",
        "internal-json",
        f"{torch_flake}#{FDL}.libtorch.cpu",
        f"{torch_flake}#{FDL}.training",
        *overrides(env, example_copy(tmp_path / "example"), tmp_path / "recipe", **example_recipe()),
    )

    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(e["outputs"]["out"] for e in json.loads(done.stdout)) == sorted(
        [built_example["libtorch"], built_example["training"]]
    )
    events = [json.loads(line[len("@nix ") :]) for line in done.stderr.splitlines() if line.startswith("@nix ")]
    assert [e for e in events if e.get("action") == "start" and e.get("type") in (101, 105)] == []


@pytest.mark.parametrize("sandbox", ["true", "false"])
def test_the_example_builds_with_the_hosts_cargo_with_the_sandbox_on_and_off(env, torch_flake, tmp_path, sandbox):
    # A source the store has never seen, so this really builds.
    tree = example_copy(tmp_path / "example", nonce=f"sandbox={sandbox} {time.time_ns()}")
    config = env["NIX_CONFIG"] + f"\nsandbox = {sandbox}\nsandbox-paths = {sandbox_paths()}\n"

    built = build({**env, "NIX_CONFIG": config}, torch_flake, tree, tmp_path, **example_recipe())
    ran = smoke(f"{built['training']}/bin/train")

    assert ran.returncode == 0, ran.stderr
    assert LOSS.search(ran.stdout)


# --- cargo without libtorch -----------------------------------------------------------------


def require_cargo() -> None:
    if not os.access(CARGO, os.X_OK):
        pytest.skip(f"{CARGO} is not installed (scripts/setup installs Debian's cargo)")


def path_dependent_workspace(root: Path, *, lock: bool = True) -> Path:
    """floDl's shape: a member crate with a `../` path dependency, its
    version from the workspace root, Cargo.lock at that root."""
    (root / "app" / "src").mkdir(parents=True)
    (root / "util" / "src").mkdir(parents=True)
    (root / "Cargo.toml").write_text('[workspace]\nmembers = ["app", "util"]\n[workspace.package]\nversion = "0.2.0"\n')
    (root / "app" / "Cargo.toml").write_text(
        '[package]\nname = "app"\nversion.workspace = true\nedition = "2021"\n'
        '[dependencies]\nutil = { path = "../util" }\n'
    )
    (root / "app" / "src" / "main.rs").write_text('fn main() { println!("app says {}", util::word()); }\n')
    (root / "util" / "Cargo.toml").write_text('[package]\nname = "util"\nversion = "0.1.0"\nedition = "2021"\n')
    (root / "util" / "src" / "lib.rs").write_text('pub fn word() -> &\'static str { "hello from ../util" }\n')
    if lock:
        subprocess.run(
            [CARGO, "generate-lockfile", "--offline"],
            cwd=root,
            env={"PATH": "/usr/bin:/bin", "CARGO_HOME": str(root.parent / "cargo-home")},
            check=True,
            capture_output=True,
        )
    return root


def test_a_workspace_member_with_a_path_dependency_builds_from_the_whole_tree(env, test_flake, tmp_path):
    require_cargo()
    tree = path_dependent_workspace(tmp_path / "source")

    done = nix(
        env,
        "build",
        "--json",
        "--no-link",
        f"{test_flake}#{FDL}.training",
        *overrides(env, tree, tmp_path / "recipe", libtorch=None, cwd="app", build=None, bin="app"),
    )

    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)[0]["outputs"]["out"]
    ran = subprocess.run([f"{out}/bin/app"], env={}, capture_output=True, text=True)
    assert ran.stdout == "app says hello from ../util\n"


def test_a_workspace_members_floDl_bin_climbs_to_the_workspace_target_from_its_cwd(env, test_flake, tmp_path):
    # floDl's publish writes `bin` relative to `cwd`; a member's build lands
    # in the WORKSPACE target/, so the member names it `../target/release/app`.
    require_cargo()
    tree = path_dependent_workspace(tmp_path / "source")

    done = nix(
        env,
        "build",
        "--json",
        "--no-link",
        f"{test_flake}#{FDL}.training",
        *overrides(env, tree, tmp_path / "recipe", libtorch=None, cwd="app", build=None, bin="../target/release/app"),
    )

    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)[0]["outputs"]["out"]
    ran = subprocess.run([f"{out}/bin/app"], env={}, capture_output=True, text=True)
    assert ran.stdout == "app says hello from ../util\n"


def test_a_lone_crate_in_a_subdirectory_finds_its_bin_in_its_own_target(env, test_flake, tmp_path):
    # No workspace above it: cargo's target/ is the crate's own, <cwd>/target.
    require_cargo()
    tree = tmp_path / "source"
    (tree / "lone" / "src").mkdir(parents=True)
    (tree / "lone" / "Cargo.toml").write_text('[package]\nname = "lone"\nversion = "0.1.0"\nedition = "2021"\n')
    (tree / "lone" / "src" / "main.rs").write_text('fn main() { println!("lone"); }\n')
    subprocess.run(
        [CARGO, "generate-lockfile", "--offline"],
        cwd=tree / "lone",
        env={"PATH": "/usr/bin:/bin", "CARGO_HOME": str(tmp_path / "cargo-home")},
        check=True,
        capture_output=True,
    )

    done = nix(
        env,
        "build",
        "--json",
        "--no-link",
        f"{test_flake}#{FDL}.training",
        *overrides(env, tree, tmp_path / "recipe", libtorch=None, cwd="lone", build=None, bin="target/release/lone"),
    )

    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)[0]["outputs"]["out"]
    assert subprocess.run([f"{out}/bin/lone"], env={}, capture_output=True, text=True).stdout == "lone\n"


def test_floDls_published_build_line_and_bin_build_the_example_against_the_real_libtorch(env, torch_flake, tmp_path):
    # The line `fdl publish` derives and the `bin` it writes, as written:
    # the feature is the variant's (empty for cpu, which cargo takes), the
    # binary where cargo leaves it relative to cwd, no --target triple.
    line = 'cargo build --release --features "$FDL_GPU_FEATURE" --bin train'

    built = build(
        env,
        torch_flake,
        example_copy(tmp_path / "example", nonce="floDl-line"),
        tmp_path,
        libtorch="cpu",
        cwd=".",
        build=line,
        bin="target/release/train",
    )

    ran = smoke(f"{built['training']}/bin/train")
    assert ran.returncode == 0, ran.stderr
    assert runpath(f"{built['training']}/bin/train") == [f"{built['libtorch']}/lib"]


def test_a_source_without_cargo_lock_is_refused_at_evaluation_saying_to_commit_it(env, test_flake, tmp_path):
    require_cargo()
    tree = path_dependent_workspace(tmp_path / "source", lock=False)

    done = nix(
        env,
        "build",
        "--no-link",
        f"{test_flake}#{FDL}.training",
        *overrides(env, tree, tmp_path / "recipe", libtorch="cpu", cwd="app", build=None, bin="app"),
    )

    assert done.returncode != 0
    assert 'fdl-prepare flake: the training source has no Cargo.lock in `cwd` = "app"' in done.stderr
    assert "commit Cargo.lock" in done.stderr and "cargo generate-lockfile" in done.stderr
    assert "building '" not in done.stderr


def test_a_cuda_build_sees_cuda_home_with_lib64_and_the_cuda_feature(env, test_flake, tmp_path):
    # The test flake's CUDA variants are stand-ins; this is the shared
    # nix/training-env.nix making CUDA_HOME for real, seen from a build line.
    tree = tmp_path / "source"
    tree.mkdir()
    line = (
        'test -f "$CUDA_HOME/lib64/libcudart.so" && test -f "$CUDA_HOME/include/cuda_runtime.h" '
        '&& test -d "$LIBTORCH_PATH/lib" && test -d "$LIBTORCH_PATH/include" '
        '&& printf "%s %s %s\\n" "$FDL_GPU_FEATURE" "$FDL_CUDA_VERSION" "$NIX_LDFLAGS" > train'
    )

    done = nix(
        env,
        "build",
        "--json",
        "--no-link",
        f"{test_flake}#{FDL}.training",
        *overrides(env, tree, tmp_path / "recipe", libtorch="cu128", build=line, bin="train"),
    )

    assert done.returncode == 0, done.stderr[-3000:]
    feature, version, *ldflags = Path(json.loads(done.stdout)[0]["outputs"]["out"], "bin", "train").read_text().split()
    assert (feature, version) == ("cuda", "12.8")
    rpath = ldflags[1::2]
    assert ldflags[0::2] == ["-rpath"] * len(rpath)
    assert rpath[0].endswith("-fdl-test-libtorch-cuda/lib") and rpath[-1] == "/run/opengl-driver/lib"
    assert any(p.endswith("-fdl-test-cuda-12.8/lib") for p in rpath)
    assert any(p.endswith("-fdl-test-cuda-12.8/nccl/lib") for p in rpath)


def test_a_source_without_cargo_lock_is_transient_the_sources_reason_before_anything_is_evaluated(
    nix_env, test_flake, state_dir, git_source, monkeypatch, tmp_path
):
    from nix_fixtures import MANIFEST, manifest_text

    from prepare.fail import Fail
    from prepare.pipeline import prepare
    from prepare.spec import PrepareSpec, SourceSpec

    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    source = git_source(
        {"Cargo.toml": '[package]\nname = "trainer"\nversion = "0.1.0"\n', MANIFEST: manifest_text(bin="train")}
    )
    spec = PrepareSpec(
        source=SourceSpec(from_=source.url), flake=test_flake, state_dir=state_dir, libtorch="cpu", cpu_only=True
    )

    with pytest.raises(Fail) as failed:
        prepare(spec, [])

    # The publisher's to fix, by the next publish: not the flake's.
    assert failed.value.reason == "source.no-cargo-lock" and not failed.value.permanent
    assert "and no Cargo.lock there or in any directory above it" in failed.value.message
    assert "The publisher commits Cargo.lock" in failed.value.message


def test_a_source_whose_cargo_lock_has_a_git_dependency_is_transient_the_sources_reason_naming_the_crate(
    nix_env, test_flake, state_dir, git_source, monkeypatch, tmp_path
):
    from nix_fixtures import MANIFEST, manifest_text

    from prepare.fail import Fail
    from prepare.pipeline import prepare
    from prepare.spec import PrepareSpec, SourceSpec

    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    lock = (
        "version = 3\n\n"
        '[[package]]\nname = "trainer"\nversion = "0.1.0"\ndependencies = ["tch-fork"]\n\n'
        '[[package]]\nname = "tch-fork"\nversion = "0.9.0"\n'
        'source = "git+https://deploy:s3cr3t-token@git.example/tch.git?branch=main#0123456789abcdef"\n'
    )
    source = git_source(
        {
            "Cargo.toml": '[package]\nname = "trainer"\nversion = "0.1.0"\n',
            "Cargo.lock": lock,
            MANIFEST: manifest_text(bin="train"),
        }
    )
    spec = PrepareSpec(
        source=SourceSpec(from_=source.url), flake=test_flake, state_dir=state_dir, libtorch="cpu", cpu_only=True
    )
    events: list[dict] = []

    with pytest.raises(Fail) as failed:
        prepare(spec, [], progress=events.append)

    # The publisher's to fix, by the next publish, found before evaluation.
    assert failed.value.reason == "source.git-dependency" and not failed.value.permanent
    assert "tch-fork 0.9.0 (git+https://git.example/tch.git?branch=main#0123456789abcdef)" in failed.value.message
    assert "s3cr3t" not in failed.value.message and "deploy" not in failed.value.message
    assert not [e for e in events if e.get("event") == "build-start"]


# --- the CUDA build -------------------------------------------------------------------------


def needed(binary: str) -> list[str]:
    dynamic = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)


_BUILT_CUDA: dict[str, dict[str, str]] = {}


@pytest.fixture
def built_cuda_example(env, torch_flake, tmp_path) -> dict[str, str]:
    """The example trainer with its `cuda` feature, built by the test flake
    exactly as the production flake builds a floDl crate for a CUDA variant:
    against the cu128 libtorch from PyTorch's wheels (nix/libtorch-wheel.nix),
    CUDA_HOME its `cuda` output. Built once per session."""
    from nix_fixtures import require_cuda_wheels

    require_cuda_wheels()
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    if torch_flake not in _BUILT_CUDA:
        tree = example_copy(tmp_path / "example")
        recipe = {**example_recipe(), "libtorch": "cu128"}
        done = nix(
            env,
            "build",
            "--json",
            "--no-link",
            f"{torch_flake}#{FDL}.libtorch.cu128",
            f"{torch_flake}#{FDL}.training",
            *overrides(env, tree, tmp_path / "recipe", **recipe),
            timeout=3600,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        outputs = [entry["outputs"] for entry in json.loads(done.stdout)]
        training = next(o["out"] for o in outputs if "-fdl-test-training-" in o["out"])
        libtorch = next(o for o in outputs if o["out"] != training)
        # Only `out` is built by name; the other outputs from the evaluation.
        more = nix(
            env,
            "eval",
            "--json",
            "--no-write-lock-file",
            f"{torch_flake}#{FDL}.libtorch.cu128",
            "--apply",
            "d: { dev = d.dev.outPath; cuda = d.cuda.outPath; }",
        )
        assert more.returncode == 0, more.stderr
        _BUILT_CUDA[torch_flake] = {**libtorch, **json.loads(more.stdout), "training": training}
    return _BUILT_CUDA[torch_flake]


def test_a_cuda_build_links_torch_cuda_cudart_and_nccl_and_trains_on_the_cpu_saying_cuda_is_unavailable(
    built_cuda_example,
):
    binary = f"{built_cuda_example['training']}/bin/train"
    out = built_cuda_example["out"]

    ran = smoke(binary)

    assert ran.returncode == 0, ran.stderr
    # No driver here: CUDA is simply unavailable, and the step runs on the
    # CPU. scripts/gpu-check runs this test on a GPU box, where the binary
    # must see the cards through the driver directory instead.
    seen = "\\d+ CUDA device\\(s\\)" if os.environ.get("FDL_GPU_CHECK") == "1" else "CUDA unavailable"
    assert re.search(rf"CUDA runtime 12\.8, NCCL \d+, {seen}", ran.stdout), ran.stdout
    before, after = map(float, LOSS.search(ran.stdout).groups())  # type: ignore[union-attr]
    assert after < before and "with libtorch 2.10.0" in ran.stdout
    # What flodl-sys links under `cuda`, each found through the RUNPATH alone,
    # which ends at the driver directory (libcuda.so.1, libnvidia-ml.so.1).
    assert {"libtorch_cuda.so", "libc10_cuda.so", "libcudart.so.12", "libnccl.so.2"} <= set(needed(binary))
    assert runpath(binary) == [
        f"{out}/lib",
        f"{out}/nvidia/cuda_runtime/lib",
        f"{out}/nvidia/nccl/lib",
        "/run/opengl-driver/lib",
    ]


def test_the_cuda_libtorch_is_flodl_shaped_its_archs_read_from_the_wheel_and_its_libraries_reach_the_driver(
    built_cuda_example,
):
    out, dev, cuda = (Path(built_cuda_example[k]) for k in ("out", "dev", "cuda"))

    assert (out / "build-version").read_text() == "2.10.0+cu128\n"
    # floDl's .arch, the archs the build read from libtorch_cuda.so's
    # fatbinary and checked against nix/wheels.nix.
    assert (out / ".arch").read_text() == (
        "cuda=12.8\ntorch=2.10.0\narchs=7.0 7.5 8.0 8.6 9.0 10.0 12.0\nsource=precompiled\nvariant=cu128\n"
    )
    # CUDA_HOME: every header floDl's shim includes, in one include/.
    for header in ("cuda_runtime.h", "nccl.h", "cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h"):
        assert (cuda / "include" / header).is_file(), header
    assert (cuda / "include" / "crt" / "host_config.h").is_file()
    assert (dev / "include" / "ATen" / "cuda" / "CUDAGraph.h").is_file()
    # lib64/: link names and sonames, pointing into `out`.
    for name in ("libcudart.so", "libcudart.so.12", "libnccl.so", "libnccl.so.2"):
        assert os.path.realpath(cuda / "lib64" / name).startswith(f"{out}/nvidia/"), name
    # The CUDA libraries dlopen libcuda.so.1 through their own RPATH.
    for library in (out / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12", out / "lib" / "libc10_cuda.so"):
        assert "/run/opengl-driver/lib" in runpath(str(library))
    assert "$ORIGIN/../nvidia/cublas/lib" in runpath(str(out / "lib" / "libtorch_cuda.so"))


def test_the_cuda_training_closure_holds_the_libraries_and_neither_headers_nor_cuda_home(built_cuda_example):
    closure = subprocess.run(
        ["nix-store", "-qR", built_cuda_example["training"]],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "NIX_CONFIG": NIX_CONFIG},
    ).stdout.split()

    assert built_cuda_example["out"] in closure
    assert built_cuda_example["dev"] not in closure and built_cuda_example["cuda"] not in closure


def test_the_archs_are_read_from_the_kernels_libtorch_cuda_carries_and_a_declaration_that_differs_fails(
    built_cuda_example, capsys
):
    import importlib.util

    spec = importlib.util.spec_from_file_location("libtorch_wheel", REPO / "nix" / "libtorch-wheel.py")
    assert spec is not None and spec.loader is not None
    wheel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheel)
    library = f"{built_cuda_example['out']}/lib/libtorch_cuda.so"
    shipped = ["7.0", "7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]

    assert wheel.check_archs(library, shipped) == shipped
    # What 2.7's CUDA 12.8 build had: no Volta. The build stops, naming both.
    with pytest.raises(SystemExit) as stopped:
        wheel.check_archs(library, shipped[1:])

    assert stopped.value.code == 1
    said = capsys.readouterr().err
    assert "libtorch_cuda.so carries kernels for 7.0 7.5 8.0 8.6 9.0 10.0 12.0" in said
    assert "nix/wheels.nix declares 7.5 8.0 8.6 9.0 10.0 12.0 for it" in said
