"""libtorch variant choice and arch coverage: pure functions over the flake's
variant metadata and the devices the gate offers."""

from __future__ import annotations

import pytest

from prepare.build.variants import Arch, check_coverage, choose, covers, parse_arch, parse_variants
from prepare.fail import Fail
from prepare.gpu.devices import Device, Gpus

FLAKE = "path:/srv/fdl"

# The metadata nix/libtorch.nix ships, as `nix eval --json` prints it.
SHIPPED = {
    "cpu": {"label": "cpu", "cuda": None, "archs": []},
    "cu128": {"label": "cu128", "cuda": "12.8", "archs": ["7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]},
}
WITH_CU126 = {
    **SHIPPED,
    "cu126": {"label": "cu126", "cuda": "12.6", "archs": ["5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0"]},
}


def card(index: int, capability: tuple[int, int] | None, name: str = "NVIDIA Test Card") -> Device:
    return Device(
        index=index, name=name, uuid=f"GPU-{index}", capability=capability, memory_total=None, usable=True, error=None
    )


def box(*caps: tuple[int, int] | None, cuda: tuple[int, int] | None = (12, 8)) -> Gpus:
    devices = tuple(card(i, c) for i, c in enumerate(caps))
    return Gpus(driver_version="570.86.15", cuda_driver_version=cuda, devices=devices, offered=devices)


def variants(raw=SHIPPED):
    return parse_variants(raw, FLAKE)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("8.6", Arch(8, 6)),
        ("9.0+PTX", Arch(9, 0, True)),
        ("10.0", Arch(10, 0)),
        ("sm_86", Arch(8, 6)),
        ("86", Arch(8, 6)),
        ("12.0 + ptx", Arch(12, 0, True)),
    ],
)
def test_arch_strings_parse_the_way_torch_spells_them(text, want):
    assert parse_arch(text) == want


@pytest.mark.parametrize("text", ["", "eight", "8", "8.x", "+PTX"])
def test_a_malformed_arch_is_refused(text):
    with pytest.raises(ValueError):
        parse_arch(text)


@pytest.mark.parametrize(
    ("archs", "capability", "covered"),
    [
        (["8.0"], (8, 6), True),  # SASS runs forward within a major
        (["8.6"], (8, 0), False),  # never backward
        (["8.6"], (9, 0), False),  # never across a major
        (["7.5", "8.0"], (8, 9), True),
        (["9.0+PTX"], (12, 0), True),  # PTX JIT-compiles for anything newer
        (["9.0+PTX"], (8, 6), False),
        (["7.5", "8.0", "8.6", "9.0", "10.0", "12.0"], (6, 1), False),  # Pascal vs cu128
        (["7.5", "8.0", "8.6", "9.0", "10.0", "12.0"], (7, 0), False),  # Volta vs cu128
        (["7.5", "8.0", "8.6", "9.0", "10.0", "12.0"], (12, 1), True),
        ([], (8, 6), False),
    ],
)
def test_coverage_follows_how_cuda_loads_kernels(archs, capability, covered):
    assert covers([parse_arch(a) for a in archs], capability) is covered


def test_an_uncovered_card_is_permanent_and_names_card_capability_archs_and_fixes():
    v = variants()
    gpus = box((8, 6), (6, 1))
    with pytest.raises(Fail) as caught:
        check_coverage(v["cu128"], gpus, v)
    msg = caught.value.message
    assert caught.value.permanent
    assert "GPU 1" in msg and "NVIDIA Test Card" in msg and "6.1" in msg
    assert "7.5, 8.0, 8.6, 9.0, 10.0, 12.0" in msg
    assert "--devices 0" in msg  # the covered card alone is a fix
    assert "--libtorch" in msg
    assert "GPU 0" not in msg


def test_the_fix_names_a_variant_that_does_cover_the_card():
    v = variants(WITH_CU126)
    with pytest.raises(Fail) as caught:
        check_coverage(v["cu128"], box((6, 1)), v)
    assert "libtorch = 'cu126'" in caught.value.message


def test_a_card_with_an_unknown_capability_is_not_refused():
    check_coverage(variants()["cu128"], box(None, (8, 6)), variants())


