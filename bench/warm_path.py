"""Warm path: a full `fdl-prepare` when everything is already in the store,
against a bare `nix build` of the same attributes with the same flags, on
the ordinary test flake and on an evaluation-heavy one (an attribute set
generated on the way to `fdl`, as costly to evaluate as nixpkgs: seconds).

    python bench/warm_path.py [-n 9] [--demo | --stand-in]

Offline (NIX_CONFIG `substituters =`), against flat copies of the test flake
(the real cpu libtorch: PyTorch's CPU wheel, which scripts/setup puts in the
store) and the example training source (examples/trainer, a Rust crate whose
smoke run takes one training step) in a temp git repository,
`--cpu-only --libtorch cpu`; with `--demo`, the ordinary flake is the one
scripts/demo uses. With `--stand-in`, both flakes are the suite's ordinary
test flake (`test_flake`: the /bin/sh stand-in libtorch) and the source a
shell-built trainer whose smoke run is a shell script: fdl-prepare's own
cost, with no training step to subtract. One warm-up run builds everything; then the commands take
turns N times in this one process, so a noisy machine slows them alike, and
the medians and the ratios are printed. Targets: at most 3x on the ordinary
flake, at most 0.5x on the heavy one (a warm attempt evaluates nothing, the
bare build evaluates the flake).

Measured in the same rounds, to show where the CLI's time goes: the
interpreter starting (`python -c pass`), importing what a warm attempt
imports, the source's resolution alone (`nix flake prefetch`), and a warm
`prepare()` library call in one long-lived process, as a join loop makes it.

A `nix` that logs its calls, first on PATH, counts the evaluations (`nix
eval`, `nix build`) of a warm attempt, of an attempt with nothing recorded,
of one after a new commit, and of one after the flake changed but not its
variants.
"""

from __future__ import annotations

import argparse
import compileall
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

# The tests' offline configuration, which also lends the test flake's host
# tools to Nix's build sandbox where it is on (Debian 13).
sys.path.insert(0, str(REPO / "tests"))
from nix_fixtures import MANIFEST, NIX_CONFIG, flat_copy, manifest_text  # noqa: E402 - found through the path set just above


def example_source(dest: Path, *, stand_in: bool = False) -> str:
    if stand_in:
        # What the stand-in flake can build: a shell script, smoke-run too.
        dest.mkdir()
        build = "printf '#!/bin/sh\\necho trained\\n' > train && chmod +x train"
        (dest / MANIFEST).write_text(manifest_text(bin="train", build=build))
    else:
        # A target/ left by a local cargo build is not part of the source.
        shutil.copytree(REPO / "examples" / "trainer", dest, ignore=shutil.ignore_patterns("target"))
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


HEAVY = 600000

JOIN_LOOP = """
import json, os, sys, time
from prepare import config
from prepare.pipeline import prepare
spec = config.resolve({}, json.loads(sys.argv[1]), os.environ)
for _ in sys.stdin:
    start = time.perf_counter()
    prepare(spec, [])
    print(time.perf_counter() - start, flush=True)
"""
EVALUATING = ("eval", "build")


def counting_nix(directory: Path) -> tuple[Path, Path]:
    """A `nix` that logs each call's argv (JSON lines) and runs the real one."""
    real = shutil.which("nix")
    log = directory / "calls.jsonl"
    shim = directory / "bin" / "nix"
    shim.parent.mkdir(parents=True)
    shim.write_text(
        "#!/bin/sh\n"
        f"{sys.executable} -c 'import json,sys; print(json.dumps(sys.argv[1:]))' \"$@\" >> {log}\n"
        f'exec {real} "$@"\n'
    )
    shim.chmod(0o755)
    return shim.parent, log


def evaluations(log: Path) -> int:
    if not log.exists():
        return 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    log.unlink()
    return sum(
        1 for argv in calls if next((a for a in argv if a in (*EVALUATING, "flake", "--version")), "") in EVALUATING
    )


