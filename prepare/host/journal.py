"""Telling systemd: the journal's priorities and the unit's status line.

- `is_journal(stream)`: whether `stream` is the journal's own stream for
  this service. systemd says so in JOURNAL_STREAM ("<device>:<inode>" of
  the socket it connected to stdout/stderr, sd_journal_stream_fd(3),
  systemd.exec(5)); the variable is inherited by everything the service
  starts, so a stream is the journal only when it is that very socket: a
  child whose stderr was redirected to a file, or a pipe to `tee`, is not.
- `lines(text, priority, journal)`: `text`, every line of it prefixed with
  its syslog priority (`<3>` err, `<4>` warning, `<6>` info) when it goes to
  the journal, so `journalctl -p warning` shows the failures and warnings
  and nothing else. Every line, not only the first: journald reads a
  prefix at the start of each line it receives, and a continuation line
  that quotes a build log must not be able to pick its own priority
  (`<0>`, emergency, is broadcast to every terminal).
- `notify(state)`: an sd_notify(3) datagram to NOTIFY_SOCKET, e.g.
  `STATUS=build: building libtorch-cpu`, which `systemctl status` shows
  while the unit runs. A few lines of `socket` rather than a dependency;
  a socket that is gone or full never stops an attempt.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# syslog(3) priorities, the three fdl-prepare writes.
FAILURE = 3  # LOG_ERR
WARNING = 4  # LOG_WARNING
INFO = 6  # LOG_INFO

# A status line is one line of at most this many characters: systemd keeps
# it in memory for `systemctl status`, and a datagram has a size limit.
STATUS_CHARS = 400


def is_journal(stream: Any, environ: Mapping[str, str] | None = None) -> bool:
    """Whether `stream` (a file object or a descriptor) is the journal
    stream JOURNAL_STREAM names."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, sep, inode = value.partition(":")
    if not sep or not device.isdigit() or not inode.isdigit():
        return False
    try:
        fd = stream if isinstance(stream, int) else stream.fileno()
        st = os.fstat(fd)
    except (AttributeError, OSError, ValueError):
        return False
    return st.st_dev == int(device) and st.st_ino == int(inode)


def lines(text: str, priority: int, journal: bool) -> str:
    """`text` as lines to write, each with `priority` when `journal`."""
    if not journal:
        return text + "\n"
    return "".join(f"<{priority}>{line}\n" for line in text.split("\n"))


def notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send `state` (`STATUS=...`, `READY=1`) to the service manager, when
    there is one (NOTIFY_SOCKET: a path, or `@name` in the abstract
    namespace); whether it was sent. Never blocks and never raises: the
    status line is a courtesy, the attempt is the point."""
    address = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        # Unset, or a vsock address (vsock:CID:PORT), which a VM's manager
        # uses and a worker box's does not.
        return False
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode("utf-8", "replace"), socket.MSG_DONTWAIT, address)
    except OSError:
        return False
    return True


def status(step: str, what: str) -> str:
    """The STATUS= assignment for `step` doing `what`: one line, bounded."""
    from prepare.host.human import printable

    text = " ".join(printable(f"{step}: {what}").split())
    if len(text) > STATUS_CHARS:
        text = text[: STATUS_CHARS - 3] + "..."
    return f"STATUS={text}"
