"""The nix wrapper: its shared flags, its version check, its reading of
internal-json, and the classification of failures (each fault triggered for
real where this machine can, against recorded records where it cannot)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from nix_fixtures import MANIFEST, NIX_CONFIG, build, nix_as, require_nix, trainer

from prepare.fail import Fail
from prepare.nix import runner as nix_mod
from prepare.nix.diagnosis import BUILD, EVALUATION, FETCH, diagnose, failure
from prepare.nix.log import Log
from prepare.nix.runner import Nix, parse_nix_version
from prepare.spec import PrepareSpec, SourceSpec


def _record(**fields: object) -> str:
    return "@nix " + json.dumps(fields)


def _error(text: str) -> str:
    return _record(action="msg", level=0, msg=f"\x1b[31;1merror:\x1b[0m {text}", raw_msg=text)


def _fetching(url: str, text: str) -> str:
    """An error as 2.26 and 2.34 word one met while fetching an input: the
    input first, then Nix's own error."""
    return f"\n       \u2026 while fetching the input '{url}'\n\n       error: {text}"


# -- version ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("nix (Nix) 2.8.0\n", (2, 8, 0)),
        ("nix (Nix) 2.18.1", (2, 18, 1)),
        ("nix (Determinate Nix 3.6.2) 2.29.0", (2, 29, 0)),
        ("nix (Lix, like Nix) 2.91.1\nSystem type: x86_64-linux", (2, 91, 1)),
        ("nix (Nix) 2.3", (2, 3, 0)),
        ("garbage", None),
        ("", None),
    ],
)
def test_the_version_is_the_last_number_on_the_first_line(text, want):
    assert parse_nix_version(text) == want


def _shim(tmp_path: Path, body: str) -> str:
    path = tmp_path / "bin" / "nix"
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_nix_older_than_2_8_is_permanent_and_names_the_install(tmp_path):
    old = _shim(tmp_path, 'echo "nix (Nix) 2.3.16"\n')
    with pytest.raises(Fail) as caught:
        Nix(str(tmp_path), program=old).check_version()
    assert caught.value.permanent
    assert "2.3.16" in caught.value.message and "older than 2.8" in caught.value.message
    assert "apt-get install nix-bin" in caught.value.message


def test_nix_not_on_path_is_permanent_and_names_the_install(tmp_path):
    with pytest.raises(Fail) as caught:
        Nix(str(tmp_path), env={"PATH": str(tmp_path / "empty")}).check_version()
    assert caught.value.permanent
    assert "nix is not installed" in caught.value.message
    assert "apt-get install nix-bin" in caught.value.message and "nixos.org" in caught.value.message


def test_the_version_is_asked_once_per_binary_until_the_binary_changes(tmp_path):
    log = tmp_path / "asked"
    shim = _shim(tmp_path, f'echo asked >> {log}\necho "nix (Nix) 2.18.1"\n')
    state = tmp_path / "state"
    state.mkdir()
    for _ in range(3):
        nix_mod._VERSIONS.clear()  # as a fresh process would start
        assert Nix(str(state), program=shim).check_version() == (2, 18, 1)
    assert log.read_text().splitlines() == ["asked"]
    # An upgrade replaces the binary: the cached answer no longer applies.
    Path(shim).write_text(Path(shim).read_text().replace("2.18.1", "2.24.9"))
    nix_mod._VERSIONS.clear()
    assert Nix(str(state), program=shim).check_version() == (2, 24, 9)
    assert len(log.read_text().splitlines()) == 2


def test_the_installed_nix_passes_the_version_check(tmp_path):
    require_nix()
    assert Nix(str(tmp_path)).check_version() >= (2, 8, 0)


# -- the shared flags -----------------------------------------------------------------


