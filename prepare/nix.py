"""The one wrapper around the `nix` command, and what its failures mean.

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
- `--no-write-lock-file`: the flake may live in a read-only store path, and a
  prepare must not edit the operator's checkout.
- `--no-eval-cache` on eval and build: Nix 2.8 caches a *failed* evaluation of
  a locked flake and answers the repeat with a generic "is not an attribute
  set", which would hide the `throw` message a 3 a.m. operator needs
  (nix/CONTRACT.md). The flake's evaluation costs milliseconds anyway.

Failures are classified by the *phase* a call belongs to (evaluation, input
fetch, build) and the error records Nix wrote, never by the exit code beyond
zero/non-zero: `nix build` exits 1 for a failed builder where `nix-store
--realise` exits 100, and the daemon and remote builders lose the 1xx codes
(NixOS/nix #8782, #4813, #12641).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import stat
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prepare import proc
from prepare.fail import Fail, permanent, transient

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

# Activity types (nix/src/libutil/logging.hh).
ACT_COPY_PATH = 100
ACT_FILE_TRANSFER = 101
ACT_BUILDS = 104
ACT_BUILD = 105
ACT_SUBSTITUTE = 108
# Result types.
RES_BUILD_LOG_LINE = 101
RES_SET_PHASE = 104
RES_PROGRESS = 105

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")

Event = dict[str, Any]
OnEvent = Callable[[Event], None]


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def system() -> str:
    """The Nix system double of this machine, for attribute paths. Pure
    evaluation has no `builtins.currentSystem`, so we name it ourselves."""
    machine = platform.machine().lower()
    arch = {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}.get(machine, machine)
    kernel = platform.system().lower()
    return f"{arch}-{kernel}"


def store_name(path: str) -> str:
    """'/nix/store/<hash>-training.drv' -> 'training'."""
    base = os.path.basename(path)
    if base.endswith(".drv"):
        base = base[: -len(".drv")]
    head, sep, rest = base.partition("-")
    return rest if sep and len(head) == 32 else base


@dataclass
class Activity:
    id: int
    type: int
    text: str
    fields: list[Any]
    parent: int | None
    started: float
    stopped: float | None = None
    phase: str | None = None
    outcome: str | None = None  # builds: built, failed, stopped
    done: int = 0
    expected: int = 0
    log: deque[str] = field(default_factory=lambda: deque(maxlen=25))

    @property
    def name(self) -> str:
        first = self.fields[0] if self.fields else ""
        if self.type in (ACT_BUILD, ACT_SUBSTITUTE, ACT_COPY_PATH) and isinstance(first, str) and first:
            return store_name(first)
        if self.type == ACT_FILE_TRANSFER and isinstance(first, str) and first:
            return first
        return strip_ansi(self.text)


class Log:
    """Folds the internal-json records of one nix call into what happened:
    builds started, bytes transferred, paths substituted, error records.

    Fed from the reader thread of `proc.run`, one stderr line at a time;
    `on_event` receives the progress events the CLI renders."""

    def __init__(self, on_event: OnEvent | None = None) -> None:
        self.on_event = on_event
        self.activities: dict[int, Activity] = {}
        self.errors: list[str] = []
        self.warnings: list[str] = []
        # stderr lines that are not records: git's and ssh's own messages
        # during a fetch, the only place the cause of a failed fetch is named.
        self.other: deque[str] = deque(maxlen=40)
        self.fetch_seen = False
        # The `builds` activity counts finished and failed builds, and Nix
        # bumps a count before it stops that build's own activity: that is
        # how a build's end is told apart as built, failed, or stopped (an
        # interrupt bumps neither) while it happens.
        self.builds_done = 0
        self.builds_failed = 0
        self._done_seen = 0
        self._failed_seen = 0

    # -- reading ---------------------------------------------------------
    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        if not line.startswith("@nix "):
            if line.strip():
                self.other.append(strip_ansi(line))
            return
        try:
            record = json.loads(line[5:])
        except ValueError:
            self.other.append(strip_ansi(line))
            return
        if isinstance(record, dict):
            try:
                self._record(record)
            except Exception:  # noqa: BLE001 - a malformed record must not kill the reader thread
                pass

    def _record(self, record: dict[str, Any]) -> None:
        action = record.get("action")
        if action == "start":
            self._start(record)
        elif action == "stop":
            self._stop(record)
        elif action == "result":
            self._result(record)
        elif action == "msg":
            level = record.get("level", 3)
            text = strip_ansi(str(record.get("msg", ""))).strip()
            if level == 0 and text and not text.startswith("(use '--show-trace'"):
                self.errors.append(text)
            elif level == 1 and text:
                self.warnings.append(text)

    def _start(self, record: dict[str, Any]) -> None:
        act = Activity(
            id=int(record["id"]),
            type=int(record.get("type", 0)),
            text=str(record.get("text", "")),
            fields=list(record.get("fields") or []),
            parent=record.get("parent"),
            started=time.monotonic(),
        )
        self.activities[act.id] = act
        low = act.text.lower()
        if act.type == ACT_FILE_TRANSFER or low.startswith("fetching ") or low.startswith("downloading "):
            self.fetch_seen = True
        if act.type == ACT_BUILD:
            self._emit({"type": "build-start", "id": act.id, "name": act.name, "drv": act.fields[0] if act.fields else None})
        elif act.type == ACT_FILE_TRANSFER:
            self._emit({"type": "download-start", "id": act.id, "name": act.name})
        elif act.type == ACT_SUBSTITUTE:
            self._emit({"type": "substitute-start", "id": act.id, "name": act.name})
        elif act.type == 0 and low.startswith("fetching "):
            self._emit({"type": "download-start", "id": act.id, "name": strip_ansi(act.text)})

    def _stop(self, record: dict[str, Any]) -> None:
        act = self.activities.get(int(record["id"]))
        if act is None or act.stopped is not None:
            return
        act.stopped = time.monotonic()
        seconds = round(act.stopped - act.started, 3)
        if act.type == ACT_BUILD:
            if self.builds_done > self._done_seen:
                self._done_seen += 1
                act.outcome = "built"
            elif self.builds_failed > self._failed_seen:
                self._failed_seen += 1
                act.outcome = "failed"
            else:
                act.outcome = "stopped"
            self._emit({"type": "build-done", "id": act.id, "name": act.name, "seconds": seconds,
                        "ok": act.outcome == "built", "outcome": act.outcome})
        elif act.type == ACT_FILE_TRANSFER or (act.type == 0 and act.text.lower().startswith("fetching ")):
            self._emit({"type": "download-done", "id": act.id, "name": act.name, "bytes": act.done, "seconds": seconds})
        elif act.type == ACT_SUBSTITUTE:
            self._emit({"type": "substitute-done", "id": act.id, "name": act.name, "seconds": seconds})

    def _result(self, record: dict[str, Any]) -> None:
        act = self.activities.get(int(record.get("id", -1)))
        if act is None:
            return
        kind = record.get("type")
        fields = record.get("fields") or []
        if kind == RES_BUILD_LOG_LINE and fields:
            act.log.append(strip_ansi(str(fields[0])))
        elif kind == RES_SET_PHASE and fields and act.type == ACT_BUILD:
            act.phase = str(fields[0])
            self._emit({"type": "build-phase", "id": act.id, "name": act.name, "phase": act.phase})
        elif kind == RES_PROGRESS and len(fields) >= 4 and act.type == ACT_BUILDS:
            self.builds_done, self.builds_failed = int(fields[0]), int(fields[3])
        elif kind == RES_PROGRESS and len(fields) >= 2 and act.type == ACT_FILE_TRANSFER:
            act.done, act.expected = int(fields[0]), int(fields[1])
            self._emit({"type": "download-progress", "id": act.id, "name": act.name,
                        "done": act.done, "expected": act.expected})

    def _emit(self, event: Event) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # noqa: BLE001 - a broken display must not break the build
                pass

    # -- what happened ---------------------------------------------------
    def builds(self) -> list[Activity]:
        return [a for a in self.activities.values() if a.type == ACT_BUILD]

    def transfers(self) -> list[Activity]:
        return [a for a in self.activities.values() if a.type == ACT_FILE_TRANSFER]

    def substitutions(self) -> list[Activity]:
        return [a for a in self.activities.values() if a.type == ACT_SUBSTITUTE]

    @property
    def bytes_downloaded(self) -> int:
        return sum(a.done for a in self.transfers())

    def error_text(self) -> str:
        if self.errors:
            return "\n".join(e.removeprefix("error:").strip() for e in self.errors)
        return "\n".join(self.other)

    def failed_build(self) -> Activity | None:
        """The build an error record names, else the last one that started."""
        text = "\n".join(self.errors)
        builds = self.builds()
        for act in builds:
            if act.outcome == "failed":
                return act
        for act in builds:
            drv = act.fields[0] if act.fields else None
            if drv and drv in text:
                return act
        return builds[-1] if builds else None


# -- classification ---------------------------------------------------------

EVALUATION = "evaluation"
FETCH = "fetch"
BUILD = "build"

# Compiled on first use: they only matter once a call has failed, and
# compiling them at import would cost every warm run ~10 ms.
_HASH_MISMATCH = r"hash mismatch in fixed-output derivation|hash mismatch importing path|NAR hash mismatch|got:\s+sha256"
_NO_SPACE = r"no space left on device|disk quota exceeded|database or disk is full"
# Daemon wording only. "connection reset by peer" and "unexpected end-of-file"
# also end a download cut short (current Nix appends curl's own words:
# "unable to download '…': Failure when receiving data from the peer (56)
# Recv failure: Connection reset by peer"), and sending an operator to
# `systemctl start nix-daemon` for a flaky network is the wrong fix. A daemon
# that drops the connection says so through its store: "cannot open
# connection to remote store 'unix://…': … Connection reset by peer" (Nix 2.8).
# A cut with no daemon wording is a fetch (below): transient either way.
_DAEMON = (
    r"cannot connect to socket at|cannot connect to daemon|error (reading from|writing to) daemon|"
    r"cannot open connection to remote store '(daemon|unix:[^']*)'|daemon-socket/socket"
)
# The daemon is there and says no to this user: the socket's permissions
# (Debian's nix-setup-systemd lets only the nix-users group in) or its
# allowed-users. Seen the same on 2.8 and 2.26; no retry changes group
# membership, so unlike an absent daemon it must stop a persist loop.
_DAEMON_REFUSED = (
    r"cannot connect to socket at '[^']*': permission denied|is not allowed to connect to the nix daemon"
)
# Nix builds as the members of build-users-group and that group does not
# exist: Debian's nix-bin without its recommended nix-setup-systemd (2.8 and
# 2.26 word it the same). Every build fails until the installation is fixed.
_BUILD_USERS = r"the group '[^']*' specified in 'build-users-group' does not exist"
# The build users cannot enter the directory Nix builds in (a single-user
# Nix as root builds under its TMPDIR, e.g. libpam-tmpdir's /tmp/user/0 at
# 0700). The runner gives Nix an enterable TMPDIR, so this is what is left
# when the builds go through a daemon whose own TMPDIR is like that.
_BUILD_DIR = r"nix-build-[^\s'/]*\.drv-\d+[^\n]*(permission denied|can't cd)|can't cd to [^\n]*/nix-build-"
# A flake URL Nix cannot parse (source.from, flake, or an input the flake
# declares): no retry parses it, so it must stop a persist loop. Checked
# before the fetch fallback, which would call any error in a fetch transient.
_BAD_URL = (
    r"is not a valid URL|\bURL '[^']*' is invalid|input '[^']*' is unsupported|has wrong length for hash type|"
    r"invalid SRI hash|is not SRI|invalid base-(16|32|64) hash|unexpected fragment '|should not have an authority|"
    r"has unexpected authority|has unsupported parameter|invalid Git branch/tag name|"
    # 2.26 says "hash algorithm" where 2.8 says "hash type".
    r"has wrong length for hash algorithm|"
    # 2.26 reads file:///x as an archive to open; 2.8 refuses it outright
    # ("input 'file:///x' is unsupported").
    r"could not read a file:// file|"
    # 2.26 (not 2.8) takes a string it cannot parse as a URL for a path
    # relative to the working directory, so the refusal names
    # "<cwd>/github:a" or "<cwd>/path:/tmp/a b": a path component that
    # carries a URL scheme.
    r"getting status of '[^']*/[a-z][a-z0-9+.-]*:[^']*': no such file or directory"
)
_TIMEOUT = r"timed out after \d+ seconds"
_BUILDER = (
    r"builder for .* failed|build of .* failed|dependencies couldn't be built|"
    r"dependencies of derivation .* failed to build|cannot build|builder failed"
)
_FETCH = (
    r"unable to download|couldn't connect|could not connect|could not resolve|couldn't resolve|"
    r"failed to connect|connection refused|connection timed out|timeout was reached|network is unreachable|"
    r"temporary failure in name resolution|name or service not known|program 'git' failed|unable to access|"
    r"cannot fetch|failed to fetch|unable to fetch|could not read from remote repository|http error|"
    r"ssh: connect to host|host key verification failed|\bSSL\b|\bTLS\b|connection reset by peer|"
    r"unexpected end-of-file|failure when receiving data from the peer"
)


@functools.lru_cache(maxsize=None)
def _pattern(source: str) -> re.Pattern[str]:
    return re.compile(source, re.IGNORECASE)


@dataclass(frozen=True)
class Diagnosis:
    # hash-mismatch, no-space, build-users, daemon-refused, store-permission, build-dir, daemon, timeout,
    # builder, flake-builder, bad-url, fetch, evaluation, unknown
    category: str
    permanent: bool
    detail: str


def _store_permission(text: str) -> bool:
    for line in text.splitlines():
        low = line.lower()
        if ("permission denied" in low or "operation not permitted" in low or "read-only file system" in low) and (
            "/nix/" in line or "big-lock" in low or "store" in low
        ):
            return True
    return False


def _build_logs(log: Log) -> str:
    return "\n".join(line for act in log.builds() for line in act.log)


def diagnose(phase: str, log: Log, returncode: int | None = None) -> Diagnosis:
    """Why a nix call failed, and whether retrying could help.

    Specific causes first (they can surface in any phase: a full store stops
    a fetch as surely as a build; a URL that does not parse is permanent even
    in a fetch, where any other error is taken for the network's), then the
    phase decides: an evaluation error
    is permanent, a failed fetch transient, and in a build call an error with
    no build started is the evaluation of the overridden flake (permanent)
    while an error after one is the builder's (transient)."""
    text = log.error_text()
    detail = text.strip() or (f"nix exited with status {returncode} and wrote no error" if returncode else "no error text")
    if _pattern(_HASH_MISMATCH).search(text):
        return Diagnosis("hash-mismatch", True, detail)
    if _pattern(_NO_SPACE).search(text):
        return Diagnosis("no-space", True, detail)
    if _pattern(_BUILD_USERS).search(text):
        return Diagnosis("build-users", True, detail)
    if _pattern(_DAEMON_REFUSED).search(text):
        return Diagnosis("daemon-refused", True, detail)
    if _store_permission(text):
        return Diagnosis("store-permission", True, detail)
    if _pattern(_BUILD_DIR).search(text) or _pattern(_BUILD_DIR).search(_build_logs(log)):
        return Diagnosis("build-dir", True, detail)
    if _pattern(_DAEMON).search(text):
        return Diagnosis("daemon", False, detail)
    if _pattern(_TIMEOUT).search(text):
        return Diagnosis("timeout", False, detail)
    if phase == BUILD and (_pattern(_BUILDER).search(text) or (log.builds() and not log.errors)):
        return Diagnosis("builder", False, detail)
    if log.errors and _pattern(_BAD_URL).search(text):
        return Diagnosis("bad-url", True, detail)
    if _pattern(_FETCH).search(text) or _pattern(_FETCH).search("\n".join(log.other)):
        return Diagnosis("fetch", False, detail)
    if not log.errors:
        # Killed, crashed, or a failure with nothing said: nothing shows it
        # would fail again.
        return Diagnosis("unknown", False, detail)
    if phase == FETCH:
        return Diagnosis("fetch", False, detail)
    if phase == BUILD and log.builds():
        return Diagnosis("builder", False, detail)
    return Diagnosis("evaluation", True, detail)


_FIXES = {
    "hash-mismatch": "a pinned hash is wrong; retrying fetches the same bytes. Update the hash in the flake "
                     "(the 'got:' value above) or the pin that produced it",
    "no-space": "the Nix store's disk is full: free space with `nix-collect-garbage -d` (or `nix-store --gc`) "
                "or grow the disk, then run again",
    "store-permission": "this user cannot write the Nix store: run as the store's owner (root on a single-user "
                        "install) or through the daemon (NIX_REMOTE=daemon, with nix-daemon running)",
    "build-users": "this is the Nix installation, not the flake: Nix builds as the members of its "
                   "build-users-group, and that group does not exist. On Debian/Ubuntu install the package that "
                   "creates it and the nixbld users: `sudo apt-get install nix-setup-systemd` (scripts/setup does); "
                   "elsewhere create the group and its users as the Nix manual's multi-user installation says",
    "daemon-refused": "this is the Nix installation, not the flake: the Nix daemon refuses this user. On "
                      "Debian/Ubuntu add it to the nix-users group (`sudo usermod -aG nix-users $USER`, then log in "
                      "again); elsewhere add it to allowed-users in /etc/nix/nix.conf and restart nix-daemon",
    "build-dir": "this is the Nix installation, not the flake or the training source: Nix's build users cannot "
                 "enter the directory builds run in (the TMPDIR of whoever runs the builds: nix-daemon's, or this "
                 "process's for a single-user Nix). Make it enterable (`chmod 755`, or `chmod 1777` like /tmp), or "
                 "point TMPDIR at one that is",
    "daemon": "this is the Nix installation, not the flake: the Nix daemon is not reachable. Start it: "
              "`sudo systemctl start nix-daemon.socket nix-daemon` (Debian/Ubuntu: it comes with "
              "`sudo apt-get install nix-setup-systemd`); the next attempt retries",
    "timeout": "the build ran past build_timeout_s (--build-timeout); raise it if the build is legitimately "
               "slow; the next attempt retries",
    "builder": "the build itself failed: fix the training source and publish again; the next attempt retries",
    "flake-builder": "a build the flake itself provides failed, not the training build: fix the flake (or "
                     "its toolchain) and point flake (--flake) at the fixed revision; retrying builds the same "
                     "thing again. A builder that cannot find its tools (`command not found`, `executing "
                     "'/bin/sh'`) relies on host programs that Nix's build sandbox (sandbox = true) hides",
    "bad-url": "Nix cannot parse the URL quoted above, and no retry will: correct source.from in [join.source] "
               "(--source) or flake (--flake), whichever it is (or the input the flake declares with it)",
    "fetch": "check the network, the URL and its ref; the next attempt retries",
    "evaluation": "fix the flake, or point `flake` (--flake) at one that evaluates",
    "unknown": "the next attempt retries",
}


def failure(diagnosis: Diagnosis, doing: str, *, fix: str | None = None, extra: str = "") -> Fail:
    """An operator-facing Fail: what was being done, what Nix said, the fix.

    `fix` is the caller's word for an evaluation error only (it knows which
    setting names the flake); every other category has one cause whatever
    the call, and its own fix: an input fetch that fails while the flake is
    evaluated is the network's fault, not the flake's, and says retry."""
    detail = _clip(diagnosis.detail)
    # Nix words the same refusal differently across versions (2.26 takes an
    # unparsable URL for a relative path); the operator and a fleet's log
    # search get the same words from every version.
    said = "Nix refused the URL (it is not a valid URL to Nix): " if diagnosis.category == "bad-url" else ""
    message = f"{doing} failed: {said}{detail}"
    if extra:
        message += f"\n{extra}"
    chosen = fix if fix and diagnosis.category == EVALUATION else _FIXES[diagnosis.category]
    message += f"\nFix: {chosen}"
    return Fail(message, permanent=diagnosis.permanent)


def _clip(text: str, limit: int = 3000) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 20] + "\n... (cut)"


