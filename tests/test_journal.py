"""What systemd sees of a run (prepare/host/journal.py, prepare/cli/report.py):
syslog priorities on every line when stderr is the journal, and the unit's
status line through NOTIFY_SOCKET.

"The journal" is tried three ways, each real: a file whose device and inode
JOURNAL_STREAM names (what fdl-prepare compares, as systemd documents it), a
file JOURNAL_STREAM does not name, and a real systemd-journald started in a
private mount namespace, with the command under systemd-cat and the result
read back with journalctl. The status line is read from an AF_UNIX datagram
socket the test binds, by path and in the abstract namespace."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from console import console_script

from prepare.host import journal
from prepare.notes import is_warning, print_notes, warning


@pytest.fixture
def box(tmp_path: Path) -> dict[str, str]:
    """One run's environment: its own HOME and TMPDIR, an empty config, no
    NVML library, and no JOURNAL_STREAM or NOTIFY_SOCKET of the caller's."""
    home, stage = tmp_path / "home", tmp_path / "stage"
    home.mkdir()
    stage.mkdir()
    (tmp_path / "prepare.toml").write_text("[join]\n")
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(stage),
        "LD_LIBRARY_PATH": str(tmp_path / "no-nvml-here"),
        "FDL_PREPARE_CONFIG": str(tmp_path / "prepare.toml"),
    }


def _no_home(box: dict[str, str]) -> dict[str, str]:
    """Without HOME the dirs step warns (the dataset cache goes under the
    password database's home)."""
    return {k: v for k, v in box.items() if k != "HOME"}


def run_to_file(env: dict[str, str], err: Path, *args: str, stream: str | None) -> tuple[int, list[str]]:
    """The CLI with stderr the file `err`, and JOURNAL_STREAM `stream`; the
    lines it wrote but the warnings of a HOME or stage on tmpfs."""
    if stream is not None:
        env = {**env, "JOURNAL_STREAM": stream}
    with err.open("w") as handle:
        done = subprocess.run([console_script(), *args], env=env, stdout=subprocess.PIPE, stderr=handle, timeout=60)
    return done.returncode, [line for line in err.read_text().splitlines() if not _tmpfs(line)]


def _tmpfs(line: str) -> bool:
    """A warning that the dataset cache or the stage is on tmpfs: a box
    whose /tmp is a tmpfs (Debian 13) has one in every run here."""
    return " is on tmpfs (mounted at " in line


def stream_of(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}"


# -- a file that is, or is not, the journal ----------------------------------------------------


