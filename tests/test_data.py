"""Step 2, the dataset source root: the grammar, the sshfs command, and real mounts.

The mounts are real: a real sshd on 127.0.0.1 (tests/sshd_fixtures.py), real
sshfs, real FUSE, real kernel tmpfs mounts. Faults are produced the way
production meets them: a closed port, a stopped server, a key the server
does not know, a server that accepts TCP and never speaks, a server frozen
mid-mount with SIGSTOP, an sshfs process killed under its mount.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import prepare.plan
from prepare import config
from prepare.data import listing, mount
from prepare.data import root as data
from prepare.data import url as sshfs_url
from prepare.data.url import Source, parse_source, sshfs_argv
from prepare.fail import Fail
from prepare.host import locks, mounts
from prepare.plan import plan
from prepare.spec import DataSpec, PrepareSpec, SshSpec

pytestmark = pytest.mark.usefixtures("forget_mount_locks")


def _spec(data_path: str | None = None, data_source: str | None = None, **kw: object) -> PrepareSpec:
    return PrepareSpec(data=DataSpec(data_path=data_path, data_source=data_source), cpu_only=True, **kw)  # type: ignore[arg-type]


def ensure(spec: PrepareSpec, notes: list[str]) -> str | None:
    """Step 2 on `spec`'s plan, as the pipeline runs it."""
    return data.ensure(plan(spec).data, notes)


def _fail(spec: PrepareSpec, notes: list[str] | None = None) -> Fail:
    with pytest.raises(Fail) as caught:
        ensure(spec, notes if notes is not None else [])
    return caught.value


# -- the grammar ---------------------------------------------------------------

BROKEN_SOURCES = [
    ("/flodl/data", "a bare absolute path"),
    ("./data", "a bare relative path"),
    ("~/data", "a bare home path"),
    ("exa:/flodl/data", "an scp spelling without the scheme"),
    ("data", "a bare word"),
    ("", "empty"),
    ("   ", "blank"),
    ("smb://server/share", "an unknown scheme"),
    ("nfs://exa/flodl/data", "a scheme another tool mounts"),
    ("ssh://exa/flodl/data", "ssh is not sshfs"),
    ("://exa/flodl/data", "an empty scheme"),
    ("sshfs://exa", "no path"),
    ("sshfs://exa:2222", "a port and no path"),
    ("sshfs://user@exa:", "an scp colon and no path"),
    ("sshfs://exa:data", "an scp relative path"),
    ("sshfs://exa:banana/data", "a port that is not a number"),
    ("sshfs://exa:22x/data", "a port with a letter in it"),
    ("sshfs://exa:-1/data", "a negative port"),
    ("sshfs://exa:0/data", "port zero"),
    ("sshfs://exa:65536/data", "a port past 65535"),
    ("sshfs://exa:\u00b2/data", "a superscript-two port (isdigit, but int() refuses it)"),
    ("sshfs://exa:\u0662\u0662/data", "an Arabic-Indic port (int() would read it as 22)"),
    ("sshfs://exa:\uff12\uff12/data", "a fullwidth port (int() would read it as 22)"),
    ("sshfs://:/flodl/data", "an empty host, scp spelling"),
    ("sshfs:///flodl/data", "an empty host"),
    ("sshfs://:2222/flodl/data", "an empty host with a port"),
    ("sshfs://user@/flodl/data", "a user and no host"),
    ("sshfs://@exa/flodl/data", "an empty user"),
    ("sshfs://ex a/flodl/data", "whitespace in the host"),
    ("sshfs://fe80::1/flodl/data", "an unbracketed IPv6 address"),
    ("sshfs://[::1/flodl/data", "an unclosed IPv6 bracket"),
    ("sshfs://[::1]x/flodl/data", "junk after the IPv6 bracket"),
    ("sshfs://exa:/", "the remote root, scp spelling"),
    ("sshfs://exa/", "the remote root"),
    ("sshfs://exa:2222//", "the remote root, doubled"),
    ("sshfs://exa/./", "the remote root, dotted"),
    # What sshfs hands to ssh as its destination must not read as an option.
    ("sshfs://-oProxyCommand=touch%20x@exa/flodl/data", "a user that starts with a dash"),
    ("sshfs://-oProxyCommand=x/flodl/data", "a host that starts with a dash"),
    ("sshfs://data@-oProxyCommand=x:/flodl/data", "a host after a user that starts with a dash"),
    ("sshfs://da\tta@exa/flodl/data", "a tab in the user"),
    ("sshfs://ex\x07a/flodl/data", "a control character in the host"),
]


@pytest.mark.parametrize("value,shape", BROKEN_SOURCES, ids=[s for _, s in BROKEN_SOURCES])
def test_every_broken_data_source_shape_is_refused_permanently_naming_data_source(value: str, shape: str) -> None:
    with pytest.raises(Fail) as caught:
        parse_source(value)
    fail = caught.value
    assert fail.kind == "permanent", shape
    assert "data_source" in fail.message, fail.message
    # The operator sees the value they wrote, quoted.
    assert repr(value) in fail.message or repr(value.strip()) in fail.message, fail.message


@pytest.mark.sshfs
def test_a_dashed_user_never_reaches_sshfs_or_ssh(tmp_path: Path) -> None:
    # The case: nothing ran, but it came back transient, so the
    # unit retried it for ever. Now it is refused before any program runs.
    marker = tmp_path / "ran"
    point = tmp_path / "mnt"
    fail = _fail(_spec(data_path=str(point), data_source=f"sshfs://-oProxyCommand=touch {marker}@127.0.0.1/srv"))
    assert fail.kind == "permanent" and "starts with '-'" in fail.message
    assert not marker.exists() and not point.exists()


@pytest.mark.parametrize("value", BROKEN_SOURCES[0:1] + [("~/data", "")], ids=["absolute", "home"])
def test_a_bare_path_names_data_path_as_the_field_it_belongs_in(value: tuple[str, str]) -> None:
    with pytest.raises(Fail) as caught:
        parse_source(value[0])
    assert "`data_path`" in caught.value.message
    assert "--data-path" in caught.value.message


def test_an_unknown_scheme_names_the_scheme_and_points_at_data_path() -> None:
    with pytest.raises(Fail) as caught:
        parse_source("nfs://exa/flodl/data")
    assert "`nfs://`" in caught.value.message
    assert "`data_path`" in caught.value.message


