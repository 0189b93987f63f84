from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TextIO

from prepare.host.human import printable
from prepare.host.redact import redact


def print_notes(command: str, notes: Iterable[str], file: TextIO | None = None) -> None:
    """Write advisory lines to stderr, each under the calling command's name,
    so a journal grep for the command finds them. A credential in a URL
    a note quotes is hidden (prepare.host.redact), and a control character is
    escaped (text a note quotes may be a manifest's or a program's)."""
    out = file if file is not None else sys.stderr
    for note in notes:
        print(f"{command}: {printable(redact(note), lines=True)}", file=out)
    out.flush()
