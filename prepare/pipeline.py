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

`check` (`fdl-prepare check`) runs the same steps in the same order, each
through its `check` counterpart: what the step would settle, settled as
far as can be without changing the box or spending minutes. The GPU gate
is the gate (the driver directory only looked at); the dataset root is
listed, an existing mount judged, a source not mounted yet reached with
sftp and its directory found; the local directories and the state
directory are judged and proven writable by probes that leave nothing
behind (a missing one by where it would be made); the flake is resolved
and evaluated, the source fetched and its manifest read; the build is
asked of Nix as a dry run (what it would build, what substitute); the
smoke run's user is resolved. Nothing is mounted, built, linked or
recorded, no directory made, no lock taken. A step's Fail is the
attempt's, and ends the check there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from prepare.fail import Fail
from prepare.spec import Checked, Event, Prepared, PrepareSpec, Progress, StepCheck

if TYPE_CHECKING:
    from prepare.build.realise import Built
    from prepare.build.source import Source
    from prepare.build.warm import Choice
    from prepare.build.workspace import Workspace
    from prepare.gpu.devices import Gpus
    from prepare.host.dirs import LocalDirs
    from prepare.nix.runner import DryRun
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
    # A check's dry run of the build (step 7 of `check`).
    dry_run: DryRun | None = None


def _always(attempt: Attempt) -> bool:
    return True


@dataclass(frozen=True)
class Step:
    # The step's name: its key in Prepared.timings.
    name: str
    run: Callable[[Attempt], Attempt]
    # `check`'s counterpart of `run`: the same settled without changing
    # the box, and the step's verdict.
    check: Callable[[Attempt], tuple[Attempt, StepCheck]]
    # Whether the attempt needs the step at all (the build steps only for a
    # spec that asks for a libtorch or a source), and, in a check, why not.
    wanted: Callable[[Attempt], bool] = _always
    skipped: str = ""
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
    built = warm.build(a.plan.build, a.workspace, a.choice, a.source, a.gpus, a.notes)
    if built.bin is not None and a.source is not None:
        # The run's cwd made writable before the smoke run starts in it.
        from prepare import handoff
        from prepare.build import rundir

        owner = handoff.owner(handoff.training_user(a.plan))
        built = rundir.provide(a.workspace.state, built, a.source, owner, a.notes)
    return replace(a, built=built)


def _smoke(a: Attempt) -> Attempt:
    from prepare import handoff, smoke

    assert a.built is not None and a.built.bin is not None and a.built.smoke
    smoke.run(a.built.bin, a.built.smoke, a.plan.smoke.timeout_s, a.notes, user=handoff.training_user(a.plan))
    return a


def _builds(a: Attempt) -> bool:
    return a.plan.build is not None


def _smokes(a: Attempt) -> bool:
    if a.built is not None:
        return a.built.bin is not None and bool(a.built.smoke)
    # A check builds nothing: the recipe says whether the attempt would run it.
    return a.source is not None and bool(a.source.recipe.smoke)


# -- each step's check counterpart --------------------------------------------------


def _gate_check(a: Attempt) -> tuple[Attempt, StepCheck]:
    from prepare.gpu import gate

    gpus = gate.check(a.plan.gate, a.notes, change=False)
    if gpus is None:
        return a, StepCheck("skipped", "cpu_only: no GPU is gated or offered, only the cpu libtorch can be used")
    vendor, offered = gpus.offered_for(None)
    cards = ", ".join(str(i) for i in offered)
    return replace(a, gpus=gpus), StepCheck("ok", f"offering {'AMD' if vendor == 'amd' else 'NVIDIA'} GPU {cards}")


def _data_check(a: Attempt) -> tuple[Attempt, StepCheck]:
    from prepare.data import root

    path, verdict, detail = root.check(a.plan.data, a.notes)
    return replace(a, data_path=path), StepCheck(verdict, detail)


