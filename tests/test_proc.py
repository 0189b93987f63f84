"""prepare/host/proc.py, the one seam every program goes through, with real
programs: output and exit status, timeouts that reach grandchildren, deaths
by signal, a program that is not there, and a grandchild that keeps the
pipes open after its parent is gone. Parent-death kills are in
tests/test_signals.py."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from nix_fixtures import procs_with

from prepare.host import proc

REPO = Path(__file__).resolve().parent.parent


def test_output_status_and_stderr_lines_as_they_arrive():
    lines: list[str] = []
    done = proc.run(["sh", "-c", "echo out; echo one >&2; echo two >&2; exit 3"], on_stderr_line=lines.append)
    assert (done.returncode, done.ok, done.stdout) == (3, False, "out\n")
    assert done.stderr == "one\ntwo\n" and lines == ["one", "two"]


def test_stdin_env_and_cwd_reach_the_program(tmp_path):
    done = proc.run(
        ["sh", "-c", 'cat; printf "%s %s" "$FDL_PROBE" "$(pwd)"'],
        stdin="given\n",
        env={"PATH": os.environ["PATH"], "FDL_PROBE": "seen"},
        cwd=str(tmp_path),
    )
    assert done.ok and done.stdout == f"given\nseen {tmp_path}"


def test_a_program_that_does_not_read_its_stdin_is_not_an_error():
    done = proc.run(["true"], stdin="x" * 1_000_000)
    assert done.ok


def test_output_that_is_not_utf8_is_replaced_not_raised():
    done = proc.run([sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'a\\xffb')"])
    assert done.stdout == "a\ufffdb"


def test_large_output_on_both_pipes_does_not_deadlock_and_stderr_keeps_its_last_lines():
    code = "import sys; sys.stdout.write('o' * 2_000_000); sys.stderr.write(''.join(f'{i:099d}' + chr(10) for i in range(20_000)))"
    done = proc.run([sys.executable, "-c", code], timeout=60)
    assert len(done.stdout) == 2_000_000 and done.stdout_cut == 0
    kept = done.stderr.splitlines()
    assert len(done.stderr) <= proc.STDERR_BYTES and done.stderr_cut + len(kept) == 20_000
    assert kept[-1] == f"{19_999:099d}" and kept[0] == f"{done.stderr_cut:099d}"


def test_stdout_past_the_callers_cap_keeps_its_end_and_says_how_much_went():
    done = proc.run(["sh", "-c", "head -c 100000 /dev/zero | tr '\\0' a; echo end"], max_stdout=1000)
    assert done.stdout.endswith("aend\n") and len(done.stdout) == 1000 and done.stdout_cut == 100004 - 1000


GIGABYTE = """
import resource, sys
from prepare.host import proc
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
lines = []
done = proc.run(["sh", "-c", sys.argv[1]], on_stderr_line=lines.append, max_stdout=1 << 16)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before, after, len(done.stdout), len(done.stderr), len(lines), max(map(len, lines)), done.stdout[-5:].strip())
"""


def test_a_program_printing_a_gigabyte_on_each_pipe_keeps_the_callers_memory_flat():
    # stdout past its cap, and stderr one line of a gigabyte with no newline
    # in it: what a caller sees of it is bounded, and so is what it costs.
    shell = (
        "head -c 1073741824 /dev/zero | tr '\\0' o; echo stop;"
        "head -c 1073741824 /dev/zero | tr '\\0' e >&2; echo >&2; echo last >&2"
    )
    done = subprocess.run(
        [sys.executable, "-c", GIGABYTE, shell], cwd=str(REPO), capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, out, err, lines, longest, end = done.stdout.split()
    grew_mib = (int(after) - int(before)) / 1024
    print(f"resident set grew {grew_mib:.1f} MiB")
    assert grew_mib < 64, f"the caller's resident set grew {grew_mib:.0f} MiB"
    assert int(out) == 1 << 16 and end == "stop"
    assert int(err) < proc.STDERR_BYTES and int(lines) == 2 and int(longest) <= proc.LINE_BYTES + 20


def test_a_command_line_the_kernel_refuses_is_too_long_not_missing():
    # One argument past MAX_ARG_STRLEN (128 KiB): E2BIG from execve.
    with pytest.raises(proc.TooLong) as refused:
        proc.run(["true", "x" * 200_000])
    assert refused.value.errno == errno.E2BIG and "E2BIG" in str(refused.value)
    assert not isinstance(refused.value, proc.Missing)
    with pytest.raises(proc.Missing):
        proc.run(["fdl-no-such-program", "x"])


def test_a_timeout_kills_the_whole_group_and_says_so():
    marker = f"4{os.getpid() % 1000:03d}1"
    started = time.monotonic()
    with pytest.raises(proc.TimedOut) as late:
        proc.run(["sh", "-c", f"echo partial >&2; sleep {marker} & sleep {marker}; wait"], timeout=0.5)
    assert time.monotonic() - started < 5
    assert late.value.timeout == 0.5 and late.value.stderr == "partial\n"
    deadline = time.monotonic() + 5
    while procs_with(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not procs_with(f"sleep {marker}"), "the background grandchild outlived the timeout"


def test_a_death_by_signal_reads_as_the_shell_reports_it():
    assert proc.run(["sh", "-c", "kill -TERM $$"]).returncode == 128 + 15
    assert proc.run(["sh", "-c", "kill -KILL $$"]).returncode == 128 + 9


@pytest.mark.parametrize("program", ["fdl-no-such-program", "/nonexistent/bin/x", "{tmp}/plain", "{tmp}/garbage"])
def test_a_program_that_is_missing_or_not_a_program_is_missing(program, tmp_path):
    (tmp_path / "plain").write_text("not executable\n")
    (tmp_path / "garbage").write_bytes(b"\x7fELF\x00not really")
    (tmp_path / "garbage").chmod(0o755)
    program = program.format(tmp=tmp_path)
    with pytest.raises(proc.Missing) as missing:
        proc.run([program])
    assert missing.value.program == program


def test_a_program_is_looked_up_on_the_path_of_the_environment_it_gets(tmp_path):
    (tmp_path / "fdl-probe").write_text("#!/bin/sh\necho found\n")
    (tmp_path / "fdl-probe").chmod(0o755)
    assert proc.run(["fdl-probe"], env={"PATH": str(tmp_path)}).stdout == "found\n"
    with pytest.raises(proc.Missing):
        proc.run(["fdl-probe"])


def test_a_grandchild_holding_the_pipes_does_not_hold_the_caller():
    # The program exits at once; what it left behind keeps stdout and
    # stderr open for a minute, in a group of its own (as a daemon would be).
    marker = f"7{os.getpid() % 1000:03d}3"
    code = f"import os, subprocess; subprocess.Popen(['sleep', '{marker}'], start_new_session=True); print('bye')"
    started = time.monotonic()
    try:
        done = proc.run([sys.executable, "-c", code], timeout=30)
        took = time.monotonic() - started
        assert done.ok and done.stdout == "bye\n"
        # One wait for both pipes, not one each.
        assert took < 2 * proc._DRAIN_S - 0.5, took
    finally:
        for pid, _ in procs_with(f"sleep {marker}"):
            os.kill(pid, 9)


def _sleeping(marker: str) -> list[int]:
    return [pid for pid, cmdline in procs_with(f"sleep {marker}") if cmdline.split()[0].endswith("sleep")]


def test_an_interrupted_caller_stops_the_program_before_it_unwinds():
    marker = f"5{os.getpid() % 1000:03d}7"

    def interrupt_once_it_sleeps() -> None:
        deadline = time.monotonic() + 10
        while not _sleeping(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        # A real SIGINT, as Ctrl-C sends: it interrupts the wait itself.
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_it_sleeps, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        proc.run(["sh", "-c", f"sleep {marker} & wait"], timeout=30)
    # The group has its SIGTERM; the grandchild may take a moment to go.
    deadline = time.monotonic() + 5
    while _sleeping(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _sleeping(marker), "the program outlived the interrupted caller"


def test_two_programs_side_by_side_and_one_given_up():
    marker = f"6{os.getpid() % 1000:03d}9"
    slow = proc.start(["sleep", marker])
    fast = proc.start(["sh", "-c", "echo fast"], timeout=10)
    assert fast.wait().stdout == "fast\n"
    deadline = time.monotonic() + 5
    while not _sleeping(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _sleeping(marker), "the first program is not running beside the second"
    slow.stop()
    assert not _sleeping(marker)