def test_a_broken_source_fails_the_step_before_anything_is_touched(tmp_path: Path) -> None:
    point = tmp_path / "never-made"
    fail = _fail(_spec(data_path=str(point), data_source="sshfs://exa"))
    assert fail.kind == "permanent"
    assert not point.exists()


@pytest.mark.parametrize(
    "value,secret",
    [
        ("sshfs://u:p@h/x", "p"),
        ("sshfs://flodl:hunter2@exa:2222/flodl/data", "hunter2"),
        ("sshfs://flodl:@exa/flodl/data", None),
        ("sshfs://flodl:pa@ss@exa/flodl/data", "pa@ss"),
    ],
    ids=["short", "with-a-port", "empty-password", "an-at-in-the-password"],
)
def test_a_password_in_the_url_is_refused_permanently_pointing_at_the_identity_file(
    value: str, secret: str | None
) -> None:
    with pytest.raises(Fail) as caught:
        parse_source(value)
    fail = caught.value
    assert fail.kind == "permanent"
    assert "data_source" in fail.message
    assert "ssh.identity_file" in fail.message and "--identity-file" in fail.message
    assert "password" in fail.message
    # The message goes to logs and journals: the password itself does not.
    if secret is not None:
        assert f":{secret}@" not in fail.message
    assert "flodl:***@" in fail.message or "u:***@" in fail.message


GOOD_SOURCES = [
    ("sshfs://flodl@exa:2222/flodl/data", Source("flodl", "exa", 2222, "/flodl/data")),
    ("sshfs://flodl@exa:/flodl/data", Source("flodl", "exa", None, "/flodl/data")),
    ("sshfs://exa/flodl/data", Source(None, "exa", None, "/flodl/data")),
    ("sshfs://exa:/flodl/data", Source(None, "exa", None, "/flodl/data")),
    ("sshfs://exa/flodl/data/", Source(None, "exa", None, "/flodl/data")),
    ("sshfs://exa//flodl//data", Source(None, "exa", None, "/flodl/data")),
    ("SSHFS://exa/d", Source(None, "exa", None, "/d")),
    ("  sshfs://exa/d  ", Source(None, "exa", None, "/d")),
    ("sshfs://[::1]:2222/d", Source(None, "::1", 2222, "/d")),
    ("sshfs://u@[fe80::1]:/d", Source("u", "fe80::1", None, "/d")),
    ("sshfs://u@10.0.0.7:65535/with space/d", Source("u", "10.0.0.7", 65535, "/with space/d")),
    ("sshfs://a@b@exa/d", Source("a@b", "exa", None, "/d")),
]


@pytest.mark.parametrize("value,expected", GOOD_SOURCES, ids=[v for v, _ in GOOD_SOURCES])
def test_each_accepted_spelling_parses_to_user_host_port_and_path(value: str, expected: Source) -> None:
    assert parse_source(value) == expected


def test_the_remote_is_what_sshfs_takes_and_mountinfo_lists_and_the_url_round_trips() -> None:
    for value, _ in GOOD_SOURCES:
        source = parse_source(value)
        assert parse_source(source.url) == source
    assert parse_source("sshfs://flodl@exa:2222/flodl/data").remote == "flodl@exa:/flodl/data"
    assert parse_source("sshfs://[::1]:2222/d").remote == "[::1]:/d"
    assert parse_source("sshfs://exa/d").remote == "exa:/d"


# -- the sshfs command -----------------------------------------------------------


def test_sshfs_argv_puts_the_operators_options_first_then_key_port_and_the_defaults_last() -> None:
    ssh = SshSpec(
        target="ctrl",
        port=22,
        user="join-user",
        identity_file="/etc/fdl/join_key",
        options=("ServerAliveInterval=5", "StrictHostKeyChecking=yes"),
    )
    source = parse_source("sshfs://flodl@exa:2222/flodl/data")
    assert sshfs_argv(source, "/flodl/data", ssh) == [
        "sshfs",
        "-o", "ServerAliveInterval=5",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "IdentityFile=/etc/fdl/join_key",
        "-o", "port=2222",
        "-o", "ro",
        "-o", "reconnect",
        "-o", "ServerAliveInterval=15",
        "-o", "ServerAliveCountMax=3",
        "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=20",
        "--", "flodl@exa:/flodl/data", "/flodl/data",
    ]  # fmt: skip


def test_the_operators_value_for_a_key_comes_before_the_default_so_openssh_keeps_it() -> None:
    argv = sshfs_argv(parse_source("sshfs://exa/d"), "/m", SshSpec(options=("ServerAliveInterval=5",)))
    assert argv.index("ServerAliveInterval=5") < argv.index("ServerAliveInterval=15")


def test_the_port_comes_from_the_source_not_the_ssh_block() -> None:
    argv = sshfs_argv(parse_source("sshfs://exa/d"), "/m", SshSpec(port=2222))
    assert not any(a.startswith("port=") for a in argv)
    argv = sshfs_argv(parse_source("sshfs://exa:2200/d"), "/m", SshSpec(port=2222))
    assert "port=2200" in argv and "port=2222" not in argv


def test_ro_and_batchmode_are_always_there_and_last_even_with_no_ssh_block() -> None:
    argv = sshfs_argv(parse_source("sshfs://exa/d"), "/m", None)
    assert argv == ["sshfs"] + [x for o in sshfs_url.SSHFS_DEFAULTS for x in ("-o", o)] + [
        "-o", f"ConnectTimeout={sshfs_url.CONNECT_TIMEOUT_S}", "--", "exa:/d", "/m",
    ]  # fmt: skip
    argv = sshfs_argv(parse_source("sshfs://exa/d"), "/m", SshSpec(options=("rw", "ConnectTimeout=60")))
    assert argv.index("rw") < argv.index("ro")
    assert argv.index("ConnectTimeout=60") < argv.index(f"ConnectTimeout={sshfs_url.CONNECT_TIMEOUT_S}")
    assert argv[-6] == "BatchMode=yes"


