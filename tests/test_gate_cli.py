"""`fdl-prepare gpus` through the installed console script, in a child process
that finds the fake libnvidia-ml.so.1 through LD_LIBRARY_PATH."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from console import fdl_prepare
from nvml_fixtures import (
    DRIVER_NOT_LOADED,
    FABRIC_IN_PROGRESS,
    GIB,
    GPU_IS_LOST,
    NOT_READY,
    FakeGpu,
    alive,
    ampere_pair,
    hgx_h100,
    host_has_nvml,
    hung_pids,
    no_driver_env,
    query_processes,
)

H100 = {"name": "NVIDIA H100 80GB HBM3", "capability": (9, 0), "memory": 80 * GIB}


def _base(columns: int | None = 200) -> dict[str, str]:
    """No NVML but the fake's, no masks, no config file; the table as wide
    as `columns` (None: as wide as a pipe, which is not a terminal)."""
    env = no_driver_env()
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "FDL_PREPARE_CONFIG", "COLUMNS"):
        env.pop(name, None)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return env


def gpus(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return fdl_prepare(env, "gpus", *args, timeout=timeout)


def test_gpus_prints_a_table_of_the_cards(fake_nvml):
    box = fake_nvml.box([FakeGpu(), FakeGpu(fail=GPU_IS_LOST)])
    done = gpus(box.env(_base()))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "NVIDIA driver 570.86.15, CUDA 12.8"
    assert lines[1].split() == ["IDX", "NAME", "UUID", "CC", "MEMORY", "STATUS"]
    assert lines[2].startswith("0 ") and lines[2].endswith("offered")
    assert "unusable: " in lines[3] and "GPU is lost" in lines[3]
    assert "offered: 0" in lines


def test_gpus_json_is_the_survey_after_cuda_visible_devices(fake_nvml):
    box = fake_nvml.box(ampere_pair())
    env = box.env(_base())
    env["CUDA_VISIBLE_DEVICES"] = "1"
    done = gpus(env, "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["offered"] == [1]
    assert data["cuda_visible_devices"] == "1"
    assert [d["masked_by"] for d in data["devices"]] == ["CUDA_VISIBLE_DEVICES", None]
    assert data["devices"][1]["capability"] == "8.6"


def test_gpus_on_a_box_without_a_driver_exits_78_naming_the_package_and_not_a_flag_it_does_not_take():
    if host_has_nvml():
        pytest.skip("this host has a real libnvidia-ml.so.1 on the default search path")
    done = gpus(_base())
    assert done.returncode == 78
    assert "libnvidia-ml.so.1 was not found" in done.stderr
    # gpus takes no --cpu-only; it says what makes a CPU worker skip the gate.
    assert "--cpu-only" not in done.stderr
    assert "set cpu_only = true under [join], and an attempt skips the gate" in done.stderr
    # An attempt, which takes it, still advises it.
    assert "--cpu-only" in fdl_prepare(_base()).stderr


@pytest.mark.parametrize(
    ("code", "exit_code", "kind"),
    [(DRIVER_NOT_LOADED, 78, "permanent"), (NOT_READY, 75, "transient")],
    ids=["driver-not-loaded", "not-ready"],
)
def test_gpus_json_carries_the_kind_of_an_nvml_failure(fake_nvml, code, exit_code, kind):
    box = fake_nvml.box(ampere_pair(), init_error=code)
    done = gpus(box.env(_base()), "--json")
    assert done.returncode == exit_code
    data = json.loads(done.stdout)
    assert data["kind"] == "gpus" and data["schema"] == 1 and data["ready"] is False and data["devices"] == []
    assert data["fail"]["kind"] == kind
    assert f"(error {code})" in data["fail"]["message"]
    assert box.calls() == [f"init {code}"]


def test_gpus_leaves_the_box_shut_down(fake_nvml):
    box = fake_nvml.box(ampere_pair())
    assert gpus(box.env(_base())).returncode == 0
    assert box.calls() == ["init 0", "shutdown 0"]


def test_json_before_gpus_prints_the_survey_as_json(fake_nvml):
    box = fake_nvml.box(ampere_pair())
    done = fdl_prepare(box.env(_base()), "--json", "gpus")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["kind"] == "gpus" and data["ready"] is True and data["fail"] is None and data["offered"] == [0, 1]


@pytest.mark.parametrize(
    ("code", "reason"),
    [(DRIVER_NOT_LOADED, "gpu.driver-not-loaded"), (NOT_READY, "gpu.not-ready")],
    ids=["driver-not-loaded", "not-ready"],
)
def test_json_before_gpus_carries_the_reason_of_an_nvml_failure(fake_nvml, code, reason):
    box = fake_nvml.box(ampere_pair(), init_error=code)
    done = fdl_prepare(box.env(_base()), "--json", "gpus")
    assert json.loads(done.stdout)["fail"]["reason"] == reason


@pytest.mark.parametrize("flags", [["--cpu-only"], ["--libtorch", "cpu"], ["--data-path", "/srv/data"]])
def test_a_root_flag_gpus_would_ignore_is_a_usage_error(fake_nvml, flags):
    box = fake_nvml.box(ampere_pair())
    done = fdl_prepare(box.env(_base()), *flags, "gpus")
    assert done.returncode == 2
    assert flags[0] in done.stderr and "gpus" in done.stderr
    assert done.stdout == ""
    assert box.calls() == []


# -- gpus as a health check ----------------------------------------------------------------


def sick_hgx() -> list[FakeGpu]:
    """The fake 8-card box with GPU 5 awaiting a row remap."""
    cards = hgx_h100(8)
    cards[5] = FakeGpu(**H100, remap=(0, 1, 1, 0), fabric=cards[5].fabric)  # type: ignore[arg-type]
    return cards


def test_gpus_expect_gpus_on_a_healthy_eight_card_box_is_ready_and_exits_0(fake_nvml):
    box = fake_nvml.box(hgx_h100(8))
    done = gpus(box.env(_base()), "--expect-gpus", "8", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["kind"] == "gpus" and data["schema"] == 1
    assert data["ready"] is True and data["fail"] is None and data["offered"] == list(range(8))
    human = gpus(box.env(_base()), "--expect-gpus", "8")
    assert human.returncode == 0
    assert (
        "fdl-prepare gpus: ready: an attempt would pass the GPU gate, offering NVIDIA GPU 0, 1, 2, 3, 4, 5, 6, 7"
        in (human.stdout)
    )


def test_gpus_expect_gpus_with_one_sick_card_is_permanent_and_exits_78_naming_it(fake_nvml):
    box = fake_nvml.box(sick_hgx())
    done = gpus(box.env(_base()), "--expect-gpus", "8", "--json")
    assert done.returncode == 78, done.stderr
    data = json.loads(done.stdout)
    assert data["ready"] is False and data["fail"]["reason"] == "gpu.expected-missing"
    assert (
        data["fail"]["kind"] == "permanent"
        and "GPU 5 (NVIDIA H100 80GB HBM3): a row remap is pending" in (data["fail"]["message"])
    )
    assert data["offered"] == [0, 1, 2, 3, 4, 6, 7] and data["health"][5]["healthy"] is False
    human = gpus(box.env(_base()), "--expect-gpus", "8")
    assert human.returncode == 78
    assert "not ready: an attempt would stop at the GPU gate (permanent, gpu.expected-missing)" in human.stdout
    assert "permanent failure" in human.stderr and "nvidia-smi -r -i 5" in human.stderr


def test_gpus_expect_gpus_short_by_a_fabric_still_coming_up_is_transient_and_exits_75(fake_nvml):
    cards = hgx_h100(8)
    cards[2] = FakeGpu(**H100, fabric=(FABRIC_IN_PROGRESS, 0))  # type: ignore[arg-type]
    done = gpus(fake_nvml.box(cards).env(_base()), "--expect-gpus", "8", "--json")
    assert done.returncode == 75, done.stderr
    data = json.loads(done.stdout)
    assert data["fail"]["kind"] == "transient" and data["fail"]["reason"] == "gpu.fabric-not-ready"


def test_gpus_judges_by_the_configs_gate_settings_and_its_own_flags_win(fake_nvml, tmp_path):
    box = fake_nvml.box(hgx_h100(4))
    config = tmp_path / "prepare.toml"
    config.write_text("[join]\ndevices = [1, 2]\nexpect_gpus = 2\n")
    env = box.env(_base())
    env["FDL_PREPARE_CONFIG"] = str(config)
    data = json.loads(gpus(env, "--json").stdout)
    assert data["ready"] is True and data["offered"] == [1, 2] and data["devices_mask"] == [1, 2]
    # After the word, a flag outranks the file, as on an attempt.
    done = gpus(env, "--json", "--expect-gpus", "3")
    assert done.returncode == 78 and json.loads(done.stdout)["fail"]["reason"] == "gpu.expected-missing"
    # --config and the gate's flags before the word are the command's too.
    other = tmp_path / "other.toml"
    other.write_text("[join]\ndevices = [3]\n")
    data = json.loads(
        fdl_prepare(box.env(_base()), "--config", str(other), "--devices", "0,3", "gpus", "--json").stdout
    )
    assert data["offered"] == [0, 3]
    data = json.loads(gpus(box.env(_base()), "--config", str(other), "--json").stdout)
    assert data["offered"] == [3]


def test_gpus_on_a_box_set_cpu_only_is_ready_whatever_its_cards(fake_nvml, tmp_path):
    box = fake_nvml.box([FakeGpu(ecc=3)])
    config = tmp_path / "prepare.toml"
    config.write_text("[join]\ncpu_only = true\nexpect_gpus = 8\n")
    done = gpus(box.env(_base()), "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["ready"] is True and data["gate_skipped"] is True and data["health"][0]["healthy"] is False
    assert any("an attempt skips the GPU gate" in n for n in data["notes"])


@pytest.mark.parametrize("columns", [80, 200])
def test_the_gpus_table_fits_the_terminal_and_never_a_line_over_it(fake_nvml, columns):
    done = gpus(fake_nvml.box(sick_hgx()).env(_base(columns)))
    lines = done.stdout.splitlines()
    assert lines and max(len(line) for line in lines) <= columns, "\n".join(lines)
    table = lines[: lines.index("offered: 0, 1, 2, 3, 4, 6, 7")]
    sick = next(i for i, line in enumerate(table) if line.startswith("5 "))
    if columns == 200:
        # Everything in its row: the whole UUID, the whole status.
        assert "GPU-00000005-1111-2222-3333-000000000005" in table[sick]
        assert "unhealthy, not offered: a row remap is pending" in table[sick]
    else:
        assert "(UUID left out to fit 80 columns; --json has it)" in lines
        assert "UUID" not in table[table.index("(UUID left out to fit 80 columns; --json has it)") + 1]
        # The status is wrapped, never cut: all of it is there.
        said = " ".join(" ".join(table[sick:]).split())
        assert "unhealthy, not offered: a row remap is pending" in said and "until the GPU is reset" in said


def test_the_gpus_table_is_80_columns_wide_when_stdout_is_not_a_terminal(fake_nvml):
    done = gpus(fake_nvml.box(sick_hgx()).env(_base(columns=None)))
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
    assert "(UUID left out to fit 80 columns; --json has it)" in done.stdout.splitlines()


def _hung_box(fake_nvml, call: str):
    box = fake_nvml.box(ampere_pair())
    env = box.env(_base())
    env["FAKE_NVML_HANG"] = call
    return box, env


def _left(box) -> list[int]:
    """The hung processes still alive a moment after the command ended."""
    until = time.monotonic() + 3
    while any(alive(p) for p in hung_pids(box)) and time.monotonic() < until:
        time.sleep(0.05)
    return [p for p in hung_pids(box) if alive(p)] + query_processes(str(box.config))


@pytest.mark.parametrize("call", ["nvmlInitWithFlags", "nvmlDeviceGetMemoryInfo"])
def test_gpus_with_a_hung_nvml_call_is_transient_within_the_deadline_and_leaves_no_process(fake_nvml, call):
    box, env = _hung_box(fake_nvml, call)
    started = time.monotonic()
    done = gpus(env, "--json", "--gpu-timeout", "2", timeout=30)
    took = time.monotonic() - started
    assert done.returncode == 75, done.stderr
    data = json.loads(done.stdout)
    assert data["fail"]["reason"] == "gpu.query-timeout" and data["fail"]["kind"] == "transient"
    assert data["ready"] is False
    assert took < 2 + 5, took
    assert len(hung_pids(box)) == 1
    assert _left(box) == []


def test_an_attempt_with_a_hung_nvml_call_is_transient_within_the_deadline_and_leaves_no_process(fake_nvml):
    box, env = _hung_box(fake_nvml, "nvmlDeviceGetHandleByIndex_v2")
    started = time.monotonic()
    done = fdl_prepare(env, "--json", "--gpu-timeout", "2", timeout=30)
    took = time.monotonic() - started
    assert done.returncode == 75, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["reason"] == "gpu.query-timeout"
    assert "nvmlDeviceGetHandleByIndex for GPU 0 never returned" in done.stdout
    assert took < 2 + 5, took
    assert len(hung_pids(box)) == 1
    assert _left(box) == []


def test_gpus_escapes_a_cards_name_before_it_reaches_the_terminal(fake_nvml):
    # A name is the driver's (or a board's EEPROM's) to say: it must not
    # drive the terminal, hide text or break the columns.
    box = fake_nvml.box([FakeGpu(name="Evil\x1b[2J\rGPU\u202e\tX"), FakeGpu()])
    done = gpus(box.env(_base()))
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\r" not in done.stdout and "\u202e" not in done.stdout
    assert "Evil\\x1b[2J\\rGPU\\u202e\\tX" in done.stdout
    rows = done.stdout.splitlines()
    assert rows[2].split()[:2] == ["0", "Evil\\x1b[2J\\rGPU\\u202e\\tX"]