def test_every_nix_call_carries_the_shared_flags_and_never_impure(nix_env, test_flake, git_source, tmp_path):
    """A logging `nix` shim in front of the real one records every argv of a
    full build."""
    real = shutil.which("nix")
    calls = tmp_path / "calls.jsonl"
    shim = _shim(
        tmp_path,
        f"""python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' "$@" >> {calls}
exec {real} "$@"
""",
    )
    state = tmp_path / "state"
    src = git_source(trainer())
    spec = PrepareSpec(
        source=SourceSpec(from_=src.url), libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=str(state)
    )
    build(spec, [], nix_program=shim)
    argvs = [json.loads(line) for line in calls.read_text().splitlines()]
    # Before the first call that may build, where builds run is asked, read
    # only: `config show` (`show-config` on 2.8, which has no `config`).
    probes = [argv for argv in argvs if "config" in argv or "show-config" in argv]
    assert probes and all(
        argv[-3:] == ["config", "show", "--json"] or argv[-2:] == ["show-config", "--json"] for argv in probes
    )
    assert argvs.index(probes[-1]) < next(i for i, argv in enumerate(argvs) if "eval" in argv)
    argvs = [argv for argv in argvs if argv not in probes]
    subcommands = [next(a for a in argv if a in ("eval", "flake", "build", "--version")) for argv in argvs]
    # The flake resolved (no evaluation), its variants evaluated, the source
    # fetched, the build.
    assert subcommands == ["--version", "flake", "eval", "flake", "build"]
    assert argvs[1][argvs[1].index("flake") + 1] == "metadata" and "--no-write-lock-file" in argvs[1]
    registry = str(state / "flake-registry.json")
    assert json.loads(Path(registry).read_text()) == {"flakes": [], "version": 2}
    for argv in argvs[1:]:
        joined = " ".join(argv)
        assert argv[:2] == ["--extra-experimental-features", "nix-command flakes"]
        assert "--log-format internal-json" in joined
        assert f"--option flake-registry {registry}" in joined
        assert "--option accept-flake-config false" in joined
        assert "--impure" not in argv and "--accept-flake-config" not in argv
        assert "--json" in argv
    for argv in (argvs[2], argvs[4]):
        assert "--no-write-lock-file" in argv and "--no-eval-cache" in argv
    build_argv = argvs[4]
    i = build_argv.index("source")
    assert build_argv[i - 1] == "--override-input" and build_argv[i + 1].startswith("path:/nix/store/")
    assert "narHash=sha256-" in build_argv[i + 1]
    j = build_argv.index("recipe")
    assert build_argv[j + 1] == f"path:{state / 'recipe'}"
    # Options end at `--`: every installable, URL and store path after it,
    # and nothing else.
    for argv in argvs[1:]:
        assert argv.count("--") == 1, argv
        after = argv[argv.index("--") + 1 :]
        assert after and not any(a.startswith("-") for a in after), argv
    assert argvs[1][-1] == test_flake and argvs[3][-1] == src.url


def test_a_value_that_looks_like_an_option_reaches_nix_as_an_installable_not_an_option(nix_env, tmp_path):
    # Without `--`, nix 2.8 reads `-f<file>` as its --file option and
    # evaluates the file impurely; after `--` it is a (missing) flake.
    planted = tmp_path / "planted.nix"
    planted.write_text('builtins.trace "PLANTED-FILE-EVALUATED" 1\n')
    with pytest.raises(Fail) as caught:
        Nix(str(tmp_path)).eval_json(f"-f{planted}")
    assert "PLANTED-FILE-EVALUATED" not in caught.value.message


def test_a_registry_name_fails_fast_without_downloading_the_global_registry(nix_env, tmp_path):
    start = time.monotonic()
    with pytest.raises(Fail) as caught:
        Nix(str(tmp_path)).eval_json("nixpkgs#hello")
    assert time.monotonic() - start < 10
    assert caught.value.permanent
    assert "cannot find flake 'flake:nixpkgs' in the flake registries" in caught.value.message
    assert "github.com" not in caught.value.message


# -- reading internal-json ---------------------------------------------------------------

BUILD_OK = [
    _record(action="start", id=1, level=0, text="", type=104),
    _record(
        action="start",
        id=2,
        level=3,
        type=105,
        text="building '/nix/store/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-train.drv'",
        fields=["/nix/store/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-train.drv", "", 1, 1],
    ),
    _record(action="result", id=1, type=105, fields=[0, 1, 1, 0]),
    _record(action="result", id=2, type=104, fields=["buildPhase"]),
    _record(action="result", id=2, type=101, fields=["compiling"]),
    _record(action="result", id=1, type=105, fields=[1, 1, 0, 0]),
    _record(action="stop", id=2),
    _record(action="stop", id=1),
]


def test_a_finished_build_reads_as_built_with_its_phase():
    events: list[dict] = []
    log = Log(events.append)
    for line in BUILD_OK:
        log.feed(line)
    assert [e["type"] for e in events] == ["build-start", "build-phase", "build-done"]
    assert events[0]["name"] == "train"
    assert events[1]["phase"] == "buildPhase"
    assert events[2]["outcome"] == "built" and events[2]["ok"]
    assert list(log.builds()[0].log) == ["compiling"]