def test_options_are_rewritten_into_the_one_shape_sshfs_accepts() -> None:
    ssh = SshSpec(
        identity_file="/keys/a,b\\c",
        options=(
            "Ciphers=aes128-ctr,aes256-ctr",
            "StrictHostKeyChecking no",
            "-o Compression=yes",
            "ProxyCommand ssh -o Port=2 -W %h:%p jump",
            "  ",
        ),
    )
    argv = sshfs_argv(parse_source("sshfs://exa/d"), "/m", ssh)
    # A comma would split one ssh option into two fuse options and sshfs
    # unescapes backslashes; `Key Value` is an unknown option to sshfs; a
    # blank is dropped.
    assert argv[1:11] == [
        "-o", "Ciphers=aes128-ctr\\,aes256-ctr",
        "-o", "StrictHostKeyChecking=no",
        "-o", "Compression=yes",
        "-o", "ProxyCommand=ssh -o Port=2 -W %h:%p jump",
        "-o", "IdentityFile=/keys/a\\,b\\\\c",
    ]  # fmt: skip
    # ssh splits a value on whitespace unless it is quoted.
    argv = sshfs_argv(parse_source("sshfs://exa/d"), "/m", SshSpec(identity_file="/keys/my key"))
    assert argv[1:3] == ["-o", 'IdentityFile="/keys/my key"']


# -- nothing declared, and data_path alone -------------------------------------------


def test_nothing_declared_ships_nothing_and_checks_nothing() -> None:
    notes: list[str] = []
    assert ensure(PrepareSpec(), notes) is None
    assert notes == []


def test_a_declared_directory_is_shipped_absolute(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    notes: list[str] = []
    assert ensure(_spec(data_path=str(tmp_path / "root")), notes) == str(tmp_path / "root")
    assert notes == []


def test_a_data_path_is_normalized_lexically_and_symlinks_are_kept(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert ensure(_spec(data_path=str(tmp_path / "link")), []) == str(tmp_path / "link")
    assert ensure(_spec(data_path=f"{tmp_path}/./real/../link/"), []) == str(tmp_path / "link")


@pytest.mark.parametrize("value", ["relative/dir", "link", "./real/../link/", "data"])
def test_a_relative_data_path_is_refused_permanently_with_an_absolute_example(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    # Under systemd the cwd is `/`, so "relative/dir" would silently become
    # /relative/dir; here it would resolve, which is the trap.
    (tmp_path / "relative" / "dir").mkdir(parents=True)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    fail = _fail(_spec(data_path=value))
    assert fail.reason == "config.invalid"
    assert f'PrepareSpec.data.data_path = "{value}": is a relative path' in fail.message
    assert "e.g. /flodl/data" in fail.message
    # The same for the mountpoint of a data_source: nothing is created.
    fail = _fail(_spec(data_path="not-made/here", data_source="sshfs://exa/flodl/data"))
    assert fail.reason == "config.invalid" and "PrepareSpec.data.data_path" in fail.message
    assert not (tmp_path / "not-made").exists()


@pytest.mark.parametrize("value", ["~/data", "~root/data"])
def test_a_home_relative_data_path_is_refused_as_a_state_dir_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    # Only a shell expands `~`: below it, it is a directory named `~`. The
    # same rule as state_dir's, wherever the value comes from.
    (tmp_path / "data").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    fail = _fail(_spec(data_path=value))
    assert fail.reason == "config.invalid"
    assert "PrepareSpec.data.data_path" in fail.message and "starts with '~'" in fail.message
    with pytest.raises(Fail) as caught:
        config.resolve({"data_path": value}, {}, {})
    assert "join.data_path" in caught.value.message and "starts with '~'" in caught.value.message


def test_a_data_source_is_not_mounted_over_the_root_of_the_machine() -> None:
    fail = _fail(_spec(data_path="/", data_source="sshfs://exa/flodl/data"))
    assert fail.reason == "config.invalid"
    assert "data_path '/' (from PrepareSpec.data.data_path) cannot be the mountpoint of data_source" in fail.message


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_text("not a dir"), "not a directory"),
        (lambda p: p.symlink_to(p.parent / "nowhere"), "does not exist"),
    ],
    ids=["missing", "a-file", "a-dangling-symlink"],
)
def test_a_data_path_that_is_not_a_listable_directory_is_permanent_naming_data_path(
    tmp_path: Path, make: object, words: str
) -> None:
    path = tmp_path / "root"
    make(path)  # type: ignore[operator]
    fail = _fail(_spec(data_path=str(path)))
    assert fail.kind == "permanent"
    assert words in fail.message
    assert str(path) in fail.message
    assert "`data_path`" in fail.message


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_data_path_is_permanent_naming_data_path(value: str) -> None:
    fail = _fail(_spec(data_path=value))
    assert fail.reason == "config.invalid" and "PrepareSpec.data.data_path" in fail.message
    assert "expected a non-empty string" in fail.message


@pytest.mark.mounts
def test_a_read_only_data_path_is_normal_not_a_fault(tmpfs: object) -> None:
    root = tmpfs(read_only=True, populate=lambda p: (p / "train").mkdir())  # type: ignore[operator]
    assert ensure(_spec(data_path=str(root)), []) == str(root)


def _ensure_root_without_dac_override(spec: str) -> tuple[str, str]:
    """Run the data step on `spec` (Python source for a PrepareSpec) in a
    child that is root without the capabilities overriding permissions, so
    the kernel's own EACCES is met; return the Fail's kind and message."""
    code = (
        "from prepare.data import root\n"
        "from prepare.plan import plan\n"
        "from prepare.spec import DataSpec, PrepareSpec, SshSpec\n"
        "from prepare.fail import Fail\n"
        f"spec = {spec}\n"
        "try:\n    root.ensure(plan(spec).data, [])\nexcept Fail as f:\n    print(f.kind); print(f.message)\n"
    )
    done = subprocess.run(
        # Out of every set a child could regain them from: a container
        # (systemd-nspawn) hands root inheritable and ambient capabilities.
        ["setpriv", "--inh-caps", "-dac_override,-dac_read_search", "--ambient-caps",
         "-dac_override,-dac_read_search", "--bounding-set", "-dac_override,-dac_read_search", "--",
         sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    kind, message = done.stdout.split("\n", 1)
    return kind, message


def test_an_unreadable_data_path_is_permanent_when_the_kernel_refuses_the_listing(tmp_path: Path) -> None:
    # Root lists anything, so the check runs as root without the two
    # capabilities that override file permissions, against a directory that
    # belongs to nobody: a real EACCES from the kernel, not a mode bit read
    # by the code.
    if os.geteuid() != 0:
        pytest.skip("needs root to hand the directory to another user")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    (root / "x").write_text("x")
    os.chown(root, 65534, 65534)
    kind, message = _ensure_root_without_dac_override(f"PrepareSpec(data=DataSpec(data_path={str(root)!r}))")
    assert kind == "permanent"
    assert "cannot be listed" in message and "Permission denied" in message
    assert "`data_path`" in message


# -- sshfs, for real -------------------------------------------------------------------


def _only_mount(point: Path) -> mounts.Mount:
    at = [m for m in mounts.read() if m.mount_point == str(point)]
    assert len(at) == 1, at
    return at[0]


@pytest.mark.sshfs
def test_a_source_is_mounted_read_only_and_a_write_through_it_fails_with_erofs(
    sshd, sshfs_mounts, remote_tree: Path
) -> None:
    point = sshfs_mounts.point()
    notes: list[str] = []
    got = ensure(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point)), notes)
    assert got == str(point)
    mount = _only_mount(point)
    assert mount.fstype == "fuse.sshfs"
    assert mount.source == sshd.remote(remote_tree)
    assert mount.read_only
    assert notes == [f"mounted `{sshd.remote(remote_tree)}` read-only at {point}"]
    assert (point / "README").read_text() == "dataset root for fdl-prepare tests\n"
    for attempt in (
        lambda: (point / "new-file").write_text("x"),
        lambda: (point / "README").write_text("overwritten"),
        lambda: (point / "train" / "new-dir").mkdir(),
        lambda: (point / "README").unlink(),
    ):
        with pytest.raises(OSError) as caught:
            attempt()
        assert caught.value.errno == errno.EROFS
    assert (remote_tree / "README").read_text() == "dataset root for fdl-prepare tests\n"
    assert not (remote_tree / "new-file").exists()


