"""The one place a command's outcome becomes output and an exit code.

Every command runs its work through `Report.outcome`, and whatever the work
ends in is written here and mapped to the code a shell loop or systemd acts
on without parsing text: 0 done, 75 transient (EX_TEMPFAIL: retry), 78
permanent (EX_CONFIG: stop), 2 usage, 70 a bug (EX_SOFTWARE: stop), 130
interrupted.

- A result (a Prepared, a Published, a GPU survey): with `--json`, one
  JSON object on stdout, its `kind` and `"schema": 1` first, the notes in
  it; else a summary for people on stderr (a survey's tables on stdout),
  the notes having been printed as they were added (`LiveNotes`), so a
  note about a mount is read before the build it explains. A new kind of
  result is one entry in `_KINDS`, with its kind. A result that says the
  box is not ready (a check, the GPUs' health) carries the Fail an attempt
  would stop on: it exits as that Fail would, its failure lines written as
  a Fail's are.
- A Fail: its kind, reason and message, as JSON or for people
  (`fdl-prepare: permanent failure [gpu.no-driver]: ...`), and 75 or 78.
- An interruption (SIGINT, or SIGTERM, which the command turns into one):
  130; the subprocess seam has stopped any child by then.
- An exception that is not a Fail is a bug in fdl-prepare, never the box's
  state: it is reported with its traceback and exits 70, which the units do
  not retry (a bug retried every 10 s for ever hides itself in the journal),
  where Python's own exit 1 would be retried as if transient.
- A command line that cannot be run (`Usage`): its usage line, the error
  naming the option, and 2; under `--json`, also as a JSON object of kind
  `usage` on stdout.

What people read goes to stderr, each line at a syslog priority when
stderr is the journal (prepare.host.journal): failures at err, warnings (a
note made with prepare.notes.warning) at warning, the rest at info. `level`
is what `-q` and `-v` chose: QUIET keeps only warnings and failures,
VERBOSE adds each command run (redacted) and each step's time. Under
systemd (NOTIFY_SOCKET), each step is also the unit's status line.

Output that cannot be written is no bug either (`Output`). stdout carries
the result a caller reads (`--json`): when it cannot take it, an attempt
that succeeded exits 78 for a full disk (ENOSPC, EDQUOT, EFBIG, EROFS: a
person frees space, as for every other full disk) and 75 otherwise (EPIPE:
the reader went away, a journal restarted; EIO), since the caller never got
the answer. stderr carries only what people read: a failure to write it
leaves the exit code the outcome's.

Credentials in URLs never reach a journal or a JSON consumer, whoever wrote
the text (prepare.host.redact); text a program or a manifest wrote is
escaped before it reaches a terminal (prepare.host.human).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from prepare import notes as notes_mod
from prepare.fail import Fail
from prepare.host import human, journal
from prepare.host.human import printable
from prepare.host.journal import FAILURE, INFO, WARNING
from prepare.host.redact import redact

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_SOFTWARE = 70
EXIT_TRANSIENT = 75
EXIT_PERMANENT = 78
EXIT_INTERRUPTED = 130

NAME = "fdl-prepare"

# The version of every JSON object's shape: a consumer checks it, and a
# change that breaks one bumps it.
SCHEMA = 1

# What -q and -v choose (Report.level).
QUIET, NORMAL, VERBOSE = 0, 1, 2

# A command line shown under -v is cut here: a box can be given thousands
# of devices or a long URL, and a journal line is no place for all of it.
COMMAND_CHARS = 4096


def say(text: str, priority: int = INFO) -> None:
    """`text` on stderr, each line at `priority` when stderr is the journal."""
    err = sys.stderr
    if err is None:
        return
    err.write(journal.lines(text, priority, journal.is_journal(err)))
    err.flush()


class Usage(Exception):
    """A command line that cannot be run: exit 2, with the usage line of the
    command it was meant for and the error naming the option."""

    def __init__(self, message: str, *, usage: str, command: str = NAME) -> None:
        super().__init__(message)
        self.message = message
        self.usage = usage
        self.command = command


# The reasons of the two outcomes that are no Fail of the box, for a
# controller that keys on `reason` alone: neither is in prepare.fail.REASONS
# (neither is permanent or transient: a usage error is the caller's, an
# interruption the operator's), and no Fail reason starts with `cli.`.
USAGE_REASON = "cli.usage"
INTERRUPTED_REASON = "cli.interrupted"


def usage(error: Usage, *, as_json: bool = False) -> int:
    """A usage error as click words one, on stderr; with `as_json`, also
    as one JSON object on stdout (else stdout stays empty). The message may
    quote a flag's value: a credential in it is hidden, a control character
    escaped."""
    message = printable(redact(error.message))
    if as_json:
        out = {"kind": "usage", "schema": SCHEMA, "reason": USAGE_REASON, "message": message, "usage": error.usage}
        print(json.dumps(out), flush=True)
    say(f"Usage: {error.usage}\nTry '{error.command} -h' for help.\n\nError: {message}", FAILURE)
    return EXIT_USAGE


class LiveNotes(list[str]):
    """A command's notes, each shown (`show`) as it is added: the library
    appends to its caller's list, and a note printed at the end would come
    after the build it explains."""

    def __init__(self, show: Callable[[str], None]) -> None:
        super().__init__()
        self._show = show

    def append(self, note: str, /) -> None:
        super().append(note)
        self._show(note)

    def insert(self, index: Any, note: str, /) -> None:
        super().insert(index, note)
        self._show(note)

    def extend(self, notes: Iterable[str], /) -> None:
        for note in list(notes):
            self.append(note)

    def __iadd__(self, notes: Iterable[str]) -> LiveNotes:  # type: ignore[override,misc]
        self.extend(notes)
        return self


@dataclass
class Report:
    """Where one command's outcome goes: `name` heads every line it writes
    on stderr (`fdl-prepare`, `fdl-prepare gpus`), so a journal grep for the
    command finds them; `as_json` puts the outcome on stdout as one JSON
    object; `notes` are what the work said along the way."""

    name: str = NAME
    as_json: bool = False
    notes: list[str] = field(default_factory=list)
    # QUIET, NORMAL or VERBOSE (-q, -v).
    level: int = NORMAL

    def __post_init__(self) -> None:
        self.journal = journal.is_journal(sys.stderr)
        self._lock = threading.Lock()
        # The pipeline step running, for the status line of its phases.
        self._step: str | None = None
        if not self.as_json and not self.notes:
            # With --json, the notes are the JSON's; for people, they are
            # printed as they come.
            self.notes = LiveNotes(self.note)

    # -- what people read, as it happens --------------------------------------------------------

    def say(self, text: str, priority: int = INFO) -> None:
        """A line (or lines) on stderr; info is left out under -q."""
        if priority == INFO and self.level == QUIET:
            return
        with self._lock:
            err = sys.stderr
            if err is not None:
                err.write(journal.lines(text, priority, self.journal))
                err.flush()

    def note(self, note: str) -> None:
        """One note, under the command's name, at its priority."""
        self.say(notes_mod.shown(self.name, note), notes_mod.priority(note))

    def command(self, argv: Sequence[str]) -> None:
        """A program fdl-prepare starts (prepare.host.proc.watching), under -v."""
        if self.level < VERBOSE:
            return
        line = printable(redact(shlex.join(argv)))
        if len(line) > COMMAND_CHARS:
            line = line[:COMMAND_CHARS] + " ... (cut)"
        self.say(f"{self.name}: running: {line}")

    def event(self, event: dict[str, Any]) -> None:
        """The steps' progress events, for the unit's status line (under
        systemd) and each step's time (under -v)."""
        kind = event.get("type")
        if kind == "step-start":
            self._step = str(event.get("name", "?"))
            self.status(self._step, str(event.get("detail", "")))
        elif kind == "step":
            from prepare.cli.progress import doing

            self.status(self._step or str(event.get("name", "?")), redact(doing(event)))
        elif kind == "step-done":
            self._step = None
            if self.level >= VERBOSE:
                seconds = float(event.get("seconds") or 0.0)
                how = "done in" if event.get("ok") else "failed after"
                self.say(f"{self.name}: {event.get('name', '?')}: {how} {seconds:.3f}s")

    def status(self, step: str, what: str) -> None:
        """systemd's status line for the unit (`systemctl status`), when
        there is a service manager to tell."""
        if os.environ.get("NOTIFY_SOCKET"):
            journal.notify(journal.status(step, what))

    # -- the outcome ----------------------------------------------------------------------------

    def outcome(self, work: Callable[[], Any]) -> int:
        """Run `work` and report whatever it ends in: the one place a
        command's Fail, interruption or bug is caught."""
        started = time.monotonic()
        try:
            result = work()
        except Fail as fail:
            return self.fail(fail)
        except KeyboardInterrupt:
            return self.interrupted()
        except Exception as bug:  # noqa: BLE001 (a bug: reported with its traceback, exit 70)
            return self.bug(bug)
        return self.done(result, time.monotonic() - started)

    def done(self, result: Any, seconds: float) -> int:
        shown = _shown(result)
        stopped = shown.stopped(result) if shown.stopped is not None else None
        if stopped is None:
            self.status(shown.kind, f"done in {seconds:.2f}s")
        elif self.as_json:
            # The human path says it through `fail`; the unit's status line
            # must not depend on how stdout is read.
            self._failure_status(stopped)
        if self.as_json:
            out = {"kind": shown.kind, "schema": SCHEMA, **result.to_json()}
            if shown.notes_in_json:
                out["notes"] = self._notes()
            # Keys as the result orders them: the timings read as the steps ran.
            print(json.dumps(out))
        else:
            shown.human(self, result, seconds)
            if stopped is not None:
                return self.fail(stopped)
        if stopped is not None:
            return EXIT_PERMANENT if stopped.permanent else EXIT_TRANSIENT
        return EXIT_OK

    def fail(self, fail: Fail) -> int:
        code = EXIT_PERMANENT if fail.permanent else EXIT_TRANSIENT
        message = redact(fail.message)
        self._failure_status(fail)
        if self.as_json:
            out = {**fail.to_json(), "schema": SCHEMA, "message": message, "notes": self._notes()}
            print(json.dumps(out, sort_keys=True))
            return code
        self._notes_left()
        then = (
            "retrying cannot help: fix the cause above, then run again"
            if fail.permanent
            else "the next attempt may succeed: retry with backoff"
        )
        self.say(
            f"{self.name}: {fail.kind} failure [{fail.reason}]: {printable(message, lines=True)}\n"
            f"{self.name}: exit {code}: {then}",
            FAILURE,
        )
        return code

    def _failure_status(self, fail: Fail) -> None:
        self.status(f"{fail.kind} failure [{fail.reason}]", redact(fail.message))

    def interrupted(self) -> int:
        """SIGINT, or SIGTERM from systemd stopping the unit: the seam in
        prepare.host.proc has stopped any running child by now."""
        message = (
            "interrupted (SIGINT or SIGTERM) before preparation finished: the running step and its child were "
            "stopped; the next attempt starts over"
        )
        self.status("interrupted", "stopped before preparation finished")
        if self.as_json:
            out = {
                "kind": "interrupted",
                "schema": SCHEMA,
                "reason": INTERRUPTED_REASON,
                "message": message,
                "notes": self._notes(),
            }
            print(json.dumps(out, sort_keys=True), flush=True)
        else:
            self._notes_left()
        # A warning, not a failure: systemd stopping the unit is routine.
        self.say(f"{NAME}: interrupted", WARNING)
        return EXIT_INTERRUPTED

    def bug(self, bug: BaseException) -> int:
        """An exception that is not a Fail: a bug, said as one, with the
        traceback a report needs, and an exit code no unit retries."""
        import traceback

        trace = redact("".join(traceback.format_exception(type(bug), bug, bug.__traceback__)))
        message = redact(
            f"internal error: {type(bug).__name__}: {bug}. This is a bug in fdl-prepare, not a problem of this box: "
            "retrying would only repeat it. Report it with the traceback, and the config and flags that led to it"
        )
        self.status("bug", f"{type(bug).__name__}, exit {EXIT_SOFTWARE}")
        if self.as_json:
            out = {"kind": "bug", "schema": SCHEMA, "message": message, "traceback": trace, "notes": self._notes()}
            print(json.dumps(out, sort_keys=True), flush=True)
        else:
            self._notes_left()
        self.say(
            trace.rstrip("\n")
            + f"\n{self.name}: {message}\n{self.name}: exit {EXIT_SOFTWARE}: a bug; the unit does not restart on it",
            FAILURE,
        )
        return EXIT_SOFTWARE

    def _notes(self) -> list[str]:
        return [redact(n) for n in self.notes]

    def _notes_left(self) -> None:
        """Notes not printed yet: those of a list that was not live (a
        caller's own)."""
        if not isinstance(self.notes, LiveNotes):
            for note in self.notes:
                self.note(note)


