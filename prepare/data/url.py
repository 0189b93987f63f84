"""The `sshfs://` source grammar, and the sshfs command line it becomes.

`data_source = "sshfs://[user@]host[:port]/abs/path"` is parsed here, without
touching the network: every malformed shape is a permanent Fail naming
`data_source`, raised before anything is mounted. `sshfs_argv` turns a parsed
source and the box's ssh block into the command `prepare.data.mount` runs.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from prepare.fail import Fail
from prepare.host.redact import SSH_SECRET_OPTIONS
from prepare.spec import SshSpec

SCHEME = "sshfs"

# ssh's own bound on the TCP connect and the banner exchange, inside the
# mount timeout (prepare.mount.MOUNT_TIMEOUT_S), so a black-holed far side is
# reported by sshfs itself and the ssh it started does not linger against it
# after we give up.
CONNECT_TIMEOUT_S = 20

# In this order after the operator's own options: ro is the source-root
# invariant; reconnect + ServerAlive bring a dropped link back instead of
# wedging every read behind a dead channel; BatchMode because a passphrase
# or password prompt inside a systemd unit waits forever for nobody.
SSHFS_DEFAULTS = (
    "ro",
    "reconnect",
    "ServerAliveInterval=15",
    "ServerAliveCountMax=3",
    "BatchMode=yes",
)
# ConnectTimeout=CONNECT_TIMEOUT_S follows them.


# -- the source spec ---------------------------------------------------------


@dataclass(frozen=True)
class SshTree:
    """A directory on a host reached over ssh: what sshfs mounts (a
    `data_source`) and rsync pulls (an `rsync://` training source). `port`
    None leaves it to ssh (22 or ssh_config)."""

    user: str | None
    host: str
    port: int | None
    path: str

    @property
    def remote(self) -> str:
        """`[user@]host:/path` (an IPv6 host in brackets): what sshfs and
        rsync take, and what the kernel then lists as a mount's source in
        mountinfo."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.user}@" if self.user else ""
        return f"{user}{host}:{self.path}"


@dataclass(frozen=True)
class Source(SshTree):
    """A parsed `data_source`."""

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port is not None else ""
        return f"{SCHEME}://{user}{host}{port}{self.path}"


_GRAMMAR = "expected `sshfs://[user@]host[:port]/abs/path` (or the scp spelling `sshfs://[user@]host:/abs/path`)"


def _bad(value: str, why: str) -> Fail:
    return Fail("config.invalid", f"data_source {value!r} {why}; {_GRAMMAR}. Fix `data_source` (flag --data-source).")


def parse_source(value: str) -> Source:
    """Parse a `data_source`. Every malformed shape is a permanent Fail naming
    `data_source`: a box that cannot reach its data must say so here, not
    mid-epoch, and no retry fixes a typo."""
    scheme, rest = _scheme(value)
    slash = rest.find("/")
    authority, path = (rest, "") if slash < 0 else (rest[:slash], rest[slash:])
    user, authority = _user(value, scheme, authority, path)
    host, port_text = _host(value, authority)
    port = _port(value, port_text, path)
    return Source(user=user, host=host, port=port, path=_path(value, path))


def _scheme(value: str) -> tuple[str, str]:
    """The scheme, which must be sshfs, and what follows its `://`."""
    text = value.strip()
    if not text:
        raise _bad(value, "is empty")
    if "://" not in text:
        if text.startswith(("/", "~", ".")):
            raise Fail(
                "config.invalid",
                f"data_source {value!r} is a path, not a source: a directory that is already "
                f"there (provisioned, or mounted by another tool) goes in `data_path` "
                f"(--data-path {text}); `data_source` is for a source fdl-prepare mounts, "
                f"e.g. `sshfs://user@host:/flodl/data`.",
            )
        raise _bad(value, "names no scheme")
    scheme, rest = text.split("://", 1)
    if not scheme:
        raise _bad(value, "names no scheme")
    if scheme.lower() != SCHEME:
        raise Fail(
            "config.invalid",
            f"data_source {value!r} uses the scheme `{scheme}://`, which fdl-prepare does not "
            f"mount; it mounts `sshfs://` only. A source another tool already mounted needs no "
            f"scheme: name its local path in `data_path` instead, and drop `data_source`.",
        )
    return scheme, rest