@pytest.mark.sshfs
def test_an_identity_file_with_a_comma_and_a_backslash_in_its_path_reaches_ssh_intact(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path
) -> None:
    key = tmp_path / "keys, odd\\ones" / "id"
    key.parent.mkdir()
    shutil.copy(sshd.user_key, key)
    key.chmod(0o600)
    point = sshfs_mounts.point()
    spec = sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point), identity=key)
    assert ensure(spec, []) == str(point)
    assert _only_mount(point).fstype == "fuse.sshfs"


@pytest.mark.sshfs
def test_the_scp_spelling_mounts_the_same_source(sshd, sshfs_mounts, remote_tree: Path) -> None:
    point = sshfs_mounts.point()
    # No port in the source: the ssh block's own Port option carries it.
    spec = sshd.spec(data_source=sshd.source(remote_tree, scp=True), data_path=str(point), extra=(f"Port={sshd.port}",))
    assert ensure(spec, []) == str(point)
    assert _only_mount(point).source == sshd.remote(remote_tree)


@pytest.mark.sshfs
def test_a_second_prepare_reuses_the_mount_of_the_same_source_with_a_note(
    sshd, sshfs_mounts, remote_tree: Path
) -> None:
    point = sshfs_mounts.point()
    spec = sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point))
    ensure(spec, [])
    first = _only_mount(point)
    serving = _sshfs_pids(point)
    notes: list[str] = []
    assert ensure(spec, notes) == str(point)
    assert _only_mount(point).mount_id == first.mount_id
    assert _sshfs_pids(point) == serving
    assert len(notes) == 1
    assert "already mounted from" in notes[0] and "reusing it" in notes[0] and "read-only" in notes[0]
    # The same source spelled with a trailing slash is still the same source.
    spec = sshd.spec(data_source=sshd.source(f"{remote_tree}/"), data_path=str(point))
    notes = []
    ensure(spec, notes)
    assert "reusing it" in notes[0]
    assert sshfs_mounts.count_at(point) == 1


@pytest.mark.sshfs
def test_a_symlinked_mountpoint_is_mounted_through_and_shipped_as_declared(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path
) -> None:
    real = sshfs_mounts.point("real")
    link = tmp_path / "declared"
    link.symlink_to(real)
    spec = sshd.spec(data_source=sshd.source(remote_tree), data_path=str(link))
    assert ensure(spec, []) == str(link)
    assert _only_mount(real).fstype == "fuse.sshfs"
    notes: list[str] = []
    assert ensure(spec, notes) == str(link)
    assert "reusing it" in notes[0]
    assert sshfs_mounts.count_at(real) == 1


@pytest.mark.sshfs
def test_a_mount_of_a_different_source_is_left_alone_with_the_fusermount_note(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-tree"
    other.mkdir()
    (other / "theirs").write_text("x")
    point = sshfs_mounts.point()
    sshfs_mounts.sshfs(sshd, other, point)
    before = _only_mount(point)
    notes: list[str] = []
    got = ensure(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point)), notes)
    assert got == str(point)
    assert _only_mount(point).mount_id == before.mount_id
    assert (point / "theirs").exists()
    assert len(notes) == 1
    assert f"`fusermount -u {point}`" in notes[0]
    assert sshd.remote(other) in notes[0]
    assert sshd.source(remote_tree) in notes[0]


@pytest.mark.mounts
def test_a_kernel_mount_already_at_the_mountpoint_is_left_alone_with_the_umount_note(
    sshd, sshfs_mounts, remote_tree: Path, tmpfs: object
) -> None:
    point = tmpfs(populate=lambda p: (p / "provisioned").mkdir())  # type: ignore[operator]
    notes: list[str] = []
    assert ensure(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point)), notes) == str(point)
    assert _only_mount(point).fstype == "tmpfs"
    assert f"`sudo umount {point}`" in notes[0]


@pytest.mark.sshfs
def test_the_mountpoint_is_created_when_missing_and_the_default_is_used_when_none_is_given(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    point = sshfs_mounts.track(tmp_path / "made" / "by" / "prepare")
    monkeypatch.setattr(prepare.plan, "DATA_MOUNTPOINT", str(point))
    assert ensure(sshd.spec(data_source=sshd.source(remote_tree), data_path=None), []) == str(point)
    assert _only_mount(point).fstype == "fuse.sshfs"


@pytest.mark.sshfs
def test_a_closed_port_is_transient_and_fast(sshd, sshfs_mounts, remote_tree: Path) -> None:
    from sshd_fixtures import free_port

    point = sshfs_mounts.point()
    source = f"sshfs://root@127.0.0.1:{free_port()}{remote_tree}"
    start = time.monotonic()
    fail = _fail(sshd.spec(data_source=source, data_path=str(point)))
    assert time.monotonic() - start < 5
    assert fail.kind == "transient"
    assert "Connection refused" in fail.message
    assert source in fail.message
    assert sshfs_mounts.count_at(point) == 0


@pytest.mark.sshfs
def test_a_stopped_sshd_is_transient_and_the_next_attempt_after_it_returns_mounts(
    make_sshd, sshfs_mounts, remote_tree: Path
) -> None:
    server = make_sshd()
    point = sshfs_mounts.point()
    spec = server.spec(data_source=server.source(remote_tree), data_path=str(point))
    server.stop()
    fail = _fail(spec)
    assert fail.kind == "transient"
    assert "sshfs exited" in fail.message
    server.start()
    assert ensure(spec, []) == str(point)
    assert _only_mount(point).fstype == "fuse.sshfs"


@pytest.mark.sshfs
def test_a_refused_key_fails_fast_under_batchmode_transient_with_sshfs_stderr_quoted(
    sshd, sshfs_mounts, remote_tree: Path
) -> None:
    point = sshfs_mounts.point()
    spec = sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point), identity=sshd.stranger_key)
    start = time.monotonic()
    fail = _fail(spec)
    assert time.monotonic() - start < 10
    assert fail.kind == "transient"
    assert "Permission denied (publickey)" in fail.message
    assert "sshfs said:" in fail.message
    assert sshfs_mounts.count_at(point) == 0


