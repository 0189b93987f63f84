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
let go on every path, with Nix's TMPDIR (and build-dir) of this attempt
removed first.
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
from prepare.host import dirs, human, locks, state, trust
from prepare.nix import runner
from prepare.nix.diagnosis import BuildDir
from prepare.spec import Event, Progress, SshSpec

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

# Nix's TMPDIR for one attempt, a directory of its own under the box's, and
# where Nix builds in its build-dir instead, a build-dir of its own there:
# what a build leaves in them (`nix-build-<drv>-<n>`, `nix-<pid>-<n>` from
# 2.31, a copy of the source) goes with the attempt, and, when a SIGKILL
# left it, with the next.
NIX_TMP_PREFIX = "fdl-prepare-nix."
NIX_TMP_RECORD = "nix-tmp"
# Two paths, each at most PATH_MAX (4096 on Linux), one a line.
RECORD_BYTES = 2 * 4097


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
    runner that uses it (the box's caches, this attempt's TMPDIR and build-dir), the
    progress step emitter, and the system the flake's attributes are for."""

    state: str
    nix: runner.Nix
    step: Phases
    system: str
    # A check's own directory (`inspect`), removed when it ends: where its
    # Nix keeps the empty registry and the dry run its recipe, so that
    # nothing is written under `state`. None on an attempt.
    scratch: str | None = None
    # The ssh block, for a source fetched over ssh (prepare.build.transport).
    ssh: SshSpec | None = None


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
    root = build_root(env, notes, "nix builds")
    nix = _nix(plan, where, nix_program, env, progress)
    nix.notes = notes
    step = Phases(progress)
    # The wait for the lock may start the display (it says whom it waits for).
    held.callback(step.end)
    held.enter_context(_locked(where, lock_wait_s(plan.build_timeout_s), step, notes))
    # Under the lock: the directory a killed attempt left is this state
    # directory's to remove, and no other attempt is using it.
    held.enter_context(_nix_tmp(where, nix, root))
    return Workspace(state=where, nix=nix, step=step, system=runner.system(), ssh=plan.ssh)


def inspect(
    plan: BuildPlan,
    notes: list[str],
    progress: Progress | None,
    held: ExitStack,
    *,
    nix_program: str = "nix",
    env: Mapping[str, str] | None = None,
) -> tuple[Workspace, bool]:
    """Step 4 of `fdl-prepare check`: the state directory judged as `open`
    judges it and proven writable by a probe (or, when missing, the place
    it would be made in), and a Nix recent enough; nothing is made, and the
    lock is not taken (only said, when another prepare holds it). What the
    steps after it write (the flake registry, the recipe) goes to a scratch
    directory of this check's, removed with `held`. Returns the workspace
    and whether the state directory exists."""
    where = plan.state_dir
    var = "state_dir (--state-dir)"
    exists = state.vet(where, plan.state_origin, var, change=False)
    if exists:
        dirs.probe(where, f"the state directory {where}", plan.state_origin, var=var)
        gcroots = os.path.join(where, "gcroots")
        if os.path.isdir(gcroots):
            dirs.probe(gcroots, "the state directory's gcroots", plan.state_origin, var=var)
        _note_holder(os.path.join(where, "lock"), lock_wait_s(plan.build_timeout_s), notes)
    build_root(env, notes, "an attempt's nix would build", make=False)
    scratch = tempfile.mkdtemp(prefix="fdl-prepare-check.")
    held.callback(shutil.rmtree, scratch, ignore_errors=True)
    nix = _nix(plan, scratch, nix_program, env, progress)
    step = Phases(progress)
    held.callback(step.end)
    return Workspace(state=where, nix=nix, step=step, system=runner.system(), scratch=scratch, ssh=plan.ssh), exists


def build_root(env: Mapping[str, str] | None, notes: list[str], who: str, *, make: bool = True) -> str:
    """The directory under which this attempt's Nix gets its TMPDIR, where
    Nix before 2.30 (and any without a build-dir) makes each build's
    directory: one no one but root (or this user) can write, nor any
    directory above it (`trust.open_above`, with lstat).

    With the sandbox off (Debian's Nix, Nix 2.8 here) a build sees the whole
    file system, and cargo reads `.cargo/config.toml` from every directory
    above its own: under /tmp, any local user (or an earlier smoke run) can
    plant one whose `rustc-wrapper` runs inside every later build, and on a
    publish host gets its output signed into the cache every box trusts.
    So the box's TMPDIR is taken only when that holds of it; else Nix's own
    `<state>/builds` (/nix/var/nix/builds: where Nix 2.30 and later build by
    default, for the same reason, on the store's disk), made as Nix makes
    it. Run as root, Nix's build users must pass through it. Said in a note
    when TMPDIR is set aside; a permanent `nix.build-dir` when neither will
    do."""
    base_env = os.environ if env is None else env
    tmpdir = base_env.get("TMPDIR") or "/tmp"
    root = os.geteuid() == 0
    doubt = trust.open_above(tmpdir)
    if doubt is None and (not root or trust.enterable_by_others(tmpdir)):
        return tmpdir
    builds = os.path.join(base_env.get("NIX_STATE_DIR") or runner.NIX_STATE_DIR, "builds")
    if make:
        with contextlib.suppress(OSError):
            os.makedirs(builds, 0o755, exist_ok=True)
    # Judged as far as it exists (a check makes nothing).
    there = builds if os.path.isdir(builds) else os.path.dirname(builds)
    if not root and not os.access(there, os.W_OK | os.X_OK):
        # Not root, Nix builds as this user only in a store of its own,
        # whose state directory it can write; else the daemon builds, where
        # it decides, and TMPDIR is only the client's own scratch.
        return tmpdir
    shown = human.printable(builds)
    ahead = trust.open_above(there)
    if ahead is None and (not root or trust.enterable_by_others(there)):
        why = f"{doubt.path} {doubt.why}" if doubt is not None else "Nix's build users cannot enter it"
        notes.append(
            f"TMPDIR {human.printable(repr(tmpdir))} is not where builds may run ({human.printable(why)}): with "
            "Nix's sandbox off a build reads what lies above its directory (cargo's .cargo/config.toml), so "
            f"{who} under {shown} instead, which only root can write"
        )
        return builds
    worst = ahead or doubt
    why = f"{worst.path}, which {worst.why}" if worst is not None else f"{there}, which Nix's build users cannot enter"
    raise Fail(
        "nix.build-dir",
        f"no directory for builds that only root can write and Nix's build users can enter: TMPDIR "
        f"{human.printable(repr(tmpdir))} and {shown} have {human.printable(why)}. With the sandbox off a build "
        "reads .cargo/config.toml from every directory above it, so a directory others can write there lets them "
        "run code in every build. Fix: set TMPDIR to a directory only root can write, none above it writable by "
        f"others either, that Nix's build users can enter (e.g. `install -d -m 0755 {shown}`), or "
        + (
            f"`sudo chmod go-w {human.printable(worst.path)}`"
            if worst is not None
            else f"let them pass through it (`sudo chmod o+x {human.printable(there)}`)"
        ),
    )