def test_when_stderr_is_the_journal_a_failure_is_at_err_on_every_line(box: dict[str, str], tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    err.touch()
    # A TOML error: a message of several lines (the line and its caret).
    Path(box["FDL_PREPARE_CONFIG"]).write_text("[join\ncpu_only = true\n")

    code, lines = run_to_file(box, err, stream=stream_of(err))

    assert code == 78
    assert lines[0].startswith("<3>fdl-prepare: permanent failure [config.invalid]: config ")
    assert "<3>    [join" in lines and any(line.startswith("<3>") and line.endswith("^") for line in lines)
    assert lines[-1] == "<3>fdl-prepare: exit 78: retrying cannot help: fix the cause above, then run again"
    assert all(line.startswith("<3>") for line in lines), lines


def test_when_stderr_is_the_journal_a_warning_is_at_warning_and_the_rest_at_info(
    box: dict[str, str], tmp_path: Path
) -> None:
    err = tmp_path / "stderr"
    err.touch()

    code, lines = run_to_file(_no_home(box), err, "--cpu-only", stream=stream_of(err))

    assert code == 0
    assert [line for line in lines if line.startswith("<4>")] == [
        line for line in lines if line.startswith("<4>fdl-prepare: HOME is unset: ")
    ]
    assert len([line for line in lines if line.startswith("<4>")]) == 1
    assert "<6>fdl-prepare: GPU gate skipped: cpu_only is set, so only the cpu libtorch variant can be used." in lines
    assert any(line.startswith("<6>fdl-prepare: prepared in ") for line in lines)
    assert "<6>  gpus      gate skipped (--cpu-only)" in lines
    assert all(line[:3] in ("<4>", "<6>") for line in lines), lines


def test_a_sick_card_is_a_warning_in_the_journal(box: dict[str, str], tmp_path: Path, fake_nvml) -> None:  # type: ignore[no-untyped-def]
    from nvml_fixtures import FakeGpu

    err = tmp_path / "stderr"
    err.touch()
    env = fake_nvml.box([FakeGpu(), FakeGpu(pages_pending=True)]).env(box)

    code, lines = run_to_file(env, err, "--driver-dir", str(tmp_path / "driver"), stream=stream_of(err))

    warned = [line for line in lines if line.startswith("<4>")]
    assert code == 0, lines
    assert len(warned) == 1 and "GPU 1" in warned[0] and "unhealthy and will not be offered" in warned[0], lines


def test_a_journal_stream_that_names_another_file_adds_no_prefix(box: dict[str, str], tmp_path: Path) -> None:
    err, other = tmp_path / "stderr", tmp_path / "the-journal-elsewhere"
    err.touch()
    other.touch()

    failed = run_to_file(box, err, stream=stream_of(other))
    prepared = run_to_file(_no_home(box), tmp_path / "stderr2", "--cpu-only", stream=stream_of(other))
    garbled = run_to_file(box, tmp_path / "stderr3", stream="not:a-device")

    for _, lines in (failed, prepared, garbled):
        assert lines and all(line.startswith(("fdl-prepare: ", "  ")) for line in lines), lines
    assert failed[1][0].startswith("fdl-prepare: permanent failure [gpu.no-driver]: ")


def test_a_warning_note_is_still_a_str_for_a_join_loop_and_print_notes_prefixes_it_in_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    note = warning("GPU 1 is unhealthy")
    notes: list[str] = ["mounted it", note]
    out = tmp_path / "stderr"
    with out.open("w") as handle:
        print_notes("join", notes, file=handle)
        monkeypatch.setenv("JOURNAL_STREAM", stream_of(out))
        print_notes("join", notes, file=handle)

    assert note == "GPU 1 is unhealthy" and isinstance(note, str) and is_warning(note)
    assert not is_warning("GPU 1 is unhealthy") and json.dumps(notes) == '["mounted it", "GPU 1 is unhealthy"]'
    assert out.read_text().splitlines() == [
        "join: mounted it",
        "join: GPU 1 is unhealthy",
        "<6>join: mounted it",
        "<4>join: GPU 1 is unhealthy",
    ]


def test_a_continuation_line_cannot_choose_its_own_priority() -> None:
    # A build log quoted in a message: its own "<0>" (emergency, broadcast
    # to every terminal) stays text behind the prefix journald reads.
    assert journal.lines("failed:\n<0>pwned", journal.FAILURE, True) == "<3>failed:\n<3><0>pwned\n"
    assert journal.lines("failed:\n<0>pwned", journal.FAILURE, False) == "failed:\n<0>pwned\n"


# -- a real journald -------------------------------------------------------------------------

_JOURNALD_RUN = textwrap.dedent(
    r"""
    set -eu
    out=$1; shift
    # This namespace's own /run (journald's sockets and its volatile store)
    # and, where the host has one, its own /var/log/journal: nothing of the
    # host's journal is read or written.
    mount -t tmpfs tmpfs /run
    if [ -d /var/log/journal ]; then mount -t tmpfs tmpfs /var/log/journal; fi
    "$JOURNALD" 2>"$out/journald.log" &
    journald=$!
    trap 'kill $journald 2>/dev/null || true; wait $journald 2>/dev/null || true' EXIT
    i=0
    while [ ! -S /run/systemd/journal/stdout ]; do
        i=$((i + 1)); [ $i -lt 200 ] || { echo "journald did not start" >&2; exit 90; }
        sleep 0.05
    done
    set +e
    # systemd sets JOURNAL_STREAM for a unit; systemd-cat before v255 does
    # not, so it is set here as systemd sets it: the device and inode of the
    # stream socket on stderr.
    systemd-cat -t fdl-journal-test -- sh -c '
        [ -n "${JOURNAL_STREAM:-}" ] || JOURNAL_STREAM=$(stat -L -c %d:%i /proc/self/fd/2)
        export JOURNAL_STREAM
        exec "$@"' sh "$@"
    echo $? > "$out/rc"
    set -e
    journalctl --sync 2>/dev/null || sleep 1
    journalctl -t fdl-journal-test -o json --no-pager > "$out/entries.json"
    journalctl -t fdl-journal-test -o cat -p warning --no-pager > "$out/warning.txt"
    """
)


def _journald() -> str:
    for path in ("/lib/systemd/systemd-journald", "/usr/lib/systemd/systemd-journald"):
        if os.access(path, os.X_OK):
            return path
    pytest.skip("systemd-journald is not installed (apt install systemd)")


@pytest.fixture
def in_journal(tmp_path: Path) -> Iterator[object]:
    """Run a command under systemd-cat to a journald of its own; its exit
    code, its journal entries, and `journalctl -o cat -p warning`."""
    daemon = _journald()
    for tool in ("systemd-cat", "journalctl", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    if os.geteuid() != 0:
        pytest.skip("a journald of the test's own needs root (a private mount namespace)")
    script = tmp_path / "journald-run.sh"
    script.write_text(_JOURNALD_RUN)

    def run(env: dict[str, str], *args: str) -> tuple[int, list[dict[str, str]], str]:
        out = tmp_path / f"journal{len(list(tmp_path.glob('journal*')))}"
        out.mkdir()
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", str(script), str(out), console_script(), *args],
            env={**env, "JOURNALD": daemon}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if done.returncode == 90 or not (out / "rc").exists():
            log = (out / "journald.log").read_text() if (out / "journald.log").exists() else ""
            pytest.skip(f"no journald of the test's own could run here: {done.stderr.strip()} {log.strip()}")
        entries = [json.loads(line) for line in (out / "entries.json").read_text().splitlines()]
        return int((out / "rc").read_text()), entries, (out / "warning.txt").read_text()

    yield run


def _said(entries: list[dict[str, str]]) -> list[tuple[int, str]]:
    return [(int(e["PRIORITY"]), e["MESSAGE"]) for e in entries if not _tmpfs(e["MESSAGE"])]


def test_through_journald_a_failure_is_at_err_and_journalctl_p_warning_shows_it(in_journal, box) -> None:  # type: ignore[no-untyped-def]
    code, entries, warnings = in_journal(box)

    said = _said(entries)
    assert code == 78
    assert said[0][0] == 3 and said[0][1].startswith("fdl-prepare: permanent failure [gpu.no-driver]: GPU gate: ")
    assert said[-1] == (3, "fdl-prepare: exit 78: retrying cannot help: fix the cause above, then run again")
    assert [line for line in warnings.splitlines() if not _tmpfs(line)] == [message for _, message in said]


def test_through_journald_warnings_are_at_warning_and_progress_at_info(in_journal, box) -> None:  # type: ignore[no-untyped-def]
    code, entries, warnings = in_journal(_no_home(box), "--cpu-only")

    said = _said(entries)
    assert code == 0
    assert [p for p, m in said if "HOME is unset" in m] == [4]
    assert (6, "fdl-prepare: GPU gate skipped: cpu_only is set, so only the cpu libtorch variant can be used.") in said
    assert [p for p, m in said if m.startswith("fdl-prepare: prepared in ")] == [6]
    assert {p for p, _ in said} == {4, 6}
    shown = [line for line in warnings.splitlines() if not _tmpfs(line)]
    assert len(shown) == 1 and shown[0].startswith("fdl-prepare: HOME is unset: ")


# -- the unit's status line ------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """An AF_UNIX datagram socket bound at a path, as systemd's is."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        yield str(path), sock


def received(sock: socket.socket) -> list[str]:
    sock.settimeout(0)
    got = []
    while True:
        try:
            got.append(sock.recv(4096).decode())
        except BlockingIOError:
            return got


def test_under_systemd_each_step_is_the_units_status_line(box, notify_socket) -> None:  # type: ignore[no-untyped-def]
    address, sock = notify_socket

    done = subprocess.run(
        [console_script(), "--cpu-only", "-q"], env={**box, "NOTIFY_SOCKET": address}, capture_output=True, timeout=60
    )

    said = received(sock)
    assert done.returncode == 0
    assert said[:3] == [
        "STATUS=gate: checking the GPUs",
        "STATUS=data: checking the dataset root",
        "STATUS=dirs: checking the node-local directories",
    ]
    assert len(said) == 4 and re.fullmatch(r"STATUS=prepared: done in \d+\.\d\ds", said[3]), said


def test_a_failure_is_the_last_status_line_with_its_reason(box, notify_socket) -> None:  # type: ignore[no-untyped-def]
    address, sock = notify_socket

    done = subprocess.run([console_script()], env={**box, "NOTIFY_SOCKET": address}, capture_output=True, timeout=60)

    said = received(sock)
    assert done.returncode == 78
    assert said[0] == "STATUS=gate: checking the GPUs"
    assert said[-1].startswith("STATUS=permanent failure [gpu.no-driver]: GPU gate: no NVIDIA driver is installed")
    assert all("\n" not in line and len(line) <= len("STATUS=") + journal.STATUS_CHARS for line in said)


def test_a_health_check_that_finds_the_box_not_ready_says_so_on_the_status_line_under_json_too(  # type: ignore[no-untyped-def]
    box, notify_socket
) -> None:
    address, sock = notify_socket

    done = subprocess.run(
        [console_script(), "gpus", "--json"], env={**box, "NOTIFY_SOCKET": address}, capture_output=True, timeout=60
    )

    said = received(sock)
    assert done.returncode == 78 and json.loads(done.stdout)["ready"] is False
    assert said and said[-1].startswith("STATUS=permanent failure [gpu.no-driver]: "), said


def test_an_abstract_notify_socket_is_reached_too(box) -> None:  # type: ignore[no-untyped-def]
    name = f"fdl-prepare-test-{os.getpid()}-{id(box)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        done = subprocess.run(
            [console_script(), "--cpu-only"], env={**box, "NOTIFY_SOCKET": "@" + name}, capture_output=True, timeout=60
        )
        said = received(sock)

    assert done.returncode == 0
    assert said[0] == "STATUS=gate: checking the GPUs" and said[-1].startswith("STATUS=prepared: ")


@pytest.mark.parametrize("address", ["/nonexistent/notify", "@fdl-prepare-nobody-listens", "vsock:2:1234", "relative"])
def test_a_notify_socket_nobody_listens_on_leaves_the_attempt_its_own_outcome(box, address: str) -> None:  # type: ignore[no-untyped-def]
    done = subprocess.run(
        [console_script(), "--cpu-only", "--json"],
        env={**box, "NOTIFY_SOCKET": address}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kind"] == "prepared" and "Traceback" not in done.stderr


def test_a_status_line_is_one_bounded_line_whatever_it_quotes() -> None:
    line = journal.status("source", "fetching git+https://h/x\nSTATUS=forged\r" + "y" * 5000)
    assert line.startswith("STATUS=source: fetching git+https://h/x\\nSTATUS=forged\\r")
    assert "\n" not in line and len(line) == len("STATUS=") + journal.STATUS_CHARS


@pytest.mark.nix
def test_under_systemd_a_build_names_its_source_and_its_builds_in_the_status_line(  # type: ignore[no-untyped-def]
    box, notify_socket, nix_env, test_flake, git_source, tmp_path
):
    from nix_fixtures import trainer

    address, sock = notify_socket
    src = git_source(trainer())
    argv = ["--cpu-only", "--libtorch", "cpu", "--flake", test_flake, "--state-dir", str(tmp_path / "state")]
    env = {**box, "NOTIFY_SOCKET": address, "NIX_CONFIG": nix_env["NIX_CONFIG"]}

    done = subprocess.run([console_script(), *argv, "--source", src.url], env=env, capture_output=True, timeout=300)

    said = received(sock)
    assert done.returncode == 0, done.stderr
    steps = [line.removeprefix("STATUS=").split(":", 1)[0] for line in said]
    assert list(dict.fromkeys(steps)) == ["gate", "data", "dirs", "state", "variant", "source", "build", "prepared"]
    assert f"STATUS=source: fetching training source {src.url}" in said
    assert any(line.startswith("STATUS=build: building ") and "training" in line for line in said), said
    assert said[-1].startswith("STATUS=prepared: done in ")
