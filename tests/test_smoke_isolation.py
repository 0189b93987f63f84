"""The smoke run shares nothing of the box's that it could read, write or
leave behind: its own /proc (no other process of the box in it), its own
/tmp, /var/tmp and /dev/shm (what it leaves goes with it; what another
user planted there is out of its sight), bounds on its processes and file
sizes, a uid of its own, and a home that outlives no attempt.

Each test runs the real smoke run (prepare.smoke.run, as root) of a shell
script that reports what it could reach, next to real processes and files
of the host's."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from other_user import reachable_dir

from prepare import smoke
from prepare.host import confine
from prepare.spec import Binary

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="fdl-prepare runs as root; the run drops to another user")


@pytest.fixture
def public() -> Iterator[Path]:
    path = reachable_dir("fdl-smoke-iso-")
    out = path / "out"
    out.mkdir()
    out.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def script(path: Path, body: str) -> Binary:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return Binary(path=str(path), cwd=str(path.parent))


def _report(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


PROBE = """
out="$1"; pid="$2"; mark="$3"
{
  echo "uid=$(id -u)"
  if grep -q "FDL_SECRET" "/proc/$pid/environ" 2>/dev/null; then echo "environ=read"; else echo "environ=denied"; fi
  if [ -e "/proc/$pid" ]; then echo "their_proc=seen"; else echo "their_proc=absent"; fi
  echo "pids=$(ls -d /proc/[0-9]* | wc -l)"
  if [ -e "/tmp/fdl-planted-$mark" ]; then echo "planted=seen"; else echo "planted=absent"; fi
  for d in /tmp /var/tmp /dev/shm; do echo left > "$d/fdl-left-$mark" && echo "wrote $d=yes"; done
  echo "home=$HOME"
  grep -E '^Max (processes|file size|core file size)' /proc/self/limits | sed -E 's/ +/ /g; s/^Max ([a-z ]+[a-z]) /\\1=/'
} > "$out"
"""


def test_the_smoke_run_sees_its_own_proc_and_tmp_and_runs_bounded_as_a_uid_of_its_own(public):
    mark = f"{os.getpid()}{time.time_ns() % 100000}"
    # Another `nobody` process of the box's, with a secret in its environment.
    theirs = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "sleep", "60"],
        env={"PATH": "/usr/bin:/bin", "FDL_SECRET": "not-for-the-smoke-run"},
    )
    planted = Path(f"/tmp/fdl-planted-{mark}")
    planted.write_text("planted by another user\n")
    report = public / "out" / "report"
    notes: list[str] = []
    try:
        time.sleep(0.2)
        smoke.run(script(public / "train", PROBE), [str(report), str(theirs.pid), mark], 30, notes)
    finally:
        theirs.kill()
        theirs.wait()
        planted.unlink()
    seen = _report(report)
    print(seen, notes)
    assert seen["environ"] == "denied" and seen["their_proc"] == "absent", seen
    # Its own PID namespace's /proc: itself, its shell's children, no more.
    assert int(seen["pids"]) < 10, seen
    assert seen["planted"] == "absent", seen
    # It could write in each, and nothing it wrote is on the box after it.
    assert all(seen.get(f"wrote {d}") == "yes" for d in ("/tmp", "/var/tmp", "/dev/shm")), seen
    assert not [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.exists(f"{d}/fdl-left-{mark}")]
    assert not os.path.exists(seen["home"])
    # Bounded: processes, one file's size, no core.
    limits = {k: v.split()[0] for k, v in seen.items() if k in ("processes", "file size", "core file size")}
    assert limits == {"processes": "8192", "file size": str(64 << 30), "core file size": "0"}, seen
    # A uid of its own: not nobody, no user of the box's, not Nix's build users'.
    uid = int(seen["uid"])
    assert uid != NOBODY and confine.DYNAMIC_UIDS[0] <= uid <= confine.DYNAMIC_UIDS[1], uid
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    assert "with its own /proc, /tmp, /var/tmp and /dev/shm" in notes[0], notes


def test_a_dynamic_uid_is_never_one_a_process_runs_as_or_another_run_holds(public):
    import fcntl

    from prepare.host import locks

    low = confine.DYNAMIC_UIDS[0]
    # The first uid of the range runs a process; the second is held by
    # another smoke run (its lock, taken by another process).
    running = subprocess.Popen(["setpriv", f"--reuid={low}", f"--regid={low}", "--clear-groups", "--", "sleep", "60"])
    locks.private_dir(locks.ROOT_DIR)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({os.path.join(locks.ROOT_DIR, f'smoke-uid.{low + 1}')!r}, os.O_RDONLY | os.O_CREAT, 0o600)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    report = public / "out" / "uid"
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        time.sleep(0.1)
        smoke.run(script(public / "train", 'id -u > "$1"\n'), [str(report)], 30, [])
    finally:
        for child in (running, holder):
            child.kill()
            child.wait()
    uid = int(report.read_text())
    assert low + 1 < uid <= confine.DYNAMIC_UIDS[1], uid
    # Let go after the run: the next one may take it again.
    fd = locks.open_lock(os.path.join(locks.ROOT_DIR, f"smoke-uid.{uid}"))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_nix_build_user_as_smoke_user_is_permanent_naming_smoke_user(public):
    import grp

    try:
        builder = grp.getgrnam(confine.NIX_BUILD_GROUP).gr_mem[0]
    except (KeyError, IndexError):
        pytest.skip("this box has no Nix build users")
    with pytest.raises(Exception) as caught:
        smoke.run(script(public / "train", "exit 0\n"), [], 30, [], user=builder)
    fail = caught.value
    assert getattr(fail, "reason", None) == "config.invalid" and fail.permanent, fail  # type: ignore[attr-defined]
    assert f"smoke_user = {builder!r} is one of Nix's build users" in str(fail) and "--smoke-user" in str(fail)


SIGKILLED = """
import sys
from prepare import smoke
from prepare.spec import Binary
smoke.run(Binary(sys.argv[1], sys.argv[2]), [], 60, [])
"""


def test_the_home_of_a_smoke_run_whose_fdl_prepare_was_sigkilled_goes_with_the_next_attempt(public):
    marker = f"7{os.getpid() % 1000:03d}{time.time_ns() % 100}"
    binary = script(public / "train", f'echo "$HOME" > {public}/out/home\nexec sleep {marker}\n')
    before = {p for p in Path("/tmp").glob("fdl-smoke-*")}
    child = subprocess.Popen([sys.executable, "-c", SIGKILLED, binary.path, binary.cwd], cwd=str(REPO))
    try:
        deadline = time.monotonic() + 30
        while not (public / "out" / "home").exists() or not (public / "out" / "home").read_text().strip():
            assert time.monotonic() < deadline and child.poll() is None, "the smoke run never started"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    left = {p for p in Path("/tmp").glob(f"fdl-smoke-{child.pid}-*")} - before
    assert left, "the killed attempt left no home on the host (nothing to show)"
    smoke.run(script(public / "next", "exit 0\n"), [], 30, [])
    assert not [p for p in left if p.exists()], left