def _nix(
    plan: BuildPlan, state_dir: str, program: str, env: Mapping[str, str] | None, progress: Progress | None
) -> runner.Nix:
    """The Nix the build steps call, its version checked."""
    nix = runner.Nix(
        state_dir,
        program=program,
        env=env,
        on_event=progress,
        substituters=plan.nix.substituters,
        trusted_public_keys=plan.nix.trusted_public_keys,
    )
    nix.check_version()
    return nix


def _note_holder(path: str, wait_s: float, notes: list[str]) -> None:
    """Say when another prepare holds the state lock now: an attempt would
    wait for it. Asked without taking it for longer than the asking (a
    shared lock, let go at once), and never by making the file."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        notes.append(
            f"another fdl-prepare holds {path} now: an attempt would wait for it (up to {human.duration(wait_s)}) "
            "before its build steps"
        )
    except OSError:
        pass
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


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
def _nix_tmp(where: str, nix: runner.Nix, base: str) -> Iterator[None]:
    """Give `nix` a TMPDIR of this attempt's own under the one it has and,
    before its first call that may build, a build-dir of the attempt's own
    where builds do not follow TMPDIR (`_own_build_dir`); their paths are
    recorded in <state>/nix-tmp, one a line. The ones a killed attempt left
    go first, this attempt's at the end. `base` is `build_root`'s. Where one
    cannot be made (its disk is full), Nix gets `base` itself: the build
    then says what is full."""
    record = os.path.join(where, NIX_TMP_RECORD)
    _remove_left_tmp(record)
    made: list[str] = []
    try:
        tmp = tempfile.mkdtemp(prefix=NIX_TMP_PREFIX, dir=base)
        made.append(tmp)
        # Nix's build users enter it (a single-user Nix as root builds as them).
        os.chmod(tmp, 0o755)
        _record(record, made)
    except OSError:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        made.clear()
        tmp = base
    nix.env = {**(nix.env if nix.env is not None else os.environ), "TMPDIR": tmp}
    nix.builds = BuildDir(base, "TMPDIR")
    nix.own_build_dir = lambda parent: _own_build_dir(parent, record, made)
    try:
        yield
    finally:
        nix.own_build_dir = None
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(record)


def _own_build_dir(parent: str, record: str, made: list[str]) -> str | None:
    """Nix 2.30 and later build in their build-dir (`parent`:
    /nix/var/nix/builds unless nix.conf sets one), not under TMPDIR: a
    build-dir of this attempt's own under it (`--option build-dir`) keeps
    what a build leaves there with the attempt, as the TMPDIR of its own
    does for earlier Nix, on the disk Nix would have used. 0711: the build
    users must pass through it when the sandbox is off (Nix makes each
    build's own directory inside, 0700 and theirs), and no one else may
    list or write it (Nix refuses a build-dir under a directory others can
    write). None, and Nix builds where it would have, when it cannot be
    made or recorded (unrecorded, a SIGKILL would leave it for good)."""
    try:
        # What Nix would make at its first build, as Nix makes it.
        os.makedirs(parent, 0o755, exist_ok=True)
        own = tempfile.mkdtemp(prefix=NIX_TMP_PREFIX, dir=parent)
    except OSError:
        return None
    made.append(own)
    try:
        os.chmod(own, 0o711)
        _record(record, made)
    except OSError:
        made.remove(own)
        shutil.rmtree(own, ignore_errors=True)
        return None
    return own


def _record(record: str, made: list[str]) -> None:
    state.write_file(record, "".join(f"{path}\n" for path in made).encode(), "state directory")


def _remove_left_tmp(record: str) -> None:
    """The directories an earlier attempt recorded and did not remove (it
    was killed): each removed when it is still one of ours (a real
    directory of this user's, with our name), never through a link."""
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with os.fdopen(fd, "rb") as handle:
            left = handle.read(RECORD_BYTES).decode("utf-8", "replace").splitlines()
    except OSError:
        return
    for path in left[:2]:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if (
                os.path.isabs(path)
                and os.path.basename(path).startswith(NIX_TMP_PREFIX)
                and stat.S_ISDIR(st.st_mode)
                and st.st_uid == os.geteuid()
            ):
                shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(record)
