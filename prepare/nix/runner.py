"""The one wrapper around the `nix` command.

Every call goes through `Nix`, which holds the flags every call shares:

- `--extra-experimental-features 'nix-command flakes'`: Debian's Nix 2.8 keeps
  flakes behind the flag, and current Nix accepts it unchanged.
- `--log-format internal-json`: one `@nix {...}` record per stderr line, so
  progress (builds, downloads) and errors are read from structure, not text.
- `--json` results: Nix 2.8 has no `--print-out-paths`.
- `flake-registry` pointed at an empty registry file under the state
  directory: otherwise the first flake command downloads the global registry
  from GitHub, and a box without internet waits on it.
- `accept-flake-config = false`, and never impure evaluation: a flake must not change
  substituters or read the environment behind the operator's back.
- the box's own binary caches and keys (`[join.nix]`), added to nix.conf's,
  with signatures required (`prepare.nix.caches`); a daemon that drops them
  stops the attempt (permanent), whichever call it answered.
- `--no-write-lock-file`: the flake may live in a read-only store path, and a
  prepare must not edit the operator's checkout.
- `--` before every installable, URL and store path: nothing from a
  config, a flag or a manifest is ever read as an option (a `--flake
  -f/file` would otherwise evaluate a file impurely). Nix's argument
  parser has ended options at `--` since 2.0; 2.8 and 2.26 alike.
- `--no-eval-cache` on eval and build: Nix 2.8 caches a *failed* evaluation of
  a locked flake and answers the repeat with a generic "is not an attribute
  set", which would hide the `throw` message a 3 a.m. operator needs
  (nix/CONTRACT.md). The flake's evaluation costs milliseconds anyway.

Each call's stderr is folded by `nix_log.Log` as it arrives; a call that
fails becomes a `Fail` in `nix_diagnosis`, from its phase and that log.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prepare.config.kinds import LIMITS
from prepare.fail import Fail, Reason
from prepare.host import human, proc, state
from prepare.nix import caches
from prepare.nix.diagnosis import BUILD, COPY, EVALUATION, FETCH, SIGN, BuildDir, explain
from prepare.nix.log import Log, strip_ansi

if TYPE_CHECKING:
    from prepare.spec import Progress


OLDEST = (2, 8)
FEATURES = "nix-command flakes"
INSTALL = (
    "install Nix: `sudo apt-get install nix-bin` (Debian/Ubuntu), or the installer from "
    "https://nixos.org/download (`sh <(curl -L https://nixos.org/nix/install) --daemon`)"
)

# Bounds for calls that have no operator-set limit. Generous: a first fetch
# of nixpkgs over a slow link takes minutes; they only stop a wedged call
# (a black-holed TCP connection) from holding a join loop forever.
EVAL_TIMEOUT_S = 900.0
FETCH_TIMEOUT_S = 1800.0
# Past the build limit, Nix's own `timeout` stops the builder and says so;
# this margin lets it, and covers evaluation and out-link creation, before
# the wrapper kills nix itself.
BUILD_GRACE_S = 120.0

# Nix 2.30 moved build-dir's default from TMPDIR to `builds` in its state
# directory (/nix/var/nix/builds), out of reach of other users: a builder's
# directory under a world-writable one had let builds escape the sandbox.
BUILD_DIR_DEFAULT_FROM = (2, 30)
NIX_STATE_DIR = "/nix/var/nix"
SETTINGS_TIMEOUT_S = 60.0
CONFIG_SHOW_FROM = (2, 20)

_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def system() -> str:
    """The Nix system double of this machine, for attribute paths. Pure
    evaluation has no `builtins.currentSystem`, so we name it ourselves."""
    # os.uname, not the platform module: the same answer without importing
    # platform on every attempt.
    uname = os.uname()
    machine = uname.machine.lower()
    arch = {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}.get(machine, machine)
    kernel = uname.sysname.lower()
    return f"{arch}-{kernel}"


@dataclass(frozen=True)
class Prefetched:
    url: str
    store_path: str
    nar_hash: str
    locked: Mapping[str, Any] | None = None

    @property
    def pinned_url(self) -> str:
        """A flake input URL for exactly this tree: a store path with its NAR
        hash, so the build cannot resolve the source a second time."""
        from urllib.parse import quote

        return f"path:{self.store_path}?narHash={quote(self.nar_hash, safe='')}"


@dataclass(frozen=True)
class FlakeIdentity:
    """A flake as `nix flake metadata` resolved it (Nix.flake_identity)."""

    key: str
    locked_url: str


@dataclass(frozen=True)
class DryRun:
    """What `nix build --dry-run` of an attempt's installables says the
    build would do (nothing is built or fetched by asking): the derivations
    it would build, the store paths it would substitute from a cache, and
    their download size as Nix put it. `results` are the outputs the build
    would make, in `nix build --json`'s shape."""

    results: tuple[dict[str, Any], ...]
    build: tuple[str, ...]
    fetch: tuple[str, ...]
    unknown: tuple[str, ...] = ()
    fetch_size: str | None = None
    # As Nix counted them (a list keeps prepare.nix.log.MAX_LISTED).
    build_count: int = 0
    fetch_count: int = 0


