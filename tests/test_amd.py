"""AMD GPUs: the survey (prepare/gpu/amd.py), the gate over both vendors, and
`fdl-prepare gpus`, against fake boxes put where a real box has them: the
KFD topology and DRM class bind-mounted over /sys/class/kfd and
/sys/class/drm, /dev/kfd and the render nodes as device nodes, in a private
mount namespace (tests/amd_fixtures.py says where the shapes come from).
The mask parsers are also exercised as pure functions."""

from __future__ import annotations

import json
import os
import time

import pytest
from amd_fixtures import apu, clean_env, mi300x, mi300x_uuid, rx7900xtx, rx7900xtx_gpu
from nvml_fixtures import ampere_pair, host_has_nvml, query_processes

from prepare.gpu import amd
from prepare.gpu.amd import AmdDevice, gfx_name, parse_hip_visible_devices, parse_override, parse_rocr_visible_devices

OTHER_UID = 54321

SURVEY = "import json\nfrom prepare.gpu import amd\nprint(json.dumps(amd.survey().to_json()))\n"
SURVEY_NOTES = "import json\nfrom prepare.gpu import amd\ns = amd.survey()\nprint(json.dumps(list(s.notes)))\n"

# The variants `auto` chooses among: the shipped ones and the test flake's
# ROCm stand-ins, as `nix eval --json` prints them.
VARIANTS = {
    "cpu": {"label": "cpu", "cuda": None, "archs": []},
    "cu128": {"label": "cu128", "cuda": "12.8", "archs": ["7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]},
    "rocm6.4": {
        "label": "rocm6.4",
        "cuda": None,
        "archs": [],
        "vendor": "amd",
        "rocm": "6.4",
        "gfx": ["gfx900", "gfx906", "gfx908", "gfx90a", "gfx942", "gfx1030", "gfx1100", "gfx1101", "gfx1102"],
    },
    "rocm7.0": {
        "label": "rocm7.0",
        "cuda": None,
        "archs": [],
        "vendor": "amd",
        "rocm": "7.0",
        "gfx": ["gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1151"],
    },
}


def choose_code(libtorch: str = "auto", variants: dict = VARIANTS) -> str:
    """gate.check then variants.choose, in the box; prints the pick or the Fail."""
    return (
        "import json\n"
        "from prepare.build import variants\n"
        "from prepare.gpu import gate\n"
        "from prepare.fail import Fail\n"
        "from prepare.spec import PrepareSpec\n"
        "notes = []\n"
        "try:\n"
        "    gpus = gate.check(gate.GatePlan(), notes)\n"
        f"    v = variants.choose({libtorch!r}, variants.parse_variants({variants!r}, 'path:/f'), gpus, False, 'path:/f', notes)\n"
        "    print(json.dumps({'label': v.label, 'notes': notes}))\n"
        "except Fail as f:\n"
        "    print(json.dumps({'kind': f.kind, 'message': f.message, 'notes': notes}))\n"
    )


def run_json(box, code: str, env=None, uid=None) -> object:
    done = box.run(code, env, uid)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def no_nvml():
    if host_has_nvml():
        pytest.skip("this host has a real libnvidia-ml.so.1 on the default search path")


# -- the survey, from the fake boxes ------------------------------------------------


def test_an_mi300x_box_surveys_eight_gfx942_gpus_numbered_as_rocm_numbers_them(amd_box):
    got = run_json(amd_box(mi300x()), SURVEY)
    devices = got["devices"]
    assert [d["index"] for d in devices] == list(range(8))
    # CPU nodes 0 and 1 are not GPUs: the GPUs are topology nodes 2-9.
    assert [d["node"] for d in devices] == list(range(2, 10))
    first = devices[0]
    assert first == {
        "index": 0,
        "node": 2,
        "name": "AMD Instinct MI300X OAM",
        "gfx": "gfx942",
        "target": "gfx942",
        "uuid": mi300x_uuid(0),
        "pci": "0000:05:00.0",
        "device_id": "0x74a1",
        "render_node": "/dev/dri/renderD128",
        "memory_total": 205822885888,
        "usable": True,
        "error": None,
        "run_index": 0,
        "offered": True,
        "masked_by": None,
    }
    assert devices[7]["pci"] == "0000:e5:00.0" and devices[7]["render_node"] == "/dev/dri/renderD135"
    assert got["offered"] == list(range(8))


def test_a_radeon_rx_7900_xtx_is_gfx1100_and_a_board_without_a_product_name_has_none(amd_box):
    got = run_json(amd_box(rx7900xtx()), SURVEY)
    (card,) = got["devices"]
    assert (card["index"], card["node"], card["gfx"], card["name"]) == (0, 1, "gfx1100", None)
    assert card["pci"] == "0000:03:00.0" and card["device_id"] == "0x744c"
    assert card["memory_total"] == 25753026560


def test_an_apu_igpu_without_compute_units_is_not_a_gpu(amd_box):
    box = amd_box(apu())
    got = run_json(box, SURVEY)
    assert got["devices"] == [] and got["offered"] == []
    notes = run_json(box, SURVEY_NOTES)
    assert any("node 1" in n and "gfx90c" in n and "simd_count 0" in n and "0x1638" in n for n in notes), notes


def test_a_box_without_a_kfd_topology_has_no_amd_survey_at_all():
    # This machine has no amdgpu driver: the survey is one failed listdir.
    import os

    if os.path.exists(amd.TOPOLOGY):
        pytest.skip("this host has an amdgpu KFD topology")
    assert amd.survey({}) is None


@pytest.mark.parametrize(
    ("blocking", "named"),
    [
        ("sys/kfd/kfd/topology/nodes/3/properties", "reading /sys/class/kfd/kfd/topology/nodes/3/properties"),
        (
            "sys/drm/renderD129/device/mem_info_vram_total",
            "reading /sys/class/drm/renderD129/device/mem_info_vram_total",
        ),
    ],
    ids=["topology", "drm"],
)
def test_a_kfd_read_that_never_answers_is_transient_within_the_deadline_and_leaves_no_process(
    amd_box, no_nvml, blocking, named
):
    # A FIFO nobody writes blocks whoever opens it to read, as a sysfs read
    # of a card in a bad state can.
    box = amd_box(mi300x())
    path = box.root / blocking
    path.unlink()
    os.mkfifo(path, 0o444)
    env = clean_env()
    env["FDL_TEST_BOX"] = str(box.root)
    started = time.monotonic()
    out = box.gate(env, query_timeout_s=1.5)
    took = time.monotonic() - started
    assert out.get("reason") == "gpu.query-timeout", out
    assert out["kind"] == "transient"
    assert f"({named} never returned)" in out["message"]
    # The namespace's setup costs a second or two of its own.
    assert took < 1.5 + 8, took
    assert query_processes(f"FDL_TEST_BOX={box.root}") == []


# -- the gate over both vendors -----------------------------------------------------


def test_an_amd_only_box_passes_the_gate_without_any_nvidia_driver(amd_box, no_nvml):
    out = amd_box(mi300x()).gate()
    gpus = out["gpus"]
    assert gpus["devices"] == [] and gpus["offered"] == []
    assert "NVML Shared Library Not Found" in gpus["nvidia_error"]
    assert gpus["amd"]["offered"] == list(range(8))
    assert any(n.startswith("NVIDIA: no usable NVML on this box of AMD GPUs") for n in out["notes"]), out["notes"]
    offering = [n for n in out["notes"] if n.startswith("GPU gate: offering")]
    assert offering == [
        "GPU gate: offering AMD GPU 0, 1, 2, 3, 4, 5, 6, 7 (gfx942) to the run; no NVIDIA GPU "
        "(NVML said 'NVML Shared Library Not Found' (error 12) at nvmlInit)."
    ]


def test_an_apu_box_without_nvidia_keeps_the_nvidia_message(amd_box, no_nvml):
    out = amd_box(apu()).gate()
    assert out["kind"] == "permanent"
    assert "libnvidia-ml.so.1 was not found" in out["message"]
    assert "apt install nvidia-driver" in out["message"] and "--cpu-only" in out["message"]


def test_a_mixed_box_trains_on_its_nvidia_cards_beside_an_apu_igpu(amd_box, fake_nvml):
    nvidia = fake_nvml.box(ampere_pair())
    box = amd_box(apu())
    out = box.gate(nvidia.env(clean_env()))
    assert out["gpus"]["offered"] == [0, 1]
    assert out["gpus"]["amd"]["devices"] == []
    assert "GPU gate: offering NVIDIA GPU 0, 1 to the run; no AMD GPU is offered." in out["notes"]
    picked = run_json(box, choose_code(), nvidia.env(clean_env()))
    assert picked["label"] == "cu128"
    assert any("picked cu128" in n and "8.6" in n for n in picked["notes"]), picked["notes"]


def test_a_box_with_cards_of_both_vendors_picks_the_vendor_with_more_and_says_why(amd_box, fake_nvml):
    nvidia = fake_nvml.box(ampere_pair())
    env = nvidia.env(clean_env())
    two_to_one = run_json(amd_box(rx7900xtx()), choose_code(), env)
    assert two_to_one["label"] == "cu128"
    why = next(n for n in two_to_one["notes"] if "picked cu128" in n)
    assert "2 NVIDIA and 1 AMD" in why and "more of them" in why
    assert any("1 offered AMD GPU(s) sit idle" in n for n in two_to_one["notes"]), two_to_one["notes"]

    two_to_eight = run_json(amd_box(mi300x()), choose_code(), env)
    assert two_to_eight["label"] == "rocm7.0"
    assert any("2 NVIDIA and 8 AMD" in n for n in two_to_eight["notes"])
    assert any("2 offered NVIDIA GPU(s) sit idle" in n for n in two_to_eight["notes"])


def test_auto_picks_the_newest_rocm_that_covers_every_amd_card(amd_box, no_nvml):
    picked = run_json(amd_box(mi300x()), choose_code())
    assert picked["label"] == "rocm7.0"
    assert any("picked rocm7.0" in n and "gfx942" in n for n in picked["notes"])


def test_a_cuda_libtorch_on_an_amd_only_box_is_permanent_and_names_the_rocm_variants(amd_box, no_nvml):
    out = run_json(amd_box(rx7900xtx()), choose_code("cu128"))
    assert out["kind"] == "permanent"
    assert "libtorch cu128 is a CUDA 12.8 build" in out["message"] and "AMD GPUs only" in out["message"]
    assert "rocm6.4, rocm7.0" in out["message"] and "--libtorch auto" in out["message"]


def test_a_variant_lacking_a_cards_gfx_target_is_permanent_and_names_the_target(amd_box, no_nvml):
    instinct_only = {**VARIANTS, "rocm-instinct": {**VARIANTS["rocm7.0"], "label": "rocm-instinct", "gfx": ["gfx942"]}}
    out = run_json(amd_box(rx7900xtx()), choose_code("rocm-instinct", instinct_only))
    assert out["kind"] == "permanent"
    message = out["message"]
    assert "AMD GPU 0" in message and "gfx1100" in message and "gfx942" in message
    assert "Nothing was downloaded" in message
    assert "libtorch = 'rocm6.4' (--libtorch rocm6.4)" in message


def test_hsa_override_gfx_version_is_the_target_coverage_checks(amd_box, no_nvml):
    env = {**clean_env(), "HSA_OVERRIDE_GFX_VERSION": "9.4.2"}
    box = amd_box(rx7900xtx())
    got = run_json(box, SURVEY, env)
    assert (got["gfx_override"], got["devices"][0]["gfx"], got["devices"][0]["target"]) == (
        "gfx942",
        "gfx1100",
        "gfx942",
    )
    instinct_only = {**VARIANTS, "rocm-instinct": {**VARIANTS["rocm7.0"], "label": "rocm-instinct", "gfx": ["gfx942"]}}
    assert run_json(box, choose_code("rocm-instinct", instinct_only), env)["label"] == "rocm-instinct"


# -- masks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "offered", "run"),
    [
        pytest.param({"ROCR_VISIBLE_DEVICES": "3,1"}, [3, 1], {3: 0, 1: 1}, id="rocr-indices"),
        # ROCm's own example B: an index, a full UUID, then an absent index that stops.
        pytest.param({"ROCR_VISIBLE_DEVICES": f"3,{mi300x_uuid(0)},9"}, [3, 0], {3: 0, 0: 1}, id="rocr-uuid"),
        pytest.param({"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": "1"}, [5], {5: 0}, id="hip-after-rocr"),
        pytest.param({"HIP_VISIBLE_DEVICES": "7,0"}, [7, 0], {7: 0, 0: 1}, id="hip"),
        pytest.param({"CUDA_VISIBLE_DEVICES": "2"}, [2], {2: 0}, id="hip-reads-cuda-visible-devices"),
        pytest.param({"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "6"}, [6], {6: 0}, id="empty-hip"),
        pytest.param({"HIP_VISIBLE_DEVICES": ""}, list(range(8)), {i: i for i in range(8)}, id="empty-hip-hides-none"),
    ],
)
def test_rocm_masks_choose_and_number_the_cards_as_the_runtime_does(amd_box, no_nvml, env, offered, run):
    out = amd_box(mi300x()).gate({**clean_env(), **env})
    amd_json = out["gpus"]["amd"]
    assert amd_json["offered"] == offered
    assert {d["index"]: d["run_index"] for d in amd_json["devices"] if d["offered"]} == run


def test_rocr_visible_devices_set_and_empty_masks_every_card_and_is_permanent(amd_box, no_nvml):
    out = amd_box(mi300x()).gate({**clean_env(), "ROCR_VISIBLE_DEVICES": ""})
    assert out["kind"] == "permanent"
    assert "every usable GPU is masked: ROCR_VISIBLE_DEVICES=''" in out["message"]
    assert "ROCR_VISIBLE_DEVICES" in out["message"] and "HIP_VISIBLE_DEVICES" in out["message"]
    assert "ROCR_VISIBLE_DEVICES is set and empty: ROCm sees no AMD GPU." in out["notes"]


def test_devices_takes_rocm_indices_on_an_amd_box(amd_box, no_nvml):
    out = amd_box(mi300x()).gate(devices=(6, 1))
    assert out["gpus"]["amd"]["offered"] == [1, 6]
    assert any("leaves out AMD GPU 0" in n for n in out["notes"])
    absent = amd_box(rx7900xtx()).gate(devices=(0, 2))
    assert absent["kind"] == "permanent"
    assert "GPU 2" in absent["message"] and "1 AMD GPU(s), indices 0-0" in absent["message"]


# -- permissions and missing device nodes ----------------------------------------------


def test_a_render_node_this_user_cannot_open_is_permanent_and_names_the_groups(amd_box):
    # /dev/kfd open to all, the render node crw-rw---- root:render (video
    # where there is no render group): the classic first contact.
    box = amd_box(rx7900xtx(), kfd_mode=0o666, render_mode=0o660)
    out = box.gate(uid=OTHER_UID)
    assert out["kind"] == "permanent"
    message = out["message"]
    assert "cannot open /dev/dri/renderD128 (EACCES" in message and "crw-rw----" in message
    assert "usermod -aG render,video" in message and "--group-add render" in message
    assert "--cpu-only" in message
    # Root opens it: the same box passes.
    assert box.gate()["gpus"]["amd"]["offered"] == [0]


def test_kfd_this_user_cannot_open_is_permanent_and_names_it(amd_box):
    out = amd_box(mi300x(), kfd_mode=0o660, render_mode=0o666).gate(uid=OTHER_UID)
    assert out["kind"] == "permanent"
    assert "cannot open /dev/kfd (EACCES" in out["message"]
    assert "SupplementaryGroups=render video" in out["message"]


def test_no_dev_kfd_is_permanent_and_says_to_pass_it_into_the_container(amd_box, no_nvml):
    out = amd_box(mi300x(), no_kfd=True).gate()
    assert out["kind"] == "permanent"
    assert "/dev/kfd does not exist" in out["message"] and "--device=/dev/kfd" in out["message"]


def test_a_gpu_whose_render_node_is_missing_is_dropped_and_the_rest_renumbered(amd_box, no_nvml):
    # A container given only some of /dev/dri: ROCm skips the GPU whose
    # render node it cannot find, and numbers the others without it.
    got = run_json(amd_box(mi300x(), no_render=[129]), SURVEY)
    dropped = got["devices"][1]
    assert (dropped["node"], dropped["index"], dropped["usable"]) == (3, None, False)
    assert "--device=/dev/dri" in dropped["error"]
    assert [d["index"] for d in got["devices"] if d["index"] is not None] == list(range(7))
    assert got["devices"][2]["node"] == 4 and got["devices"][2]["index"] == 1
    assert got["offered"] == list(range(7))


# -- the whole pipeline, with real Nix and the test flake ----------------------------


def prepare_code(flake: str, state: str, source: str, libtorch: str) -> str:
    return (
        "import json\n"
        "from prepare.fail import Fail\n"
        "from prepare.pipeline import prepare\n"
        "from prepare.spec import PrepareSpec, SourceSpec\n"
        "events, notes = [], []\n"
        f"spec = PrepareSpec(source=SourceSpec(from_={source!r}), libtorch={libtorch!r}, flake={flake!r}, "
        f"state_dir={state!r})\n"
        "try:\n"
        "    done = prepare(spec, notes, progress=events.append)\n"
        "    out = {'done': done.to_json()}\n"
        "except Fail as f:\n"
        "    out = {'kind': f.kind, 'message': f.message}\n"
        "print(json.dumps({**out, 'events': events, 'notes': notes}, default=str))\n"
    )


@pytest.mark.nix
def test_a_rocm_variant_lacking_a_cards_target_fails_before_any_fetch(
    amd_box, no_nvml, nix_env, make_flake, state_dir, git_source
):
    from nix_fixtures import trainer

    flake = make_flake(
        extra_nix='toolchain: { rocm-instinct = { vendor = "amd"; rocm = "7.0"; cuda = null; archs = [ ]; '
        'gfx = [ "gfx90a" "gfx942" ]; package = toolchain.mkLibtorch { label = "rocm-instinct"; }; }; }'
    )
    src = git_source(trainer())
    out = run_json(amd_box(rx7900xtx()), prepare_code(flake, state_dir, src.url, "rocm-instinct"), clean_env(nix_env))
    assert out["kind"] == "permanent"
    message = out["message"]
    assert "libtorch rocm-instinct ships no kernel for AMD GPU 0 (name unknown, gfx1100)" in message
    assert "gfx90a, gfx942" in message and "--libtorch rocm6.4" in message
    # Nothing fetched, nothing built: the only step reached is the evaluation.
    events = out["events"]
    assert [e["name"] for e in events if e["type"] == "step"] == ["evaluate"]
    assert not any(e["type"].startswith(("download", "build", "substitute")) for e in events)


@pytest.mark.nix
def test_auto_builds_the_rocm_libtorch_for_an_mi300x_box(amd_box, no_nvml, nix_env, test_flake, state_dir, git_source):
    from nix_fixtures import trainer

    src = git_source(trainer())
    out = run_json(amd_box(mi300x()), prepare_code(test_flake, state_dir, src.url, "auto"), clean_env(nix_env))
    assert "done" in out, out.get("message")
    done = out["done"]
    assert done["libtorch"]["variant"] == "rocm7.0"
    assert done["devices"] == list(range(8)) and done["gpu_vendor"] == "amd"
    assert any("picked rocm7.0" in n for n in out["notes"])
    with open(f"{done['libtorch']['path']}/share/fdl-libtorch-variant") as fh:
        assert fh.read().strip() == "rocm7.0"


# -- fdl-prepare gpus ---------------------------------------------------------------

GPUS_CLI = "import sys\nfrom prepare.cli import main\nsys.argv = ['fdl-prepare', 'gpus'{extra}]\nmain()\n"


def test_gpus_lists_the_amd_cards_with_rocm_and_run_numbering(amd_box, no_nvml):
    env = {**clean_env(), "ROCR_VISIBLE_DEVICES": "2,0", "COLUMNS": "200"}
    done = amd_box(mi300x()).run(GPUS_CLI.format(extra=""), env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("NVIDIA: none (NVML said 'NVML Shared Library Not Found'")
    at = lines.index("AMD (amdgpu KFD topology)")
    assert lines[at + 1].split() == ["IDX", "RUN", "NAME", "GFX", "UUID", "PCI", "MEMORY", "STATUS"]
    rows = lines[at + 2 : at + 10]
    assert rows[0].split()[:2] == ["0", "1"] and rows[0].endswith("offered") and "gfx942" in rows[0]
    assert rows[2].split()[:2] == ["2", "0"] and "191.7 GiB" in rows[2]
    assert rows[1].split()[:2] == ["1", "-"] and rows[1].endswith("masked by ROCR_VISIBLE_DEVICES")
    assert "offered (AMD): 2, 0" in lines
    assert lines[-1] == "fdl-prepare gpus: ready: an attempt would pass the GPU gate, offering AMD GPU 2, 0"


def test_the_amd_table_fits_80_columns_leaving_out_the_uuid_and_pci_columns(amd_box, no_nvml):
    env = {**clean_env(), "ROCR_VISIBLE_DEVICES": "2,0", "COLUMNS": "80"}
    done = amd_box(mi300x()).run(GPUS_CLI.format(extra=""), env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    at = lines.index("(UUID, PCI left out to fit 80 columns; --json has them)")
    assert lines[at + 1].split() == ["IDX", "RUN", "NAME", "GFX", "MEMORY", "STATUS"]
    assert lines[at + 3].endswith("masked by ROCR_VISIBLE_DEVICES")


def test_gpus_expect_gpus_on_an_amd_box_the_masks_leave_short_is_permanent_and_exits_78(amd_box, no_nvml):
    env = {**clean_env(), "ROCR_VISIBLE_DEVICES": "2,0"}
    done = amd_box(mi300x()).run(GPUS_CLI.format(extra=", '--expect-gpus', '8', '--json'"), env)
    assert done.returncode == 78, done.stderr
    data = json.loads(done.stdout)
    assert data["ready"] is False and data["fail"]["reason"] == "gpu.expected-missing"
    assert "this box offers 2 healthy AMD GPUs (2, 0)" in data["fail"]["message"]


def test_gpus_json_lists_both_vendors(amd_box, fake_nvml):
    nvidia = fake_nvml.box(ampere_pair())
    done = amd_box(rx7900xtx()).run(GPUS_CLI.format(extra=", '--json'"), nvidia.env(clean_env()))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["offered"] == [0, 1] and data["devices"][0]["capability"] == "8.6"
    assert data["amd"]["offered"] == [0] and data["amd"]["devices"][0]["gfx"] == "gfx1100"


# -- the parsers, as pure functions ---------------------------------------------------


def gpu(index: int, unique_id: int) -> AmdDevice:
    return AmdDevice(index, index + 1, None, "gfx942", "gfx942", unique_id, None, None, 128 + index, None, True, None)


# ROCm's own examples (core/inc/amd_filter_device.h), on four GPUs with these UUIDs.
FOUR = [
    gpu(0, 0xBABABABABABABABA),
    gpu(1, 0xABBAABBAABBAABBA),
    gpu(2, 0xBABAABBAABBABABA),
    gpu(3, 0xABBABABABABAABBA),
]


@pytest.mark.parametrize(
    ("value", "visible"),
    [
        pytest.param(None, None, id="unset"),
        pytest.param("", (), id="A1-empty"),
        pytest.param("-1", (), id="A2-minus-one"),
        pytest.param("GPU-XX", (), id="A3-gpu-xx"),
        pytest.param("3,GPU-BABABABABABABABA,4", (3, 0), id="B"),
        pytest.param("1,GPU-ABBAABBAABBAABBA,GPU-XX", (1,), id="C-repeat-stops"),
        pytest.param("3,GPU-BABAABBA,GPU-XX", (3, 2), id="D-prefix"),
        pytest.param(" 1 , gpu-abbaabba ", (1,), id="trimmed-and-case-folded-then-repeat"),
        pytest.param("0x2,01", (2, 1), id="strtol-hex-and-octal"),
        pytest.param("1,,2", (1, 0, 2), id="empty-entry-reads-as-zero"),
        pytest.param("GPU-BABA", (), id="ambiguous-prefix-stops"),
        pytest.param("0,1,2,3,x", (0, 1, 2, 3), id="only-as-many-entries-as-gpus"),
        pytest.param("2,", (2,), id="trailing-comma"),
        pytest.param("1,a,2", (1,), id="invalid-stops"),
    ],
)
def test_rocr_visible_devices_is_read_as_rocr_reads_it(value, visible):
    assert parse_rocr_visible_devices(value, FOUR)[0] == visible


@pytest.mark.parametrize(
    ("value", "visible"),
    [
        pytest.param(None, None, id="unset"),
        pytest.param("", None, id="empty-hides-nothing"),
        pytest.param("2,0", (2, 0), id="indices"),
        pytest.param("1,1,3", (1, 3), id="repeat-is-skipped"),
        pytest.param("0,01,3", (0,), id="not-plain-decimal-stops"),
        pytest.param("0, 1", (0,), id="space-stops"),
        pytest.param("3,9,0", (3,), id="absent-stops"),
        pytest.param("GPU-abbaabbaabbaabba,0", (1, 0), id="uuid"),
        pytest.param("GPU-ABBAABBAABBAABBA", (), id="uuid-is-case-sensitive"),
        pytest.param("0,,1", (0,), id="empty-entry-stops"),
        pytest.param("2,", (2,), id="trailing-comma"),
    ],
)
def test_hip_visible_devices_is_read_as_hip_reads_it(value, visible):
    assert parse_hip_visible_devices(value, "HIP_VISIBLE_DEVICES", FOUR)[0] == visible


def test_a_stopped_parse_is_quoted_in_a_note():
    _, notes = parse_rocr_visible_devices("1,GPU-BABA,0", FOUR)
    assert any("parsing stops at 'GPU-BABA'" in n and "ambiguous" in n for n in notes), notes
    _, notes = parse_hip_visible_devices("0,7", "HIP_VISIBLE_DEVICES", FOUR)
    assert any("HIP stops at '7'" in n and "numbers the 4 AMD GPU(s)" in n for n in notes), notes


@pytest.mark.parametrize(
    ("version", "name"),
    [(90402, "gfx942"), (90010, "gfx90a"), (90012, "gfx90c"), (110000, "gfx1100"), (100300, "gfx1030"), (0, None)],
)
def test_gfx_target_version_is_named_as_llvm_names_the_target(version, name):
    assert gfx_name(version) == name


def test_hsa_override_gfx_version_reads_major_minor_stepping():
    assert parse_override("10.3.0") == "gfx1030"
    assert parse_override("9.0.10") == "gfx90a"
    assert parse_override("gfx1030") is None and parse_override(None) is None


def test_a_second_gpu_model_is_numbered_in_topology_order(amd_box):
    nodes = [*rx7900xtx(), rx7900xtx_gpu(minor=129, bus=0x83, unique_id=0x77)]
    got = run_json(amd_box(nodes), SURVEY)
    assert [(d["index"], d["node"], d["pci"]) for d in got["devices"]] == [
        (0, 1, "0000:03:00.0"),
        (1, 2, "0000:83:00.0"),
    ]
