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
import sys
import time
from pathlib import Path

import pytest
from nix_fixtures import NIX_CONFIG, nix_system, sandbox_paths

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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
    (directory / "recipe.json").write_text(json.dumps({"contract": 1, **recipe}))
    return [
        "--no-write-lock-file",
        *("--override-input", "source", prefetch(env, tree)),
        *("--override-input", "recipe", f"path:{directory}"),
    ]


def example_recipe() -> dict[str, object]:
    manifest = tomllib.loads((EXAMPLE / ".fdl-run.toml").read_text())
    return {"libtorch": "cpu", "cwd": manifest["cwd"], "build": manifest.get("build"), "bin": manifest["bin"]}


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
    libtorch, training = (entry["outputs"]["out"] for entry in json.loads(done.stdout))
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
    assert [e["outputs"]["out"] for e in json.loads(done.stdout)] == [
        built_example["libtorch"],
        built_example["training"],
    ]
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
    from nix_fixtures import manifest_text

    from prepare.fail import Fail
    from prepare.pipeline import prepare
    from prepare.spec import PrepareSpec, SourceSpec

    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    source = git_source(
        {"Cargo.toml": '[package]\nname = "trainer"\nversion = "0.1.0"\n', ".fdl-run.toml": manifest_text(bin="train")}
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
