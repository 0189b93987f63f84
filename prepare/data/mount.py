"""The sshfs mount at `data_path`: made, reused, or repaired.

`establish` runs under the step's mount lock (`prepare.data`), so what it
finds at the mountpoint is not another prepare's mount in the making. It
mounts when nothing is there, reuses a mount of the configured source (and
replaces one whose sshfs process is gone), and leaves anything else alone
with a note saying how to free the mountpoint.

What an sshfs failure means is read from what it said: ssh refusing its own
options is this box's configuration (permanent); anything else is the far
side or the network (transient).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import posixpath
import re
import shlex
import stat
import time
from collections.abc import Mapping

from prepare.data import listing, ssh_config, url
from prepare.data.url import Source, sshfs_argv
from prepare.fail import Fail
from prepare.host import human, mounts, proc
from prepare.host.redact import redact
from prepare.notes import warning
from prepare.spec import SshSpec

# sshfs returns once its connection is up or has failed; a refused key or a
# closed port takes milliseconds. This bounds what ConnectTimeout does not:
# a far side that finishes the handshake and then never answers.
MOUNT_TIMEOUT_S = 30.0

# A failure slower than this is not asked again verbosely (see _mount).
QUICK_FAIL_S = 5.0

INSTALL_SSHFS = (
    "`sudo apt-get install sshfs` (Debian/Ubuntu), or from Nix the `sshfs` attribute "
    "(`nix profile install nixpkgs#sshfs`; on NixOS add `pkgs.sshfs` to environment.systemPackages)"
)


def establish(source: Source, mountpoint: str, ssh: SshSpec, list_timeout_s: float, notes: list[str]) -> None:
    """Leave a listable mount at `mountpoint`: this source's, made or reused,
    or whatever else was there first (named in a note). The caller holds
    the mount lock."""
    existing = mounts.mounted_at(mountpoint)
    if existing is None:
        _mount(source, mountpoint, ssh, notes)
        notes.append(f"mounted `{source.remote}` read-only at {mountpoint}")
        listing.verify(mountpoint, list_timeout_s, mounted_from=source)
        return

    if _same_source(existing, source):
        try:
            listing.verify(mountpoint, list_timeout_s, mounted_from=source)
        except listing.Disconnected:
            # The sshfs process behind this mount is gone (killed, OOM, a
            # reboot of the far side without reconnect): the kernel answers
            # ENOTCONN forever. It is our own mount of our own source, so
            # replacing it is the repair, not a trespass.
            _unmount(mountpoint)
            _mount(source, mountpoint, ssh, notes)
            notes.append(
                warning(
                    f"the earlier mount of `{source.remote}` at {mountpoint} had lost its sshfs process "
                    f"(transport endpoint not connected); unmounted it and mounted it again read-only"
                )
            )
            listing.verify(mountpoint, list_timeout_s, mounted_from=source)
            return
        notes.append(_reused(existing, mountpoint) + "; reusing it")
        return

    notes.append(_foreign(existing, mountpoint, source))
    listing.verify(mountpoint, list_timeout_s, mounted_from=source, foreign=True)


def inspect(source: Source, mountpoint: str, ssh: SshSpec, list_timeout_s: float, notes: list[str]) -> tuple[str, str]:
    """What `establish` would do at `mountpoint`, found out without
    mounting or unmounting: a mount there is judged (and listed) as
    `establish` judges it; with none, or a dead one of ours, the source is
    reached as the mount would reach it (`reach`). Returns a verdict ("ok",
    "would mount", "would remount") and what was found; raises the Fail the
    attempt would."""
    existing = mounts.mounted_at(mountpoint)
    if existing is None:
        return "would mount", reach(source, mountpoint, ssh, notes)
    if _same_source(existing, source):
        try:
            listing.verify(mountpoint, list_timeout_s, mounted_from=source)
        except listing.Disconnected:
            return "would remount", (
                f"the mount of `{source.remote}` at {mountpoint} has lost its sshfs process: an attempt unmounts "
                f"it and mounts it again; {reach(source, mountpoint, ssh, notes)}"
            )
        return "ok", _reused(existing, mountpoint) + "; an attempt reuses it"
    notes.append(_foreign(existing, mountpoint, source))
    listing.verify(mountpoint, list_timeout_s, mounted_from=source, foreign=True)
    return "ok", f"{mountpoint} carries a mount from `{existing.source}`, which an attempt leaves there"


def reach(source: Source, mountpoint: str, ssh: SshSpec, notes: list[str]) -> str:
    """Everything the mount would need, short of mounting: sshfs there, the
    identity file usable, the mountpoint a directory or one that can be
    made (a probe directory made and removed beside where it would be),
    and the far side reached with sftp, with the ssh options the mount
    would use, and the source's directory found there (`cd`). A failure is
    read as the mount's would be, so it has the attempt's reason and kind.
    Returns what an attempt would mount."""
    if proc.which("sshfs") is None:
        raise _no_sshfs(source)
    _check_identity(ssh)
    made = _check_mountpoint(mountpoint)
    mounted = f"`{source.remote}` read-only at {mountpoint}" + (" (the mountpoint made first)" if made else "")
    sftp = proc.which("sftp")
    if sftp is None:
        notes.append(
            f"sftp is not installed (openssh-client ships it), so the data host of `{source.url}` was not reached: "
            "the first attempt's mount is the first to try it"
        )
        return mounted + "; the data host not reached (no sftp)"
    _, own = url.ssh_options(ssh)
    connects = sorted({key for key in own if key.lower() in url.SSHFS_CONNECTS})
    if connects:
        notes.append(
            f"ssh.options sets {', '.join(connects)}, which changes how sshfs reaches the data host: the check "
            "reached it with sftp over ssh instead, which the mount does not use"
        )
    argv = url.sftp_argv(source, ssh)
    batch = url.sftp_batch(source.path)
    where = f"reaching data_source `{source.url}` with sftp (as the mount at {mountpoint} would)"
    verbose = [argv[0], "-v", *argv[1:]]
    try:
        done = proc.run(argv, timeout=MOUNT_TIMEOUT_S, stdin=batch if batch is not None else "pwd\n", cwd="/")
    except proc.ExecFailed as failed:
        raise Fail(
            "data.unreachable", f"{where}: sftp could not be started ({failed}); the next attempt retries"
        ) from None
    except proc.TimedOut as late:
        raise Fail(
            "data.unreachable",
            f"{where}: sftp did not finish within {MOUNT_TIMEOUT_S:g}s (the far side accepts connections but does "
            f"not answer){_quoted(late.stderr, 'sftp')}",
        ) from None
    if not done.ok:
        raise _sshfs_failed(where, done, done.stderr, verbose, source, tool="sftp")
    if batch is None:
        notes.append(
            f"the remote path {source.path!r} of data_source has characters sftp's batch mode cannot be given "
            "safely: the host was reached, the directory not looked at"
        )
        return mounted + "; the data host reached (sftp)"
    return mounted + f"; the data host reached and {source.path} found there (sftp)"


def _check_mountpoint(mountpoint: str) -> bool:
    """The mountpoint as `_ensure_mountpoint` would find it, without making
    it: a directory (False), or missing with a directory above it where a
    probe directory can be made and removed (True, an attempt makes it)."""
    if os.path.isdir(mountpoint):
        return False
    if os.path.lexists(mountpoint):
        raise Fail(
            "data.mountpoint-unusable",
            f"the mountpoint {mountpoint} for data_source exists and is not a directory; remove it, "
            f"or set `data_path` to a directory this user owns.",
        )
    from prepare.host import dirs

    anchor = dirs.nearest_existing(mountpoint)
    probe = os.path.join(anchor, f".fdl-prepare-probe-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        if not os.path.isdir(anchor):
            raise NotADirectoryError(20, "Not a directory", anchor)
        os.mkdir(probe, 0o700)
        os.rmdir(probe)
    except OSError as err:
        raise _uncreatable(mountpoint, err) from None
    return True


def _reused(existing: mounts.Mount, mountpoint: str) -> str:
    mode = "read-only" if existing.read_only else "read-write (ranks only read it; ro is expected)"
    return f"{mountpoint} is already mounted from `{existing.source}` ({existing.fstype}, {mode})"


def _foreign(existing: mounts.Mount, mountpoint: str, source: Source) -> str:
    unmount = f"fusermount -u {mountpoint}" if existing.is_fuse else f"sudo umount {mountpoint}"
    return warning(
        f"{mountpoint} already carries a mount from `{existing.source}` ({existing.fstype}), not the "
        f"configured data_source `{source.url}`; leaving it alone, and the ranks will read whatever is "
        f"mounted there. To mount the configured source instead: `{unmount}`, then run again."
    )


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
        raise Fail(
            "data.mountpoint-unusable",
            f"the mountpoint {mountpoint} for data_source exists and is not a directory; remove it, "
            f"or set `data_path` to a directory this user owns.",
        )
    try:
        os.makedirs(mountpoint, exist_ok=True)
    except OSError as err:
        raise _uncreatable(mountpoint, err) from None


def _uncreatable(mountpoint: str, err: OSError) -> Fail:
    user = human.user()
    return Fail(
        "data.mountpoint-unusable",
        f"the mountpoint {mountpoint} for data_source does not exist and cannot be created: "
        f"{human.oserror(err)}. Create it once during provisioning "
        f"(`sudo mkdir -p {mountpoint} && sudo chown {user} {mountpoint}`), or set `data_path` "
        f"to a directory this user owns.",
    )


def _check_identity(ssh: SshSpec | None, env: Mapping[str, str] | None = None, *, who: str = "data host") -> None:
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
    fix = f"set `ssh.identity_file` (flag --identity-file) to the private key the {who} accepts, readable by this user"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        raise Fail(
            "data.identity-unreadable", f"the ssh identity file {key} cannot be read: {human.oserror(err)}; {fix}."
        ) from None
    try:
        st = os.fstat(fd)
        text = os.read(fd, _KEY_BYTES) if stat.S_ISREG(st.st_mode) else os.read(fd, 1)
    except OSError as err:
        raise Fail(
            "data.identity-unreadable", f"the ssh identity file {key} cannot be read: {human.oserror(err)}; {fix}."
        ) from None
    finally:
        os.close(fd)
    _check_key(key, st, text, env or os.environ, who)


# A private key file is a few KiB at most.
_KEY_BYTES = 1 << 16


def _check_key(key: str, st: os.stat_result, text: bytes, env: Mapping[str, str], who: str = "data host") -> None:
    """What ssh would refuse about the key itself, said before the mount
    tries: sshfs backgrounds ssh with its stderr on /dev/null, so the far
    side's "Permission denied" would be all that shows, and that reads as
    transient: the box would retry a key ssh never sends, for ever."""
    # OpenSSH's own rule (sshkey_perm_ok): a key its user owns must be
    # readable by nobody else, or it is ignored.
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
        raise Fail(
            "data.identity-unusable",
            f"the ssh identity file {key} has mode {stat.S_IMODE(st.st_mode):04o}: ssh refuses a private key "
            f"that others can read (\"Permissions {stat.S_IMODE(st.st_mode):04o} for '{key}' are too open\") and "
            f"does not use it. `chmod 600 {key}`; set `ssh.identity_file` (flag --identity-file) to the key the "
            f"{who} accepts",
        )
    if _encrypted(text) and not env.get("SSH_AUTH_SOCK"):
        raise Fail(
            "data.identity-unusable",
            f"the ssh identity file {key} has a passphrase, and the mount runs with BatchMode=yes, which cannot "
            'type one (ssh would only say "Permission denied (publickey)", and the box would retry for ever). '
            f"Remove the passphrase (`ssh-keygen -p -N '' -f {key}`, the file kept mode 0600), or load the key "
            "into an ssh-agent whose socket the unit gets as SSH_AUTH_SOCK (the NixOS module's sshAuthSock)",
        )


def _encrypted(text: bytes) -> bool:
    """Whether a private key file's text says it is encrypted: PEM's
    `Proc-Type: 4,ENCRYPTED` or an encrypted PKCS#8 block, or an OpenSSH
    key whose cipher is not "none"."""
    if b"Proc-Type: 4,ENCRYPTED" in text or b"BEGIN ENCRYPTED PRIVATE KEY" in text:
        return True
    begin, end = b"-----BEGIN OPENSSH PRIVATE KEY-----", b"-----END OPENSSH PRIVATE KEY-----"
    if begin not in text or end not in text:
        return False
    body = text.split(begin, 1)[1].split(end, 1)[0]
    try:
        raw = base64.b64decode(b"".join(body.split()), validate=True)
    except (ValueError, binascii.Error):
        return False
    magic = b"openssh-key-v1\0"
    if not raw.startswith(magic) or len(raw) < len(magic) + 4:
        return False
    size = int.from_bytes(raw[len(magic) : len(magic) + 4], "big")
    cipher = raw[len(magic) + 4 : len(magic) + 4 + size]
    return cipher != b"none"


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


# Where systemd, as PID 1, keeps its runtime state: what sd_booted(3)
# checks to know that systemd is the init system.
_SYSTEMD_RUNTIME = "/run/systemd/system"

# What systemd-run prints when it cannot make the scope (no bus, no
# permission); it has not started the command then.
_SCOPE_REFUSED = re.compile(r"^Failed to (?:start transient scope unit|create bus connection|connect to bus)", re.M)


def _scope(mountpoint: str) -> list[str]:
    """The prefix that runs sshfs in a transient scope of its own, outside
    the cgroup of the unit that started fdl-prepare, or [] where there is
    no systemd to ask (a container, another init: then nothing kills a
    unit's cgroup either).

    The sshfs daemon is the mount: a daemon left in the unit's cgroup is
    killed by every `systemctl restart` (each settings change does one),
    and the dataset mount under a running job goes with it (the mechanism
    of stargz-snapshotter#2387). `KillMode=process` would spare it too,
    but would also spare everything else a stopped attempt leaves (nix's
    builders, a listing wedged on a dead mount), so the unit keeps
    systemd's default and the daemon moves out instead. Only root may make
    a scope in the system manager."""
    if os.geteuid() != 0 or not os.path.isdir(_SYSTEMD_RUNTIME):
        return []
    runner = proc.which("systemd-run")
    if runner is None:
        return []
    return [runner, "--scope", "--quiet", "--collect", f"--description=fdl-prepare: sshfs mount at {mountpoint}", "--"]


def _run_sshfs(argv: list[str], mountpoint: str, notes: list[str]) -> proc.Completed:
    """sshfs, in a scope of its own when systemd can give it one."""
    scope = _scope(mountpoint)
    if scope:
        done = proc.run([*scope, *argv], timeout=MOUNT_TIMEOUT_S)
        refused = _SCOPE_REFUSED.search(done.stderr)
        if done.ok or refused is None:
            return done
        line = done.stderr[refused.start() :].splitlines()[0]
        notes.append(
            warning(
                f"systemd-run could not give the sshfs mount at {mountpoint} a scope of its own ({line}): mounted "
                "inside this unit instead, so a restart of the unit takes the mount down with it"
            )
        )
    return proc.run(argv, timeout=MOUNT_TIMEOUT_S)


def _mount(source: Source, mountpoint: str, ssh: SshSpec, notes: list[str]) -> None:
    if proc.which("sshfs") is None:
        raise _no_sshfs(source)
    _check_identity(ssh)
    _ensure_mountpoint(mountpoint)
    # As ssh reads them (not sshfs's -o escaping), the ones that can carry a secret.
    secrets = [option for option in url.ssh_options(ssh)[0] if url.secret(option)]
    argv = sshfs_argv(source, mountpoint, ssh, ssh_config.write(secrets, notes))
    where = f"mounting data_source `{source.url}` at {mountpoint}"
    start = time.monotonic()
    try:
        done = _run_sshfs(argv, mountpoint, notes)
    except proc.Missing:
        raise _no_sshfs(source) from None
    except proc.ExecFailed as failed:
        raise Fail(
            "data.unreachable", f"{where}: sshfs could not be started ({failed}); the next attempt retries"
        ) from None
    except proc.TimedOut as late:
        # sshfs puts the FUSE mount in place before its ssh has finished
        # connecting; killed now, it leaves a mount that answers ENOTCONN
        # to everyone. Nothing was mounted here when we started (we hold
        # the lock), so whatever sshfs is there now is this attempt's.
        _discard(mountpoint)
        raise Fail(
            "data.unreachable",
            f"{where}: sshfs did not finish within {MOUNT_TIMEOUT_S:g}s (the far side accepts "
            f"connections but does not answer){_quoted(late.stderr)}",
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
                again = _run_sshfs(verbose, mountpoint, [])
            except (proc.ExecFailed, proc.TimedOut):
                again = None
            if again is not None and again.ok and _is_sshfs_at(mountpoint):
                return
            _discard(mountpoint)
            if again is not None and again.stderr.strip():
                said = again.stderr
        else:
            said = f"no answer after {took:.0f}s; {said}"
        raise _sshfs_failed(where, done, said, verbose, source)
    # sshfs exits 0 only once its connection is up, so a zero exit with
    # nothing mounted means the far side went away mid-handshake.
    if not _is_sshfs_at(mountpoint):
        raise Fail("data.unreachable", f"{where}: sshfs exited 0 but nothing is mounted there{_quoted(done.stderr)}")


# What ssh says when it will not use a private key it was given (one named
# by an IdentityFile in ssh.options, which _check_key does not read): the
# key is this box's, and no retry changes it.
_KEY_REFUSED = re.compile(
    r'^(?:Load key "[^"]*": (?:bad permissions|incorrect passphrase supplied to decrypt private key|invalid format)'
    r"|Permissions \d+ for '[^']*' are too open\.)"
)


# What ssh says when the far side's host key is not the one known_hosts
# holds for it, or none is known and checking is strict (BatchMode=yes
# cannot ask): a person must look at the key and record it.
_HOST_KEY = re.compile(
    r"Host key verification failed|REMOTE HOST IDENTIFICATION HAS CHANGED|No \S+ host key is known for", re.I
)


def host_key_fix(host: str, port: int | None) -> str:
    """How to record a host's key after checking it, for the messages."""
    name = host if not port or port == 22 else f"[{host}]:{port}"
    scan = f"ssh-keyscan{'' if not port or port == 22 else f' -p {port}'} {host}"
    return (
        f"compare `{scan}` (its fingerprints: `{scan} | ssh-keygen -lf -`) with the key the host's operator "
        f"gives, then record it in the known_hosts file ssh uses (`ssh-keygen -R '{name}'` drops a changed one; "
        f"`{scan} >> ~/.ssh/known_hosts`, or the UserKnownHostsFile in ssh.options)"
    )


def _sshfs_failed(
    where: str, done: proc.Completed, said: str, verbose: list[str], source: Source, *, tool: str = "sshfs"
) -> Fail:
    """Why sshfs (or the check's sftp, `tool`) exited non-zero, from what it
    (or its verbose retry) said."""
    everything = f"{done.stderr}\n{said}"
    if _HOST_KEY.search(everything):
        changed = "CHANGED" in everything.upper() and "IDENTIFICATION" in everything.upper()
        what = (
            "has a host key other than the one known_hosts holds for it (REMOTE HOST IDENTIFICATION HAS CHANGED: "
            "a reinstalled host, or someone in between)"
            if changed
            else "has a host key ssh does not know, and strict checking cannot ask (Host key verification failed)"
        )
        return Fail(
            "data.host-key",
            f"{where}: the data host {what}. No retry changes known_hosts: {host_key_fix(source.host, source.port)}. "
            f"Try it by hand: `{_by_hand(verbose)}`",
        )
    keys = [line.strip() for line in everything.splitlines() if _KEY_REFUSED.match(line.strip())]
    if keys:
        return Fail(
            "data.identity-unusable",
            f"{where}: ssh will not use the private key it was given (ssh said: {' / '.join(dict.fromkeys(keys))}). "
            "That is this box's key, not the far side: `chmod 600` a key others can read, remove a passphrase "
            "(`ssh-keygen -p -N '' -f KEY`) or load the key into an ssh-agent, and check `ssh.identity_file` "
            f"(flag --identity-file) and any IdentityFile in `ssh.options`. Try it by hand: `{_by_hand(verbose)}`",
        )
    refused = _option_errors(f"{done.stderr}\n{said}")
    if refused:
        # Transient would restart the unit into the same refusal forever.
        in_file = any(not line.startswith(("fuse: ", "command-line")) for line in refused)
        return Fail(
            "config.invalid",
            f"{where}: ssh cannot use the options it was given ({tool} said: {redact(' / '.join(refused))}). "
            f"That is this box's configuration, not the far side: fix `ssh.options` (flag "
            f"--ssh-option: ssh_config options as Key=Value, or sshfs's own)"
            f"{' or the ssh_config file named there' if in_file else ''}. "
            f"Try it by hand: `{_by_hand(verbose)}`",
        )
    return Fail(
        "data.unreachable",
        f"{where} failed: {tool} exited {done.returncode}{_quoted(said, tool)}. Try it by hand: `{_by_hand(verbose)}`",
    )


def _discard(mountpoint: str) -> None:
    """Take down what a failed sshfs left at the mountpoint, if anything."""
    if _is_sshfs_at(mountpoint):
        with contextlib.suppress(Fail):
            _unmount(mountpoint)


def _is_sshfs_at(mountpoint: str) -> bool:
    mounted = mounts.mounted_at(mountpoint)
    return mounted is not None and mounted.fstype == "fuse.sshfs"


def _no_sshfs(source: Source) -> Fail:
    return Fail(
        "data.sshfs-missing",
        f"data_source `{source.url}` needs sshfs, which is not installed (not on PATH). Install it: "
        f"{INSTALL_SSHFS}. Or mount the source during provisioning and declare only `data_path`.",
    )


def _unmount(mountpoint: str) -> None:
    for argv in (
        ["fusermount3", "-u", "-z", mountpoint],
        ["fusermount", "-u", "-z", mountpoint],
        ["umount", "-l", mountpoint],
    ):
        if proc.which(argv[0]) is None:
            continue
        try:
            if proc.run(argv, timeout=MOUNT_TIMEOUT_S).ok:
                return
        except (proc.ExecFailed, proc.TimedOut):
            continue
    raise Fail(
        "data.dead-mount",
        f"{mountpoint} carries a dead sshfs mount (transport endpoint not connected) that could not "
        f"be unmounted; run `fusermount -u -z {mountpoint}`.",
    )


def _quoted(stderr: str, tool: str = "sshfs") -> str:
    text = " ".join(line.strip() for line in stderr.strip().splitlines() if line.strip())
    if not text:
        return ""
    if len(text) > 2000:
        text = text[:2000] + " ..."
    return f"; {tool} said: {redact(text)}"


def _by_hand(argv: list[str]) -> str:
    """A command for the operator to run, with the value of any ssh option
    that can carry a secret (ProxyCommand, SetEnv, ...) hidden: the message
    goes to the journal, and the operator has the option in the config."""
    return redact(shlex.join(argv))