@dataclass
class Outcome:
    """A finished nix call: its result and what the log said."""

    completed: proc.Completed
    log: Log

    @property
    def ok(self) -> bool:
        return self.completed.returncode == 0


class Nix:
    """The one place `nix` argv is built. `state_dir` holds the empty flake
    registry; `env` replaces the environment (tests set NIX_CONFIG);
    `substituters` and `trusted_public_keys` are the box's binary caches."""

    def __init__(
        self,
        state_dir: str,
        *,
        program: str = "nix",
        env: Mapping[str, str] | None = None,
        on_event: Progress | None = None,
        substituters: Sequence[str] = (),
        trusted_public_keys: Sequence[str] = (),
    ) -> None:
        self.state_dir = state_dir
        self.program = program
        self.env = dict(env) if env is not None else None
        self.on_event = on_event
        self.registry = os.path.join(state_dir, "flake-registry.json")
        self.substituters = tuple(substituters)
        self.trusted_public_keys = tuple(trusted_public_keys)
        # Where a build's directory is made, as a full disk names it: the
        # TMPDIR the box gave, or Nix's build-dir (under a directory of the
        # attempt's own either way: prepare.build.workspace); None: this
        # process's TMPDIR.
        self.builds: BuildDir | None = None
        # The attempt's own build directory, given to a Nix that has the
        # build-dir setting (`--option build-dir`).
        self.build_dir_option: str | None = None
        # Given Nix's build-dir, makes a directory of the attempt's own
        # under it and returns its path (None: none could be made), for
        # `build_dir_option` (prepare.build.workspace).
        self.own_build_dir: Callable[[str], str | None] | None = None
        # Where the builds go is settled once, before the first call that
        # may build (an evaluation can, through import-from-derivation): a
        # warm attempt that neither evaluates nor builds never asks.
        self._builds_settled = False
        self.version: tuple[int, int, int] | None = None
        # Where what settling the builds finds is said (a sandbox that is
        # off); None: nowhere.
        self.notes: list[str] | None = None

    # -- flags -------------------------------------------------------------
    def _common(self) -> list[str]:
        argv = [self.program, "--extra-experimental-features", FEATURES, "--log-format", "internal-json"]
        argv += ["--option", "flake-registry", self.registry]
        argv += ["--option", "accept-flake-config", "false"]
        argv += caches.options(self.substituters, self.trusted_public_keys)
        if self.build_dir_option is not None:
            argv += ["--option", "build-dir", self.build_dir_option]
        return argv

    def _ready_to_build(self) -> None:
        if self._builds_settled:
            return
        self._builds_settled = True
        said = self.settings(("build-dir", "store", "sandbox", "build-users-group"))
        builds = self.where_builds(said)
        self._vet_builders(said, builds)
        if builds is None:
            return
        self.builds = builds
        if builds.setting == "build-dir" and self.own_build_dir is not None:
            self.build_dir_option = self.own_build_dir(builds.path)

    def _ensure_registry(self) -> None:
        # An empty registry: flake references must be full URLs; nothing is
        # looked up by name, locally or on the network.
        if os.path.lexists(self.registry):
            return
        try:
            state.write_file(self.registry, b'{"flakes": [], "version": 2}\n', "state directory")
        except OSError as err:
            raise Fail(
                "dirs.unwritable",
                f"cannot write the empty flake registry {self.registry}: {human.oserror(err)}; make the state "
                "directory writable for this user, or set state_dir (--state-dir) to a directory it can write",
            ) from None

    def _run(self, argv: Sequence[str], timeout: float | None, log: Log) -> proc.Completed:
        return self._start(argv, timeout, log).wait()

    def _start(
        self, argv: Sequence[str], timeout: float | None, log: Log, env: Mapping[str, str] | None = None
    ) -> proc.Running:
        try:
            return proc.start(argv, timeout=timeout, env=env or self.env, on_stderr_line=log.feed)
        except proc.ExecFailed as failed:
            raise self._not_started(argv, failed) from None

    def _not_started(self, argv: Sequence[str], failed: proc.ExecFailed) -> Fail:
        """Why a nix call could not be started, by cause: nix missing, a
        command line the kernel refuses, or a box out of processes."""
        if isinstance(failed, proc.Missing):
            return self._missing()
        if isinstance(failed, proc.TooLong):
            size = sum(len(str(a).encode()) + 1 for a in argv)
            longest = max((len(str(a).encode()) for a in argv), default=0)
            return Fail(
                "config.invalid",
                f"the nix command line is {human.size(size)} (its longest argument {human.size(longest)}), which the "
                f"kernel refuses (E2BIG): a URL or argument past what a program can be given. fdl-prepare takes "
                f"URLs of up to {LIMITS}; shorten the flake (--flake), source.from (--source) or nix.substituters "
                "(--substituter) value",
            )
        return Fail(
            "nix.unknown",
            f"nix could not be started ({failed}): the box is short of processes or memory; the next attempt retries",
        )

    def _missing(self) -> Fail:
        path = (self.env or os.environ).get("PATH", "")
        return Fail("nix.missing", f"nix is not installed: {self.program!r} is not on PATH ({path}); {INSTALL}")

    # -- version -------------------------------------------------------------
    def check_version(self) -> tuple[int, int, int]:
        """The Nix version, refusing one older than OLDEST (see `_version`
        for why asking is cached)."""
        path_var = (self.env or os.environ).get("PATH")
        resolved = self.program if os.sep in self.program else proc.which(self.program, path=path_var)
        if resolved is None or not os.path.exists(resolved):
            raise self._missing()
        try:
            version = _version(resolved, self.env, os.path.join(self.state_dir, "nix-version.json"))
        except proc.ExecFailed as failed:
            raise self._not_started([resolved, "--version"], failed) from None
        self.version = version
        if version[:2] < OLDEST:
            raise Fail(
                "nix.too-old",
                f"nix {'.'.join(map(str, version))} at {resolved} is older than {'.'.join(map(str, OLDEST))}, the "
                f"oldest fdl-prepare supports (flakes and `nix build --json`); {INSTALL}",
            )
        return version

    # -- where builds run ----------------------------------------------------
    def settings(self, names: Sequence[str]) -> dict[str, Any] | None:
        """The values of the settings `names` that this Nix has, as it runs
        (nix.conf, NIX_CONFIG, NIX_REMOTE, its command line); one it does
        not have is left out. None when it could not say.

        `nix config show` from 2.20 (2.34 warns that `show-config` is its
        deprecated alias); 2.8 has only `show-config`, asked first where the
        version says so (a process start saved). With --json both print
        `{"<name>": {"value": ..., ...}}`."""
        base = [self.program, "--extra-experimental-features", FEATURES]
        commands = [["config", "show", "--json"], ["show-config", "--json"]]
        if self.version is not None and self.version[:2] < CONFIG_SHOW_FROM:
            commands.reverse()
        for command in commands:
            try:
                done = proc.run([*base, *command], timeout=SETTINGS_TIMEOUT_S, env=self.env)
            except (proc.ExecFailed, proc.TimedOut):
                return None
            if done.returncode == 0:
                break
        else:
            return None
        try:
            data = _json(done)
        except (ValueError, RecursionError):
            return None
        if not isinstance(data, dict):
            return None
        return {name: data[name].get("value") for name in names if isinstance(data.get(name), dict)}

    def _vet_builders(self, said: dict[str, Any] | None, builds: BuildDir | None) -> None:
        """Refuse a Nix that would build the training source as root, and
        say when it builds without its sandbox (what that exposes).

        Run as root, a Nix that builds itself (not through a daemon) runs
        each builder as one of `build-users-group`'s users; with that
        setting empty it runs it as root, and the publisher's build line
        then reads /etc/shadow and can copy the root-only signing key into
        the world-readable store. Where a daemon builds, its own settings
        decide, which a client cannot read (docs/HARDENING.md)."""
        if said is None:
            return
        group = said.get("build-users-group")
        daemon = builds is not None and builds.setting == "daemon"
        if os.geteuid() == 0 and not daemon and isinstance(group, str) and not group.strip():
            raise Fail(
                "nix.builds-as-root",
                "Nix would build the training source as root: build-users-group is empty in nix.conf "
                "(`nix show-config | grep build-users-group`), so every builder runs with root's rights, and the "
                "publisher's build line could read /etc/shadow or copy a root-only key into the world-readable "
                "store. Fix: give Nix build users (`build-users-group = nixbld` in /etc/nix/nix.conf, with the "
                "nixbld group and its users, as Nix's multi-user install makes them; on NixOS it is the default), "
                "or run fdl-prepare as an unprivileged user with a daemon that has them",
            )
        if said.get("sandbox") is False and self.notes is not None:
            self.notes.append(
                "Nix builds here without its sandbox (sandbox = false, the default of Debian's Nix): a training "
                "build runs as a Nix build user with the whole file system in view and the network open, and "
                "reads what lies above its directory (cargo's .cargo/config.toml); fdl-prepare builds under a "
                "directory only root can write, but the build still sees everything other users may read. Set "
                "`sandbox = true` in /etc/nix/nix.conf where the kernel allows it"
            )

    def where_builds(self, said: dict[str, Any] | None = None) -> BuildDir | None:
        """Where this Nix makes a build's directory, when TMPDIR does not
        decide it: under its build-dir ("build-dir": nix.conf's, or from
        2.30 its default, `<state>/builds`) for a store it builds in
        itself; the daemon ("daemon") for a store another process builds
        for (the daemon, a remote store). None where TMPDIR decides (a Nix
        without the setting, 2.8; one before 2.30 with none set), for a
        local store of its own elsewhere (`store = /root`, `local?root=`),
        or where Nix could not say: the attempt's TMPDIR covers those."""
        if said is None:
            said = self.settings(("build-dir", "store"))
        if said is None:
            return None
        here = self._builds_here(said.get("store"))
        if here is None:
            return None
        if not here:
            return BuildDir("", "daemon")
        if "build-dir" not in said:
            return None
        configured = said["build-dir"]
        if isinstance(configured, str) and configured.startswith("/"):
            return BuildDir(configured, "build-dir")
        if (self.version or self.check_version())[:2] < BUILD_DIR_DEFAULT_FROM:
            return None
        return BuildDir(os.path.join(self._state_of_nix(), "builds"), "build-dir")

    def _builds_here(self, store: object) -> bool | None:
        """Whether the `store` setting names the local store this process
        builds in (True), a store another process builds for (False), or
        a local store of its own elsewhere (None). `auto` is local where
        Nix's state directory is writable (as Nix itself decides), else
        the daemon."""
        if store in (None, "", "auto"):
            return os.access(self._state_of_nix(), os.R_OK | os.W_OK)
        if store in ("local", "local://"):
            return True
        # A local store with a root or a state of its own: 2.8 and 2.26 print
        # `local?root=/r` and `/r` as given, 2.34 `local://?root=/r` and
        # `local:///r`.
        if not isinstance(store, str) or store.startswith(("local", "/")):
            return None
        return False

    def _state_of_nix(self) -> str:
        return self._environ().get("NIX_STATE_DIR") or NIX_STATE_DIR

    def _environ(self) -> Mapping[str, str]:
        return self.env if self.env is not None else os.environ

    # -- calls ---------------------------------------------------------------
    def eval_json(
        self,
        installable: str,
        *,
        apply: str | None = None,
        timeout: float = EVAL_TIMEOUT_S,
        doing: str | None = None,
        fix: str | None = None,
    ) -> Any:
        self._ensure_registry()
        self._ready_to_build()
        argv = self._common() + ["eval", "--json", "--no-write-lock-file", "--no-eval-cache"]
        if apply is not None:
            argv += ["--apply", apply]
        argv += ["--", installable]
        outcome = self._call(argv, timeout, doing or f"evaluating {installable}", EVALUATION, fix=fix)
        try:
            return _json(outcome.completed)
        except (ValueError, RecursionError):
            raise Fail(
                "nix.evaluation",
                f"{doing or 'evaluating ' + installable}: nix printed no JSON "
                f"({outcome.completed.stdout[:200]!r}); is the flake's output a plain value?",
            ) from None

    def prefetch(
        self,
        url: str,
        *,
        timeout: float = FETCH_TIMEOUT_S,
        doing: str | None = None,
        unreachable: Reason = "nix.fetch",
    ) -> Prefetched:
        """`nix flake prefetch --json url`. No caller fix: a fetch's failure
        is never an evaluation error, so every category brings its own.
        `unreachable`: the reason a failed fetch gets (the training source's
        is `source.unreachable`)."""
        return self.start_prefetch(url, timeout=timeout, doing=doing, unreachable=unreachable).result()

    def start_prefetch(
        self,
        url: str,
        *,
        timeout: float = FETCH_TIMEOUT_S,
        doing: str | None = None,
        unreachable: Reason = "nix.fetch",
        env: Mapping[str, str] | None = None,
    ) -> PendingFetch:
        """`prefetch`, started: its `result` (or `stop`) is the caller's to
        call, while it does something else meanwhile. `env`: the whole
        environment of this one call (a git+ssh source's GIT_SSH_COMMAND:
        git runs in nix's own process, not the daemon's)."""
        self._ensure_registry()
        # tarball-ttl 0: a remote git ref (or tarball URL) is otherwise
        # resolved from Nix's cache for an hour, and a re-dial right after a
        # publish would build the previous commit.
        argv = self._common() + ["--option", "tarball-ttl", "0", "flake", "prefetch", "--json", "--", url]
        doing = doing or f"fetching {url}"
        log = Log(self.on_event)
        running = self._start(argv, timeout, log, env)

        def finish() -> Prefetched:
            outcome = self._finish(running, log, doing, FETCH, unreachable=unreachable)
            if outcome.completed.stdout_cut:
                return _prefetched(url, "", doing)
            return _prefetched(url, outcome.completed.stdout, doing)

        return PendingFetch(finish, running.stop)

    def flake_identity(self, flake: str, *, timeout: float = FETCH_TIMEOUT_S) -> FlakeIdentity | None:
        """What decides the flake's outputs, without evaluating them: the
        flake resolved and locked (`nix flake metadata`), as one string, and
        the locked reference it was read from (its `url`: the tree by NAR
        hash or revision), which every later call of the attempt evaluates
        and builds, so what is recorded under the key is what the key came
        from even if the flake changes meanwhile. None when that cannot be told (the call failed, or the flake's tree
        or one of its inputs has no content hash, e.g. a dirty git tree on
        some versions). None only ever means "evaluate as usual": a failure
        here is the evaluation's to report, with its own words and kind.

        The NAR hash of the flake's tree covers flake.nix, flake.lock and
        every file the flake imports from it; the lock nodes cover inputs
        that flake.lock does not pin (Nix locks them afresh for the call).
        `lastModified` is left out: a touched but unchanged tree is the
        same flake."""
        self._ensure_registry()
        argv = self._common() + ["flake", "metadata", "--json", "--no-write-lock-file", "--", flake]
        try:
            completed = self._run(argv, timeout, Log())
            data = _json(completed) if completed.returncode == 0 else None
        except (proc.TimedOut, ValueError, RecursionError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("locked"), dict):
            return None
        nar_hash = data["locked"].get("narHash")
        if not isinstance(nar_hash, str) or not nar_hash:
            return None
        nodes = (data.get("locks") or {}).get("nodes") if isinstance(data.get("locks"), dict) else None
        if not isinstance(nodes, dict):
            nodes = {}
        inputs = {}
        for name, node in nodes.items():
            locked = node.get("locked") if isinstance(node, dict) else None
            if isinstance(locked, dict):
                if not locked.get("narHash"):
                    return None
                inputs[name] = {k: v for k, v in locked.items() if k != "lastModified"}
        flake_locked = {k: v for k, v in data["locked"].items() if k != "lastModified"}
        locked_url = data.get("url")
        store_path = data.get("path")
        if (
            data["locked"].get("type") == "path"
            and isinstance(store_path, str)
            and store_path.startswith("/nix/store/")
        ):
            # A `path:` flake by the tree Nix just copied into the store: 2.26
            # and later read a locked `path:` URL from its directory again,
            # and a tree changed since is a hash mismatch there.
            from urllib.parse import quote

            locked_url = f"path:{store_path}?narHash={quote(nar_hash, safe='')}"
        # A reference the later calls can take as it is: one URL, no fragment.
        if not isinstance(locked_url, str) or not locked_url or any(c.isspace() or c in "#\0" for c in locked_url):
            return None
        key = json.dumps({"flake": flake_locked, "inputs": inputs}, sort_keys=True)
        return FlakeIdentity(key=key, locked_url=locked_url)

    def build(
        self,
        installables: Sequence[str],
        *,
        out_link: str | None,
        overrides: Mapping[str, str] = {},
        timeout_s: float | None = None,
        doing: str = "building",
        source_path: str | None = None,
    ) -> tuple[list[dict[str, Any]], Log]:
        """`nix build --json` of `installables`, each override an
        `--override-input NAME URL`. Out-links, where asked, are GC roots
        named `<out_link>`, `<out_link>-1`, ... in the order of Nix's JSON
        result, which is not the installables' order (2.8 sorts them: plain
        store paths first, then by derivation path); the JSON says which
        store path each one holds.

        `source_path`, the fetched training source, tells a failed training
        build (transient: the next publish may fix it) from a failed build of
        something the flake itself provides (permanent: libtorch, a toolchain)."""
        self._ensure_registry()
        self._ready_to_build()
        argv = self._common() + ["build", "--json", "--no-write-lock-file", "--no-eval-cache"]
        argv += ["--out-link", out_link] if out_link else ["--no-link"]
        if timeout_s is not None:
            # Nix's own limit kills the builder and reports the timeout in a
            # record; the wrapper's limit below is only the backstop.
            argv += ["--option", "timeout", str(max(1, int(timeout_s)))]
        for name, url in overrides.items():
            argv += ["--override-input", name, url]
        argv += ["--", *installables]
        wall = None if timeout_s is None else timeout_s + BUILD_GRACE_S
        outcome = self._call(argv, wall, doing, BUILD, source_path=source_path)
        try:
            results = [build_result(r) for r in _json(outcome.completed)]
        except (ValueError, TypeError, RecursionError):
            raise Fail(
                "nix.unknown",
                f"{doing}: nix build printed no JSON result of a known shape "
                f"({outcome.completed.stdout[:200]!r}); the next attempt retries",
            ) from None
        return results, outcome.log

    def dry_run(
        self,
        installables: Sequence[str],
        *,
        overrides: Mapping[str, str] = {},
        doing: str = "checking what a build would do",
        source_path: str | None = None,
        timeout: float = EVAL_TIMEOUT_S,
    ) -> DryRun:
        """`nix build --dry-run` of what `build` would be given: the flake
        evaluated and the derivations written (.drv files, no outputs), what
        is missing asked of the caches, nothing built, fetched or linked.
        A failure is read as the build's would be (the same phase), so it
        gets the reason the attempt's build would."""
        self._ensure_registry()
        argv = self._common() + ["build", "--dry-run", "--json", "--no-link", "--no-write-lock-file", "--no-eval-cache"]
        for name, url in overrides.items():
            argv += ["--override-input", name, url]
        argv += ["--", *installables]
        outcome = self._call(argv, timeout, doing, BUILD, source_path=source_path)
        try:
            # The lists are what is read; the outputs only where Nix gives them.
            printed = outcome.completed.stdout.strip()
            results = tuple(build_result(r) for r in _json(outcome.completed)) if printed else ()
        except (ValueError, TypeError, RecursionError):
            raise Fail(
                "nix.unknown",
                f"{doing}: nix build --dry-run printed no JSON result of a known shape "
                f"({outcome.completed.stdout[:200]!r}); the next attempt retries",
            ) from None
        missing = outcome.log.missing
        return DryRun(
            results=results,
            build=tuple(missing.build),
            fetch=tuple(missing.fetch),
            unknown=tuple(missing.unknown),
            fetch_size=missing.fetch_size,
            build_count=missing.counts["build"],
            fetch_count=missing.counts["fetch"],
        )

    def sign(self, paths: Sequence[str], key_file: str, *, doing: str, timeout: float = EVAL_TIMEOUT_S) -> Log:
        """`nix store sign --key-file` over the closure of `paths`, in the
        local store. The key travels as a file name only: it is never on a
        command line, in the environment or in a message."""
        argv = self._common() + ["store", "sign", "--key-file", key_file, "--recursive", "--", *paths]
        return self._call(argv, timeout, doing, SIGN).log

    def copy(self, paths: Sequence[str], to: str, *, doing: str, timeout: float = FETCH_TIMEOUT_S) -> Log:
        """`nix copy --to` of `paths` and their closure. `--no-check-sigs`:
        the paths carry the publisher's signatures, which the boxes check;
        the cache is a relay whose own nix.conf need not know the key (a
        binary cache checks nothing anyway; an ssh-ng store would refuse)."""
        argv = self._common() + ["copy", "--no-check-sigs", "--to", to, "--", *paths]
        return self._call(argv, timeout, doing, COPY).log

    def _call(
        self,
        argv: list[str],
        timeout: float | None,
        doing: str,
        phase: str,
        *,
        fix: str | None = None,
        source_path: str | None = None,
        unreachable: Reason = "nix.fetch",
    ) -> Outcome:
        log = Log(self.on_event)
        running = self._start(argv, timeout, log)
        return self._finish(running, log, doing, phase, fix=fix, source_path=source_path, unreachable=unreachable)

    def _finish(
        self,
        running: proc.Running,
        log: Log,
        doing: str,
        phase: str,
        *,
        fix: str | None = None,
        source_path: str | None = None,
        unreachable: Reason = "nix.fetch",
    ) -> Outcome:
        try:
            completed = running.wait()
        except proc.TimedOut as late:
            log.finished(False)
            what = "the build" if phase == BUILD else "nix"
            slow_fix = "Raise build_timeout_s (--build-timeout) if the build is legitimately slow; "
            raise Fail(
                "nix.timeout",
                f"{doing} did not finish within {late.timeout:g}s; {what} was stopped. "
                + (slow_fix if phase == BUILD else "")
                + "the next attempt retries",
            ) from None
        except BaseException:
            log.finished(False)
            raise
        log.finished(completed.returncode == 0)
        outcome = Outcome(completed, log)
        # Before the call's own outcome: a daemon that dropped the box's
        # caches answers the call anyway, and every build would then happen
        # here instead of being substituted.
        dropped = caches.untrusted(log, self.substituters)
        if dropped is not None:
            raise dropped
        if not outcome.ok:
            build_dir = self.builds or BuildDir(self._environ().get("TMPDIR") or "/tmp", "TMPDIR")
            raise explain(
                phase, log, completed.returncode, doing, fix=fix, source_path=source_path, unreachable=unreachable,
                build_dir=build_dir,
            )  # fmt: skip
        return outcome