# -- what each kind of result looks like for people ------------------------------------------


@dataclass(frozen=True)
class Shown:
    human: Callable[[Report, Any, float], None]
    # The JSON object's "kind": what a consumer dispatches on.
    kind: str
    # Whether the JSON object carries the notes (a survey's are its own).
    notes_in_json: bool = True
    # The Fail a result says an attempt would stop on (None: it would not):
    # its exit code is the result's.
    stopped: Callable[[Any], Fail | None] | None = None


def _rows(report: Report, rows: list[tuple[str, str]]) -> None:
    # Values that came from a manifest or a program: escaped, one line each.
    report.say("\n".join(f"  {key:<9} {printable(value)}" for key, value in rows))


def _prepared(report: Report, done: Any, seconds: float) -> None:
    report._notes_left()
    rows: list[tuple[str, str]] = []
    if done.devices is None:
        rows.append(("gpus", "gate skipped (--cpu-only)"))
    else:
        said = ", ".join(str(i) for i in done.devices)
        if done.nvml_indices is not None and done.nvml_indices != done.devices:
            said += f"  (CUDA ordinals; NVML {', '.join(str(i) for i in done.nvml_indices)})"
        rows.append(("gpus", said))
    rows.append(("data", done.data_path or "(none declared)"))
    if done.libtorch is not None:
        rows.append(("libtorch", f"{done.libtorch.variant}  {done.libtorch.path}"))
    if done.bin is not None:
        rows.append(("bin", f"{done.bin.path}  (cwd {done.bin.cwd})"))
    if done.args is not None:
        rows.append(("args", shlex.join(done.args)))
    if done.run_id is not None:
        rows.append(("run", done.run_id))
    report.say(f"{report.name}: prepared in {seconds:.2f}s")
    _rows(report, rows)