def test_a_failed_build_reads_as_failed_before_the_error_record_arrives():
    lines = BUILD_OK[:5] + [
        _record(action="result", id=1, type=105, fields=[0, 0, 0, 1]),
        _record(action="stop", id=2),
        _record(action="stop", id=1),
        _error("builder for '/nix/store/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-train.drv' failed with exit code 3"),
    ]
    events: list[dict] = []
    log = Log(events.append)
    for line in lines:
        log.feed(line)
    assert events[-1]["outcome"] == "failed"
    assert log.failed_build().name == "train"


def test_an_interrupted_build_reads_as_stopped():
    events: list[dict] = []
    log = Log(events.append)
    for line in BUILD_OK[:5] + [_record(action="stop", id=2)]:
        log.feed(line)
    assert events[-1]["outcome"] == "stopped"


def test_downloads_count_their_bytes_and_plain_lines_are_kept():
    events: list[dict] = []
    log = Log(events.append)
    for line in [
        _record(
            action="start",
            id=7,
            level=4,
            type=101,
            text="downloading 'https://c/x.nar.xz'",
            fields=["https://c/x.nar.xz"],
        ),
        _record(action="result", id=7, type=105, fields=[512, 2048, 0, 0]),
        _record(action="result", id=7, type=105, fields=[2048, 2048, 0, 0]),
        _record(action="stop", id=7),
        "fatal: unable to access 'http://127.0.0.1:9/x/': Failed to connect",
        "@nix {not json",
    ]:
        log.feed(line)
    assert log.bytes_downloaded == 2048
    assert [e["type"] for e in events] == ["download-start", "download-progress", "download-progress", "download-done"]
    assert events[-1]["bytes"] == 2048
    assert "fatal: unable to access" in log.other[0]


def test_a_display_that_raises_does_not_break_the_log():
    def broken(event: dict) -> None:
        raise RuntimeError("display gone")

    log = Log(broken)
    for line in BUILD_OK:
        log.feed(line)
    assert log.builds()[0].outcome == "built"


# -- classification from recorded records -------------------------------------------------

