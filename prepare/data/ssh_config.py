"""The ssh options that can carry a secret, kept off command lines.

sshfs hands `ssh.options` to ssh as `-o Key=Value`, and every user of the
box reads a command line in `ps` for as long as the mount lives. So the
options whose values can carry a secret (prepare.host.redact's
SSH_SECRET_OPTIONS: a ProxyCommand with a token, SetEnv, ...) go into an
ssh config file only this user can read, named with `-F`; the rest stay
`-o` options. ssh's precedence is kept: the file holds them first (ssh keeps
the first value it reads for a key), then includes the user's and the
system's own config files, which `-F` would otherwise leave unread.

The file lives in a directory of this user's alone (`/run/fdl-prepare-ssh`
for root, `$XDG_RUNTIME_DIR/fdl-prepare-ssh` otherwise), named by a digest
of its content, and is never removed while the box runs: ssh reads it again
at every reconnect of the mount. /run is emptied at boot, with the mounts.
Where no such directory can be had, the options stay on the command line,
as before, and a note says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Sequence

from prepare.fail import Fail
from prepare.host.redact import redact
from prepare.notes import warning


def write(options: Sequence[str], notes: list[str]) -> str | None:
    """The path of a config file holding `options` (None when there are
    none, or no private directory for them: then a note says they stay on
    the command line)."""
    if not options:
        return None
    for option in options:
        if "\n" in option or "\r" in option or "\0" in option:
            raise Fail(
                "config.invalid",
                f"ssh.options holds {redact(repr(option))}, with a line break: an ssh option is one line. "
                "Fix ssh.options (--ssh-option).",
            )
    keys = ", ".join(sorted({o.split("=", 1)[0] for o in options}))
    directory = _directory()
    if directory is None:
        notes.append(_on_the_command_line(keys, "there is no directory of this user's alone to keep them in"))
        return None
    text = (
        "# fdl-prepare: the ssh.options whose values can carry a secret, kept off the command line.\n"
        + "".join(f"{option}\n" for option in options)
        + "Include ~/.ssh/config\nInclude /etc/ssh/ssh_config\n"
    )
    path = os.path.join(directory, f"ssh_config.{hashlib.sha256(text.encode()).hexdigest()[:16]}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
        return path
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        notes.append(_on_the_command_line(keys, f"{path} cannot be written ({err.strerror or err})"))
        return None
    return path


def _on_the_command_line(keys: str, why: str) -> str:
    return warning(
        f"ssh.options carries {keys}, whose values can hold a secret, and {why} (/run/fdl-prepare-ssh for root, "
        "$XDG_RUNTIME_DIR/fdl-prepare-ssh for another user): they are on sshfs's command line, where other users "
        "read them in ps"
    )


def _directory() -> str | None:
    """This user's private directory for the files, made if missing; None
    where there is none to be had (or what is there is not private)."""
    if os.geteuid() == 0:
        base = "/run"
    else:
        base = os.environ.get("XDG_RUNTIME_DIR") or ""
        if not os.path.isabs(base):
            return None
    path = os.path.join(base, "fdl-prepare-ssh")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return path
