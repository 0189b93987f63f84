"""The steps, in an order that is itself load-bearing: cheap before expensive.

1. gate: the GPU gate, over NVIDIA and AMD cards (prepare.gpu);
2. data: the dataset source root, a path or a read-only sshfs mount
   (prepare.data);
3. dirs: the node-local directories, proven writable by writing
   (prepare.host.dirs);
4. state: the state directory, Nix, and the state lock
   (prepare.build.workspace);
5. variant: the libtorch variant and its arch coverage, read from the flake
   by evaluation (prepare.build.choose, prepare.build.warm), so a card the
   variant cannot serve is refused before anything is downloaded;
6. source: the training source fetched, its manifest merged over the box's
   recipe (prepare.build.source);
7. build: libtorch and the training binary through the store, with GC
   roots (prepare.build.realise, prepare.build.warm): minutes and gigabytes;
8. smoke: the built binary run once, when the recipe asks for it
   (prepare.smoke), last, since it needs everything before it.

The first three finish in milliseconds, the next three in about as long as
Nix takes to resolve and evaluate. A box that has no usable GPU, or an
unwritable stage directory, must find out before a cold build has been
spent on it. And all of it runs before the controller is dialled, because
admission starts a window deadline that anything acquired afterwards would
burn. Before step 1, the plan (prepare.plan) has checked everything that
can be checked without the box.

`STEPS` lists them; `run` is the one executor: it runs each in order (each
takes its part of the plan and what earlier steps returned, and returns its
own result), times each under its name, and holds what spans steps (the
state lock, a fetch started early) until the last one is done, or one
failed. Step modules are imported inside the steps, so `import prepare`
(and the CLI's `--help`) stays cheap.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from prepare.spec import Event, Prepared, PrepareSpec, Progress

if TYPE_CHECKING:
    from prepare.build.realise import Built
    from prepare.build.source import Source
    from prepare.build.warm import Choice
    from prepare.build.workspace import Workspace
    from prepare.gpu.devices import Gpus
    from prepare.host.dirs import LocalDirs
    from prepare.plan import Plan


@dataclass(frozen=True)
class Attempt:
    """One run of the steps: its plan, where the steps report (the caller's
    notes and progress), what spans steps (`held`), and what each step so
    far returned. A step never changes it: it returns its own result, and
    the executor makes the next Attempt with it."""

    plan: Plan
    notes: list[str]
    progress: Progress | None
    held: ExitStack
    # The nix program and environment the build steps run (a test's
    # counting wrapper around the real nix; None: this process's own).
    nix_program: str = "nix"
    nix_env: Mapping[str, str] | None = None
    gpus: Gpus | None = None
    data_path: str | None = None
    dirs: LocalDirs | None = None
    workspace: Workspace | None = None
    choice: Choice | None = None
    source: Source | None = None
    built: Built | None = None


@dataclass(frozen=True)
class Step:
    # The step's name: its key in Prepared.timings.
    name: str
    run: Callable[[Attempt], Attempt]
    # Whether the attempt needs the step at all (the build steps only for a
    # spec that asks for a libtorch or a source).
    wanted: Callable[[Attempt], bool] = lambda attempt: True
    # What it is doing, for the progress display and systemd's status line
    # (`STATUS=gate: checking the GPUs`).
    doing: str = ""


def _gate(a: Attempt) -> Attempt:
    from prepare.gpu import gate

    return replace(a, gpus=gate.check(a.plan.gate, a.notes))


def _data(a: Attempt) -> Attempt:
    from prepare.data import root

    return replace(a, data_path=root.ensure(a.plan.data, a.notes))


def _dirs(a: Attempt) -> Attempt:
    from prepare.host import dirs

    return replace(a, dirs=dirs.check(a.notes))


def _state(a: Attempt) -> Attempt:
    from prepare.build import workspace

    assert a.plan.build is not None
    opened = workspace.open(a.plan.build, a.notes, a.progress, a.held, nix_program=a.nix_program, env=a.nix_env)
    return replace(a, workspace=opened)


def _variant(a: Attempt) -> Attempt:
    from prepare.build import warm

    assert a.plan.build is not None and a.workspace is not None
    return replace(a, choice=warm.choose_variant(a.plan.build, a.workspace, a.gpus, a.notes, a.held))


def _source(a: Attempt) -> Attempt:
    from prepare.build import source

    assert a.plan.build is not None and a.workspace is not None and a.choice is not None
    box = a.plan.build.source
    if box is None:
        return a
    return replace(a, source=source.fetch(a.workspace, box, a.choice.fetch, a.notes))


def _build(a: Attempt) -> Attempt:
    from prepare.build import warm

    assert a.plan.build is not None and a.workspace is not None and a.choice is not None
    return replace(a, built=warm.build(a.plan.build, a.workspace, a.choice, a.source, a.gpus, a.notes))


def _smoke(a: Attempt) -> Attempt:
    from prepare import smoke

    assert a.built is not None and a.built.bin is not None and a.built.smoke
    smoke.run(a.built.bin, a.built.smoke, a.plan.smoke.timeout_s, a.notes, user=a.plan.smoke.user)
    return a


def _builds(a: Attempt) -> bool:
    return a.plan.build is not None


def _smokes(a: Attempt) -> bool:
    return a.built is not None and a.built.bin is not None and bool(a.built.smoke)


STEPS: tuple[Step, ...] = (
    Step("gate", _gate, doing="checking the GPUs"),
    Step("data", _data, doing="checking the dataset root"),
    Step("dirs", _dirs, doing="checking the node-local directories"),
    Step("state", _state, _builds, doing="opening the state directory, checking nix"),
    Step("variant", _variant, _builds, doing="choosing the libtorch variant"),
    Step("source", _source, _builds, doing="fetching the training source"),
    Step("build", _build, _builds, doing="building libtorch and the training binary"),
    Step("smoke", _smoke, _smokes, doing="running the training binary's smoke run"),
)


def prepare(spec: PrepareSpec, notes: list[str], *, progress: Progress | None = None) -> Prepared:
    """Run the pipeline once. Every step is idempotent, so a retry loop
    around this call is a provisioning loop: call it on every attempt."""
    from prepare.plan import plan

    return run(plan(spec), notes, progress=progress)


def run(
    plan: Plan,
    notes: list[str],
    *,
    progress: Progress | None = None,
    steps: Sequence[Step] = STEPS,
    nix_program: str = "nix",
    nix_env: Mapping[str, str] | None = None,
) -> Prepared:
    """The executor: `steps` (all of them unless a caller picks some) in
    their order on `plan`, each timed under its name."""
    timings: dict[str, float] = {}
    with ExitStack() as held:
        attempt = Attempt(plan, notes, progress, held, nix_program=nix_program, nix_env=nix_env)
        for step in steps:
            if not step.wanted(attempt):
                continue
            _tell(progress, {"type": "step-start", "name": step.name, "detail": step.doing})
            start = time.monotonic()
            ok = False
            try:
                attempt = step.run(attempt)
                ok = True
            finally:
                timings[step.name] = round(time.monotonic() - start, 4)
                _tell(progress, {"type": "step-done", "name": step.name, "seconds": timings[step.name], "ok": ok})
    return _prepared(attempt, timings)


def _tell(progress: Progress | None, event: Event) -> None:
    if progress is not None:
        # A broken display must not break preparation.
        with contextlib.suppress(Exception):
            progress(event)


def _prepared(a: Attempt, timings: dict[str, float]) -> Prepared:
    built = a.built
    # The cards the run uses are the built libtorch's vendor's (a CPU build
    # leaves them idle but they stay offered, in the numbering auto favours).
    variant = built.variant if built is not None else None
    vendor, devices = (None, None) if a.gpus is None else a.gpus.offered_for(variant.vendor if variant else None)
    return Prepared(
        data_path=a.data_path,
        libtorch=built.libtorch if built else None,
        bin=built.bin if built else None,
        args=built.args if built else None,
        run_id=built.run_id if built else None,
        devices=devices,
        gpu_vendor=vendor,
        timings=timings,
    )
