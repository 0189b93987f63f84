"""Several prepares at once on one box, one data_source: one mount, all prepared.

A box runs one join loop, but systemd restarts, an operator's manual run and
a second worker unit all happen, and two sshfs processes stacked on one
mountpoint leave the lower one serving nobody. The mount is serialized by a
lock keyed by the mountpoint; these tests race real processes (the console
entry point, `python -m prepare`) and real threads (the library) against a
real sshd, and count what the kernel ends up with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from prepare import prepare
from prepare.data import root
from prepare.fail import Fail
from prepare.host import dirs, mounts

pytestmark = [pytest.mark.sshfs, pytest.mark.usefixtures("forget_mount_locks")]

RACERS = 4


def _mounts_at(point: Path) -> list[mounts.Mount]:
    return [m for m in mounts.read() if m.mount_point == str(point)]


def _leftovers(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith(dirs.PROBE_PREFIX))


def _split_notes(notes: list[list[str]], remote: str) -> tuple[int, int]:
    mounted = sum(1 for n in notes for line in n if line.startswith(f"mounted `{remote}` read-only"))
    reused = sum(1 for n in notes for line in n if "already mounted from" in line and "reusing it" in line)
    return mounted, reused


def test_four_concurrent_cli_runs_make_one_mount_all_succeed_and_leave_no_probe_files(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path
) -> None:
    point = sshfs_mounts.point("data")
    root.lock_path(str(point))  # recorded, so the lock file is removed afterwards
    home = tmp_path / "home"
    stage = tmp_path / "stage"
    home.mkdir()
    stage.mkdir()
    env = dict(os.environ, HOME=str(home), TMPDIR=str(stage), PYTHONDONTWRITEBYTECODE="1")
    env.pop("FDL_PREPARE_CONFIG", None)
    argv = [
        sys.executable, "-m", "prepare", "--cpu-only", "--json",
        "--data-source", sshd.source(remote_tree),
        "--data-path", str(point),
        "--identity-file", str(sshd.user_key),
        "--config", os.devnull,
    ]  # fmt: skip
    for option in sshd.options:
        argv += ["--ssh-option", option]

    racers = [
        subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(RACERS)
    ]
    outcomes = []
    try:
        for racer in racers:
            out, err = racer.communicate(timeout=180)
            outcomes.append((racer.returncode, out, err))
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
                racer.wait()

    for code, out, err in outcomes:
        assert code == 0, f"exit {code}\nstdout: {out}\nstderr: {err}"
    results = [json.loads(out) for _, out, _ in outcomes]
    assert all(r["data_path"] == str(point) for r in results)
    mounted, reused = _split_notes([r["notes"] for r in results], sshd.remote(remote_tree))
    assert (mounted, reused) == (1, RACERS - 1), [r["notes"] for r in results]

    at = _mounts_at(point)
    assert len(at) == 1, at
    assert at[0].fstype == "fuse.sshfs" and at[0].read_only

    assert _leftovers(home / ".flodl" / "data") == []
    assert os.listdir(home / ".flodl" / "data") == []
    assert _leftovers(stage) == []


def test_four_threads_calling_prepare_make_one_mount_and_all_get_the_same_root(
    sshd, sshfs_mounts, remote_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # flock belongs to an open file description, and each attempt opens the
    # lock afresh, so threads of one process exclude each other as processes do.
    point = sshfs_mounts.point("data")
    home = tmp_path / "home"
    stage = tmp_path / "stage"
    home.mkdir()
    stage.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(stage))
    spec = sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point))

    start = threading.Barrier(RACERS)
    notes: list[list[str]] = [[] for _ in range(RACERS)]
    roots: list[object] = [None] * RACERS

    def race(i: int) -> None:
        start.wait()
        try:
            roots[i] = prepare(spec, notes[i]).data_path
        except Fail as fail:
            roots[i] = fail

    threads = [threading.Thread(target=race, args=(i,)) for i in range(RACERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)

    assert roots == [str(point)] * RACERS, roots
    assert _split_notes(notes, sshd.remote(remote_tree)) == (1, RACERS - 1), notes
    assert len(_mounts_at(point)) == 1
    assert _leftovers(home / ".flodl" / "data") == []
    assert _leftovers(stage) == []
