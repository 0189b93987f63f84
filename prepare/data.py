"""Step 2: the dataset source root.

Three shapes, and the empty one is the common case:

- nothing declared: ship nothing, check nothing (the training binary keeps
  its own default, which is what a run that never mentions data expects);
- `data_path` alone: a root provisioning already placed. Verified to be a
  listable directory and shipped absolute, lexically: the path is handed to
  this host's ranks, and resolving symlinks would silently replace what the
  operator declared. A relative one is refused rather than resolved: it
  would mean the cwd of whoever started us, which under systemd is `/`;
- `data_source = "sshfs://[user@]host[:port]/abs/path"`: mounted read-only at
  `data_path` (default `/flodl/data`) unless something is mounted there
  already, which is reused (and named, when it is not the configured source).

Read-only is the invariant, not a precaution: ranks read the source root and
never write it (anything missing goes to the node-local cache), so `ro` puts
the kernel behind what was only a convention.

The mount outlives the attempt and the run: it is provisioning state, and it
is what makes the next attempt cheap (it finds the mount and reuses it).

Nothing here may hang. A dead sshfs mount answers `stat` by never answering,
so "is something mounted there" is read from /proc/self/mountinfo, and the
mountpoint itself is only ever looked at from a child process that
`prepare.proc` kills at `list_timeout_s`. A thread would not do: a thread
stuck in the kernel on a dead mount cannot be cancelled and keeps the
process from exiting.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import posixpath
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prepare import human, mounts, proc
from prepare.fail import Fail, permanent, transient
from prepare.spec import PrepareSpec, SshSpec

DEFAULT_DATA_PATH = "/flodl/data"

SCHEME = "sshfs"

# sshfs returns once its connection is up or has failed; a refused key or a
# closed port takes milliseconds. This bounds what ConnectTimeout does not:
# a far side that finishes the handshake and then never answers.
MOUNT_TIMEOUT_S = 30.0

# ssh's own bound on the TCP connect and the banner exchange, inside the
# mount timeout, so a black-holed far side is reported by sshfs itself and
# the ssh it started does not linger against it after we give up.
CONNECT_TIMEOUT_S = 20

# A failure slower than this is not asked again verbosely (see _mount).
QUICK_FAIL_S = 5.0

# How long a second prepare waits for the first to finish mounting before it
# gives up (transient) rather than queueing forever behind a wedged one.
LOCK_GRACE_S = 15.0

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

# Errors that describe the path itself: retrying cannot change them. Anything
# else from a listing (EIO, ENOTCONN, ESTALE, ETIMEDOUT, ...) is the far side
# of a mount misbehaving, which the next attempt may not meet.
_PATH_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENAMETOOLONG})

INSTALL_SSHFS = (
    "`sudo apt-get install sshfs` (Debian/Ubuntu), or from Nix the `sshfs` attribute "
    "(`nix profile install nixpkgs#sshfs`; on NixOS add `pkgs.sshfs` to environment.systemPackages)"
)


# -- the source spec ---------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A parsed `data_source`. `port` None leaves it to ssh (22 or ssh_config)."""

    user: str | None
    host: str
    port: int | None
    path: str

    @property
    def remote(self) -> str:
        """What sshfs takes as its first argument, and what the kernel then
        lists as the mount's source in mountinfo."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.user}@" if self.user else ""
        return f"{user}{host}:{self.path}"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port is not None else ""
        return f"{SCHEME}://{user}{host}{port}{self.path}"


_GRAMMAR = (
    "expected `sshfs://[user@]host[:port]/abs/path` "
    "(or the scp spelling `sshfs://[user@]host:/abs/path`)"
)


def _bad(value: str, why: str) -> Fail:
    return permanent(f"data_source {value!r} {why}; {_GRAMMAR}. Fix `data_source` (flag --data-source).")


def parse_source(value: str) -> Source:
    """Parse a `data_source`. Every malformed shape is a permanent Fail naming
    `data_source`: a box that cannot reach its data must say so here, not
    mid-epoch, and no retry fixes a typo."""
    text = value.strip()
    if not text:
        raise _bad(value, "is empty")
    if "://" not in text:
        if text.startswith(("/", "~", ".")):
            raise permanent(
                f"data_source {value!r} is a path, not a source: a directory that is already "
                f"there (provisioned, or mounted by another tool) goes in `data_path` "
                f"(--data-path {text}); `data_source` is for a source fdl-prepare mounts, "
                f"e.g. `sshfs://user@host:/flodl/data`."
            )
        raise _bad(value, "names no scheme")
    scheme, rest = text.split("://", 1)
    if not scheme:
        raise _bad(value, "names no scheme")
    if scheme.lower() != SCHEME:
        raise permanent(
            f"data_source {value!r} uses the scheme `{scheme}://`, which fdl-prepare does not "
            f"mount; it mounts `sshfs://` only. A source another tool already mounted needs no "
            f"scheme: name its local path in `data_path` instead, and drop `data_source`."
        )

    slash = rest.find("/")
    authority, path = (rest, "") if slash < 0 else (rest[:slash], rest[slash:])

    user: str | None = None
    if "@" in authority:
        user, authority = authority.rsplit("@", 1)
        if not user:
            raise _bad(value, "has an empty user before `@`")
        if ":" in user:
            # `user:password@`: the password is not quoted back, since this
            # message lands in journals; BatchMode could not type it anyway.
            name = user.split(":", 1)[0]
            shown = f"{scheme}://{name}:***@{authority}{path}"
            raise permanent(
                f"data_source {shown!r} carries a password in its user part (`{name}:...@`); "
                f"fdl-prepare does not send passwords (no prompt can be answered under systemd). "
                f"Authenticate with a key instead: drop `:password` from `data_source` (flag "
                f"--data-source) and set `ssh.identity_file` (flag --identity-file) to a private "
                f"key the data host accepts."
            )

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
    if any(c.isspace() for c in host):
        raise _bad(value, f"has whitespace in the host {host!r}")

    port: int | None = None
    if port_text:
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
    return Source(user=user, host=host, port=port, path=path)


# -- the sshfs command ---------------------------------------------------------


_KEY_VALUE = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)(?:\s*=\s*|\s+)(.*)$", re.DOTALL)


def _ssh_option(option: str) -> str:
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


def sshfs_argv(source: Source, mountpoint: str, ssh: SshSpec | None = None) -> list[str]:
    """The sshfs command line. The ssh block's own options come first:
    OpenSSH keeps the first value it sees for a key, so the operator's
    choices win over the defaults that follow. Those defaults come last
    (ro above all) and cannot be switched off from the config."""
    argv = ["sshfs", source.remote, mountpoint]

    def opt(value: str) -> None:
        argv.extend(["-o", value])

    if ssh is not None:
        for option in ssh.options:
            if option.strip():
                opt(_ssh_option(option))
        if ssh.identity_file:
            key = ssh.identity_file
            # ssh splits an option's value on whitespace unless it is quoted.
            if any(c.isspace() for c in key):
                key = f'"{key}"'
            opt(_ssh_option(f"IdentityFile={key}"))
    # The source's port, not the ssh block's: the data host and the tunnel
    # target can be different machines.
    if source.port is not None:
        opt(f"port={source.port}")
    for default in SSHFS_DEFAULTS:
        opt(default)
    opt(f"ConnectTimeout={CONNECT_TIMEOUT_S}")
    return argv


# -- the step ----------------------------------------------------------------


def ensure_root(spec: PrepareSpec, notes: list[str]) -> str | None:
    """Put the dataset source root in place and return its absolute path,
    or None when nothing is declared."""
    data = spec.data
    if data.data_source is None:
        if data.data_path is None:
            return None
        path = _absolute(data.data_path, "data_path")
        _verify(path, spec.list_timeout_s, mounted_from=None)
        return path

    source = parse_source(data.data_source)
    mountpoint = _absolute(data.data_path if data.data_path is not None else DEFAULT_DATA_PATH, "data_path")
    if mountpoint == "/":
        raise permanent(
            "data_path '/' cannot be the mountpoint of data_source: it would cover the whole "
            "machine. Set `data_path` to an empty directory such as /flodl/data."
        )
    with _mount_lock(mountpoint, spec.list_timeout_s):
        _establish(source, mountpoint, spec, notes)
    return mountpoint


def _absolute(path: str, field: str) -> str:
    if not path.strip():
        raise permanent(f"`{field}` is empty; give an absolute directory such as {DEFAULT_DATA_PATH}.")
    if "\0" in path:
        raise permanent(f"`{field}` {path!r} contains a NUL byte; no path can.")
    expanded = os.path.expanduser(path)
    if not os.path.isabs(expanded):
        # Resolving it would use our cwd, which is nobody's choice: `/` under
        # systemd, wherever a shell happened to be otherwise.
        shown = f" (expands to {expanded!r})" if expanded != path else ""
        raise permanent(
            f"`{field}` {path!r}{shown} is a relative path; it would resolve against the current "
            f"directory ({os.getcwd()}; `/` under systemd). Give an absolute directory such as "
            f"{DEFAULT_DATA_PATH} (flag --data-path)."
        )
    # Lexical on purpose: abspath never consults symlinks.
    return os.path.abspath(expanded)


def _establish(source: Source, mountpoint: str, spec: PrepareSpec, notes: list[str]) -> None:
    existing = mounts.mounted_at(mountpoint)
    if existing is None:
        _mount(source, mountpoint, spec.ssh)
        notes.append(f"mounted `{source.remote}` read-only at {mountpoint}")
        _verify(mountpoint, spec.list_timeout_s, mounted_from=source)
        return

    if _same_source(existing, source):
        try:
            _verify(mountpoint, spec.list_timeout_s, mounted_from=source)
        except _Disconnected:
            # The sshfs process behind this mount is gone (killed, OOM, a
            # reboot of the far side without reconnect): the kernel answers
            # ENOTCONN forever. It is our own mount of our own source, so
            # replacing it is the repair, not a trespass.
            _unmount(mountpoint)
            _mount(source, mountpoint, spec.ssh)
            notes.append(
                f"the earlier mount of `{source.remote}` at {mountpoint} had lost its sshfs process "
                f"(transport endpoint not connected); unmounted it and mounted it again read-only"
            )
            _verify(mountpoint, spec.list_timeout_s, mounted_from=source)
            return
        mode = "read-only" if existing.read_only else "read-write (ranks only read it; ro is expected)"
        notes.append(
            f"{mountpoint} is already mounted from `{existing.source}` ({existing.fstype}, {mode}); reusing it"
        )
        return

    unmount = f"fusermount -u {mountpoint}" if existing.is_fuse else f"sudo umount {mountpoint}"
    notes.append(
        f"{mountpoint} already carries a mount from `{existing.source}` ({existing.fstype}), not the "
        f"configured data_source `{source.url}`; leaving it alone, and the ranks will read whatever is "
        f"mounted there. To mount the configured source instead: `{unmount}`, then run again."
    )
    _verify(mountpoint, spec.list_timeout_s, mounted_from=source, foreign=True)


def _same_source(mount: mounts.Mount, source: Source) -> bool:
    if mount.fstype != "fuse.sshfs":
        return False
    if mount.source == source.remote:
        return True
    # sshfs keeps the remote as typed: `host:/data/` and `host:/data` are one source.
    head, sep, path = mount.source.rpartition(":")
    return bool(sep) and f"{head}:{posixpath.normpath(path)}" == source.remote




def _ensure_mountpoint(mountpoint: str) -> None:
    if os.path.isdir(mountpoint):
        return
    if os.path.lexists(mountpoint):
        raise permanent(
            f"the mountpoint {mountpoint} for data_source exists and is not a directory; remove it, "
            f"or set `data_path` to a directory this user owns."
        )
    try:
        os.makedirs(mountpoint, exist_ok=True)
    except OSError as err:
        user = human.user()
        raise permanent(
            f"the mountpoint {mountpoint} for data_source does not exist and cannot be created: "
            f"{human.oserror(err)}. Create it once during provisioning "
            f"(`sudo mkdir -p {mountpoint} && sudo chown {user} {mountpoint}`), or set `data_path` "
            f"to a directory this user owns."
        ) from None


def _check_identity(ssh: SshSpec | None) -> None:
    """ssh skips an IdentityFile it cannot load and carries on with the
    keys it has left, so a mistyped key path only ever surfaces as the far
    side refusing us: a transient failure, retried forever. Open it here,
    where its absence is still the config's fault and says so."""
    if ssh is None or not ssh.identity_file:
        return
    key = ssh.identity_file
    # ssh expands `%d`, `%u`, `${VAR}` itself; only it knows what those name.
    if "%" in key or "${" in key:
        return
    path = os.path.expanduser(key)
    fix = (
        "set `ssh.identity_file` (flag --identity-file) to the private key the data host accepts, "
        "readable by this user"
    )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        raise permanent(f"the ssh identity file {key} cannot be read: {human.oserror(err)}; {fix}.") from None
    try:
        os.read(fd, 1)
    except OSError as err:
        raise permanent(f"the ssh identity file {key} cannot be read: {human.oserror(err)}; {fix}.") from None
    finally:
        os.close(fd)