RECORDED = [
    # (phase, error text, category, permanent)
    (EVALUATION, "syntax error, unexpected ';'", "evaluation", True),
    (EVALUATION, "flake 'path:/x' does not provide attribute 'legacyPackages.x86_64-linux.fdl'", "evaluation", True),
    (EVALUATION, "assertion '(cuda != null)' failed", "evaluation", True),
    (
        EVALUATION,
        "unable to download 'https://github.com/NixOS/nixpkgs/archive/x.tar.gz': Couldn't resolve host name (6)",
        "fetch",
        False,
    ),
    (FETCH, "program 'git' failed with exit code 128", "fetch", False),
    (FETCH, "getting status of '/srv/train': No such file or directory", "fetch", False),
    (FETCH, "writing to file: No space left on device", "no-space", True),
    (BUILD, "builder for '/nix/store/x-train.drv' failed with exit code 3", "builder", False),
    (BUILD, "Cannot build '/nix/store/x-train.drv'.\nReason: builder failed with exit code 3.", "builder", False),
    (BUILD, "building of '/nix/store/x-train.drv!out' from .drv file timed out after 2 seconds", "timeout", False),
    (
        BUILD,
        "hash mismatch in fixed-output derivation '/nix/store/x.drv':\n specified: sha256-A\n got: sha256-B",
        "hash-mismatch",
        True,
    ),
    (BUILD, "cannot connect to socket at '/nix/var/nix/daemon-socket/socket': Connection refused", "daemon", False),
    (BUILD, "getting status of /nix/var/nix/daemon-socket/socket: Permission denied", "store-permission", True),
    (
        BUILD,
        "could not set permissions on '/nix/var/nix/profiles/per-user' to 755: Operation not permitted",
        "store-permission",
        True,
    ),
    (BUILD, "opening lock file '/nix/var/nix/db/big-lock': Permission denied", "store-permission", True),
    (BUILD, "fdl-prepare flake: recipe.json has no `bin`", "evaluation", True),
    # Nix's own installation (2.8 and 2.26 word these the same)
    (BUILD, "the group 'nixbld' specified in 'build-users-group' does not exist", "build-users", True),
    (
        EVALUATION,
        "cannot connect to socket at '/nix/var/nix/daemon-socket/socket': Permission denied",
        "daemon-refused",
        True,
    ),
    (
        BUILD,
        "cannot open connection to remote store 'daemon': error: user 'ci' is not allowed to connect to the Nix daemon",
        "daemon-refused",
        True,
    ),
    (BUILD, "cp: cannot stat '/tmp/user/0/nix-build-train.drv-0/source': Permission denied", "build-dir", True),
    # A path that merely does not exist is not a URL Nix refused.
    (FETCH, "getting status of '/srv/train/data': No such file or directory", "fetch", False),
    (FETCH, _fetching("path:/srv/train/data", "path '//srv/train/data' does not exist"), "fetch", False),  # 2.26, 2.34
    # 2.34's words (seen on 2.34.8), where they are its own
    (
        EVALUATION,
        "setting journal mode: database or disk is full, database or disk is full (in "
        "'/srv/tiny/nix/var/nix/db/db.sqlite')",
        "no-space",
        True,
    ),
    (FETCH, _fetching("path:/srv/big", "write of 24576 bytes: No space left on device"), "no-space", True),
    (BUILD, "Cannot build '/nix/store/x-dep.drv'.\n       Reason: 1 dependency failed.", "builder", False),
    (BUILD, "timed out after 2 seconds", "timeout", False),
    (BUILD, 'opening lock file "/nix/var/nix/db/big-lock": Permission denied', "store-permission", True),
    # A build-dir others can write (2.34; 2.30 adds "or a parent directory"),
    # and one the build users cannot pass through with the sandbox off.
    (BUILD, 'Path "/tmp" is world-writable or a symlink. That\'s not allowed for security.', "build-dir", True),
    (BUILD, "sh: 1: cannot create /srv/builds/nix-11-1014727337/f: Permission denied", "build-dir", True),
    (
        FETCH,
        _fetching("git+file:///srv/nowhere?ref=main", 'Git repository "/srv/nowhere" does not exist.'),
        "fetch",
        False,
    ),
    (
        FETCH,
        _fetching("https://git.example/x.git?ref=main", "Failed to fetch git repository 'https://git.example/x.git'"),
        "fetch",
        False,
    ),
    # A flake's own input that cannot be fetched is a failed fetch on every
    # version: 2.8 says "program 'git' failed", 2.26 and 2.34 (libgit2) name
    # the ref or the repository.
    (EVALUATION, "program 'git' failed with exit code 128", "fetch", False),
    (EVALUATION, "resolving Git reference 'nope': revspec 'nope' not found (libgit2 error code = 4)", "fetch", False),
    (EVALUATION, 'Git repository "/srv/nowhere" does not exist.', "fetch", False),
    # An archive that is not one, named like one: a failed fetch, as on 2.8
    # ("failed to open archive: Unrecognized archive format").
    (FETCH, "failed to open archive: Unrecognized archive format", "fetch", False),
    (FETCH, _fetching("file:///srv/x.tar.gz", "Failed to open archive (Unrecognized archive format)"), "fetch", False),
    # The daemon refusing this user, in either quotes or none
    (
        EVALUATION,
        'cannot connect to socket at "/nix/var/nix/daemon-socket/socket": Permission denied',
        "daemon-refused",
        True,
    ),
    (EVALUATION, "cannot connect to socket at /srv/socket: Permission denied", "daemon-refused", True),
    (BUILD, 'the group "nixbld" specified in "build-users-group" does not exist', "build-users", True),
    # A FIFO (socket, device node) in a tree copied to the store: 2.8 and
    # 2.26 quote the path in single quotes, 2.34 in double.
    (FETCH, "file '/src/pipe' has an unsupported type", "unsupported-file", True),
    (FETCH, 'file "/src/pipe" has an unsupported type', "unsupported-file", True),
    (EVALUATION, "file '/flake/sock' has an unsupported type", "unsupported-file", True),
    # A builder killed from outside (the OOM killer, an operator) is no
    # fault of the build; one that crashes by its own signal is.
    (BUILD, "builder for '/nix/store/a-x.drv' failed due to signal 9 (Killed)", "build-killed", False),
    (
        BUILD,
        "Cannot build '/nix/store/a-x.drv'.\nReason: builder failed due to signal 15 (Terminated).",
        "build-killed",
        False,
    ),
    (BUILD, "builder for '/nix/store/a-x.drv' failed due to signal 11 (Segmentation fault)", "builder", False),
]


@pytest.mark.parametrize(("phase", "text", "category", "permanent"), RECORDED)
def test_failures_are_classified_by_phase_and_error_record(phase, text, category, permanent):
    log = Log()
    log.feed(_error(text))
    got = diagnose(phase, log, returncode=1)
    assert (got.category, got.permanent) == (category, permanent)


