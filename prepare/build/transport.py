"""floDl's transports for the training source, before Nix fetches it.

floDl lands every source spec the same way (flodl-cli source.rs
`materialize`): into a local directory it owns, then builds there. Here
`file:///abs` and `rsync://[user@]host[:port]:/abs` are copied with `rsync
-a --delete` into `<state>/sources/<digest of the spec>` (a `check` copies
into its own scratch directory), and that directory is handed to Nix as a
`path:` source: the build still gets a store path pinned by its NAR hash.
rsync keeps mtimes and sends only what changed, so a re-dial with nothing
changed costs a comparison, and the `path:` fetch of an unchanged tree
finds its store path already there.

What the copy takes and leaves is floDl's: `target/` and `.git/` at any
depth, `/libtorch/` at the root. What it refuses to carry is this box's
rule for root: no owners, no device or special files, no setuid bits, and
no symlink that leads out of the tree (`--safe-links`: an absolute link,
or one that climbs above the root, is not copied), so nothing in the copy
gives root, or the build, a file outside it.

floDl's `git+...#<tag or branch>` is asked of the remote (`git ls-remote`)
for its commit, and Nix fetches that commit: `?ref=refs/tags/<t>` or
`?ref=refs/heads/<b>`, with `&rev=<commit>`.

ssh, under rsync and under git, gets `[join.ssh]`'s identity and options
first (OpenSSH keeps the first value it sees), then BatchMode=yes and a
connect timeout, as the data mount does (prepare.data.url.ssh_options).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import stat
from collections.abc import Mapping
from urllib.parse import urlsplit

from prepare.data import mount, url
from prepare.fail import Fail
from prepare.host import human, proc, state
from prepare.nix.urls import SourceRef
from prepare.spec import SshSpec

# What floDl's fetch skips (source.rs RSYNC_EXCLUDES): `target/` and `.git/`
# at any depth, `libtorch/` only at the root.
EXCLUDES = ("--exclude=target/", "--exclude=.git/", "--exclude=/libtorch/")
# ssh's bound on the TCP connect and the banner exchange, and rsync's on a
# far side that stops sending mid-transfer (exit 30).
CONNECT_TIMEOUT_S = url.CONNECT_TIMEOUT_S
IO_TIMEOUT_S = 120
PULL_TIMEOUT_S = 1800.0
RESOLVE_TIMEOUT_S = 300.0
SOURCES = "sources"
# rsync's exit codes that mean the far side or the link (rsync(1)): socket
# I/O, the protocol stream broken, a timeout, a daemon that never answered,
# and ssh's own failure.
UNREACHABLE_CODES = {10: "socket I/O error", 12: "error in the rsync protocol data stream",
                     30: "timeout in data send/receive", 35: "timeout waiting for daemon connection",
                     255: "ssh failed"}  # fmt: skip
# A path Nix takes in a `path:` URL as it is.
_PLAIN_PATH = re.compile(r"[A-Za-z0-9/._+,@=-]+")
# What rsync (and the far side's rsync) says when the source directory is
# not there.
_NO_SUCH = re.compile(r"change_dir .* failed: No such file or directory|link_stat .* failed: No such file", re.I)
_RSH_PLAIN = re.compile(r"[A-Za-z0-9_./=:,@%+-]+")

INSTALL_RSYNC = "`sudo apt-get install rsync` (Debian/Ubuntu), or from Nix the `rsync` attribute"


def tree_dir(state_dir: str, scratch: str | None, ref: SourceRef) -> str:
    """The directory the copy of `ref` lives in, made (root's alone):
    `<state>/sources/<digest>` on an attempt, the check's scratch otherwise.
    A link or another user's directory there is refused, never followed."""
    parent = scratch if scratch is not None else os.path.join(state_dir, SOURCES)
    leaf = os.path.join(parent, hashlib.sha256(ref.spelled.encode()).hexdigest()[:16])
    if not _PLAIN_PATH.fullmatch(leaf):
        raise Fail(
            "config.invalid",
            f"the copy of the training source would live at {leaf!r}, which a `path:` URL cannot name as it is "
            "(spaces, quotes, %): set state_dir (--state-dir) to a plain path, e.g. /var/lib/fdl-prepare",
        )
    if scratch is None:
        _own_dir(parent, "state directory's copies of training sources")
    _own_dir(leaf, f"copy of the training source {ref.spelled!r}")
    return leaf


def _own_dir(path: str, what: str) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        with state.opened_dir(path, what) as fd:
            # Root's copy: nobody else reads the tree before Nix has it.
            if stat.S_IMODE(os.fstat(fd).st_mode) != 0o700:
                os.fchmod(fd, 0o700)
    except OSError as err:
        raise Fail(
            "dirs.unwritable", f"cannot make the {what} {path}: {human.oserror(err)}; make state_dir writable"
        ) from None


def rsh_words(ssh: SshSpec | None, port: int | None) -> list[str]:
    """The ssh command rsync runs, as words: the ssh block's options first
    (as the data mount gives them to ssh), the source's port, then
    BatchMode and the connect timeout."""
    given, _ = url.ssh_options(ssh)
    words = ["ssh"]
    for option in given:
        # As ssh_options gives them: an IdentityFile with a space in double
        # quotes, which ssh's own option parser reads (rsh keeps them).
        words += ["-o", option]
    if port is not None:
        words += ["-p", str(port)]
    words += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]
    return words