# -- the wrapper ---------------------------------------------------------------


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


@dataclass
class Outcome:
    """A finished nix call: its result and what the log said."""

    completed: proc.Completed
    log: Log

    @property
    def ok(self) -> bool:
        return self.completed.returncode == 0


_VERSIONS: dict[tuple[str, int, int, int], tuple[int, int, int]] = {}


class Nix:
    """The one place `nix` argv is built. `state_dir` holds the empty flake
    registry; `env` replaces the environment (tests set NIX_CONFIG)."""

    def __init__(
        self,
        state_dir: str,
        *,
        program: str = "nix",
        env: Mapping[str, str] | None = None,
        on_event: OnEvent | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.program = program
        self.env = dict(env) if env is not None else None
        self.on_event = on_event
        self.registry = os.path.join(state_dir, "flake-registry.json")
        self.calls = 0

    # -- flags -------------------------------------------------------------
    def _common(self) -> list[str]:
        return [
            self.program,
            "--extra-experimental-features", FEATURES,
            "--log-format", "internal-json",
            "--option", "flake-registry", self.registry,
            "--option", "accept-flake-config", "false",
        ]

    def _ensure_registry(self) -> None:
        # An empty registry: flake references must be full URLs; nothing is
        # looked up by name, locally or on the network.
        if os.path.exists(self.registry):
            return
        tmp = f"{self.registry}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write('{"flakes": [], "version": 2}\n')
        os.replace(tmp, self.registry)

    def _run(self, argv: Sequence[str], timeout: float | None, log: Log) -> proc.Completed:
        self.calls += 1
        try:
            return proc.run(argv, timeout=timeout, env=self.env, on_stderr_line=log.feed)
        except proc.Missing:
            raise self._missing() from None

    def _missing(self) -> Fail:
        path = (self.env or os.environ).get("PATH", "")
        return permanent(f"nix is not installed: {self.program!r} is not on PATH ({path}); {INSTALL}")

    # -- version -------------------------------------------------------------
    def check_version(self) -> tuple[int, int, int]:
        """The Nix version, refusing one older than OLDEST.

        Asking costs a process start (~50 ms, more through the seam's
        timeout), on every attempt of a loop whose warm path should cost
        little more than the build itself. The answer depends only on the
        binary, so it is kept per (real path, inode, size, mtime), in memory
        and in the state directory; an upgrade replaces the file and asks
        again."""
        path_var = (self.env or os.environ).get("PATH")
        resolved = self.program if os.sep in self.program else proc.which(self.program, path=path_var)
        if resolved is None or not os.path.exists(resolved):
            raise self._missing()
        real = os.path.realpath(resolved)
        st = os.stat(real)
        key = (real, st.st_ino, st.st_size, st.st_mtime_ns)
        version = _VERSIONS.get(key) or self._cached_version(key)
        if version is None:
            self.calls += 1
            try:
                done = proc.run([resolved, "--version"], timeout=60, env=self.env)
            except proc.Missing:
                raise self._missing() from None
            except proc.TimedOut:
                raise transient(f"`{resolved} --version` did not answer within 60s; the next attempt retries") from None
            version = parse_nix_version(done.stdout)
            if done.returncode != 0 or version is None:
                raise permanent(
                    f"`{resolved} --version` failed (exit {done.returncode}): "
                    f"{strip_ansi(done.stderr or done.stdout).strip()[:500]!r}; reinstall nix: {INSTALL}"
                )
            self._remember_version(key, version)
        _VERSIONS[key] = version
        if version[:2] < OLDEST:
            raise permanent(
                f"nix {'.'.join(map(str, version))} at {resolved} is older than {'.'.join(map(str, OLDEST))}, the "
                f"oldest fdl-prepare supports (flakes and `nix build --json`); {INSTALL}"
            )
        return version

    def _version_file(self) -> str:
        return os.path.join(self.state_dir, "nix-version.json")

    def _cached_version(self, key: tuple[str, int, int, int]) -> tuple[int, int, int] | None:
        try:
            with open(self._version_file(), encoding="utf-8") as handle:
                data = json.load(handle)
            if tuple(data["key"]) == key:
                return tuple(int(x) for x in data["version"])  # type: ignore[return-value]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def _remember_version(self, key: tuple[str, int, int, int], version: tuple[int, int, int]) -> None:
        try:
            tmp = f"{self._version_file()}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump({"key": list(key), "version": list(version)}, handle)
            os.replace(tmp, self._version_file())
        except OSError:
            pass  # only a cache: the next attempt asks again

    # -- calls ---------------------------------------------------------------
    def eval_json(self, installable: str, *, apply: str | None = None, timeout: float = EVAL_TIMEOUT_S,
                  doing: str | None = None, fix: str | None = None) -> Any:
        self._ensure_registry()
        argv = self._common() + ["eval", "--json", "--no-write-lock-file", "--no-eval-cache", installable]
        if apply is not None:
            argv += ["--apply", apply]
        outcome = self._call(argv, timeout, doing or f"evaluating {installable}", EVALUATION, fix=fix)
        try:
            return json.loads(outcome.completed.stdout)
        except ValueError:
            raise permanent(
                f"{doing or 'evaluating ' + installable}: nix printed no JSON "
                f"({outcome.completed.stdout[:200]!r}); is the flake's output a plain value?"
            ) from None

    def prefetch(self, url: str, *, timeout: float = FETCH_TIMEOUT_S, doing: str | None = None) -> Prefetched:
        """`nix flake prefetch --json url`. No caller fix: a fetch's failure
        is never an evaluation error, so every category brings its own."""
        self._ensure_registry()
        # tarball-ttl 0: a remote git ref (or tarball URL) is otherwise
        # resolved from Nix's cache for an hour, and a re-dial right after a
        # publish would build the previous commit.
        argv = self._common() + ["--option", "tarball-ttl", "0", "flake", "prefetch", "--json", url]
        outcome = self._call(argv, timeout, doing or f"fetching {url}", FETCH)
        try:
            data = json.loads(outcome.completed.stdout)
            return Prefetched(url=url, store_path=data["storePath"], nar_hash=data["hash"], locked=data.get("locked"))
        except (ValueError, KeyError, TypeError):
            raise transient(
                f"{doing or 'fetching ' + url}: `nix flake prefetch` printed no store path "
                f"({outcome.completed.stdout[:200]!r}); the next attempt retries"
            ) from None

    def build(
        self,
        installables: Sequence[str],
        *,
        out_link: str | None,
        overrides: Mapping[str, str] = {},
        timeout_s: float | None = None,
        doing: str = "building",
        fix: str | None = None,
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
        argv = self._common() + ["build", "--json", "--no-write-lock-file", "--no-eval-cache"]
        argv += ["--out-link", out_link] if out_link else ["--no-link"]
        if timeout_s is not None:
            # Nix's own limit kills the builder and reports the timeout in a
            # record; the wrapper's limit below is only the backstop.
            argv += ["--option", "timeout", str(max(1, int(timeout_s)))]
        for name, url in overrides.items():
            argv += ["--override-input", name, url]
        argv += list(installables)
        wall = None if timeout_s is None else timeout_s + BUILD_GRACE_S
        outcome = self._call(argv, wall, doing, BUILD, fix=fix, source_path=source_path)
        try:
            results = [build_result(r) for r in json.loads(outcome.completed.stdout)]
        except (ValueError, TypeError):
            raise transient(f"{doing}: nix build printed no JSON result of a known shape "
                            f"({outcome.completed.stdout[:200]!r}); the next attempt retries") from None
        return results, outcome.log

    def _call(self, argv: list[str], timeout: float | None, doing: str, phase: str, *,
              fix: str | None = None, source_path: str | None = None) -> Outcome:
        log = Log(self.on_event)
        try:
            completed = self._run(argv, timeout, log)
        except proc.TimedOut as late:
            what = "the build" if phase == BUILD else "nix"
            raise transient(
                f"{doing} did not finish within {late.timeout:g}s; {what} was stopped. "
                + ("Raise build_timeout_s (--build-timeout) if the build is legitimately slow; " if phase == BUILD else "")
                + "the next attempt retries"
            ) from None
        outcome = Outcome(completed, log)
        if not outcome.ok:
            diagnosis = diagnose(phase, log, completed.returncode)
            extra = ""
            if diagnosis.category == "builder" and not _builds_from(log.failed_build(), source_path):
                diagnosis = Diagnosis("flake-builder", True, diagnosis.detail)
            if diagnosis.category in ("builder", "flake-builder", "timeout"):
                failed = log.failed_build()
                if failed is not None and failed.log:
                    extra = f"last lines of the {failed.name} build log:\n  " + "\n  ".join(failed.log)
            elif log.other and log.errors:
                # git and ssh write the actual cause (refused, unknown ref,
                # bad host key) as plain lines; Nix only says git failed.
                extra = "the fetcher said:\n  " + "\n  ".join(list(log.other)[-8:])
            raise failure(diagnosis, doing, fix=fix, extra=extra)
        return outcome


def _enterable_by_others(path: str) -> bool:
    """Whether a user with no particular rights can reach into `path`:
    every directory on the way must grant others search (x)."""
    current = os.path.realpath(path)
    while True:
        try:
            st = os.stat(current)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or not st.st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(current)
        if parent == current:
            return True
        current = parent


def build_tmpdir(env: Mapping[str, str]) -> str | None:
    """A TMPDIR for nix children in which Nix's build users can build, or
    None to leave TMPDIR as it is.

    A single-user Nix run as root builds in `$TMPDIR/nix-build-*`, as the
    nixbld users, who must be able to enter it; libpam-tmpdir hands root
    `/tmp/user/0` at 0700, and every build then fails with "Permission
    denied" although nothing is wrong with the flake or the source. Rather
    than refuse such a box, Nix gets the box's shared temporary directory,
    which is made for exactly this. Other users build as themselves or
    through the daemon (whose own TMPDIR counts), so only root needs it."""
    if os.geteuid() != 0:
        return None
    current = env.get("TMPDIR") or "/tmp"
    if _enterable_by_others(current):
        return None
    for candidate in ("/tmp", "/var/tmp"):
        if _enterable_by_others(candidate):
            return candidate
    raise permanent(
        f"Nix's build users (nixbld) cannot enter TMPDIR={current!r}, nor /tmp or /var/tmp: a single-user Nix run "
        "as root builds there as those users, so every build would fail with \"Permission denied\". This is the "
        "box's setup, not the flake: make one of them enterable (`chmod 1777 /tmp`), or set TMPDIR to a "
        "directory every user can enter"
    )


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
        if isinstance(raw.get("drvPath"), str) and isinstance(outputs, dict) and outputs \
                and all(isinstance(v, str) for v in outputs.values()):
            return raw
        if isinstance(raw.get("path"), str):
            return raw
    raise ValueError(f"not a build result: {raw!r}")


def _builds_from(act: Activity | None, source_path: str | None) -> bool:
    """Whether the failed build is the training source's: its derivation
    names the fetched source tree (as `src`, or through a vendoring step that
    reads it). Anything else that failed (libtorch, the flake's toolchain)
    is the flake's. When that cannot be told, the training build is blamed,
    as before the distinction existed: it is the one that changes."""
    if source_path is None:
        return False
    drv = act.fields[0] if act is not None and act.fields else None
    if not isinstance(drv, str) or not drv.endswith(".drv"):
        return True
    try:
        with open(drv, "rb") as handle:
            return source_path.encode() in handle.read()
    except OSError:
        return True


def parse_nix_version(text: str) -> tuple[int, int, int] | None:
    """`nix (Nix) 2.8.0`, `nix (Determinate Nix 3.6.2) 2.29.0`, `nix (Lix, like
    Nix) 2.91.1`: the last version number on the first line is Nix's."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    found = _VERSION.findall(first)
    if not found:
        return None
    major, minor, patch = found[-1]
    return int(major), int(minor), int(patch or 0)