def test_cpu_only_forces_cpu():
    # A CUDA libtorch with cpu_only is the plan's to refuse (test_config.py).
    v = variants()
    notes: list[str] = []
    assert choose("auto", v, None, True, FLAKE, notes).label == "cpu"
    assert choose(None, v, None, True, FLAKE, notes).label == "cpu"


def test_an_unknown_variant_is_permanent_and_lists_the_flakes_variants():
    with pytest.raises(Fail) as caught:
        choose("rocm6", variants(), box((8, 6)), False, FLAKE, [])
    msg = caught.value.message
    assert caught.value.permanent
    assert "'rocm6'" in msg and FLAKE in msg
    assert "cpu (CUDA none" in msg and "cu128 (CUDA 12.8" in msg


def test_auto_picks_the_newest_cuda_the_driver_runs_that_covers_every_card():
    v = variants(WITH_CU126)
    notes: list[str] = []
    assert choose("auto", v, box((8, 6), (9, 0)), False, FLAKE, notes).label == "cu128"
    assert "picked cu128" in notes[0] and "8.6, 9.0" in notes[0]
    # An older driver cannot run 12.8: the 12.6 build serves the same cards.
    assert choose("auto", v, box((8, 6), cuda=(12, 6)), False, FLAKE, []).label == "cu126"
    # A Pascal card is covered by cu126 only.
    assert choose("auto", v, box((6, 1)), False, FLAKE, []).label == "cu126"


def test_auto_with_no_variant_for_the_cards_is_permanent_and_says_why():
    with pytest.raises(Fail) as caught:
        choose("auto", variants(), box((6, 1)), False, FLAKE, [])
    msg = caught.value.message
    assert caught.value.permanent
    assert "GPU 0" in msg and "6.1" in msg and "--devices" in msg and "--libtorch" in msg
    with pytest.raises(Fail) as caught:
        choose("auto", variants(), box((8, 6), cuda=(11, 8)), False, FLAKE, [])
    assert "11.8" in caught.value.message and "driver" in caught.value.message


def test_auto_on_a_box_without_gpus_picks_cpu():
    assert choose("auto", variants(), None, False, FLAKE, []).label == "cpu"


def test_an_explicit_variant_newer_than_the_driver_is_noted_not_refused():
    notes: list[str] = []
    assert choose("cu128", variants(), box((8, 6), cuda=(12, 2)), False, FLAKE, notes).label == "cu128"
    assert any("driver supports CUDA 12.2" in n for n in notes)


def test_the_cpu_variant_on_a_gpu_box_is_allowed_with_a_note():
    notes: list[str] = []
    assert choose("cpu", variants(), box((8, 6)), False, FLAKE, notes).label == "cpu"
    assert any("sit idle" in n for n in notes)


@pytest.mark.parametrize(
    "raw",
    [
        {},
        None,
        {"cu128": {"label": "cu128", "cuda": "12.8", "archs": ["eighty-six"]}},
        {"cu128": "not a set"},
    ],
)
def test_malformed_variant_metadata_is_permanent(raw):
    with pytest.raises(Fail) as caught:
        parse_variants(raw, FLAKE)
    assert caught.value.permanent
    assert FLAKE in caught.value.message


def test_a_variants_cuda_version_is_major_and_minor_and_null_for_cpu():
    from prepare.build import variants
    from prepare.nix import runner

    assert variants.parse_cuda_version("12.8") == (12, 8)
    assert variants.parse_cuda_version("13") == (13, 0)
    assert variants.parse_cuda_version(None) is None
    with pytest.raises(ValueError):
        variants.parse_cuda_version("twelve")
    # Two parsers, two names: Nix's version is a 3-tuple read from `nix --version`.
    assert runner.parse_nix_version("nix (Nix) 2.8.0") == (2, 8, 0)
    assert not hasattr(variants, "parse_version") and not hasattr(runner, "parse_version")


# -- ROCm variants and AMD cards ----------------------------------------------------

ROCM_VARIANTS = {
    **SHIPPED,
    # The test flake's stand-ins: PyTorch's libtorch target lists before and
    # after gfx950, gfx1150 and gfx1151 were added.
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
        "gfx": ["gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1150", "gfx1151"],
    },
}


def amd_card(index: int, target: str | None, name: str | None = "AMD Test Card", gfx: str | None = None):
    from prepare.gpu.amd import AmdDevice

    return AmdDevice(index, index + 2, name, gfx or target, target, None, None, None, 128 + index, None, True, None)


