"""scripts/gpu-check, the checks only a box with an NVIDIA GPU can run: here
against no driver at all (it skips, saying why) and against the fake driver
(tests/fake_nvml), which runs its real code path: the gate, the health
queries, `auto`'s choice and each variant's coverage, with their verdicts."""

from __future__ import annotations

import subprocess
from pathlib import Path

from nvml_fixtures import FakeGpu, ampere_pair, host_has_nvml, no_driver_env, pascal_card

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu-check"


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # No Nix on PATH: the build step skips, saying so, and the run stays short.
    return subprocess.run(
        [str(SCRIPT)], env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120, cwd=REPO
    )


def test_without_an_nvidia_gpu_it_skips_saying_why_and_checks_nothing():
    import pytest

    if host_has_nvml():
        pytest.skip("this host has a real NVIDIA driver")

    done = run(no_driver_env())

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpu-check: SKIP: no NVIDIA GPU here (NVML cannot start")
    assert "PASS" not in done.stdout and "FAIL" not in done.stdout


def test_on_an_ampere_pair_every_check_passes_and_auto_picks_cu128(fake_nvml):
    done = run(fake_nvml.box(ampere_pair(), cuda=(12, 8)).env())

    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "gpu-check: NVML counts 2 GPU(s)" in lines
    assert "PASS gate (fdl-prepare gpus)" in lines
    assert "PASS gpus --expect-gpus 2" in lines and "PASS gpus --expect-gpus 3 refused (exit 78)" in lines
    assert any(line.startswith("PASS auto picks cu128") for line in lines), done.stdout
    assert "PASS coverage of cu128 (7.0, 7.5, 8.0, 8.6, 9.0, 10.0, 12.0)" in lines
    # Health, per card, each query with its verdict.
    assert sum(line.startswith("PASS GPU 0") for line in lines) >= 3, done.stdout
    # No driver directory here: the GPU build says why it did not run.
    assert any(line.startswith("SKIP cu128 build of the example trainer: ") for line in lines), done.stdout
    assert not any(line.startswith("FAIL") for line in lines), done.stdout


def test_a_pascal_card_fails_the_cu128_coverage_naming_the_card(fake_nvml):
    done = run(fake_nvml.box(pascal_card(), cuda=(12, 8)).env())

    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL coverage of cu128")]
    assert failed and "6.1" in failed[0], done.stdout


def test_a_card_with_uncorrectable_ecc_errors_fails_its_health_line(fake_nvml):
    sick = FakeGpu(name="NVIDIA A100-SXM4-80GB", capability=(8, 0), ecc=3)
    done = run(fake_nvml.box([sick], cuda=(12, 8)).env())

    assert done.returncode == 1, done.stdout + done.stderr
    assert any(line.startswith("FAIL") for line in done.stdout.splitlines()), done.stdout
