"""Re-dial after a change: the flake's split training build (nix/cargo-split.nix)
against floDl's own path, `cargo build --release` in a persistent tree, on a
crate with real dependencies and a C++ build script against libtorch.

    python bench/redial.py [-n 3] [--cold 1]

The crate is tests/redial_fixtures.py's: the run's own code on Debian's
packaged cc and itoa and the test flake's fdl-shim-sys, whose build script
compiles a C++ shim against libtorch with the cc crate, as floDl's
flodl-sys does. The flake is a flat copy of the test flake with the real cpu
libtorch (PyTorch's CPU wheel, which scripts/setup puts in the store); the
persistent tree builds against the same libtorch (a root of links to the
same store paths) and the same vendored crates, offline.

Measured, the two sides taking turns in this one process so a noisy machine
slows them alike, medians and ratios printed:

(a) a re-dial after a one-line change in the run's crate: `nix build` of
    `training` and `trainingDeps` with the changed source (the build of the
    runner's step 7, prefetch included), against `cargo build --release` in
    the persistent tree after the same change. Target: at most 1.5x.
(b) a cold prepare, libtorch already in the store and nothing of the crate
    built (a nonce in Cargo.toml makes every derivation new), against a cold
    `cargo build --release` (no target/) with the same libtorch. Target: at
    most 1.3x.

(c), a re-dial with nothing changed, evaluates nothing and builds nothing
whatever the split: bench/warm_path.py measures it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import redial_fixtures  # noqa: E402 - found through the path set just above
from nix_fixtures import NIX_CONFIG, flat_copy, nix_system  # noqa: E402

FDL = f"legacyPackages.{nix_system()}.fdl"
FLAGS = ["--extra-experimental-features", "nix-command flakes", "--no-eval-cache"]


def nix(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nix", *FLAGS, *args], env=env, capture_output=True, text=True)


def nix_build(env: dict[str, str], flake: Path, tree: Path, recipe: Path) -> float:
    start = time.perf_counter()
    pre = nix(env, "flake", "prefetch", "--json", f"path:{tree}")
    if pre.returncode != 0:
        sys.exit(pre.stderr)
    found = json.loads(pre.stdout)
    done = nix(
        env,
        "build",
        "--no-link",
        f"path:{flake}#{FDL}.training",
        f"path:{flake}#{FDL}.trainingDeps",
        "--no-write-lock-file",
        *("--override-input", "source", f"path:{found['storePath']}?narHash={found['hash']}"),
        *("--override-input", "recipe", f"path:{recipe}"),
    )
    took = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(done.stderr[-4000:])
    return took


def cargo_build(tree: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/cargo", "build", "--release"], cwd=tree, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(done.stderr[-4000:])
    return took


def floDl_env(work: Path, env: dict[str, str], flake: Path) -> dict[str, str]:
    """What floDl's persistent tree builds with: LIBTORCH_PATH a root over
    the flake's libtorch (the same store paths), the vendored crates the
    flake uses, offline."""
    got = nix(
        env,
        "eval",
        "--json",
        f"path:{flake}#{FDL}.libtorch.cpu",
        "--apply",
        "d: { out = d.out.outPath; dev = d.dev.outPath; }",
        "--no-write-lock-file",
    )
    paths = json.loads(got.stdout)
    if nix(env, "build", "--no-link", f"path:{flake}#{FDL}.libtorch.cpu.out", "--no-write-lock-file").returncode:
        sys.exit("the real libtorch is not in the store: run scripts/setup")
    root = work / "libtorch"
    root.mkdir()
    (root / "lib").symlink_to(f"{paths['out']}/lib")
    (root / "include").symlink_to(f"{paths['dev']}/include")
    home = work / "cargo-home"
    vendor = home / "vendor"
    vendor.mkdir(parents=True)
    for name in redial_fixtures.PACKAGED:
        found = sorted(redial_fixtures.REGISTRY.glob(f"{name}-[0-9]*"))[-1]
        shutil.copytree(found, vendor / found.name)
    for own in redial_fixtures.FLAKE_REGISTRY.iterdir():
        shutil.copytree(own, vendor / own.name)
        digest = redial_fixtures._digest(own)
        (vendor / own.name / ".cargo-checksum.json").write_text(json.dumps({"package": digest, "files": {}}))
    (home / "config.toml").write_text(
        f'[source.crates-io]\nreplace-with = "v"\n[source.v]\ndirectory = {json.dumps(str(vendor))}\n'
    )
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "CARGO_HOME": str(home),
        "CARGO_NET_OFFLINE": "true",
        "LIBTORCH_PATH": str(root),
        "RUSTFLAGS": f"-C link-args=-Wl,-rpath,{paths['out']}/lib",
    }


def nonce(tree: Path, value: str) -> None:
    toml = tree / "Cargo.toml"
    lines = [line for line in toml.read_text().splitlines() if not line.startswith("description")]
    at = lines.index('edition = "2021"') + 1
    lines.insert(at, f'description = "bench {value}"')
    toml.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=3, help="rounds of (a)")
    parser.add_argument("--cold", type=int, default=1, help="rounds of (b)")
    args = parser.parse_args()
    why = redial_fixtures.missing()
    if why:
        sys.exit(f"redial: {why}")
    work = Path(tempfile.mkdtemp(prefix="fdl-redial-"))
    registry = work / "registry.json"
    registry.write_text('{"flakes":[],"version":2}')
    env = {**os.environ, "NIX_CONFIG": NIX_CONFIG + f"\nflake-registry = {registry}\n"}
    try:
        flake = flat_copy(work / "flake")
        recipe = work / "recipe"
        recipe.mkdir()
        (recipe / "recipe.json").write_text(
            json.dumps({"contract": 2, "libtorch": "cpu", "cwd": ".", "build": None, "bin": "target/release/redial"})
        )
        cargo_env = floDl_env(work, env, flake)
        ours = redial_fixtures.make_source(work / "ours")
        theirs = work / "theirs"
        shutil.copytree(ours, theirs)

        cold_nix: list[float] = []
        cold_cargo: list[float] = []
        for i in range(args.cold):
            tag = f"{time.time_ns()}-{i}"
            nonce(ours, tag)
            nonce(theirs, tag)
            shutil.rmtree(theirs / "target", ignore_errors=True)
            cold_nix.append(nix_build(env, flake, ours, recipe))
            cold_cargo.append(cargo_build(theirs, cargo_env))
            print(f"(b) cold round {i + 1}: prepare {cold_nix[-1]:.1f}s, cargo {cold_cargo[-1]:.1f}s", flush=True)

        redial_nix: list[float] = []
        redial_cargo: list[float] = []
        for i in range(args.n):
            n = 100 + i
            redial_fixtures.one_line_change(ours, n)
            redial_fixtures.one_line_change(theirs, n)
            redial_nix.append(nix_build(env, flake, ours, recipe))
            redial_cargo.append(cargo_build(theirs, cargo_env))
            print(
                f"(a) re-dial round {i + 1}: prepare {redial_nix[-1]:.1f}s, cargo {redial_cargo[-1]:.1f}s", flush=True
            )

        a = statistics.median(redial_nix) / statistics.median(redial_cargo)
        b = statistics.median(cold_nix) / statistics.median(cold_cargo)
        print()
        print(f"(a) re-dial after a one-line change: split build {statistics.median(redial_nix):.2f}s, "
              f"floDl's cargo build {statistics.median(redial_cargo):.2f}s: {a:.2f}x (target <= 1.5x)")  # fmt: skip
        print(f"(b) cold: split build {statistics.median(cold_nix):.2f}s, "
              f"cold cargo build {statistics.median(cold_cargo):.2f}s: {b:.2f}x (target <= 1.3x)")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
