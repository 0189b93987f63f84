"""Steps 4 and 5: a libtorch variant that serves this box's cards, and the
training binary built from the published source against it.

The order inside is as load-bearing as the pipeline's, which calls each
part (`build` runs them in the same order):

1. `start`: the spec is checked first (a flake named, a pinned source URL,
   neither one a path Nix would resolve against the working directory, sane
   box recipe values): no nix call is spent on a config that cannot work.
   Then `<state>/lock`: a second prepare on the box waits for the first
   (saying so), bounded, since afterwards its own run is a warm no-op.
2. `choose_variant`: the variant and its arch coverage come from
   *evaluating* the flake's `fdl.variants`: nothing is fetched or built
   before a card that the variant ships no kernel for is refused (permanent).
   A re-dial takes them from `<state>/warm.json` instead (record.py): as
   they were, for the flake as locked then; as they were *recorded*, for a
   flake that changed since, in which case the build asks for its outputs
   under `ifVariants.<digest>` and so builds nothing unless the new flake's
   variants are those (see `_predicted`).
3. `fetch_source`: the training source is fetched once per attempt (`nix
   flake prefetch`), which re-resolves a moving ref, so a re-dial after a new
   publish sees the new commit. The build then gets *that* tree by store path
   and NAR hash (`--override-input source path:<store>?narHash=`), never the
   URL: the ref cannot move between fetch and build. On a re-dial of the
   source the box built before, the fetch starts beside the flake's
   resolution, before step 2 (see `_start_source_fetch`).
4. Also `fetch_source`: the manifest is read from the fetched tree and merged
   over the box's recipe. `build_outputs` hands the result to the flake as
   `recipe.json` in a directory under the state directory
   (`--override-input recipe path:<dir>`), which is how it reaches the build
   with evaluation kept pure.
5. `build_outputs`: one `nix build` of libtorch, the training binary and the source tree, with
   out-links under `<state>/gcroots/`: they are GC roots, so a garbage
   collection never deletes what a prepared run is about to use. Nix writes
   an out-link only once its output is complete, so a build stopped midway
   (SIGTERM, timeout) leaves the previous links, each to a complete output.

What `Binary.cwd` means for a store-built binary: the fetched source tree at
the recipe's `cwd` (`<source store path>/<cwd>`), the same directory the build
ran in, so relative paths in the run's arguments resolve as they did on the
publisher's machine. It is read-only (it is a store path, kept alive by the
`source` GC root); a run writes to the stage or cache directories, never to
its cwd.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prepare import config
from prepare.nix import caches
from prepare.host import dirs
from prepare.host import human
from prepare.host import locks
from prepare.nix import urls
from prepare.build import outputs
from prepare.build import manifest as manifest_mod
from prepare.nix import runner as nix_mod
from prepare.build import record as record_mod
from prepare.host import state as state_mod
from prepare.build import variants as variants_mod
from prepare.fail import Fail
from prepare.nix.log import Log, store_name
from prepare.spec import Binary, Libtorch, PrepareSpec

if TYPE_CHECKING:
    from prepare.gpu.devices import Gpus
    from prepare.spec import Event, Progress

CONTRACT = 1


# How long a prepare waits for another one holding <state>/lock. Waiting is
# normal: a restart racing a manual run builds the same thing, and once the
# holder is done ours is a warm no-op. The bound only turns a stuck holder
# into a transient Fail naming the lock instead of a silent hang. With
# build_timeout_s set, the holder's whole locked section is bounded (one
# evaluation, one fetch, the build and its grace), so the wait is that plus
# LOCK_MARGIN_S; without it the build is unbounded, and LOCK_WAIT_S (6 h) is
# longer than any sane cold build of libtorch and a training binary.
LOCK_WAIT_S = 6 * 3600.0
LOCK_MARGIN_S = nix_mod.EVAL_TIMEOUT_S + nix_mod.FETCH_TIMEOUT_S + nix_mod.BUILD_GRACE_S + 60.0


@dataclass(frozen=True)
class Built:
    libtorch: Libtorch | None
    bin: Binary | None
    args: tuple[str, ...] | None
    run_id: str | None
    # The smoke run's arguments (the recipe's), for the pipeline.
    smoke: tuple[str, ...] | None = None
    # The variant built: the one chosen, or the one chosen anew when the
    # flake did not bear out a prediction (see `build_outputs`).
    variant: variants_mod.Variant | None = None


# -- the state directory ----------------------------------------------------------


def default_state_dir(env: dict[str, str] | None = None, uid: int | None = None) -> str:
    """systemd's StateDirectory= first (a unit that declares one owns it),
    then the XDG state home, then the per-user default; root gets /var/lib."""
    env = dict(os.environ) if env is None else env
    uid = os.getuid() if uid is None else uid
    from_unit = config.env_value(env, config.STATE_ENV)
    if from_unit:
        return from_unit
    # The XDG spec has a relative XDG_STATE_HOME ignored: it would move with
    # the working directory.
    if env.get("XDG_STATE_HOME", "").startswith("/"):
        return os.path.join(env["XDG_STATE_HOME"], "fdl-prepare")
    if uid == 0:
        return "/var/lib/fdl-prepare"
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".local", "state", "fdl-prepare")


def _state_origin(spec: PrepareSpec, env: dict[str, str]) -> str:
    """Where the state directory came from, for the message about it: as
    the config resolved it, else from the spec, else our own default."""
    if spec.state_dir:
        origin = spec.origin("state_dir")
        return str(origin) if origin is not None else "state_dir, --state-dir"
    from_unit = config.env_value(env, config.STATE_ENV)
    if from_unit:
        return f"${config.STATE_ENV}, systemd's StateDirectory="
    if env.get("XDG_STATE_HOME", "").startswith("/"):
        return "$XDG_STATE_HOME"
    return "the default for root" if os.getuid() == 0 else "the default for this user"


def _ensure_state_dir(spec: PrepareSpec) -> str:
    env = dict(os.environ)
    state = os.path.abspath(spec.state_dir or default_state_dir(env))
    origin = _state_origin(spec, env)
    var = "state_dir (--state-dir)"
    # Root writes and removes entries here: none of them may be a link
    # elsewhere, or another user's (prepare.host.state).
    state_mod.vet(state, origin, var)
    # The same proof as the node-local directories: it holds the GC roots
    # of built outputs, so it must take a write before a build is spent.
    dirs.prove_writable(os.path.join(state, "gcroots"), "the state directory's gcroots", origin, var=var)
    return state


def lock_wait_s(build_timeout_s: float | None) -> float:
    """The longest a prepare waits for <state>/lock (see LOCK_WAIT_S)."""
    if build_timeout_s:
        return float(build_timeout_s) + LOCK_MARGIN_S
    return LOCK_WAIT_S


@contextmanager
def _locked(state: str, wait_s: float, step: Callable[[str, str], None], notes: list[str]) -> Iterator[None]:
    """Two prepares on one box (a restart racing a manual run) must not
    rewrite the recipe or the out-links under each other. A busy lock is
    said at once (a progress step and a note), then waited for, bounded."""
    path = os.path.join(state, "lock")
    with locks.held(
        path,
        wait_s,
        cannot_open=lambda err: Fail(
            "dirs.unwritable",
            f"cannot open the state lock {path}: {human.oserror(err)}; make {state} writable for this user, "
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


# -- the steps ------------------------------------------------------------------------


class _Phases:
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


class Session:
    """What steps 4 and 5 share within one attempt: the checked spec, the
    state directory and the Nix runner that uses it, the progress step
    emitter, and `<state>/lock`.

    Made with the lock held (as `open` returns a file already open): the
    wait for another prepare is over, or has failed, before the first
    evaluation; `with session:` lets go of the lock and ends the progress
    display. The lock covers the evaluation, the fetch and the build alike:
    the recipe and the out-links they write are the state directory's, one
    set for the box."""

    def __init__(
        self, spec: PrepareSpec, notes: list[str], flake: str, state: str, nix: nix_mod.Nix, step: _Phases
    ) -> None:
        self.spec = spec
        self.notes = notes
        self.flake = flake
        self.state = state
        self.nix = nix
        self.step = step
        self.system = nix_mod.system()
        self.fdl = f"{flake}#legacyPackages.{self.system}.fdl"
        # Filled by choose_variant: the flake's identity for the warm-path
        # record (None: evaluate as usual), the record when it is this
        # flake's, and the variant metadata to record.
        self.flake_key: str | None = None
        self.record: record_mod.Record | None = None
        self.variants_raw: Any = None
        # Filled by choose_variant for a flake this state directory has not
        # seen, on a box that has been through the gate before: the digest
        # of the recorded variants the choice was made from (see
        # `_predicted`), the cards it was made for, and the notes it made.
        self.gated: str | None = None
        self.gpus: Gpus | None = None
        self.gated_notes: list[str] = []
        # The training source's fetch, started beside the flake's resolution
        # on a re-dial (see `_start_source_fetch`).
        self.source_fetch: nix_mod.PendingFetch | None = None
        self._held = ExitStack()
        try:
            self._held.enter_context(_locked(state, lock_wait_s(spec.build_timeout_s), step, notes))
            # Under the lock: the directory a killed attempt left is this
            # state directory's to remove, and no other attempt is using it.
            self._held.enter_context(_nix_tmp(state, nix))
        except BaseException:
            # The wait may have started the display (it says whom it waits for).
            self._held.close()
            step.end()
            raise

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.source_fetch is not None:
                # Started and never waited for: an earlier step failed.
                self.source_fetch.stop()
            self._held.close()
        finally:
            self.step.end()


# Nix's TMPDIR for one attempt: a directory of its own under the box's, so
# that what a build leaves there (`nix-build-<drv>-<n>`, a copy of the
# source) goes with the attempt, and, when a SIGKILL left it, with the next.
NIX_TMP_PREFIX = "fdl-prepare-nix."
NIX_TMP_RECORD = "nix-tmp"


@contextmanager
def _nix_tmp(state: str, nix: nix_mod.Nix) -> Iterator[None]:
    """Give `nix` a TMPDIR of this attempt's own under the one it has, its
    path recorded in <state>/nix-tmp; remove the one a killed attempt left
    first, and this one at the end. Where none can be made (the TMPDIR is
    full), nix keeps its own: the build then says what is full."""
    base = (nix.env if nix.env is not None else os.environ).get("TMPDIR") or "/tmp"
    record = os.path.join(state, NIX_TMP_RECORD)
    _remove_left_tmp(record)
    try:
        made = tempfile.mkdtemp(prefix=NIX_TMP_PREFIX, dir=base)
        # Nix's build users enter it (a single-user Nix as root builds as them).
        os.chmod(made, 0o755)
        state_mod.write_file(record, made.encode(), "state directory")
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


@dataclass(frozen=True)
class Source:
    """The training source as fetched, and the recipe it brings."""

    fetched: nix_mod.Prefetched
    recipe: manifest_mod.Recipe


def check(spec: PrepareSpec) -> str:
    """Every permanent error of the spec that steps 4 and 5 can find
    without Nix, found before the first nix call: a config that cannot
    work costs no evaluation. Returns the flake reference, checked."""
    flake = urls.check_flake_url(spec.flake)
    if spec.source is not None:
        urls.check_source_url(spec.source.from_)
        manifest_mod.check_box(spec.source)
    return flake


def start(
    spec: PrepareSpec,
    notes: list[str],
    progress: Progress | None = None,
    *,
    nix_program: str = "nix",
    env: Mapping[str, str] | None = None,
) -> Session:
    """Get steps 4 and 5 ready: the spec checked, the state directory proven
    writable, a Nix recent enough, and the state lock taken (waiting for
    another prepare, bounded, and saying so)."""
    flake = check(spec)
    state = _ensure_state_dir(spec)
    base_env = os.environ if env is None else env
    tmpdir = nix_mod.build_tmpdir(base_env)
    if tmpdir is not None:
        notes.append(
            f"TMPDIR {base_env.get('TMPDIR', '/tmp')!r} cannot be entered by Nix's build users (a single-user Nix "
            f"as root builds there as them): nix builds under {tmpdir} instead"
        )
        env = {**base_env, "TMPDIR": tmpdir}
    nix = nix_mod.Nix(
        state,
        program=nix_program,
        env=env,
        on_event=progress,
        substituters=spec.nix.substituters,
        trusted_public_keys=spec.nix.trusted_public_keys,
    )
    nix.check_version()
    return Session(spec, notes, flake, state, nix, _Phases(progress))


def choose_variant(session: Session, gpus: Gpus | None) -> variants_mod.Variant:
    """Step 4: the libtorch variant, and its arch coverage of the offered
    cards, from the flake's metadata by evaluation: nothing is fetched or
    built before a card the variant ships no kernel for is refused."""
    spec, flake = session.spec, session.flake
    session.gpus = gpus
    known = None if spec.refresh else record_mod.load(session.state)
    _start_source_fetch(session, known)
    lock_flake(session)
    if session.flake_key is None:
        known = None
    if spec.libtorch is None and not spec.cpu_only:
        session.notes.append('libtorch not set: choosing automatically (libtorch = "auto")')
    if known is not None and known.flake_key == session.flake_key:
        # This flake, as locked, was evaluated by an earlier attempt, which
        # checked its contract: its variants are what it said then.
        session.record = known
        session.variants_raw = known.variants
    elif known is not None and (predicted := _predicted(session, known, gpus)) is not None:
        return predicted
    else:
        session.variants_raw = evaluate_variants(session)
    variants = variants_mod.parse_variants(session.variants_raw, flake)
    return variants_mod.choose(spec.libtorch, variants, gpus, spec.cpu_only, flake, session.notes)


def lock_flake(session: Session) -> None:
    """Resolve the flake once (`nix flake metadata`) and pin the attempt to
    it: the warm-path key comes from that resolution, and every evaluation
    and build after it names the locked reference it returned, never the
    flake's own URL, which could resolve to another tree a moment later (a
    flake changed between the two, then rolled back, would otherwise leave
    the other tree's outputs recorded under this one's key). A flake whose
    resolution cannot be told is evaluated by its URL, and nothing is
    recorded for it."""
    identity = session.nix.flake_identity(session.flake)
    if identity is None:
        session.flake_key = None
        return
    session.flake_key = record_mod.key(identity.key, session.system, CONTRACT)
    session.fdl = f"{identity.locked_url}#legacyPackages.{session.system}.fdl"


def _predicted(session: Session, known: record_mod.Record, gpus: Gpus | None) -> variants_mod.Variant | None:
    """A changed flake on a box that has been through the gate: the variant
    chosen from the variants recorded for the flake before, without
    evaluating. The build then asks for its outputs under
    `ifVariants.<digest of those variants>` (nix/CONTRACT.md), an attribute
    the new flake has only while its variants are exactly those: the
    choice is then the one its own metadata give, and the build's one
    evaluation is the attempt's only one. Otherwise that evaluation fails
    before anything is built, and `build_outputs` takes the normal path.
    None (evaluate as usual) when the recorded variants do not serve this
    box, since the new flake's might."""
    spec = session.spec
    said: list[str] = []
    try:
        variants = variants_mod.parse_variants(known.variants, session.flake)
        variant = variants_mod.choose(spec.libtorch, variants, gpus, spec.cpu_only, session.flake, said)
    except Fail:
        return None
    session.variants_raw = known.variants
    session.gated = record_mod.variants_digest(CONTRACT, known.variants)
    session.gated_notes = said
    session.notes.extend(said)
    return variant


