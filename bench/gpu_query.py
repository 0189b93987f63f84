"""What asking the GPU drivers from a child costs: the survey as the gate
makes it (prepare.gpu.query: one child, `python -I -S`, that imports pynvml
and makes every call under a deadline, its answers replayed here) against
the same calls made in this process, as the survey made them before it had
a deadline.

    python bench/gpu_query.py [-n 30] [--cards 8]

On the fake libnvidia-ml.so.1 (tests/fake_nvml, compiled with gcc), a box
of H100 cards on NVSwitch (every health query answers). The two take turns
N times, so a noisy machine slows them alike; the medians, their
difference and their ratio are printed, twice:

- in this one process, as a long-lived join loop surveys: the in-process
  variant warm (pynvml imported once), the child's worst case;
- each in a fresh interpreter, as every `fdl-prepare` attempt and
  `fdl-prepare gpus` surveys: the in-process variant then pays pynvml's
  import too, as the survey before the deadline did.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=30, help="rounds (default 30)")
    parser.add_argument("--cards", type=int, default=8, help="fake H100 cards (default 8)")
    parser.add_argument("--once", choices=("in-process", "child"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        # One survey in this fresh interpreter, the fake already in the environment.
        ctypes.CDLL(
            os.path.join(os.environ["LD_LIBRARY_PATH"].split(":")[0], "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL
        )
        _variants(args.cards)[args.once]()
        return

    from nvml_fixtures import SONAME, SOURCE, FakeNvml, hgx_h100

    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        sys.exit("gpu_query: gcc is needed to compile the fake libnvidia-ml.so.1")
    lib_dir = Path(tempfile.mkdtemp(prefix="gpu-query-bench-"))
    try:
        subprocess.run(
            [gcc, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{SONAME}", "-o", str(lib_dir / SONAME), str(SOURCE)],
            check=True,
        )
        box = FakeNvml(lib_dir).box(hgx_h100(args.cards))
        os.environ.update(box.env())
        os.environ.pop("FAKE_NVML_HANG", None)
        # This process's own loader read LD_LIBRARY_PATH at its start: load
        # the fake by path, so pynvml's load by soname finds it.
        ctypes.CDLL(str(lib_dir / SONAME), mode=ctypes.RTLD_GLOBAL)
        _compare(args.n, args.cards)
    finally:
        shutil.rmtree(lib_dir, ignore_errors=True)


def _variants(cards: int) -> dict[str, Callable[[], None]]:
    from prepare.gpu import _query, amd, gate, nvml, query

    def in_process() -> None:
        spec = importlib.util.find_spec("pynvml")
        assert spec is not None and spec.origin
        request = {"pynvml_dir": os.path.dirname(spec.origin), "preload": None, "preload_trusted": True, "mig": False}
        answers = _query._nvml(request, lambda call: None)
        files = query.Recorded(_query._amd(amd.paths(), lambda call: None)["ops"])
        amd.survey({}, files=files)
        gpus = nvml.survey({}, answers)
        assert len(gpus.offered) == cards

    def child() -> None:
        gpus = gate.survey({}, timeout=30)
        assert len(gpus.offered) == cards

    return {"in-process": in_process, "child": child}


def _compare(rounds: int, cards: int) -> None:
    variants = _variants(cards)

    def fresh(name: str) -> Callable[[], None]:
        argv = [sys.executable, __file__, "--once", name, "--cards", str(cards)]
        return lambda: subprocess.run(argv, check=True)

    for title, runs in (
        ("in this process (a join loop)", variants),
        ("each in a fresh interpreter (an attempt, `fdl-prepare gpus`)", {n: fresh(n) for n in variants}),
    ):
        for run in runs.values():
            run()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
        inside = statistics.median(times["in-process"])
        outside = statistics.median(times["child"])
        print(f"GPU survey of {cards} fake H100 cards, {title}, median of {rounds} rounds:")
        print(f"  the calls in process     {inside * 1000:8.1f} ms")
        print(f"  one child under deadline {outside * 1000:8.1f} ms")
        print(f"  the child costs {(outside - inside) * 1000:.1f} ms more, ratio {outside / inside:.2f}x")


if __name__ == "__main__":
    main()
