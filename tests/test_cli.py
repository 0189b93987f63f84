"""The command as an operator and systemd see it: through the installed
console script, in a child process, judged by exit code and output."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from console import console_script, fdl_prepare


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


def test_version_prints_the_package_version_and_rev_unknown_from_a_pip_install() -> None:
    from prepare import __version__

    done = fdl(dict(os.environ), "--version")
    assert done.returncode == 0
    # A pip install carries no prepare/_revision.py (nix/app.nix writes one;
    # tests/test_flake.py holds the app's to the flake's revision).
    assert done.stdout.strip() == f"fdl-prepare {__version__} (rev unknown)"


@pytest.mark.parametrize(
    "argv", [["gpus", "--version"], ["publish", "--version"], ["completion", "--version"], ["--json", "--version"]]
)
def test_every_command_takes_version_after_its_word(argv: list[str]) -> None:
    from prepare import __version__

    done = fdl(dict(os.environ), *argv)
    assert (done.returncode, done.stdout.strip()) == (0, f"fdl-prepare {__version__} (rev unknown)"), done.stderr


def test_fdl_prepare_publish_takes_version() -> None:
    from prepare import __version__

    publish = Path(console_script()).with_name("fdl-prepare-publish")
    if not publish.exists():
        pytest.skip("the fdl-prepare-publish console script is not installed (pip install -e .)")
    done = subprocess.run([str(publish), "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, f"fdl-prepare {__version__} (rev unknown)"), done.stderr


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


def test_the_failure_line_names_its_reason_code(box: dict[str, str]) -> None:
    done = fdl(box)
    lines = done.stderr.splitlines()
    assert lines[0].startswith("fdl-prepare: permanent failure [gpu.no-driver]: GPU gate: "), done.stderr
    assert lines[-1] == "fdl-prepare: exit 78: retrying cannot help: fix the cause above, then run again"


# -- -q and -v ---------------------------------------------------------------------------


def _no_home(box: dict[str, str]) -> dict[str, str]:
    """The box without HOME: the dirs step warns (prepare.notes.warning)."""
    return {k: v for k, v in box.items() if k != "HOME"}


def _not_tmpfs(text: str) -> list[str]:
    """`text`'s lines but the warnings of a HOME or stage on tmpfs, which a
    box whose /tmp is a tmpfs (Debian 13) adds to every run here."""
    return [line for line in text.splitlines() if " is on tmpfs (mounted at " not in line]


def test_quiet_prints_nothing_for_a_success_and_keeps_warnings(box: dict[str, str]) -> None:
    plain = fdl(box, "--cpu-only", "-q")
    warned = fdl(_no_home(box), "--cpu-only", "--quiet")

    assert (plain.returncode, plain.stdout, _not_tmpfs(plain.stderr)) == (0, "", [])
    assert warned.returncode == 0
    assert len(_not_tmpfs(warned.stderr)) == 1 and _not_tmpfs(warned.stderr)[0].startswith("fdl-prepare: HOME is unset")


def test_quiet_keeps_the_failure_and_works_after_a_command_word(box: dict[str, str]) -> None:
    failed = fdl(box, "-q")
    surveyed = fdl(box, "gpus", "-q")

    for done, name in ((failed, "fdl-prepare"), (surveyed, "fdl-prepare gpus")):
        assert done.returncode == 78, done.stderr
        assert done.stderr.startswith(f"{name}: permanent failure [gpu.no-driver]: "), done.stderr


def test_verbose_prints_each_steps_time(box: dict[str, str]) -> None:
    done = fdl(box, "--cpu-only", "-v")
    assert done.returncode == 0, done.stderr
    for step in ("gate", "data", "dirs"):
        assert re.search(rf"^fdl-prepare: {step}: done in \d+\.\d{{3}}s$", done.stderr, re.M), done.stderr
    failed = fdl(box, "--verbose")
    assert re.search(r"^fdl-prepare: gate: failed after \d+\.\d{3}s$", failed.stderr, re.M), failed.stderr


def test_verbose_prints_each_command_run(
    box: dict[str, str], nix_env: dict[str, str], test_flake: str, tmp_path: Path
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Closed once the socket is gone: nix's fetch is refused, at once.
    url = f"git+http://127.0.0.1:{port}/train.git?ref=main"
    argv = ["--cpu-only", "--libtorch", "cpu", "--flake", test_flake, "--state-dir", str(tmp_path / "state")]
    env = {**box, "NIX_CONFIG": nix_env["NIX_CONFIG"]}

    verbose = fdl(env, *argv, "--source", url, "-v", timeout=300)
    plain = fdl(env, *argv, "--source", url, timeout=300)

    assert verbose.returncode == plain.returncode == 75, verbose.stderr
    ran = [line for line in verbose.stderr.splitlines() if line.startswith("fdl-prepare: running: ")]
    assert any(" flake prefetch --json -- " + shlex.quote(url) in line for line in ran), ran
    assert any(line.endswith(" --version") and "/nix" in line for line in ran), ran
    assert "running:" not in plain.stderr
    # A transient failure's line names its reason too.
    assert "\nfdl-prepare: transient failure [source.unreachable]: " in "\n" + plain.stderr, plain.stderr


def test_a_command_shown_under_verbose_has_its_credentials_hidden_and_is_bounded(capsys) -> None:  # type: ignore[no-untyped-def]
    from prepare.cli.report import COMMAND_CHARS, VERBOSE, Report

    report = Report(level=VERBOSE)
    report.command(["git", "fetch", "https://fdl:hunter2-token@git.example/train.git", "x" * 10_000])
    said = capsys.readouterr().err

    assert said.startswith("fdl-prepare: running: git fetch https://***@git.example/train.git xxx")
    assert "hunter2-token" not in said
    assert len(said) < COMMAND_CHARS + 100 and said.rstrip().endswith("... (cut)")


def test_notes_print_as_they_happen_not_after_the_build(
    box: dict[str, str],
    nix_env: dict[str, str],
    test_flake: str,
    git_source,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    from nix_fixtures import trainer

    src = git_source(trainer())
    argv = ["--cpu-only", "--libtorch", "cpu", "--flake", test_flake, "--state-dir", str(tmp_path / "state")]
    done = fdl({**box, "NIX_CONFIG": nix_env["NIX_CONFIG"]}, *argv, "--source", src.url, timeout=300)

    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()

    def first(test) -> int:  # type: ignore[no-untyped-def]
        return next(i for i, line in enumerate(lines) if test(line))

    fetched = first(lambda line: line.startswith("fdl-prepare: training source ") and " fetched: " in line)
    building = first(lambda line: line == "fdl-prepare: building fdl-test-training-cpu")
    built = first(lambda line: line.startswith("fdl-prepare: built: "))
    summary = first(lambda line: line.startswith("fdl-prepare: prepared in "))
    # The source step's note is out before the build step starts, the
    # build's own note after its builds: each note once, where it happened.
    assert fetched < building < built < summary, lines
    assert len([line for line in lines if " fetched: " in line]) == 1


def test_quiet_and_verbose_together_are_a_usage_error(box: dict[str, str]) -> None:
    done = fdl(box, "-q", "gpus", "-v")
    assert done.returncode == 2
    assert "-q" in done.stderr and "-v" in done.stderr


def test_cpu_only_prepares_with_exit_0_and_a_json_prepared_with_timings_and_notes(box: dict[str, str]) -> None:
    done = fdl(box, "--cpu-only", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert list(out)[:2] == ["kind", "schema"] and (out["kind"], out["schema"]) == ("prepared", 1)
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
    assert out["kind"] == "permanent" and out["schema"] == 1
    assert "data_path" in out["message"]
    assert str(missing) in out["message"]
    assert out["reason"] == "data.root-unusable"


def test_a_prepared_box_reports_its_devices_as_cuda_ordinals_beside_their_nvml_indices(  # type: ignore[no-untyped-def]
    box: dict[str, str], fake_nvml
) -> None:
    from nvml_fixtures import FakeGpu

    env = fake_nvml.box([FakeGpu(), FakeGpu(), FakeGpu()]).env(box)
    env["CUDA_VISIBLE_DEVICES"] = "2,1"

    as_json = fdl(env, "--json")
    said = fdl(env)

    assert as_json.returncode == 0, as_json.stderr
    out = json.loads(as_json.stdout)
    assert (out["devices"], out["nvml_indices"], out["gpu_vendor"]) == ([0, 1], [2, 1], "nvidia")
    assert said.returncode == 0, said.stderr
    assert "gpus      0, 1  (CUDA ordinals; NVML 2, 1)" in said.stderr


def test_the_survey_in_json_has_kind_gpus_and_schema_1(box: dict[str, str], fake_nvml) -> None:  # type: ignore[no-untyped-def]
    from nvml_fixtures import ampere_pair

    env = fake_nvml.box(ampere_pair()).env(box)
    for argv in (["gpus", "--json"], ["--json", "gpus"]):
        done = fdl(env, *argv)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert (out["kind"], out["schema"]) == ("gpus", 1) and len(out["devices"]) == 2


@pytest.mark.parametrize(
    ("argv", "usage_line"),
    [
        (["--json", "--devices", "zero,one"], "fdl-prepare [OPTIONS] COMMAND [ARGS]..."),
        (["--no-such-flag", "--json"], "fdl-prepare [OPTIONS] COMMAND [ARGS]..."),
        (["gpus", "--json", "--no-such-flag"], "fdl-prepare gpus [OPTIONS]"),
        (["publish", "src", "--json"], "fdl-prepare publish [OPTIONS] SOURCE_DIR"),
        (["--json", "-q", "-v"], "fdl-prepare [OPTIONS] COMMAND [ARGS]..."),
    ],
)
def test_a_usage_error_under_json_is_a_json_object_of_kind_usage_with_exit_2(
    box: dict[str, str], argv: list[str], usage_line: str
) -> None:
    done = fdl(box, *argv)
    assert done.returncode == 2, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"kind", "schema", "message", "usage"}
    assert (out["kind"], out["schema"], out["usage"]) == ("usage", 1, usage_line)
    assert out["message"] and out["message"] in done.stderr


def test_a_usage_error_hides_a_credential_the_bad_value_carries(box: dict[str, str]) -> None:
    done = fdl(box, "--json", "--devices", "https://fdl:hunter2-token@git.example/x")
    assert done.returncode == 2
    assert "https://***@git.example/x" in json.loads(done.stdout)["message"]
    assert "hunter2-token" not in done.stdout + done.stderr


def test_a_usage_error_without_json_leaves_stdout_empty_even_when_a_value_says_json(box: dict[str, str]) -> None:
    # `--json` here is the smoke run's argument, not the option.
    done = fdl(box, "--smoke", "--json", "--no-such-flag")
    assert done.returncode == 2
    assert done.stdout == "" and "No such option: --no-such-flag" in done.stderr


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


# -- a bug, an interruption: said, and exited on with a code the unit acts on ----------

_BUG = """
import sys
import prepare.pipeline