def _start_source_fetch(session: Session, known: record_mod.Record | None) -> None:
    """On a re-dial of the same source (the record says this box built it
    before), fetch it beside the flake's resolution rather than after the
    gate: the two resolutions are the bulk of a warm attempt. A box that has
    never fetched it keeps the gate's order (nothing fetched before the
    gate); a re-dial's fetch is the re-resolution of a tree already in the
    store, and a refusal stops it."""
    source = session.spec.source
    if known is None or known.plan is None or source is None or known.plan.source_url != source.from_:
        return
    url = source.from_
    assert url is not None
    session.source_fetch = session.nix.start_prefetch(
        url, doing=f"fetching the training source {url!r} (source.from, --source)", unreachable="source.unreachable"
    )


def evaluate_variants(session: Session, setting: str = "flake (--flake)") -> Any:
    """The flake's `fdl.variants` as Nix prints them, its contract checked:
    one evaluation, nothing fetched or built. `setting` names where the
    flake was given, for the messages (publish has only the flag)."""
    flake, system = session.flake, session.system
    session.step("evaluate", f"libtorch variants of {flake}")
    meta = session.nix.eval_json(
        session.fdl,
        apply="fdl: { contract = fdl.contract or null; variants = fdl.variants or null; }",
        doing=f"evaluating the flake {flake!r} ({setting}) for legacyPackages.{system}.fdl",
        fix=f"point {setting} at a flake that follows the fdl-prepare contract (nix/CONTRACT.md) "
        f"for {system}, or fix this one",
    )
    contract = meta.get("contract") if isinstance(meta, dict) else None
    if contract != CONTRACT:
        raise Fail(
            "flake.contract-mismatch",
            f"the flake {flake!r} speaks contract {contract!r} (legacyPackages.{system}.fdl.contract), this "
            f"fdl-prepare speaks {CONTRACT}: upgrade fdl-prepare or point {setting} at a matching revision",
        )
    return meta.get("variants")


