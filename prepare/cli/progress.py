"""Showing the long steps (downloads, builds) while they run.

The library never prints: `prepare.build` hands events (plain dicts) to a
`progress` callable, and the CLI picks how to show them with `renderer`:

- on a terminal, a live display: downloads with their bytes, builds as
  running or done with the phase they are in (rich, imported only then:
  the `live` extra; without it, a terminal gets the plain lines);
- anywhere else (systemd's journal, a pipe, a CI log), one plain line per
  build or download started and finished, and, while a step runs, a line
  at least every `heartbeat_s` (10 s) saying what runs, for how long, and
  the bytes so far (`fdl-prepare: build: 40 s, building libtorch-cpu,
  812.0 MiB so far`): a 40-minute build is never a silent one. No
  spinners, no carriage returns: a journal keeps every byte, and a redrawn
  line there is noise. Lines written to the journal carry the info
  priority (prepare.host.journal).

Events (all have "type"): step-start {name, detail} and step-done {name,
seconds, ok} around each of the pipeline's steps (prepare.pipeline); step
{name, detail}, a phase inside one (evaluate, fetch, build, wait, sign,
copy); build-start {id, name, drv}; build-phase {id, name, phase};
build-done {id, name, seconds, ok, outcome: built | failed | stopped};
download-start {id, name}; download-progress {id, name, done, expected};
download-done {id, name, bytes, seconds, ok?}; fetch-start {id, name} and
fetch-done {id, name, seconds, ok}, a fetcher's (`fetching Git repository
...`), whose end is said once the call's outcome is known; substitute-start
/ substitute-done {id, name}; end {}. Unknown types are ignored, so the
producer can grow.

Events arrive on the thread that reads nix's stderr: every renderer here
serialises its writes with a lock.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, TextIO

from prepare.host import human, journal
from prepare.host.redact import redact
from prepare.spec import Event, Progress

# Small files a binary cache serves for every path it is asked about: a line
# each would bury the transfers that matter.
_QUIET_SUFFIXES = (".narinfo", "nix-cache-info")

# Off a terminal, the longest a running step stays silent.
HEARTBEAT_S = 10.0

# A phase's name (a `step` event inside a pipeline step) as what it is doing.
_DOING = {"evaluate": "evaluating", "fetch": "fetching", "build": "building", "sign": "signing", "copy": "copying"}


def doing(event: Event) -> str:
    """What a `step` (phase) event says is happening, as words."""
    name, detail = str(event.get("name", "")), str(event.get("detail", ""))
    verb = _DOING.get(name)
    if verb is None:
        return detail or name
    return f"{verb} {detail}".strip()


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):
        return False


def renderer(
    stream: TextIO, *, prefix: str = "fdl-prepare", live: bool | None = None, heartbeat_s: float = HEARTBEAT_S
) -> Progress:
    """The progress callable for `stream`: live on a terminal, plain lines
    elsewhere, with a line at least every `heartbeat_s` while a step runs.
    `live` forces the choice (tests, `--json` runs)."""
    if live is None:
        live = _is_tty(stream)
    if live:
        try:
            return LiveRenderer(stream)
        except ImportError:  # rich missing: plain lines still say everything
            pass
    return PlainRenderer(stream, prefix=prefix, heartbeat_s=heartbeat_s)


def chain(*receivers: Progress | None) -> Progress:
    """One progress callable that hands each event to every receiver."""
    chosen = [r for r in receivers if r is not None]

    def tell(event: Event) -> None:
        for receiver in chosen:
            # One broken receiver must not silence the others.
            with contextlib.suppress(Exception):
                receiver(event)

    return tell


def _redacted(event: Event) -> Event:
    """The event with the user-info of any URL in its strings (a step's
    detail, a download's URL) hidden (prepare.host.redact), before any of it
    reaches a terminal or a journal."""
    return {k: redact(v) if isinstance(v, str) else v for k, v in event.items()}


class PlainRenderer:
    """One line per started and finished build or download, and a
    heartbeat line (see the module's doc) while a step runs."""

    def __init__(self, stream: TextIO, *, prefix: str = "fdl-prepare", heartbeat_s: float = HEARTBEAT_S) -> None:
        self.stream = stream
        self.prefix = prefix
        self.heartbeat_s = heartbeat_s
        self.journal = journal.is_journal(stream)
        # One lock for the writes, the state and the heartbeat's waits:
        # events arrive on nix's reader threads, the heartbeat on its own.
        self.lock = threading.Condition(threading.RLock())
        self.started: dict[Any, float] = {}
        # The step running (a pipeline step, or a phase when no pipeline
        # step is known, as in publish), since when, and what it does.
        self.step: str | None = None
        self.step_since = 0.0
        self.step_doing = ""
        self.pipeline_step = False
        # What runs in it now (by activity id, in start order) and the
        # bytes its downloads moved.
        self.running: dict[Any, str] = {}
        self.bytes: dict[Any, int] = {}
        self.last_line = time.monotonic()
        self.beating: threading.Thread | None = None

    def _line(self, text: str) -> None:
        with self.lock:
            self.last_line = time.monotonic()
            try:
                self.stream.write(journal.lines(f"{self.prefix}: {text}", journal.INFO, self.journal))
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def __call__(self, event: Event) -> None:
        event = _redacted(event)
        with self.lock:
            self._track(event)
        self._show(event)

    def _show(self, event: Event) -> None:
        kind = event.get("type")
        name = event.get("name", "?")
        if kind == "build-start":
            self._line(f"building {name}")
        elif kind == "build-done":
            verb = {"failed": "build failed:", "stopped": "build stopped:"}.get(event.get("outcome", ""), "built")
            self._line(f"{verb} {name} ({event.get('seconds', 0):.1f}s)")
        elif kind == "download-start":
            if not str(name).endswith(_QUIET_SUFFIXES):
                self._line(f"downloading {name}")
        elif kind == "download-done":
            # One that failed is said by the failure, never as "downloaded".
            if not str(name).endswith(_QUIET_SUFFIXES) and event.get("ok", True):
                got = event.get("bytes") or 0
                amount = f"{human.size(got)}, " if got else ""
                self._line(f"downloaded {name} ({amount}{event.get('seconds', 0):.1f}s)")
        elif kind == "fetch-start":
            self._line(str(name))
        elif kind == "fetch-done":
            if event.get("ok", False):
                what = str(name)
                what = "fetched " + what[len("fetching ") :] if what.lower().startswith("fetching ") else what
                self._line(f"{what} ({event.get('seconds', 0):.1f}s)")
        elif kind == "substitute-start":
            self._line(f"fetching {name} from a binary cache")
        elif kind == "substitute-done":
            self._line(f"fetched {name} from a binary cache ({event.get('seconds', 0):.1f}s)")
        elif kind == "step" and name == "wait":
            # Other phases are quick; a wait on another prepare can be long,
            # and a journal that says nothing meanwhile looks like a hang.
            self._line(str(event.get("detail", "waiting for another fdl-prepare")))

    # -- the heartbeat ------------------------------------------------------------------------

    def _track(self, event: Event) -> None:
        """What the heartbeat says: the step, what runs in it, its bytes
        (under the lock)."""
        kind = event.get("type")
        key = event.get("id")
        now = time.monotonic()
        if kind == "step-start":
            self._enter(str(event.get("name", "?")), str(event.get("detail", "")), now, pipeline=True)
        elif kind == "step":
            if self.pipeline_step:
                self.step_doing = doing(event)
            else:
                self._enter(str(event.get("name", "?")), doing(event), now, pipeline=False)
        elif kind in ("step-done", "end"):
            self.step = None
            self.pipeline_step = False
            self.running.clear()
            self.lock.notify_all()
        elif kind == "build-start":
            self.running[key] = f"building {event.get('name', '?')}"
        elif kind == "download-start" and not str(event.get("name", "")).endswith(_QUIET_SUFFIXES):
            self.running[key] = f"downloading {event.get('name', '?')}"
        elif kind == "fetch-start":
            self.running[key] = str(event.get("name", "fetching"))
        elif kind == "substitute-start":
            self.running[key] = f"fetching {event.get('name', '?')} from a binary cache"
        elif kind == "download-progress":
            self.bytes[key] = int(event.get("done") or 0)
        elif kind in ("build-done", "download-done", "fetch-done", "substitute-done"):
            self.running.pop(key, None)
            if kind == "download-done" and event.get("bytes"):
                self.bytes[key] = int(event["bytes"])

    def _enter(self, step: str, what: str, now: float, *, pipeline: bool) -> None:
        if step != self.step or pipeline:
            self.step, self.step_since, self.bytes = step, now, {}
            # Silence is counted from the step's start.
            self.last_line = max(self.last_line, now)
        self.step_doing = what
        self.pipeline_step = pipeline
        if self.heartbeat_s > 0 and self.beating is None:
            self.beating = threading.Thread(target=self._beat, name="fdl-prepare heartbeat", daemon=True)
            self.beating.start()

    def heartbeat(self, now: float | None = None) -> str | None:
        """The heartbeat line for now; None when no step runs."""
        with self.lock:
            if self.step is None:
                return None
            now = time.monotonic() if now is None else now
            running = list(self.running.values())
            what = running[-1] if running else self.step_doing
            if len(running) > 1:
                what += f" (and {len(running) - 1} more)"
            parts = [f"{self.step}: {int(now - self.step_since)} s"]
            if what:
                parts.append(what)
            moved = sum(self.bytes.values())
            if moved:
                parts.append(f"{human.size(moved)} so far")
            return ", ".join(parts)

    def _beat(self) -> None:
        """While a step runs: a line whenever `heartbeat_s` has passed
        without one. Ends when no step runs (the next step starts another)."""
        while True:
            with self.lock:
                if self.step is None:
                    self.beating = None
                    return
                wait = self.last_line + self.heartbeat_s - time.monotonic()
                if wait > 0:
                    self.lock.wait(wait)
                    continue
                line = self.heartbeat()
                if line is not None:
                    self._line(line)


class LiveRenderer:
    """A redrawn table on a terminal: running and finished builds with their
    phase, and downloads with bytes so far. Started on the first event,
    stopped on `end` (or at exit)."""

    MAX_ROWS = 12

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console  # noqa: F401 - fail early (ImportError) if rich is missing

        self.stream = stream
        self.lock = threading.Lock()
        self.rows: dict[Any, dict[str, Any]] = {}
        self.step = ""
        self.live: Any = None

    def _start(self) -> None:
        from rich.console import Console
        from rich.live import Live

        console = Console(file=self.stream, stderr=True)
        self.live = Live(console=console, get_renderable=self._render, refresh_per_second=8, transient=False)
        self.live.start()
        import atexit

        atexit.register(self.close)

    def close(self) -> None:
        with self.lock:
            live, self.live = self.live, None
        if live is not None:
            # The display is best effort.
            with contextlib.suppress(Exception):
                live.stop()

    def __call__(self, event: Event) -> None:
        event = _redacted(event)
        kind = event.get("type")
        if kind == "end":
            self.close()
            return
        with self.lock:
            if kind == "step-start":
                # A header only: a quick step alone starts no display.
                self.step = f"{event.get('name')}: {event.get('detail', '')}"
                return
            if kind == "step":
                self.step = f"{event.get('name')}: {event.get('detail', '')}"
            elif kind in ("build-start", "download-start", "fetch-start", "substitute-start"):
                if str(event.get("name", "")).endswith(_QUIET_SUFFIXES):
                    return
                what = kind.split("-")[0]
                self.rows[event.get("id")] = {
                    "what": what,
                    "name": event.get("name", "?"),
                    "state": "running",
                    "since": time.monotonic(),
                    "phase": None,
                    "done": 0,
                    "expected": 0,
                }
            elif kind == "build-phase":
                row = self.rows.get(event.get("id"))
                if row:
                    row["phase"] = event.get("phase")
            elif kind == "download-progress":
                row = self.rows.get(event.get("id"))
                if row:
                    row["done"], row["expected"] = event.get("done", 0), event.get("expected", 0)
            elif kind in ("build-done", "download-done", "fetch-done", "substitute-done"):
                row = self.rows.get(event.get("id"))
                if row:
                    row["state"] = {"failed": "failed", "stopped": "stopped"}.get(event.get("outcome", ""), "done")
                    if event.get("ok", True) is False:
                        row["state"] = "failed"
                    row["seconds"] = event.get("seconds", 0.0)
                    if kind == "download-done" and event.get("bytes"):
                        row["done"] = event["bytes"]
            else:
                return
            start = self.live is None
        if start:
            # A display that cannot start leaves the run without one, nothing worse.
            with contextlib.suppress(Exception):
                self._start()

    def _render(self) -> Any:
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        table.add_column(no_wrap=True)
        table.add_column(overflow="ellipsis", no_wrap=True, max_width=70)
        table.add_column(no_wrap=True)
        # Rich calls this from its refresh thread while the nix reader thread
        # adds rows and updates them in place (a dict changing size under an
        # iteration raises): read what is shown under the lock, rows copied,
        # and render from the copies.
        with self.lock:
            rows = [dict(r) for r in list(self.rows.values())[-self.MAX_ROWS :]]
            done = sum(1 for r in self.rows.values() if r["state"] == "done" and r["what"] == "build")
            step = self.step
        now = time.monotonic()
        running = sum(1 for r in rows if r["state"] == "running" and r["what"] == "build")
        table.add_row(f"[bold]{step}[/bold]", f"builds: {running} running, {done} done", "")
        for row in rows:
            seconds = row.get("seconds", now - row["since"])
            if row["what"] == "build":
                state = {
                    "running": "[yellow]building[/yellow]",
                    "done": "[green]built[/green]",
                    "failed": "[red]failed[/red]",
                    "stopped": "[red]stopped[/red]",
                }[row["state"]]
                detail = row["phase"] or ""
            elif row["what"] == "fetch":
                state = {"running": "[cyan]fetching[/cyan]", "failed": "[red]failed[/red]"}.get(
                    row["state"], "[green]fetched[/green]"
                )
                detail = ""
            else:
                state = {"running": "[cyan]download[/cyan]", "failed": "[red]failed[/red]"}.get(
                    row["state"], "[green]downloaded[/green]"
                )
                detail = human.size(row["done"]) + (f" / {human.size(row['expected'])}" if row["expected"] else "")
            table.add_row(state, str(row["name"]), f"{detail}  {seconds:.1f}s".strip())
        return table