def amd_box(*targets: str | None, nvidia: Gpus | None = None) -> Gpus:
    from dataclasses import replace

    from prepare.gpu.amd import AmdGpus

    cards = tuple(amd_card(i, t) for i, t in enumerate(targets))
    base = nvidia or Gpus(driver_version=None, cuda_driver_version=None, devices=(), offered=())
    return replace(base, amd=AmdGpus(devices=cards, offered=cards))


def test_a_rocm_variant_parses_with_its_vendor_version_and_targets():
    v = variants(ROCM_VARIANTS)
    rocm = v["rocm7.0"]
    assert (rocm.vendor, rocm.rocm, rocm.cuda, rocm.archs) == ("amd", (7, 0), None, ())
    assert "gfx1151" in rocm.gfx and rocm.runtime == "ROCm 7.0"
    # A flake from before vendors existed: a CUDA version means NVIDIA.
    assert (v["cu128"].vendor, v["cpu"].vendor) == ("nvidia", None)


@pytest.mark.parametrize(
    "meta",
    [
        {"label": "x", "cuda": None, "archs": [], "vendor": "intel"},
        {"label": "x", "cuda": None, "archs": [], "vendor": "amd", "rocm": "7.0", "gfx": []},
        {"label": "x", "cuda": None, "archs": [], "vendor": "amd", "rocm": "7.0", "gfx": ["sm_86"]},
        {"label": "x", "cuda": None, "archs": [], "vendor": "nvidia"},
    ],
)
def test_malformed_rocm_metadata_is_permanent(meta):
    with pytest.raises(Fail) as caught:
        parse_variants({"x": meta}, FLAKE)
    assert caught.value.permanent and "'x'" in caught.value.message


def test_auto_on_an_amd_box_picks_the_newest_rocm_that_covers_every_card():
    v = variants(ROCM_VARIANTS)
    notes: list[str] = []
    assert choose("auto", v, amd_box("gfx942", "gfx942"), False, FLAKE, notes).label == "rocm7.0"
    assert "picked rocm7.0" in notes[0] and "gfx942" in notes[0]
    # gfx906 (MI50) is in the 6.4 list only.
    assert choose("auto", v, amd_box("gfx906"), False, FLAKE, []).label == "rocm6.4"
    # A card whose target the driver did not report does not stand in the way.
    assert choose("auto", v, amd_box(None, "gfx1151"), False, FLAKE, []).label == "rocm7.0"


def test_auto_with_no_rocm_variant_for_the_cards_is_permanent_and_says_why():
    with pytest.raises(Fail) as caught:
        choose("auto", variants(ROCM_VARIANTS), amd_box("gfx906", "gfx1151"), False, FLAKE, [])
    msg = caught.value.message
    assert "no ROCm variant has kernels for every offered card" in msg
    assert "AMD GPU 0 (AMD Test Card, gfx906)" in msg and "gfx1151" in msg
    assert "rocm7.0 (ROCm 7.0; gfx gfx90a" in msg and "ROCR_VISIBLE_DEVICES" in msg
    # The production flake has no ROCm variant at all.
    with pytest.raises(Fail) as caught:
        choose("auto", variants(), amd_box("gfx942"), False, FLAKE, [])
    assert 'the flake has no ROCm variant (vendor = "amd")' in caught.value.message
    assert "Adding a variant" in caught.value.message


def test_a_rocm_variant_missing_a_cards_target_is_refused_naming_it_and_the_fixes():
    v = variants(ROCM_VARIANTS)
    with pytest.raises(Fail) as caught:
        check_coverage(v["rocm6.4"], amd_box("gfx942", "gfx1151"), v)
    msg = caught.value.message
    assert caught.value.permanent
    assert "AMD GPU 1 (AMD Test Card, gfx1151)" in msg and "AMD GPU 0" not in msg.split("Fix:")[0]
    assert "own target" in msg and "Nothing was downloaded" in msg
    assert "devices = [0] (--devices 0) or ROCR_VISIBLE_DEVICES=0" in msg
    assert "libtorch = 'rocm7.0' (--libtorch rocm7.0)" in msg