def fetch_source(session: Session) -> Source | None:
    """Step 5, first half: the training source fetched once per attempt
    (a moving ref re-resolves here), and its run manifest merged over the
    box's own recipe. None when the spec names no source."""
    source = session.spec.source
    if source is None:
        return None
    url = source.from_
    assert url is not None  # check_source_url refused a source without one
    session.step("fetch", f"training source {url}")
    pending, session.source_fetch = session.source_fetch, None
    if pending is None:
        pending = session.nix.start_prefetch(
            url, doing=f"fetching the training source {url!r} (source.from, --source)", unreachable="source.unreachable"
        )
    fetched = pending.result()
    _note_fetched(fetched, session.notes)
    manifest = manifest_mod.read(fetched.store_path)
    recipe = manifest_mod.merge(source, manifest, url)
    manifest_mod.check_tree(recipe, fetched.store_path, url)
    session.notes.extend(manifest_mod.notes_for(recipe, manifest, time.time()))
    return Source(fetched=fetched, recipe=recipe)


def build_outputs(
    session: Session, variant: variants_mod.Variant, source: Source | None, *, link: str = "run"
) -> Built:
    """Step 5, second half: one `nix build` of libtorch, the training binary
    and the fetched tree (pinned by store path and NAR hash, the recipe
    passed as a flake input), with GC roots under the state directory,
    named `<state>/gcroots/<link>*` (a publish keeps one set per variant).
    Only prepare's own set (`run`) is recorded for the warm path."""
    warm = link == "run"
    if warm and source is not None:
        link = run_links(source.fetched.url)
    out_link = os.path.join(session.state, "gcroots", link)
    flake_input = None if source is None else source.recipe.flake_input(variant.label, CONTRACT)
    plan_key = _plan_key(session, variant, source, flake_input) if warm else None
    known = session.record
    if (
        plan_key is not None
        and known is not None
        and known.plan is not None
        and known.plan.key == plan_key
        and record_mod.still_there(known.plan.results, out_link)
    ):
        session.notes.append(
            "nothing evaluated: the flake, the training source, the recipe and the variant are those of an "
            f"earlier attempt, whose outputs are still in the store ({os.path.join(session.state, record_mod.NAME)}; "
            "--refresh evaluates anyway)"
        )
        return _built(session, variant, source, known.plan.results, Log())

    try:
        results, log = _build(session, variant, source, flake_input, out_link)
    except Fail as fail:
        if session.gated is None or fail.reason not in ("nix.evaluation", "nix.unknown"):
            raise
        # The flake's variants are not the recorded ones (or it predates
        # `ifVariants`): nothing was built. The normal path: evaluate them,
        # choose and check coverage anew, and build what that gives.
        variant = _choose_again(session)
        flake_input = None if source is None else source.recipe.flake_input(variant.label, CONTRACT)
        plan_key = _plan_key(session, variant, source, flake_input) if warm else None
        results, log = _build(session, variant, source, flake_input, out_link)
    outputs.prune_links(out_link, outputs.store_paths(results))
    built = _built(session, variant, source, results, log)
    if session.flake_key is not None and plan_key is not None:
        url = None if source is None else source.fetched.url
        plan = record_mod.Plan(key=plan_key, results=results, source_url=url)
        record_mod.save(session.state, record_mod.Record(session.flake_key, session.variants_raw, plan))
    elif warm:
        record_mod.forget(session.state)
    caches.note(log, session.spec.nix.substituters, session.notes)
    return built