def test_the_exit_code_alone_never_decides():
    # The same builder failure reads the same whether nix said 1, 100 or 101.
    for code in (1, 100, 101, 102):
        log = Log()
        log.feed(_error("builder for '/nix/store/x-train.drv' failed with exit code 3"))
        assert diagnose(BUILD, log, returncode=code).category == "builder"


def test_a_failure_with_no_error_record_is_transient():
    assert not diagnose(EVALUATION, Log(), returncode=137).permanent


# -- classification, triggered for real -----------------------------------------------------


def test_an_unreachable_daemon_socket_is_transient(nix_env, test_flake, tmp_path, monkeypatch):
    sock_path = tmp_path / "daemon.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(sock_path))  # bound, never listening: connections are refused
    try:
        monkeypatch.setenv("NIX_CONFIG", NIX_CONFIG + f"store = unix://{sock_path}\n")
        with pytest.raises(Fail) as caught:
            build(PrepareSpec(libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=str(tmp_path / "s")), [])
    finally:
        dead.close()
    assert not caught.value.permanent
    assert "cannot connect to socket" in caught.value.message
    assert "nix-daemon" in caught.value.message
    # Named as the installation's, with how Debian installs the daemon.
    fix = caught.value.message.split("Fix:")[1]
    assert "Nix installation" in fix and "nix-setup-systemd" in fix and "systemctl start nix-daemon" in fix


def _root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (a tmpfs mount / switching to another user)")


@pytest.fixture
def tiny_store(tmp_path):
    _root_only()
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mountpoint)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


@pytest.mark.parametrize("reserved", ["as-configured", "none"])
def test_a_full_store_is_permanent_whichever_step_finds_it_full(
    nix_env, test_flake, tiny_store, tmp_path, monkeypatch, reserved
):
    """2.34 keeps gc-reserved-space (8 MiB unless set) in the store's db/,
    so a 2 MiB store is full at its first call, the flake's evaluation
    ("database or disk is full"); with none reserved, and on 2.8 and 2.26
    either way, the 4 MiB source fills it while it is fetched ("No space
    left on device"). Either step gives the same Fail."""
    big = tmp_path / "big"
    big.mkdir()
    (big / "weights.bin").write_bytes(os.urandom(4 << 20))
    (big / MANIFEST).write_text("bin: x\n")
    config = NIX_CONFIG + f"store = {tiny_store}\n" + ("gc-reserved-space = 0\n" if reserved == "none" else "")
    monkeypatch.setenv("NIX_CONFIG", config)
    spec = PrepareSpec(
        source=SourceSpec(from_=f"path:{big}"),
        libtorch="cpu",
        cpu_only=True,
        flake=test_flake,
        state_dir=str(tmp_path / "state"),
    )
    with pytest.raises(Fail) as caught:
        build(spec, [])
    assert (caught.value.reason, caught.value.permanent) == ("nix.no-space", True), caught.value.message
    assert "nix-collect-garbage" in caught.value.message.split("Fix:")[1]


def test_a_store_this_user_cannot_write_is_permanent(nix_env, test_flake, tmp_path):
    _root_only()
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    # Everything the unprivileged nix reads must be outside root's 0700
    # pytest directory.
    shared = Path(tempfile.mkdtemp(prefix="fdl-nobody-"))
    try:
        shared.chmod(0o755)
        flake = shared / "flake"
        shutil.copytree(test_flake.removeprefix("path:"), flake)
        shim = nix_as(65534, shared)
        state = shared / "state"
        state.mkdir()
        # The build users a root Nix has (Nix leaves build-users-group empty
        # for any other user, and fdl-prepare, root here, would refuse it).
        env = {**os.environ, "NIX_REMOTE": "local", "NIX_CONFIG": f"{NIX_CONFIG}build-users-group = nixbld\n"}
        runner = Nix(str(state), program=str(shim), env=env)
        with pytest.raises(Fail) as caught:
            runner.eval_json(f"path:{flake}#legacyPackages.{nix_mod.system()}.fdl.contract")
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert caught.value.permanent
    assert "Operation not permitted" in caught.value.message or "Permission denied" in caught.value.message
    assert "store's owner" in caught.value.message


# -- a URL that does not parse, a cut connection, the caller's fix ------------------------

# Current Nix appends curl's own words to a failed download; Nix 2.8 does
# not, so these are recorded from the format string in filetransfer.cc.
CUT = [
    (
        FETCH,
        "unable to download 'https://git.example/src.tar.gz': Failure when receiving data from the peer (56) "
        "Recv failure: Connection reset by peer",
    ),
    (
        EVALUATION,
        "unable to download 'https://api.github.com/repos/NixOS/nixpkgs/tarball/x': Failure when receiving "
        "data from the peer (56) Recv failure: Connection reset by peer",
    ),
    (FETCH, "unexpected end-of-file"),
]


