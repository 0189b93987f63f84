"""The child that lists a dataset root for `prepare.data.listing`, bounded.

Run as a script (`python -I -S _list_root.py PATH LIMIT`), never imported
for its work: it must start with nothing but the standard library, since
`-I` keeps the package (and the cwd) off its path. It prints one line,
`<stage> <errno> <reason>`, where stage is ok, stat, notdir, list, timeout
or died.

The parent never stats the root itself: it runs this in a child. And this
child does not touch the root either, it forks a grandchild that does. A
process blocked on a FUSE request that the daemon has already taken cannot
be killed, not even by SIGKILL (the kernel waits the request out), so a
child that listed the root itself would hold up whoever waits for it to
die; here only the grandchild wedges, orphaned with its stdio on
/dev/null, and the child answers "timeout" and exits on time. The wedged
grandchild ends when the far side answers or the mount is dropped.

One entry is enough to prove listing works; reading them all would cost
minutes on a large remote directory.
"""

from __future__ import annotations

import os
import select
import stat
import sys
from typing import NoReturn


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    path, limit = args[0], float(args[1])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _look(path, w)
    os.close(w)
    ready, _, _ = select.select([r], [], [], limit)
    if not ready:
        print("timeout 0 ", flush=True)
        os._exit(0)
    answer = os.read(r, 4096).decode("utf-8", "replace")
    os.waitpid(pid, 0)
    print(answer or "died 0 the check process died", flush=True)


def _look(path: str, w: int) -> NoReturn:
    """The grandchild: the only process that touches `path`."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        st = os.stat(path)
    except OSError as e:
        _report(w, "stat", e.errno, e.strerror)
    if not stat.S_ISDIR(st.st_mode):
        _report(w, "notdir", 0, "not a directory")
    try:
        with os.scandir(path) as it:
            next(it, None)
    except OSError as e:
        _report(w, "list", e.errno, e.strerror)
    _report(w, "ok", 0, "")


def _report(w: int, stage: str, code: int | None, reason: str | None) -> NoReturn:
    os.write(w, f"{stage} {code} {reason}".encode("utf-8", "replace"))
    os._exit(0)


if __name__ == "__main__":
    main()
