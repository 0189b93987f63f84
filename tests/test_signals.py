"""Children die with fdl-prepare, even on SIGKILL, when no handler of ours
runs (prepare/host/proc.py asks the kernel for PR_SET_PDEATHSIG in each child).
SIGINT and SIGTERM are in tests/test_cli.py and tests/test_build.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nix_fixtures import (
    MANIFEST,
    NIX_BUILDS,
    NIX_CONFIG,
    build,
    builds_follow_tmpdir,
    manifest_text,
    private_dir,
    procs_with,
    trainer,
)

from prepare.host import proc

REPO = Path(__file__).resolve().parent.parent


def test_every_child_is_started_with_sigkill_as_its_parent_death_signal():
    probe = "import ctypes; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"
    done = proc.run([sys.executable, "-c", probe], timeout=30)
    assert done.ok, done.stderr
    assert int(done.stdout) == signal.SIGKILL


def _wait_gone(text: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while procs_with(text):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_child_dies_when_its_caller_is_sigkilled(tmp_path):
    marker = f"{time.time_ns() % 100000 + 300}.{os.getpid()}"
    code = f"from prepare.host import proc\nproc.run(['sleep', '{marker}'])\n"
    caller = subprocess.Popen([sys.executable, "-c", code], cwd=str(REPO))
    try:
        deadline = time.monotonic() + 30
        while not procs_with(f"sleep {marker}"):
            assert caller.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        caller.kill()  # SIGKILL: no handler, no finally, nothing of ours runs
        caller.wait(timeout=10)
        assert _wait_gone(f"sleep {marker}", 5), procs_with(f"sleep {marker}")
    finally:
        for pid, _ in procs_with(f"sleep {marker}"):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.nix
def test_a_sigkilled_prepare_leaves_no_nix_to_rewrite_the_out_links(nix_env, test_flake, state_dir, git_source):
    # The case: fdl-prepare SIGKILLed mid-build orphaned nix, which
    # later rewrote the out-links with the state lock long released.
    from prepare.spec import PrepareSpec, SourceSpec

    src = git_source(trainer())
    s = PrepareSpec(
        source=SourceSpec(from_=src.url), libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=state_dir
    )
    build(s, [])
    roots = os.path.join(state_dir, "gcroots")
    before = {n: os.readlink(os.path.join(roots, n)) for n in os.listdir(roots)}

    # A build that takes a few seconds: long enough to be killed in, short
    # enough to see that nothing writes the links once it would have ended.
    marker = f"4.{os.getpid()}{time.time_ns() % 1000}"
    slow = f"sleep {marker}; printf '#!/bin/sh\\n' > train; chmod +x train"
    src.commit({MANIFEST: manifest_text(bin="train", build=slow)}, "slow build")
    argv = [sys.executable, "-m", "prepare", "--cpu-only", "--libtorch", "cpu", "--flake", test_flake]
    argv += ["--source", src.url, "--state-dir", state_dir]
    child = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "NIX_CONFIG": NIX_CONFIG},
        cwd=str(REPO),
    )
    try:
        deadline = time.monotonic() + 60
        while not procs_with(f"sleep {marker}"):
            assert child.poll() is None, "prepare ended before its build started"
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.05)
        child.kill()
        child.wait(timeout=10)
        # nix itself goes with it at once.
        assert _wait_gone(f"--out-link {roots}", 5), procs_with(f"--out-link {roots}")
        # Past the time the build would have taken: no one wrote the links.
        time.sleep(float(marker) + 1)
        after = {n: os.readlink(os.path.join(roots, n)) for n in os.listdir(roots)}
        assert after == before
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid, _ in procs_with(f"sleep {marker}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _forget_killed_attempt(state_dir)


def _forget_killed_attempt(state_dir: str) -> None:
    """What a killed attempt left (its TMPDIR and build-dir, recorded in
    <state>/nix-tmp), which the next attempt on this state directory would
    have removed: none comes after a test (on 2.34 it is in the box's
    /nix/var/nix/builds)."""
    with contextlib.suppress(OSError):
        for line in Path(state_dir, "nix-tmp").read_text().splitlines():
            if Path(line).name.startswith("fdl-prepare-nix."):
                shutil.rmtree(line, ignore_errors=True)


def _ours(parent: Path) -> set[Path]:
    return set(parent.glob("fdl-prepare-nix.*")) if parent.is_dir() else set()


@pytest.mark.nix
@pytest.mark.parametrize("sandbox", ["true", "false"])
def test_the_build_directory_a_sigkilled_prepare_left_goes_with_the_next_attempt(
    nix_env, test_flake, state_dir, git_source, sandbox
):
    # A TMPDIR of this test's own that Nix's build users can enter, and only
    # root can write, nor any directory above it (else it is set aside).
    tmp = private_dir("fdl-sigkill-tmp-")
    # Where this Nix makes a build's directory: under TMPDIR (2.8, 2.26), or
    # in its build-dir (2.30 and later), where the attempt has one of its own.
    parent = tmp if builds_follow_tmpdir() else NIX_BUILDS
    before = _ours(NIX_BUILDS)
    marker = f"30.{os.getpid()}{time.time_ns() % 1000}"
    build = f"sleep {marker}; printf '#!/bin/sh\\n' > train; chmod +x train"
    src = git_source({MANIFEST: manifest_text(bin="train", build=build)})
    argv = [sys.executable, "-m", "prepare", "--cpu-only", "--libtorch", "cpu", "--flake", test_flake]
    argv += ["--source", src.url, "--state-dir", state_dir]
    env = {**os.environ, "NIX_CONFIG": f"{NIX_CONFIG}sandbox = {sandbox}\n", "TMPDIR": str(tmp)}
    record = Path(state_dir, "nix-tmp")
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=str(REPO))
    try:
        deadline = time.monotonic() + 60
        while not procs_with(f"sleep {marker}"):
            assert child.poll() is None, "prepare ended before its build started"
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.05)
        child.kill()
        child.wait(timeout=10)
        # A builder may outlive its nix by a moment (see above); this test is
        # about what it leaves on disk, so it is stopped here.
        for pid, _ in procs_with(f"sleep {marker}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert _wait_gone(f"sleep {marker}", 10)
        # What the killed build left: its directory (nix-build-<drv>-<n> up
        # to 2.30, nix-<pid>-<n> since), a copy of the source, inside a
        # directory of the attempt's own, which the attempt recorded.
        recorded = [Path(line) for line in record.read_text().splitlines()]
        assert recorded and all(p.parent in (tmp, parent) and p.name.startswith("fdl-prepare-nix.") for p in recorded)
        left = [b for d in recorded if d.parent == parent for b in d.iterdir() if b.name.startswith("nix-")]
        assert left, f"no build directory in {recorded}"
        src.commit({MANIFEST: manifest_text(bin="train", build="printf '#!/bin/sh\\n' > train; chmod +x train")})
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=300)
        assert done.returncode == 0, done.stderr
        assert not [p for p in [*recorded, *left] if p.exists()], f"left behind: {left} (in {recorded})"
        # The next attempt's own went at its end, with the record.
        assert not record.exists()
        assert not _ours(tmp) and _ours(NIX_BUILDS) == before
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid, _ in procs_with(f"sleep {marker}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _forget_killed_attempt(state_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        for mine in _ours(NIX_BUILDS) - before:
            shutil.rmtree(mine, ignore_errors=True)
