"""Why a nix call failed, and whether trying again could help.

Failures are classified by the *phase* a call belongs to (evaluation, input
fetch, build) and the error records Nix wrote, never by the exit code beyond
zero/non-zero: `nix build` exits 1 for a failed builder where `nix-store
--realise` exits 100, and the daemon and remote builders lose the 1xx codes
(NixOS/nix #8782, #4813, #12641).

The diagnosis is a table: `ROWS`, in order, each a cause (`Cause`: its
name, its reason code, and so its kind, and the fix the operator is told),
what the call's words must match, and the phases it applies to; the first
row that matches is the diagnosis.

Nix words the same failure differently across versions, so the patterns
match the meaning rather than one version's spelling; where one is there for
a version's own words, the comment beside it says which version said what.
Each pattern takes a quoted value in single quotes (2.8, 2.26), double
quotes (2.34's paths) or none (`_Q`, `_IN`); the comments quote the words
each version was seen to write (2.8.0, 2.26.3, 2.34.8).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from prepare.fail import PERMANENT, REASONS, Fail, Reason
from prepare.host.redact import redact
from prepare.nix.log import Activity, Log

# The phase a nix call belongs to: what an error record means depends on it.
EVALUATION = "evaluation"
FETCH = "fetch"
BUILD = "build"
# A publish's own steps: signing its outputs in the local store, copying
# them to a cache.
SIGN = "sign"
COPY = "copy"


@dataclass(frozen=True)
class BuildDir:
    """Where a build's directory is made, for the words a full disk gets.
    `setting` says what chose `path`: TMPDIR (Nix without a build-dir
    setting, or before 2.30 with none set), Nix's build-dir (its default
    from 2.30, or nix.conf's), or the daemon, which builds where its own
    settings say (`path` unknown here)."""

    path: str
    setting: Literal["TMPDIR", "build-dir", "daemon"]

    def words(self) -> dict[str, str]:
        if self.setting == "TMPDIR":
            return {
                "where": f"under TMPDIR={self.path}",
                "look": f"see `df -h {self.path}`",
                "move": "point TMPDIR at a larger disk",
            }
        if self.setting == "build-dir":
            return {
                "where": f"under Nix's build-dir {self.path}",
                "look": f"see `df -h {self.path}`",
                "move": "set build-dir in /etc/nix/nix.conf to a directory on a larger disk that no other user "
                "can write (not under /tmp)",
            }
        return {
            "where": "the Nix daemon's: under its build-dir, /nix/var/nix/builds unless its nix.conf sets one "
            "(Nix 2.30 and later), or its TMPDIR (earlier Nix)",
            "look": "see `df -h` of that directory",
            "move": "point the daemon's at a larger disk (build-dir in its nix.conf, TMPDIR in its environment "
            "before Nix 2.30) and restart nix-daemon",
        }


TMP = BuildDir("/tmp", "TMPDIR")

# A value Nix quotes in a message: 2.8 and 2.26 write 'x' everywhere; 2.34
# writes paths "x" (`getting status of "/p/github:a"`, `tarball "/x" does
# not exist.`, `opening lock file "/nix/var/nix/db/big-lock"`) and other
# values still 'x' (`input 'sshfs://x/y' is unsupported`, `cannot connect
# to socket at '/s'`). Patterns take either quote, or none: `_Q` is the
# optional quote, `_IN` what lies between.
_Q = "['\"]?"
_IN = "[^'\"\\n]*"

# Compiled on first use: they only matter once a call has failed, and
# compiling them at import would cost every warm run ~10 ms.
_HASH_MISMATCH = (
    r"hash mismatch in fixed-output derivation|hash mismatch importing path|NAR hash mismatch|got:\s+sha256"
)
# "writing to file: No space left on device" (2.8, 2.26) and "write of
# 24576 bytes: No space left on device" (2.34) where the store's disk fills
# during a fetch. 2.34 also keeps gc-reserved-space (8 MiB) in the store's
# db/, so a small store is full at its first call, whatever the call:
# "setting journal mode: database or disk is full, database or disk is full
# (in '/…/nix/var/nix/db/db.sqlite')".
_NO_SPACE = r"no space left on device|disk quota exceeded|database or disk is full"
# Daemon wording only. "connection reset by peer" and "unexpected end-of-file"
# also end a download cut short (current Nix appends curl's own words:
# "unable to download '…': Failure when receiving data from the peer (56)
# Recv failure: Connection reset by peer"), and sending an operator to
# `systemctl start nix-daemon` for a flaky network is the wrong fix. A daemon
# that drops the connection says so through its store: "cannot open
# connection to remote store 'unix://…': … Connection reset by peer" (Nix 2.8).
# A cut with no daemon wording is a fetch (below): transient either way.
# "cannot connect to socket at '/s': Connection refused" on 2.8, 2.26 and
# 2.34 alike (2.34 still single-quotes the socket).
_DAEMON = (
    r"cannot connect to socket at|cannot connect to daemon|error (reading from|writing to) daemon|"
    rf"cannot open connection to remote store {_Q}(daemon|unix:{_IN}){_Q}|daemon-socket/socket"
)
# The daemon is there and says no to this user: the socket's permissions
# (Debian's nix-setup-systemd lets only the nix-users group in) or its
# allowed-users. Seen the same on 2.8, 2.26 and 2.34 ("cannot connect to
# socket at '/s': Permission denied"); no retry changes group membership,
# so unlike an absent daemon it must stop a persist loop.
_DAEMON_REFUSED = (
    rf"cannot connect to socket at {_Q}{_IN}{_Q}: permission denied|is not allowed to connect to the nix daemon"
)
# Nix builds as the members of build-users-group and that group does not
# exist: Debian's nix-bin without its recommended nix-setup-systemd (2.8,
# 2.26 and 2.34 word it the same: "the group 'nixbld' specified in
# 'build-users-group' does not exist"). Every build fails until the
# installation is fixed.
_BUILD_USERS = rf"the group {_Q}{_IN}{_Q} specified in {_Q}build-users-group{_Q} does not exist"
# The build users cannot enter the directory Nix builds in (a single-user
# Nix as root builds under its TMPDIR, e.g. libpam-tmpdir's /tmp/user/0 at
# 0700). The runner gives Nix an enterable TMPDIR, so this is what is left
# when the builds go through a daemon whose own TMPDIR is like that. Up to
# 2.30 a build's directory is `nix-build-<drv>-<n>`; 2.34 names it
# `nix-<pid>-<n>`, in a build-dir the build users cannot pass through with
# the sandbox off ("cannot create /d/nix-11-1014727337/f: Permission
# denied"). 2.30 and later also refuse a build-dir under a directory others
# can write: 'Path "/tmp" is world-writable or a symlink. That's not
# allowed for security.' (2.34; 2.30: "Path '/x' or a parent directory is
# world-writable or a symlink.").
_BUILD_DIR = (
    r"nix-build-[^\s'\"/]*\.drv-\d+[^\n]*(permission denied|can't cd)|can't cd to [^\n]*/nix-build-|"
    r"/nix-\d+-\d+(/[^\s'\"]*)?[^\n]*permission denied|is world-writable or a symlink"
)
# A flake URL Nix cannot parse (source.from, flake, or an input the flake
# declares): no retry parses it, so it must stop a persist loop. Checked
# before the fetch fallback, which would call any error in a fetch transient.
_BAD_URL = (
    # 2.8's words, most of them kept by 2.26 and 2.34: "'path:/a b' is not
    # a valid URL", "URL 'github:a' is invalid", "input 'sshfs://x/y' is
    # unsupported" (2.8, 2.26, 2.34), "hash 'zzz' has wrong length for hash
    # type 'sha1'", "invalid SRI hash 'AAAA'" (2.34 adds ", length 3 !=
    # expected length 32"), "hash 'garbage' is not SRI" (2.8, 2.34), "path
    # URL 'path://tmp/x' should not have an authority ('tmp')" and "path URL
    # 'path:/x?x=1' has unsupported parameter 'x'" (2.8, 2.26, 2.34).
    rf"is not a valid URL|\bURL {_Q}{_IN}{_Q} is invalid|input {_Q}{_IN}{_Q} is unsupported|"
    r"has wrong length for hash type|invalid SRI hash|is not SRI|unexpected fragment|"
    r"should not have an authority|has unexpected authority|has unsupported parameter|invalid Git branch/tag name|"
    # "invalid base-16 hash 'zzz…'" (2.8); "invalid base16 hash 'zzz…',
    # length 0 != expected length 20" (2.34).
    r"invalid base-?(16|32|64) hash|"
    # 2.26 and 2.34 say "hash algorithm" where 2.8 says "hash type".
    r"has wrong length for hash algorithm|"
    # A file:// URL that names no file. 2.8: "unable to download
    # 'file:///x.tar.gz': Couldn't read a file:// file (37)" (and "input
    # 'file:///x' is unsupported", above, for a name that is no archive's);
    # 2.26, for either: "Failed to open archive (Source threw exception:
    # error: unable to download 'file:///x': Could not read a file:// file
    # (37) Couldn't open file /x)"; 2.34: "tarball "/x" does not exist." and
    # "tarball "/d" is a directory, not a file." (2.8: unsupported).
    rf"(could not|couldn't) read a file:// file|tarball {_Q}{_IN}{_Q} (does not exist|is a directory, not a file)|"
    # 2.26 and 2.34 open any file:// URL as an archive, where 2.8 takes only
    # a name that ends .zip, .tar, .tgz, .tar.gz, .tar.xz, .tar.bz2 or
    # .tar.zst and refuses any other as unsupported (above). A file of any
    # other name that is no archive is that refusal in their words: "…
    # while fetching the input 'file:///p/x.txt'" then "error: Failed to
    # open archive (Unrecognized archive format)" (2.26, 2.34). A misnamed
    # archive's failure (x.tar.gz) stays a failed fetch, as on 2.8.
    rf"input {_Q}file://{_IN}(?<!\.zip)(?<!\.tar)(?<!\.tgz)(?<!\.tar\.gz)(?<!\.tar\.xz)(?<!\.tar\.bz2)(?<!\.tar\.zst)"
    rf"{_Q}\s*(error:\s*)?failed to open archive \(unrecognized archive format\)|"
    # 2.26 and 2.34 (not 2.8) take a string they cannot parse as a URL for
    # a path relative to the working directory, so the refusal names
    # "<cwd>/github:a" or "<cwd>/path:/tmp/a b": a path component that
    # carries a URL scheme. 2.26: "getting status of '/p/github:a': No such
    # file or directory"; 2.34: "getting status of "/p/github:a": No such
    # file or directory" (also for git+file://tmp/x, read as
    # "/p/git+file:/tmp/x", and for an invalid ref name, ?ref=a..b).
    rf"getting status of {_Q}{_IN}/[a-z][a-z0-9+.-]*:{_IN}{_Q}: no such file or directory"
)
# "building of '/nix/store/…-x.drv!out' from .drv file timed out after 2
# seconds" (2.8; 2.26 writes "^out"); "timed out after 2 seconds" (2.34).
_TIMEOUT = r"timed out after \d+ seconds"
# ssh (under git, for a git+ssh source or input) refusing the far side's
# host key: none known and strict checking on (BatchMode cannot ask), or
# another than known_hosts holds. A person must check and record the key;
# retrying fetches nothing. Checked before the fetch fallback.
_HOST_KEY = r"host key verification failed|remote host identification has changed|no \S+ host key is known for"
# A cache that says no, or a URL that names no store Nix can write: no retry
# changes either. 2.8 and 2.26 word these alike.
_CACHE_REFUSED = (
    r"don't know how to open nix store|does not appear to be a binary cache|unsupported store|"
    r"permission denied|read-only file system|operation not permitted|lacks a valid signature|"
    r"not privileged|is not allowed|HTTP error 40[13]|access denied|host key verification failed|"
    r"permission denied \(publickey"
)
# A builder killed by a signal from outside its own code: SIGKILL (the
# OOM killer, `kill -9`), SIGTERM, SIGINT, SIGHUP (an operator, a shutdown).
# "builder for '/nix/store/…drv' failed due to signal 9 (Killed)" (2.8,
# 2.26); "Reason: builder failed due to signal 9 (Killed)." (2.34). A
# builder that crashes by its own signal (SIGSEGV, SIGABRT) is the build's
# own failure, as an exit code is. Nix's own timeout kills too, but says
# "timed out" (the timeout row, first).
_KILLED = r"failed due to signal (1|2|9|15)\b"
# "builder for '/nix/store/…drv' failed with exit code 3" and "1
# dependencies of derivation '…' failed to build" (2.8, 2.26); "Cannot build
# '/nix/store/…drv'.", then "Reason: builder failed with exit code 3." or
# "Reason: 1 dependency failed." (2.34).
_BUILDER = (
    r"builder for .* failed|build of .* failed|dependencies couldn't be built|"
    r"dependencies of derivation .* failed to build|cannot build|builder failed"
)
_FETCH = (
    r"unable to download|couldn't connect|could not connect|could not resolve|couldn't resolve|"
    r"failed to connect|connection refused|connection timed out|timeout was reached|network is unreachable|"
    r"temporary failure in name resolution|name or service not known|unable to access|"
    # A git fetch that fails: "program 'git' failed with exit code 128"
    # (2.8, which runs git); "resolving Git reference 'main': revspec 'main'
    # not found" (2.26, 2.34: libgit2), "Git repository "/p" does not
    # exist." and "Failed to fetch git repository 'https://…'" (2.34). A
    # flake input that fails so is the same failed fetch on every version.
    rf"program {_Q}git{_Q} failed|resolving git reference|git repository {_Q}{_IN}{_Q} does not exist|"
    r"cannot fetch|failed to fetch|unable to fetch|could not read from remote repository|http error|"
    r"ssh: connect to host|host key verification failed|\bSSL\b|\bTLS\b|connection reset by peer|"
    r"unexpected end-of-file|failure when receiving data from the peer"
)


# A tree Nix copies into the store (a path: source, the flake's own) holds a
# file that is no regular file, directory or symlink: a FIFO, a socket, a
# device node. 2.8 through 2.34: "file '/src/pipe' has an unsupported type"
# (2.34 quotes the path in double quotes). Checked before the fetch fallback,
# which would blame the network for the tree's content.
_UNSUPPORTED_FILE = rf"file {_Q}{_IN}{_Q} has an unsupported type"


@functools.cache
def _pattern(source: str) -> re.Pattern[str]:
    return re.compile(source, re.IGNORECASE)


# -- what a failure comes down to ----------------------------------------------------------


@dataclass(frozen=True)
class Cause:
    """What a failed nix call comes down to: its name, its reason code (and
    so its kind, prepare.fail.REASONS), and the fix an operator is told."""

    category: str
    reason: Reason
    fix: str


HASH_MISMATCH = Cause(
    "hash-mismatch",
    "nix.hash-mismatch",
    "a pinned hash is wrong; retrying fetches the same bytes. Update the hash in the flake "
    "(the 'got:' value above) or the pin that produced it",
)
NO_SPACE = Cause(
    "no-space",
    "nix.no-space",
    "the Nix store's disk is full: free space with `nix-collect-garbage -d` (or `nix-store --gc`) "
    "or grow the disk, then run again",
)
BUILD_DIR_FULL = Cause(
    "build-dir-full",
    "nix.no-space",
    "the disk Nix builds on is full (the build directory, {where}), not the training source: {look}, free "
    "space there or {move} (a build of libtorch and a training binary needs gigabytes), then run again",
)
BUILD_USERS = Cause(
    "build-users",
    "nix.build-users-missing",
    "this is the Nix installation, not the flake: Nix builds as the members of its "
    "build-users-group, and that group does not exist. On Debian/Ubuntu install the package that "
    "creates it and the nixbld users: `sudo apt-get install nix-setup-systemd` (scripts/setup does); "
    "elsewhere create the group and its users as the Nix manual's multi-user installation says",
)
DAEMON_REFUSED = Cause(
    "daemon-refused",
    "nix.daemon-refused",
    "this is the Nix installation, not the flake: the Nix daemon refuses this user. On "
    "Debian/Ubuntu add it to the nix-users group (`sudo usermod -aG nix-users $USER`, then log in "
    "again); elsewhere add it to allowed-users in /etc/nix/nix.conf and restart nix-daemon",
)
SIGNING = Cause(
    "signing",
    "publish.signing-failed",
    "check that --signing-key names a Nix secret key file (`nix key generate-secret --key-name NAME "
    "> FILE`; the boxes trust its public half), and that this user may add signatures to the store (root, or "
    "one of the daemon's trusted-users)",
)
CACHE_REFUSED = Cause(
    "cache-refused",
    "publish.cache-refused",
    "the cache refused the copy, or --to names no store Nix can write: check the URL "
    "(file:///dir, s3://bucket, ssh-ng://user@host, ...) and that this user may write there; publishing "
    "again copies everything",
)
CACHE = Cause(
    "cache",
    "publish.cache-unreachable",
    "the cache could not be reached or the copy broke off: check its server and the network; "
    "publishing again copies only what is missing",
)
STORE_PERMISSION = Cause(
    "store-permission",
    "nix.store-not-writable",
    "this user cannot write the Nix store: run as the store's owner (root on a single-user "
    "install) or through the daemon (NIX_REMOTE=daemon, with nix-daemon running)",
)
BUILD_DIR = Cause(
    "build-dir",
    "nix.build-dir",
    "this is the Nix installation, not the flake or the training source: the directory builds run in (that "
    "of whoever runs them: nix-daemon, or this process for a single-user Nix) is one Nix's build users cannot "
    "enter, or one Nix refuses. Before Nix 2.30 it is the TMPDIR: make it enterable (`chmod 755`, or `chmod "
    "1777` like /tmp), or point TMPDIR at one that is. From 2.30 it is build-dir (/nix/var/nix/builds unless "
    "nix.conf sets one): set it to a directory every user can pass through (`chmod 755`) on a path no other "
    "user can write (not under /tmp)",
)
DAEMON = Cause(
    "daemon",
    "nix.daemon-unreachable",
    "this is the Nix installation, not the flake: the Nix daemon is not reachable. Start it: "
    "`sudo systemctl start nix-daemon.socket nix-daemon` (Debian/Ubuntu: it comes with "
    "`sudo apt-get install nix-setup-systemd`); the next attempt retries",
)
TIMEOUT = Cause(
    "timeout",
    "nix.timeout",
    "the build ran past build_timeout_s (--build-timeout); raise it if the build is legitimately "
    "slow; the next attempt retries",
)
BUILD_KILLED = Cause(
    "build-killed",
    "nix.build-killed",
    "the build of {build} was killed by a signal from outside it, not a fault of the flake or of the training "
    "source: the OOM killer (`journalctl -k | grep -i -e oom -e 'killed process'` says so), or an operator or a "
    "shutdown. The next attempt retries; if the OOM killer keeps ending it, give the box more memory or swap, or "
    "let Nix run fewer builds at once (max-jobs and cores in nix.conf)",
)
BUILDER = Cause(
    "builder",
    "nix.build-failed",
    "the build itself failed: fix the training source and publish again; the next attempt retries",
)
# Not in the table: `explain` tells it from BUILDER by which build failed.
FLAKE_BUILDER = Cause(
    "flake-builder",
    "nix.flake-build-failed",
    "a build the flake itself provides failed, not the training build: fix the flake (or "
    "its toolchain) and point flake (--flake) at the fixed revision; retrying builds the same "
    "thing again. A builder that cannot find its tools (`command not found`, `executing "
    "'/bin/sh'`) relies on host programs that Nix's build sandbox (sandbox = true) hides",
)
BAD_URL = Cause(
    "bad-url",
    "nix.bad-url",
    "Nix cannot parse the URL quoted above (or, for a file:// URL, finds no archive where it points), and "
    "no retry will: correct source.from in [join.source] (--source) or flake (--flake), whichever it is (or the "
    "input the flake declares with it)",
)
HOST_KEY = Cause(
    "host-key",
    "nix.host-key",
    "ssh refused the git host's key (unknown to known_hosts, or another than it holds), and no retry "
    "records one: compare `ssh-keyscan [-p PORT] HOST` (`| ssh-keygen -lf -` for its fingerprints) with the key "
    "the host's operator gives, then add it to the known_hosts file of the user fdl-prepare runs as (root: "
    "/root/.ssh/known_hosts; `ssh-keygen -R HOST` first drops a changed one)",
)
UNSUPPORTED_FILE = Cause(
    "unsupported-file",
    "source.unsupported-file",
    "the tree named above holds a file Nix cannot copy into the store (a FIFO, a socket or a device node: only "
    "regular files, directories and symlinks go into a store path), and every attempt copies the same tree. "
    "Remove it from the training source (`find DIR -not -type f -not -type d -not -type l` lists them; a FIFO "
    "is `-type p`), or keep it out of the published tree, and publish again",
)
FETCH_FAILED = Cause("fetch", "nix.fetch", "check the network, the URL and its ref; the next attempt retries")
UNKNOWN = Cause("unknown", "nix.unknown", "the next attempt retries")
EVALUATION_FAILED = Cause(
    "evaluation", "nix.evaluation", "fix the flake, or point `flake` (--flake) at one that evaluates"
)


# -- the table: the first row that matches is the diagnosis ------------------------------------


@dataclass(frozen=True)
class Said:
    """What a failed call said, as the rows read it."""

    phase: str
    # Nix's error records (or, with none, the plain lines).
    errors: str
    # The failed builds' own log lines.
    build_logs: str
    # Plain lines, where git and ssh write the actual cause.
    other: str
    error_records: bool
    builds_started: bool


Match = Callable[[Said], bool]


def _in_errors(pattern: str) -> Match:
    return lambda said: bool(_pattern(pattern).search(said.errors))


def _in_build_logs(pattern: str) -> Match:
    return lambda said: bool(_pattern(pattern).search(said.build_logs))


# A builder's last log lines as Nix quotes them in its error, each after a
# "> " ("last 1 log lines:\n> head: error writing 'standard output': No
# space left on device", 2.8 through a daemon, which sends no log records of
# its own for them).
_QUOTED = re.compile(r"^\s*>", re.MULTILINE)


def _builder_said(pattern: str) -> Match:
    """In what a builder wrote: its log records, or its lines that Nix's
    error quotes."""

    def said_by_builder(said: Said) -> bool:
        quoted = "\n".join(line for line in said.errors.splitlines() if _QUOTED.match(line))
        return bool(_pattern(pattern).search(said.build_logs) or _pattern(pattern).search(quoted))

    return said_by_builder


def _nix_said(pattern: str) -> Match:
    """In Nix's own words: its error records, less the builder's lines they
    quote."""

    def said_by_nix(said: Said) -> bool:
        own = "\n".join(line for line in said.errors.splitlines() if not _QUOTED.match(line))
        return bool(_pattern(pattern).search(own))

    return said_by_nix


def _in_errors_or_other(pattern: str) -> Match:
    return lambda said: bool(_pattern(pattern).search(said.errors) or _pattern(pattern).search(said.other))


def _store_permission(said: Said) -> bool:
    for line in said.errors.splitlines():
        low = line.lower()
        if ("permission denied" in low or "operation not permitted" in low or "read-only file system" in low) and (
            "/nix/" in line or "big-lock" in low or "store" in low
        ):
            return True
    return False


def _not_the_daemon(said: Said) -> bool:
    return not _pattern(_DAEMON).search(said.errors)


@dataclass(frozen=True)
class Row:
    cause: Cause
    when: Match
    # The phases the row applies to; empty: every phase.
    phases: frozenset[str] = frozenset()


# Specific causes first: they can surface in any phase (a full store stops a
# fetch as surely as a build; a URL that does not parse is permanent even in
# a fetch, where any other error is taken for the network's). Then the
# phase decides: an evaluation error is permanent, a failed fetch
# transient, and in a build call an error with no build started is the
# evaluation of the overridden flake (permanent) while an error after one
# is the builder's (transient).
ROWS: tuple[Row, ...] = (
    Row(HASH_MISMATCH, _in_errors(_HASH_MISMATCH)),
    Row(NO_SPACE, _nix_said(_NO_SPACE)),
    # The builder's own disk (the build directory, under TMPDIR or Nix's
    # build-dir) filled up: its log says so, Nix's error only that it failed.
    Row(BUILD_DIR_FULL, _builder_said(_NO_SPACE), frozenset({BUILD})),
    Row(BUILD_USERS, _in_errors(_BUILD_USERS)),
    Row(DAEMON_REFUSED, _in_errors(_DAEMON_REFUSED)),
    # A publish's signing is always the key or the store's rules; its copy
    # is refused (permanent) or the cache's server or the network
    # (transient: publishing again copies what is missing). A daemon that
    # is not there is the daemon's row, below, whatever the call.
    Row(SIGNING, _not_the_daemon, frozenset({SIGN})),
    Row(CACHE_REFUSED, lambda said: _not_the_daemon(said) and _in_errors(_CACHE_REFUSED)(said), frozenset({COPY})),
    Row(CACHE, _not_the_daemon, frozenset({COPY})),
    Row(STORE_PERMISSION, _store_permission),
    Row(BUILD_DIR, lambda said: _in_errors(_BUILD_DIR)(said) or _in_build_logs(_BUILD_DIR)(said)),
    Row(DAEMON, _in_errors(_DAEMON)),
    Row(TIMEOUT, _in_errors(_TIMEOUT)),
    Row(BUILD_KILLED, _nix_said(_KILLED), frozenset({BUILD})),
    Row(
        BUILDER,
        lambda said: _in_errors(_BUILDER)(said) or (said.builds_started and not said.error_records),
        frozenset({BUILD}),
    ),
    Row(BAD_URL, lambda said: said.error_records and _in_errors(_BAD_URL)(said)),
    Row(UNSUPPORTED_FILE, _in_errors(_UNSUPPORTED_FILE)),
    Row(HOST_KEY, _in_errors_or_other(_HOST_KEY)),
    Row(FETCH_FAILED, _in_errors_or_other(_FETCH)),
    # Killed, crashed, or a failure with nothing said: nothing shows it
    # would fail again.
    Row(UNKNOWN, lambda said: not said.error_records),
    Row(FETCH_FAILED, lambda said: True, frozenset({FETCH})),
    Row(BUILDER, lambda said: said.builds_started, frozenset({BUILD})),
    Row(EVALUATION_FAILED, lambda said: True),
)


@dataclass(frozen=True)
class Diagnosis:
    cause: Cause
    detail: str

    @property
    def category(self) -> str:
        return self.cause.category

    @property
    def permanent(self) -> bool:
        return REASONS[self.cause.reason].kind == PERMANENT


def diagnose(phase: str, log: Log, returncode: int | None = None) -> Diagnosis:
    """Why a nix call failed, and whether retrying could help: the first
    row of ROWS for the call's phase that what it said matches."""
    text = log.error_text()
    detail = text.strip() or (
        f"nix exited with status {returncode} and wrote no error" if returncode else "no error text"
    )
    said = Said(
        phase=phase,
        errors=text,
        build_logs="\n".join(line for act in log.builds() for line in act.log),
        other="\n".join(log.other),
        error_records=bool(log.errors),
        builds_started=bool(log.builds()),
    )
    cause = next(row.cause for row in ROWS if (not row.phases or phase in row.phases) and row.when(said))
    return Diagnosis(cause, detail)