@pytest.mark.parametrize(("phase", "text"), CUT)
def test_a_download_cut_by_the_peer_is_a_fetch_not_a_dead_daemon(phase, text):
    log = Log()
    log.feed(_error(text))
    got = diagnose(phase, log, returncode=1)
    assert (got.category, got.permanent) == ("fetch", False)
    fail = failure(got, "fetching", fix="point flake (--flake) at a flake that follows the contract")
    assert "nix-daemon" not in fail.message
    assert "retries" in fail.message.split("Fix:")[1] and "point flake" not in fail.message


def test_a_daemon_that_drops_the_connection_is_still_the_daemon(nix_env, test_flake, tmp_path, monkeypatch):
    """The daemon anchor must still catch a daemon that accepts and resets:
    Nix 2.8 says "cannot open connection to remote store 'unix://…':
    reading from file: Connection reset by peer"."""
    import struct
    import threading

    sock_path = tmp_path / "daemon.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock_path))
    listener.listen()

    def reset_all() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=reset_all, daemon=True).start()
    try:
        monkeypatch.setenv("NIX_CONFIG", NIX_CONFIG + f"store = unix://{sock_path}\n")
        with pytest.raises(Fail) as caught:
            build(PrepareSpec(libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=str(tmp_path / "s")), [])
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    assert not caught.value.permanent
    assert "cannot open connection to remote store" in caught.value.message
    assert "nix-daemon" in caught.value.message.split("Fix:")[1]


def test_a_source_download_reset_by_the_peer_is_a_transient_fetch(nix_env, test_flake, tmp_path, reset_server):
    url = f"http://127.0.0.1:{reset_server}/src.tar.gz"
    spec = PrepareSpec(
        source=SourceSpec(from_=url), libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=str(tmp_path / "state")
    )
    with pytest.raises(Fail) as caught:
        build(spec, [])
    assert not caught.value.permanent
    assert url in caught.value.message and "source.from" in caught.value.message
    fix = caught.value.message.split("Fix:")[1]
    assert "retries" in fix and "nix-daemon" not in fix


def test_an_input_fetch_failing_while_the_flake_is_evaluated_says_retry_not_fix_the_flake(
    nix_env, make_flake, tmp_path, reset_server
):
    flake = make_flake(
        flake_nix=f"""{{
  inputs.remote = {{ url = "http://127.0.0.1:{reset_server}/remote.tar.gz"; flake = false; }};
  outputs = {{ self, remote }}: {{
    legacyPackages.x86_64-linux.fdl = {{ contract = 2; variants = {{ }}; }};
    legacyPackages.aarch64-linux.fdl = {{ contract = 2; variants = {{ }}; }};
  }};
}}
"""
    )
    Path(flake.removeprefix("path:"), "flake.lock").unlink()
    with pytest.raises(Fail) as caught:
        build(PrepareSpec(libtorch="cpu", cpu_only=True, flake=flake, state_dir=str(tmp_path / "state")), [])
    assert not caught.value.permanent
    assert "unable to download" in caught.value.message
    fix = caught.value.message.split("Fix:")[1]
    assert "retries" in fix
    assert "point flake" not in fix and "contract" not in fix and "nix-daemon" not in fix


# What Nix says for each, by version where they differ (seen on 2.8.0,
# 2.26.3 and 2.34.8). {tree} is a directory holding a manifest, {tmp} the
# test's own directory, which holds notes.txt, a file that is no archive.
UNPARSABLE_SOURCES = {
    # `file://` is floDl's directory on the box (tests/test_sources.py), no
    # longer Nix's tarball: it never reaches Nix as a URL.
    "scheme-unknown": ("sshfs://x/y", ("is unsupported",)),
    "rev-too-short": ("path:{tree}?rev=zzz", ("has wrong length",)),
    "nar-hash-not-sri": ("path:{tree}?narHash=sha256-AAAA", ("invalid SRI hash",)),
    # A forge URL without an owner/repo pair: 2.8 "URL 'github:a?ref=main' is
    # invalid"; 2.26 and 2.34 read it as a relative path, "getting status of
    # '<cwd>/github:a'" (2.34 in double quotes).
    "github-no-repo": ("github:a?ref=main", ("is invalid", "/github:a")),
    "gitlab-no-repo": ("gitlab:a?ref=main", ("is invalid", "/gitlab:a")),
}