def _dirs_check(a: Attempt) -> tuple[Attempt, StepCheck]:
    from prepare.host import dirs

    found = dirs.check(a.notes, change=False)
    said = f"dataset cache {found.cache}, stage {found.stage}"
    if found.missing:
        return replace(a, dirs=found), StepCheck("would create", f"{', '.join(found.missing)} (writable); {said}")
    return replace(a, dirs=found), StepCheck("ok", f"{said}: both writable")


def _state_check(a: Attempt) -> tuple[Attempt, StepCheck]:
    from prepare.build import workspace

    assert a.plan.build is not None
    ws, exists = workspace.inspect(a.plan.build, a.notes, a.progress, a.held, nix_program=a.nix_program, env=a.nix_env)
    if not exists:
        return replace(a, workspace=ws), StepCheck(
            "would create", f"the state directory {ws.state} (its parent writable)"
        )
    return replace(a, workspace=ws), StepCheck("ok", f"the state directory {ws.state}, writable")


def _variant_check(a: Attempt) -> tuple[Attempt, StepCheck]:
    done = _variant(a)
    assert done.choice is not None
    variant = done.choice.variant
    if variant.vendor is None:
        return done, StepCheck("ok", f"{variant.label} ({variant.runtime}): no GPU kernels to cover")
    kernels = variant.gfx_text if variant.vendor == "amd" else variant.archs_text
    return done, StepCheck(
        "ok", f"{variant.label} ({variant.runtime}, kernels for {kernels}): covers the offered cards"
    )


def _source_check(a: Attempt) -> tuple[Attempt, StepCheck]:
    done = _source(a)
    if done.source is None:
        return done, StepCheck("skipped", "no training source (source.from): libtorch alone")
    fetched, recipe = done.source.fetched, done.source.recipe
    rev = (fetched.locked or {}).get("rev") if fetched.locked else None
    said = f"{fetched.url} at {fetched.store_path}" + (f" (rev {str(rev)[:12]})" if rev else "")
    return done, StepCheck("ok", f"{said}; bin {recipe.bin}")


def _build_check(a: Attempt) -> tuple[Attempt, StepCheck]:
    from prepare.build import warm

    ws = a.workspace
    assert a.plan.build is not None and ws is not None and ws.scratch is not None and a.choice is not None
    dry = warm.preview(a.plan.build, ws, a.choice, a.source, a.gpus, a.notes, ws.scratch)
    if dry is None:
        return a, StepCheck("ok", "nothing to build: an earlier attempt's outputs are in the store")
    done = replace(a, dry_run=dry)
    if dry.unknown:
        # Not met in practice (the one store path the build names, the
        # source, was fetched a moment ago): said, not guessed at.
        a.notes.append(
            f"nix can neither build nor fetch {len(dry.unknown)} store path(s) the build names ("
            + ", ".join(dry.unknown[:3])
            + "): the attempt's build would stop on them"
        )
    parts = []
    if dry.build_count:
        parts.append(f"{dry.build_count} derivation(s) to build")
    if dry.fetch_count:
        parts.append(f"{dry.fetch_count} path(s) to substitute" + (f" ({dry.fetch_size})" if dry.fetch_size else ""))
    if not parts:
        return done, StepCheck("ok", "everything is in the store: an attempt only links its GC roots")
    return done, StepCheck("would build" if dry.build_count else "would substitute", ", ".join(parts))


def _smoke_check(a: Attempt) -> tuple[Attempt, StepCheck]:
    import shlex

    from prepare import handoff
    from prepare.host import confine, human

    assert a.source is not None
    recipe = a.source.recipe
    # Resolved as the run would be (a missing or root smoke_user is the
    # config's error), then its home removed again.
    confinement = confine.enter(handoff.training_user(a.plan))
    confine.leave(confinement)
    command = human.printable(shlex.join([recipe.bin, *(recipe.smoke or ())]))
    if len(command) > 200:
        command = command[:200] + " ... (cut)"
    who = confinement.describe(None)
    return a, StepCheck("would run", f"`{command}` {who}, within {a.plan.smoke.timeout_s:g}s")


_NO_BUILD = "no libtorch and no training source asked for (libtorch, source.from)"

