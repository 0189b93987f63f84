"""How fast `fdl-prepare --help` and `import prepare` are, beside a bare
interpreter start measured in the same run (the machines are shared and
noisy, so only side-by-side figures mean anything).

    python bench/cli_startup.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 15

CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "import prepare": [sys.executable, "-c", "import prepare"],
    "fdl-prepare --help": [sys.executable, "-m", "prepare", "--help"],
    "fdl-prepare --version": [sys.executable, "-m", "prepare", "--version"],
}


def once(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(ROUNDS):
        # Alternate the cases round by round so drift hits them alike.
        for name, argv in CASES.items():
            samples[name].append(once(argv))
    base = statistics.median(samples["python -c pass"])
    print(f"{'case':<24} {'median':>9} {'min':>9} {'vs bare python':>15}")
    for name, values in samples.items():
        med = statistics.median(values)
        print(f"{name:<24} {med * 1000:8.1f}ms {min(values) * 1000:8.1f}ms {med / base:14.2f}x")
    imported = statistics.median(samples["import prepare"]) - base
    print(f"import prepare costs about {imported * 1000:.1f}ms over a bare interpreter")


if __name__ == "__main__":
    main()
