"""Wording shared by the steps' messages, so a size, an OS error or a user
reads the same in every Fail and note."""

from __future__ import annotations

import errno
import os
import pwd
import textwrap

# No terminal is this narrow; a COLUMNS of 5 is read as this.
MIN_WIDTH = 24


def size(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable: the loop returns at TiB")


def duration(seconds: float) -> str:
    """A bound as an operator set it: whole hours as hours, the rest in seconds."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    return f"{seconds:g}s"


def oserror(exc: OSError) -> str:
    """`Permission denied (EACCES)`: the text for the operator, the symbol
    for the search engine."""
    if exc.errno is None:
        return str(exc)
    return f"{os.strerror(exc.errno)} ({errno.errorcode.get(exc.errno, exc.errno)})"


def user() -> str:
    """The effective user, by name for a `chown` line; a uid without a
    passwd entry is given as the number, which `chown` also takes."""
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


# Characters a terminal acts on or that hide text: C0 and C1 controls, DEL,
# and the bidirectional overrides and isolates (a line that reads one way and
# is another); zero-width characters that split a word a search looks for.
_HIDING = frozenset(
    {0x7F, *range(0x80, 0xA0), 0x200B, 0x200C, 0x200D, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}
)


def printable(text: str, *, lines: bool = False) -> str:
    """`text` from a manifest, a program or the network, safe to print: each
    control character (an escape sequence's ESC, a carriage return, a
    newline that would start a forged `fdl-prepare:` line) and each
    character that hides or reorders text is written as its escape
    (\\x1b, \\r, \\u202e). `lines` keeps newlines (a program's own lines)."""
    if text.isprintable():
        return text
    out = []
    for char in text:
        code = ord(char)
        if (char == "\n" and lines) or char == "\t":
            out.append(char)
        elif code < 0x20 or code in _HIDING:
            out.append(char.encode("unicode_escape").decode("ascii") if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out)


def wrapped(text: str, width: int | None, indent: str = "") -> str:
    """`text`, each of its lines wrapped to `width` (continuations under
    `indent`), a word longer than a line broken."""
    if width is None:
        return text
    width = max(width, MIN_WIDTH)
    out: list[str] = []
    for line in text.splitlines() or [""]:
        lead = line[: len(line) - len(line.lstrip(" "))]
        out += textwrap.wrap(
            line, width, initial_indent="", subsequent_indent=lead + indent, break_on_hyphens=False
        ) or [""]
    return "\n".join(out)