def broken(*args, **kwargs):
    raise RuntimeError("a bug stood in for by this test")

prepare.pipeline.prepare = broken
from prepare.cli import main
main(sys.argv[1:])
"""


def test_an_unexpected_exception_exits_70_with_its_traceback_not_1(box: dict[str, str]) -> None:
    import sys

    from prepare.cli import EXIT_SOFTWARE

    done = subprocess.run(
        [sys.executable, "-c", _BUG, "--cpu-only"], env=box, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == EXIT_SOFTWARE == 70, done.stderr
    assert "Traceback (most recent call last)" in done.stderr and "RuntimeError: a bug stood in" in done.stderr
    assert "fdl-prepare: internal error: RuntimeError" in done.stderr and "This is a bug in fdl-prepare" in done.stderr
    assert "exit 70" in done.stderr


def test_an_unexpected_exception_with_json_prints_a_bug_object(box: dict[str, str]) -> None:
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _BUG, "--cpu-only", "--json"], env=box, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 70, done.stderr
    out = json.loads(done.stdout)
    assert out["kind"] == "bug" and "RuntimeError" in out["message"] and "Traceback" in out["traceback"]
    assert out["schema"] == 1


def _fake_nix_that_hangs(tmp_path: Path) -> str:
    folder = tmp_path / "hanging-nix"
    folder.mkdir()
    nix = folder / "nix"
    nix.write_text("#!/bin/sh\nexec sleep 120\n")
    nix.chmod(0o755)
    return str(folder)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("as_json", [False, True])
def test_an_interrupt_prints_its_line_and_with_json_a_fail_of_kind_interrupted(
    box: dict[str, str], tmp_path: Path, sig: str, as_json: bool
) -> None:
    import signal
    import time

    from console import console_script

    env = {**box, "PATH": _fake_nix_that_hangs(tmp_path) + os.pathsep + box["PATH"]}
    argv = [console_script(), "--cpu-only", "--libtorch", "cpu", "--flake", "path:/srv/fdl"]
    argv += ["--state-dir", str(tmp_path / "state")] + (["--json"] if as_json else [])
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        # Waiting in its `nix --version`, which never answers.
        while not any("sleep 120" in line for line in _children_of(child.pid)):
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.05)
        child.send_signal(getattr(signal, sig))
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130, err
    assert "fdl-prepare: interrupted" in err
    if as_json:
        got = json.loads(out)
        assert got["kind"] == "interrupted" and "interrupted" in got["message"] and isinstance(got["notes"], list)
        assert got["schema"] == 1
    else:
        assert out == ""


def _children_of(pid: int) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append(cmdline)
    return found


def test_dev_zero_as_the_config_exits_78_at_once(box: dict[str, str]) -> None:
    done = fdl(box, "--config", "/dev/zero", "--cpu-only", timeout=30)
    assert done.returncode == 78, done.stderr
    assert "config /dev/zero is a character device, not a regular file" in done.stderr


# -- no value is ever read as an option --------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [("--flake", "-f/some/file", "flake"), ("--source", "--impure", "source.from")],
)
def test_a_url_that_starts_with_a_dash_is_refused_before_nix_sees_it(
    box: dict[str, str], tmp_path: Path, flag: str, value: str, field: str
) -> None:
    args = ["--cpu-only", "--libtorch", "cpu", "--state-dir", str(tmp_path / "state"), "--json"]
    if flag != "--flake":
        args += ["--flake", "path:/srv/fdl"]
    done = fdl(box, *args, f"{flag}={value}")
    assert done.returncode == 78, done.stderr
    out = json.loads(done.stdout)
    assert f"{field} = {value!r} starts with '-'" in out["message"]
    assert not (tmp_path / "state").exists()  # refused before the first nix call


def test_a_hundred_thousand_devices_in_the_config_take_well_under_seconds(box: dict[str, str]) -> None:
    import time

    devices = ", ".join(str(i) for i in range(100_000))
    Path(box["FDL_PREPARE_CONFIG"]).write_text(f"[join]\ncpu_only = true\ndevices = [{devices}]\n")
    start = time.monotonic()
    done = fdl(box, "--json", timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 10


# -- output that cannot be written -------------------------------------------------------


def _run_to(box: dict[str, str], stdout: object, stderr: object, *args: str) -> int:
    return subprocess.run(
        [console_script(), *args], env=box, stdout=stdout, stderr=stderr, timeout=60, check=False
    ).returncode


def test_a_result_json_to_a_full_disk_is_permanent_not_a_bug(box: dict[str, str]) -> None:
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [console_script(), "--cpu-only", "--json"], env=box, stdout=full, stderr=subprocess.PIPE, text=True,
            timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == 78, done.stderr
    assert "could not be written to stdout (No space left on device (ENOSPC))" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_reader_gone_from_stdout_is_transient_not_a_bug(box: dict[str, str]) -> None:
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [console_script(), "--cpu-only", "--json"], env=box, stdout=write, stderr=subprocess.PIPE, text=True,
            timeout=60, check=False,
        )  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 75, done.stderr
    assert "(Broken pipe (EPIPE))" in done.stderr and "Traceback" not in done.stderr


def test_a_full_stderr_leaves_the_outcome_its_own_code(box: dict[str, str], tmp_path: Path) -> None:
    with open("/dev/full", "w") as full:
        assert _run_to(box, subprocess.DEVNULL, full, "--cpu-only") == 0
        # A permanent failure still says so, whatever became of its message.
        assert _run_to(box, subprocess.DEVNULL, full, "--cpu-only", "--data-path", str(tmp_path / "no")) == 78
        with open(os.devnull, "w") as null:
            assert _run_to(box, null, full, "--cpu-only", "--json") == 0


def test_a_state_directory_in_proc_is_permanent_not_a_bug(box: dict[str, str]) -> None:
    done = fdl(box, "--cpu-only", "--libtorch", "cpu", "--flake", "path:/srv/fdl", "--state-dir", "/proc", "--json")
    assert done.returncode == 78, done.stderr
    fail = json.loads(done.stdout)
    assert fail["reason"] == "state.untrusted" and "the state directory /proc (from --state-dir)" in fail["message"]


def test_a_smoke_timeout_below_its_floor_is_permanent_naming_the_range(box: dict[str, str]) -> None:
    done = fdl(box, "--cpu-only", "--smoke-timeout", "0.001")
    assert done.returncode == 78, done.stderr
    assert "--smoke-timeout" in done.stderr and "expected 1 to 86400 seconds (a second to a day)" in done.stderr


# -- shell completion, made from the parser ------------------------------------------------------


def _script(shell: str) -> str:
    done = fdl(dict(os.environ), "completion", shell)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return done.stdout


def _bash_completes(script: Path, *words: str) -> list[str]:
    """What bash offers for the last of `words`, through the script's function."""
    quoted = " ".join(f"'{w}'" for w in words)
    line = (
        f"source {script}; COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _fdl_prepare; "
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30, check=True)
    return [word for word in done.stdout.splitlines() if word]