def rsh(words: list[str]) -> str:
    """`words` as the one `-e` string rsync splits itself: on spaces, with
    a word in single quotes kept whole and a doubled quote inside it one
    quote (rsync's main.c, do_cmd). A control character cannot be carried
    at all, and is refused."""
    out = []
    for word in words:
        if any(not c.isprintable() or (c.isspace() and c != " ") for c in word):
            raise Fail(
                "config.invalid",
                f"ssh.options holds {word!r}, with a control character or a tab, which no ssh command line can "
                "carry: fix `ssh.options` (--ssh-option) in [join.ssh]",
            )
        out.append(word if _RSH_PLAIN.fullmatch(word) else "'" + word.replace("'", "''") + "'")
    return " ".join(out)


def rsync_argv(ref: SourceRef, dest: str, ssh: SshSpec | None) -> list[str]:
    """The rsync command: floDl's `-a --delete` and excludes, what root
    will not carry (owners, devices, setuid bits, links out of the tree),
    `--protect-args` so the far side's shell never reads the path, and
    `--` before the operands."""
    argv = ["rsync", "-a", "--delete", "--no-owner", "--no-group", "--no-devices", "--no-specials"]
    argv += ["--safe-links", "--chmod=ugo-st,go-w", "--protect-args", f"--timeout={IO_TIMEOUT_S}", *EXCLUDES]
    if ref.kind == "rsync":
        assert ref.target is not None
        argv += ["-e", rsh(rsh_words(ssh, ref.target.port))]
        src = ref.target.remote.rstrip("/") + "/"
    else:
        assert ref.path is not None
        src = ref.path.rstrip("/") + "/"
    return [*argv, "--", src, dest.rstrip("/") + "/"]


def start_pull(ref: SourceRef, dest: str, ssh: SshSpec | None) -> proc.Running:
    """The copy, started (`finish_pull` waits for it)."""
    if ref.kind == "file":
        assert ref.path is not None
        if not os.path.isdir(ref.path):
            # Transient: the directory is the operator's to provide (a mount
            # still coming up, a copy not yet placed), as a remote tree not
            # yet published is; a mistyped path says so on every retry.
            raise Fail(
                "source.missing",
                f"the training source {ref.spelled!r} is not a directory on this box ({ref.path} "
                f"{'is not a directory' if os.path.lexists(ref.path) else 'does not exist'}); the next attempt "
                f"looks again. Place or mount the tree there, or fix source.from in [join.source] (--source)",
            )
    if ref.kind == "rsync":
        mount._check_identity(ssh, who="source host")
    argv = rsync_argv(ref, dest, ssh)
    try:
        return proc.start(argv, timeout=PULL_TIMEOUT_S, cwd="/")
    except proc.Missing:
        raise _no_rsync(ref) from None
    except proc.ExecFailed as failed:
        raise Fail(
            "source.unreachable",
            f"copying {ref.spelled!r}: rsync could not be started ({failed}); the next attempt retries",
        ) from None


def finish_pull(running: proc.Running, ref: SourceRef, dest: str, ssh: SshSpec | None) -> None:
    """Wait for the copy; its failure, by what rsync and ssh said."""
    where = f"copying the training source {ref.spelled!r} into {dest} with rsync"
    try:
        done = running.wait()
    except proc.TimedOut as late:
        raise Fail(
            "source.unreachable",
            f"{where}: did not finish within {late.timeout:g}s; the next attempt carries on from what was copied"
            f"{mount._quoted(late.stderr, 'rsync')}",
        ) from None
    if done.ok:
        return
    raise pull_failed(where, done, ref, ssh)


def pull_failed(where: str, done: proc.Completed, ref: SourceRef, ssh: SshSpec | None) -> Fail:
    said = done.stderr
    by_hand = shlex.join(rsync_argv(ref, "DEST", ssh))
    target = ref.target
    if target is not None and mount._HOST_KEY.search(said):
        return Fail(
            "source.host-key",
            f"{where}: the source host {target.host} has a host key ssh does not know or one other than "
            f"known_hosts holds (Host key verification failed). No retry changes known_hosts: "
            f"{mount.host_key_fix(target.host, target.port)}",
        )
    refused = mount._option_errors(said)
    if refused:
        return Fail(
            "config.invalid",
            f"{where}: ssh cannot use the options it was given (it said: {' / '.join(refused)}): fix `ssh.options` "
            f"(--ssh-option) in [join.ssh]. Try it by hand: `{by_hand}`",
        )
    if _NO_SUCH.search(said):
        place = f"on {target.host}" if target is not None else "on this box"
        return Fail(
            "source.missing",
            f"{where}: the tree is not there {place} (not published yet, or a path mistyped){mount._quoted(said, 'rsync')}; "
            f"the next attempt looks again. Publish it (`fdl publish`), or fix source.from in [join.source] (--source)",
        )
    meaning = UNREACHABLE_CODES.get(done.returncode, "")
    return Fail(
        "source.unreachable",
        f"{where} failed: rsync exited {done.returncode}{f' ({meaning})' if meaning else ''}"
        f"{mount._quoted(said, 'rsync')}; the next attempt retries. Check the far side is up, the key "
        f"(ssh.identity_file) is accepted there and allows rsync (a forced command does not). Try it by hand: "
        f"`{by_hand}`",
    )