def _json(completed: proc.Completed) -> Any:
    """A call's JSON; ValueError when it printed more than is kept
    (proc.OUTPUT_BYTES), which no answer of Nix's to us is."""
    if completed.stdout_cut:
        raise ValueError(f"nix printed over {human.size(proc.OUTPUT_BYTES)} on stdout")
    return json.loads(completed.stdout)


class PendingFetch:
    """A `nix flake prefetch` under way (`Nix.start_prefetch`)."""

    def __init__(self, finish: Callable[[], Prefetched], stop: Callable[[], None]) -> None:
        self._finish = finish
        self._stop = stop
        self._waited = False

    def result(self) -> Prefetched:
        """What it fetched; its Fail if it failed."""
        self._waited = True
        return self._finish()

    def stop(self) -> None:
        """Stop it, unless it was waited for: for a caller that no longer
        wants what it fetches (an attempt that failed before it did)."""
        if not self._waited:
            self._stop()


def _prefetched(url: str, stdout: str, doing: str) -> Prefetched:
    try:
        data = json.loads(stdout)
        prefetched = Prefetched(url=url, store_path=data["storePath"], nar_hash=data["hash"], locked=data.get("locked"))
        if not (isinstance(prefetched.store_path, str) and isinstance(prefetched.nar_hash, str)):
            raise TypeError("storePath and hash are not strings")
        if prefetched.locked is not None and not isinstance(prefetched.locked, dict):
            raise TypeError("locked is not an object")
        return prefetched
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise Fail(
            "nix.fetch",
            f"{doing}: `nix flake prefetch` printed no store path ({stdout[:200]!r}); the next attempt retries",
        ) from None


