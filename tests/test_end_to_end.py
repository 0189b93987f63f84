"""The whole pipeline through the console script, every part real at once:
the stand-in NVML library with two Ampere cards, an sshfs mount from the
loopback sshd, the local directories, and a build through the test flake
from a git source with a published manifest. This is what a join loop sees
on a healthy box, and what it sees when it asks again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from console import fdl_prepare
from nix_fixtures import trainer
from nvml_fixtures import ampere_pair

from prepare.host import dirs, mounts

pytestmark = [pytest.mark.sshfs, pytest.mark.nix]

# The trainer reports the libtorch it was built against, so the test can
# tell the variant reached the build, not only the summary.
BUILD = (
    'printf \'#!/bin/sh\\necho built against %s at %s\\n\' "$FDL_LIBTORCH_VARIANT" "$LIBTORCH" > train '
    "&& chmod +x train"
)


def _config(path: Path, **tables: dict[str, object]) -> Path:
    lines: list[str] = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        for key, value in table.items():
            lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def shared_stage() -> Iterator[Path]:
    """A stage the Nix build users can enter, as /tmp is: a single-user Nix
    (Debian's nix-bin, as root) puts its build directories under $TMPDIR,
    and pytest's own temp tree is private to root."""
    stage = Path(tempfile.mkdtemp(prefix="fdl-e2e-stage-", dir="/tmp"))
    stage.chmod(0o1777)
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def test_a_healthy_gpu_box_is_prepared_end_to_end_and_a_second_attempt_changes_nothing(
    fake_nvml,
    sshd,
    sshfs_mounts,
    remote_tree,
    nix_env,
    test_flake,
    git_source,
    state_dir,
    forget_mount_lock_of,
    shared_stage: Path,
    tmp_path: Path,
) -> None:
    stage = shared_stage
    point = sshfs_mounts.point("data")
    forget_mount_lock_of(point)
    source = git_source(
        trainer(manifest={"bin": "train", "build": BUILD, "args": ["--epochs", "1"], "run": "e2e-1", "built": True})
    )
    config = _config(
        tmp_path / "prepare.toml",
        join={
            "data_source": sshd.source(remote_tree),
            "data_path": str(point),
            "libtorch": "auto",
            "flake": test_flake,
            "state_dir": state_dir,
        },
        **{
            "join.source": {"from": source.url},
            "join.ssh": {"identity_file": str(sshd.user_key), "options": list(sshd.options)},
        },
    )
    (tmp_path / "home").mkdir()
    env = fake_nvml.box(ampere_pair(), cuda=(12, 8)).env(nix_env)
    env.update(HOME=str(tmp_path / "home"), TMPDIR=str(stage))
    env.pop("CUDA_VISIBLE_DEVICES", None)

    first = fdl_prepare(env, "--config", str(config), "--json", timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    done = json.loads(first.stdout)

    assert done["devices"] == [0, 1]
    assert list(done["timings"]) == ["gate", "data", "dirs", "state", "variant", "source", "build"]
    assert done["data_path"] == str(point)
    mount = mounts.mounted_at(str(point))
    assert mount is not None and mount.fstype == "fuse.sshfs" and mount.read_only
    assert sorted(os.listdir(point)) == sorted(os.listdir(remote_tree))
    assert done["libtorch"]["variant"] == "cu128"
    assert done["run_id"] == "e2e-1" and done["args"] == ["--epochs", "1"]
    ran = subprocess.run([done["bin"]["path"]], capture_output=True, text=True, cwd=done["bin"]["cwd"], check=True)
    assert ran.stdout == f"built against cu128 at {done['libtorch']['path']}\n"

    second = fdl_prepare(env, "--config", str(config), "--json", timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    again = json.loads(second.stdout)
    for key in ("devices", "data_path", "libtorch", "bin", "args", "run_id"):
        assert again[key] == done[key], key
    assert any("nothing built, nothing downloaded" in note for note in again["notes"]), again["notes"]
    assert any("reusing it" in note for note in again["notes"]), again["notes"]
    assert [m.mount_point for m in mounts.read()].count(str(point)) == 1
    assert not [name for name in os.listdir(stage) if name.startswith(dirs.PROBE_PREFIX)]
    assert not [
        name for name in os.listdir(tmp_path / "home" / ".flodl" / "data") if name.startswith(dirs.PROBE_PREFIX)
    ]
