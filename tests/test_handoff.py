"""The hand-off to an unchanged `fdl join` (prepare.handoff, prepare.build.rundir):
the run's writable project directory, floDl's libtorch/.active, the stable
links and the last Prepared in the state directory, and the devices as CUDA
ordinals. Real builds of the /bin/sh stand-in flake, real owners and modes
(the training user is `nobody`, as root), the fake NVML for the gate."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from nix_fixtures import build, manifest_text, private_dir, trainer
from nvml_fixtures import FakeGpu

from prepare.fail import Fail
from prepare.spec import PrepareSpec, SourceSpec

NOBODY = 65534

# A trainer that writes where floDl's trainers do: checkpoints under its cwd.
CHECKPOINTING = "printf '#!/bin/sh\\nmkdir -p runs && echo step > runs/ckpt\\n' > train && chmod +x train"


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the run directory is handed to another user")
    try:
        import pwd

        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this box has no user `nobody`")


@pytest.fixture
def state(request: pytest.FixtureRequest) -> str:
    # The training user must pass through every directory above it (the
    # state directory of a box is /var/lib/fdl-prepare): not under pytest's
    # 0700 /tmp/pytest-of-root.
    made = private_dir("fdl-handoff-")
    request.addfinalizer(lambda: shutil.rmtree(made, ignore_errors=True))
    return str(made / "state")


@pytest.fixture
def flodl_home(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Path:
    base = private_dir("fdl-flodl-home-")
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    monkeypatch.setenv("FLODL_HOME", str(base / "flodl"))
    return base / "flodl"


def spec(flake: str, state_dir: str, source: str) -> PrepareSpec:
    return PrepareSpec(source=SourceSpec(from_=source), libtorch="cpu", cpu_only=True, flake=flake, state_dir=state_dir)


def as_nobody(argv: list[str], cwd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, user=NOBODY, group=NOBODY, extra_groups=[], cwd=cwd, env={"PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def owners(top: str) -> set[int]:
    found = {os.lstat(top).st_uid}
    for root, dirs, files in os.walk(top):
        found.update(os.lstat(os.path.join(root, n)).st_uid for n in dirs + files)
    return found


# --- the run directory --------------------------------------------------------------------


def test_the_run_directory_is_a_copy_of_the_published_tree_the_training_user_owns_and_writes(
    nix_env, test_flake, state, git_source
):
    needs_root()
    files = trainer(build=CHECKPOINTING, manifest={"bin": "train", "cwd": "app", "build": CHECKPOINTING})
    files["app/keep"] = "x\n"
    src = git_source(files)
    os.symlink("keep", src.path / "app" / "alias")
    subprocess.run(["git", "-C", str(src.path), "add", "app/alias"], check=True)
    src.commit({}, "a link")
    notes: list[str] = []

    got = build(spec(test_flake, state, src.url), notes)

    assert got.bin is not None
    runs = os.path.join(state, "runs")
    assert got.bin.cwd.startswith(runs + "/") and got.bin.cwd.endswith("/app")
    # As published: files, and links as links, never followed.
    assert Path(got.bin.cwd, "keep").read_text() == "x\n"
    assert os.readlink(os.path.join(got.bin.cwd, "alias")) == "keep"
    # Every entry the training user's, none of root's; runs/ itself root's.
    assert owners(os.path.dirname(got.bin.cwd)) == {NOBODY}
    assert os.lstat(runs).st_uid == 0 and stat.S_IMODE(os.lstat(runs).st_mode) == 0o755
    # The trainer writes its checkpoints where floDl's write them: its cwd.
    ran = as_nobody([got.bin.path], got.bin.cwd)
    assert ran.returncode == 0, ran.stderr
    assert Path(got.bin.cwd, "runs", "ckpt").read_text() == "step\n"
    assert any("a writable copy of the run's tree, nobody's" in n for n in notes)


def test_a_redial_of_the_same_run_keeps_its_directory_and_a_new_publish_prunes_the_old_one(
    nix_env, test_flake, state, git_source
):
    needs_root()
    src = git_source(trainer(manifest={"bin": "train", "build": CHECKPOINTING, "run": "run-1"}))
    first = build(spec(test_flake, state, src.url))
    assert first.bin is not None
    assert as_nobody([first.bin.path], first.bin.cwd).returncode == 0

    notes: list[str] = []
    again = build(spec(test_flake, state, src.url), notes)

    assert again.bin is not None and again.bin.cwd == first.bin.cwd
    assert Path(first.bin.cwd, "runs", "ckpt").read_text() == "step\n"
    assert any("kept from the last attempt of this run" in n for n in notes)

    src.commit({".fdl-run.toml": manifest_text(bin="train", build=CHECKPOINTING, run="run-2")}, "publish run-2")
    notes = []
    second = build(spec(test_flake, state, src.url), notes)

    # Rule: one directory a source, the current run's; the older runs' go.
    assert second.bin is not None and second.bin.cwd != first.bin.cwd
    assert not os.path.lexists(first.bin.cwd)
    assert not Path(second.bin.cwd, "runs").exists()
    assert os.listdir(os.path.join(state, "runs")) == [os.path.basename(second.bin.cwd)]
    assert any("1 older run directory of this source removed" in n for n in notes)


def test_a_symlink_the_training_user_plants_in_the_run_directory_sends_no_write_or_removal_of_roots_elsewhere(
    nix_env, test_flake, state, git_source, tmp_path
):
    needs_root()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("root's\n")
    src = git_source(trainer(manifest={"bin": "train", "build": CHECKPOINTING, "run": "run-1"}))
    first = build(spec(test_flake, state, src.url))
    assert first.bin is not None
    # What the training code could do in its own directory: links to what
    # it cannot write, where root would write or remove next.
    planted = as_nobody(
        [
            "/bin/sh",
            "-c",
            f"ln -s {victim} runs && ln -sf {victim}/precious README && mkdir deep && ln -s {victim} deep/up",
        ],
        first.bin.cwd,
    )
    assert planted.returncode == 0, planted.stderr

    build(spec(test_flake, state, src.url))  # a re-dial: kept, nothing written in it
    src.commit({".fdl-run.toml": manifest_text(bin="train", build=CHECKPOINTING, run="run-2")}, "publish run-2")
    build(spec(test_flake, state, src.url))  # a new run: the old directory pruned

    assert not os.path.lexists(first.bin.cwd)
    assert (victim / "precious").read_text() == "root's\n" and os.listdir(victim) == ["precious"]


def test_a_bin_the_build_did_not_make_is_transient_the_sources_to_fix(nix_env, test_flake, state_dir, git_source):
    # floDl's `bin` names where the build writes, relative to cwd; a publish
    # that names another path is fixed by the next publish, not the flake.
    src = git_source(trainer(manifest={"bin": "target/release/train", "build": CHECKPOINTING}))

    with pytest.raises(Fail) as failed:
        build(spec(test_flake, state_dir, src.url))

    assert failed.value.reason == "nix.build-failed" and not failed.value.permanent
    assert "the build produced no file 'target/release/train' relative to cwd" in failed.value.message
    assert "publish a run whose bin is the path the build writes" in failed.value.message


# --- floDl's libtorch/.active, the stable links, the last Prepared --------------------------


def test_active_under_flodl_home_names_the_built_libtorch_as_flodl_resolves_it(
    nix_env, test_flake, state, git_source, flodl_home
):
    needs_root()
    src = git_source(trainer())
    notes: list[str] = []

    got = build(spec(test_flake, state, src.url), notes)

    assert got.libtorch is not None
    # floDl's read_active: <root>/libtorch/.active, trimmed, relative to libtorch/.
    active = (flodl_home / "libtorch" / ".active").read_text()
    assert active == "fdl-prepare/cpu\n"
    variant = flodl_home / "libtorch" / active.strip()
    assert os.path.realpath(variant) == got.libtorch.path and (variant / "lib").is_dir()
    # The training user's, as floDl's own files would be.
    assert owners(str(flodl_home)) == {NOBODY}
    assert any("libtorch/.active names fdl-prepare/cpu" in n for n in notes)


def test_a_link_planted_in_the_flodl_root_is_not_followed_and_the_hand_off_is_a_note(
    nix_env, test_flake, state, git_source, flodl_home, tmp_path
):
    needs_root()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (flodl_home / "libtorch").mkdir(parents=True)
    os.symlink(elsewhere, flodl_home / "libtorch" / "fdl-prepare")
    os.lchown(flodl_home / "libtorch" / "fdl-prepare", NOBODY, NOBODY)
    notes: list[str] = []

    got = build(spec(test_flake, state, git_source(trainer()).url), notes)

    assert got.bin is not None
    assert os.listdir(elsewhere) == [] and not (flodl_home / "libtorch" / ".active").exists()
    assert any("libtorch/.active not written under" in n and "fdl-prepare is not a directory" in n for n in notes)


def test_the_last_prepared_and_stable_links_to_the_current_binary_are_in_the_state_directory(
    nix_env, test_flake, state_dir, git_source
):
    src = git_source(trainer(manifest={"bin": "train", "build": CHECKPOINTING, "run": "run-9", "args": ["--x"]}))

    os.makedirs(os.path.join(state_dir, "current"))
    # A swap an earlier attempt was killed in the middle of.
    os.symlink("/nix/store/gone", os.path.join(state_dir, "current", ".bin.0123456789abcdef.tmp"))

    got = build(spec(test_flake, state_dir, src.url))

    path = os.path.join(state_dir, "prepared.json")
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o644
    saved = json.loads(Path(path).read_text())
    assert saved == {"kind": "prepared", "schema": 1, **json.loads(json.dumps(got.to_json()))}
    assert saved["run_id"] == "run-9" and saved["args"] == ["--x"]
    current = os.path.join(state_dir, "current")
    assert got.bin is not None and got.libtorch is not None
    assert os.readlink(os.path.join(current, "bin")) == got.bin.path
    assert os.readlink(os.path.join(current, "cwd")) == got.bin.cwd
    assert os.readlink(os.path.join(current, "libtorch")) == got.libtorch.path
    assert sorted(os.listdir(current)) == ["bin", "cwd", "libtorch"]


def test_a_tree_past_the_run_directorys_bounds_is_permanent_and_leaves_nothing_half_made(
    nix_env, test_flake, state, git_source, monkeypatch
):
    from prepare.build import rundir

    src = git_source(trainer())
    monkeypatch.setattr(rundir, "MAX_ENTRIES", 1)

    with pytest.raises(Fail) as failed:
        build(spec(test_flake, state, src.url))

    assert failed.value.reason == "state.run-dir" and failed.value.permanent
    assert "more than 1 entries" in failed.value.message and "Publish the project, not its data" in failed.value.message
    assert os.listdir(os.path.join(state, "runs")) == []


# --- devices as CUDA ordinals --------------------------------------------------------------


@pytest.mark.parametrize(
    ("mask", "ordinals", "nvml"),
    [
        pytest.param(None, (0, 1, 2), (0, 1, 2), id="no-mask"),
        pytest.param("2,1", (0, 1), (2, 1), id="reordered"),
        pytest.param("0,2", (0, 1), (0, 2), id="gap"),
        pytest.param("1", (0,), (1,), id="one"),
    ],
)
def test_the_offered_devices_are_cuda_ordinals_under_cuda_visible_devices_with_nvml_indices_beside(
    nvml_box, monkeypatch, mask, ordinals, nvml
):
    from prepare import pipeline
    from prepare.plan import plan

    nvml_box([FakeGpu(), FakeGpu(), FakeGpu()])
    if mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)

    got = pipeline.run(plan(PrepareSpec()), [], steps=[s for s in pipeline.STEPS if s.name == "gate"])

    assert (got.devices, got.nvml_indices, got.gpu_vendor) == (ordinals, nvml, "nvidia")
    assert got.to_json()["devices"] == list(ordinals) and got.to_json()["nvml_indices"] == list(nvml)


def test_a_state_directory_the_training_user_cannot_reach_keeps_the_read_only_cwd_with_a_note(
    nix_env, test_flake, state_dir, git_source
):
    # pytest's /tmp/pytest-of-root is root's, mode 0700: nobody passes through.
    needs_root()
    notes: list[str] = []

    got = build(spec(test_flake, state_dir, git_source(trainer()).url), notes)

    assert got.bin is not None and got.bin.cwd.startswith("/nix/store/")
    assert not os.path.exists(os.path.join(state_dir, "runs"))
    said = [n for n in notes if n.startswith("no run directory: nobody, who runs the training, cannot pass through")]
    assert len(said) == 1 and "Set state_dir (--state-dir)" in said[0]