_VersionKey = tuple[str, int, int, int]
_VERSIONS: dict[_VersionKey, tuple[int, int, int]] = {}


def _version(resolved: str, env: Mapping[str, str] | None, cache_file: str) -> tuple[int, int, int]:
    """The version of the nix at `resolved`.

    Asking costs a process start (~50 ms, more through the seam's
    timeout), on every attempt of a loop whose warm path should cost
    little more than the build itself. The answer depends only on the
    binary, so it is kept per (real path, inode, size, mtime), in memory
    and in the state directory; an upgrade replaces the file and asks
    again."""
    real = os.path.realpath(resolved)
    st = os.stat(real)
    key = (real, st.st_ino, st.st_size, st.st_mtime_ns)
    version = _VERSIONS.get(key) or _cached_version(cache_file, key)
    if version is None:
        try:
            done = proc.run([resolved, "--version"], timeout=60, env=env)
        except proc.TimedOut:
            raise Fail(
                "nix.timeout", f"`{resolved} --version` did not answer within 60s; the next attempt retries"
            ) from None
        version = parse_nix_version(done.stdout)
        if done.returncode != 0 or version is None:
            raise Fail(
                "nix.broken",
                f"`{resolved} --version` failed (exit {done.returncode}): "
                f"{strip_ansi(done.stderr or done.stdout).strip()[:500]!r}; reinstall nix: {INSTALL}",
            )
        _remember_version(cache_file, key, version)
    _VERSIONS[key] = version
    return version


