"""GPU health beyond presence, through the real pynvml against the fake
libnvidia-ml.so.1: pending row remaps and page retirements, uncorrectable
ECC errors, the NVLink fabric, the compute mode. A sick card beside healthy
ones is a note and is not offered; no healthy card left stops the box,
naming each card, what is wrong and what fixes it; a fabric still being set
up is worth another attempt. Parts that do not report a check are healthy."""

from __future__ import annotations

import json

import pytest
from console import fdl_prepare
from nvml_fixtures import (
    COMPUTE_EXCLUSIVE_PROCESS,
    COMPUTE_PROHIBITED,
    FABRIC_COMPLETED,
    FABRIC_IN_PROGRESS,
    FABRIC_NOT_STARTED,
    FABRIC_NOT_SUPPORTED,
    GPU_IS_LOST,
    HEALTH_QUERIES,
    UNKNOWN,
    FakeGpu,
    hgx_h100,
    no_driver_env,
)

from prepare.fail import Fail
from prepare.gpu import gate
from prepare.pipeline import prepare
from prepare.spec import PrepareSpec

FUNCTION_NOT_FOUND = 13
H100 = FakeGpu(name="NVIDIA H100 80GB HBM3", capability=(9, 0), memory=80 << 30, fabric=(FABRIC_COMPLETED, 0))

# Each sickness, the words its note or Fail must carry, and the fix it names.
SICK = {
    "pending-remap": (FakeGpu(remap=(1, 2, 1, 0)), "a row remap is pending", "nvidia-smi -r -i 1"),
    "remap-failed": (FakeGpu(remap=(0, 9, 0, 1)), "row remapping failed", "replace the card"),
    "pages-pending": (FakeGpu(pages_pending=True), "pending retirement", "nvidia-smi -r -i 1"),
    "volatile-ecc": (FakeGpu(ecc=3), "3 uncorrectable ECC errors since the driver loaded", "reboot the box"),
    "fabric-failed": (
        FakeGpu(fabric=(FABRIC_COMPLETED, UNKNOWN)),
        "NVLink fabric registration failed",
        "systemctl restart nvidia-fabricmanager",
    ),
    "prohibited": (FakeGpu(compute=COMPUTE_PROHIBITED), "compute mode is Prohibited", "nvidia-smi -i 1 -c DEFAULT"),
}


@pytest.fixture(autouse=True)
def _no_masks_from_the_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


@pytest.mark.parametrize("case", list(SICK))
def test_a_sick_card_beside_a_healthy_one_is_a_note_and_is_not_offered(nvml_box, case):
    sick, words, fix = SICK[case]
    nvml_box([FakeGpu(), sick])
    notes: list[str] = []
    gpus = gate.check(gate.GatePlan(), notes)
    assert gpus is not None
    assert gpus.offered_indices == (0,)
    assert gpus.devices[1].usable and not gpus.devices[1].healthy
    note = next(n for n in notes if n.startswith("GPU 1 "))
    assert "is unhealthy and will not be offered" in note
    assert words in note and fix in note


@pytest.mark.parametrize("case", list(SICK))
def test_a_box_whose_only_card_is_sick_stops_permanently_naming_the_card_and_the_fix(nvml_box, case):
    sick, words, fix = SICK[case]
    nvml_box([sick, sick])
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(), [])
    fail = failed.value
    assert fail.permanent and fail.reason == "gpu.unhealthy"
    assert fail.message.startswith("GPU gate: no healthy GPU: GPU 0 (NVIDIA GeForce RTX 3090): ")
    assert "; GPU 1 (NVIDIA GeForce RTX 3090): " in fail.message
    assert fail.message.count(words) == 2
    assert fix.replace("-i 1", "-i 0") in fail.message and fix in fail.message


def test_each_sick_card_is_named_with_its_own_trouble(nvml_box):
    nvml_box([FakeGpu(remap=(0, 1, 1, 0)), FakeGpu(compute=COMPUTE_PROHIBITED), FakeGpu(fail=GPU_IS_LOST)])
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(), [])
    message = failed.value.message
    zero, one, two = message.split("; GPU ")[:3]
    assert "a row remap is pending" in zero and "Prohibited" not in zero
    assert one.startswith("1 (") and "compute mode is Prohibited" in one
    assert two.startswith("2 (") and "is unusable" in two and "GPU is lost" in two
    assert "--cpu-only" in message