# What ssh prints when the options it was started with do not parse. It
# exits on them before it connects, so they name this box's configuration,
# never the far side. sshfs's own parser (which also vets the ssh options it
# passes on) answers in fuse's words. Matched per line, from its start.
_OPTION_ERROR = re.compile(
    r"^(?:fuse: unknown option"
    r"|fuse: invalid parameter in option"
    r"|command-line:? line \d+: "  # an -o value: a bad port, key, cipher, yes/no ...
    r"|\S.*: terminating, \d+ bad configuration options?$)"  # how every ssh_config file error ends
)
# The lines a config file's error is made of, quoted along with its end.
_FILE_LINE = re.compile(r"^\S.*:? line \d+: ")
# The one error-level message ssh prints about an option and then carries
# on past (a removed option such as RSAAuthentication): a refused connection
# after it is still the network's. The fatal bad-value message is lowercase
# (`unsupported option "maybe".`).
_OPTION_WARNING = re.compile(r'^\S.* line \d+: Unsupported option "')


def _option_errors(stderr: str) -> list[str]:
    """ssh's (or sshfs's) own lines saying it could not use its options, or
    [] when it did not say so."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    lines = [line for line in dict.fromkeys(lines) if not _OPTION_WARNING.match(line)]
    if not any(_OPTION_ERROR.match(line) for line in lines):
        return []
    return [line for line in lines if _OPTION_ERROR.match(line) or _FILE_LINE.match(line)]


def _mount(source: Source, mountpoint: str, ssh: SshSpec) -> None:
    if proc.which("sshfs") is None:
        raise _no_sshfs(source)
    _check_identity(ssh)
    _ensure_mountpoint(mountpoint)
    argv = sshfs_argv(source, mountpoint, ssh)
    where = f"mounting data_source `{source.url}` at {mountpoint}"
    start = time.monotonic()
    try:
        done = proc.run(argv, timeout=MOUNT_TIMEOUT_S)
    except proc.Missing:
        raise _no_sshfs(source) from None
    except proc.TimedOut as late:
        # sshfs puts the FUSE mount in place before its ssh has finished
        # connecting; killed now, it leaves a mount that answers ENOTCONN
        # to everyone. Nothing was mounted here when we started (we hold
        # the lock), so whatever sshfs is there now is this attempt's.
        _discard(mountpoint)
        raise transient(
            f"{where}: sshfs did not finish within {MOUNT_TIMEOUT_S:g}s (the far side accepts "
            f"connections but does not answer){_quoted(late.stderr)}"
        ) from None
    took = time.monotonic() - start
    if not done.ok:
        _discard(mountpoint)
        said = done.stderr
        verbose = [argv[0], "-v", *argv[1:]]
        if took < QUICK_FAIL_S:
            # A backgrounding sshfs sends ssh's stderr to /dev/null, so the
            # reason (a refused key, a refused connection, a changed host
            # key) is lost and all it says is "read: Connection reset by
            # peer". Its -v keeps ssh's stderr, but on success ssh then holds
            # our stderr pipe open for the life of the mount, which would
            # cost every good mount a wait. So only a quick failure is asked
            # again, verbosely: those are the ones with a reason to give.
            try:
                again = proc.run(verbose, timeout=MOUNT_TIMEOUT_S)
            except (proc.Missing, proc.TimedOut):
                again = None
            if again is not None and again.ok and _is_sshfs_at(mountpoint):
                return
            _discard(mountpoint)
            if again is not None and again.stderr.strip():
                said = again.stderr
        else:
            said = f"no answer after {took:.0f}s; {said}"
        refused = _option_errors(f"{done.stderr}\n{said}")
        if refused:
            # Transient would restart the unit into the same refusal forever.
            in_file = any(not line.startswith(("fuse: ", "command-line")) for line in refused)
            raise permanent(
                f"{where}: ssh cannot use the options it was given (sshfs said: {' / '.join(refused)}). "
                f"That is this box's configuration, not the far side: fix `ssh.options` (flag "
                f"--ssh-option: ssh_config options as Key=Value, or sshfs's own)"
                f"{' or the ssh_config file named there' if in_file else ''}. "
                f"Try it by hand: `{_shell(verbose)}`"
            )
        raise transient(
            f"{where} failed: sshfs exited {done.returncode}{_quoted(said)}. "
            f"Try it by hand: `{_shell(verbose)}`"
        )
    # sshfs exits 0 only once its connection is up, so a zero exit with
    # nothing mounted means the far side went away mid-handshake.
    if not _is_sshfs_at(mountpoint):
        raise transient(f"{where}: sshfs exited 0 but nothing is mounted there{_quoted(done.stderr)}")


def _discard(mountpoint: str) -> None:
    """Take down what a failed sshfs left at the mountpoint, if anything."""
    if _is_sshfs_at(mountpoint):
        try:
            _unmount(mountpoint)
        except Fail:
            pass


def _is_sshfs_at(mountpoint: str) -> bool:
    mounted = mounts.mounted_at(mountpoint)
    return mounted is not None and mounted.fstype == "fuse.sshfs"


def _no_sshfs(source: Source) -> Fail:
    return permanent(
        f"data_source `{source.url}` needs sshfs, which is not installed (not on PATH). Install it: "
        f"{INSTALL_SSHFS}. Or mount the source during provisioning and declare only `data_path`."
    )


def _unmount(mountpoint: str) -> None:
    for argv in (["fusermount3", "-u", "-z", mountpoint], ["fusermount", "-u", "-z", mountpoint], ["umount", "-l", mountpoint]):
        if proc.which(argv[0]) is None:
            continue
        try:
            if proc.run(argv, timeout=MOUNT_TIMEOUT_S).ok:
                return
        except (proc.Missing, proc.TimedOut):
            continue
    raise transient(
        f"{mountpoint} carries a dead sshfs mount (transport endpoint not connected) that could not "
        f"be unmounted; run `fusermount -u -z {mountpoint}`."
    )


def _quoted(stderr: str) -> str:
    text = " ".join(line.strip() for line in stderr.strip().splitlines() if line.strip())
    if not text:
        return ""
    if len(text) > 2000:
        text = text[:2000] + " ..."
    return f"; sshfs said: {text}"


def _shell(argv: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)


# -- listing, bounded --------------------------------------------------------

# The parent never stats the root itself: it runs this in a child. And the
# child does not touch the root either, it forks a grandchild that does. A
# process blocked on a FUSE request that the daemon has already taken cannot
# be killed, not even by SIGKILL (the kernel waits the request out), so a
# child that listed the root itself would hold up whoever waits for it to
# die; here only the grandchild wedges, orphaned with its stdio on
# /dev/null, and the child answers "timeout" and exits on time. The wedged
# grandchild ends when the far side answers or the mount is dropped.
#
# One entry is enough to prove listing works; reading them all would cost
# minutes on a large remote directory.
_LIST_SCRIPT = r"""
import os, select, stat, sys
path, limit = sys.argv[1], float(sys.argv[2])
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    def report(stage, code, reason):
        os.write(w, f"{stage} {code} {reason}".encode("utf-8", "replace"))
        os._exit(0)
    try:
        st = os.stat(path)
    except OSError as e:
        report("stat", e.errno, e.strerror)
    if not stat.S_ISDIR(st.st_mode):
        report("notdir", 0, "not a directory")
    try:
        with os.scandir(path) as it:
            next(it, None)
    except OSError as e:
        report("list", e.errno, e.strerror)
    report("ok", 0, "")
