"""Warm path: a full `fdl-prepare` when everything is already in the store,
against a bare `nix build` of the same attributes with the same flags.

    python bench/warm_path.py [-n 15] [--demo]

Offline (NIX_CONFIG `substituters =`), against a flat copy of the test flake
and the example training source (examples/trainer) in a temp git repository,
`--cpu-only --libtorch cpu`; with `--demo`, against the references
scripts/demo uses (`git+file://<repo>?dir=tests/flake`, `path:<repo>/examples/trainer`). One warm-up run builds everything; then the two
commands alternate N times in this one process, so a noisy machine slows
both alike, and the medians and their ratio are printed (target: at most
1.25x). A third figure, the library call `prepare()` in this process, splits
the CLI's cost into interpreter start-up and the pipeline itself.
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
sys.path.insert(0, str(REPO))

NIX_CONFIG = "experimental-features = nix-command flakes\nsubstituters =\n"


def flat_flake(dest: Path) -> str:
    dest.mkdir(parents=True)
    for name in ("flake.nix", "toolchain.nix", "flake.lock"):
        shutil.copy(REPO / "tests" / "flake" / name, dest / name)
    shutil.copytree(REPO / "nix", dest / "nix", ignore=shutil.ignore_patterns("*.md"))
    return f"path:{dest}"


def example_source(dest: Path) -> str:
    shutil.copytree(REPO / "examples" / "trainer", dest)
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "bench",
        "GIT_AUTHOR_EMAIL": "bench@fdl.invalid",
        "GIT_COMMITTER_NAME": "bench",
        "GIT_COMMITTER_EMAIL": "bench@fdl.invalid",
    }
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "example"]):
        subprocess.run(argv, cwd=dest, env=env, check=True)
    return f"git+file://{dest}?ref=main"


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    return time.perf_counter() - start, done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=15, help="alternations (default 15)")
    parser.add_argument("--demo", action="store_true", help="use scripts/demo's flake and source references")
    args = parser.parse_args()
    if shutil.which("nix") is None:
        print("nix is not installed: nothing to measure", file=sys.stderr)
        return 1

    os.environ["NIX_CONFIG"] = NIX_CONFIG
    from prepare import nix as nix_mod
    from prepare.pipeline import prepare
    from prepare.spec import PrepareSpec, SourceSpec

    tmp = Path(tempfile.mkdtemp(prefix="fdl-bench-warm-"))
    try:
        if args.demo:
            flake = f"git+file://{REPO}?dir=tests/flake"
            source = f"path:{REPO}/examples/trainer"
        else:
            flake = flat_flake(tmp / "flake")
            source = example_source(tmp / "source")
        print(f"flake {flake}\nsource {source}")
        state = tmp / "state"
        env = {**os.environ, "NIX_CONFIG": NIX_CONFIG, "HOME": str(tmp / "home")}
        (tmp / "home").mkdir()
        cli = [
            sys.executable,
            "-m",
            "prepare",
            "--cpu-only",
            "--libtorch",
            "cpu",
            "--flake",
            flake,
            "--source",
            source,
            "--state-dir",
            str(state),
            "--json",
        ]

        seconds, done = timed(cli, env)  # warm-up: builds what is missing
        if done.returncode != 0:
            print(f"warm-up failed (exit {done.returncode}):\n{done.stdout}{done.stderr}", file=sys.stderr)
            return 1
        prepared = json.loads(done.stdout)
        print(f"warm-up (first run): {seconds:.3f}s")

        # The bare build: the very argv the runner issues, with the source
        # pinned as the runner pins it (the prefetch is the runner's own cost).
        runner = nix_mod.Nix(str(state))
        fetched = runner.prefetch(source)
        system = nix_mod.system()
        fdl = f"{flake}#legacyPackages.{system}.fdl"
        bare = runner._common() + [
            "build",
            "--json",
            "--no-write-lock-file",
            "--no-eval-cache",
            "--out-link",
            str(tmp / "bare" / "run"),
            "--override-input",
            "source",
            fetched.pinned_url,
            "--override-input",
            "recipe",
            f"path:{state / 'recipe'}",
            f"{fdl}.libtorch.cpu",
            f"{fdl}.training",
            fetched.store_path,
        ]
        (tmp / "bare").mkdir()
        seconds, done = timed(bare, env)
        if done.returncode != 0:
            print(f"bare build failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1

        spec = PrepareSpec(
            source=SourceSpec(from_=source), libtorch="cpu", cpu_only=True, flake=flake, state_dir=str(state)
        )
        os.environ["HOME"] = str(tmp / "home")
        cli_s: list[float] = []
        bare_s: list[float] = []
        lib_s: list[float] = []
        steps: dict[str, list[float]] = {}
        for i in range(args.n):
            order = [("cli", cli), ("bare", bare)] if i % 2 == 0 else [("bare", bare), ("cli", cli)]
            for name, argv in order:
                seconds, done = timed(argv, env)
                if done.returncode != 0:
                    print(f"{name} failed on round {i}:\n{done.stderr[-2000:]}", file=sys.stderr)
                    return 1
                if name == "cli":
                    cli_s.append(seconds)
                    again = json.loads(done.stdout)
                    assert again["libtorch"] == prepared["libtorch"] and again["bin"] == prepared["bin"]
                    for step, t in again.get("timings", {}).items():
                        steps.setdefault(step, []).append(t)
                else:
                    bare_s.append(seconds)
            start = time.perf_counter()
            prepare(spec, [])
            lib_s.append(time.perf_counter() - start)

        med_cli, med_bare, med_lib = (statistics.median(x) for x in (cli_s, bare_s, lib_s))
        print(f"rounds: {args.n} (alternated)")
        print(f"fdl-prepare CLI (warm)     median {med_cli * 1000:7.1f} ms  (min {min(cli_s) * 1000:.1f})")
        print(f"bare nix build (same argv) median {med_bare * 1000:7.1f} ms  (min {min(bare_s) * 1000:.1f})")
        print(f"prepare() in-process       median {med_lib * 1000:7.1f} ms  (min {min(lib_s) * 1000:.1f})")
        for step, values in steps.items():
            print(f"  CLI step {step:<7} median {statistics.median(values) * 1000:7.1f} ms")
        print(f"ratio CLI / bare build:        {med_cli / med_bare:.2f}x  (target <= 1.25x)")
        print(f"ratio prepare() / bare build:  {med_lib / med_bare:.2f}x")
        print(f"interpreter start-up and CLI:  {(med_cli - med_lib) * 1000:.1f} ms")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
