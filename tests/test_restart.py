"""The dataset mount outlives a restart of the unit (prepare/data/mount.py runs
sshfs in a transient scope of its own under systemd).

`systemctl restart` kills every process left in the unit's cgroup, the
sshfs daemon too when it was started there, and the mount under a running
job goes with it. tests/restart_box.py restarts a unit that way for real
(cgroups, cgroup.kill, sshfs against the loopback sshd) in a mount
namespace of its own; with systemd there, the daemon has moved out and the
mount is alive and reused by the next attempt. Without systemd (`plain`),
the same restart kills it, which is what shows the test kills what systemd
kills; the next attempt repairs the mount.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sshfs

BOX = Path(__file__).resolve().parent / "restart_box.py"


def _cgroup2_root() -> str | None:
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            fields = line.split()
            if fields[fields.index("-") + 1] == "cgroup2":
                return fields[4]
    return None


def restart(sshd, remote_tree: Path, tmp_path: Path, *, systemd: bool, refuse_scope: bool = False) -> dict:
    if os.geteuid() != 0:
        pytest.skip("cgroups and mount namespaces need root")
    root = _cgroup2_root()
    if root is None or not os.access(root, os.W_OK) or shutil.which("unshare") is None:
        pytest.skip("needs a writable cgroup2 hierarchy and unshare (util-linux)")
    if systemd and not os.path.isdir("/run/systemd"):
        pytest.skip("no /run/systemd to lay a tmpfs over")
    point = tmp_path / "data"
    point.mkdir()
    (tmp_path / "home").mkdir()
    (tmp_path / "stage").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    args = ["--cpu-only", "--json", "--config", os.devnull, "--data-source", sshd.source(remote_tree)]
    args += ["--data-path", str(point), "--identity-file", str(sshd.user_key)]
    for option in sshd.options:
        args += ["--ssh-option", option]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp_path / "stage"),
        "LD_LIBRARY_PATH": str(tmp_path / "no-nvml-here"),
    }
    spec = {
        "work": str(work),
        "point": str(point),
        "systemd": systemd,
        "refuse_scope": refuse_scope,
        "args": args,
        "env": env,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, str(BOX), str(work / "spec.json")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _notes(attempt: dict) -> list[str]:
    assert attempt["code"] == 0, attempt["stderr"]
    return json.loads(attempt["stdout"])["notes"]


def test_under_systemd_the_mount_outlives_a_restart_of_the_unit_and_is_reused(
    sshd, remote_tree: Path, tmp_path: Path, forget_mount_lock_of
) -> None:
    forget_mount_lock_of(tmp_path / "data")
    got = restart(sshd, remote_tree, tmp_path, systemd=True)
    first, second = got["attempts"]
    assert any("mounted `" in n and "read-only" in n for n in _notes(first))
    # The daemon was started in a scope of its own, not in the unit.
    assert got["daemons"] and all("fdl-test-scope-" in c for c in got["daemons"]), got
    assert got["left_in_unit"] == 0
    assert "--scope" in got["scope_args"] and "--collect" in got["scope_args"]
    # systemd's restart killed nothing the mount needs; the next attempt reuses it.
    assert got["alive_after_restart"]
    assert any("already mounted from" in n and "reusing it" in n for n in _notes(second)), _notes(second)
    assert got["alive_at_the_end"]


def test_without_a_scope_the_same_restart_kills_the_mount_and_the_next_attempt_repairs_it(
    sshd, remote_tree: Path, tmp_path: Path, forget_mount_lock_of
) -> None:
    # No systemd in this namespace: as before, the daemon stays in the
    # unit's cgroup, and killing the cgroup takes the mount down.
    forget_mount_lock_of(tmp_path / "data")
    got = restart(sshd, remote_tree, tmp_path, systemd=False)
    first, second = got["attempts"]
    assert _notes(first)
    assert got["daemons"] and all(c == got["unit"] for c in got["daemons"]), got
    assert got["left_in_unit"] >= 1
    assert not got["alive_after_restart"]
    assert any("had lost its sshfs process" in n for n in _notes(second)), _notes(second)
    assert got["alive_at_the_end"]


def test_a_scope_systemd_refuses_still_mounts_and_says_the_mount_will_not_outlive_a_restart(
    sshd, remote_tree: Path, tmp_path: Path, forget_mount_lock_of
) -> None:
    forget_mount_lock_of(tmp_path / "data")
    got = restart(sshd, remote_tree, tmp_path, systemd=True, refuse_scope=True)
    notes = _notes(got["attempts"][0])
    assert any("systemd-run could not give the sshfs mount" in n and "Access denied" in n for n in notes), notes
    assert any("mounted `" in n for n in notes)
    assert got["daemons"] and all(c == got["unit"] for c in got["daemons"]), got
