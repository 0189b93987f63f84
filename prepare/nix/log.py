"""Reading what a nix call says: its `--log-format internal-json` stream.

With that flag Nix writes one `@nix {...}` record per stderr line: activities
started and stopped (builds, downloads, substitutions), results attached to
them (a build's log lines and phases, bytes transferred), and messages (the
errors). `Log` folds those records into what happened, so progress is shown
and failures are read from structure, not from text meant for a terminal.

Lines that are not records are kept too: during a fetch, git and ssh write
their own messages there, the only place the cause of a failed fetch is named.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# A derivation's path as Nix's errors quote it, in 'x', "x" (2.34) or no quotes.
_DRV = re.compile(r"[^\s'\"]+\.drv\b")

if TYPE_CHECKING:
    from prepare.spec import Progress

# Activity types (nix/src/libutil/logging.hh).
ACT_COPY_PATH = 100
ACT_FILE_TRANSFER = 101
ACT_BUILDS = 104
ACT_BUILD = 105
ACT_SUBSTITUTE = 108
# A fetcher's own activity (`fetching Git repository ...`): Nix 2.8 starts
# it untyped (0), later releases as actFetchTree.
ACT_FETCH_TREE = 112
# Result types.
RES_BUILD_LOG_LINE = 101
RES_SET_PHASE = 104
RES_PROGRESS = 105
RES_SET_EXPECTED = 106

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# What a log keeps, whatever a call prints (a builder writing megabytes of
# log, a flake throwing a huge message): the last of each, each cut short.
MAX_MESSAGES = 50
MAX_TEXT = 8 << 10
MAX_LOG_LINE = 1 << 10


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _clean(text: str, limit: int = MAX_TEXT) -> str:
    """A message or log line from Nix, a builder or a fetcher, fit to quote:
    colours gone, other control characters escaped (a builder's output is
    the training source's, and must not drive the operator's terminal),
    newlines kept, cut at `limit`."""
    from prepare.host.human import printable

    text = strip_ansi(text if len(text) <= 2 * limit else text[: 2 * limit])
    text = printable(text, lines=True)
    return text if len(text) <= limit else text[:limit] + " ... (cut)"


def store_name(path: str) -> str:
    """'/nix/store/<hash>-training.drv' -> 'training'."""
    base = os.path.basename(path).removesuffix(".drv")
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


# What `nix build --dry-run` says it would do, one message a line: a head
# per list, then a line per store path, two spaces in. The same words on
# 2.8, 2.26 and 2.34 (seen on each): "this derivation will be built:",
# "these 2 derivations will be built:", "this path will be fetched (0.00
# MiB download, 0.00 MiB unpacked):" (2.34 sizes in KiB, MiB, ... as
# fits), and "don't know how to build these paths" for a path neither
# buildable nor on a cache.
_WILL = re.compile(r"(?:this|these (\d+)) (?:derivations?|paths?) will be (built|fetched)(?: \(([^)]*)\))?:")
_UNKNOWN = re.compile(r"don't know how to build these paths")
_LISTED_PATH = re.compile(r"  (/\S+)")
# How many store paths a list keeps (its count is kept whole): what a
# closure of nixpkgs fetches is hundreds; a list never costs more than this.
MAX_LISTED = 10_000


@dataclass
class Missing:
    """What a dry run said the build would do: the derivations it would
    build, the paths it would fetch from a cache (and their size, as Nix
    put it), and paths it can do neither for."""

    build: list[str] = field(default_factory=list)
    fetch: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    # Each list's length as Nix counted it (a list keeps MAX_LISTED).
    counts: dict[str, int] = field(default_factory=lambda: {"build": 0, "fetch": 0, "unknown": 0})
    fetch_size: str | None = None
    _into: str | None = None

    def feed(self, text: str) -> None:
        """One message of the call, in order."""
        head = _WILL.fullmatch(text.strip())
        if head is not None:
            self._into = "build" if head.group(2) == "built" else "fetch"
            if self._into == "fetch" and head.group(3):
                self.fetch_size = head.group(3)
            return
        if _UNKNOWN.match(text.strip()):
            self._into = "unknown"
            return
        listed = _LISTED_PATH.fullmatch(text.rstrip())
        if listed is None or self._into is None:
            self._into = None
            return
        self.counts[self._into] += 1
        kept: list[str] = getattr(self, self._into)
        if len(kept) < MAX_LISTED:
            kept.append(listed.group(1))


def _keep(kept: list[str], text: str) -> None:
    kept.append(text)
    if len(kept) > MAX_MESSAGES:
        del kept[0]


def _is_fetching(act: Activity) -> bool:
    """A fetcher's activity (untyped on 2.8, actFetchTree later) whose text
    says it is fetching something: shown as a fetch."""
    return act.type in (0, ACT_FETCH_TREE) and act.text.lower().startswith("fetching ")


class Log:
    """Folds the internal-json records of one nix call into what happened:
    builds started, bytes transferred, paths substituted, error records.

    Fed from the reader thread of `proc.run`, one stderr line at a time;
    `on_event` receives the progress events the CLI renders."""

    def __init__(self, on_event: Progress | None = None) -> None:
        self.on_event = on_event
        self.activities: dict[int, Activity] = {}
        # The last MAX_MESSAGES of each (`_keep`).
        self.errors: list[str] = []
        self.warnings: list[str] = []
        # stderr lines that are not records: git's and ssh's own messages
        # during a fetch, the only place the cause of a failed fetch is named.
        self.other: deque[str] = deque(maxlen=40)
        # The `builds` activity counts finished and failed builds, and Nix
        # bumps a count before it stops that build's own activity: that is
        # how a build's end is told apart as built, failed, or stopped (an
        # interrupt bumps neither) while it happens.
        self.builds_done = 0
        self.builds_failed = 0
        # What Nix announced it will move, by activity type: the NAR bytes
        # substitutions copy (ACT_COPY_PATH), whatever the cache's protocol.
        self.expected: dict[int, int] = {}
        self._done_seen = 0
        self._failed_seen = 0
        # What a dry run said it would build and fetch (`Missing`).
        self.missing = Missing()
        # Ends of activities said only once the call's outcome is known
        # (`finished`).
        self._pending: list[tuple[str, Activity, dict[str, Any]]] = []

    # -- reading ---------------------------------------------------------
    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        if not line.startswith("@nix "):
            if line.strip():
                self.other.append(_clean(line, MAX_LOG_LINE))
            return
        try:
            record = json.loads(line[5:])
        except (ValueError, RecursionError):
            self.other.append(_clean(line, MAX_LOG_LINE))
            return
        if isinstance(record, dict):
            # A malformed record must not kill the reader thread.
            with contextlib.suppress(Exception):
                self._record(record)

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
            said = _clean(str(record.get("msg", "")))
            if level == 0:
                self.missing.feed(said)
            text = said.strip()
            # A daemon's warnings reach its client at error level (the client
            # prints what the daemon sends as an error, 2.8 and 2.26 alike),
            # and "disabling binary cache" is printed as one: they say so.
            daemon_warning = text.startswith("warning:") or text.startswith("disabling binary cache")
            # "(use '--show-trace' to show detailed location information)",
            # a record of its own on 2.8 (2.26 and 2.34 write none); read
            # whatever its quotes.
            hint = text.startswith("(use ") and "--show-trace" in text
            if level == 0 and text and not hint and not daemon_warning:
                _keep(self.errors, text)
            elif level <= 1 and text:
                _keep(self.warnings, text)

    def _start(self, record: dict[str, Any]) -> None:
        act = Activity(
            id=int(record["id"]),
            type=int(record.get("type", 0)),
            text=_clean(str(record.get("text", "")), MAX_LOG_LINE),
            fields=list(record.get("fields") or []),
            parent=record.get("parent"),
            started=time.monotonic(),
        )
        self.activities[act.id] = act
        if act.type == ACT_BUILD:
            self._emit("build-start", act, drv=act.fields[0] if act.fields else None)
        elif act.type == ACT_FILE_TRANSFER:
            self._emit("download-start", act)
        elif _is_fetching(act):
            self._emit("fetch-start", act)
        elif act.type == ACT_SUBSTITUTE:
            self._emit("substitute-start", act)

    def _stop(self, record: dict[str, Any]) -> None:
        act = self.activities.get(int(record["id"]))
        if act is None or act.stopped is not None:
            return
        act.stopped = time.monotonic()
        seconds = round(act.stopped - act.started, 3)
        if act.type == ACT_BUILD:
            act.outcome = self._build_outcome()
            self._emit("build-done", act, seconds=seconds, ok=act.outcome == "built", outcome=act.outcome)
        elif act.type == ACT_FILE_TRANSFER and act.done:
            self._emit("download-done", act, bytes=act.done, seconds=seconds)
        elif act.type == ACT_FILE_TRANSFER:
            # Nix stops a transfer's activity whether it succeeded or not,
            # and says which only later, in the call's error or its exit:
            # one that moved nothing it reported is said when that is known
            # (`finished`), so a refused download is never "downloaded".
            self._pending.append(("download-done", act, {"bytes": 0, "seconds": seconds}))
        elif _is_fetching(act):
            # The same for a fetcher's activity (`fetching Git repository
            # ...`), whose bytes Nix never reports.
            self._pending.append(("fetch-done", act, {"seconds": seconds}))
        elif act.type == ACT_SUBSTITUTE:
            self._emit("substitute-done", act, seconds=seconds)

    def _build_outcome(self) -> str:
        """How the build whose activity just stopped ended (see builds_done)."""
        if self.builds_done > self._done_seen:
            self._done_seen += 1
            return "built"
        if self.builds_failed > self._failed_seen:
            self._failed_seen += 1
            return "failed"
        return "stopped"

    def _result(self, record: dict[str, Any]) -> None:
        act = self.activities.get(int(record.get("id", -1)))
        if act is None:
            return
        kind = record.get("type")
        fields = record.get("fields") or []
        if kind == RES_BUILD_LOG_LINE and fields:
            act.log.append(_clean(str(fields[0]), MAX_LOG_LINE))
        elif kind == RES_SET_PHASE and fields and act.type == ACT_BUILD:
            act.phase = str(fields[0])
            self._emit("build-phase", act, phase=act.phase)
        elif kind == RES_PROGRESS and len(fields) >= 4 and act.type == ACT_BUILDS:
            self.builds_done, self.builds_failed = int(fields[0]), int(fields[3])
        elif kind == RES_PROGRESS and len(fields) >= 2 and act.type == ACT_FILE_TRANSFER:
            act.done, act.expected = int(fields[0]), int(fields[1])
            self._emit("download-progress", act, done=act.done, expected=act.expected)
        elif kind == RES_PROGRESS and len(fields) >= 2 and act.type == ACT_COPY_PATH:
            act.done, act.expected = int(fields[0]), int(fields[1])
        elif kind == RES_SET_EXPECTED and len(fields) >= 2:
            self.expected[int(fields[0])] = int(fields[1])

    def finished(self, ok: bool) -> None:
        """The call is over, `ok` or not: the transfers and fetches whose
        end waited on that are said now, each with `ok`."""
        pending, self._pending = self._pending, []
        for kind, act, fields in pending:
            self._emit(kind, act, ok=ok, **fields)

    def _emit(self, kind: str, act: Activity, **fields: Any) -> None:
        """A progress event (prepare.cli.progress lists them) about `act`."""
        if self.on_event is not None:
            # A broken display must not break the build.
            with contextlib.suppress(Exception):
                self.on_event({"type": kind, "id": act.id, "name": act.name, **fields})

    # -- what happened ---------------------------------------------------
    def builds(self) -> list[Activity]:
        return [a for a in self.activities.values() if a.type == ACT_BUILD]

    def transfers(self) -> list[Activity]:
        return [a for a in self.activities.values() if a.type == ACT_FILE_TRANSFER]

    def substitutions(self) -> list[Activity]:
        return [a for a in self.activities.values() if a.type == ACT_SUBSTITUTE]

    def copies(self) -> list[Activity]:
        """Paths copied between stores: a substitution's NAR coming in (its
        fields: path, from, to)."""
        return [a for a in self.activities.values() if a.type == ACT_COPY_PATH]

    @property
    def bytes_downloaded(self) -> int:
        return sum(a.done for a in self.transfers())

    def error_text(self) -> str:
        if self.errors:
            return "\n".join(e.removeprefix("error:").strip() for e in self.errors)
        return "\n".join(self.other)

    def failed_build(self) -> Activity | None:
        """The build that failed first: the first one Nix's errors name
        ("builder for '/nix/store/…-x.drv' failed ..."), else one whose end
        was counted failed, else the last one that started. The errors come
        first: once a build fails, Nix stops the builds still running beside
        it, and their activities can end (and be counted failed) before the
        one that failed, so the count would name a sibling."""
        builds = self.builds()
        by_drv = {act.fields[0]: act for act in builds if act.fields and isinstance(act.fields[0], str)}
        for error in self.errors:
            for drv in _DRV.findall(error):
                if drv in by_drv:
                    return by_drv[drv]
        for act in builds:
            if act.outcome == "failed":
                return act
        return builds[-1] if builds else None