os.close(w)
ready, _, _ = select.select([r], [], [], limit)
if not ready:
    print("timeout 0 ", flush=True)
    os._exit(0)
answer = os.read(r, 4096).decode("utf-8", "replace")
os.waitpid(pid, 0)
print(answer or "died 0 the check process died", flush=True)
"""

# How much longer than the listing itself the child may take to start and
# answer before it is killed (it never touches the mount, so this is only a
# bound on a machine too loaded to start Python).
_CHILD_GRACE_S = 10.0


class _Disconnected(Fail):
    """The mount's FUSE process is gone (ENOTCONN)."""


def _verify(path: str, timeout: float, *, mounted_from: Source | None, foreign: bool = False) -> None:
    """Prove `path` is a listable directory, from a killable child.

    `mounted_from` None: a bare `data_path`, whose faults are the operator's
    to fix (permanent). Otherwise the root of a mount of that source, or
    (`foreign`) of some other mount found where that source belongs."""
    python = sys.executable or "python3"
    if mounted_from is None:
        what = "dataset root"
        fix = (
            "provision it (create or mount it), point `data_path` at a directory that exists, "
            "or set `data_source` so fdl-prepare mounts it there"
        )
    elif foreign:
        what = "the dataset root"
        fix = f"unmount it (`fusermount -u {path}` or `sudo umount {path}`) so data_source `{mounted_from.url}` can be mounted there"
    else:
        what = "the mounted dataset root"
        fix = f"check the remote directory named by data_source `{mounted_from.url}`"
    hung = transient(
        f"listing {what} {path} did not finish within {timeout:g}s: a dead or wedged mount "
        f"(the far side stopped answering). It may come back; if it does not, drop it with "
        f"`fusermount -u -z {path}` (or `sudo umount -l {path}`) and run again."
    )
    try:
        done = proc.run(
            [python, "-I", "-S", "-c", _LIST_SCRIPT, path, repr(float(timeout))],
            timeout=timeout + _CHILD_GRACE_S,
            cwd="/",
        )
    except proc.TimedOut:
        raise hung from None
    except proc.Missing:
        raise permanent(
            f"cannot check {what} {path}: the Python interpreter {python!r} is not runnable"
        ) from None

    words = done.stdout.strip().split(" ", 2)
    if not done.ok or len(words) < 2:
        raise transient(
            f"checking {what} {path} failed (the check exited {done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[:500]}"
        )
    stage, code = words[0], int(words[1]) if words[1].lstrip("-").isdigit() else 0
    reason = words[2] if len(words) > 2 else ""
    if stage == "ok":
        return
    if stage == "timeout":
        raise hung
    if stage == "notdir":
        raise permanent(f"{what} {path} is not a directory; {fix}.")
    if code == errno.ENOENT:
        raise permanent(f"{what} {path} does not exist; {fix}.")
    # The kernel answers ENOTCONN once a FUSE daemon is gone, and
    # ECONNABORTED to the first requests after an abort.
    if code in (errno.ENOTCONN, errno.ECONNABORTED):
        raise _Disconnected(
            f"{what} {path} is a FUSE mount whose process is gone ({reason}); "
            f"`fusermount -u -z {path}` drops it, then run again.",
            permanent=False,
        )
    if code in _PATH_ERRNOS:
        raise permanent(f"{what} {path} cannot be listed: {reason} (errno {code}); {fix}.")
    raise transient(
        f"{what} {path} cannot be listed: {reason} (errno {code}), a fault of the mount or the far "
        f"side that may clear; if it persists, `fusermount -u -z {path}` and run again."
    )


