"""The smoke run never reaches the operator's terminal.

fdl-prepare is often started by hand from a root shell. The smoke run is
the training source's code: if it kept that shell's controlling terminal it
could open /dev/tty and push keystrokes into the shell's input (TIOCSTI),
which the shell runs as root once fdl-prepare exits, or write escape
sequences past all of fdl-prepare's output escaping.

Each test runs fdl-prepare's smoke run in a child whose controlling terminal
is a real pty (pty.fork), with a real smoke binary, compiled here with gcc,
that tries what such code would: open("/dev/tty"), TIOCSTI on the
descriptors it has and on /dev/tty, isatty on 0-2, and lists every
descriptor it inherited. The child then reads its terminal for anything
pushed into it, and the test reads the pty's master side for anything
written to it."""

from __future__ import annotations

import errno
import os
import pty
import re
import select
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from other_user import reachable_dir

REPO = Path(__file__).resolve().parent.parent
MARK = "FDL-PWNED-7731"

PROBE_C = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <dirent.h>
#include <unistd.h>

static const char typed[] = "echo %(mark)s\n";

static int push(int fd) {
    for (const char *c = typed; *c; c++)
        if (ioctl(fd, TIOCSTI, c) != 0) return errno;
    return 0;
}

int main(int argc, char **argv) {
    FILE *out = fopen(argv[1], "w");
    if (!out) return 2;
    int tty = open("/dev/tty", O_RDWR | O_NOCTTY);
    fprintf(out, "tty_open=%%d\n", tty < 0 ? errno : 0);
    if (tty >= 0) {
        fprintf(out, "tiocsti_tty=%%d\n", push(tty));
        /* Raw escapes straight onto the terminal, past any escaping. */
        (void)!write(tty, "\033]0;%(mark)s\007%(mark)s-ESC\n", sizeof "\033]0;%(mark)s\007%(mark)s-ESC\n" - 1);
    }
    for (int fd = 0; fd < 3; fd++) {
        fprintf(out, "isatty%%d=%%d\n", fd, isatty(fd));
        fprintf(out, "tiocsti%%d=%%d\n", fd, push(fd));
    }
    fprintf(out, "sid_is_pid=%%d\n", getsid(0) == getpid());
    DIR *d = opendir("/proc/self/fd");
    fprintf(out, "fds=");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char link[64], target[256];
        snprintf(link, sizeof link, "/proc/self/fd/%%s", e->d_name);
        ssize_t n = readlink(link, target, sizeof target - 1);
        target[n < 0 ? 0 : n] = 0;
        fprintf(out, "%%s:%%s,", e->d_name, target);
    }
    fprintf(out, "\n");
    fclose(out);
    printf("probe done\n");
    return 0;
}
"""

# Run in the pty child: the smoke run, then whatever was pushed into the
# terminal's input, read back without waiting for more than a moment.
CHILD = """
import os, select, sys, termios
sys.path.insert(0, {repo!r})
from prepare import smoke
from prepare.spec import Binary
attrs = termios.tcgetattr(0)
attrs[3] &= ~(termios.ICANON | termios.ECHO)
termios.tcsetattr(0, termios.TCSANOW, attrs)
notes = []
try:
    smoke.run(Binary({binary!r}, {cwd!r}), [{report!r}], 30, notes, **{kwargs!r})
    print("SMOKE-OK", flush=True)
except Exception as failed:
    print("SMOKE-FAILED", getattr(failed, "reason", ""), str(failed)[:300], flush=True)
pushed = b""
while select.select([0], [], [], 0.3)[0]:
    chunk = os.read(0, 4096)
    if not chunk:
        break
    pushed += chunk
