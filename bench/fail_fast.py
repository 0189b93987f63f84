"""Fail fast: time to the permanent Fail for an unwritable dataset cache, and
how many times `nix` ran before it (target: zero; the cheap steps come first).

    python bench/fail_fast.py [-n 10]

The run asks for a full build (`--cpu-only --libtorch cpu`, a flake and a
training source), so any nix call before the refusal would show. Nix calls
are counted by a `nix` on PATH that logs each invocation and execs the real
one. Two ways to break the cache (`$HOME/.flodl/data`):

- a file where the cache directory should be (any user);
- HOME on a read-only tmpfs (root only: it mounts one, and unmounts it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NIX_CONFIG = "experimental-features = nix-command flakes\nsubstituters =\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=10, help="runs per case (default 10)")
    args = parser.parse_args()
    real_nix = shutil.which("nix")

    tmp = Path(tempfile.mkdtemp(prefix="fdl-bench-fail-"))
    mounted: list[Path] = []
    try:
        calls = tmp / "nix-calls.log"
        calls.touch()
        shim_dir = tmp / "shim"
        shim_dir.mkdir()
        shim = shim_dir / "nix"
        target = real_nix or "/nonexistent/nix"
        shim.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {target} "$@"\n')
        shim.chmod(0o755)

        cases: list[tuple[str, Path]] = []
        home_file = tmp / "home-file"
        home_file.mkdir()
        (home_file / ".flodl").write_text("a file where the cache directory should be\n")
        cases.append(("cache path blocked by a file", home_file))
        if os.geteuid() == 0:
            home_ro = tmp / "home-ro"
            home_ro.mkdir()
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(home_ro)], capture_output=True, text=True
            )
            if done.returncode == 0:
                mounted.append(home_ro)
                cases.append(("HOME on a read-only tmpfs", home_ro))
            else:
                print(f"(skipping the read-only tmpfs case: {done.stderr.strip()})")
        else:
            print("(skipping the read-only tmpfs case: needs root to mount)")

        argv = [
            sys.executable,
            "-m",
            "prepare",
            "--cpu-only",
            "--libtorch",
            "cpu",
            "--flake",
            f"git+file://{REPO}?dir=tests/flake",
            "--source",
            f"git+file://{REPO}?ref=main",
            "--state-dir",
            str(tmp / "state"),
        ]
        print(f"nix: {real_nix or 'not installed (the shim counts calls all the same)'}")
        for name, home in cases:
            env = {
                **os.environ,
                "HOME": str(home),
                "PATH": f"{shim_dir}:{os.environ.get('PATH', '')}",
                "NIX_CONFIG": NIX_CONFIG,
            }
            env.pop("FDL_PREPARE_CONFIG", None)
            times: list[float] = []
            for _ in range(args.n):
                before = len(calls.read_text().splitlines())
                start = time.perf_counter()
                done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=str(tmp))
                times.append(time.perf_counter() - start)
                if done.returncode != 78:
                    print(f"{name}: expected exit 78, got {done.returncode}:\n{done.stderr}", file=sys.stderr)
                    return 1
                assert len(calls.read_text().splitlines()) == before, "nix ran before the refusal"
            last = done.stderr.strip().splitlines()
            print(
                f"{name}: median {statistics.median(times) * 1000:.1f} ms (min {min(times) * 1000:.1f}, "
                f"max {max(times) * 1000:.1f}) over {args.n} runs, exit 78"
            )
            print(f"  says: {next((line for line in last if 'permanent failure' in line), last[0] if last else '')}")
        print(f"nix invocations before the permanent Fail: {len(calls.read_text().splitlines())} (target 0)")
        return 0
    finally:
        for mountpoint in mounted:
            subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