def _known_hosts(tmp_path: Path, sshd, how: str) -> Path:  # type: ignore[no-untyped-def]
    known = tmp_path / f"known_hosts-{how}"
    if how == "unknown":
        known.write_text("")
        return known
    # Another key under the host's name: what a reinstalled host, or a
    # machine in between, looks like.
    other = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    key = (tmp_path / "other_host_key.pub").read_text().split()[:2]
    known.write_text(f"[{sshd.host}]:{sshd.port} {' '.join(key)}\n")
    return known


@pytest.mark.parametrize("how", ["unknown", "changed"])
def test_a_host_key_ssh_does_not_know_or_that_changed_is_permanent_naming_ssh_keyscan_and_known_hosts(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path, how: str
) -> None:
    point = sshfs_mounts.point()
    known = _known_hosts(tmp_path, sshd, how)
    options = (f"UserKnownHostsFile={known}", "GlobalKnownHostsFile=/dev/null", "StrictHostKeyChecking=yes")
    spec = PrepareSpec(
        data=DataSpec(data_path=str(point), data_source=sshd.source(remote_tree)),
        ssh=SshSpec(identity_file=str(sshd.user_key), options=(*options, "IdentitiesOnly=yes")),
        cpu_only=True,
    )
    fail = _fail(spec)
    assert fail.permanent and fail.reason == "data.host-key"
    said = "REMOTE HOST IDENTIFICATION HAS CHANGED" if how == "changed" else "Host key verification failed"
    assert said in fail.message
    assert f"ssh-keyscan -p {sshd.port} {sshd.host}" in fail.message and "known_hosts" in fail.message
    assert sshfs_mounts.count_at(point) == 0


# What ssh (or sshfs, for its own option parser) says about an option it
# cannot use, as the operator wrote it: the box's configuration, which no
# retry changes.
BAD_SSH_OPTIONS = [
    ("Bogus=1", ["fuse: unknown option(s)", "Bogus=1"]),
    ("Port=notnum", ["Bad port 'notnum'"]),
    ("StrictHostKeyChecking=maybe", ['unsupported option "maybe"']),
    ("Ciphers=nonesuch", ["command-line line 0:", "nonesuch"]),
    ("ssh_command=ssh -o Bogus=1", ["Bad configuration option: bogus"]),
]


@pytest.mark.sshfs
@pytest.mark.parametrize("option,said", BAD_SSH_OPTIONS, ids=[o for o, _ in BAD_SSH_OPTIONS])
def test_an_ssh_option_ssh_refuses_is_permanent_naming_ssh_options_and_quoting_ssh(
    sshd, sshfs_mounts, remote_tree: Path, option: str, said: list[str]
) -> None:
    point = sshfs_mounts.point()
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point), extra=(option,)))
    assert fail.kind == "permanent", fail.message
    assert "`ssh.options`" in fail.message and "--ssh-option" in fail.message
    for words in said:
        assert words in fail.message, fail.message
    assert sshfs_mounts.count_at(point) == 0


@pytest.mark.sshfs
def test_a_bad_option_in_an_ssh_config_file_is_permanent_too(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path
) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Bogus yes\n")
    point = sshfs_mounts.point()
    spec = sshd.spec(
        data_source=sshd.source(remote_tree), data_path=str(point), extra=(f"ssh_command=ssh -F {config}",)
    )
    fail = _fail(spec)
    assert fail.kind == "permanent", fail.message
    assert f"{config}: line 1: Bad configuration option: bogus" in fail.message
    assert "--ssh-option" in fail.message


@pytest.mark.sshfs
def test_an_option_ssh_only_warns_about_leaves_a_network_failure_transient(
    sshd, sshfs_mounts, remote_tree: Path
) -> None:
    from sshd_fixtures import free_port

    # OpenSSH prints `command-line line 0: Unsupported option "rsaauthentication"`
    # for a removed option and carries on: the refused port is the failure.
    point = sshfs_mounts.point()
    spec = sshd.spec(
        data_source=f"sshfs://root@127.0.0.1:{free_port()}{remote_tree}",
        data_path=str(point),
        extra=("RSAAuthentication=yes",),
    )
    fail = _fail(spec)
    assert fail.kind == "transient", fail.message
    assert "Connection refused" in fail.message
    # And against a server that answers, the warning does not stop the mount.
    point = sshfs_mounts.point()
    spec = sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point), extra=("RSAAuthentication=yes",))
    assert ensure(spec, []) == str(point)
    assert _only_mount(point).fstype == "fuse.sshfs"


@pytest.mark.sshfs
@pytest.mark.parametrize("shape", ["missing", "a-directory"])
def test_an_identity_file_that_is_not_a_readable_file_is_permanent_before_anything_is_mounted(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path, shape: str
) -> None:
    key = tmp_path / "keys" / "id_ed25519"
    if shape == "a-directory":
        key.mkdir(parents=True)
    point = tmp_path / "never-made"
    sshfs_mounts.track(point)
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point), identity=key))
    assert fail.kind == "permanent", fail.message
    assert "`ssh.identity_file`" in fail.message and "--identity-file" in fail.message
    assert str(key) in fail.message
    assert ("(ENOENT)" if shape == "missing" else "(EISDIR)") in fail.message
    assert not point.exists()


