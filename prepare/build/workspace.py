"""Step 4: the state directory, Nix, and the state lock, before the first
evaluation.

The state directory holds the GC roots of built outputs, the recipe handed
to the flake and the warm path's record: it is vetted (root writes there,
so nothing in it may be a link elsewhere or another user's:
prepare.host.state) and proven writable by a write, as the node-local
directories are, before a build is spent. Then a Nix recent enough, and
`<state>/lock`: a second prepare on the box waits for the first (saying
so), bounded, since afterwards its own run is a warm no-op. The lock covers
the evaluation, the fetch and the build alike (steps 5 to 7): the recipe
and the out-links they write are the state directory's, one set for the
box. It is held by whoever runs the steps (the pipeline's ExitStack), and
let go on every path, with Nix's TMPDIR of this attempt removed first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from prepare.build.plan import BuildPlan
from prepare.fail import Fail
from prepare.host import dirs, human, locks, state
from prepare.nix import runner
from prepare.spec import Event, Progress

# How long a prepare waits for another one holding <state>/lock. Waiting is
# normal: a restart racing a manual run builds the same thing, and once the
# holder is done ours is a warm no-op. The bound only turns a stuck holder
# into a transient Fail naming the lock instead of a silent hang. With
# build_timeout_s set, the holder's whole locked section is bounded (one
# evaluation, one fetch, the build and its grace), so the wait is that plus
# LOCK_MARGIN_S; without it the build is unbounded, and LOCK_WAIT_S (6 h) is
# longer than any sane cold build of libtorch and a training binary.
LOCK_WAIT_S = 6 * 3600.0
LOCK_MARGIN_S = runner.EVAL_TIMEOUT_S + runner.FETCH_TIMEOUT_S + runner.BUILD_GRACE_S + 60.0

# Nix's TMPDIR for one attempt: a directory of its own under the box's, so
# that what a build leaves there (`nix-build-<drv>-<n>`, a copy of the
# source) goes with the attempt, and, when a SIGKILL left it, with the next.
NIX_TMP_PREFIX = "fdl-prepare-nix."
NIX_TMP_RECORD = "nix-tmp"


class Phases:
    """Step events for the progress display, around the nix events."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress

    def __call__(self, name: str, detail: str) -> None:
        self._send({"type": "step", "name": name, "detail": detail})

    def end(self) -> None:
        self._send({"type": "end"})

    def _send(self, event: Event) -> None:
        if self.progress is not None:
            # A broken display must not break preparation.
            with contextlib.suppress(Exception):
                self.progress(event)


@dataclass(frozen=True)
class Workspace:
    """What step 4 made for steps 5 to 7: the state directory, the Nix
    runner that uses it (the box's caches, this attempt's TMPDIR), the
    progress step emitter, and the system the flake's attributes are for."""

    state: str
    nix: runner.Nix
    step: Phases
    system: str


def open(
    plan: BuildPlan,
    notes: list[str],
    progress: Progress | None,
    held: ExitStack,
    *,
    nix_program: str = "nix",
    env: Mapping[str, str] | None = None,
) -> Workspace:
    """The state directory proven, a Nix recent enough, and the state lock
    taken (waiting for another prepare, bounded, and saying so): held in
    `held`, with the display's end, until the caller closes it."""
    where = plan.state_dir
    var = "state_dir (--state-dir)"
    # Root writes and removes entries here: none of them may be a link
    # elsewhere, or another user's (prepare.host.state).
    state.vet(where, plan.state_origin, var)
    # The same proof as the node-local directories: it holds the GC roots
    # of built outputs, so it must take a write before a build is spent.
    dirs.prove_writable(os.path.join(where, "gcroots"), "the state directory's gcroots", plan.state_origin, var=var)
    base_env = os.environ if env is None else env
    tmpdir = runner.build_tmpdir(base_env)
    if tmpdir is not None:
        notes.append(
            f"TMPDIR {base_env.get('TMPDIR', '/tmp')!r} cannot be entered by Nix's build users (a single-user Nix "
            f"as root builds there as them): nix builds under {tmpdir} instead"
        )
        env = {**base_env, "TMPDIR": tmpdir}
    nix = runner.Nix(
        where,
        program=nix_program,
        env=env,
        on_event=progress,
        substituters=plan.nix.substituters,
        trusted_public_keys=plan.nix.trusted_public_keys,
    )
    nix.check_version()
    step = Phases(progress)
    # The wait for the lock may start the display (it says whom it waits for).
    held.callback(step.end)
    held.enter_context(_locked(where, lock_wait_s(plan.build_timeout_s), step, notes))
    # Under the lock: the directory a killed attempt left is this state
    # directory's to remove, and no other attempt is using it.
    held.enter_context(_nix_tmp(where, nix))
    return Workspace(state=where, nix=nix, step=step, system=runner.system())