def test_bash_completes_the_options_commands_and_paths_the_parser_has(tmp_path: Path) -> None:
    script = tmp_path / "fdl-prepare.bash"
    script.write_text(_script("bash"))
    assert _bash_completes(script, "fdl-prepare", "--cpu") == ["--cpu-only"]
    assert _bash_completes(script, "fdl-prepare", "pub") == ["publish"]
    # A command's own options, and none of the root's after it.
    assert _bash_completes(script, "fdl-prepare", "publish", "--sig") == ["--signing-key"]
    assert _bash_completes(script, "fdl-prepare", "gpus", "--cpu") == []
    assert _bash_completes(script, "fdl-prepare", "completion", "") == ["bash", "zsh", "fish"]
    # An option that takes a path completes files; one that takes a URL offers nothing.
    (tmp_path / "prepare.toml").write_text("[join]\n")
    assert _bash_completes(script, "fdl-prepare", "--config", str(tmp_path / "prep")) == [
        str(tmp_path / "prepare.toml")
    ]
    assert _bash_completes(script, "fdl-prepare", "--flake", "") == []


def test_fish_completes_the_options_and_commands_the_parser_has(tmp_path: Path) -> None:
    import shutil

    if shutil.which("fish") is None:
        pytest.skip("fish is not installed (scripts/setup installs it)")
    script = tmp_path / "fdl-prepare.fish"
    script.write_text(_script("fish"))

    def completes(line: str) -> list[str]:
        done = subprocess.run(
            ["fish", "--no-config", "-c", f"source {script}; complete -C {shlex.quote(line)}"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return [row.split("\t")[0] for row in done.stdout.splitlines()]

    from prepare.cli import app, completion

    root, commands = completion.read(app.parser())
    root_flags = {flag for option in root for flag in option.flags}
    publish_flags = {
        flag for option in next(c for c in commands if c.name == "publish").options for flag in option.flags
    }

    def prefixed(line: str, options: set[str]) -> list[str]:
        # Fish 4 (Debian 13) adds fuzzy matches after the prefix ones
        # (`--no-cpu-only` for `--cpu`): those must still be the parser's
        # own options, and the prefix matches exactly what the parser has.
        got = completes(line)
        assert set(got) <= options, got
        word = line.split()[-1]
        return [option for option in got if option.startswith(word)]

    assert prefixed("fdl-prepare --cpu", root_flags) == ["--cpu-only"]
    assert {"gpus", "publish", "completion"} <= set(completes("fdl-prepare "))
    assert prefixed("fdl-prepare publish --sig", publish_flags) == ["--signing-key"]


def test_zsh_loads_the_completion_for_both_programs(tmp_path: Path) -> None:
    import shutil

    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed (scripts/setup installs it)")
    functions = tmp_path / "functions"
    functions.mkdir()
    (functions / "_fdl-prepare").write_text(_script("zsh"))
    assert subprocess.run(["zsh", "-n", str(functions / "_fdl-prepare")], timeout=30).returncode == 0
    line = (
        f"fpath=({functions} $fpath); autoload -Uz compinit; compinit -u -d {tmp_path / 'dump'}; "
        "print -r -- ${_comps[fdl-prepare]} ${_comps[fdl-prepare-publish]}"
    )
    done = subprocess.run(["zsh", "-f", "-c", line], capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.split() == ["_fdl-prepare", "_fdl-prepare"]


def test_a_completion_for_a_shell_it_does_not_know_is_a_usage_error() -> None:
    done = fdl(dict(os.environ), "completion", "tcsh")
    assert done.returncode == 2 and "completion" in done.stderr and done.stdout == ""
