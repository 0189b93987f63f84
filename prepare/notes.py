from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TextIO

from prepare.redact import redact


def print_notes(command: str, notes: Iterable[str], file: TextIO | None = None) -> None:
    """Write advisory lines to stderr, each under the calling command's name,
    so a journal grep for the command finds them. A credential in a URL
    a note quotes is hidden (prepare.redact)."""
    out = file if file is not None else sys.stderr
    for note in notes:
        print(f"{command}: {redact(note)}", file=out)
    out.flush()
