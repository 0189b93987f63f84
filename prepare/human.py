"""Wording shared by the steps' messages, so a size, an OS error or a user
reads the same in every Fail and note."""

from __future__ import annotations

import errno
import os
import pwd


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
