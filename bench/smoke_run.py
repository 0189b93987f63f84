"""The smoke run's confinement, what it costs: `smoke.run` of a binary that
exits at once (as nobody, no capabilities, a clean environment, in a PID
namespace of its own, under root; as itself under a subreaper otherwise)
against `proc.run` of the same binary as the caller, unconfined.

    python bench/smoke_run.py [-n 31]

The two take turns N times in this one process, so a noisy machine slows
them alike; the medians and their ratio are printed. What the difference
buys is in prepare/host/confine.py; what it costs is one interpreter started
with -I -S (prepare/host/confine_helper.py, which drops the privileges and
waits as the namespace's parent, importing only the cheapest of the
standard library), on a smoke run that itself loads libtorch and wakes a
GPU (seconds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prepare import smoke  # noqa: E402
from prepare.host import proc
from prepare.spec import Binary  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=31, help="rounds (default 31)")
    rounds = parser.parse_args().n
    # Not under /tmp: as root the run gets a fresh /tmp of its own, without the binary.
    where = Path(tempfile.mkdtemp(prefix="fdl-bench-smoke-", dir="/var/tmp" if os.geteuid() != 0 else "/var/lib"))
    try:
        where.chmod(0o755)
        binary = where / "train"
        binary.write_text("#!/bin/sh\nexit 0\n")
        binary.chmod(0o755)
        confined: list[float] = []
        plain: list[float] = []
        for _ in range(rounds):
            started = time.perf_counter()
            smoke.run(Binary(str(binary), str(where)), [], 30, [])
            confined.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert proc.run([str(binary)], timeout=30, cwd=str(where)).ok
            plain.append(time.perf_counter() - started)
        c, p = statistics.median(confined), statistics.median(plain)
        who = (
            "root: as a uid of its own, in PID and mount namespaces of its own"
            if os.geteuid() == 0
            else "not root: as itself, under a subreaper"
        )
        print(f"smoke run, confined ({who}): {c * 1000:.1f} ms (median of {rounds})")
        print(f"the same binary through proc.run, unconfined: {p * 1000:.1f} ms")
        print(f"ratio: {c / p:.1f}x, {1000 * (c - p):.1f} ms more per attempt")
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