def _published(report: Report, done: Any, seconds: float) -> None:
    report._notes_left()
    report.say(f"{report.name}: run {done.run_id} published in {seconds:.2f}s")
    source = os.path.dirname(done.manifest)
    rows = [("source", source + (f" (git {done.rev[:12]})" if done.rev else ""))]
    rows += [("to", done.to)]
    rows += [(label, f"{out.bin}  (libtorch {out.libtorch})") for label, out in done.outputs.items()]
    rows += [("manifest", done.manifest + (f" (commit {done.commit[:12]})" if done.commit else ""))]
    if done.next_step:
        rows.append(("next", done.next_step))
    _rows(report, rows)


def _width() -> int:
    """The terminal's columns: COLUMNS, else stdout's tty, else 80."""
    import shutil

    return shutil.get_terminal_size((80, 24)).columns


def _health(report: Report, health: Any, seconds: float) -> None:
    from prepare.gpu import table

    width = _width()
    if health.survey is not None:
        print(table.format_table(health.survey, width))
        lines = table.format_health(health.survey, width)
        if lines:
            print("\n" + lines)
        print()
    if health.skipped:
        verdict = "ready: an attempt skips the GPU gate (cpu_only)"
    elif health.fail is None:
        vendor, offered = health.survey.offered_for(None)
        cards = ", ".join(str(i) for i in offered)
        verdict = (
            f"ready: an attempt would pass the GPU gate, offering {'AMD' if vendor == 'amd' else 'NVIDIA'} GPU {cards}"
        )
    else:
        verdict = f"not ready: an attempt would stop at the GPU gate ({health.fail.kind}, {health.fail.reason})"
    print(human.wrapped(f"{report.name}: {verdict}", width, "  "))
    if health.ready:
        report._notes_left()


