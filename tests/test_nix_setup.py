"""Nix itself, misconfigured, is named as such, never as a flake or a
training-source problem; and the shapes Nix versions give the same answer
in (2.8 on Debian 12, 2.26 on Debian 13, 2.34 on Debian testing). Every case
runs real Nix on the misconfiguration, except where a comment says what could
not be made."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import nix_fixtures
import pytest
from nix_fixtures import (
    NIX_BUILDS,
    NIX_CONFIG,
    SANDBOX_LENT,
    box_settings,
    build,
    builds_follow_tmpdir,
    nix_daemon_client,
    sandbox_paths,
    small_disk,
    trainer,
)

from prepare.fail import Fail
from prepare.nix import runner as nix_mod
from prepare.nix.diagnosis import BuildDir
from prepare.nix.runner import Nix, build_result
from prepare.spec import PrepareSpec, SourceSpec

pytestmark = pytest.mark.nix


def _root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (builds as the nixbld users, switching to another user, mount namespaces)")


def _fix(fail: Fail) -> str:
    return fail.message.split("Fix:")[1]


def _cpu_spec(flake: str, source: str, tmp_path: Path) -> PrepareSpec:
    return PrepareSpec(
        source=SourceSpec(from_=source), libtorch="cpu", cpu_only=True, flake=flake, state_dir=str(tmp_path / "state")
    )


def _nonce() -> str:
    return f"{time.time_ns()}"


def test_a_build_users_group_that_does_not_exist_is_permanent_and_names_the_installation(
    nix_env, test_flake, git_source, tmp_path, monkeypatch
):
    # What Debian's nix-bin without nix-setup-systemd looks like: the
    # configured group is missing (a fresh training source forces a build).
    _root_only()
    monkeypatch.setenv("NIX_CONFIG", NIX_CONFIG + "build-users-group = fdl-no-such-group\n")
    src = git_source(trainer(nonce=_nonce()))
    spec = _cpu_spec(test_flake, src.url, tmp_path)
    with pytest.raises(Fail) as caught:
        build(spec, [])
    fail = caught.value
    assert fail.permanent
    assert "'fdl-no-such-group' specified in 'build-users-group' does not exist" in fail.message
    fix = _fix(fail)
    assert "Nix installation" in fix and "nix-setup-systemd" in fix
    assert "training source" not in fix and "fix the flake" not in fix


def test_a_daemon_socket_this_user_may_not_open_is_permanent_and_names_the_group(nix_env, test_flake, tmp_path):
    # A real nix-daemon on a socket in a directory only root may enter, and
    # a client that is another user: the kernel refuses the connect, as it
    # does on Debian for a user outside nix-users.
    with nix_daemon_client(test_flake, private_socket=True) as (runner, flake), pytest.raises(Fail) as caught:
        runner.eval_json(f"path:{flake}#legacyPackages.{nix_mod.system()}.fdl.contract")
    fail = caught.value
    assert fail.permanent
    assert "cannot connect to socket" in fail.message and "Permission denied" in fail.message
    assert "nix-users" in _fix(fail) and "Nix installation" in _fix(fail)


def test_a_stage_the_build_users_cannot_enter_still_builds(nix_env, test_flake, git_source, tmp_path, monkeypatch):
    # libpam-tmpdir gives root TMPDIR=/tmp/user/0 at 0700; a single-user Nix
    # as root builds there as the nixbld users, who cannot enter it.
    _root_only()
    stage = Path(tempfile.mkdtemp(prefix="fdl-private-stage-"))
    try:
        stage.chmod(0o700)
        monkeypatch.setenv("TMPDIR", str(stage))
        src = git_source(trainer(nonce=_nonce()))
        notes: list[str] = []
        got = build(_cpu_spec(test_flake, src.url, tmp_path), notes)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    assert got.bin is not None and os.access(got.bin.path, os.X_OK)
    assert any(f"TMPDIR {str(stage)!r} is not where builds may run" in n and "/nix/var/nix/builds" in n for n in notes)


def test_a_build_dir_under_a_directory_others_can_write_is_permanent_and_names_the_installation(
    nix_env, test_flake, git_source, tmp_path, monkeypatch
):
    # nix.conf's build-dir under /tmp, which anyone can write: Nix 2.30 and
    # later refuse to build there (a builder's directory others can reach
    # had let builds out of the sandbox), whatever the flake or the source.
    _root_only()
    if builds_follow_tmpdir():
        pytest.skip("Nix before 2.30 builds under a directory others can write (its TMPDIR, /tmp) without a word")
    shared = Path(tempfile.mkdtemp(prefix="fdl-open-builds-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        monkeypatch.setenv("NIX_CONFIG", f"{NIX_CONFIG}build-dir = {shared}\n")
        src = git_source(trainer(nonce=_nonce()))
        with pytest.raises(Fail) as caught:
            build(_cpu_spec(test_flake, src.url, tmp_path), [])
        # The attempt's own directory under it went all the same.
        assert not list(shared.glob("fdl-prepare-nix.*"))
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    fail = caught.value
    assert fail.permanent and fail.reason == "nix.build-dir", fail.message
    assert "world-writable" in fail.message
    assert "Nix installation" in _fix(fail) and "not under /tmp" in _fix(fail)


@pytest.mark.parametrize(
    ("store", "setting"),
    [
        ("daemon", "daemon"),
        ("unix:///run/fdl-elsewhere/socket", "daemon"),
        ("ssh-ng://builder.invalid", "daemon"),
        # A local store of its own somewhere else: TMPDIR's own covers it.
        ("local?root=/srv/fdl-chroot", None),
        ("/srv/fdl-chroot", None),
    ],
)
def test_a_store_another_process_builds_for_is_given_no_build_dir_of_ours(
    nix_env, tmp_path, monkeypatch, store, setting
):
    # Real Nix reads the setting (`config show` opens no store): where another
    # process builds, that process's own settings decide where; a build-dir
    # of ours would name a path on another host, or one it does not use.
    monkeypatch.setenv("NIX_CONFIG", f"{NIX_CONFIG}store = {store}\n")
    where = Nix(str(tmp_path)).where_builds()
    assert (where.setting if where else None) == setting


def test_a_local_store_builds_in_nix_s_build_dir_where_it_has_one(nix_env, tmp_path, monkeypatch):
    _root_only()
    runner = Nix(str(tmp_path))
    where = runner.where_builds()
    if "build-dir" not in box_settings():
        assert where is None  # 2.8: builds follow TMPDIR, the attempt's own
    elif builds_follow_tmpdir():
        assert where is None  # 2.26 with none set: TMPDIR still
    else:
        assert where == BuildDir(str(NIX_BUILDS), "build-dir")
    if "build-dir" in box_settings():
        monkeypatch.setenv("NIX_CONFIG", f"{NIX_CONFIG}build-dir = /srv/fdl-builds\n")
        assert Nix(str(tmp_path)).where_builds() == BuildDir("/srv/fdl-builds", "build-dir")


_FILLS_ITS_BUILD_DIR = """{
  outputs = { self }: {
    big = derivation {
      name = "fills-its-build-dir-NONCE";
      system = "SYSTEM";
      builder = "/bin/sh";
      args = [ "-c" "/usr/bin/head -c 8000000 /dev/zero > big && echo done > $out" ];
    };
  };
}
"""


def test_a_full_disk_under_the_daemons_builds_is_permanent_and_names_the_daemons_directory(nix_env, tmp_path):
    # A real nix-daemon whose builds go to a 4 MiB tmpfs (its TMPDIR on 2.8
    # and 2.26, its build-dir from 2.30), and a client that is another user.
    # Where the daemon builds is its own to say: the client gives it no
    # build-dir (a daemon takes none from a user it does not trust), and the
    # failure names the daemon's directory, not the client's TMPDIR.
    _root_only()
    follows = builds_follow_tmpdir()
    flake = tmp_path / "big"
    flake.mkdir()
    (flake / "flake.nix").write_text(
        _FILLS_ITS_BUILD_DIR.replace("NONCE", _nonce()).replace("SYSTEM", nix_mod.system())
    )
    with small_disk(private=not follows) as point:
        daemon_env = {"TMPDIR": str(point)} if follows else {"NIX_CONFIG": f"{NIX_CONFIG}build-dir = {point}\n"}
        with nix_daemon_client(f"path:{flake}", daemon_env=daemon_env) as (runner, copy):
            with pytest.raises(Fail) as caught:
                runner.build([f"path:{copy}#big"], out_link=None)
            argv = runner._common()
    fail = caught.value
    assert fail.permanent and fail.reason == "nix.no-space", fail.message
    assert "No space left on device" in fail.message
    assert "(the build directory, the Nix daemon's: under its build-dir" in fail.message
    assert "restart nix-daemon" in _fix(fail) and "TMPDIR=" not in fail.message
    assert "build-dir" not in [argv[i + 1] for i, a in enumerate(argv) if a == "--option"]


def test_a_flake_build_that_cannot_find_its_tools_in_the_sandbox_blames_the_flake(
    nix_env, make_flake, tmp_path, monkeypatch
):
    # Debian 13 and NixOS build in a sandbox; a builder that runs the host's
    # mkdir then fails whatever the training source says. The sandbox here
    # lends a shell and the libraries it links, and none of /usr/bin.
    _root_only()
    lent = [f"/bin/sh={os.path.realpath('/bin/sh')}"]
    lent += [p for p in ("/lib", "/lib64", "/usr/lib", "/usr/lib64") if os.path.lexists(p)]
    label = f"sbx{_nonce()}"
    flake = make_flake(
        extra_nix=f"""toolchain: {{
  {label} = {{ cuda = null; archs = [ ]; package = toolchain.mkLibtorch {{ label = "{label}"; }}; }};
}}
"""
    )
    monkeypatch.setenv("NIX_CONFIG", NIX_CONFIG + f"sandbox = true\nsandbox-paths = {' '.join(lent)}\n")
    with pytest.raises(Fail) as caught:
        build(PrepareSpec(libtorch=label, cpu_only=False, flake=flake, state_dir=str(tmp_path / "state")), [])
    fail = caught.value
    assert fail.permanent
    assert f"fdl-test-libtorch-{label}" in fail.message
    assert "mkdir" in fail.message and "not found" in fail.message
    fix = _fix(fail)
    assert "flake" in fix and "sandbox" in fix and "training source" not in fix


_WHICH_SHELL = """{
  outputs = { self }: {
    shell = derivation {
      name = "which-shell-NONCE";
      system = "SYSTEM";
      builder = "/bin/sh";
      args = [ "-c" "PATH=/usr/bin:/bin; sha256sum /bin/sh | cut -d ' ' -f 1 > $out" ];
    };
  };
}
"""


def test_the_shell_lent_to_the_sandbox_is_the_one_its_builders_run(nix_env, tmp_path, monkeypatch):
    """The tests' sandbox-paths lend the host's /bin/sh, and the builder
    gets that shell, not the box's default (Debian's 2.26 and 2.34 build in
    /usr/bin/bash-static, which 2.34 keeps over an `extra-sandbox-paths`
    entry for /bin/sh)."""
    _root_only()
    import hashlib

    flake = tmp_path / "shell"
    flake.mkdir()
    (flake / "flake.nix").write_text(_WHICH_SHELL.replace("NONCE", _nonce()).replace("SYSTEM", nix_mod.system()))
    monkeypatch.setenv("NIX_CONFIG", NIX_CONFIG + "sandbox = true\n")
    runner = Nix(str(tmp_path / "state"))
    (tmp_path / "state").mkdir()
    results, _ = runner.build([f"path:{flake}#shell"], out_link=None)
    seen = Path(results[0]["outputs"]["out"]).read_text().strip()
    assert seen == hashlib.sha256(Path(os.path.realpath("/bin/sh")).read_bytes()).hexdigest()


def test_the_sandbox_paths_keep_the_boxs_own_entries_that_the_lent_ones_do_not_replace(monkeypatch):
    box = ["/bin/sh=/usr/bin/bash-static", "/run/binfmt?", "/usr/lib/locale=/srv/locale", "/usr-extra"]
    monkeypatch.setattr(nix_fixtures, "box_sandbox_paths", lambda: box)
    lent = ["/bin/sh=/usr/bin/dash", "/usr"]
    assert sandbox_paths(lent).split() == ["/run/binfmt?", "/usr-extra", "/bin/sh=/usr/bin/dash", "/usr"]
    # the lent list itself: a shell, /usr, and what the host's loader needs
    assert SANDBOX_LENT[1] == "/usr" and (SANDBOX_LENT[0] == "/bin" or SANDBOX_LENT[0].startswith("/bin/sh=/"))


def test_a_failing_training_build_still_blames_the_training_source(nix_env, test_flake, git_source, tmp_path):
    src = git_source(trainer(build="echo no compiler here >&2; exit 4", nonce=_nonce()))
    spec = _cpu_spec(test_flake, src.url, tmp_path)
    with pytest.raises(Fail) as caught:
        build(spec, [])
    assert not caught.value.permanent
    assert "fix the training source" in _fix(caught.value)


# -- one reading of every version's JSON ---------------------------------------------


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        # 2.8: a store path installable
        ({"path": "/nix/store/aaaa-src"}, {"path": "/nix/store/aaaa-src"}),
        # 2.26: the same, as a bare string
        ("/nix/store/aaaa-src", {"path": "/nix/store/aaaa-src"}),
        # both: a derivation; later versions add fields, which are kept
        (
            {"drvPath": "/nix/store/b.drv", "outputs": {"out": "/nix/store/b"}, "startTime": 1},
            {"drvPath": "/nix/store/b.drv", "outputs": {"out": "/nix/store/b"}, "startTime": 1},
        ),
        # 2.26 and 2.34: a derivation built by this call, with its times
        (
            {
                "drvPath": "/nix/store/b.drv",
                "outputs": {"out": "/nix/store/b"},
                "startTime": 1796155525,
                "stopTime": 1796155526,
            },
            {
                "drvPath": "/nix/store/b.drv",
                "outputs": {"out": "/nix/store/b"},
                "startTime": 1796155525,
                "stopTime": 1796155526,
            },
        ),
    ],
)
def test_a_build_result_reads_the_same_from_every_version(raw, want):
    assert build_result(raw) == want


@pytest.mark.parametrize("raw", [None, 3, "relative", {"drvPath": "/x.drv"}, {"outputs": {"out": 1}}, []])
def test_a_build_result_of_an_unknown_shape_is_refused(raw):
    with pytest.raises(ValueError):
        build_result(raw)


def test_an_unknown_shape_from_nix_build_is_a_fail_not_a_traceback(tmp_path):
    # A stand-in nix that answers the version and prints JSON of a shape no
    # version has: the one seam where a real Nix cannot be made to do it.
    fake = tmp_path / "nix"
    fake.write_text("#!/bin/sh\ncase \"$1\" in --version) echo 'nix (Nix) 2.26.3';; *) echo '[{\"x\": 1}]';; esac\n")
    fake.chmod(0o755)
    runner = Nix(str(tmp_path), program=str(fake))
    with pytest.raises(Fail) as caught:
        runner.build(["/nix/store/aaaa-x"], out_link=None)
    assert not caught.value.permanent and "known shape" in caught.value.message
