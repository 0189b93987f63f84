"""The GPU gate, run through the real pynvml against the fake libnvidia-ml.so.1
(tests/fake_nvml): in this process for most cases, in subprocesses where the
library has to be absent or found through LD_LIBRARY_PATH."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nvml_fixtures import (
    DRIVER_NOT_LOADED,
    GPU_IS_LOST,
    LIB_RM_VERSION_MISMATCH,
    NO_PERMISSION,
    NOT_READY,
    NOT_SUPPORTED,
    TIMEOUT,
    UNKNOWN,
    FakeGpu,
    alive,
    ampere_pair,
    default_uuid,
    hopper_mig,
    host_has_nvml,
    hung_pids,
    no_driver_env,
    pascal_card,
    query_processes,
)

from prepare.fail import Fail
from prepare.gpu import gate, nvml
from prepare.gpu import table as gpu_table

REPO = Path(__file__).resolve().parent.parent
FUNCTION_NOT_FOUND = 13


@pytest.fixture(autouse=True)
def _no_masks_from_the_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


def three_cards() -> list[FakeGpu]:
    # Two UUIDs share a prefix, so prefix matching has something to be
    # ambiguous about.
    return [
        FakeGpu(
            name="NVIDIA A100-SXM4-80GB",
            uuid="GPU-aaaa1111-0000-0000-0000-000000000000",
            capability=(8, 0),
            memory=80 << 30,
        ),
        FakeGpu(
            name="NVIDIA A100-SXM4-80GB",
            uuid="GPU-aaaa2222-0000-0000-0000-000000000000",
            capability=(8, 0),
            memory=80 << 30,
        ),
        FakeGpu(
            name="NVIDIA A100-SXM4-80GB",
            uuid="GPU-bbbb3333-0000-0000-0000-000000000000",
            capability=(8, 0),
            memory=80 << 30,
        ),
    ]


def run_python(code: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# -- the survey ---------------------------------------------------------------


def test_a_survey_reports_every_card_with_name_uuid_capability_and_memory(nvml_box):
    nvml_box(
        [
            FakeGpu(),
            FakeGpu(name="NVIDIA GeForce GTX 1080 Ti", capability=(6, 1), memory=11 << 30),
            FakeGpu(name="NVIDIA H100 80GB HBM3", capability=(9, 0), memory=80 << 30),
        ],
        driver="565.57.01",
        cuda=(12, 7),
    )
    gpus = gate.survey({})
    assert gpus.driver_version == "565.57.01"
    assert gpus.cuda_driver_version == (12, 7)
    assert [(d.index, d.name, d.uuid, d.capability, d.memory_total, d.usable) for d in gpus.devices] == [
        (0, "NVIDIA GeForce RTX 3090", default_uuid(0), (8, 6), 24 << 30, True),
        (1, "NVIDIA GeForce GTX 1080 Ti", default_uuid(1), (6, 1), 11 << 30, True),
        (2, "NVIDIA H100 80GB HBM3", default_uuid(2), (9, 0), 80 << 30, True),
    ]
    assert gpus.offered_indices == (0, 1, 2)
    assert gpus.visible is None
    assert gpus.notes == ()


def test_nvml_is_shut_down_after_every_survey(nvml_box):
    box = nvml_box([FakeGpu(), FakeGpu(fail=GPU_IS_LOST)])
    gate.survey({})
    gate.survey({"CUDA_VISIBLE_DEVICES": ""})
    assert box.calls() == ["init 0", "shutdown 0", "init 0", "shutdown 0"]


def test_nvml_is_shut_down_even_when_counting_the_devices_fails(nvml_box):
    box = nvml_box(ampere_pair(), count_error=NO_PERMISSION)
    with pytest.raises(Fail) as failed:
        gate.survey({})
    assert failed.value.permanent
    assert "/dev/nvidia" in failed.value.message
    assert box.calls() == ["init 0", "shutdown 0"]


def test_one_lost_card_beside_two_good_ones_still_passes_the_gate(nvml_box):
    nvml_box([FakeGpu(), FakeGpu(fail=GPU_IS_LOST), FakeGpu()])
    notes: list[str] = []
    gpus = gate.check(gate.GatePlan(), notes)
    assert gpus is not None
    assert gpus.offered_indices == (0, 2)
    lost = gpus.devices[1]
    assert not lost.usable
    assert "GPU is lost" in lost.error
    assert any("GPU 1" in n and "unusable" in n and "nvidia-smi -r -i 1" in n for n in notes), notes


def test_a_card_whose_handle_cannot_be_had_is_unusable_and_nameless(nvml_box):
    nvml_box([FakeGpu(fail=UNKNOWN, fail_on="handle"), FakeGpu()])
    gpus = gate.survey({})
    broken = gpus.devices[0]
    assert (broken.usable, broken.name, broken.uuid, broken.capability) == (False, None, None, None)
    assert broken.error.startswith("nvmlDeviceGetHandleByIndex")
    assert gpus.offered_indices == (1,)


def test_a_card_whose_capability_query_fails_is_unusable_but_keeps_what_it_did_say(nvml_box):
    nvml_box([FakeGpu(fail=UNKNOWN, fail_on="cc")])
    device = gate.survey({}).devices[0]
    assert not device.usable
    assert device.name == "NVIDIA GeForce RTX 3090"
    assert device.capability is None
    assert "nvmlDeviceGetCudaComputeCapability" in device.error


def test_a_card_that_does_not_report_its_memory_is_still_usable(nvml_box):
    # Unified-memory parts answer NOT_SUPPORTED for the memory size.
    nvml_box([FakeGpu(fail=NOT_SUPPORTED, fail_on="mem")])
    device = gate.survey({}).devices[0]
    assert device.usable
    assert device.memory_total is None


def test_every_card_failing_is_permanent_and_names_each_card(nvml_box):
    nvml_box([FakeGpu(fail=GPU_IS_LOST), FakeGpu(fail=UNKNOWN, fail_on="uuid")])
    notes: list[str] = []
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(), notes)
    message = failed.value.message
    assert failed.value.permanent
    assert "GPU 0" in message and "GPU is lost" in message
    assert "GPU 1" in message and "nvmlDeviceGetUUID" in message
    assert "--cpu-only" in message
    assert len([n for n in notes if "unusable" in n]) == 2, "notes must survive the Fail"


def test_a_box_with_the_driver_loaded_but_no_card_is_permanent(nvml_box):
    nvml_box([])
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(), [])
    assert failed.value.permanent
    assert "no NVIDIA device" in failed.value.message
    assert "nvidia-smi -L" in failed.value.message


def test_a_driver_that_will_not_tell_its_versions_is_still_surveyed(nvml_box):
    nvml_box(ampere_pair(), driver_error=UNKNOWN, cuda_error=UNKNOWN)
    gpus = gate.survey({})
    assert (gpus.driver_version, gpus.cuda_driver_version) == (None, None)
    assert gpus.offered_indices == (0, 1)
    assert len([n for n in gpus.notes if "could not read" in n]) == 2


# -- NVML itself unusable ---------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "permanent", "fix"),
    [
        pytest.param(DRIVER_NOT_LOADED, True, "sudo modprobe nvidia", id="driver-not-loaded"),
        pytest.param(LIB_RM_VERSION_MISMATCH, True, "Reboot", id="driver-library-mismatch"),
        pytest.param(NO_PERMISSION, True, "usermod -aG video", id="no-permission"),
        pytest.param(FUNCTION_NOT_FOUND, True, "Upgrade the NVIDIA driver", id="driver-older-than-pynvml"),
        pytest.param(NOT_READY, False, "nvidia-fabricmanager", id="not-ready-yet"),
        pytest.param(UNKNOWN, True, "nvidia-smi", id="unknown"),
    ],
)
def test_each_nvml_init_error_names_its_cause_and_fix(nvml_box, code, permanent, fix):
    box = nvml_box(ampere_pair(), init_error=code)
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(), [])
    assert failed.value.permanent is permanent
    assert fix in failed.value.message
    assert f"(error {code})" in failed.value.message
    # A failed init leaves nothing to shut down.
    assert box.calls() == [f"init {code}"]


def test_a_version_mismatch_says_it_follows_a_driver_upgrade(nvml_box):
    nvml_box(ampere_pair(), init_error=LIB_RM_VERSION_MISMATCH)
    with pytest.raises(Fail) as failed:
        gate.survey({})
    assert "driver/library version mismatch" in failed.value.message
    assert "driver upgrade" in failed.value.message


def test_no_permission_points_at_the_device_files(nvml_box):
    nvml_box(ampere_pair(), init_error=NO_PERMISSION)
    with pytest.raises(Fail) as failed:
        gate.survey({})
    assert "ls -l /dev/nvidia*" in failed.value.message


def test_a_box_without_any_driver_is_told_which_package_to_install():
    if host_has_nvml():
        pytest.skip("this host has a real libnvidia-ml.so.1 on the default search path")
    code = (
        "import json\nfrom prepare.gpu import gate\nfrom prepare.spec import PrepareSpec\nfrom prepare.fail import Fail\n"
        "try:\n    gate.check(gate.GatePlan(), [])\n    print(json.dumps({'kind': None}))\n"
        "except Fail as f:\n    print(json.dumps({'kind': f.kind, 'message': f.message}))\n"
    )
    out = run_python(code, no_driver_env())
    assert out["kind"] == "permanent"
    assert "libnvidia-ml.so.1 was not found" in out["message"]
    assert "apt install nvidia-driver" in out["message"]
    assert "--cpu-only" in out["message"]


def test_a_subprocess_finds_the_fake_through_ld_library_path(fake_nvml):
    box = fake_nvml.box(pascal_card())
    code = "import json\nfrom prepare.gpu import gate\nprint(json.dumps(gate.survey().to_json()))\n"
    out = run_python(code, box.env(no_driver_env()))
    assert [(d["name"], d["capability"]) for d in out["devices"]] == [("NVIDIA GeForce GTX 1080 Ti", "6.1")]
    assert box.calls() == ["init 0", "shutdown 0"]


# -- cpu_only ---------------------------------------------------------------------


def test_cpu_only_never_touches_nvml(nvml_box):
    box = nvml_box(ampere_pair(), init_error=DRIVER_NOT_LOADED)
    notes: list[str] = []
    assert gate.check(gate.GatePlan(cpu_only=True), notes) is None
    assert box.calls() == []
    assert notes == ["GPU gate skipped: cpu_only is set, so only the cpu libtorch variant can be used."]


def test_cpu_only_passes_on_a_box_with_no_driver_and_never_imports_pynvml():
    code = (
        "import json, sys\nfrom prepare.gpu import gate\nfrom prepare.spec import PrepareSpec\n"
        "notes = []\nresult = gate.check(gate.GatePlan(cpu_only=True), notes)\n"
        "print(json.dumps({'result': result, 'notes': notes, 'pynvml': 'pynvml' in sys.modules}))\n"
    )
    out = run_python(code, no_driver_env())
    assert out["result"] is None
    assert out["pynvml"] is False
    assert "cpu_only" in out["notes"][0]


def test_importing_prepare_does_not_import_pynvml():
    out = run_python(
        "import json, sys\nimport prepare, prepare.gpu.gate, prepare.pipeline\nprint(json.dumps('pynvml' in sys.modules))\n",
        no_driver_env(),
    )
    assert out is False


# -- CUDA_VISIBLE_DEVICES ---------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "visible", "offered"),
    [
        pytest.param("0,2", (0, 2), (0, 2), id="indices"),
        pytest.param("2,0", (2, 0), (2, 0), id="reordered"),
        pytest.param(" 1 , 2 ", (1, 2), (1, 2), id="spaces"),
        pytest.param("GPU-bbbb", (2,), (2,), id="unique-uuid-prefix"),
        pytest.param("GPU-aaaa2222-0000-0000-0000-000000000000,0", (1, 0), (1, 0), id="full-uuid"),
        pytest.param("1,GPU-aaaa,0", (1,), (1,), id="ambiguous-prefix-stops"),
        pytest.param("GPU-cccc,0", (), (), id="unknown-uuid-stops"),
        pytest.param("", (), (), id="empty"),
        pytest.param("-1", (), (), id="minus-one"),
        pytest.param("0,-1,1", (0,), (0,), id="minus-one-later-stops"),
        pytest.param("0,x,1", (0,), (0,), id="invalid-entry-stops"),
        pytest.param("0,7,1", (0,), (0,), id="absent-index-stops"),
        pytest.param("0,,1", (0,), (0,), id="empty-entry-stops"),
        pytest.param("0,0,1", (0,), (0,), id="repeat-stops"),
    ],
)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(nvml_box, value, visible, offered):
    nvml_box(three_cards())
    gpus = gate.survey({"CUDA_VISIBLE_DEVICES": value})
    assert gpus.visible == visible
    assert gpus.offered_indices == offered
    assert gpus.cuda_visible_devices == value


def test_an_entry_that_stops_parsing_is_quoted_in_a_note(nvml_box):
    nvml_box(three_cards())
    gpus = gate.survey({"CUDA_VISIBLE_DEVICES": "1,GPU-aaaa,0"})
    stop = [n for n in gpus.notes if "parsing stops" in n]
    assert len(stop) == 1
    assert "'GPU-aaaa'" in stop[0] and "ambiguous" in stop[0] and "GPU 0, GPU 1" in stop[0]
    assert any("hides GPU 0" in n and "GPU 2" in n for n in gpus.notes)


def test_masking_every_card_through_cuda_visible_devices_is_permanent(nvml_box, monkeypatch):
    nvml_box(ampere_pair())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    notes: list[str] = []
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(), notes)
    assert failed.value.permanent
    assert "CUDA_VISIBLE_DEVICES=''" in failed.value.message
    assert "every usable GPU is masked" in failed.value.message
    assert "CUDA sees no device" in " ".join(notes)


def test_a_visible_broken_card_does_not_count_as_offered(nvml_box, monkeypatch):
    nvml_box([FakeGpu(fail=GPU_IS_LOST), FakeGpu()])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(), [])
    assert "CUDA_VISIBLE_DEVICES='0'" in failed.value.message
    assert "GPU 1" in failed.value.message


def test_indices_on_a_box_of_mixed_cards_warn_about_cuda_device_order(nvml_box):
    nvml_box(ampere_pair() + pascal_card())
    loose = gate.survey({"CUDA_VISIBLE_DEVICES": "2"})
    assert any("CUDA_DEVICE_ORDER=PCI_BUS_ID" in n for n in loose.notes)
    pinned = gate.survey({"CUDA_VISIBLE_DEVICES": "2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert not any("CUDA_DEVICE_ORDER" in n for n in pinned.notes)
    by_uuid = gate.survey({"CUDA_VISIBLE_DEVICES": default_uuid(2)})
    assert not any("CUDA_DEVICE_ORDER" in n for n in by_uuid.notes)


# -- MIG --------------------------------------------------------------------------

MIG_A = "MIG-1a2b3c4d-0000-5555-aaaa-000000000001"
MIG_B = "MIG-9f8e7d6c-0000-5555-aaaa-000000000002"


@pytest.mark.parametrize(
    ("value", "visible"),
    [
        pytest.param(MIG_B, (1,), id="mig-uuid"),
        pytest.param("MIG-9f8e", (1,), id="mig-uuid-prefix"),
        pytest.param(f"{MIG_A},{MIG_B}", (1,), id="two-instances-of-one-card"),
        pytest.param(f"0,{MIG_A}", (0, 1), id="card-then-instance"),
        pytest.param(f"MIG-{default_uuid(1)}/1/0", (1,), id="pre-r470-form"),
        pytest.param(f"MIG-{default_uuid(1)},0", (), id="pre-r470-form-without-instance-ids-stops"),
        pytest.param("MIG-ffff,0", (), id="unknown-instance-stops"),
        pytest.param(f"MIG-{default_uuid(0)}/1/0", (0,), id="pre-r470-form-is-not-checked-against-mig-mode"),
    ],
)
def test_a_mig_id_maps_to_the_card_it_lives_on(nvml_box, value, visible):
    nvml_box(ampere_pair()[:1] + hopper_mig(MIG_A, MIG_B))
    gpus = gate.survey({"CUDA_VISIBLE_DEVICES": value})
    assert gpus.visible == visible


def test_a_mig_instance_note_says_the_run_gets_only_its_share(nvml_box):
    nvml_box(ampere_pair()[:1] + hopper_mig(MIG_A))
    gpus = gate.survey({"CUDA_VISIBLE_DEVICES": MIG_A})
    assert gpus.offered_indices == (1,)
    assert any(MIG_A in n and "GPU 1 (NVIDIA H100 80GB HBM3)" in n and "share" in n for n in gpus.notes)


def test_mig_instances_are_only_listed_when_an_entry_asks_for_them():
    calls: list[bool] = []

    def instances():
        calls.append(True)
        return [(MIG_A, 0)]

    device = gate.Device(0, "x", default_uuid(0), (9, 0), 1, True, None)
    assert nvml.parse_visible_devices("0", [device], instances) == ((0,), [])
    assert calls == []
    assert nvml.parse_visible_devices(MIG_A, [device], instances)[0] == (0,)
    assert calls == [True]


# -- devices (--devices) ----------------------------------------------------------


def test_devices_offers_only_the_cards_it_names(nvml_box):
    nvml_box(three_cards())
    notes: list[str] = []
    gpus = gate.check(gate.GatePlan(devices=(2, 0)), notes)
    assert gpus.offered_indices == (0, 2)
    assert gpus.devices_mask == (2, 0)
    assert gpus.masked_by(1) == "devices"
    assert any("leaves out GPU 1" in n for n in notes)


def test_devices_are_cuda_ordinals_among_the_cards_cuda_visible_devices_leaves(nvml_box, monkeypatch):
    # floDl's devices are CUDA's ordinals: ordinal k is the k-th card the
    # variable leaves, in its order (here NVML 2, then NVML 1).
    nvml_box(three_cards())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    gpus = gate.check(gate.GatePlan(devices=(0, 1)), [])
    assert gpus.offered_indices == (2, 1)
    assert gpus.masked_by(0) == "CUDA_VISIBLE_DEVICES"
    gpus = gate.check(gate.GatePlan(devices=(0,)), [])
    assert gpus.offered_indices == (2,)
    assert gpus.masked_by(1) == "devices" and gpus.masked_by(2) is None


def test_unset_cuda_visible_devices_makes_the_ordinals_nvmls_indices(nvml_box, monkeypatch):
    nvml_box(three_cards())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gate.check(gate.GatePlan(devices=(1,)), []).offered_indices == (1,)


def test_devices_naming_an_absent_card_is_permanent_and_names_the_field(nvml_box):
    nvml_box(ampere_pair())
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(devices=(0, 3)), [])
    message = failed.value.message
    assert failed.value.permanent
    assert "devices = [0, 3]" in message and "--devices" in message
    assert "GPU 3" in message and "indices 0-1" in message


def test_an_ordinal_past_what_cuda_visible_devices_leaves_is_permanent_naming_both(nvml_box, monkeypatch):
    nvml_box(ampere_pair())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(devices=(1,)), [])
    assert failed.value.reason == "gpu.device-absent"
    message = failed.value.message
    assert "devices = [1] (--devices) names CUDA device 1" in message
    assert "CUDA_VISIBLE_DEVICES='1' leaves 1 device(s), CUDA ordinals 0-0" in message
    # The one card it leaves is ordinal 0, whatever NVML numbers it.
    assert gate.check(gate.GatePlan(devices=(0,)), []).offered_indices == (1,)


# -- output -----------------------------------------------------------------------


def test_the_table_aligns_its_columns_and_marks_every_status(nvml_box, monkeypatch):
    nvml_box(
        [
            FakeGpu(),
            FakeGpu(name="NVIDIA GeForce GTX 1080 Ti", capability=(6, 1), memory=11 << 30),
            FakeGpu(fail=GPU_IS_LOST, fail_on="uuid"),
        ]
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    gpus = gate.check(gate.GatePlan(), [])
    table = gpu_table.format_table(gpus)
    lines = table.splitlines()
    assert lines[0] == "NVIDIA driver 570.86.15, CUDA 12.8"
    header, rows = lines[1], lines[2:5]
    for column in ("NAME", "UUID", "CC", "MEMORY", "STATUS"):
        start = header.index(column)
        assert all(row[start - 2 : start] == "  " and row[start] != " " for row in rows), (column, table)
    assert rows[0].startswith("0") and rows[0].endswith("offered") and "24.0 GiB" in rows[0] and " 8.6 " in rows[0]
    assert rows[1].endswith("masked by CUDA_VISIBLE_DEVICES") and " 6.1 " in rows[1]
    assert "unusable: nvmlDeviceGetUUID: GPU is lost" in rows[2]
    assert lines[-1] == "offered: 0"


def test_the_table_of_a_box_with_no_card_says_so():
    gpus = gate.Gpus(driver_version="570.86.15", cuda_driver_version=None, devices=(), offered=())
    assert gpu_table.format_table(gpus) == "NVIDIA driver 570.86.15, CUDA unknown\nno NVIDIA device"


def test_the_json_survey_is_plain_json_with_labels_for_versions(nvml_box):
    nvml_box([FakeGpu(), FakeGpu(fail=GPU_IS_LOST)], cuda=(12, 8))
    gpus = gate.check(gate.GatePlan(devices=(0,)), [])
    data = json.loads(json.dumps(gpus.to_json()))
    assert data["driver_version"] == "570.86.15"
    assert data["cuda_driver_version"] == "12.8"
    assert data["offered"] == [0]
    assert data["devices_mask"] == [0]
    assert data["cuda_visible_devices"] is None
    first, second = data["devices"]
    assert first == {
        "index": 0,
        "name": "NVIDIA GeForce RTX 3090",
        "uuid": default_uuid(0),
        "capability": "8.6",
        "memory_total": 24 << 30,
        "usable": True,
        "error": None,
        "offered": True,
        "masked_by": None,
    }
    assert second["usable"] is False and second["offered"] is False and "GPU is lost" in second["error"]
    assert any("GPU 1" in n for n in data["notes"])


def test_devices_given_with_cpu_only_are_noted_as_ignored():
    notes: list[str] = []
    assert gate.check(gate.GatePlan(cpu_only=True, devices=(0, 1)), notes) is None
    assert any("devices (0,1) is ignored with cpu_only" in n for n in notes), notes


def _gone(pid: int, within: float = 3.0) -> bool:
    until = time.monotonic() + within
    while alive(pid) and time.monotonic() < until:
        time.sleep(0.05)
    return not alive(pid)


@pytest.mark.parametrize(
    ("call", "named"),
    [
        ("nvmlInitWithFlags", "nvmlInit never returned"),
        ("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex for GPU 0 never returned"),
        ("nvmlDeviceGetComputeMode", "nvmlDeviceGetComputeMode on GPU 0 never returned"),
    ],
)
def test_a_hung_nvml_call_is_transient_within_the_deadline_and_the_hung_process_is_killed(
    nvml_box, monkeypatch, call, named
):
    box = nvml_box(ampere_pair())
    monkeypatch.setenv("FAKE_NVML_HANG", call)
    started = time.monotonic()
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(query_timeout_s=1.5), [])
    took = time.monotonic() - started
    assert failed.value.reason == "gpu.query-timeout"
    assert not failed.value.permanent
    assert named in failed.value.message and "within 1.5s" in failed.value.message
    assert took < 1.5 + 2.5, took
    # The call was really reached, in a process that is gone now.
    pids = hung_pids(box)
    assert len(pids) == 1
    assert _gone(pids[0])
    assert query_processes(str(box.config)) == []


def test_the_survey_is_one_child_that_answers_as_the_in_process_survey_did(nvml_box):
    box = nvml_box([FakeGpu(), FakeGpu(fail=GPU_IS_LOST, fail_on="ecc")], driver="565.57.01")
    gpus = gate.survey({}, timeout=5)
    # One init and one shutdown: one process made every call.
    assert box.calls() == ["init 0", "shutdown 0"]
    assert [d.usable for d in gpus.devices] == [True, False]
    assert "reading its health" in (gpus.devices[1].error or "")
    assert query_processes(str(box.config)) == []


@pytest.mark.parametrize("code", [NOT_READY, TIMEOUT], ids=["not-ready", "timeout"])
def test_a_card_answering_not_ready_is_transient_as_the_driver_at_start_up_is(nvml_box, code):
    nvml_box([FakeGpu(fail=code, fail_on="uuid")])
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(), [])
    assert failed.value.reason == "gpu.not-ready"
    assert not failed.value.permanent
    assert f"(NVML error {code})" in failed.value.message and "GPU 0" in failed.value.message


def test_a_card_named_in_devices_answering_not_ready_is_transient(nvml_box):
    nvml_box([FakeGpu(), FakeGpu(fail=NOT_READY, fail_on="handle")])
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(devices=(0, 1)), [])
    assert failed.value.reason == "gpu.not-ready"
    assert not failed.value.permanent


def test_expect_gpus_short_by_a_card_answering_not_ready_is_transient(nvml_box):
    nvml_box([FakeGpu(), FakeGpu(fail=TIMEOUT, fail_on="cc")])
    with pytest.raises(Fail) as failed:
        gate.check(gate.GatePlan(expect_gpus=2), [])
    assert failed.value.reason == "gpu.not-ready"
    assert not failed.value.permanent


def test_a_card_answering_not_ready_beside_a_good_one_is_a_note_saying_it_may_be_ready_next_time(nvml_box):
    nvml_box([FakeGpu(), FakeGpu(fail=NOT_READY, fail_on="uuid")])
    notes: list[str] = []
    gpus = gate.check(gate.GatePlan(), notes)
    assert gpus is not None and gpus.offered_indices == (0,)
    assert any("GPU 1" in n and "the next attempt may find it ready" in n for n in notes), notes