def _cached_version(cache_file: str, key: _VersionKey) -> tuple[int, int, int] | None:
    try:
        with open(cache_file, encoding="utf-8") as handle:
            data = json.load(handle)
        if tuple(data["key"]) == key:
            major, minor, patch = (int(x) for x in data["version"])
            return major, minor, patch
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _remember_version(cache_file: str, key: _VersionKey, version: tuple[int, int, int]) -> None:
    data = json.dumps({"key": list(key), "version": list(version)}).encode()
    # Only a cache: the next attempt asks again. A symlink or another
    # user's directory in the way is the state vetting's to report.
    with contextlib.suppress(OSError, Fail):
        state.write_file(cache_file, data, "state directory")


def build_result(raw: Any) -> dict[str, Any]:
    """One entry of `nix build --json`, in one shape for every version: a
    derivation's `{"drvPath", "outputs": {name: path}}`, or `{"path"}` for
    an installable that is already a store path. 2.8 writes the latter as
    `{"path": ...}`, 2.26 as a bare string; later versions add fields
    (`startTime`, `stopTime`, ...), which are kept and never required."""
    if isinstance(raw, str) and raw.startswith("/"):
        return {"path": raw}
    if isinstance(raw, dict):
        outputs = raw.get("outputs")
        if (
            isinstance(raw.get("drvPath"), str)
            and isinstance(outputs, dict)
            and outputs
            and all(isinstance(v, str) for v in outputs.values())
        ):
            return raw
        if isinstance(raw.get("path"), str):
            return raw
    raise ValueError(f"not a build result: {raw!r}")


def parse_nix_version(text: str) -> tuple[int, int, int] | None:
    """`nix (Nix) 2.8.0`, `nix (Determinate Nix 3.6.2) 2.29.0`, `nix (Lix, like
    Nix) 2.91.1`: the last version number on the first line is Nix's."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    found = _VERSION.findall(first)
    if not found:
        return None
    major, minor, patch = found[-1]
    return int(major), int(minor), int(patch or 0)