def _unparsable_source(tmp_path: Path, case: str) -> tuple[str, tuple[str, ...]]:
    tree = tmp_path / "tree"
    tree.mkdir(exist_ok=True)
    (tree / MANIFEST).write_text("bin: train\n")
    (tmp_path / "notes.txt").write_text("not an archive\n")
    url, said = UNPARSABLE_SOURCES[case]
    return url.format(tree=tree, tmp=tmp_path), said


@pytest.mark.parametrize("case", sorted(UNPARSABLE_SOURCES))
def test_a_source_url_nix_cannot_parse_is_permanent_and_names_source_from(nix_env, test_flake, tmp_path, case):
    url, said = _unparsable_source(tmp_path, case)
    events: list[dict] = []
    spec = PrepareSpec(
        source=SourceSpec(from_=url), libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=str(tmp_path / "state")
    )
    with pytest.raises(Fail) as caught:
        build(spec, [], progress=events.append)
    assert (caught.value.reason, caught.value.permanent) == ("nix.bad-url", True), caught.value.message
    assert any(words in caught.value.message for words in said) and url in caught.value.message
    assert "is not a valid URL" in caught.value.message
    fix = caught.value.message.split("Fix:")[1]
    assert "source.from" in fix and "--source" in fix and "--flake" in fix
    assert "retries" not in fix
    assert not any(e["type"] == "build-start" for e in events)


@pytest.mark.parametrize("flake", ["github:a", "gitlab:a", "git+file://tmp/x"])
def test_a_flake_url_nix_cannot_parse_is_permanent_and_says_to_correct_it(nix_env, tmp_path, flake):
    """2.26 and 2.34 take github:a for a relative path (2.34 in double
    quotes), 2.8 calls it invalid: the same refusal, not an evaluation error
    that sends the operator to the contract."""
    with pytest.raises(Fail) as caught:
        build(PrepareSpec(libtorch="cpu", cpu_only=True, flake=flake, state_dir=str(tmp_path / "state")), [])
    assert (caught.value.reason, caught.value.permanent) == ("nix.bad-url", True), caught.value.message
    assert flake in caught.value.message and "is not a valid URL" in caught.value.message
    fix = caught.value.message.split("Fix:")[1]
    assert "flake (--flake)" in fix and "contract" not in fix and "retries" not in fix


def test_nix_refusing_a_url_with_a_space_is_permanent(nix_env, tmp_path):
    """check_source_url refuses whitespace first; this is what Nix itself
    says when such a URL reaches it anyway (a caller other than build)."""
    (tmp_path / "a src").mkdir()
    with pytest.raises(Fail) as caught:
        Nix(str(tmp_path)).prefetch(f"path:{tmp_path}/a src")
    assert caught.value.permanent
    assert "is not a valid URL" in caught.value.message
    assert "--source" in caught.value.message.split("Fix:")[1]


@pytest.mark.parametrize(
    "text",
    [
        "'path:/tmp/a src' is not a valid URL",
        "input 'sshfs://x/y' is unsupported",
        "hash 'zzz' has wrong length for hash type 'sha1'",
        "invalid SRI hash 'AAAA'",
        "hash 'garbage' is not SRI",
        "invalid base-16 hash 'zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz'",
        "URL 'github:owner' is invalid",
        "path URL 'path://tmp/x' should not have an authority ('tmp')",
        "file:// URL 'git+file://tmp/x?ref=main' has unexpected authority 'tmp'",
        "path URL 'path:/x?x=1' has unsupported parameter 'x'",
        "invalid Git branch/tag name 'ma in'",
        "unexpected fragment 'x' in flake reference 'path:/x#x'",
        "unable to download 'file:///srv/x.tar.gz': Couldn't read a file:// file (37)",
        # 2.26's words for the same refusals
        "hash 'zzz' has wrong length for hash algorithm 'sha1'",
        "getting status of '/srv/cwd/github:a': No such file or directory",
        "getting status of '/srv/cwd/path:/tmp/a src': No such file or directory",
        "getting status of '/srv/cwd/git+file:/tmp/x': No such file or directory",
        "Failed to open archive (Source threw exception: error: unable to download 'file:///x': Could not read a "
        "file:// file (37) Couldn't open file /x)",
        # 2.34's (seen on 2.34.8): paths in double quotes, a fetch's error
        # under the input it was fetching
        'getting status of "/srv/cwd/github:a": No such file or directory',
        'getting status of "/srv/cwd/gitlab:a": No such file or directory',
        'getting status of "/srv/cwd/path:/tmp/a src": No such file or directory',
        'getting status of "/srv/cwd/git+file:/srv/repo": No such file or directory',
        _fetching("file:///x", 'tarball "/x" does not exist.'),
        _fetching("file:///srv/missing.tar.gz", 'tarball "/srv/missing.tar.gz" does not exist.'),
        _fetching("file:///srv/d", 'tarball "/srv/d" is a directory, not a file.'),
        _fetching("path:/srv/t?narHash=sha256-AAAA", "invalid SRI hash 'AAAA', length 3 != expected length 32"),
        "invalid base16 hash 'zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz', length 0 != expected length 20",
        # a file:// name 2.8 refuses as no archive's ("unsupported"), that
        # 2.26 and 2.34 open and find no archive in
        _fetching("file:///srv/notes.txt", "Failed to open archive (Unrecognized archive format)"),
        # the same, in quotes no version has used yet, or none
        "getting status of /srv/cwd/github:a: No such file or directory",
        'URL "github:owner" is invalid',
        "input sshfs://x/y is unsupported",
    ],
)
def test_every_nix_refusal_to_parse_a_url_is_permanent_in_any_phase(text):
    for phase in (FETCH, EVALUATION, BUILD):
        log = Log()
        log.feed(_error(text))
        got = diagnose(phase, log, returncode=1)
        assert (got.category, got.permanent) == ("bad-url", True), phase