@pytest.mark.sshfs
def test_an_identity_file_the_user_cannot_read_is_permanent(
    sshd, remote_tree: Path, tmp_path: Path, forget_mount_lock_of
) -> None:
    # As in the unreadable data_path test: root without the capabilities that
    # override permissions meets the kernel's own EACCES.
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    key = tmp_path / "id_ed25519"
    shutil.copy(sshd.user_key, key)
    key.chmod(0o600)
    os.chown(key, 65534, 65534)
    point = tmp_path / "never-made"
    forget_mount_lock_of(point)
    kind, message = _ensure_root_without_dac_override(
        f"PrepareSpec(data=DataSpec(data_path={str(point)!r}, data_source={sshd.source(remote_tree)!r}), "
        f"ssh=SshSpec(identity_file={str(key)!r}, options={sshd.options!r}))"
    )
    assert kind == "permanent", message
    assert "Permission denied (EACCES)" in message
    assert str(key) in message and "--identity-file" in message
    assert not point.exists()


@pytest.mark.sshfs
def test_a_remote_directory_that_does_not_exist_is_transient_with_sshfs_stderr(
    sshd, sshfs_mounts, remote_tree: Path
) -> None:
    point = sshfs_mounts.point()
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree / "not-published-yet"), data_path=str(point)))
    assert fail.kind == "transient"
    assert "No such file or directory" in fail.message


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A port that accepts TCP and never says a word: a far side whose sshd
    is wedged, or a middlebox eating the banner."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                held.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        # Closing the held connections ends the ssh client sshfs left behind.
        for conn in held:
            conn.close()
        server.close()


@pytest.mark.sshfs
def test_a_far_side_that_accepts_and_never_answers_is_reported_by_ssh_at_its_connect_timeout(
    sshd, sshfs_mounts, remote_tree: Path, silent_listener: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sshfs_url, "CONNECT_TIMEOUT_S", 1)
    point = sshfs_mounts.point()
    start = time.monotonic()
    fail = _fail(sshd.spec(data_source=f"sshfs://root@127.0.0.1:{silent_listener}{remote_tree}", data_path=str(point)))
    assert time.monotonic() - start < 8
    assert fail.kind == "transient"
    assert "banner exchange" in fail.message
    assert sshfs_mounts.count_at(point) == 0


@pytest.mark.sshfs
def test_sshfs_killed_at_the_mount_timeout_is_transient_and_leaves_no_dead_mount(
    sshd, sshfs_mounts, remote_tree: Path, silent_listener: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The operator's ConnectTimeout comes first and wins, so only our own
    # timeout stops this one. sshfs has put the FUSE mount in place by then.
    monkeypatch.setattr(mount, "MOUNT_TIMEOUT_S", 2.0)
    point = sshfs_mounts.point()
    spec = sshd.spec(
        data_source=f"sshfs://root@127.0.0.1:{silent_listener}{remote_tree}",
        data_path=str(point),
        extra=("ConnectTimeout=600",),
    )
    start = time.monotonic()
    fail = _fail(spec)
    assert time.monotonic() - start < 6
    assert fail.kind == "transient"
    assert "did not finish within 2s" in fail.message
    assert sshfs_mounts.count_at(point) == 0
    assert os.listdir(point) == []


def _sshfs_pids(point: Path) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"sshfs" and os.fsencode(str(point)) in argv:
            pids.append(int(entry))
    return pids


@pytest.mark.sshfs
def test_a_dead_mount_makes_listing_time_out_transient_within_the_timeout(
    make_sshd, sshfs_mounts, remote_tree: Path
) -> None:
    server = make_sshd()
    point = sshfs_mounts.point()
    # No directory cache, so a listing has to ask the far side.
    spec = server.spec(
        data_source=server.source(remote_tree), data_path=str(point), extra=("dir_cache=no",), list_timeout_s=2.0
    )
    assert ensure(spec, []) == str(point)
    assert server.freeze(), "no sshd connection process to freeze"

    start = time.monotonic()
    fail = _fail(spec)
    took = time.monotonic() - start
    assert fail.kind == "transient"
    assert "did not finish within 2s" in fail.message
    assert f"fusermount -u -z {point}" in fail.message
    assert took < 5, took

    # The same dead mount declared as a bare data_path: also bounded.
    start = time.monotonic()
    fail = _fail(_spec(data_path=str(point), list_timeout_s=2.0))
    assert fail.kind == "transient"
    assert time.monotonic() - start < 5


@pytest.mark.sshfs
def test_a_mount_whose_sshfs_process_died_is_replaced_with_a_note(sshd, sshfs_mounts, remote_tree: Path) -> None:
    point = sshfs_mounts.point()
    spec = sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point))
    ensure(spec, [])
    pids = _sshfs_pids(point)
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(OSError) as caught:
        os.listdir(point)
    assert caught.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)

    notes: list[str] = []
    assert ensure(spec, notes) == str(point)
    assert _only_mount(point).fstype == "fuse.sshfs"
    fresh = _sshfs_pids(point)
    assert fresh and not set(fresh) & set(pids)
    assert "lost its sshfs process" in notes[0]
    assert (point / "README").exists()


@pytest.mark.sshfs
def test_sshfs_not_installed_is_permanent_naming_the_install_commands(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    point = tmp_path / "not-created"
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point)))
    assert fail.kind == "permanent"
    assert "sudo apt-get install sshfs" in fail.message
    assert "nixpkgs#sshfs" in fail.message
    assert "`data_path`" in fail.message
    assert not point.exists()


@pytest.mark.mounts
def test_a_mountpoint_that_cannot_be_created_is_permanent_naming_mkdir_chown_and_data_path(
    sshd, remote_tree: Path, tmpfs: object
) -> None:
    ro = tmpfs(read_only=True)  # type: ignore[operator]
    point = ro / "flodl" / "data"
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point)))
    assert fail.kind == "permanent"
    assert "Read-only file system" in fail.message
    assert f"sudo mkdir -p {point} && sudo chown root {point}" in fail.message
    assert "`data_path`" in fail.message


def test_a_mountpoint_that_is_a_file_is_permanent(sshd, remote_tree: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(tmp_path / "file")))
    assert fail.kind == "permanent"
    assert "not a directory" in fail.message and "`data_path`" in fail.message
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(tmp_path / "file" / "below")))
    assert fail.kind == "permanent"
    assert "sudo mkdir -p" in fail.message


@pytest.mark.mounts
def test_os_errors_are_worded_with_their_errno_symbol_like_every_other_step(
    sshd, remote_tree: Path, tmp_path: Path, tmpfs: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("x")
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(tmp_path / "file" / "below")))
    assert fail.kind == "permanent"
    assert "Not a directory (ENOTDIR)" in fail.message
    # A lock directory the kernel will not let anyone create in.
    ro = tmpfs(read_only=True)  # type: ignore[operator]
    monkeypatch.setattr(data, "_lock_dir", lambda: str(ro))
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(tmp_path / "locked")))
    assert fail.kind == "permanent"
    assert "mount lock" in fail.message
    assert "Read-only file system (EROFS)" in fail.message