def test_a_card_named_in_devices_that_is_sick_is_permanent_not_dropped_with_a_note(nvml_box):
    nvml_box([FakeGpu(), FakeGpu(ecc=1), FakeGpu()])
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(devices=(0, 1)), [])
    fail = failed.value
    assert fail.permanent and fail.reason == "gpu.device-unhealthy"
    assert "devices = [0, 1] (--devices) names a card that cannot train: GPU 1 (NVIDIA GeForce RTX 3090)" in (
        fail.message
    )
    assert "1 uncorrectable ECC error since the driver loaded" in fail.message
    assert "take it out of devices in [join] (--devices)" in fail.message
    # A sick card devices does not name is left out with a note, as before.
    notes: list[str] = []
    gpus = gate.check(gate.GatePlan(devices=(0, 2)), notes)
    assert gpus is not None and gpus.offered_indices == (0, 2)


def test_a_card_named_in_devices_that_is_lost_stops_an_attempt_too_as_permanent(nvml_box):
    nvml_box([FakeGpu(), FakeGpu(fail=GPU_IS_LOST)])
    with pytest.raises(Fail) as failed:
        prepare(PrepareSpec(devices=(0, 1)), [])
    assert failed.value.reason == "gpu.device-unhealthy" and failed.value.permanent
    assert "GPU 1 (name unknown) is unusable" in failed.value.message and "GPU is lost" in failed.value.message


def test_a_card_named_in_devices_still_setting_up_its_fabric_is_transient(nvml_box):
    nvml_box([H100, FakeGpu(fabric=(FABRIC_IN_PROGRESS, 0))])
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(devices=(0, 1)), [])
    assert not failed.value.permanent and failed.value.reason == "gpu.fabric-not-ready"
    assert "NVLink fabric registration is in progress" in failed.value.message


def test_a_card_masked_by_cuda_visible_devices_is_the_masks_business_not_a_sick_named_one(nvml_box, monkeypatch):
    nvml_box([FakeGpu(), FakeGpu(ecc=1)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    gpus = gate.check(gate.GatePlan(devices=(0,)), [])
    assert gpus is not None and gpus.offered_indices == (0,)
    # devices counts CUDA's ordinals, among what the mask leaves: the sick
    # card it hides cannot be named, and naming past it is an absent card.
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(devices=(0, 1)), [])
    assert failed.value.reason == "gpu.device-absent"


def test_a_fabric_still_being_set_up_on_every_card_is_transient(nvml_box):
    nvml_box([FakeGpu(fabric=(FABRIC_IN_PROGRESS, 0)), FakeGpu(fabric=(FABRIC_NOT_STARTED, 0))])
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(), [])
    fail = failed.value
    assert not fail.permanent and fail.reason == "gpu.fabric-not-ready"
    assert "NVLink fabric registration is in progress" in fail.message
    assert "NVLink fabric registration has not started" in fail.message
    assert "nvidia-fabricmanager" in fail.message and "next attempt" in fail.message


def test_a_card_whose_fabric_is_not_ready_beside_a_registered_one_is_left_out_with_a_note(nvml_box):
    nvml_box([H100, FakeGpu(fabric=(FABRIC_IN_PROGRESS, 0))])
    notes: list[str] = []
    gpus = gate.check(gate.GatePlan(), notes)
    assert gpus is not None and gpus.offered_indices == (0,)
    assert any(n.startswith("GPU 1 ") and "is not ready and will not be offered" in n for n in notes), notes


def test_a_sick_card_and_one_still_setting_up_its_fabric_make_the_box_wait_not_stop(nvml_box):
    nvml_box([FakeGpu(ecc=2), FakeGpu(fabric=(FABRIC_IN_PROGRESS, 0))])
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(), [])
    assert not failed.value.permanent and failed.value.reason == "gpu.fabric-not-ready"
    assert "2 uncorrectable ECC errors" in failed.value.message


def test_an_hgx_box_with_its_fabric_registered_offers_every_card(nvml_box):
    nvml_box(hgx_h100(8))
    gpus = gate.check(gate.GatePlan(), [])
    assert gpus is not None and gpus.offered_indices == tuple(range(8))
    fabric = {c.name: c for c in gpus.devices[0].health}["fabric"]
    # The fake leaves the padding after the one-byte state dirty, as a
    # driver may: the state is read from its own byte.
    assert fabric.state == "ok" and fabric.detail == "NVLink fabric registered"


def test_a_card_that_reports_none_of_the_health_queries_is_healthy_and_offered(nvml_box):
    nvml_box([FakeGpu(unsupported=HEALTH_QUERIES)])
    gpus = gate.check(gate.GatePlan(), [])
    assert gpus is not None and gpus.offered_indices == (0,)
    states = {c.name: c.state for c in gpus.devices[0].health}
    assert states == dict.fromkeys(["row remapping", "retired pages", "ECC", "fabric", "compute mode"], "unknown")


