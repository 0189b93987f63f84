"""The one place a command's outcome becomes output and an exit code.

Every command runs its work through `Report.outcome`, and whatever the work
ends in is written here and mapped to the code a shell loop or systemd acts
on without parsing text: 0 done, 75 transient (EX_TEMPFAIL: retry), 78
permanent (EX_CONFIG: stop), 2 usage, 70 a bug (EX_SOFTWARE: stop), 130
interrupted.

- A result (a Prepared, a Published, a GPU survey): with `--json`, one
  JSON object on stdout, the notes in it; else the notes and a summary for
  people on stderr (a survey's tables on stdout). A new kind of result is
  one entry in `_shown`.
- A Fail: its kind, reason and message, as JSON or for people, and 75 or 78.
- An interruption (SIGINT, or SIGTERM, which the command turns into one):
  130; the subprocess seam has stopped any child by then.
- An exception that is not a Fail is a bug in fdl-prepare, never the box's
  state: it is reported with its traceback and exits 70, which the units do
  not retry (a bug retried every 10 s for ever hides itself in the journal),
  where Python's own exit 1 would be retried as if transient.
- A command line that cannot be run (`Usage`): its usage line, the error
  naming the option, and 2.

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from prepare.fail import Fail
from prepare.host import human
from prepare.host.human import printable
from prepare.host.redact import redact
from prepare.notes import print_notes

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_SOFTWARE = 70
EXIT_TRANSIENT = 75
EXIT_PERMANENT = 78
EXIT_INTERRUPTED = 130

NAME = "fdl-prepare"


class Usage(Exception):
    """A command line that cannot be run: exit 2, with the usage line of the
    command it was meant for and the error naming the option."""

    def __init__(self, message: str, *, usage: str, command: str = NAME) -> None:
        super().__init__(message)
        self.message = message
        self.usage = usage
        self.command = command


def usage(error: Usage) -> int:
    """A usage error as click words one, on stderr; stdout stays empty."""
    err = sys.stderr
    print(f"Usage: {error.usage}", file=err)
    print(f"Try '{error.command} -h' for help.", file=err)
    print(f"\nError: {error.message}", file=err)
    return EXIT_USAGE


@dataclass
class Report:
    """Where one command's outcome goes: `name` heads every line it writes
    on stderr (`fdl-prepare`, `fdl-prepare gpus`), so a journal grep for the
    command finds them; `as_json` puts the outcome on stdout as one JSON
    object; `notes` are what the work said along the way."""

    name: str = NAME
    as_json: bool = False
    notes: list[str] = field(default_factory=list)

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
        if self.as_json:
            out = result.to_json()
            if shown.notes_in_json:
                out["notes"] = self._notes()
            # Keys as the result orders them: the timings read as the steps ran.
            print(json.dumps(out))
        else:
            shown.human(self, result, seconds)
        return EXIT_OK

    def fail(self, fail: Fail) -> int:
        code = EXIT_PERMANENT if fail.permanent else EXIT_TRANSIENT
        message = redact(fail.message)
        if self.as_json:
            out = {**fail.to_json(), "message": message, "notes": self._notes()}
            print(json.dumps(out, sort_keys=True))
            return code
        print_notes(self.name, self.notes)
        then = (
            "retrying cannot help: fix the cause above, then run again"
            if fail.permanent
            else "the next attempt may succeed: retry with backoff"
        )
        print(f"{self.name}: {fail.kind} failure: {printable(message, lines=True)}", file=sys.stderr)
        print(f"{self.name}: exit {code}: {then}", file=sys.stderr)
        return code

    def interrupted(self) -> int:
        """SIGINT, or SIGTERM from systemd stopping the unit: the seam in
        prepare.host.proc has stopped any running child by now."""
        message = (
            "interrupted (SIGINT or SIGTERM) before preparation finished: the running step and its child were "
            "stopped; the next attempt starts over"
        )
        if self.as_json:
            out = {"kind": "interrupted", "message": message, "notes": self._notes()}
            print(json.dumps(out, sort_keys=True), flush=True)
        else:
            print_notes(self.name, self.notes)
        print(f"{NAME}: interrupted", file=sys.stderr, flush=True)
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
        if self.as_json:
            out = {"kind": "bug", "message": message, "traceback": trace, "notes": self._notes()}
            print(json.dumps(out, sort_keys=True), flush=True)
        else:
            print_notes(self.name, self.notes)
        print(trace, file=sys.stderr, end="")
        print(f"{self.name}: {message}", file=sys.stderr)
        print(f"{self.name}: exit {EXIT_SOFTWARE}: a bug; the unit does not restart on it", file=sys.stderr, flush=True)
        return EXIT_SOFTWARE

    def _notes(self) -> list[str]:
        return [redact(n) for n in self.notes]


# -- what each kind of result looks like for people ------------------------------------------


@dataclass(frozen=True)
class Shown:
    human: Callable[[Report, Any, float], None]
    # Whether the JSON object carries the notes (a survey's are its own).
    notes_in_json: bool = True


def _rows(rows: list[tuple[str, str]]) -> None:
    # Values that came from a manifest or a program: escaped, one line each.
    for key, value in rows:
        print(f"  {key:<9} {printable(value)}", file=sys.stderr)


def _prepared(report: Report, done: Any, seconds: float) -> None:
    print_notes(report.name, report.notes)
    rows: list[tuple[str, str]] = []
    if done.devices is None:
        rows.append(("gpus", "gate skipped (--cpu-only)"))
    else:
        rows.append(("gpus", ", ".join(str(i) for i in done.devices)))
    rows.append(("data", done.data_path or "(none declared)"))
    if done.libtorch is not None:
        rows.append(("libtorch", f"{done.libtorch.variant}  {done.libtorch.path}"))
    if done.bin is not None:
        rows.append(("bin", f"{done.bin.path}  (cwd {done.bin.cwd})"))
    if done.args is not None:
        rows.append(("args", shlex.join(done.args)))
    if done.run_id is not None:
        rows.append(("run", done.run_id))
    print(f"{report.name}: prepared in {seconds:.2f}s", file=sys.stderr)
    _rows(rows)


def _published(report: Report, done: Any, seconds: float) -> None:
    print_notes(report.name, report.notes)
    print(f"{report.name}: run {done.run_id} published in {seconds:.2f}s", file=sys.stderr)
    source = os.path.dirname(done.manifest)
    rows = [("source", source + (f" (git {done.rev[:12]})" if done.rev else ""))]
    rows += [("to", done.to)]
    rows += [(label, f"{out.bin}  (libtorch {out.libtorch})") for label, out in done.outputs.items()]
    rows += [("manifest", done.manifest + (f" (commit {done.commit[:12]})" if done.commit else ""))]
    if done.next_step:
        rows.append(("next", done.next_step))
    _rows(rows)


def _surveyed(report: Report, survey: Any, seconds: float) -> None:
    from prepare.gpu import table

    print(table.format_table(survey))
    health = table.format_health(survey)
    if health:
        print("\n" + health)
    print_notes(report.name, survey.notes)


# How each kind of result a command returns is shown: one line here for
# each, by the module and name of its type.
_KINDS: tuple[tuple[str, str, Shown], ...] = (
    ("prepare.spec", "Prepared", Shown(_prepared)),
    ("prepare.publish.spec", "Published", Shown(_published)),
    ("prepare.gpu.devices", "Gpus", Shown(_surveyed, notes_in_json=False)),
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
            print(
                f"{NAME}: the result could not be written to stdout ({human.oserror(self.out.failed)}): "
                + ("free space where stdout goes, then run again" if full else "the next attempt writes it again")
                + f"; exit {code}",
                file=sys.stderr,
            )
            if sys.stderr is not None:
                self.err.flush()
        return code
