"""Where builds run: under no directory that others can write, and never as root.

With Nix's sandbox off (Debian 12's default, Nix 2.8 here) a build sees the
whole file system, and cargo reads `.cargo/config.toml` from every
directory above the one it builds in. A build under /tmp (TMPDIR's default)
then runs whatever `rustc-wrapper` any local user planted in
/tmp/.cargo/config.toml. fdl-prepare builds only under a directory none of
whose ancestors others can write (prepare.build.workspace.build_root), and
refuses a Nix that would build the training source as root.

The planting test runs the CLI in a private mount namespace whose /tmp is a
fresh tmpfs (pytest's own directory bound back into it), so that what it
plants there reaches no other process of the box."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from nix_fixtures import MANIFEST, NIX_CONFIG, manifest_text, private_dir, trainer

from prepare.build import workspace
from prepare.fail import Fail
from prepare.nix.runner import NIX_STATE_DIR

REPO = Path(__file__).resolve().parent.parent
CARGO = "/usr/bin/cargo"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="fdl-prepare runs as root; builds run as nixbld")


# -- build_root, on real directories -----------------------------------------------------------


@root_only
def test_a_tmpdir_under_tmp_is_set_aside_for_nixs_own_builds_directory_with_a_note():
    under_tmp = Path(tempfile.mkdtemp(prefix="fdl-open-tmpdir-", dir="/tmp"))
    try:
        under_tmp.chmod(0o755)
        notes: list[str] = []
        got = workspace.build_root({"TMPDIR": str(under_tmp)}, notes, "nix builds")
    finally:
        under_tmp.rmdir()
    assert got == os.path.join(NIX_STATE_DIR, "builds")
    assert len(notes) == 1 and "/tmp is writable by its group and others (mode 1777)" in notes[0], notes
    assert ".cargo/config.toml" in notes[0] and got in notes[0]


@root_only
def test_a_tmpdir_only_root_can_write_above_is_kept():
    own = private_dir("fdl-clean-tmpdir-")
    try:
        notes: list[str] = []
        assert workspace.build_root({"TMPDIR": str(own)}, notes, "nix builds") == str(own)
        assert notes == []
    finally:
        own.rmdir()


@root_only
def test_no_place_for_builds_that_only_root_can_write_is_permanent_naming_the_directory():
    # Nix's state directory under /tmp too (NIX_STATE_DIR): nowhere is left.
    open_state = Path(tempfile.mkdtemp(prefix="fdl-open-nixstate-", dir="/tmp"))
    try:
        open_state.chmod(0o755)
        with pytest.raises(Fail) as caught:
            workspace.build_root({"TMPDIR": "/tmp", "NIX_STATE_DIR": str(open_state)}, [], "nix builds")
    finally:
        shutil.rmtree(open_state)
    fail = caught.value
    assert fail.permanent and fail.reason == "nix.build-dir", fail.message
    assert "/tmp, which is writable by its group and others" in fail.message and "sudo chmod go-w /tmp" in fail.message


@root_only
def test_a_control_character_in_tmpdir_is_escaped_in_the_note():
    forged = Path(tempfile.mkdtemp(prefix="fdl-ctl-\n[fdl-prepare] ok\x1b[2J", dir="/tmp"))
    try:
        forged.chmod(0o755)
        notes: list[str] = []
        workspace.build_root({"TMPDIR": str(forged)}, notes, "nix builds")
    finally:
        forged.rmdir()
    assert notes and "\n" not in notes[0] and "\x1b" not in notes[0], notes


# -- a planted .cargo/config.toml and a real cargo build -----------------------------------------

# Run in the namespace: /tmp becomes a fresh tmpfs holding the planted
# configs and pytest's directory (bound back), then the CLI builds.
PLANT = r"""
import json, os, subprocess, sys
spec = json.loads(sys.argv[1])
keep, pytest_top = spec["keep"], spec["pytest_top"]
subprocess.run(["mount", "--bind", "/tmp", keep], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp"], check=True)
os.mkdir(pytest_top, 0o700)
subprocess.run(["mount", "--bind", os.path.join(keep, os.path.basename(pytest_top)), pytest_top], check=True)
plant = "/tmp/fdl-plant"
tmpdir = f"{plant}/tmpdir"
marks = f"{plant}/marks"
for d in (plant, tmpdir, marks):
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o1777)
wrapper = f"{plant}/wrapper"
with open(wrapper, "w") as f:
    f.write('#!/bin/sh\necho "$(id -u) $PWD" >> ' + marks + '/ran\nexec "$@"\n')
os.chmod(wrapper, 0o755)
for where in ("/tmp", plant, tmpdir):
    os.makedirs(f"{where}/.cargo", exist_ok=True)
    os.chmod(f"{where}/.cargo", 0o755)
    with open(f"{where}/.cargo/config.toml", "w") as f:
        f.write(f'[build]\nrustc-wrapper = "{wrapper}"\n')
# The plant works: cargo run by another user in a crate under TMPDIR runs it.
control = f"{tmpdir}/control"
subprocess.run(["cp", "-r", spec["crate"], control], check=True)
subprocess.run(["chown", "-R", "65534:65534", control], check=True)
env = {"PATH": "/usr/bin:/bin", "HOME": control, "CARGO_HOME": f"{control}/.cargo-home"}
ran = subprocess.run(
    ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", spec["cargo"], "build", "--offline", "-q"],
    cwd=f"{control}/app", env=env, capture_output=True, text=True,
)
control_ran = os.path.exists(f"{marks}/ran")
if control_ran:
    os.unlink(f"{marks}/ran")