def lock_wait_s(build_timeout_s: float | None) -> float:
    """The longest a prepare waits for <state>/lock (see LOCK_WAIT_S)."""
    if build_timeout_s:
        return float(build_timeout_s) + LOCK_MARGIN_S
    return LOCK_WAIT_S


@contextmanager
def _locked(where: str, wait_s: float, step: Callable[[str, str], None], notes: list[str]) -> Iterator[None]:
    """Two prepares on one box (a restart racing a manual run) must not
    rewrite the recipe or the out-links under each other. A busy lock is
    said at once (a progress step and a note), then waited for, bounded."""
    path = os.path.join(where, "lock")
    with locks.held(
        path,
        wait_s,
        cannot_open=lambda err: Fail(
            "dirs.unwritable",
            f"cannot open the state lock {path}: {human.oserror(err)}; make {where} writable for this user, "
            "or set state_dir (--state-dir) to a directory it can write",
        ),
        stuck=(
            f"another fdl-prepare has held {path} for over {human.duration(wait_s)} and this one stopped "
            f"waiting: it is probably stuck. See who holds it (`fuser -v {path}`, or `systemctl status` "
            "of the unit), stop it if it is wedged; the next attempt retries"
        ),
        waiting=lambda line: step("wait", line),
        notes=notes,
    ):
        yield


@contextmanager
def _nix_tmp(where: str, nix: runner.Nix) -> Iterator[None]:
    """Give `nix` a TMPDIR of this attempt's own under the one it has, its
    path recorded in <state>/nix-tmp; remove the one a killed attempt left
    first, and this one at the end. Where none can be made (the TMPDIR is
    full), nix keeps its own: the build then says what is full."""
    base = (nix.env if nix.env is not None else os.environ).get("TMPDIR") or "/tmp"
    record = os.path.join(where, NIX_TMP_RECORD)
    _remove_left_tmp(record)
    try:
        made = tempfile.mkdtemp(prefix=NIX_TMP_PREFIX, dir=base)
        # Nix's build users enter it (a single-user Nix as root builds as them).
        os.chmod(made, 0o755)
        state.write_file(record, made.encode(), "state directory")
    except OSError:
        yield
        return
    nix.env = {**(nix.env if nix.env is not None else os.environ), "TMPDIR": made}
    nix.build_dir = base
    try:
        yield
    finally:
        shutil.rmtree(made, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(record)


def _remove_left_tmp(record: str) -> None:
    """The directory an earlier attempt recorded and did not remove (it was
    killed): removed when it is still one of ours (a real directory of this
    user's, with our name), never through a link."""
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with os.fdopen(fd, "rb") as handle:
            left = handle.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return
    with contextlib.suppress(OSError):
        st = os.lstat(left)
        if (
            os.path.isabs(left)
            and os.path.basename(left).startswith(NIX_TMP_PREFIX)
            and stat.S_ISDIR(st.st_mode)
            and st.st_uid == os.geteuid()
        ):
            shutil.rmtree(left, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(record)