def measure(name: str, flake: str, source: str, tmp: Path, env: dict[str, str], n: int) -> dict[str, float] | None:
    from prepare.nix import runner as nix_mod

    state = tmp / f"state-{name}"
    cli = [sys.executable, "-m", "prepare", "--cpu-only", "--libtorch", "cpu", "--flake", flake, "--source", source]
    # The smoke run is the box's own (floDl's manifest has no field for it).
    cli += ["--smoke=--smoke", "--state-dir", str(state), "--json"]

    seconds, done = timed(cli, env)  # warm-up: builds what is missing
    if done.returncode != 0:
        print(f"{name}: warm-up failed (exit {done.returncode}):\n{done.stdout}{done.stderr}", file=sys.stderr)
        return None
    prepared = json.loads(done.stdout)
    print(f"{name}: flake {flake}\n{name}: warm-up (first run) {seconds:.3f}s")

    # The bare build: the very argv the runner issues on a cold attempt, with
    # the source pinned as the runner pins it.
    runner = nix_mod.Nix(str(state))
    fetched = runner.prefetch(source)
    fdl = f"{flake}#legacyPackages.{nix_mod.system()}.fdl"
    bare = runner._common() + ["build", "--json", "--no-write-lock-file", "--no-eval-cache"]
    bare += ["--out-link", str(tmp / f"bare-{name}" / "run")]
    bare += ["--override-input", "source", fetched.pinned_url, "--override-input", "recipe", f"path:{state / 'recipe'}"]
    bare += [f"{fdl}.libtorch.cpu", f"{fdl}.training", fetched.store_path]
    (tmp / f"bare-{name}").mkdir()
    if timed(bare, env)[1].returncode != 0:
        print(f"{name}: the bare build failed", file=sys.stderr)
        return None

    # What no warm attempt can go below, measured in the same rounds: the
    # interpreter starting, and the training source's re-resolution (a
    # moving ref must be resolved on every attempt; the flake's runs beside
    # it).
    modules = "prepare.cli, prepare.pipeline, prepare.config, prepare.gpu.gate, prepare.data, prepare.host.dirs, prepare.build"
    floor = {
        "python": [sys.executable, "-c", "pass"],
        "imports": [sys.executable, "-c", f"import {modules}"],
        "resolve": runner._common() + ["--option", "tarball-ttl", "0", "flake", "prefetch", "--json", "--", source],
    }
    # Every attempt runs the box's smoke run, the trainer's own work (a
    # training step through libtorch): measured alone, so the ratios below
    # show fdl-prepare's share apart from the binary's.
    floor["smoke"] = [prepared["bin"]["path"], "--smoke"]
    commands = {"cli": cli, "bare": bare, **floor}
    # The library call from a join loop: one long-lived process, each
    # attempt a `prepare()` call (its first call, the warm-up, not counted).
    source_keys = {"from": source, "smoke": ["--smoke"]}
    flags = {"cpu_only": True, "libtorch": "cpu", "flake": flake, "source": source_keys, "state_dir": str(state)}
    loop = subprocess.Popen(
        [sys.executable, "-c", JOIN_LOOP, json.dumps(flags)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert loop.stdin is not None and loop.stdout is not None
    loop.stdin.write("warm-up\n")
    loop.stdin.flush()
    loop.stdout.readline()
    seconds_of: dict[str, list[float]] = {which: [] for which in [*commands, "library"]}
    for i in range(n):
        names = [*commands, "library"]
        order = names[i % len(names) :] + names[: i % len(names)]
        for which in order:
            if which == "library":
                loop.stdin.write("attempt\n")
                loop.stdin.flush()
                seconds_of[which].append(float(loop.stdout.readline()))
                continue
            seconds, done = timed(commands[which], env)
            if done.returncode != 0:
                print(f"{name}: {which} failed on round {i}:\n{done.stderr[-2000:]}", file=sys.stderr)
                return None
            if which == "cli":
                again = json.loads(done.stdout)
                assert again["libtorch"] == prepared["libtorch"] and again["bin"] == prepared["bin"]
            seconds_of[which].append(seconds)
    loop.stdin.close()
    loop.wait()
    med = {which: statistics.median(values) for which, values in seconds_of.items()}
    label = {
        "cli": "fdl-prepare CLI (warm)",
        "bare": "bare nix build (same argv)",
        "python": "floor: python -c pass",
        "imports": "python, importing what a warm attempt does",
        "resolve": "floor: nix flake prefetch (source)",
        "library": "library call in a join loop (warm)",
        "smoke": "the trainer's smoke step alone",
    }
    for which, values in seconds_of.items():
        print(f"{name}: {label[which]:<44} median {med[which] * 1000:8.1f} ms  (min {min(values) * 1000:.1f})")
    return med


def count_evaluations(flake: str, tmp: Path, env: dict[str, str], *, stand_in: bool) -> tuple[int, int, int, int]:
    """Evaluations of a warm attempt, of one with nothing recorded (a new
    state directory), of one after a new commit on the source's ref, and of
    one after the flake changed but its variants did not (a nixpkgs bump)."""
    bin_dir, log = counting_nix(tmp / "counting")
    counted = {**env, "PATH": f"{bin_dir}:{env.get('PATH', '')}"}
    source_dir = tmp / "counted-source"
    source = example_source(source_dir, stand_in=stand_in)
    state = tmp / "state-counted"
    cli = [sys.executable, "-m", "prepare", "--cpu-only", "--libtorch", "cpu", "--flake", flake, "--source", source]
    cli += ["--state-dir", str(state)]
    for argv in (cli, cli):
        if subprocess.run(argv, env=counted, capture_output=True).returncode != 0:
            raise SystemExit("the counted attempts failed")
    evaluations(log)
    subprocess.run(cli, env=counted, capture_output=True, check=True)
    warm = evaluations(log)
    shutil.rmtree(state)
    subprocess.run(cli, env=counted, capture_output=True, check=True)
    cold = evaluations(log)
    (source_dir / "NEWS").write_text("a new publish\n")
    git_env = {**env, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "b@fdl.invalid"}
    git_env |= {"GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "b@fdl.invalid"}
    subprocess.run(["git", "add", "-A"], cwd=source_dir, env=git_env, check=True)
    subprocess.run(["git", "commit", "-qm", "news"], cwd=source_dir, env=git_env, check=True)
    subprocess.run(cli, env=counted, capture_output=True, check=True)
    commit = evaluations(log)
    heavy = Path(flake.removeprefix("path:")) / "heavy.nix"
    heavy.write_text(f"{int(heavy.read_text()) + 1}\n")
    subprocess.run(cli, env=counted, capture_output=True, check=True)
    return warm, cold, commit, evaluations(log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=9, help="alternations per flake (default 9)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--demo", action="store_true", help="the ordinary flake as scripts/demo references it")
    which.add_argument("--stand-in", action="store_true", help="the suite's stand-in libtorch and a shell trainer")
    args = parser.parse_args()
    if shutil.which("nix") is None:
        print("nix is not installed: nothing to measure", file=sys.stderr)
        return 1

    # Byte-compiled first, as an installed fdl-prepare is (the Nix app, a
    # pip install): with PYTHONDONTWRITEBYTECODE set, every run would
    # compile the edited modules again and count that as the warm path.
    compileall.compile_dir(str(REPO / "prepare"), quiet=1)
    tmp = Path(tempfile.mkdtemp(prefix="fdl-bench-warm-"))
    try:
        env = {**os.environ, "NIX_CONFIG": NIX_CONFIG, "HOME": str(tmp / "home")}
        (tmp / "home").mkdir()
        source = example_source(tmp / "source", stand_in=args.stand_in)
        ordinary = (
            f"git+file://{REPO}?dir=tests/flake"
            if args.demo
            else f"path:{flat_copy(tmp / 'flake', stand_in=args.stand_in)}"
        )
        heavy = f"path:{flat_copy(tmp / 'heavy', stand_in=args.stand_in)}"
        (tmp / "heavy" / "heavy.nix").write_text(f"{HEAVY}\n")
        figures = {}
        for name, flake in (("ordinary", ordinary), ("heavy", heavy)):
            got = measure(name, flake, source, tmp, env, args.n)
            if got is None:
                return 1
            figures[name] = got
        warm, cold, commit, flake_changed = count_evaluations(heavy, tmp, env, stand_in=args.stand_in)
        print(f"rounds: {args.n} per flake (rotated)")
        for name, target in (("ordinary", 3.0), ("heavy", 0.5)):
            ratio = (figures[name]["cli"] - figures[name]["smoke"]) / figures[name]["bare"]
            print(
                f"ratio CLI (less the smoke step) / bare build, {name + ' flake:':<16} {ratio:5.2f}x  "
                f"(target <= {target:g}x)"
            )
        ordinary = figures["ordinary"]
        floor = ordinary["python"] + ordinary["resolve"]
        imports = ordinary["imports"] - ordinary["python"]
        print(
            f"floor on the ordinary flake: interpreter + source resolution = {floor * 1000:.1f} ms, "
            f"{floor / ordinary['bare']:.2f}x the bare build; the CLI spends {(ordinary['cli'] - floor) * 1000:.1f} ms "
            f"more, {imports * 1000:.1f} of them importing its modules"
        )
        for name in ("ordinary", "heavy"):
            library = figures[name]["library"] / figures[name]["bare"]
            print(f"ratio library call / bare build, {name + ' flake:':<16} {library:5.2f}x")
        print(
            f"evaluations: warm attempt {warm}, nothing recorded {cold}, after a new commit {commit}, "
            f"after a changed flake with the same variants {flake_changed}"
        )
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
