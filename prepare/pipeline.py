"""The order of the steps is load-bearing: cheap before expensive.

The GPU gate, the dataset root and the local directories finish in
milliseconds; the build can take minutes and gigabytes. A box that has no
usable GPU, or an unwritable stage directory, must find out before a cold
build has been spent on it. And all of it runs before the controller is
dialled, because admission starts a window deadline that anything acquired
afterwards would burn.

Step modules are imported inside `prepare` so `import prepare` (and the CLI's
`--help`) stays cheap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prepare.spec import Prepared, PrepareSpec

# Receives progress events from the long steps (downloads, builds). The
# library never prints: a CLI or a join loop decides how to show them.
Progress = Callable[[dict[str, Any]], None]


@contextmanager
def _timed(timings: dict[str, float], step: str) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        timings[step] = round(time.monotonic() - start, 4)


def prepare(spec: PrepareSpec, notes: list[str], *, progress: Progress | None = None) -> Prepared:
    """Run the pipeline once. Every step is idempotent, so a retry loop
    around this call is a provisioning loop: call it on every attempt."""
    from prepare import config, data, dirs, gate

    # The checked spec, not the caller's: its values are in their normal
    # form (no spaces around a URL that reaches nix).
    spec = config.check_spec(spec)
    timings: dict[str, float] = {}
    with _timed(timings, "gate"):
        gpus = gate.check(spec, notes)
    with _timed(timings, "data"):
        data_path = data.ensure_root(spec, notes)
    with _timed(timings, "dirs"):
        dirs.check(notes)

    built = None
    if spec.wants_build:
        from prepare import build

        with _timed(timings, "build"):
            built = build.build(spec, gpus, notes, progress=progress)

    return Prepared(
        data_path=data_path,
        libtorch=built.libtorch if built else None,
        bin=built.bin if built else None,
        args=built.args if built else None,
        run_id=built.run_id if built else None,
        devices=gpus.offered_indices if gpus is not None else None,
        timings=timings,
    )