def test_the_root_directory_is_refused_as_a_mountpoint(sshd, remote_tree: Path) -> None:
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path="/"))
    assert fail.kind == "permanent" and "`data_path`" in fail.message


@pytest.mark.sshfs
def test_sshfs_that_exits_zero_with_nothing_mounted_is_transient(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The one stand-in in this file: a real sshfs cannot be made to report
    # success without mounting on demand, so a program named sshfs that
    # prints what sshfs prints when the far side drops mid-handshake and
    # exits 0 sits at the PATH seam.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sshfs"
    fake.write_text("#!/bin/sh\necho 'remote host has disconnected' >&2\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    point = sshfs_mounts.point()
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point)))
    assert fail.kind == "transient"
    assert "exited 0 but nothing is mounted" in fail.message
    assert "remote host has disconnected" in fail.message


# -- one mounter at a time ------------------------------------------------------------


def test_the_mount_lock_is_keyed_by_the_mountpoint_and_lives_outside_it(tmp_path: Path) -> None:
    a = data.lock_path(str(tmp_path / "a"))
    assert a == data.lock_path(str(tmp_path / "a"))
    assert a != data.lock_path(str(tmp_path / "b"))
    assert not a.startswith(str(tmp_path / "a") + os.sep)
    locks.private_dir(os.path.dirname(a))
    assert os.access(os.path.dirname(a), os.W_OK)


@pytest.mark.sshfs
def test_a_prepare_waits_for_the_mount_lock_and_then_reuses_what_the_holder_mounted(
    sshd, sshfs_mounts, remote_tree: Path
) -> None:
    point = sshfs_mounts.point()
    spec = sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point))
    locks.private_dir(os.path.dirname(data.lock_path(str(point))))
    fd = os.open(data.lock_path(str(point)), os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        outcome: list[object] = []
        notes: list[str] = []
        waiter = threading.Thread(target=lambda: outcome.append(ensure(spec, notes)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and sshfs_mounts.count_at(point) == 0
        # The holder mounts (as another prepare would) and lets go.
        sshfs_mounts.sshfs(sshd, remote_tree, point)
        fcntl.flock(fd, fcntl.LOCK_UN)
        waiter.join(30)
    finally:
        os.close(fd)
    assert outcome == [str(point)]
    assert "reusing it" in notes[0]
    assert sshfs_mounts.count_at(point) == 1


def test_a_lock_held_past_the_wait_is_transient(
    tmp_path: Path, sshd, remote_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mount, "MOUNT_TIMEOUT_S", 0.0)
    monkeypatch.setattr(data, "LOCK_GRACE_S", 0.3)
    monkeypatch.setattr(listing, "CHILD_GRACE_S", 0.0)
    point = tmp_path / "locked"
    locks.private_dir(os.path.dirname(data.lock_path(str(point))))
    fd = os.open(data.lock_path(str(point)), os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point), list_timeout_s=0.1))
    finally:
        os.close(fd)
    assert fail.kind == "transient"
    assert "mount lock" in fail.message


def test_a_mount_lock_root_made_cannot_be_opened_or_held_by_another_user(tmp_path: Path) -> None:
    # A lock another user can open is one they can hold (a shared flock is
    # enough): every attempt would wait out its bound and fail lock.busy.
    if os.geteuid() != 0:
        pytest.skip("needs root to make the lock as a root prepare does")
    if shutil.which("setpriv") is None or shutil.which("flock") is None:
        pytest.skip("setpriv and flock (util-linux) are not installed")
    point = str(tmp_path / "shared")
    path = data.lock_path(point)
    # Root takes it and lets go, as a root prepare's mount step does.
    with data._mount_lock(point, 1.0):
        assert os.path.isfile(path)
    try:
        where = os.path.dirname(path)
        assert stat.S_IMODE(os.stat(where).st_mode) == 0o700 and os.stat(where).st_uid == 0
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
        held = subprocess.run(
            [*nobody, "flock", "-n", "-s", path, "true"], capture_output=True, text=True, timeout=60, check=False
        )
        assert held.returncode != 0 and "Permission denied" in held.stderr, held.stderr
        # Nor can it make a lock (or a directory) of its own there first.
        planted = subprocess.run(
            [*nobody, "mkdir", os.path.join(where, "fdl-prepare-mount.planted.lock")],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert planted.returncode != 0 and "Permission denied" in planted.stderr, planted.stderr
    finally:
        os.unlink(path)


def test_a_directory_in_place_of_a_mount_lock_is_permanent_and_says_to_remove_it(tmp_path: Path) -> None:
    point = str(tmp_path / "planted")
    path = data.lock_path(point)
    locks.private_dir(os.path.dirname(path))
    os.mkdir(path)
    try:
        with pytest.raises(Fail) as caught, data._mount_lock(point, 1.0):
            pytest.fail("a directory was taken for a lock")
    finally:
        os.rmdir(path)
    fail = caught.value
    assert fail.reason == "dirs.unwritable" and fail.permanent, fail.message
    assert f"remove it (`sudo rm -r {path}`)" in fail.message, fail.message


def test_a_lock_directory_another_user_made_first_is_permanent_naming_it(tmp_path: Path) -> None:
    # Where another user could make the lock directory first (a non-root
    # prepare's falls back to the temporary directory): theirs is refused.
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory as another user")
    theirs = tmp_path / "locks"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(locks.NotPrivate) as caught:
        locks.private_dir(str(theirs))
    assert "owned by uid 65534" in str(caught.value) and "sudo rm -r" in str(caught.value)


# -- the key itself: what ssh would refuse is permanent ------------------------------------


@pytest.mark.sshfs
def test_an_identity_file_others_can_read_is_permanent_and_names_chmod(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path
) -> None:
    key = tmp_path / "id_ed25519"
    shutil.copy(sshd.user_key, key)
    key.chmod(0o644)
    point = tmp_path / "never-made"
    sshfs_mounts.track(point)
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point), identity=key))
    assert fail.kind == "permanent", fail.message
    assert "mode 0644" in fail.message and "are too open" in fail.message and f"chmod 600 {key}" in fail.message
    assert not point.exists()


