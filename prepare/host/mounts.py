"""What is mounted where, read from /proc/self/mountinfo.

The kernel's table is the only answer that cannot hang: asking the mountpoint
itself (`os.path.ismount`, `stat`) goes through the filesystem, and a dead
sshfs mount answers a stat by never answering. So the data step decides
"is something already mounted there" from this table alone, and touches the
mountpoint only inside a killable child process.

The kernel escapes four bytes in the path-like fields (space, tab, newline,
backslash) as three-digit octal (`\\040`, `\\011`, `\\012`, `\\134`); a
mountpoint with a space in it only matches after decoding.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"

_OCTAL = re.compile(rb"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    mount_id: int
    parent_id: int
    root: str
    mount_point: str
    options: tuple[str, ...]
    fstype: str
    source: str
    super_options: tuple[str, ...]

    @property
    def read_only(self) -> bool:
        return "ro" in self.options or "ro" in self.super_options

    @property
    def is_fuse(self) -> bool:
        return self.fstype == "fuse" or self.fstype.startswith(("fuse.", "fuseblk"))


def unescape(field: bytes | str) -> str:
    """Decode the kernel's octal escapes. Works on bytes so that a path
    that is not valid UTF-8 round-trips through `os.fsdecode` unchanged."""
    raw = field.encode("utf-8", "surrogateescape") if isinstance(field, str) else field
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8) & 0xFF]), raw))


def parse_line(line: bytes | str) -> Mount | None:
    """One mountinfo line, or None for a line that does not have the
    documented shape (a future kernel adding fields must not break us)."""
    raw = line.encode("utf-8", "surrogateescape") if isinstance(line, str) else line
    fields = raw.rstrip(b"\n").split(b" ")
    try:
        sep = fields.index(b"-", 6)
    except ValueError:
        return None
    if len(fields) < sep + 3:
        return None
    try:
        mount_id = int(fields[0])
        parent_id = int(fields[1])
    except ValueError:
        return None
    super_options = fields[sep + 3] if len(fields) > sep + 3 else b""
    return Mount(
        mount_id=mount_id,
        parent_id=parent_id,
        root=unescape(fields[3]),
        mount_point=unescape(fields[4]),
        options=tuple(unescape(o) for o in fields[5].split(b",") if o),
        fstype=unescape(fields[sep + 1]),
        source=unescape(fields[sep + 2]),
        super_options=tuple(unescape(o) for o in super_options.split(b",") if o),
    )


def parse(text: bytes | str) -> list[Mount]:
    raw = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    table = []
    for line in raw.split(b"\n"):
        if line.strip():
            mount = parse_line(line)
            if mount is not None:
                table.append(mount)
    return table


def read(path: str = MOUNTINFO) -> list[Mount]:
    with open(path, "rb") as f:
        return parse(f.read())


def _last_at(table: Iterable[Mount], path: str) -> Mount | None:
    # Mounts stacked on one point are listed oldest first; the last one is
    # what a reader of the path actually sees.
    found = None
    for mount in table:
        if mount.mount_point == path:
            found = mount
    return found


def mounted_at(path: str, table: list[Mount] | None = None) -> Mount | None:
    """The mount whose mountpoint is exactly `path`, or None.

    The kernel lists mountpoints with symlinks resolved, while operators
    declare them lexically. Resolution is done without ever stat-ing `path`
    itself while something may be mounted on it: the lexical path is tried
    first, then the path with only its parent resolved, and only when
    neither is a mountpoint is `path` itself looked at as a symlink.
    """
    if table is None:
        table = read()
    path = os.path.normpath(os.path.abspath(path))
    found = _last_at(table, path)
    if found is not None:
        return found
    parent, name = os.path.split(path)
    via_parent = os.path.join(os.path.realpath(parent), name)
    found = _last_at(table, via_parent)
    if found is not None:
        return found
    if os.path.islink(via_parent):
        return _last_at(table, os.path.realpath(via_parent))
    return None


def containing(path: str, table: list[Mount] | None = None) -> Mount | None:
    """The mount that holds `path` (which must exist): the longest mountpoint
    that is a prefix of its resolved path; of mounts stacked on one point,
    the last listed, which is the one on top."""
    if table is None:
        table = read()
    target = os.path.realpath(path)
    best: Mount | None = None
    for mount in table:
        point = mount.mount_point
        inside = point == "/" or target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mount_point)):
            best = mount
    return best