def run_links(source_url: str) -> str:
    """The name of a prepare's out-links (`<state>/gcroots/<name>`, `-1`,
    ...): one set per training source. A prepare of another source on the
    same state directory (two join loops on one box) replaces and prunes
    only its own set, never the roots of the binary the other reported."""
    return "run." + hashlib.sha256(source_url.encode()).hexdigest()[:16]


def _plan_key(
    session: Session, variant: variants_mod.Variant, source: Source | None, flake_input: dict[str, Any] | None
) -> str | None:
    """What decides a build's outputs (record.py); None when the flake's
    identity could not be told."""
    if session.flake_key is None:
        return None
    nar_hash = None if source is None else source.fetched.nar_hash
    return record_mod.key(session.flake_key, variant.label, nar_hash, flake_input)


def _build(
    session: Session,
    variant: variants_mod.Variant,
    source: Source | None,
    flake_input: dict[str, Any] | None,
    out_link: str,
) -> tuple[list[dict[str, Any]], Log]:
    fdl = session.fdl if session.gated is None else f'{session.fdl}.ifVariants."{session.gated}"'
    installables = [f"{fdl}.libtorch.{variants_mod.nix_attr(variant.label)}"]
    overrides: dict[str, str] = {}
    if source is not None and flake_input is not None:
        recipe_dir = outputs.write_recipe(session.state, flake_input)
        overrides = {"source": source.fetched.pinned_url, "recipe": f"path:{recipe_dir}"}
        installables += [f"{fdl}.training", source.fetched.store_path]
    session.step("build", ", ".join(_short(i) for i in installables))
    return session.nix.build(
        installables,
        out_link=out_link,
        overrides=overrides,
        timeout_s=session.spec.build_timeout_s,
        source_path=source.fetched.store_path if source is not None else None,
        doing=f"building libtorch {variant.label}"
        + (f" and the training binary from {source.fetched.url!r}" if source is not None else ""),
    )


