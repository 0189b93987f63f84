"""The command as an operator and systemd see it: through the installed
console script, in a child process, judged by exit code and output."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from console import fdl_prepare


@pytest.fixture
def box(tmp_path: Path) -> dict[str, str]:
    """An environment for one run: its own HOME and TMPDIR, no config file
    from the host, and no NVML library anywhere the loader looks."""
    home = tmp_path / "home"
    stage = tmp_path / "stage"
    home.mkdir()
    stage.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(stage),
        "LD_LIBRARY_PATH": str(tmp_path / "no-nvml-here"),
        "FDL_PREPARE_CONFIG": str(tmp_path / "prepare.toml"),
    }
    (tmp_path / "prepare.toml").write_text("[join]\n")
    return env


def fdl(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return fdl_prepare(env, *args, timeout=timeout)


def test_version_prints_the_package_version() -> None:
    from prepare import __version__

    done = fdl(dict(os.environ), "--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"fdl-prepare {__version__}"


def test_help_lists_the_exit_codes_and_the_gpus_subcommand() -> None:
    done = fdl(dict(os.environ), "--help")
    assert done.returncode == 0
    assert "78 permanent" in done.stdout and "75 transient" in done.stdout
    assert "gpus" in done.stdout


def test_a_malformed_flag_is_a_usage_error_with_exit_2(box: dict[str, str]) -> None:
    done = fdl(box, "--devices", "zero,one")
    assert done.returncode == 2
    assert "--devices" in done.stderr or "devices" in done.stderr


def test_a_box_without_nvml_stops_at_the_gate_with_exit_78_and_names_cpu_only(box: dict[str, str]) -> None:
    done = fdl(box)
    assert done.returncode == 78, done.stderr
    assert "permanent failure" in done.stderr
    assert "--cpu-only" in done.stderr
    assert "exit 78" in done.stderr


def test_cpu_only_prepares_with_exit_0_and_a_json_prepared_with_timings_and_notes(box: dict[str, str]) -> None:
    done = fdl(box, "--cpu-only", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["devices"] is None
    assert out["data_path"] is None
    assert out["libtorch"] is None and out["bin"] is None and out["run_id"] is None
    assert list(out["timings"]) == ["gate", "data", "dirs"]
    assert all(isinstance(v, float) for v in out["timings"].values())
    assert any("gate" in note.lower() for note in out["notes"])
    assert (Path(box["HOME"]) / ".flodl" / "data").is_dir()


def test_a_permanent_failure_in_json_has_kind_and_a_message_naming_the_field(
    box: dict[str, str], tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-dataset"
    done = fdl(box, "--cpu-only", "--json", "--data-path", str(missing))
    assert done.returncode == 78
    out = json.loads(done.stdout)
    assert out["kind"] == "permanent"
    assert "data_path" in out["message"]
    assert str(missing) in out["message"]
    assert out["reason"] == "data.root-unusable"


def test_a_bad_config_file_is_permanent_and_names_the_key(box: dict[str, str]) -> None:
    Path(box["FDL_PREPARE_CONFIG"]).write_text('[join]\ncpu_only = "yes"\n')
    done = fdl(box, "--json")
    assert done.returncode == 78
    out = json.loads(done.stdout)
    assert out["kind"] == "permanent"
    assert "cpu_only" in out["message"]
    assert out["reason"] == "config.invalid"


def test_a_flag_wins_over_the_config_file(box: dict[str, str], tmp_path: Path) -> None:
    Path(box["FDL_PREPARE_CONFIG"]).write_text(f'[join]\ncpu_only = true\ndata_path = "{tmp_path / "absent"}"\n')
    done = fdl(box, "--json", "--data-path", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["data_path"] == str(tmp_path)


def test_the_human_summary_goes_to_stderr_and_stdout_stays_empty(box: dict[str, str]) -> None:
    done = fdl(box, "--cpu-only")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "fdl-prepare: prepared in" in done.stderr
    assert "gate skipped" in done.stderr


def test_a_root_flag_before_publish_is_a_usage_error(box: dict[str, str], tmp_path: Path) -> None:
    done = fdl(
        box, "--flake", "path:/x", "publish", str(tmp_path), "--bin", "t", "--to", "file:///c", "--signing-key", "k"
    )
    assert done.returncode == 2
    assert "--flake" in done.stderr and "publish" in done.stderr
