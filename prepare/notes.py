"""Notes: the advisory lines a step adds to the caller's `notes` list.

Most say what happened (`mounted ... read-only`, `built: training`). Some
say that something is wrong without stopping the attempt (a sick card not
offered, a stage on tmpfs, a mount from another source than the config's):
those are made with `warning(text)`, still a `str` (a join loop that joins,
prints or stores notes sees no difference), but printed as warnings, which
the journal files at warning priority (prepare.host.journal), so
`journalctl -p warning` finds them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TextIO

from prepare.host import journal
from prepare.host.human import printable
from prepare.host.redact import redact


class WarningNote(str):
    """A note that says something is wrong (see the module's doc)."""

    __slots__ = ()


def warning(text: str) -> str:
    """`text` as a note that says something is wrong."""
    return WarningNote(text)


def is_warning(note: str) -> bool:
    return isinstance(note, WarningNote)


def priority(note: str) -> int:
    """The syslog priority `note` is written at (prepare.host.journal)."""
    return journal.WARNING if is_warning(note) else journal.INFO


def shown(command: str, note: str) -> str:
    """`note` as printed under `command`: a credential in a URL it quotes
    hidden (prepare.host.redact), a control character escaped (text a note
    quotes may be a manifest's or a program's)."""
    return f"{command}: {printable(redact(note), lines=True)}"


def print_notes(command: str, notes: Iterable[str], file: TextIO | None = None) -> None:
    """Write advisory lines to stderr (or `file`), each under the calling
    command's name, so a journal grep for the command finds them; when that
    is the journal, each at its priority (a warning at warning, the rest at
    info)."""
    out = file if file is not None else sys.stderr
    to_journal = journal.is_journal(out)
    for note in notes:
        out.write(journal.lines(shown(command, note), priority(note), to_journal))
    out.flush()