def _user(value: str, scheme: str, authority: str, path: str) -> tuple[str | None, str]:
    """The user before `@`, if any, and the authority without it."""
    if "@" not in authority:
        return None, authority
    user, authority = authority.rsplit("@", 1)
    if not user:
        raise _bad(value, "has an empty user before `@`")
    if user.startswith("-"):
        # sshfs hands `user@host` to ssh as its destination argument, which
        # ssh would read as an option (`-oProxyCommand=...`).
        raise _bad(value, f"has a user {user!r} that starts with '-', which ssh would read as an option")
    if any(c.isspace() or not c.isprintable() for c in user):
        raise _bad(value, f"has whitespace or a control character in the user {user!r}")
    if ":" in user:
        # `user:password@`: the password is not quoted back, since this
        # message lands in journals; BatchMode could not type it anyway.
        name = user.split(":", 1)[0]
        shown = f"{scheme}://{name}:***@{authority}{path}"
        raise Fail(
            "config.invalid",
            f"data_source {shown!r} carries a password in its user part (`{name}:...@`); "
            f"fdl-prepare does not send passwords (no prompt can be answered under systemd). "
            f"Authenticate with a key instead: drop `:password` from `data_source` (flag "
            f"--data-source) and set `ssh.identity_file` (flag --identity-file) to a private "
            f"key the data host accepts.",
        )
    return user, authority


def _host(value: str, authority: str) -> tuple[str, str | None]:
    """The host (brackets dropped from an IPv6 one) and the port as written, if any."""
    port_text: str | None = None
    if authority.startswith("["):
        close = authority.find("]")
        if close < 0:
            raise _bad(value, "opens an IPv6 `[` host without closing it")
        host, after = authority[1:close], authority[close + 1 :]
        if after:
            if not after.startswith(":"):
                raise _bad(value, f"has {after!r} after the bracketed host")
            port_text = after[1:]
    elif authority.count(":") > 1:
        raise _bad(value, "has more than one `:` in the host (write an IPv6 address in brackets)")
    elif ":" in authority:
        host, port_text = authority.split(":", 1)
    else:
        host = authority

    if not host:
        raise _bad(value, "names no host")
    if host.startswith("-"):
        raise _bad(value, f"has a host {host!r} that starts with '-', which ssh would read as an option")
    if any(c.isspace() or not c.isprintable() for c in host):
        raise _bad(value, f"has whitespace or a control character in the host {host!r}")
    return host, port_text


def _port(value: str, port_text: str | None, path: str) -> int | None:
    if not port_text:
        return None
    # ASCII only: str.isdigit() is true for '²', which int() refuses,
    # and for '٢٢', which int() reads as 22.
    if not (port_text.isascii() and port_text.isdigit()):
        if not path:
            raise _bad(
                value,
                f"names no absolute path (scp's relative `host:{port_text}` is not accepted: "
                f"the root must not depend on the remote user's home)",
            )
        raise _bad(value, f"has a port {port_text!r} that is not a number (ASCII digits 0-9)")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise _bad(value, f"has a port {port} outside 1-65535")
    return port


def _path(value: str, path: str) -> str:
    if not path:
        raise _bad(value, "names no path")
    path = posixpath.normpath(path)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    if path == "/":
        raise _bad(
            value,
            "names the remote root `/`, which is a whole machine, not a dataset root; "
            "name the directory that holds the data",
        )
    return path


# -- the ssh block's tunnel target -----------------------------------------------