def test_a_card_without_a_fabric_is_healthy(nvml_box):
    nvml_box([FakeGpu(), FakeGpu(fabric=(FABRIC_NOT_SUPPORTED, 0))])
    gpus = gate.check(gate.GatePlan(), [])
    assert gpus is not None and gpus.offered_indices == (0, 1)
    details = [{c.name: c.detail for c in d.health}["fabric"] for d in gpus.devices]
    assert details == ["fabric: not reported by this card or driver", "not part of an NVLink fabric"]


def test_a_driver_without_the_versioned_fabric_call_is_asked_the_original_one(nvml_box):
    nvml_box([FakeGpu(fabric=(FABRIC_IN_PROGRESS, 0), fail=FUNCTION_NOT_FOUND, fail_on="fabricv"), H100])
    notes: list[str] = []
    gpus = gate.check(gate.GatePlan(), notes)
    assert gpus is not None and gpus.offered_indices == (1,)
    assert {c.name: c.state for c in gpus.devices[0].health}["fabric"] == "not-ready"


def test_exclusive_process_mode_is_healthy(nvml_box):
    nvml_box([FakeGpu(compute=COMPUTE_EXCLUSIVE_PROCESS)])
    gpus = gate.check(gate.GatePlan(), [])
    assert gpus is not None and gpus.offered_indices == (0,)
    assert {c.name: c.detail for c in gpus.devices[0].health}["compute mode"] == "compute mode Exclusive_Process"


def test_an_error_reading_a_check_leaves_it_unknown_but_a_lost_gpu_is_unusable(nvml_box):
    nvml_box([FakeGpu(fail=UNKNOWN, fail_on="ecc"), FakeGpu(fail=GPU_IS_LOST, fail_on="remap")])
    notes: list[str] = []
    gpus = gate.check(gate.GatePlan(), notes)
    assert gpus is not None and gpus.offered_indices == (0,)
    ecc = {c.name: c for c in gpus.devices[0].health}["ECC"]
    assert ecc.state == "unknown" and "could not be read" in ecc.detail and "error 999" in ecc.detail
    lost = gpus.devices[1]
    assert not lost.usable and "GPU is lost" in (lost.error or "")
    assert any("GPU 1" in n and "is unusable" in n and "nvidia-smi -r -i 1" in n for n in notes), notes


def test_prepare_offers_the_run_only_the_healthy_cards(nvml_box):
    nvml_box([FakeGpu(), FakeGpu(remap=(0, 1, 1, 0)), FakeGpu()])
    notes: list[str] = []
    done = prepare(PrepareSpec(), notes)
    assert done.devices == (0, 2)


def test_the_json_survey_carries_each_cards_health(nvml_box):
    nvml_box([FakeGpu(), FakeGpu(compute=COMPUTE_PROHIBITED)])
    data = json.loads(json.dumps(gate.check(gate.GatePlan(), []).to_json()))  # type: ignore[union-attr]
    assert data["offered"] == [0]
    assert [h["index"] for h in data["health"]] == [0, 1]
    assert data["health"][0]["healthy"] is True and data["health"][1]["healthy"] is False
    compute = next(c for c in data["health"][1]["checks"] if c["check"] == "compute mode")
    assert compute["state"] == "sick" and "nvidia-smi -i 1 -c DEFAULT" in compute["action"]


# -- fdl-prepare gpus ------------------------------------------------------------------


def _base() -> dict[str, str]:
    env = no_driver_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("CUDA_DEVICE_ORDER", None)
    env.pop("FDL_PREPARE_CONFIG", None)
    # The table whole, one row a card.
    env["COLUMNS"] = "1000"
    return env


def test_gpus_shows_each_cards_health_and_whether_it_is_offered(fake_nvml):
    box = fake_nvml.box([H100, FakeGpu(remap=(0, 1, 1, 0)), FakeGpu(fabric=(FABRIC_IN_PROGRESS, 0))])
    done = fdl_prepare(box.env(_base()), "gpus")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[2].endswith("offered")
    assert "unhealthy, not offered: a row remap is pending" in lines[3]
    assert "not ready, not offered: NVLink fabric registration is in progress" in lines[4]
    assert "offered: 0" in lines
    health = lines[lines.index("NVIDIA health (NVML):") :]
    assert health[1].startswith("  GPU 0: ok: no row remap pending")
    assert health[2].startswith("  GPU 1: sick: a row remap is pending")
    assert health[
        3
    ] == "    fix (row remapping): reset the GPU (`sudo nvidia-smi -r -i 1`, with nothing running on it) " + (
        "or reboot the box"
    )
    assert health[4].startswith("  GPU 2: not ready: ")
    assert "GPU 1" in done.stderr and "unhealthy" in done.stderr