STEPS: tuple[Step, ...] = (
    Step("gate", _gate, _gate_check, doing="checking the GPUs"),
    Step("data", _data, _data_check, doing="checking the dataset root"),
    Step("dirs", _dirs, _dirs_check, doing="checking the node-local directories"),
    Step("state", _state, _state_check, _builds, _NO_BUILD, doing="opening the state directory, checking nix"),
    Step("variant", _variant, _variant_check, _builds, _NO_BUILD, doing="choosing the libtorch variant"),
    Step("source", _source, _source_check, _builds, _NO_BUILD, doing="fetching the training source"),
    Step("build", _build, _build_check, _builds, _NO_BUILD, doing="building libtorch and the training binary"),
    Step(
        "smoke",
        _smoke,
        _smoke_check,
        _smokes,
        "the recipe asks for no smoke run (smoke)",
        doing="running the training binary's smoke run",
    ),
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
        done = _prepared(attempt, timings)
        if attempt.workspace is not None:
            # Only a prepared box hands off, and under the state lock.
            from prepare import handoff

            handoff.hand_off(plan, attempt.workspace.state, done, notes)
    return done


def check(spec: PrepareSpec, notes: list[str], *, progress: Progress | None = None) -> Checked:
    """What an attempt on `spec` would do, found out without changing the
    box (`fdl-prepare check`): never raises a Fail, it returns it, in
    `Checked.fail`, with every step's verdict up to it."""
    from prepare.plan import plan

    try:
        planned = plan(spec)
    except Fail as fail:
        verdicts = {"plan": StepCheck("failed", f"{fail.kind} [{fail.reason}]")}
        verdicts.update({s.name: StepCheck("not checked", "the plan failed first") for s in STEPS})
        return Checked(verdicts, fail=fail)
    return run_check(planned, notes, progress=progress)


def run_check(
    plan: Plan,
    notes: list[str],
    *,
    progress: Progress | None = None,
    steps: Sequence[Step] = STEPS,
    nix_program: str = "nix",
    nix_env: Mapping[str, str] | None = None,
) -> Checked:
    """The executor, in check mode: each of `steps` in order through its
    check counterpart (those the attempt would skip said so), each timed
    under its name; the first Fail ends it, and is the result's."""
    verdicts = {"plan": StepCheck("ok", "the config and flags are valid")}
    timings: dict[str, float] = {}
    with ExitStack() as held:
        attempt = Attempt(plan, notes, progress, held, nix_program=nix_program, nix_env=nix_env)
        for index, step in enumerate(steps):
            if not step.wanted(attempt):
                verdicts[step.name] = StepCheck("skipped", step.skipped)
                continue
            _tell(progress, {"type": "step-start", "name": step.name, "detail": step.doing})
            start = time.monotonic()
            ok = False
            try:
                attempt, verdicts[step.name] = step.check(attempt)
                ok = True
            except Fail as fail:
                verdicts[step.name] = StepCheck("failed", f"{fail.kind} [{fail.reason}]")
                for rest in steps[index + 1 :]:
                    verdicts[rest.name] = StepCheck("not checked", f"{step.name} failed first")
                return Checked(verdicts, fail=fail, timings=timings)
            finally:
                timings[step.name] = round(time.monotonic() - start, 4)
                _tell(progress, {"type": "step-done", "name": step.name, "seconds": timings[step.name], "ok": ok})
    dry = attempt.dry_run
    if dry is None:
        return Checked(verdicts, timings=timings)
    return Checked(verdicts, substitute=dry.fetch, build=dry.build, download=dry.fetch_size, timings=timings)


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
    nvml = None
    if a.gpus is not None and devices is not None and vendor != "amd":
        # floDl's ranks take CUDA ordinals; NVML's indices stay beside them.
        from prepare.handoff import cuda_ordinals

        nvml, devices = devices, cuda_ordinals(a.gpus, devices)
    return Prepared(
        data_path=a.data_path,
        libtorch=built.libtorch if built else None,
        bin=built.bin if built else None,
        args=built.args if built else None,
        run_id=built.run_id if built else None,
        devices=devices,
        gpu_vendor=vendor,
        nvml_indices=nvml,
        timings=timings,
    )
