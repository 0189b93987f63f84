"""As root, a config only root could have written (prepare/host/trust.py): one
that another user owns, or that they may write, or that sits in a directory
they may write, is refused with exit 78 before anything in it is acted on.
Real files, modes and owners; the command as systemd runs it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from console import fdl_prepare

from prepare.host import trust

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the checks are root's, and chown needs root")

OTHER = 54321


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "home").mkdir()
    (tmp_path / "stage").mkdir()
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp_path / "stage"),
        "LD_LIBRARY_PATH": str(tmp_path / "no-nvml-here"),
    }


def write_config(folder: Path, text: str = "[join]\ncpu_only = true\n", mode: int = 0o644) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "prepare.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


def run(env: dict[str, str], config: Path) -> subprocess.CompletedProcess[str]:
    return fdl_prepare(env, "--config", str(config))


def test_a_config_only_root_can_write_is_read(tmp_path, env):
    done = run(env, write_config(tmp_path / "etc"))
    assert done.returncode == 0, done.stderr


def test_a_config_others_may_write_is_refused_before_its_ssh_options_run(tmp_path, env):
    # The attack the issue saw: a world-writable config whose ssh option
    # runs a command as root. It must not get as far as ssh.
    marker = tmp_path / "ran-as-root"
    config = write_config(
        tmp_path / "etc",
        "[join]\ncpu_only = true\n"
        f'data_source = "sshfs://data@127.0.0.1:1/srv"\ndata_path = "{tmp_path / "mnt"}"\n'
        f'[join.ssh]\noptions = ["ProxyCommand=touch {marker}"]\n',
        mode=0o666,
    )
    done = run(env, config)
    assert done.returncode == 78, done.stderr
    assert "is not trusted" in done.stderr and "is writable by its group and others (mode 0666)" in done.stderr
    assert f"sudo chmod go-w {config}" in done.stderr
    assert not marker.exists()


def test_a_config_owned_by_another_user_is_refused_naming_chown(tmp_path, env):
    config = write_config(tmp_path / "etc")
    os.chown(config, OTHER, OTHER)
    done = run(env, config)
    assert done.returncode == 78, done.stderr
    assert f"is owned by uid {OTHER}" in done.stderr and f"sudo chown root: {config}" in done.stderr


def test_a_config_in_a_directory_others_may_write_is_refused_naming_the_directory(tmp_path, env):
    folder = tmp_path / "open"
    config = write_config(folder)
    folder.chmod(0o777)
    done = run(env, config)
    assert done.returncode == 78, done.stderr
    assert f"{folder} is a directory writable by its group and others (mode 0777)" in done.stderr
    assert f"sudo chmod go-w {folder}" in done.stderr


def test_a_config_in_a_directory_of_another_user_is_refused(tmp_path, env):
    folder = tmp_path / "theirs"
    config = write_config(folder)
    os.chown(folder, OTHER, OTHER)
    done = run(env, config)
    assert done.returncode == 78, done.stderr
    assert f"{folder} is a directory owned by uid {OTHER}" in done.stderr


def test_a_root_owned_config_in_a_sticky_directory_is_read(tmp_path, env):
    # /tmp, or /nix/store (group-writable by nixbld, sticky), where NixOS
    # keeps the config the module renders.
    folder = tmp_path / "sticky"
    config = write_config(folder)
    folder.chmod(0o1777)
    assert run(env, config).returncode == 0


def test_another_users_file_in_a_sticky_directory_is_refused(tmp_path, env):
    folder = tmp_path / "sticky"
    config = write_config(folder)
    folder.chmod(0o1777)
    os.chown(config, OTHER, OTHER)
    done = run(env, config)
    assert done.returncode == 78 and f"is owned by uid {OTHER}, in {folder}, which others may write" in done.stderr


def test_a_symlinked_config_is_judged_by_every_directory_it_leads_through(tmp_path, env):
    # /etc/fdl/prepare.toml -> /etc/static/... on NixOS: a link is fine, but
    # where it leads is held to the same rule.
    target = write_config(tmp_path / "open")
    (tmp_path / "open").chmod(0o777)
    link_dir = tmp_path / "etc"
    link_dir.mkdir()
    (link_dir / "prepare.toml").symlink_to(target)
    done = run(env, link_dir / "prepare.toml")
    assert done.returncode == 78, done.stderr
    assert f"{tmp_path / 'open'} is a directory writable by" in done.stderr


def test_a_relative_symlink_with_dotdot_is_followed_as_the_kernel_follows_it(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "c").mkdir()
    write_config(tmp_path / "c")
    (tmp_path / "a" / "b" / "link.toml").symlink_to("../../c/prepare.toml")
    assert trust.doubt(str(tmp_path / "a" / "b" / "link.toml")) is None
    (tmp_path / "c").chmod(0o777)
    found = trust.doubt(str(tmp_path / "a" / "b" / "link.toml"))
    assert found is not None and found.path == str(tmp_path / "c")


def test_a_user_other_than_root_is_trusted_with_their_own_config():
    import shutil
    import tempfile

    import other_user

    folder = Path(tempfile.mkdtemp(prefix="fdl-trust-"))
    try:
        folder.chmod(0o755)
        config = write_config(folder, mode=0o666)
        os.chown(config, OTHER, OTHER)
        code = f"from prepare import config\nprint(config.load({str(config)!r}))\n"
        done = other_user.run_as(OTHER, code)
        assert done.returncode == 0, done.stderr
        assert "cpu_only" in done.stdout
    finally:
        shutil.rmtree(folder)
