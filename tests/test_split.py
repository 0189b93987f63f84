"""The training build in two derivations (nix/cargo-split.nix): the
dependencies, keyed by what they depend on, and the run's own crates on
their target/.

What is keyed by what is asked of Nix at evaluation (the derivation paths,
nothing built), with the stand-in flake; that a re-dial after a one-line
change compiles only the run's crate is a real build: a crate on registry
crates, one of which compiles a C++ shim against the real libtorch as
floDl's flodl-sys does (tests/redial_fixtures.py); the GC roots go through
the runner.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import redial_fixtures
from nix_fixtures import NIX_CONFIG, manifest_text, nix_system, trainer
from test_build import run, spec

pytestmark = pytest.mark.nix

FDL = f"legacyPackages.{nix_system()}.fdl"
FLAGS = ["--extra-experimental-features", "nix-command flakes", "--no-eval-cache"]


@pytest.fixture
def env(nix_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    registry = tmp_path / "registry.json"
    registry.write_text('{"flakes":[],"version":2}')
    return {**nix_env, "NIX_CONFIG": nix_env["NIX_CONFIG"] + f"\nflake-registry = {registry}\n"}


def nix(env: dict[str, str], *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nix", *FLAGS, *args], env=env, capture_output=True, text=True, timeout=timeout)


def overrides(env: dict[str, str], tree: Path, recipe_dir: Path, **recipe: object) -> list[str]:
    done = nix(env, "flake", "prefetch", "--json", f"path:{tree}")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    recipe_dir.mkdir(parents=True, exist_ok=True)
    (recipe_dir / "recipe.json").write_text(json.dumps({"contract": 2, "libtorch": "cpu", **recipe}))
    return [
        "--no-write-lock-file",
        *("--override-input", "source", f"path:{found['storePath']}?narHash={found['hash']}"),
        *("--override-input", "recipe", f"path:{recipe_dir}"),
    ]


def drvs(env: dict[str, str], flake: str, tree: Path, tmp: Path, **recipe: object) -> dict[str, str]:
    """The derivation paths of `training` and `trainingDeps`, evaluated,
    nothing built."""
    recipe = {"bin": "target/release/small", "build": None, **recipe}
    done = nix(
        env,
        "eval",
        "--json",
        f"{flake}#{FDL}",
        "--apply",
        "f: { training = f.training.drvPath; deps = f.trainingDeps.drvPath; }",
        *overrides(env, tree, tmp / "recipe", **recipe),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert isinstance(got, dict)
    return got


CARGO_TOML = '[package]\nname = "small"\nversion = "0.1.0"\nedition = "2021"\n'
CARGO_LOCK = '# generated\nversion = 3\n\n[[package]]\nname = "small"\nversion = "0.1.0"\n'


def small_crate(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "Cargo.toml").write_text(CARGO_TOML)
    (root / "Cargo.lock").write_text(CARGO_LOCK)
    (root / "src" / "main.rs").write_text('fn main() {\n    println!("v1");\n}\n')
    (root / "build.rs").write_text("fn main() {}\n")
    (root / "README").write_text("a crate\n")
    return root


# --- what the dependency derivation is keyed by ---------------------------------------------------


def test_a_one_line_change_in_the_runs_crate_leaves_the_dependency_derivation_as_it_was(env, test_flake, tmp_path):
    tree = small_crate(tmp_path / "source")
    before = drvs(env, test_flake, tree, tmp_path)

    (tree / "src" / "main.rs").write_text('fn main() {\n    println!("v2");\n}\n')
    changed = drvs(env, test_flake, tree, tmp_path)
    # Neither do a new module, the build script, a README or the run manifest.
    (tree / "src" / "model.rs").write_text("pub fn layer() {}\n")
    (tree / "build.rs").write_text('fn main() { println!("cargo:rerun-if-changed=build.rs"); }\n')
    (tree / "README").write_text("a crate, described\n")
    (tree / ".fdl-run.yml").write_text(manifest_text(bin="target/release/small"))
    more = drvs(env, test_flake, tree, tmp_path)

    assert changed["deps"] == before["deps"] == more["deps"]
    assert len({before["training"], changed["training"], more["training"]}) == 3
    assert before["deps"].endswith("-fdl-test-training-deps-cpu.drv")


def test_a_change_to_cargo_lock_the_manifests_or_the_build_line_makes_new_dependencies(env, test_flake, tmp_path):
    tree = small_crate(tmp_path / "source")
    seen = [drvs(env, test_flake, tree, tmp_path)["deps"]]

    (tree / "Cargo.lock").write_text(CARGO_LOCK.replace("# generated\n", "# regenerated\n"))
    seen.append(drvs(env, test_flake, tree, tmp_path)["deps"])
    (tree / "Cargo.toml").write_text(CARGO_TOML + "[features]\nfast = []\n")
    seen.append(drvs(env, test_flake, tree, tmp_path)["deps"])
    seen.append(drvs(env, test_flake, tree, tmp_path, build="cargo build --release --features fast")["deps"])
    # A crate that appears (a new target of the run's) is stubbed too.
    (tree / "src" / "bin").mkdir()
    (tree / "src" / "bin" / "eval.rs").write_text("fn main() {}\n")
    seen.append(drvs(env, test_flake, tree, tmp_path)["deps"])

    assert len(set(seen)) == len(seen), seen


def test_a_source_without_cargo_lock_is_built_in_one_derivation(env, test_flake, tmp_path):
    tree = tmp_path / "source"
    tree.mkdir()
    (tree / "README").write_text("built by its own line\n")

    got = drvs(env, test_flake, tree, tmp_path, bin="train", build="printf x > train")

    assert got["deps"] == got["training"]


# --- the real build: a re-dial after a one-line change ---------------------------------------------


def build_log(env: dict[str, str], flake: str, tree: Path, tmp: Path) -> tuple[dict[str, dict], list[str]]:
    """Builds training and trainingDeps; returns the results by store name
    and the derivations Nix built (its internal-json log, actBuild)."""
    done = nix(
        env,
        "build",
        "--json",
        "--no-link",
        "--log-format",
        "internal-json",
        f"{flake}#{FDL}.training",
        f"{flake}#{FDL}.trainingDeps",
        *overrides(env, tree, tmp / "recipe", bin="target/release/redial", build=None),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = {r["drvPath"].split("-", 1)[1]: r for r in json.loads(done.stdout)}
    built = []
    for line in done.stderr.splitlines():
        if line.startswith("@nix "):
            record = json.loads(line[5:])
            if record.get("action") == "start" and record.get("type") == 105:
                built.append(record["fields"][0])
    return results, built


def test_a_redial_after_a_one_line_change_reuses_the_dependencies_and_compiles_only_the_crate(
    env, torch_flake, tmp_path
):
    why = redial_fixtures.missing()
    if why:
        pytest.skip(why)
    tree = redial_fixtures.make_source(tmp_path / "source")
    first, _ = build_log(env, torch_flake, tree, tmp_path)

    # A number no earlier run used: the crate's derivation is new.
    n = 10 + time.time_ns() % 1_000_000
    redial_fixtures.one_line_change(tree, n)
    second, built = build_log(env, torch_flake, tree, tmp_path)

    deps = "fdl-test-training-deps-cpu.drv"
    training = "fdl-test-training-cpu.drv"
    # The same dependency derivation, not built again; only the crate's.
    # (Nix 2.26 and later add when a result was built: not compared.)
    same = ("drvPath", "outputs")
    assert {k: second[deps][k] for k in same} == {k: first[deps][k] for k in same}
    assert built == [second[training]["drvPath"]]
    shown = nix(env, "log", second[training]["drvPath"])
    log = re.sub(r"\x1b\[[0-9;]*m", "", shown.stdout + shown.stderr)
    assert "Compiling redial" in log
    assert "Compiling fdl-shim-sys" not in log and "Compiling cc" not in log and "Compiling itoa" not in log
    binary = Path(second[training]["outputs"]["out"]) / "bin" / "redial"
    ran = subprocess.run([str(binary)], env={}, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert f"libtorch summed {n} ones to {n}" in ran.stdout
    # The build root and libtorch's headers stay out of the binary's closure.
    closure = subprocess.run(
        ["nix-store", "-qR", str(binary.parent.parent)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "NIX_CONFIG": NIX_CONFIG},
    ).stdout.split()
    assert len(closure) == 2 and any(p.endswith("-libtorch-2.13.0-cpu") for p in closure), closure


# --- GC roots ----------------------------------------------------------------------------------------


def cargo_source(git_source, **extra: str):
    files = trainer(build=None, bin="target/release/small")
    files.update(
        {
            "Cargo.toml": CARGO_TOML,
            "Cargo.lock": CARGO_LOCK,
            "src/main.rs": 'fn main() {\n    println!("v1");\n}\n',
            **extra,
        }
    )
    return git_source(files)


def deps_roots(state_dir: str) -> set[str]:
    roots = os.path.join(state_dir, "gcroots")
    return {
        os.readlink(os.path.join(roots, n))
        for n in os.listdir(roots)
        if os.readlink(os.path.join(roots, n)).endswith("-fdl-test-training-deps-cpu")
    }


def test_the_dependency_artefacts_of_the_run_are_gc_roots_and_an_older_locks_are_not(
    nix_env, test_flake, state_dir, git_source
):
    if not os.access("/usr/bin/cargo", os.X_OK):
        pytest.skip("/usr/bin/cargo is not installed (scripts/setup installs it)")
    src = cargo_source(git_source)
    first, _ = run(spec(test_flake, state_dir, src.url))
    held = deps_roots(state_dir)

    src.commit({"src/main.rs": 'fn main() {\n    println!("v2");\n}\n'}, "one line")
    second, _ = run(spec(test_flake, state_dir, src.url))
    after_line = deps_roots(state_dir)
    src.commit({"Cargo.lock": CARGO_LOCK.replace("# generated", "# regenerated")}, "new lock")
    third, _ = run(spec(test_flake, state_dir, src.url))
    after_lock = deps_roots(state_dir)

    assert len(held) == 1 and after_line == held
    assert len(after_lock) == 1 and after_lock != held
    listed = subprocess.run(
        ["nix-store", "--gc", "--print-roots"],
        capture_output=True,
        text=True,
        env={**os.environ, "NIX_CONFIG": NIX_CONFIG},
    ).stdout
    assert next(iter(after_lock)) in listed and next(iter(held)) not in listed
    for got in (first, second, third):
        assert got.bin is not None and os.path.isfile(got.bin.path)
    ran = subprocess.run([third.bin.path], capture_output=True, text=True, env={}, timeout=30)
    assert ran.stdout == "v2\n"
