"""`fdl-prepare gpus` through the installed console script, in a child process
that finds the fake libnvidia-ml.so.1 through LD_LIBRARY_PATH."""

from __future__ import annotations

import json
import subprocess

import pytest
from console import fdl_prepare
from nvml_fixtures import (
    DRIVER_NOT_LOADED,
    GPU_IS_LOST,
    NOT_READY,
    FakeGpu,
    ampere_pair,
    host_has_nvml,
    no_driver_env,
)


def _base() -> dict[str, str]:
    env = no_driver_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("CUDA_DEVICE_ORDER", None)
    return env


def gpus(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return fdl_prepare(env, "gpus", *args)


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


def test_gpus_on_a_box_without_a_driver_exits_78_naming_the_package():
    if host_has_nvml():
        pytest.skip("this host has a real libnvidia-ml.so.1 on the default search path")
    done = gpus(_base())
    assert done.returncode == 78
    assert "libnvidia-ml.so.1 was not found" in done.stderr
    assert "--cpu-only" in done.stderr


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
    assert data["kind"] == kind
    assert f"(error {code})" in data["message"]
    assert box.calls() == [f"init {code}"]


def test_gpus_leaves_the_box_shut_down(fake_nvml):
    box = fake_nvml.box(ampere_pair())
    assert gpus(box.env(_base())).returncode == 0
    assert box.calls() == ["init 0", "shutdown 0"]


def test_json_before_gpus_prints_the_survey_as_json(fake_nvml):
    box = fake_nvml.box(ampere_pair())
    done = fdl_prepare(box.env(_base()), "--json", "gpus")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["offered"] == [0, 1]


@pytest.mark.parametrize(
    ("code", "reason"),
    [(DRIVER_NOT_LOADED, "gpu.driver-not-loaded"), (NOT_READY, "gpu.not-ready")],
    ids=["driver-not-loaded", "not-ready"],
)
def test_json_before_gpus_carries_the_reason_of_an_nvml_failure(fake_nvml, code, reason):
    box = fake_nvml.box(ampere_pair(), init_error=code)
    done = fdl_prepare(box.env(_base()), "--json", "gpus")
    assert json.loads(done.stdout)["reason"] == reason


@pytest.mark.parametrize("flags", [["--cpu-only"], ["--devices", "0"], ["--config", "/etc/fdl/prepare.toml"]])
def test_a_root_flag_gpus_would_ignore_is_a_usage_error(fake_nvml, flags):
    box = fake_nvml.box(ampere_pair())
    done = fdl_prepare(box.env(_base()), *flags, "gpus")
    assert done.returncode == 2
    assert flags[0] in done.stderr and "gpus" in done.stderr
    assert done.stdout == ""
    assert box.calls() == []