done = subprocess.run(spec["argv"], env={**os.environ, "TMPDIR": tmpdir}, cwd=spec["repo"], capture_output=True, text=True)
print(json.dumps({
    "control_rc": ran.returncode, "control_stderr": ran.stderr[-2000:], "control_ran": control_ran,
    "rc": done.returncode, "stdout": done.stdout[-6000:], "stderr": done.stderr[-6000:],
    "ran": open(f"{marks}/ran").read() if os.path.exists(f"{marks}/ran") else "",
}))
"""


def _crate(root: Path) -> Path:
    """A real cargo crate, its own workspace, Cargo.lock made offline."""
    (root / "app" / "src").mkdir(parents=True)
    (root / "app" / "Cargo.toml").write_text('[package]\nname = "app"\nversion = "0.1.0"\nedition = "2021"\n')
    (root / "app" / "src" / "main.rs").write_text('fn main() { println!("built by cargo"); }\n')
    subprocess.run(
        [CARGO, "generate-lockfile", "--offline"],
        cwd=root / "app",
        env={"PATH": "/usr/bin:/bin", "CARGO_HOME": str(root / "cargo-home")},
        check=True,
        capture_output=True,
    )
    shutil.rmtree(root / "cargo-home", ignore_errors=True)
    return root


@root_only
@pytest.mark.nix
def test_a_cargo_config_planted_in_tmp_and_above_tmpdir_does_not_reach_a_real_cargo_build(
    nix_env, test_flake, git_source, state_dir, tmp_path
):
    if not os.access(CARGO, os.X_OK) or shutil.which("unshare") is None or shutil.which("setpriv") is None:
        pytest.skip(f"needs {CARGO}, unshare and setpriv (scripts/setup installs them)")
    crate = _crate(tmp_path / "crate")
    files = {
        "app/Cargo.toml": (crate / "app" / "Cargo.toml").read_text(),
        "app/Cargo.lock": (crate / "app" / "Cargo.lock").read_text(),
        "app/src/main.rs": (crate / "app" / "src" / "main.rs").read_text(),
        MANIFEST: manifest_text(bin="app", cwd="app"),
        "README": f"{trainer()['README']}",
    }
    src = git_source(files)
    keep = private_dir("fdl-plant-keep-")
    try:
        argv = [sys.executable, "-m", "prepare", "--cpu-only", "--libtorch", "cpu", "--flake", test_flake]
        argv += ["--source", src.url, "--state-dir", state_dir]
        top = "/" + "/".join(Path(tmp_path).parts[1:3])
        assert top.startswith("/tmp/"), top
        spec = {"keep": str(keep), "pytest_top": top, "crate": str(crate), "cargo": CARGO, "argv": argv}
        spec["repo"] = str(REPO)
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", PLANT, json.dumps(spec)],
            capture_output=True, text=True, timeout=900, env={**nix_env, "NIX_CONFIG": NIX_CONFIG + "sandbox = false\n"},
        )  # fmt: skip
    finally:
        keep.rmdir()
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(seen, indent=2))
    # The plant is real: cargo, run by another user under TMPDIR, ran the wrapper.
    assert seen["control_rc"] == 0 and seen["control_ran"], seen["control_stderr"]
    # fdl-prepare's build of the same crate by cargo, through the flake: built, and the wrapper never ran.
    assert seen["rc"] == 0, seen["stderr"]
    assert seen["ran"] == "", f"the planted rustc-wrapper ran in the build: {seen['ran']}"
    said = seen["stdout"] + seen["stderr"]
    assert "is not where builds may run" in said and os.path.join(NIX_STATE_DIR, "builds") in said, said
    # What the sandbox being off still exposes is said.
    assert "Nix builds here without its sandbox (sandbox = false" in said, said


# -- never as root ----------------------------------------------------------------------------


@root_only
@pytest.mark.nix
def test_a_nix_that_would_build_as_root_is_permanent_before_any_build_naming_build_users_group(
    nix_env, test_flake, git_source, state_dir, monkeypatch
):
    # build-users-group empty: a root Nix runs the builder as root, and the
    # publisher's build line reads /etc/shadow (it must never get to).
    from nix_fixtures import build

    from prepare.spec import PrepareSpec, SourceSpec

    monkeypatch.setenv("NIX_CONFIG", NIX_CONFIG + "build-users-group =\n")
    marker = Path(tempfile.mkdtemp(prefix="fdl-as-root-", dir="/tmp"))
    marker.chmod(0o1777)
    line = f"head -c 1 /etc/shadow > /dev/null && id -u > {marker}/ran; printf '#!/bin/sh\\n' > train && chmod +x train"
    src = git_source(trainer(build=line, nonce=str(os.getpid()) + str(marker)))
    spec = PrepareSpec(
        source=SourceSpec(from_=src.url), libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=state_dir
    )
    try:
        with pytest.raises(Fail) as caught:
            build(spec, [])
        ran = (marker / "ran").read_text() if (marker / "ran").exists() else ""
    finally:
        shutil.rmtree(marker, ignore_errors=True)
    fail = caught.value
    assert fail.reason == "nix.builds-as-root" and fail.permanent, fail.message
    assert "build-users-group is empty" in fail.message and "build-users-group = nixbld" in fail.message
    assert ran == "", f"the build line ran, as uid {ran.strip()}"