def _tunnel(target: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (the compact form the join loop's `--ssh`
    takes), or a bare host: its user, host and port."""
    text = target.strip()
    user, _, host = text.rpartition("@")
    port: int | None = None
    if host.startswith("[") and "]" in host:
        inside, _, after = host[1:].partition("]")
        host, digits = inside, after.removeprefix(":")
        port = int(digits) if digits.isascii() and digits.isdigit() else None
    elif host.count(":") == 1:
        name, digits = host.split(":")
        if digits.isascii() and digits.isdigit():
            host, port = name, int(digits)
    return user or None, host, port


def with_tunnel_defaults(source: Source, ssh: SshSpec | None, notes: list[str]) -> Source:
    """`source` with the ssh block's user and port where it names none,
    when its host is the controller tunnel's (`ssh.target`): in the shape
    the join loop is built for, the data host IS the controller box, and
    the block says how this box logs in there. On any other host the block
    does not apply, and a note says so rather than leaving `ssh.user` or
    `ssh.port` silently unused for the mount."""
    if ssh is None or not (ssh.target or ssh.user or ssh.port):
        return source
    given = [f"ssh.{k} (--ssh-{k})" for k in ("user", "port") if getattr(ssh, k)]
    if not ssh.target:
        if given:
            notes.append(
                f"{' and '.join(given)} describe how this box logs in to ssh.target (--ssh-target), the "
                f"controller tunnel, which is not set: the mount of data_source `{source.url}` uses its own "
                "user and port (sshfs://user@host:port/path)"
            )
        return source
    t_user, t_host, t_port = _tunnel(ssh.target)
    if t_host.lower() != source.host.lower():
        if given:
            notes.append(
                f"{' and '.join(given)} are for ssh.target {t_host} (the controller tunnel the join loop "
                f"dials); data_source's host {source.host} is another machine, so its mount uses data_source's "
                "own user and port (sshfs://user@host:port/path)"
            )
        return source
    took = []
    user, port = source.user, source.port
    if user is None and (ssh.user or t_user):
        user = ssh.user or t_user
        took.append(f"user {user} ({'ssh.user' if ssh.user else 'ssh.target'})")
    if port is None and (ssh.port or t_port):
        port = ssh.port or t_port
        took.append(f"port {port} ({'ssh.port' if ssh.port else 'ssh.target'})")
    if not took:
        return source
    notes.append(
        f"data_source's host {source.host} is the controller tunnel's (ssh.target): mounting with "
        f"{' and '.join(took)}, which data_source does not name"
    )
    return Source(user=user, host=source.host, port=port, path=source.path)


# -- the sshfs command ---------------------------------------------------------


_KEY_VALUE = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)(?:\s*=\s*|\s+)(.*)$", re.DOTALL)


def ssh_option(option: str) -> str:
    """One ssh_config option as sshfs takes it after `-o`.

    sshfs wants `Key=Value` (ssh_config's `Key Value` is an unknown option
    to it), and it splits its `-o` on commas and unescapes backslashes, so
    `Ciphers=a,b` would become two options unless the comma is escaped."""
    option = option.strip()
    if option.startswith("-o"):
        option = option[2:].strip()
    match = _KEY_VALUE.match(option)
    if match:
        option = f"{match.group(1)}={match.group(2).strip()}"
    return option.replace("\\", "\\\\").replace(",", "\\,")


def secret(option: str) -> bool:
    """Whether an ssh option (`Key=Value`, as sshfs takes it) can carry a
    secret in its value, and so goes into prepare.data.ssh_config's file
    rather than on a command line (sshfs's own ssh_command is no
    ssh_config keyword: it stays)."""
    key = option.split("=", 1)[0].strip().lower()
    return key in SSH_SECRET_OPTIONS and key != "ssh_command"


def sshfs_argv(
    source: Source, mountpoint: str, ssh: SshSpec | None = None, config_file: str | None = None
) -> list[str]:
    """The sshfs command line: its options, then `--`, the source and the
    mountpoint. The ssh block's own options come first:
    OpenSSH keeps the first value it sees for a key, so the operator's
    choices win over the defaults that follow. Those defaults come last
    (ro above all) and cannot be switched off from the config. With
    `config_file` (prepare.data.ssh_config), the options that can carry a
    secret are in that file, named with -F, not on the command line."""
    argv = ["sshfs"]

    def opt(value: str) -> None:
        argv.extend(["-o", value])

    if config_file is not None:
        argv.extend(["-F", config_file])
    if ssh is not None:
        for option in ssh.options:
            if option.strip() and not (config_file is not None and secret(ssh_option(option))):
                opt(ssh_option(option))
        if ssh.identity_file:
            key = ssh.identity_file
            # ssh splits an option's value on whitespace unless it is quoted.
            if any(c.isspace() for c in key):
                key = f'"{key}"'
            opt(ssh_option(f"IdentityFile={key}"))
    # The source's port, not the ssh block's: the data host and the tunnel
    # target can be different machines.
    if source.port is not None:
        opt(f"port={source.port}")
    for default in SSHFS_DEFAULTS:
        opt(default)
    opt(f"ConnectTimeout={CONNECT_TIMEOUT_S}")
    # Options end at `--` (fuse's option parser honours it), so the source
    # and the mountpoint are never read as options, whatever they hold.
    return [*argv, "--", source.remote, mountpoint]


# -- reaching the source without mounting it (`fdl-prepare check`) -------------------

# Options of sshfs and of FUSE (sshfs(1), mount.fuse(8)) an operator may put
# in ssh.options, which the mount takes for itself and ssh never sees; the
# rest are ssh_config options, as sshfs hands them to ssh. Compared in
# lower case: ssh's keywords are case-insensitive, sshfs's and FUSE's are
# lower case.
SSHFS_OWN = frozenset(
    {
        "reconnect", "delay_connect", "sshfs_sync", "no_readahead", "sync_readdir", "sshfs_debug", "cache",
        "cache_timeout", "cache_max_size", "cache_stat_timeout", "cache_dir_timeout", "cache_link_timeout",
        "dcache_timeout", "dcache_max_size", "dcache_stat_timeout", "dcache_dir_timeout", "dcache_link_timeout",
        "dcache_clean_interval", "dcache_min_clean_interval", "dir_cache", "idmap", "uidfile", "gidfile", "nomap",
        "ssh_command", "ssh_protocol", "sftp_server", "directport", "vsock", "slave", "passive", "disable_hardlink",
        "transform_symlinks", "follow_symlinks", "no_check_root", "password_stdin", "max_read", "max_write",
        "max_conns", "workaround", "kernel_cache", "auto_cache", "ro", "rw", "allow_other", "allow_root",
        "default_permissions", "uid", "gid", "umask", "fsname", "subtype", "noatime", "nodev", "nosuid", "noexec",
        "auto_unmount", "large_read", "entry_timeout", "attr_timeout", "negative_timeout", "ac_attr_timeout",
        "big_writes", "modules", "blkdev", "blksize", "max_background", "congestion_threshold", "nonempty",
    }
)  # fmt: skip
# Of those, the ones that change how sshfs reaches the host: with one set,
# sftp over ssh is not the way the mount connects.
SSHFS_CONNECTS = frozenset({"ssh_command", "ssh_protocol", "sftp_server", "directport", "vsock", "slave", "passive"})

# What sftp's batch mode takes unquoted in a path, and quoted: a path with
# anything else (a quote, a backslash, a control character) is not given
# to it.
_PLAIN_PATH = re.compile(r"[A-Za-z0-9/._+@%,=~:-]+")
_QUOTABLE_PATH = re.compile(r"[^\"\\\x00-\x1f\x7f*?\[\]]+")


def ssh_options(ssh: SshSpec | None) -> tuple[list[str], list[str]]:
    """The ssh block's options that are ssh's (`Key=Value`, unescaped), as
    the mount would hand them to ssh, and the keys of those that are
    sshfs's or FUSE's own."""
    given: list[str] = []
    own: list[str] = []
    if ssh is None:
        return given, own
    for option in ssh.options:
        text = option.strip()
        if text.startswith("-o"):
            text = text[2:].strip()
        if not text:
            continue
        match = _KEY_VALUE.match(text)
        key = (match.group(1) if match else text.split("=", 1)[0]).strip()
        if match is None or key.lower() in SSHFS_OWN:
            own.append(key)
            continue
        given.append(f"{match.group(1)}={match.group(2).strip()}")
    if ssh.identity_file:
        key_file = ssh.identity_file
        if any(c.isspace() for c in key_file):
            key_file = f'"{key_file}"'
        given.append(f"IdentityFile={key_file}")
    return given, own


def sftp_argv(source: Source, ssh: SshSpec | None = None, config_file: str | None = None) -> list[str]:
    """An sftp command, in batch mode (its commands on stdin), that reaches
    the source's host with the ssh options the mount would use: the ssh
    block's first (OpenSSH keeps the first value it sees), the source's
    port, then the mount's own defaults that are ssh's; with `config_file`,
    the options that can carry a secret from that file (sshfs_argv)."""
    argv = ["sftp", "-b", "-"]
    if config_file is not None:
        argv += ["-F", config_file]
    given, _ = ssh_options(ssh)
    for option in given:
        if not (config_file is not None and secret(option)):
            argv += ["-o", option]
    if source.port is not None:
        argv += ["-o", f"Port={source.port}"]
    for default in SSHFS_DEFAULTS:
        if "=" in default:
            argv += ["-o", default]
    argv += ["-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]
    host = f"[{source.host}]" if ":" in source.host else source.host
    # `--` ends the options; the destination names no path, since sftp
    # would download a path that is a file.
    return [*argv, "--", f"{source.user}@{host}" if source.user else host]


def sftp_batch(path: str) -> str | None:
    """The batch that proves `path` is a directory there (`cd`), or None
    for a path sftp's batch parser could misread (then only the host is
    reached)."""
    if _PLAIN_PATH.fullmatch(path):
        return f"cd {path}\n"
    if _QUOTABLE_PATH.fullmatch(path):
        return f'cd "{path}"\n'
    return None