@pytest.mark.sshfs
def test_an_identity_file_with_a_passphrase_is_permanent_without_an_agent(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "a passphrase", "-f", str(key)], check=True)
    point = tmp_path / "never-made"
    sshfs_mounts.track(point)
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point), identity=key))
    assert fail.kind == "permanent", fail.message
    assert "has a passphrase" in fail.message and "BatchMode=yes" in fail.message
    assert f"ssh-keygen -p -N '' -f {key}" in fail.message and "SSH_AUTH_SOCK" in fail.message


@pytest.mark.sshfs
def test_a_key_ssh_refuses_that_came_through_ssh_options_is_permanent_from_what_ssh_says(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path
) -> None:
    # Not fdl-prepare's identity_file, so not read beforehand: ssh itself
    # says "bad permissions", and that is the box's configuration.
    key = tmp_path / "id_ed25519"
    shutil.copy(sshd.user_key, key)
    key.chmod(0o644)
    point = sshfs_mounts.point()
    spec = PrepareSpec(
        data=DataSpec(data_path=str(point), data_source=sshd.source(remote_tree)),
        ssh=SshSpec(options=(*sshd.options, f"IdentityFile={key}")),
        cpu_only=True,
    )
    fail = _fail(spec)
    assert fail.kind == "permanent", fail.message
    assert "ssh will not use the private key" in fail.message and "bad permissions" in fail.message


# -- the ssh block's target, user and port --------------------------------------------------


@pytest.mark.sshfs
def test_a_data_source_on_the_tunnel_host_takes_the_ssh_blocks_user_and_port(
    sshd, sshfs_mounts, remote_tree: Path
) -> None:
    point = sshfs_mounts.point()
    spec = PrepareSpec(
        data=DataSpec(data_path=str(point), data_source=f"sshfs://{sshd.host}{remote_tree}"),
        ssh=SshSpec(
            target=sshd.host,
            user=sshd.user,
            port=sshd.port,
            identity_file=str(sshd.user_key),
            options=sshd.options,
        ),
        cpu_only=True,
    )
    notes: list[str] = []
    assert ensure(spec, notes) == str(point)
    assert _only_mount(point).source == sshd.remote(remote_tree)
    assert any(f"port {sshd.port} (ssh.port)" in n and f"user {sshd.user} (ssh.user)" in n for n in notes), notes


def test_the_ssh_blocks_user_and_port_are_not_silently_dropped_for_another_host() -> None:
    source = parse_source("sshfs://data.example/srv")
    notes: list[str] = []
    ssh = SshSpec(target="ctrl.example", port=2222, user="worker")
    assert sshfs_url.with_tunnel_defaults(source, ssh, notes) == source
    assert len(notes) == 1 and "ssh.user (--ssh-user) and ssh.port (--ssh-port)" in notes[0]
    assert "another machine" in notes[0]
    notes.clear()
    assert sshfs_url.with_tunnel_defaults(source, SshSpec(port=2222), notes) == source
    assert "which is not set" in notes[0]


def test_the_tunnel_target_may_carry_its_own_user_and_port_and_the_url_still_wins() -> None:
    notes: list[str] = []
    got = sshfs_url.with_tunnel_defaults(
        parse_source("sshfs://ctrl.example/srv"), SshSpec(target="worker@ctrl.example:2200"), notes
    )
    assert (got.user, got.port) == ("worker", 2200) and "ssh.target" in notes[0]
    own = parse_source("sshfs://me@ctrl.example:22/srv")
    assert sshfs_url.with_tunnel_defaults(own, SshSpec(target="ctrl.example", user="x", port=2), []) == own


SSH_TOKEN = "tok3n-s3cr3t-ssh-fdl"


@pytest.mark.sshfs
@pytest.mark.parametrize(
    "option",
    [f"ProxyCommand=/bin/false --token {SSH_TOKEN}", f"SetEnv=API_TOKEN={SSH_TOKEN}"],
    ids=["proxycommand", "setenv"],
)
def test_a_secret_in_an_ssh_option_never_reaches_a_message_or_a_note(
    sshd, sshfs_mounts, remote_tree: Path, option: str
) -> None:
    # The ProxyCommand fails (so the mount does, quoting the `sshfs -v` line
    # to try by hand); SetEnv rides along a mount refused for another reason.
    point = sshfs_mounts.point()
    refused = () if option.startswith("ProxyCommand") else ("Port=notnum",)
    notes: list[str] = []
    fail = _fail(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point), extra=(option, *refused)), notes)
    said = fail.message + "\n".join(notes)
    assert SSH_TOKEN not in said, said
    assert sshfs_mounts.count_at(point) == 0


def _command_lines_holding(secret: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if secret.encode() in argv:
                found.append(argv.replace(b"\0", b" ").decode(errors="replace"))
    return found


@pytest.mark.sshfs
def test_a_secret_in_an_ssh_option_is_on_no_command_line_while_the_mount_lives(
    sshd, sshfs_mounts, remote_tree: Path
) -> None:
    point = sshfs_mounts.point()
    notes: list[str] = []
    spec = sshd.spec(
        data_source=sshd.source(remote_tree), data_path=str(point), extra=(f"SetEnv=API_TOKEN={SSH_TOKEN}",)
    )
    assert ensure(spec, notes) == str(point)
    assert (point / "README").read_text() == "dataset root for fdl-prepare tests\n"
    # sshfs and the ssh it runs hold only the file's path; the file is this user's alone.
    assert _command_lines_holding(SSH_TOKEN) == []
    sshfs_line = [line for line in _command_lines_holding(str(point)) if line.split(" ", 1)[0].endswith("sshfs")]
    assert sshfs_line and " -F " in sshfs_line[0], sshfs_line
    config = sshfs_line[0].split(" -F ", 1)[1].split(" ", 1)[0]
    st = os.stat(config)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(config)).st_mode) == 0o700
    assert f"SetEnv=API_TOKEN={SSH_TOKEN}" in Path(config).read_text()


@pytest.mark.sshfs
def test_a_proxycommand_kept_off_the_command_line_is_still_the_one_ssh_uses(
    sshd, sshfs_mounts, remote_tree: Path
) -> None:
    point = sshfs_mounts.point()
    spec = sshd.spec(
        data_source=sshd.source(remote_tree), data_path=str(point), extra=(f"ProxyCommand=/bin/false {SSH_TOKEN}",)
    )
    fail = _fail(spec)
    assert fail.reason == "data.unreachable" and SSH_TOKEN not in fail.message, fail.message
    assert sshfs_mounts.count_at(point) == 0