def failure(
    diagnosis: Diagnosis,
    doing: str,
    *,
    fix: str | None = None,
    extra: str = "",
    unreachable: Reason = "nix.fetch",
    build_dir: BuildDir = TMP,
    failed_build: str | None = None,
) -> Fail:
    """An operator-facing Fail: what was being done, what Nix said, the fix.

    `fix` is the caller's word for an evaluation error only (it knows which
    setting names the flake); every other cause has one whatever the call,
    and its own fix: an input fetch that fails while the flake is evaluated
    is the network's fault, not the flake's, and says retry.

    `unreachable` is the reason a failed fetch gets: the caller knows
    whether the fetch was the training source's (`source.unreachable`) or an
    input of the flake's (`nix.fetch`)."""
    cause = diagnosis.cause
    detail = _clip(diagnosis.detail)
    # Nix words the same refusal differently across versions (2.26 and 2.34
    # take an unparsable URL for a relative path); the operator and a
    # fleet's log search get the same words from every version.
    said = "Nix refused the URL (it is not a valid URL to Nix): " if cause is BAD_URL else ""
    message = f"{doing} failed: {said}{detail}"
    if extra:
        message += f"\n{extra}"
    chosen = fix if fix and cause is EVALUATION_FAILED else cause.fix
    if cause is BUILD_DIR_FULL:
        chosen = chosen.format(**build_dir.words())
    if cause is BUILD_KILLED:
        chosen = chosen.format(build=failed_build or "a derivation")
    message += f"\nFix: {chosen}"
    reason = unreachable if cause is FETCH_FAILED else cause.reason
    # Nix and git quote URLs as they found them, a flake's own inputs too.
    return Fail(reason, redact(message))