def _checked(report: Report, checked: Any, seconds: float) -> None:
    width = _width()
    name_width = max(len(name) for name in checked.steps)
    for name, step in checked.steps.items():
        line = f"  {name:<{name_width}}  {step.verdict}" + (f": {step.detail}" if step.detail else "")
        print(human.wrapped(printable(redact(line)), width, " " * (name_width + 2)))
    for label, paths in (("would substitute", checked.substitute), ("would build", checked.build)):
        if paths:
            print(f"{label} ({len(paths)}):")
            for path in paths[: checked.LISTED]:
                print(f"  {printable(path)}")
            if len(paths) > checked.LISTED:
                print(f"  ... and {len(paths) - checked.LISTED} more (--json lists them all)")
    print(human.wrapped(f"{report.name}: {checked.summary()}", width, "  "))
    if checked.ready:
        report._notes_left()


# How each kind of result a command returns is shown: one line here for
# each, by the module and name of its type.
_KINDS: tuple[tuple[str, str, Shown], ...] = (
    ("prepare.spec", "Prepared", Shown(_prepared, "prepared")),
    ("prepare.spec", "Checked", Shown(_checked, "check", stopped=lambda c: c.fail)),
    ("prepare.publish.spec", "Published", Shown(_published, "published")),
    ("prepare.gpu.gate", "Health", Shown(_health, "gpus", stopped=lambda h: h.fail)),
)


