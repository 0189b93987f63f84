"""The driver directory on a box that is not NixOS: links to the host's NVIDIA
libraries, found with the host's real `ldconfig -p`, where Nix-built
programs look for the driver (tests/driver_fixtures.py: a test library
directory registered in a linker cache of the test's own, a loaded kernel
module's version file, all in a private mount namespace). The machine's own
linker cache and /run/opengl-driver/lib are never touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from driver_fixtures import DriverHost
from nvml_fixtures import FakeGpu, host_has_nvml, no_driver_env

from prepare.fail import Fail
from prepare.gpu import driver_dir
from prepare.spec import PrepareSpec

DEFAULT = "/run/opengl-driver/lib"
REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534


def links_to(host: DriverHost, where: Path | None = None) -> dict[str, str]:
    lib = where or host.lib_dir
    return {name: str(lib / name) for name in ("libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1")}


def test_the_hosts_nvidia_libraries_are_linked_where_nix_built_programs_look(driver_host):
    driver_host.install("570.86.15")
    got = driver_host.ensure(DEFAULT)
    assert got["links"] == links_to(driver_host)
    assert got["notes"] == [
        f"driver directory {DEFAULT}: links to the host's NVIDIA 570.86.15 libraries (3 in all: 3 new), where "
        "Nix-built programs look for the driver"
    ]


def test_an_attempt_with_nothing_changed_changes_nothing_and_says_nothing(driver_host, tmp_path):
    driver_host.install()
    where = tmp_path / "driver"
    first = driver_host.ensure(where)
    again = driver_host.ensure(where)
    assert again == {"notes": [], "links": first["links"]}


def test_a_library_the_linker_cache_now_finds_elsewhere_gets_its_link_updated(driver_host, tmp_path):
    driver_host.install("570.86.15")
    where = tmp_path / "driver"
    driver_host.ensure(where)
    moved = driver_host.root / "nvidia" / "current"
    driver_host.install("570.86.15", into=moved)
    got = driver_host.ensure(where)
    assert got["links"] == links_to(driver_host, moved)
    assert "3 updated" in got["notes"][0]


def test_a_link_whose_library_is_gone_is_removed_and_one_fdl_prepare_did_not_make_left_alone(driver_host, tmp_path):
    driver_host.install()
    where = tmp_path / "driver"
    where.mkdir()
    (where / "README").write_text("someone's own file\n")
    driver_host.ensure(where)
    # Someone's own link, with a driver library's name: not fdl-prepare's.
    (where / "libnvidia-tls.so.535.104.05").symlink_to("/usr/lib/x86_64-linux-gnu/libnvidia-tls.so.535.104.05")
    driver_host.remove("ptxjit")
    got = driver_host.ensure(where)
    assert set(got["links"]) == {"libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-tls.so.535.104.05"}
    assert "1 stale removed (libnvidia-ptxjitcompiler.so.1)" in got["notes"][0]
    assert (where / "README").read_text() == "someone's own file\n"
    assert (where / "libnvidia-tls.so.535.104.05").is_symlink()


def test_only_links_fdl_prepare_recorded_and_left_as_it_made_them_are_ever_replaced_or_removed(driver_host, tmp_path):
    driver_host.install()
    where = tmp_path / "driver"
    driver_host.ensure(where)
    recorded = json.loads((where / driver_dir.MANIFEST).read_text())
    assert recorded == links_to(driver_host)
    # Someone repoints one of them, and puts a link of their own under a
    # name the driver uses: fdl-prepare takes neither back.
    (where / "libcuda.so.1").unlink()
    (where / "libcuda.so.1").symlink_to("/opt/vendor/libcuda.so.1")
    (where / "libnvidia-ml.so.1").unlink()
    (where / "libnvidia-ml.so.1").symlink_to("/opt/vendor/libnvidia-ml.so.1")
    driver_host.remove("cuda")
    driver_host.install(libs=("cuda",))
    got = driver_host.ensure(where)
    assert os.readlink(where / "libcuda.so.1") == "/opt/vendor/libcuda.so.1"
    assert os.readlink(where / "libnvidia-ml.so.1") == "/opt/vendor/libnvidia-ml.so.1"
    notes = " ".join(got["notes"])
    assert f"{where / 'libcuda.so.1'} is not a link fdl-prepare made; left alone" in notes


def test_a_file_in_the_way_of_a_link_is_left_alone_with_a_note(driver_host, tmp_path):
    driver_host.install()
    where = tmp_path / "driver"
    where.mkdir()
    (where / "libcuda.so.1").write_bytes(b"a copy someone put here")
    got = driver_host.ensure(where)
    assert (where / "libcuda.so.1").read_bytes() == b"a copy someone put here"
    assert f"driver directory: {where / 'libcuda.so.1'} is not a link fdl-prepare made; left alone" in " ".join(
        got["notes"]
    )


def _system_library_dir(root: Path) -> dict[str, str]:
    """A shared library directory as a distribution lays one out: soname
    links to versioned files, and a file that is no library."""
    lib = root / "system-lib"
    lib.mkdir()
    for name in ("libssl.so.3", "libz.so.1"):
        (lib / f"{name}.0.0").write_bytes(b"\x7fELF")
        (lib / name).symlink_to(f"{name}.0.0")
    (lib / "libc.so").write_text("/* GNU ld script */\n")
    return {p.name: os.readlink(p) if p.is_symlink() else p.read_text(errors="replace") for p in lib.iterdir()}


def _layout(lib: Path) -> dict[str, str]:
    return {p.name: os.readlink(p) if p.is_symlink() else p.read_text(errors="replace") for p in lib.iterdir()}


def test_a_driver_directory_that_is_a_symlink_to_a_shared_library_directory_is_permanent_and_touches_nothing(
    driver_host, tmp_path
):
    driver_host.install()
    before = _system_library_dir(tmp_path)
    (tmp_path / "opengl-driver").mkdir()
    (tmp_path / "opengl-driver" / "lib").symlink_to(tmp_path / "system-lib")
    fail = driver_host.ensure(tmp_path / "opengl-driver" / "lib")["fail"]
    assert fail["kind"] == "permanent" and fail["reason"] == "gpu.driver-dir-untrusted"
    assert "is a symlink" in fail["message"] and "realpath" in fail["message"]
    assert _layout(tmp_path / "system-lib") == before


def test_a_driver_directory_reached_through_a_symlink_is_permanent(driver_host, tmp_path):
    driver_host.install()
    (tmp_path / "real").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "real")
    fail = driver_host.ensure(tmp_path / "run" / "opengl-driver" / "lib")["fail"]
    assert fail["kind"] == "permanent" and fail["reason"] == "gpu.driver-dir-untrusted"
    assert f"leads through a symlink ({tmp_path / 'run'} -> " in fail["message"]
    assert not (tmp_path / "real" / "opengl-driver").exists()


def test_the_hosts_own_library_directory_as_the_driver_directory_is_permanent_and_touches_nothing(driver_host):
    driver_host.install()
    before = _layout(driver_host.lib_dir)
    fail = driver_host.ensure(driver_host.lib_dir)["fail"]
    assert fail["kind"] == "permanent" and fail["reason"] == "gpu.driver-dir-untrusted"
    assert "is where the host's own libraries are" in fail["message"]
    assert _layout(driver_host.lib_dir) == before


@pytest.mark.parametrize("how", ["writable by others", "owned by another user"])
def test_a_driver_directory_others_could_change_is_permanent_naming_the_fix(driver_host, tmp_path, how):
    driver_host.install()
    where = tmp_path / "driver"
    where.mkdir()
    if how == "writable by others":
        where.chmod(0o777)
    else:
        os.chown(where, NOBODY, NOBODY)
    fail = driver_host.ensure(where)["fail"]
    assert fail["kind"] == "permanent" and fail["reason"] == "gpu.driver-dir-untrusted"
    fix = "sudo chmod go-w" if how == "writable by others" else "sudo chown root:"
    assert fix in fail["message"] and "driver_dir" in fail["message"]
    assert not list(where.iterdir())


def test_a_plain_file_at_the_driver_directory_is_permanent_and_does_not_say_run_as_root(driver_host, tmp_path):
    driver_host.install()
    where = tmp_path / "driver"
    where.write_text("not a directory\n")
    fail = driver_host.ensure(where)["fail"]
    assert fail["kind"] == "permanent" and fail["reason"] == "gpu.driver-dir-untrusted"
    assert "which is a file" in fail["message"] and f"sudo rm {where}" in fail["message"]
    assert "as root" not in fail["message"].split("Fix:")[1]
    assert where.read_text() == "not a directory\n"


def test_driver_libraries_of_another_version_than_the_kernel_module_are_permanent_naming_both(driver_host, tmp_path):
    driver_host.install("570.86.15")
    got = driver_host.ensure(tmp_path / "driver", kernel="575.51.02")
    fail = got["fail"]
    assert fail["kind"] == "permanent" and fail["reason"] == "gpu.driver-mismatch"
    assert "the loaded NVIDIA kernel module is 575.51.02" in fail["message"]
    assert "libcuda.so.1 is 570.86.15" in fail["message"]
    assert str(driver_host.lib_dir / "libcuda.so.570.86.15") in fail["message"]
    assert "reboot" in fail["message"]
    assert not (tmp_path / "driver").exists()


def test_a_kernel_module_without_libcuda_in_the_linker_cache_is_permanent(driver_host, tmp_path):
    driver_host.install(libs=("ml", "ptxjit"))
    fail = driver_host.ensure(tmp_path / "driver")["fail"]
    assert fail["kind"] == "permanent" and fail["reason"] == "gpu.no-driver"
    assert "lists no libcuda.so.1" in fail["message"] and "570.86.15" in fail["message"]
    assert "--cpu-only" in fail["message"]


def test_on_nixos_the_system_keeps_the_directory(driver_host):
    driver_host.install()
    assert driver_host.ensure(DEFAULT, nixos=True) == {"notes": [], "links": None}


def test_a_box_without_the_nvidia_kernel_module_gets_no_directory(driver_host):
    driver_host.install()
    assert driver_host.ensure(DEFAULT, kernel=None) == {"notes": [], "links": None}


def test_a_location_this_user_cannot_write_is_a_clear_permanent_fail(driver_host):
    driver_host.install()
    got = driver_host.ensure(DEFAULT, uid=NOBODY)
    fail = got["fail"]
    assert fail["kind"] == "permanent" and fail["reason"] == "gpu.driver-dir-unwritable"
    message = fail["message"]
    assert f"the driver directory {DEFAULT} cannot be written" in message and "Permission denied" in message
    assert "as root" in message and f"sudo install -d -o $USER {DEFAULT}" in message
    assert "driver_dir" in message and "--driver-dir" in message


def test_a_current_directory_needs_no_write_from_a_user_who_could_not_make_it(driver_host, tmp_path):
    driver_host.install()
    where = driver_host.root / "driver"
    assert "links" in driver_host.ensure(where)
    assert driver_host.ensure(where, uid=NOBODY) == {"notes": [], "links": links_to(driver_host)}


@pytest.mark.parametrize("value", ["run/opengl-driver/lib", "~/driver"])
def test_a_relative_driver_dir_is_refused_naming_the_field(value):
    # By the plan, before the gate, on any box: the path Nix-built programs
    # look in is fixed, and a relative one names none.
    from prepare.plan import plan

    with pytest.raises(Fail) as caught:
        plan(PrepareSpec(driver_dir=value))
    assert caught.value.reason == "config.invalid" and f'PrepareSpec.driver_dir = "{value}"' in caught.value.message


def test_the_gate_keeps_the_directory_then_surveys_nvml(driver_host, fake_nvml, tmp_path):
    driver_host.install()
    box = fake_nvml.box([FakeGpu()])
    env = box.env(no_driver_env())
    env["LD_LIBRARY_PATH"] = ""  # NVML comes from the (test's) linker cache, as on a real box
    where = tmp_path / "driver"
    code = (
        "import json\n"
        "from prepare.gpu import gate\n"
        "from prepare.spec import PrepareSpec\n"
        "notes = []\n"
        f"gpus = gate.check(gate.GatePlan(driver_dir={str(where)!r}), notes)\n"
        "print(json.dumps({'offered': list(gpus.offered_indices), 'notes': notes}))\n"
    )
    done = driver_host.run(code, env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["offered"] == [0]
    assert any(n.startswith(f"driver directory {where}:") for n in got["notes"])
    assert os.readlink(where / "libnvidia-ml.so.1") == str(driver_host.lib_dir / "libnvidia-ml.so.1")


def test_nvml_is_found_in_the_driver_directory_when_the_loader_finds_none(fake_nvml, tmp_path):
    """A Nix-built fdl-prepare's loader never reads the host's linker cache:
    with NVML nowhere it looks, the gate takes it from the driver directory."""
    if host_has_nvml():
        pytest.skip("this host has a real libnvidia-ml.so.1 on the default search path")
    box = fake_nvml.box([FakeGpu(), FakeGpu()])
    env = box.env(no_driver_env())
    env["LD_LIBRARY_PATH"] = ""
    where = tmp_path / "driver"
    where.mkdir()
    code = (
        "import json, sys\n"
        "from prepare.gpu import gate\n"
        "from prepare.fail import Fail\n"
        "try:\n"
        "    print(json.dumps(list(gate.survey(driver_dir=sys.argv[1]).offered_indices)))\n"
        "except Fail as f:\n"
        "    print(json.dumps(f.reason))\n"
    )

    def survey() -> object:
        done = subprocess.run(
            [sys.executable, "-c", code, str(where)], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    assert survey() == "gpu.no-driver"
    (where / "libnvidia-ml.so.1").symlink_to(fake_nvml.library)
    assert survey() == [0, 1]
    # Loaded into a root process: never from where others could swap it.
    where.chmod(0o777)
    assert survey() == "gpu.driver-dir-untrusted"


def test_a_library_version_is_read_through_its_links(tmp_path):
    real = tmp_path / "libcuda.so.570.86.15"
    real.write_bytes(b"")
    (tmp_path / "libcuda.so.1").symlink_to(real.name)
    assert driver_dir.library_version(str(tmp_path / "libcuda.so.1")) == "570.86.15"
    (tmp_path / "libnvidia-ml.so.1").write_bytes(b"")
    assert driver_dir.library_version(str(tmp_path / "libnvidia-ml.so.1")) is None


def test_a_link_another_attempt_is_making_is_left_to_it(driver_host, tmp_path):
    driver_host.install()
    where = tmp_path / "driver"
    where.mkdir()
    making = where / "libcuda.so.1.fdl-prepare-new.99999"
    making.symlink_to(driver_host.lib_dir / "libcuda.so.1")
    got = driver_host.ensure(where)
    assert making.is_symlink()
    assert "stale" not in got["notes"][0]


def test_a_check_of_the_gate_judges_the_directory_says_what_it_would_link_and_links_nothing(
    driver_host, fake_nvml, tmp_path
):
    driver_host.install("570.86.15")
    box = fake_nvml.box([FakeGpu()])
    env = box.env(no_driver_env())
    env["LD_LIBRARY_PATH"] = ""
    where = tmp_path / "run" / "driver"
    code = (
        "import json, os\n"
        "from prepare.gpu import gate\n"
        "notes = []\n"
        f"gpus = gate.check(gate.GatePlan(driver_dir={str(where)!r}), notes, change=False)\n"
        f"d = {str(where)!r}\n"
        "links = {n: os.readlink(os.path.join(d, n)) for n in sorted(os.listdir(d)) if os.path.islink(os.path.join(d, n))} if os.path.isdir(d) else None\n"
        "print(json.dumps({'offered': list(gpus.offered_indices), 'notes': notes, 'links': links}))\n"
    )

    def gated() -> dict:
        done = driver_host.run(code, env=env)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    got = gated()
    assert got["offered"] == [0] and got["links"] is None and not (tmp_path / "run").exists()
    assert (
        f"driver directory {where}: an attempt would make it (from {tmp_path / 'run'}) and link the host's 3 NVIDIA "
        "libraries there, where Nix-built programs look for the driver"
    ) in got["notes"]
    # Once an attempt made it, a driver that moved: the links would be made anew, and are not.
    made = driver_host.ensure(where, env=env)["links"]
    driver_host.install("570.86.15", into=driver_host.root / "nvidia" / "current")
    got = gated()
    assert got["links"] == made
    assert any(n.startswith(f"driver directory {where}: an attempt would link 3 of the host's 3") for n in got["notes"])