def _no_rsync(ref: SourceRef) -> Fail:
    return Fail(
        "source.rsync-missing",
        f"the training source {ref.spelled!r} is copied with rsync, which is not installed (not on PATH): "
        f"{INSTALL_RSYNC}; it is what keeps mtimes, so a re-dial copies only what changed",
    )


# -- git: floDl's `#<tag or branch>`, and ssh under git -----------------------------


def git_env(ref: SourceRef, ssh: SshSpec | None, env: Mapping[str, str] | None) -> dict[str, str] | None:
    """The environment git (under Nix, or ls-remote) runs in for `ref`:
    for git over ssh, GIT_SSH_COMMAND with the ssh block's identity and
    options and BatchMode (the box's own, when the block sets nothing and
    the environment already has one); git's transports held to the three
    a source may name. None: the environment as it is."""
    if not ref.over_ssh:
        return None
    base = dict(os.environ if env is None else env)
    given, _ = url.ssh_options(ssh)
    if not given and "GIT_SSH_COMMAND" in base:
        return base
    words = rsh_words(ssh, None)
    base["GIT_SSH_COMMAND"] = shlex.join(words)
    return base


def start_resolve(ref: SourceRef, ssh: SshSpec | None, env: Mapping[str, str] | None) -> proc.Running:
    """`git ls-remote` for the ref's commit, started."""
    assert ref.git_url is not None and ref.ref is not None
    names = [ref.ref] if ref.ref.startswith("refs/") else [f"refs/tags/{ref.ref}", f"refs/heads/{ref.ref}"]
    run_env = dict(git_env(ref, ssh, env) or (os.environ if env is None else env))
    # Only the transports a source names; git's `ext::` runs commands.
    run_env["GIT_ALLOW_PROTOCOL"] = "file:https:http:ssh:git"
    run_env["GIT_TERMINAL_PROMPT"] = "0"
    patterns = [*names, *(f"{n}^{{}}" for n in names)]
    argv = ["git", "ls-remote", "--", ref.git_url, *patterns]
    try:
        return proc.start(argv, timeout=RESOLVE_TIMEOUT_S, env=run_env, cwd="/")
    except proc.ExecFailed as failed:
        raise Fail(
            "source.unreachable", f"asking {ref.spelled!r} for its ref: git could not be started ({failed})"
        ) from None


def finish_resolve(running: proc.Running, ref: SourceRef) -> str:
    """The Nix URL of the ref's commit: `?ref=<full ref>&rev=<commit>`.
    A tag wins over a branch of the same name, as in git (and floDl)."""
    assert ref.ref is not None and ref.nix_url is not None
    where = f"asking {redact_url(ref.git_url)} for {ref.ref!r} (git ls-remote)"
    try:
        done = running.wait()
    except proc.TimedOut as late:
        raise Fail(
            "source.unreachable", f"{where}: no answer within {late.timeout:g}s{mount._quoted(late.stderr, 'git')}"
        ) from None
    if not done.ok:
        if mount._HOST_KEY.search(done.stderr):
            parts = urlsplit(ref.git_url or "")
            try:
                host, port = parts.hostname or "", parts.port
            except ValueError:
                host, port = parts.hostname or "", None
            raise Fail(
                "nix.host-key",
                f"{where}: the git host has a host key ssh does not know, or one other than known_hosts holds "
                f"(Host key verification failed). No retry changes known_hosts: {mount.host_key_fix(host, port)}",
            )
        raise Fail(
            "source.unreachable",
            f"{where} failed: git exited {done.returncode}{mount._quoted(done.stderr, 'git')}; the next attempt retries",
        )
    found: dict[str, str] = {}
    for line in done.stdout.splitlines():
        sha, _, name = line.partition("\t")
        if re.fullmatch(r"[0-9a-f]{40}", sha):
            found[name.strip()] = sha
    names = [ref.ref] if ref.ref.startswith("refs/") else [f"refs/tags/{ref.ref}", f"refs/heads/{ref.ref}"]
    for name in names:
        # An annotated tag's commit is its peeled line (`^{}`).
        commit = found.get(f"{name}^{{}}") or found.get(name)
        if commit is not None:
            base = ref.nix_url
            return f"{base}{'&' if '?' in base else '?'}ref={name}&rev={commit}"
    raise Fail(
        "source.unreachable",
        f"{where}: the remote has no tag or branch {ref.ref!r} (not pushed yet, or mistyped); the next attempt "
        f"asks again. Push it, or fix source.from in [join.source] (--source)",
    )


def redact_url(text: str | None) -> str:
    from prepare.host import redact

    return repr(redact.redact(text or ""))