def test_coverage_is_checked_against_hsa_override_gfx_version():
    from dataclasses import replace

    v = variants(ROCM_VARIANTS)
    overridden = amd_box("gfx1030")
    card = replace(overridden.amd.devices[0], gfx="gfx1031")
    gpus = replace(overridden, amd=replace(overridden.amd, devices=(card,), offered=(card,)))
    check_coverage(v["rocm6.4"], gpus, v)  # gfx1031 runs the gfx1030 kernels under the override
    with pytest.raises(Fail) as caught:
        check_coverage(v["rocm7.0"], gpus, v)
    assert "gfx1031, run as gfx1030 by HSA_OVERRIDE_GFX_VERSION" in caught.value.message


def test_a_variant_of_one_vendor_on_a_box_of_the_other_is_permanent():
    v = variants(ROCM_VARIANTS)
    with pytest.raises(Fail) as caught:
        choose("rocm7.0", v, box((8, 6)), False, FLAKE, [])
    assert "libtorch rocm7.0 is a ROCm 7.0 build, but this box offers NVIDIA GPUs only" in caught.value.message
    assert "CUDA variants (cu128)" in caught.value.message
    with pytest.raises(Fail) as caught:
        choose("cu128", v, amd_box("gfx942"), False, FLAKE, [])
    assert "libtorch cu128 is a CUDA 12.8 build, but this box offers AMD GPUs only" in caught.value.message
    assert "(rocm6.4, rocm7.0)" in caught.value.message


def test_the_other_vendors_cards_never_block_a_variant_and_are_noted_idle():
    v = variants(ROCM_VARIANTS)
    # A Pascal card cu128 cannot serve does not matter to a ROCm build.
    mixed = amd_box("gfx942", nvidia=box((6, 1)))
    notes: list[str] = []
    assert choose("rocm7.0", v, mixed, False, FLAKE, notes).label == "rocm7.0"
    assert any("the 1 offered NVIDIA GPU(s) sit idle" in n for n in notes), notes
    # Nor does an AMD card no ROCm variant serves matter to a CUDA build.
    notes = []
    assert choose("cu128", v, amd_box("gfx803", nvidia=box((8, 6))), False, FLAKE, notes).label == "cu128"
    assert any("the 1 offered AMD GPU(s) sit idle" in n for n in notes), notes


def test_auto_on_a_box_of_both_vendors_picks_the_one_with_more_cards_nvidia_on_a_tie():
    v = variants(ROCM_VARIANTS)
    notes: list[str] = []
    assert choose("auto", v, amd_box("gfx942", nvidia=box((8, 6))), False, FLAKE, notes).label == "cu128"
    assert "1 NVIDIA and 1 AMD" in notes[0] and "NVIDIA wins a tie" in notes[0]
    notes = []
    assert choose("auto", v, amd_box("gfx942", "gfx942", nvidia=box((8, 6))), False, FLAKE, notes).label == "rocm7.0"
    assert "the AMD ones, more of them" in notes[0]


def test_auto_falls_back_to_the_other_vendor_when_no_variant_serves_the_first():
    v = variants(ROCM_VARIANTS)
    notes: list[str] = []
    # Two Pascal cards outnumber the MI300X, but no variant here serves Pascal.
    assert choose("auto", v, amd_box("gfx942", nvidia=box((6, 1), (6, 1))), False, FLAKE, notes).label == "rocm7.0"
    assert "no variant serves the NVIDIA ones" in notes[0]
    with pytest.raises(Fail) as caught:
        choose("auto", v, amd_box("gfx803", nvidia=box((6, 1))), False, FLAKE, [])
    assert "found no variant for either vendor" in caught.value.message
    assert "NVIDIA: " in caught.value.message and "AMD: " in caught.value.message


def test_the_cpu_variant_on_an_amd_box_is_allowed_with_a_note():
    notes: list[str] = []
    assert choose("cpu", variants(ROCM_VARIANTS), amd_box("gfx942"), False, FLAKE, notes).label == "cpu"
    assert any("CPU build" in n and "sit idle" in n for n in notes), notes


def test_a_dotted_label_is_quoted_as_one_attribute_of_an_installable():
    from prepare.build.variants import nix_attr

    assert nix_attr("cu128") == "cu128"
    assert nix_attr("rocm7.0") == '"rocm7.0"'
    assert nix_attr("12x") == '"12x"'
