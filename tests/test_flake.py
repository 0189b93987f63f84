"""The flake contract itself (nix/CONTRACT.md), exercised with real Nix.

The test flake (tests/flake) and the production flake share nix/contract.nix
and nix/libtorch.nix; these tests evaluate and build through the test flake,
and evaluate the production flake's wiring against a nixpkgs stand-in
(tests/flake/nixpkgs-standin.nix with nixpkgs' real lib/ from NIXPKGS_LIB),
since Nix 2.8 cannot evaluate current nixpkgs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import module_fixtures
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "trainer"
SYSTEM = {"x86_64": "x86_64-linux", "aarch64": "aarch64-linux"}.get(os.uname().machine, "x86_64-linux")
FDL = f"legacyPackages.{SYSTEM}.fdl"
CU128_ARCHS = ["7.0", "7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]
ROCM64_GFX = ["gfx900", "gfx906", "gfx908", "gfx90a", "gfx942", "gfx1030", "gfx1100", "gfx1101", "gfx1102", "gfx1200"]
ROCM64_GFX.append("gfx1201")
ROCM70_GFX = [*ROCM64_GFX, "gfx950", "gfx1150", "gfx1151"]
# --no-eval-cache as the runner passes it: Nix 2.8 answers a repeated failing
# evaluation from its cache with "'…' is not an attribute set", hiding the
# message (nix/CONTRACT.md).
FLAGS = ["--extra-experimental-features", "nix-command flakes", "--no-eval-cache"]


@pytest.fixture
def env(nix_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """nix_env plus a local, empty flake registry (Nix 2.8 would otherwise
    download the global one)."""
    registry = tmp_path / "registry.json"
    registry.write_text('{"flakes":[],"version":2}')
    config = nix_env.get("NIX_CONFIG", "") + f"\nflake-registry = {registry}\n"
    return {**nix_env, "NIX_CONFIG": config}


def nix(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nix", *FLAGS, *args], env=env, capture_output=True, text=True, timeout=timeout)


def nix_json(env: dict[str, str], *args: str) -> object:
    done = nix(env, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def prefetch(env: dict[str, str], tree: Path) -> str:
    """The locked flake URL of a tree, the way the runner pins a source."""
    found = nix_json(env, "flake", "prefetch", f"path:{tree}")
    return f"path:{found['storePath']}?narHash={found['hash']}"


def write_recipe(directory: Path, **recipe: object) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "recipe.json").write_text(json.dumps({"contract": 2, **recipe}))
    return f"path:{directory}"


def overrides(source: str, recipe: str) -> list[str]:
    return ["--no-write-lock-file", "--override-input", "source", source, "--override-input", "recipe", recipe]


def example_recipe() -> dict[str, object]:
    from prepare.build import manifest as manifest_mod

    manifest = manifest_mod.read(str(EXAMPLE))
    assert manifest is not None
    return {"libtorch": "cpu", "cwd": manifest.cwd or ".", "build": manifest.build, "bin": manifest.bin}


def build_events(stderr: str) -> list[dict]:
    events = []
    for line in stderr.splitlines():
        if line.startswith("@nix "):
            events.append(json.loads(line[len("@nix ") :]))
    return events


def sri_sha256(data: bytes) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(data).digest()).decode()


# --- metadata ---------------------------------------------------------------


def test_the_variants_metadata_has_the_contract_shape(env, test_flake):
    got = nix_json(
        env, "eval", "--no-write-lock-file", f"{test_flake}#{FDL}", "--apply", "f: { inherit (f) contract variants; }"
    )

    assert got["contract"] == 2
    assert got["variants"] == {
        "cpu": {"label": "cpu", "cuda": None, "archs": []},
        "cu128": {"label": "cu128", "cuda": "12.8", "archs": CU128_ARCHS},
        # The test flake's ROCm stand-ins (tests/flake/flake.nix).
        "rocm6.4": {"label": "rocm6.4", "cuda": None, "archs": [], "vendor": "amd", "rocm": "6.4", "gfx": ROCM64_GFX},
        "rocm7.0": {"label": "rocm7.0", "cuda": None, "archs": [], "vendor": "amd", "rocm": "7.0", "gfx": ROCM70_GFX},
    }


def test_reading_the_variants_instantiates_no_derivation(env, make_flake):
    flake = make_flake(
        extra_nix='toolchain: { lazy = { cuda = null; archs = [ "8.6" ]; '
        'package = throw "the lazy variant was instantiated"; }; }'
    )

    got = nix_json(env, "eval", "--no-write-lock-file", f"{flake}#{FDL}.variants")
    building = nix(env, "build", "--no-link", "--no-write-lock-file", f"{flake}#{FDL}.libtorch.lazy")

    assert got["lazy"] == {"label": "lazy", "cuda": None, "archs": ["8.6"]}
    assert building.returncode != 0
    assert "the lazy variant was instantiated" in building.stderr


def test_a_variant_that_declares_its_vendor_says_so_and_one_that_does_not_reads_as_before(env, make_flake):
    flake = make_flake(
        extra_nix='toolchain: { cu126 = { vendor = "nvidia"; cuda = "12.6"; archs = [ "6.0" ]; '
        'package = toolchain.mkLibtorch { label = "cu126"; }; }; }'
    )

    got = nix_json(env, "eval", "--no-write-lock-file", f"{flake}#{FDL}.variants")

    assert got["cu126"] == {
        "label": "cu126",
        "cuda": "12.6",
        "archs": ["6.0"],
        "vendor": "nvidia",
        "gfx": [],
        "rocm": None,
    }
    assert got["cu128"] == {"label": "cu128", "cuda": "12.8", "archs": CU128_ARCHS}


@pytest.mark.parametrize(
    ("variant", "says"),
    [
        pytest.param('vendor = "intel"; cuda = null; archs = [ ];', "`vendor` must be", id="unknown-vendor"),
        pytest.param('vendor = "amd"; rocm = "7.0"; cuda = null; archs = [ ];', "needs `gfx`", id="amd-without-gfx"),
        pytest.param(
            'vendor = "amd"; rocm = "7.0"; cuda = null; archs = [ ]; gfx = [ "gfx11-generic" ];',
            "no generic targets",
            id="generic-target",
        ),
        pytest.param('vendor = "amd"; cuda = null; archs = [ ]; gfx = [ "gfx942" ];', "needs `rocm`", id="no-rocm"),
        pytest.param(
            'vendor = "amd"; rocm = "7.0"; cuda = "12.8"; archs = [ ]; gfx = [ "gfx942" ];',
            "`cuda = null`",
            id="amd-with-cuda",
        ),
        pytest.param('cuda = null; archs = [ ]; gfx = [ "gfx942" ];', "`gfx` is for ROCm builds", id="gfx-without-amd"),
        pytest.param('vendor = "nvidia"; cuda = null; archs = [ ];', "needs `cuda`", id="nvidia-without-cuda"),
    ],
)
def test_a_variant_with_malformed_vendor_metadata_is_refused_naming_it(env, make_flake, variant, says):
    flake = make_flake(
        extra_nix=f'toolchain: {{ bad = {{ {variant} package = toolchain.mkLibtorch {{ label = "bad"; }}; }}; }}'
    )

    done = nix(env, "eval", "--json", "--no-write-lock-file", f"{flake}#{FDL}.variants")

    assert done.returncode != 0
    assert 'variant "bad"' in done.stderr and says in done.stderr, done.stderr


def test_a_rocm_stand_in_builds_under_its_dotted_label(env, test_flake):
    done = nix(env, "build", "--json", "--no-link", "--no-write-lock-file", f'{test_flake}#{FDL}.libtorch."rocm7.0"')

    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)[0]["outputs"]["out"]
    assert (Path(out) / "share" / "fdl-libtorch-variant").read_text().strip() == "rocm7.0"


def test_a_variant_with_malformed_archs_is_refused_naming_it(env, make_flake):
    flake = make_flake(
        extra_nix='toolchain: { sm86 = { cuda = "12.8"; archs = [ 86 ]; '
        'package = toolchain.mkLibtorch { label = "sm86"; }; }; }'
    )

    done = nix(env, "eval", "--json", "--no-write-lock-file", f"{flake}#{FDL}.variants")

    assert done.returncode != 0
    assert 'variant "sm86"' in done.stderr and "archs" in done.stderr


# --- recipe -----------------------------------------------------------------


def test_a_recipe_without_bin_is_refused_at_evaluation_naming_bin(env, test_flake, tmp_path):
    recipe = write_recipe(tmp_path / "recipe", libtorch="cpu", cwd=".", build=None)

    done = nix(env, "build", "--no-link", f"{test_flake}#{FDL}.training", *overrides(prefetch(env, EXAMPLE), recipe))

    assert done.returncode != 0
    assert "fdl-prepare flake: recipe.json has no `bin`" in done.stderr
    assert ".fdl-run.yml" in done.stderr and "[join.source]" in done.stderr
    assert "building '" not in done.stderr


def test_an_unknown_variant_is_refused_listing_the_flakes_variants(env, test_flake, tmp_path):
    recipe = write_recipe(tmp_path / "recipe", libtorch="cu999", bin="train")

    done = nix(env, "eval", "--json", f"{test_flake}#{FDL}.recipe", *overrides(prefetch(env, EXAMPLE), recipe))

    assert done.returncode != 0
    assert 'unknown libtorch variant "cu999"' in done.stderr
    assert "cpu, cu128" in done.stderr


def test_the_flake_reports_the_recipe_with_its_defaults_filled_in(env, test_flake, tmp_path):
    recipe = write_recipe(tmp_path / "recipe", libtorch="cu128", bin="train")

    got = nix_json(env, "eval", f"{test_flake}#{FDL}.recipe", *overrides(prefetch(env, EXAMPLE), recipe))

    assert got == {"contract": 2, "libtorch": "cu128", "cwd": ".", "build": None, "bin": "train"}


# --- builds -----------------------------------------------------------------


def _training_drv(env: dict[str, str], flake: str, tree: Path, recipe: str) -> str:
    done = nix_json(env, "eval", f"{flake}#{FDL}.training.drvPath", *overrides(prefetch(env, tree), recipe))
    assert isinstance(done, str)
    return done


def test_the_run_files_are_not_inputs_of_the_training_build(env, test_flake, tmp_path):
    # A publish builds, pushes, and writes floDl's .fdl-run.sha256 and
    # .fdl-run.yml last: the boxes must evaluate the very derivation that was
    # pushed, run files or not.
    tree = tmp_path / "source"
    tree.mkdir()
    (tree / "README").write_text("a training source\n")
    recipe = write_recipe(tmp_path / "recipe", libtorch="cpu", bin="train", build="true")

    bare = _training_drv(env, test_flake, tree, recipe)
    (tree / ".fdl-run.sha256").write_text("0" * 64 + "  README\n")
    (tree / ".fdl-run.yml").write_text("bin: train\nrun: one\nbuilt: true\n")
    added = _training_drv(env, test_flake, tree, recipe)
    (tree / ".fdl-run.sha256").write_text("1" * 64 + "  README\n")
    (tree / ".fdl-run.yml").write_text("bin: train\nrun: two\nbuilt: true\npublished_epoch: 2\n")
    changed = _training_drv(env, test_flake, tree, recipe)
    (tree / "README").write_text("a training source, edited\n")
    edited = _training_drv(env, test_flake, tree, recipe)
    (tree / "sub").mkdir()
    (tree / "sub" / ".fdl-run.yml").write_text("the source's own file of that name\n")
    nested = _training_drv(env, test_flake, tree, recipe)

    assert bare == added == changed
    # Only the root's run files are left out: the rest of the tree still counts.
    assert len({changed, edited, nested}) == 3


def test_a_build_line_that_exits_3_fails_the_build_with_exit_code_3(env, test_flake, tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "build.sh").write_text("echo failing on purpose >&2\nexit 3\n")
    recipe = write_recipe(tmp_path / "recipe", libtorch="cpu", build="/bin/sh build.sh", bin="train")

    done = nix(env, "build", "--no-link", f"{test_flake}#{FDL}.training", *overrides(prefetch(env, source), recipe))

    assert done.returncode != 0
    assert "failed with exit code 3" in done.stderr
    assert "the build line exited 3" in done.stderr


def test_the_toolchains_fixed_output_helper_checks_its_hash(env, make_flake):
    right, wrong = sri_sha256(b"hello"), sri_sha256(b"not hello")
    flake = make_flake(
        extra_nix=(
            "toolchain: {\n"
            f'  good = {{ cuda = null; archs = [ ]; package = toolchain.fixedOutput {{ name = "good"; text = "hello"; hash = "{right}"; }}; }};\n'
            f'  bad = {{ cuda = null; archs = [ ]; package = toolchain.fixedOutput {{ name = "bad"; text = "hello"; hash = "{wrong}"; }}; }};\n'
            "}\n"
        )
    )

    good = nix(env, "build", "--no-link", "--no-write-lock-file", f"{flake}#{FDL}.libtorch.good")
    bad = nix(env, "build", "--no-link", "--no-write-lock-file", f"{flake}#{FDL}.libtorch.bad")

    assert good.returncode == 0, good.stderr
    assert bad.returncode != 0
    assert "hash mismatch in fixed-output derivation" in bad.stderr
    assert right in bad.stderr


# --- references and layouts -------------------------------------------------


def test_the_test_flake_evaluates_from_the_repository_through_git(env):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "tests/flake/flake.nix", "nix/contract.nix"],
        capture_output=True,
        text=True,
    ).stdout.split()
    if len(tracked) < 2:
        pytest.skip("tests/flake and nix/ are not tracked yet: git+file sees tracked files only")

    got = nix_json(env, "eval", "--no-write-lock-file", f"git+file://{REPO}?dir=tests/flake#{FDL}.variants")

    assert got["cu128"]["archs"] == CU128_ARCHS


def test_a_layout_preserving_copy_referenced_as_path_says_how_to_reference_it(env, tmp_path):
    shutil.copytree(REPO / "tests" / "flake", tmp_path / "tests" / "flake")
    shutil.copytree(REPO / "nix", tmp_path / "nix")

    done = nix(env, "eval", "--json", "--no-write-lock-file", f"path:{tmp_path}/tests/flake#{FDL}.contract")

    assert done.returncode != 0
    assert "git+file://<repo>?dir=tests/flake" in done.stderr


def test_the_example_manifest_is_flodls_with_every_field_typed():
    import yaml

    from prepare.build import manifest as manifest_mod

    raw = yaml.safe_load((EXAMPLE / manifest_mod.FILENAME).read_text())
    # `build` as floDl's publish writes it for a crate with a `cuda` feature,
    # no `cwd` (the root), no `smoke` (floDl's manifest has none: the box's).
    assert set(raw) == {"build", "bin", "args", "run", "built", "published_epoch", "origin", "digest"}
    manifest = manifest_mod.read(str(EXAMPLE))
    assert manifest is not None and manifest.unknown_count == 0
    assert manifest.bin == "target/release/train" and manifest.cwd is None
    assert manifest.build == 'cargo build --release --features "$FDL_GPU_FEATURE" --bin train'
    assert (EXAMPLE / "Cargo.lock").is_file()
    assert manifest.args == ("--epochs", "2") and manifest.run == "example-0001"
    assert manifest.built is False and manifest.published_epoch == 1767225600 and manifest.origin
    assert manifest.digest is not None and (EXAMPLE / manifest_mod.DIGEST_FILE).is_file()


# --- the production flake's wiring ------------------------------------------


@pytest.fixture
def production(tmp_path: Path) -> str:
    """A copy of what the production flake reads from this repository."""
    if SYSTEM != "x86_64-linux":
        pytest.skip(f"the production flake is wired for x86_64-linux only, this is {SYSTEM}")
    dest = tmp_path / "production"
    dest.mkdir()
    shutil.copy(REPO / "flake.nix", dest / "flake.nix")
    shutil.copytree(REPO / "nix", dest / "nix")
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")
    return f"path:{dest}"


def standin(tmp_path: Path, default_nix: str, lib: Path | None = None) -> str:
    dest = tmp_path / "nixpkgs"
    dest.mkdir()
    (dest / "flake.nix").write_text("{ outputs = _: { }; }\n")
    (dest / "default.nix").write_text(default_nix)
    if lib is not None:
        shutil.copytree(lib, dest / "lib")
    return f"path:{dest}"


@pytest.fixture(name="nixpkgs_lib")
def nixpkgs_lib_fixture() -> Path:
    return module_fixtures.nixpkgs_lib()


@pytest.fixture
def nixpkgs(tmp_path: Path, nixpkgs_lib: Path) -> str:
    return standin(tmp_path, (REPO / "tests" / "flake" / "nixpkgs-standin.nix").read_text(), nixpkgs_lib)


def test_the_production_flake_reads_its_variants_without_importing_nixpkgs(env, production, test_flake, tmp_path):
    throwing = standin(tmp_path, 'throw "nixpkgs was imported"\n')
    apply = "f: { inherit (f) contract variants; }"

    got = nix_json(
        env,
        "eval",
        "--no-write-lock-file",
        f"{production}#{FDL}",
        "--apply",
        apply,
        "--override-input",
        "nixpkgs",
        throwing,
    )
    shared = nix_json(env, "eval", "--no-write-lock-file", f"{test_flake}#{FDL}", "--apply", apply)
    # The test flake adds ROCm stand-ins of its own (the production flake has
    # no ROCm variant); everything from nix/ is the same.
    for label in ("rocm6.4", "rocm7.0"):
        del shared["variants"][label]

    assert got == shared


# nixpkgs as nixos-25.11 at the pinned revision, recorded the way `nix flake
# lock` records it (these values, as flake.lock files that pin the same
# revision record them); used only where the repository has no flake.lock yet.
NIXPKGS_LOCK = {
    "lastModified": 1778430510,
    "narHash": "sha256-Ti+ZBvW6yrWWAg2szExVTwCd4qOJ3KlVr1tFHfyfi8Q=",
    "owner": "NixOS",
    "repo": "nixpkgs",
    "type": "github",
}


def test_a_locked_production_flake_reads_variants_and_recipe_without_fetching_nixpkgs(env, production, tmp_path):
    dest = Path(production.removeprefix("path:"))
    if (REPO / "flake.lock").exists():
        shutil.copy(REPO / "flake.lock", dest / "flake.lock")
    else:
        rev = re.search(r'nixpkgs\.url = "github:NixOS/nixpkgs/([0-9a-f]{40})"', (REPO / "flake.nix").read_text())
        assert rev, "flake.nix must pin nixpkgs by a full revision"
        node = {**NIXPKGS_LOCK, "rev": rev.group(1)}
        original = {key: node[key] for key in ("owner", "repo", "type", "rev")}
        (dest / "flake.lock").write_text(
            json.dumps(
                {
                    "nodes": {
                        "nixpkgs": {"locked": node, "original": original},
                        "root": {"inputs": {"nixpkgs": "nixpkgs", "recipe": [], "source": []}},
                    },
                    "root": "root",
                    "version": 7,
                }
            )
        )
    recipe = write_recipe(tmp_path / "recipe", libtorch="cu128", bin="train")
    quiet = ["--log-format", "internal-json", "--option", "download-attempts", "1"]

    variants = nix(env, "eval", "--json", "--no-write-lock-file", f"{production}#{FDL}.variants", *quiet)
    checked = nix(
        env, "eval", "--json", f"{production}#{FDL}.recipe", *quiet, *overrides(prefetch(env, EXAMPLE), recipe)
    )

    for done in (variants, checked):
        assert done.returncode == 0, done.stderr
        transfers = [e for e in build_events(done.stderr) if e.get("action") == "start" and e.get("type") == 101]
        assert transfers == [] and "download" not in done.stderr
    assert json.loads(variants.stdout)["cu128"]["archs"] == CU128_ARCHS
    assert json.loads(checked.stdout)["libtorch"] == "cu128"


def test_the_documented_downstream_flake_adds_a_variant_without_editing_this_repository(env, production, tmp_path):
    contract = (REPO / "nix" / "CONTRACT.md").read_text()
    section = contract[contract.index("## Adding a variant") :]
    example = section[section.index("```nix\n") + len("```nix\n") : section.index("\n```\n")]
    downstream = tmp_path / "downstream"
    downstream.mkdir()
    (downstream / "flake.nix").write_text(example.replace('"github:<owner>/fdl-prepare"', f'"{production}"'))
    throwing = standin(tmp_path, 'throw "nixpkgs was imported"\n')
    recipe = write_recipe(tmp_path / "recipe", libtorch="cu124", bin="train")
    common = ["--override-input", "fdl-prepare/nixpkgs", throwing, *overrides(prefetch(env, EXAMPLE), recipe)]

    variants = nix_json(env, "eval", f"path:{downstream}#{FDL}.variants", *common)
    checked = nix_json(env, "eval", f"path:{downstream}#{FDL}.recipe", *common)

    assert set(variants) == {"cpu", "cu128", "cu124"}
    assert variants["cu124"]["cuda"] == "12.4" and "7.0" in variants["cu124"]["archs"]
    assert checked["libtorch"] == "cu124"


def test_the_production_libtorch_is_2_10_0_from_pytorchs_wheels_with_nixpkgs_tools(env, production, nixpkgs):
    apply = (
        "d: { inherit (d) name version label cudaVersion archs builder python patchelf outputs;"
        " wheels = map (w: { inherit (w) url outputHash; }) d.wheels; }"
    )
    common = ["--no-write-lock-file", "--override-input", "nixpkgs", nixpkgs]

    cpu = nix_json(env, "eval", f"{production}#{FDL}.libtorch.cpu", "--apply", apply, *common)
    cu128 = nix_json(env, "eval", f"{production}#{FDL}.libtorch.cu128", "--apply", apply, *common)

    tool = "/nix/store/00000000000000000000000000000000-"
    assert (cpu["name"], cpu["version"], cpu["cudaVersion"], cpu["archs"]) == (
        "libtorch-2.10.0-cpu",
        "2.10.0",
        "none",
        "",
    )
    assert [w["url"] for w in cpu["wheels"]] == [
        "https://download.pytorch.org/whl/cpu/torch-2.10.0%2Bcpu-cp313-cp313-manylinux_2_28_x86_64.whl"
    ]
    assert cpu["outputs"] == ["out", "dev"] and cpu["patchelf"] == ""
    assert (cu128["name"], cu128["cudaVersion"], cu128["archs"]) == (
        "libtorch-2.10.0-cu128",
        "12.8",
        " ".join(CU128_ARCHS),
    )
    assert cu128["outputs"] == ["out", "dev", "cuda"]
    # PyPI's torch 2.10.0 first, then its nvidia-*-cu12 wheels and the two
    # header wheels floDl's shim needs, each by URL and sha256.
    names = [w["url"].rsplit("/", 1)[1] for w in cu128["wheels"]]
    assert names[0] == "torch-2.10.0-3-cp311-cp311-manylinux_2_28_x86_64.whl"
    for wheel in ("cuda_runtime", "nccl", "cublas", "cusparse", "cusolver", "cuda_nvcc", "cuda_cccl"):
        assert any(n.startswith(f"nvidia_{wheel}_cu12-") for n in names), wheel
    assert all(len(w["outputHash"]) == 64 for w in cu128["wheels"])
    # nixpkgs' bash, python3 and patchelf; no libtorch-bin, no cudaPackages.
    assert cu128["builder"] == f"{tool}bash/bin/bash" and cu128["python"] == f"{tool}python3/bin/python3"
    assert cu128["patchelf"] == f"{tool}patchelf/bin/patchelf"


def test_on_aarch64_the_production_flake_has_the_cpu_wheel_and_refuses_cu128_naming_the_missing_pin(
    env, production, nixpkgs
):
    common = ["--no-write-lock-file", "--override-input", "nixpkgs", nixpkgs]
    arm = f"{production}#legacyPackages.aarch64-linux.fdl"

    cpu = nix_json(env, "eval", f"{arm}.libtorch.cpu", "--apply", "d: map (w: w.url) d.wheels", *common)
    cu128 = nix(env, "eval", "--raw", f"{arm}.libtorch.cu128.drvPath", *common)

    assert [url.rsplit("/", 1)[1] for url in cpu] == ["torch-2.10.0-cp311-cp311-manylinux_2_28_aarch64.whl"]
    assert cu128.returncode != 0
    assert "fdl-prepare flake: libtorch cu128 has no wheel pinned for aarch64-linux" in cu128.stderr


def workspace(root: Path, *, features: str = "", lock: bool = True, extra: str = "") -> Path:
    """A floDl-shaped source: a workspace whose member crates/train depends
    on a sibling by path and inherits its version from the root."""
    (root / "crates" / "train").mkdir(parents=True)
    (root / "crates" / "util").mkdir(parents=True)
    (root / "Cargo.toml").write_text(
        '[workspace]\nmembers = ["crates/train", "crates/util"]\n[workspace.package]\nversion = "0.3.1"\n'
    )
    (root / "crates" / "train" / "Cargo.toml").write_text(
        '[package]\nname = "trainer"\nversion.workspace = true\n'
        f'{extra}[dependencies]\nutil = {{ path = "../util" }}\n[features]\n{features}'
    )
    (root / "crates" / "util" / "Cargo.toml").write_text('[package]\nname = "util"\nversion = "0.1.0"\n')
    if lock:
        (root / "Cargo.lock").write_text("version = 3\n")
    return root


PRODUCTION_TRAINING = (
    "t: { inherit (t) pname version src env doCheck builtWith preBuild buildPhase installPhase;"
    " lock = t.cargoLock.lockFile; features = t.buildFeatures or null;"
    " subdir = t.buildAndTestSubdir or null; cargoRoot = t.cargoRoot or null;"
    " buildInputs = map toString (t.buildInputs or [ ]); nativeBuildInputs = map toString (t.nativeBuildInputs or [ ]);"
    " root = if t.passthru.root == null then null else { script = t.passthru.root.script; path = t.passthru.root.outPath; };"
    " deps = { inherit (t.passthru.deps) pname src postPatch buildPhase installPhase preBuild env;"
    " lock = t.passthru.deps.cargoLock.lockFile; }; fdlDeps = t.fdlDeps.pname; }"
)


def production_training(env, production, nixpkgs, tmp_path, tree: Path, **recipe: object) -> dict:
    recipe_ref = write_recipe(tmp_path / "recipe", **{"bin": "train", "build": None, **recipe})
    common = ["--override-input", "nixpkgs", nixpkgs, *overrides(prefetch(env, tree), recipe_ref)]
    got = nix_json(env, "eval", f"{production}#{FDL}.training", "--apply", PRODUCTION_TRAINING, *common)
    assert isinstance(got, dict)
    return got


def production_refusal(env, production, nixpkgs, tmp_path, tree: Path, **recipe: object) -> str:
    recipe_ref = write_recipe(tmp_path / "recipe", **{"bin": "train", "build": None, **recipe})
    common = ["--override-input", "nixpkgs", nixpkgs, *overrides(prefetch(env, tree), recipe_ref)]
    done = nix(env, "eval", "--json", f"{production}#{FDL}.training.drvPath", *common)
    assert done.returncode != 0, done.stdout
    return done.stderr


def test_the_production_training_build_sets_libtorch_path_and_builds_the_member_from_the_whole_tree(
    env, production, nixpkgs, tmp_path
):
    tree = workspace(tmp_path / "source")

    training = production_training(env, production, nixpkgs, tmp_path, tree, libtorch="cpu", cwd="crates/train")
    libtorch = nix_json(
        env,
        "eval",
        f"{production}#{FDL}.libtorch.cpu",
        "--apply",
        "d: { out = d.out.outPath; dev = d.dev.outPath; }",
        "--no-write-lock-file",
        "--override-input",
        "nixpkgs",
        nixpkgs,
    )

    assert training["builtWith"] == "buildRustPackage"
    # floDl's LIBTORCH_PATH: one root, a store path of two links to
    # libtorch's two outputs, named alike by both halves of the build.
    root = training["root"]["path"]
    assert root.endswith("-fdl-build-root")
    assert f"export LIBTORCH_PATH='{root}/libtorch'" in training["preBuild"]
    assert f"ln -s '{libtorch['out']}/lib' \"$out/libtorch/lib\"" in training["root"]["script"]
    assert f"ln -s '{libtorch['dev']}/include' \"$out/libtorch/include\"" in training["root"]["script"]
    # The headers' paths in the binary do not keep the root in its closure.
    assert f"remove-references-to -t {root} " in training["installPhase"]
    # ... and the RUNPATH at libtorch's lib/ in the store, which the
    # ld-wrapper would not add for a -L outside it.
    assert training["env"]["NIX_LDFLAGS"] == f"-rpath {libtorch['out']}/lib"
    # tch-rs' variables stay for sources built on tch.
    assert training["env"]["LIBTORCH"] == training["env"]["LIBTORCH_LIB"] == libtorch["out"]
    assert training["env"]["LIBTORCH_INCLUDE"] == libtorch["dev"]
    # The whole tree, the member picked by cwd, the lock from the workspace root.
    assert training["src"].endswith("-fdl-training-source")
    assert training["subdir"] is None and training["cargoRoot"] is None
    # The lock as the dependency tree holds it, so the vendored crates do
    # not depend on the run's code.
    assert training["lock"] == training["deps"]["src"] + "/Cargo.lock"
    assert training["deps"]["src"].endswith("-fdl-training-source-deps")
    # floDl's build: its default line in cwd, cargo's own target directory
    # (not cargoBuildHook's, at the source root under a --target triple),
    # no feature chosen for the crate; `bin` relative to cwd.
    assert "unset CARGO_TARGET_DIR CARGO_BUILD_TARGET" in training["buildPhase"]
    assert "cd crates/train\n  cargo build --release\n" in training["buildPhase"].replace("    ", "  ")
    assert "--target" not in training["buildPhase"] and training["features"] is None
    assert (
        "for f in crates/train/train target/release/train crates/train/target/release/train;"
        in (training["installPhase"])
    )
    assert (training["pname"], training["version"], training["doCheck"]) == ("trainer-cpu", "0.3.1", False)


def test_a_cuda_variants_training_build_carries_the_cuda_feature_cuda_home_nccl_and_the_driver_directory(
    env, production, nixpkgs, tmp_path
):
    tree = workspace(tmp_path / "source", features='cuda = ["util/cuda"]\n')
    (tree / "crates" / "util" / "Cargo.toml").write_text(
        '[package]\nname = "util"\nversion = "0.1.0"\n[features]\ncuda = []\n'
    )

    training = production_training(env, production, nixpkgs, tmp_path, tree, libtorch="cu128", cwd="crates/train")

    libtorch = nix_json(
        env,
        "eval",
        f"{production}#{FDL}.libtorch.cu128",
        "--apply",
        "d: { out = d.out.outPath; cuda = d.cuda.outPath; dev = d.dev.outPath; }",
        "--no-write-lock-file",
        "--override-input",
        "nixpkgs",
        nixpkgs,
    )
    # The vendor's feature is the build line's to use (floDl's build_env).
    assert training["features"] is None and training["env"]["FDL_GPU_FEATURE"] == "cuda"
    # CUDA_HOME is the wheels' libtorch's `cuda` output: every header floDl's
    # shim includes, and the lib64/ with the link names flodl-sys links,
    # both in the build root both halves of the split build name alike.
    assert f"ln -s '{libtorch['cuda']}/include' \"$out/cuda/include\"" in training["root"]["script"]
    assert f"ln -s '{libtorch['cuda']}/lib64' \"$out/cuda/lib64\"" in training["root"]["script"]
    assert f"export CUDA_HOME='{training['root']['path']}/cuda'" in training["preBuild"]
    assert training["deps"]["preBuild"].startswith(training["preBuild"].split("\n")[0])
    assert training["buildInputs"] == []
    # The binary loads libtorch, cudart and NCCL from `out`, never from the
    # headers' outputs.
    assert training["env"]["NIX_LDFLAGS"].split(" -rpath ")[1:] == [
        f"{libtorch['out']}/nvidia/cuda_runtime/lib",
        f"{libtorch['out']}/nvidia/nccl/lib",
    ]
    # The driver directory, where libcuda.so.1 and libnvidia-ml.so.1 are.
    assert training["nativeBuildInputs"] == [
        "/nix/store/00000000000000000000000000000000-remove-references-to",
        "/nix/store/00000000000000000000000000000000-auto-add-driver-runpath-hook",
    ]


def test_a_cpu_variants_training_build_carries_none_of_the_cuda_parts(env, production, nixpkgs, tmp_path):
    tree = workspace(tmp_path / "source", features='cuda = ["util/cuda"]\n')

    training = production_training(env, production, nixpkgs, tmp_path, tree, libtorch="cpu", cwd="crates/train")

    assert training["features"] is None and training["env"]["FDL_GPU_FEATURE"] == ""
    assert "CUDA_HOME" not in training["preBuild"] and "cuda" not in training["env"]["NIX_LDFLAGS"]
    assert training["buildInputs"] == []
    assert training["nativeBuildInputs"] == ["/nix/store/00000000000000000000000000000000-remove-references-to"]
    assert "FDL_CUDA_VERSION" not in training["env"]


def test_the_production_build_runs_floDls_build_line_in_cwd_and_finds_a_members_bin_at_the_workspace_root(
    env, production, nixpkgs, tmp_path
):
    tree = workspace(tmp_path / "source")
    line = 'cargo build --release --features "$FDL_GPU_FEATURE" --bin train'

    training = production_training(
        env,
        production,
        nixpkgs,
        tmp_path,
        tree,
        libtorch="cu128",
        cwd="crates/train",
        build=line,
        bin="../../target/release/train",
    )

    assert f"cd crates/train\n  {line}\n" in training["buildPhase"].replace("    ", "  ")
    assert "export CARGO_NET_OFFLINE=true" in training["buildPhase"]
    assert training["env"]["FDL_GPU_FEATURE"] == "cuda" and training["features"] is None
    # `bin` as floDl resolves it, relative to cwd: the workspace's target/.
    assert "for f in target/release/train;" in training["installPhase"]
    assert 'install -Dm755 "$found" "$out/bin/"train' in training["installPhase"]


def test_a_bin_leading_out_of_the_source_is_refused_at_evaluation(env, production, nixpkgs, tmp_path):
    tree = workspace(tmp_path / "source")

    stderr = production_refusal(
        env, production, nixpkgs, tmp_path, tree, libtorch="cpu", cwd="crates/train", bin="../../../train"
    )

    assert 'recipe.json `bin` = "../../../train" must be a path relative to `cwd` that stays inside' in stderr


def test_the_production_flake_asks_nixpkgs_for_no_unfree_package(env, production, nixpkgs, tmp_path):
    # CUDA comes from PyTorch's wheels, not nixpkgs' unfree CUDA packages.
    tree = workspace(tmp_path / "source")
    recipe = write_recipe(tmp_path / "recipe", libtorch="cpu", cwd="crates/train", bin="train")
    common = ["--override-input", "nixpkgs", nixpkgs, *overrides(prefetch(env, tree), recipe)]

    config = nix_json(env, "eval", f"{production}#{FDL}.training", "--apply", "t: t.nixpkgsConfig", *common)

    assert config == {}


def test_the_production_flake_instantiates_nixpkgs_once_per_system(env, production, nixpkgs):
    # The stand-in traces each instantiation; the checks reach nixpkgs both
    # through the app package and directly.
    done = nix(
        env,
        "eval",
        "--json",
        "--no-write-lock-file",
        f"{production}#checks.{SYSTEM}",
        "--apply",
        "c: [ c.app.builtWith c.gates.builtWith ]",
        "--override-input",
        "nixpkgs",
        nixpkgs,
    )

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["buildPythonApplication", "runCommand"]
    assert done.stderr.count("fdl-standin: nixpkgs instantiated") == 1, done.stderr


@pytest.mark.parametrize(
    ("change", "recipe", "says"),
    [
        pytest.param(
            "no-lock",
            {"libtorch": "cpu", "cwd": "crates/train"},
            'has no Cargo.lock in `cwd` = "crates/train" or any directory above it: commit Cargo.lock',
            id="no-cargo-lock",
        ),
        pytest.param(
            "rust-version",
            {"libtorch": "cpu", "cwd": "crates/train"},
            'declares rust-version = "1.99", and this flake builds with rustc 1.91.1',
            id="rust-version-too-new",
        ),
        pytest.param(
            "toolchain-file",
            {"libtorch": "cpu", "cwd": "crates/train"},
            "rust-toolchain file asks for Rust 1.99.0, and this flake builds with rustc 1.91.1",
            id="toolchain-file-too-new",
        ),
        pytest.param(
            "git-dependency",
            {"libtorch": "cpu", "cwd": "crates/train"},
            "Cargo.lock has git dependencies: tok 0.2.0 (git+https://example.com/tok.git?rev=abc#abcdef); "
            "the flake fetches crates only by a hash",
            id="git-dependency",
        ),
        pytest.param(
            "no-manifest",
            {"libtorch": "cpu", "cwd": "crates"},
            'has no Cargo.toml in `cwd` = "crates"',
            id="no-cargo-toml",
        ),
    ],
)
def test_a_source_the_production_build_cannot_take_is_refused_at_evaluation_with_the_fix(
    env, production, nixpkgs, tmp_path, change, recipe, says
):
    tree = workspace(
        tmp_path / "source",
        lock=change != "no-lock",
        extra='rust-version = "1.99"\n' if change == "rust-version" else "",
    )
    if change == "toolchain-file":
        (tree / "rust-toolchain.toml").write_text('[toolchain]\nchannel = "1.99.0"\n')
    if change == "git-dependency":
        # A token in the URL stays out of the message.
        (tree / "Cargo.lock").write_text(
            'version = 3\n[[package]]\nname = "tok"\nversion = "0.2.0"\n'
            'source = "git+https://user:s3cret@example.com/tok.git?rev=abc#abcdef"\n'
        )

    stderr = production_refusal(env, production, nixpkgs, tmp_path, tree, **recipe)

    assert "fdl-prepare flake: " in stderr and says in stderr, stderr
    assert "s3cret" not in stderr


def test_the_production_training_build_does_not_see_the_run_manifest(env, production, nixpkgs, tmp_path):
    crate = tmp_path / "source"
    crate.mkdir()
    (crate / "Cargo.toml").write_text('[package]\nname = "trainer"\nversion = "0.3.1"\n')
    (crate / "Cargo.lock").write_text("version = 3\n")
    recipe = write_recipe(tmp_path / "recipe", libtorch="cpu", bin="train")

    def src() -> str:
        common = ["--override-input", "nixpkgs", nixpkgs, *overrides(prefetch(env, crate), recipe)]
        got = nix_json(env, "eval", f"{production}#{FDL}.training.src", *common)
        assert isinstance(got, str)
        return got

    bare = src()
    (crate / ".fdl-run.sha256").write_text("0" * 64 + "  Cargo.toml\n")
    (crate / ".fdl-run.yml").write_text("bin: train\nrun: one\n")
    with_manifest = src()

    assert bare == with_manifest
    assert not (Path(with_manifest) / ".fdl-run.yml").exists() and (Path(with_manifest) / "Cargo.toml").exists()
    assert not (Path(with_manifest) / ".fdl-run.sha256").exists()


def test_the_app_puts_its_tools_on_path_and_defaults_to_its_own_flake(env, production, nixpkgs):
    common = ["--no-write-lock-file", "--override-input", "nixpkgs", nixpkgs]

    app = nix_json(
        env,
        "eval",
        f"{production}#packages.{SYSTEM}.fdl-prepare",
        "--apply",
        "a: { inherit (a) pname version makeWrapperArgs; }",
        *common,
    )
    program = nix_json(env, "eval", f"{production}#apps.{SYSTEM}.prepare.program", *common)
    publish = nix_json(env, "eval", f"{production}#apps.{SYSTEM}.publish", *common)

    args = app["makeWrapperArgs"]
    prefix = args[args.index("--prefix") + 3]
    suffix = args[args.index("--suffix") + 3]
    default_flake = args[args.index("--set-default") + 2]
    assert args[args.index("--set-default") + 1] == "FDL_PREPARE_FLAKE"
    assert default_flake.startswith("path:/nix/store/") and "?narHash=sha256-" in default_flake
    assert [p.split("-", 1)[1] for p in prefix.split(":")] == ["sshfs/bin", "openssh/bin", "git/bin", "rsync/bin"]
    assert [p.split("-", 1)[1] for p in suffix.split(":")] == ["nix/bin", "fuse3/bin", "fuse/bin"]
    assert app["version"] == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert program.endswith("-fdl-prepare/bin/fdl-prepare")
    # `nix run .#publish` runs the package's publish script, the same CLI's subcommand.
    assert publish["type"] == "app" and publish["program"].endswith("-fdl-prepare/bin/fdl-prepare-publish")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fdl-prepare-publish"] == "prepare.cli:publish_main"


def _committed_flake(env: dict[str, str], tree: Path, nixpkgs: str) -> str:
    """The production flake copied to `tree` as a committed git repository
    whose flake.lock pins nixpkgs to the stand-in (its URL in flake.nix
    replaced, then `nix flake lock`): a flake whose lock an evaluation would
    change is treated as dirty and has no `self.rev`, so an --override-input
    could not show the revision. Its HEAD."""
    flake = tree / "flake.nix"
    pinned = re.sub(
        r'nixpkgs\.url = "github:NixOS/nixpkgs/[0-9a-f]{40}"', f'nixpkgs.url = "{nixpkgs}"', flake.read_text()
    )
    assert pinned != flake.read_text(), "flake.nix must pin nixpkgs by a full revision"
    flake.write_text(pinned)

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-c", "user.name=fdl tests", "-c", "user.email=tests@fdl.invalid", *args],
            cwd=tree, capture_output=True, text=True, check=True,
        )  # fmt: skip
        return done.stdout.strip()

    git("init", "-q", "-b", "main")
    git("add", "-A")
    locked = nix(env, "flake", "lock", f"git+file://{tree}")
    assert locked.returncode == 0, locked.stderr
    git("add", "-A")
    git("commit", "-q", "-m", "the production flake")
    return git("rev-parse", "HEAD")


def _baked_version(env: dict[str, str], flake: str, tmp_path: Path, *extra: str) -> str:
    """What `--version` prints from the package the flake builds: its
    postPatch run over a copy of the package's sources (as the build runs
    it), then the copy's own `--version`."""
    script = nix_json(env, "eval", f"{flake}#packages.{SYSTEM}.fdl-prepare.postPatch", *extra)
    assert isinstance(script, str)
    tree = tmp_path / "app-src"
    shutil.copytree(REPO / "prepare", tree / "prepare", ignore=shutil.ignore_patterns("__pycache__", "_revision.py"))
    subprocess.run(["bash", "-euc", script], cwd=tree, check=True)
    done = subprocess.run(
        [sys.executable, "-m", "prepare", "--version"],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def test_the_app_built_from_a_git_checkout_names_its_commit_in_version(env, production, nixpkgs, tmp_path):
    from prepare import __version__

    tree = Path(production.removeprefix("path:"))
    head = _committed_flake(env, tree, nixpkgs)

    said = _baked_version(env, f"git+file://{tree}", tmp_path)

    assert said == f"fdl-prepare {__version__} (rev {head[:12]})"


def test_the_app_from_a_tree_with_uncommitted_changes_says_dirty_or_unknown_never_a_clean_rev(
    env, production, nixpkgs, tmp_path
):
    tree = Path(production.removeprefix("path:"))
    head = _committed_flake(env, tree, nixpkgs)
    (tree / "flake.nix").write_text((tree / "flake.nix").read_text() + "# an edit not committed\n")

    said = _baked_version(env, f"git+file://{tree}", tmp_path)

    # self.dirtyRev came with Nix 2.17; before it, a dirty tree has no revision.
    if _nix_version(env) >= (2, 17):
        assert said.endswith(f"(rev {head[:12]}-dirty)"), said
    else:
        assert said.endswith("(rev unknown)"), said


def test_the_app_from_a_tree_git_does_not_describe_says_rev_unknown(env, production, nixpkgs, tmp_path):
    common = ["--no-write-lock-file", "--override-input", "nixpkgs", nixpkgs]
    assert _baked_version(env, production, tmp_path, *common).endswith("(rev unknown)")


def _nix_version(env: dict[str, str]) -> tuple[int, ...]:
    done = subprocess.run(["nix", "--version"], env=env, capture_output=True, text=True, check=True)
    found = re.search(r"(\d+)\.(\d+)", done.stdout)
    assert found is not None, done.stdout
    return tuple(int(part) for part in found.groups())


def test_the_flake_checks_run_the_gates_and_the_formatter_is_nixfmt(env, production, nixpkgs):
    common = ["--no-write-lock-file", "--override-input", "nixpkgs", nixpkgs]
    # The copy the production fixture makes holds what the flake reads; the
    # gates read the package and the tests too.
    dest = Path(production.removeprefix("path:"))
    shutil.copytree(REPO / "prepare", dest / "prepare")
    shutil.copytree(REPO / "tests", dest / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "bench", dest / "bench")

    gates = nix_json(
        env,
        "eval",
        f"{production}#checks.{SYSTEM}.gates",
        "--apply",
        "g: { inherit (g) name script builtWith; tools = map (t: t.outPath) g.nativeBuildInputs; }",
        *common,
    )
    app = nix_json(env, "eval", f"{production}#checks.{SYSTEM}.app.builtWith", *common)
    formatter = nix_json(env, "eval", f"{production}#formatter.{SYSTEM}.outPath", *common)

    assert gates["builtWith"] == "runCommand"
    for gate in ("ruff check .", "ruff format --check .", "mypy --strict prepare", "nixfmt --check"):
        assert gate in gates["script"], gate
    assert any(t.endswith("-ruff") for t in gates["tools"]) and any(t.endswith("-nixfmt") for t in gates["tools"])
    assert app == "buildPythonApplication"
    assert formatter.endswith("-nixfmt")


@pytest.mark.parametrize(
    "path",
    [
        "flake.nix",
        *sorted(f"nix/{p.name}" for p in (REPO / "nix").glob("*.nix") if p.name != "module.nix"),
        *sorted(f"tests/flake/{p.name}" for p in (REPO / "tests" / "flake").glob("*.nix")),
    ],
)
def test_every_flake_file_parses(path):
    if shutil.which("nix-instantiate") is None:
        pytest.skip("nix-instantiate is not installed (apt install nix-bin)")

    done = subprocess.run(["nix-instantiate", "--parse", str(REPO / path)], capture_output=True, text=True)

    assert done.returncode == 0, done.stderr