@pytest.mark.nix
def test_a_git_ssh_source_whose_host_key_ssh_does_not_know_is_permanent_naming_ssh_keyscan(
    nix_env, test_flake, tmp_path, git_source, sshd, monkeypatch
):
    # The training source over git+ssh, from the loopback sshd: ssh (under
    # git, under nix) with strict checking and an empty known_hosts.
    src = git_source(trainer())
    bare = tmp_path / "train.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(src.path), str(bare)], check=True)
    known = tmp_path / "known_hosts"
    known.write_text("")
    ssh = f"ssh -i {sshd.user_key} -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=yes"
    monkeypatch.setenv("GIT_SSH_COMMAND", f"{ssh} -o UserKnownHostsFile={known} -o GlobalKnownHostsFile=/dev/null")
    url = f"git+ssh://{sshd.user}@{sshd.host}:{sshd.port}{bare}?ref=main"
    spec = PrepareSpec(
        source=SourceSpec(from_=url), libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=str(tmp_path / "s")
    )
    with pytest.raises(Fail) as caught:
        build(spec, [])
    fail = caught.value
    assert fail.permanent and fail.reason == "nix.host-key", fail.message
    assert "Host key verification failed" in fail.message
    assert "ssh-keyscan" in fail.message and "known_hosts" in fail.message
    # With the key recorded, the same source fetches.
    scan = subprocess.run(["ssh-keyscan", "-p", str(sshd.port), sshd.host], capture_output=True, text=True)
    known.write_text(scan.stdout)
    assert build(spec, []).bin is not None


def test_a_nix_command_line_the_kernel_refuses_is_permanent_naming_the_limits_not_nix_missing(tmp_path):
    require_nix()
    runner = Nix(str(tmp_path))
    with pytest.raises(Fail) as caught:
        runner.eval_json("path:/" + "x" * 200_000 + "#x")
    fail = caught.value
    assert fail.permanent and fail.reason == "config.invalid"
    assert "E2BIG" in fail.message and "4 KiB a URL" in fail.message and "not installed" not in fail.message


def test_a_fifo_in_the_training_source_is_permanent_naming_the_file_not_the_network(nix_env, test_flake, tmp_path):
    """Nix copies a path: tree into the store and refuses a file that is no
    regular file, directory or symlink ("file '/src/pipe' has an unsupported
    type"): the tree is wrong, and no retry or network fixes it."""
    tree = tmp_path / "src"
    tree.mkdir()
    for name, text in trainer().items():
        if text is not None:
            (tree / name).write_text(text)
    os.mkfifo(tree / "pipe")
    spec = PrepareSpec(
        source=SourceSpec(from_=f"path:{tree}"),
        libtorch="cpu",
        cpu_only=True,
        flake=test_flake,
        state_dir=str(tmp_path / "state"),
    )
    with pytest.raises(Fail) as caught:
        build(spec, [])
    assert (caught.value.reason, caught.value.permanent) == ("source.unsupported-file", True), caught.value.message
    assert str(tree / "pipe") in caught.value.message
    fix = caught.value.message.split("Fix:")[1]
    assert "network" not in fix and "retries" not in fix
    assert "-type p" in fix or "FIFO" in fix