def _clip(text: str, limit: int = 3000) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 20] + "\n... (cut)"


def explain(
    phase: str,
    log: Log,
    returncode: int | None,
    doing: str,
    *,
    fix: str | None = None,
    source_path: str | None = None,
    unreachable: Reason = "nix.fetch",
    build_dir: BuildDir = TMP,
) -> Fail:
    """The Fail for a nix call that exited non-zero: the diagnosis, refined
    with what only the caller knows (which tree is the training source), and
    the lines of the log that name the cause."""
    diagnosis = diagnose(phase, log, returncode)
    extra = ""
    if diagnosis.cause is BUILDER and not _builds_from(log.failed_build(), source_path):
        diagnosis = Diagnosis(FLAKE_BUILDER, diagnosis.detail)
    failed = log.failed_build()
    if diagnosis.cause in (BUILDER, FLAKE_BUILDER, TIMEOUT, BUILD_DIR_FULL, BUILD_KILLED):
        if failed is not None and failed.log:
            extra = f"last lines of the {failed.name} build log:\n  " + "\n  ".join(failed.log)
    elif log.other and log.errors:
        # git and ssh write the actual cause (refused, unknown ref,
        # bad host key) as plain lines; Nix only says git failed.
        extra = "the fetcher said:\n  " + "\n  ".join(list(log.other)[-8:])
    return failure(
        diagnosis,
        doing,
        fix=fix,
        extra=extra,
        unreachable=unreachable,
        build_dir=build_dir,
        failed_build=None if failed is None else failed.name,
    )


# The store name of the training source as the training derivation gets it:
# the fetched tree without its run manifest (nix/contract.nix), copied at
# evaluation, so its store path is not the fetched one.
TRAINING_SOURCE_NAME = "fdl-training-source"


def _builds_from(act: Activity | None, source_path: str | None) -> bool:
    """Whether the failed build is the training source's: its derivation
    names the fetched source tree, or the contract's copy of it without the
    manifest (as `src`, or through a vendoring step that reads it). Anything
    else that failed (libtorch, the flake's toolchain) is the flake's. When
    that cannot be told, the training build is blamed, as before the
    distinction existed: it is the one that changes."""
    if source_path is None:
        return False
    drv = act.fields[0] if act is not None and act.fields else None
    if not isinstance(drv, str) or not drv.endswith(".drv"):
        return True
    try:
        with open(drv, "rb") as handle:
            text = handle.read()
    except OSError:
        return True
    return source_path.encode() in text or f"-{TRAINING_SOURCE_NAME}".encode() in text
