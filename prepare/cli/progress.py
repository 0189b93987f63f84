"""Showing the long steps (downloads, builds) while they run.

The library never prints: `prepare.build` hands events (plain dicts) to a
`progress` callable, and the CLI picks how to show them with `renderer`:

- on a terminal, a live display: downloads with their bytes, builds as
  running or done with the phase they are in (rich, imported only then:
  the `live` extra; without it, a terminal gets the plain lines);
- anywhere else (systemd's journal, a pipe, a CI log), one plain line per
  build or download started and finished. No spinners, no carriage
  returns: a journal keeps every byte, and a redrawn line there is noise.

Events (all have "type"): step {name, detail}; build-start {id, name, drv};
build-phase {id, name, phase}; build-done {id, name, seconds, ok, outcome: built | failed | stopped};
download-start {id, name}; download-progress {id, name, done, expected};
download-done {id, name, bytes, seconds}; substitute-start / substitute-done
{id, name}; end {}. Unknown types are ignored, so the producer can grow.

Events arrive on the thread that reads nix's stderr: every renderer here
serialises its writes with a lock.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, TextIO

from prepare.host import human
from prepare.host.redact import redact
from prepare.spec import Event, Progress

# Small files a binary cache serves for every path it is asked about: a line
# each would bury the transfers that matter.
_QUIET_SUFFIXES = (".narinfo", "nix-cache-info")


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):
        return False


def renderer(stream: TextIO, *, prefix: str = "fdl-prepare", live: bool | None = None) -> Progress:
    """The progress callable for `stream`: live on a terminal, plain lines
    elsewhere. `live` forces the choice (tests, `--json` runs)."""
    if live is None:
        live = _is_tty(stream)
    if live:
        try:
            return LiveRenderer(stream)
        except ImportError:  # rich missing: plain lines still say everything
            pass
    return PlainRenderer(stream, prefix=prefix)


def _redacted(event: Event) -> Event:
    """The event with the user-info of any URL in its strings (a step's
    detail, a download's URL) hidden (prepare.host.redact), before any of it
    reaches a terminal or a journal."""
    return {k: redact(v) if isinstance(v, str) else v for k, v in event.items()}


class PlainRenderer:
    """One line per started and finished build or download."""

    def __init__(self, stream: TextIO, *, prefix: str = "fdl-prepare") -> None:
        self.stream = stream
        self.prefix = prefix
        self.lock = threading.Lock()
        self.started: dict[Any, float] = {}

    def _line(self, text: str) -> None:
        with self.lock:
            try:
                self.stream.write(f"{self.prefix}: {text}\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def __call__(self, event: Event) -> None:
        event = _redacted(event)
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
            if not str(name).endswith(_QUIET_SUFFIXES):
                got = event.get("bytes") or 0
                amount = f"{human.size(got)}, " if got else ""
                self._line(f"downloaded {name} ({amount}{event.get('seconds', 0):.1f}s)")
        elif kind == "substitute-start":
            self._line(f"fetching {name} from a binary cache")
        elif kind == "substitute-done":
            self._line(f"fetched {name} from a binary cache ({event.get('seconds', 0):.1f}s)")
        elif kind == "step" and name == "wait":
            # Other steps are quick; a wait on another prepare can be long,
            # and a journal that says nothing meanwhile looks like a hang.
            self._line(str(event.get("detail", "waiting for another fdl-prepare")))


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
            if kind == "step":
                self.step = f"{event.get('name')}: {event.get('detail', '')}"
            elif kind in ("build-start", "download-start", "substitute-start"):
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
            elif kind in ("build-done", "download-done", "substitute-done"):
                row = self.rows.get(event.get("id"))
                if row:
                    row["state"] = {"failed": "failed", "stopped": "stopped"}.get(event.get("outcome", ""), "done")
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
            else:
                state = "[cyan]download[/cyan]" if row["state"] == "running" else "[green]downloaded[/green]"
                detail = human.size(row["done"]) + (f" / {human.size(row['expected'])}" if row["expected"] else "")
            table.add_row(state, str(row["name"]), f"{detail}  {seconds:.1f}s".strip())
        return table