def _shown(result: Any) -> Shown:
    """How `result` is shown. A kind's module is never imported here: a
    result whose module was not imported cannot be of that kind, and
    importing publish's to tell a Prepared from a Published would cost
    every attempt its import."""
    for module, name, shown in _KINDS:
        kind = getattr(sys.modules.get(module), name, None)
        if isinstance(kind, type) and isinstance(result, kind):
            return shown
    raise TypeError(f"no way to show a {type(result).__name__}: add it to _KINDS")


# -- output that cannot be written -------------------------------------------------------------

# A result that could not be written to a full disk: a person frees space.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


class Output:
    """sys.stdout or sys.stderr, whose writes never raise: the first error
    (a full disk, a reader gone) is kept in `failed`, and the stream is
    pointed at /dev/null so that nothing written later, the interpreter's
    last flush included, fails again."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        if self.failed is None:
            try:
                return int(self._stream.write(text))
            except (OSError, ValueError) as err:
                self._fail(err if isinstance(err, OSError) else OSError(errno.EBADF, str(err)))
        return len(text)

    def flush(self) -> None:
        if self.failed is None:
            try:
                self._stream.flush()
            except (OSError, ValueError) as err:
                self._fail(err if isinstance(err, OSError) else OSError(errno.EBADF, str(err)))

    def _fail(self, err: OSError) -> None:
        self.failed = err
        with contextlib.suppress(OSError, ValueError, AttributeError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Streams:
    """The process's stdout and stderr, guarded (`Output`) for one command,
    and the exit code their failures make of the outcome's."""

    def __init__(self) -> None:
        # (None: Python found no open fd there at start; nothing is written.)
        self.out, self.err = Output(sys.stdout), Output(sys.stderr)
        if sys.stdout is not None:
            sys.stdout = cast(Any, self.out)
        if sys.stderr is not None:
            sys.stderr = cast(Any, self.err)

    def close(self, code: Any) -> Any:
        """`code`, unless a result that succeeded could not be written."""
        if sys.stdout is not None:
            self.out.flush()
        if sys.stderr is not None:
            self.err.flush()
        if self.out.failed is not None and code in (None, EXIT_OK):
            full = self.out.failed.errno in _DISK_FULL
            code = EXIT_PERMANENT if full else EXIT_TRANSIENT
            say(
                f"{NAME}: the result could not be written to stdout ({human.oserror(self.out.failed)}): "
                + ("free space where stdout goes, then run again" if full else "the next attempt writes it again")
                + f"; exit {code}",
                FAILURE,
            )
            if sys.stderr is not None:
                self.err.flush()
        return code