print("PUSHED=" + pushed.hex(), flush=True)
"""


@pytest.fixture(scope="module")
def probe() -> Iterator[Path]:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed (scripts/setup installs it)")
    # Outside /tmp, which the run gets fresh.
    where = reachable_dir("fdl-smoke-tty-")
    source = where / "probe.c"
    source.write_text(PROBE_C % {"mark": MARK})
    import subprocess

    subprocess.run([gcc, "-O1", "-o", str(where / "probe"), str(source)], check=True)
    out = where / "out"
    out.mkdir()
    out.chmod(0o1777)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _in_a_pty(code: str, timeout: float = 60) -> tuple[int, str]:
    """Run `code` in a fresh interpreter whose controlling terminal (and
    0-2) is a new pty; return its exit status and all it wrote there."""
    pid, master = pty.fork()
    if pid == 0:
        try:
            os.execv(sys.executable, [sys.executable, "-c", code])
        finally:
            os._exit(127)
    output = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready = select.select([master], [], [], 0.5)[0]
            if not ready:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError as err:
                if err.errno == errno.EIO:  # the child side is closed
                    break
                raise
            if not chunk:
                break
            output += chunk
    finally:
        os.close(master)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output.decode("utf-8", "replace")


def _report(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


@pytest.mark.skipif(os.geteuid() != 0, reason="fdl-prepare runs as root; the run drops to smoke_user")
def test_the_smoke_run_has_no_controlling_terminal_and_no_terminal_on_any_descriptor(probe):
    report = probe / "out" / "report"
    code = CHILD.format(repo=str(REPO), binary=str(probe / "probe"), cwd=str(probe), report=str(report), kwargs={})
    code_status, said = _in_a_pty(code)
    print(said)
    assert code_status == 0, said
    assert "SMOKE-OK" in said, said
    seen = _report(report)
    print(seen)
    # No controlling terminal: /dev/tty cannot be opened (ENXIO).
    assert seen["tty_open"] == str(errno.ENXIO), seen
    assert "tiocsti_tty" not in seen
    # None of 0-2 is a terminal, so TIOCSTI has nothing to push into.
    for fd in (0, 1, 2):
        assert seen[f"isatty{fd}"] == "0", seen
        assert seen[f"tiocsti{fd}"] == str(errno.ENOTTY), seen
    # A session of its own; only 0-2 (and the probe's own report and
    # directory listing) are open: /dev/null and two pipes.
    fds = dict(entry.split(":", 1) for entry in seen["fds"].strip(",").split(","))
    assert fds["0"] == "/dev/null", fds
    assert fds["1"].startswith("pipe:") and fds["2"].startswith("pipe:"), fds
    assert not [fd for fd, target in fds.items() if int(fd) > 2 and not target.startswith(("/proc/", str(probe)))], fds
    # Nothing reached the terminal: not pushed into its input, not written on it.
    found = re.search(r"PUSHED=([0-9a-f]*)", said)
    assert found is not None, said
    assert bytes.fromhex(found.group(1)) == b"", found.group(1)
    assert MARK not in said, said


@pytest.mark.nix
@pytest.mark.skipif(os.geteuid() != 0, reason="fdl-prepare runs as root; the run drops to smoke_user")
def test_an_attempt_started_from_a_terminal_gives_its_smoke_run_none_of_it(
    probe, nix_env, test_flake, git_source, state_dir
):
    # The whole CLI, its controlling terminal a real pty, builds a training
    # source whose binary is the probe (compiled static, committed as a
    # file, copied by the build line) and runs it as its smoke run. The
    # pty's slave side is kept here: anything pushed into its input is
    # read back after the attempt, as the shell that started it would.
    import fcntl
    import subprocess
    import termios

    from nix_fixtures import MANIFEST, _git, manifest_text

    static = probe / "probe-static"
    subprocess.run(
        [shutil.which("gcc") or "gcc", "-O1", "-static", "-o", str(static), str(probe / "probe.c")], check=True
    )
    src = git_source(
        {
            MANIFEST: manifest_text(bin="train", build="cp probe train && chmod +x train"),
            "README": f"probe source {os.getpid()}.{time.time_ns()}\n",
        }
    )
    (Path(src.path) / "probe").write_bytes(static.read_bytes())
    _git(Path(src.path), "add", "probe")
    _git(Path(src.path), "commit", "-qm", "the probe, as the training binary")
    report = probe / "out" / "attempt"
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[3] &= ~(termios.ICANON | termios.ECHO)
    termios.tcsetattr(slave, termios.TCSANOW, attrs)

    def own_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    argv = [sys.executable, "-m", "prepare", "--cpu-only", "--libtorch", "cpu", "--flake", test_flake]
    argv += ["--source", src.url, "--state-dir", state_dir, "--smoke", str(report)]
    child = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, cwd=str(REPO), preexec_fn=own_terminal, env=nix_env
    )
    output = b""
    try:
        deadline = time.monotonic() + 600
        while child.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                output += os.read(master, 65536)
        while select.select([master], [], [], 0.2)[0]:
            output += os.read(master, 65536)
        os.set_blocking(slave, False)
        try:
            pushed = os.read(slave, 4096)
        except BlockingIOError:
            pushed = b""
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        os.close(master)
        os.close(slave)
    said = output.decode("utf-8", "replace")
    print(said)
    assert child.returncode == 0, said[-3000:]
    assert "smoke run" in said and "passed" in said, said[-3000:]
    seen = _report(report)
    print(seen)
    assert seen["tty_open"] == str(errno.ENXIO), seen
    assert all(seen[f"isatty{fd}"] == "0" and seen[f"tiocsti{fd}"] == str(errno.ENOTTY) for fd in (0, 1, 2)), seen
    assert pushed == b"", pushed
    assert MARK not in said


def test_the_helper_refuses_to_start_a_run_that_could_reach_a_terminal(probe):
    # A caller other than prepare.host.proc that hands the helper a
    # terminal on stdin (and keeps its own controlling one): the run is
    # not started, and the helper says which step refused.
    import subprocess

    from prepare.host import confine

    confinement = confine.enter(confine.DEFAULT_USER)
    master, slave = os.openpty()
    status_r, status_w = os.pipe()
    report = probe / "out" / "never"
    try:
        argv = confine.command(confinement, status_w, [str(probe / "probe"), str(report)])
        done = subprocess.run(
            argv, stdin=slave, capture_output=True, pass_fds=(status_w,), env=confinement.env, timeout=60, check=False
        )
        os.close(status_w)
        said = os.read(status_r, 4096).decode()
    finally:
        confine.leave(confinement)
        for fd in (master, slave, status_r):
            os.close(fd)
    assert "setup terminal" in said, said
    assert done.returncode == 127 and not report.exists()