# -- one mounter at a time ---------------------------------------------------


def _lock_dir() -> str:
    """A directory every user can create a lock in, shared by all of them.

    /run/lock is world-writable (sticky) on systemd and Debian systems and is
    not hidden by a unit's PrivateTmp, so root and a service user serialize
    on the same file. Otherwise the runtime dir, otherwise the temp dir."""
    for candidate in ("/run/lock", os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir()):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return candidate
    return tempfile.gettempdir()


def lock_path(mountpoint: str) -> str:
    key = hashlib.sha256(os.fsencode(mountpoint)).hexdigest()[:16]
    return os.path.join(_lock_dir(), f"fdl-prepare-mount.{key}.lock")


def _open_lock(path: str) -> int:
    # Read-only is enough for flock, and works on a file another user created
    # in a sticky directory. Opening with O_CREAT an existing file owned by
    # someone else there fails under fs.protected_regular, so create only
    # when it is missing.
    while True:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            continue
        try:
            os.fchmod(fd, 0o644)
        except OSError:
            pass
        return fd


@contextmanager
def _mount_lock(mountpoint: str, list_timeout_s: float) -> Iterator[None]:
    """Two prepares on one box must not both mount: the second would stack a
    second sshfs on the first. The lock is keyed by the mountpoint, lives
    outside it, and is released by the kernel if its holder dies."""
    path = lock_path(mountpoint)
    try:
        fd = _open_lock(path)
    except OSError as err:
        raise permanent(
            f"cannot open the mount lock {path} for data_path {mountpoint}: {human.oserror(err)}; "
            f"make {os.path.dirname(path)} writable for this user."
        ) from None
    try:
        # What a holder can spend: a mount, its verbose retry or a remount
        # of a dead mount, and the listings around them, all bounded.
        wait = 3 * MOUNT_TIMEOUT_S + 3 * (list_timeout_s + _CHILD_GRACE_S) + LOCK_GRACE_S
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise transient(
                        f"another fdl-prepare has held the mount lock for {mountpoint} ({path}) for "
                        f"over {wait:g}s; it is probably stuck mounting. Retry later."
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
