"""The order of the steps is load-bearing: cheap before expensive.

1. the GPU gate, 2. the dataset root, 3. the node-local directories: each
   finishes in milliseconds;
4. the libtorch variant and its arch coverage, read from the flake by
   evaluation, so a card the variant cannot serve is refused before anything
   is downloaded;
5. the training source (fetched, its manifest merged over the box's recipe),
   then the build: minutes and gigabytes;
6. the smoke run, when the recipe asks for one: the built binary run once,
   last, since it needs everything before it.

A box that has no usable GPU, or an unwritable stage directory, must find out
before a cold build has been spent on it. And all of it runs before the
controller is dialled, because admission starts a window deadline that
anything acquired afterwards would burn.

Step modules are imported inside `prepare` so `import prepare` (and the CLI's
`--help`) stays cheap.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from prepare.spec import Prepared, PrepareSpec

if TYPE_CHECKING:
    from prepare.spec import Progress


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
    from prepare import config
    from prepare.data import root as data
    from prepare.gpu import gate
    from prepare.host import dirs

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
    variant = None
    if spec.wants_build:
        from prepare.build import steps as build

        # The spec's flake and source are checked before the first nix call;
        # then the state directory, Nix's version, and the state lock, held
        # until the build's out-links are written.
        with _timed(timings, "state"):
            session = build.start(spec, notes, progress)
        with session:
            with _timed(timings, "variant"):
                variant = build.choose_variant(session, gpus)
            with _timed(timings, "source"):
                source = build.fetch_source(session)
            with _timed(timings, "build"):
                built = build.build_outputs(session, variant, source)
            variant = built.variant or variant
        if built.bin is not None and built.smoke:
            from prepare import smoke

            with _timed(timings, "smoke"):
                smoke.run(built.bin, built.smoke, spec.smoke_timeout_s, notes, user=spec.smoke_user)

    # The cards the run uses are the chosen libtorch's vendor's (a CPU build
    # leaves them idle but they stay offered, in the numbering auto favours).
    vendor = None
    if gpus is not None:
        vendor = variant.vendor if variant is not None and variant.vendor is not None else gpus.primary_vendor
    return Prepared(
        data_path=data_path,
        libtorch=built.libtorch if built else None,
        bin=built.bin if built else None,
        args=built.args if built else None,
        run_id=built.run_id if built else None,
        devices=gpus.offered_indices_for(vendor) if gpus is not None else None,
        gpu_vendor=vendor,
        timings=timings,
    )