def _choose_again(session: Session) -> variants_mod.Variant:
    """The normal path after a prediction the new flake did not bear out:
    the prediction's notes withdrawn, the variants evaluated, the choice
    and its coverage check made from them."""
    for note in session.gated_notes:
        with contextlib.suppress(ValueError):
            session.notes.remove(note)
    session.gated, session.gated_notes = None, []
    session.variants_raw = evaluate_variants(session)
    variants = variants_mod.parse_variants(session.variants_raw, session.flake)
    spec = session.spec
    return variants_mod.choose(spec.libtorch, variants, session.gpus, spec.cpu_only, session.flake, session.notes)


def build(
    spec: PrepareSpec,
    gpus: Gpus | None,
    notes: list[str],
    progress: Progress | None = None,
    *,
    nix_program: str = "nix",
    env: Mapping[str, str] | None = None,
) -> Built:
    """Steps 4 and 5 in their order, as the pipeline runs them. Raises Fail;
    returns what the run needs. Idempotent: with nothing changed, a second
    call builds and downloads nothing."""
    with start(spec, notes, progress, nix_program=nix_program, env=env) as session:
        variant = choose_variant(session, gpus)
        source = fetch_source(session)
        return build_outputs(session, variant, source)


def _built(
    session: Session, variant: variants_mod.Variant, source: Source | None, results: list[dict[str, Any]], log: Log
) -> Built:
    """What the build made, told apart, and what the run needs of it."""
    recipe = source.recipe if source is not None else None
    try:
        libtorch_path, training_path = outputs.identify(results, recipe.bin if recipe else None)
    except ValueError as odd:
        raise Fail(
            "nix.unknown",
            f"building libtorch {variant.label}: nix build printed no JSON result of a known shape ({odd}); "
            "the next attempt retries",
        ) from None
    outputs.note_build(log, results, variant.label, libtorch_path, training_path, session.notes)
    libtorch = Libtorch(path=libtorch_path, variant=variant.label)
    if source is None or recipe is None:
        return Built(libtorch=libtorch, bin=None, args=None, run_id=None, variant=variant)
    if training_path is None:
        raise Fail(
            "flake.contract-broken",
            f"the flake {session.flake!r} built no training output holding bin/{os.path.basename(recipe.bin)}: "
            "its fdl.training does not follow the contract (nix/CONTRACT.md: install the recipe's bin to $out/bin/)",
        )
    binary = Binary(
        path=os.path.join(training_path, "bin", os.path.basename(recipe.bin)),
        cwd=os.path.normpath(os.path.join(source.fetched.store_path, recipe.cwd)),
    )
    return Built(
        libtorch=libtorch, bin=binary, args=recipe.args, run_id=recipe.run_id, smoke=recipe.smoke, variant=variant
    )


def _short(installable: str) -> str:
    if "#" not in installable:
        return store_name(installable)
    attr = installable.rsplit("#", 1)[-1].rsplit(".fdl.", 1)[-1]
    return attr.split('".', 1)[-1] if attr.startswith("ifVariants.") else attr


def _note_fetched(fetched: nix_mod.Prefetched, notes: list[str]) -> None:
    rev = (fetched.locked or {}).get("rev") if fetched.locked else None
    notes.append(
        f"training source {fetched.url} fetched: {fetched.store_path}"
        + (f" (rev {str(rev)[:12]})" if rev else "")
        + f", {fetched.nar_hash}"
    )