def test_gpus_on_a_box_of_only_sick_cards_is_permanent_with_the_survey_and_the_gates_reason(fake_nvml):
    box = fake_nvml.box([FakeGpu(ecc=1)])
    done = fdl_prepare(box.env(_base()), "--json", "gpus")
    assert done.returncode == 78, done.stderr
    data = json.loads(done.stdout)
    assert data["offered"] == [] and data["health"][0]["healthy"] is False
    assert data["ready"] is False and data["fail"]["reason"] == "gpu.unhealthy"


# -- expect_gpus -------------------------------------------------------------------------


def test_a_box_with_a_card_fallen_off_the_bus_fails_expect_gpus_naming_the_missing_index(nvml_box):
    nvml_box(hgx_h100(7))
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(expect_gpus=8), [])
    fail = failed.value
    assert fail.permanent and fail.reason == "gpu.expected-missing"
    assert fail.message.startswith(
        "GPU gate: expect_gpus = 8 (--expect-gpus), but this box offers 7 healthy NVIDIA GPUs (0, 1, 2, 3, 4, 5, 6): "
        "GPU 7 is missing: NVML lists 7 NVIDIA GPUs."
    )
    assert "fallen off the bus" in fail.message and "--expect-gpus" in fail.message


def test_expect_gpus_names_a_sick_card_with_its_fix_and_a_lost_one(nvml_box):
    cards = hgx_h100(4)
    cards[1] = FakeGpu(name="NVIDIA H100 80GB HBM3", capability=(9, 0), remap=(0, 1, 1, 0))
    cards[3] = FakeGpu(fail=GPU_IS_LOST)
    nvml_box(cards)
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(expect_gpus=4), [])
    message = failed.value.message
    assert "offers 2 healthy NVIDIA GPUs (0, 2): GPU 1 (NVIDIA H100 80GB HBM3): a row remap is pending" in message
    assert "nvidia-smi -r -i 1" in message
    assert "GPU 3 (name unknown) is unusable: " in message and "GPU is lost" in message


def test_expect_gpus_counts_what_the_masks_leave(nvml_box):
    nvml_box(hgx_h100(2))
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(expect_gpus=2, devices=(0,)), [])
    assert failed.value.reason == "gpu.expected-missing"
    assert "GPU 1 (NVIDIA H100 80GB HBM3) is masked by devices" in failed.value.message


def test_expect_gpus_short_only_by_cards_setting_up_their_fabric_is_transient(nvml_box):
    cards = hgx_h100(2)
    cards[1] = FakeGpu(name="NVIDIA H100 80GB HBM3", capability=(9, 0), fabric=(FABRIC_IN_PROGRESS, 0))
    nvml_box(cards)
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(expect_gpus=2), [])
    assert not failed.value.permanent and failed.value.reason == "gpu.fabric-not-ready"
    assert "next attempt" in failed.value.message


def test_expect_gpus_met_passes_and_offers_them(nvml_box):
    nvml_box(hgx_h100(8))
    gpus = gate.check(gate.GatePlan(expect_gpus=8), [])
    assert gpus is not None and len(gpus.offered) == 8


def test_expect_gpus_with_cpu_only_is_noted_as_ignored():
    notes: list[str] = []
    assert gate.check(gate.GatePlan(cpu_only=True, expect_gpus=8), notes) is None
    assert any("expect_gpus (8) is ignored with cpu_only" in n for n in notes), notes


@pytest.mark.parametrize("value", [0, -1, True, "8", 1.5])
def test_expect_gpus_must_be_a_count_from_one(value):
    from prepare.plan import plan

    with pytest.raises(Fail) as failed:
        plan(PrepareSpec(expect_gpus=value))
    assert failed.value.reason == "config.invalid" and "expect_gpus" in failed.value.message


def test_expect_gpus_from_the_flag_stops_the_command_with_exit_78(fake_nvml, tmp_path):
    box = fake_nvml.box(hgx_h100(7))
    env = box.env(_base())
    env["FDL_PREPARE_CONFIG"] = str(tmp_path / "prepare.toml")
    env["HOME"] = str(tmp_path)
    (tmp_path / "prepare.toml").write_text("[join]\nexpect_gpus = 4\n")
    assert fdl_prepare(env, "--json").returncode == 0
    done = fdl_prepare(env, "--json", "--expect-gpus", "8")
    assert done.returncode == 78, done.stderr
    assert json.loads(done.stdout)["reason"] == "gpu.expected-missing"
