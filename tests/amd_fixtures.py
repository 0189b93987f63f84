"""Fake AMD boxes, put where the product reads a real one: the KFD topology
and DRM class the amdgpu driver publishes, bind-mounted over /sys/class/kfd
and /sys/class/drm, and /dev/kfd and /dev/dri/renderD* as real device nodes,
in a private mount namespace of a child process. prepare/gpu/amd.py has no
test-only switch: the child imports the package and reads the same paths it
reads on a real box.

Shapes. drivers/gpu/drm/amd/amdkfd/kfd_topology.c (node_show) writes each
topology node's `properties` as one `name value` line per property, values
in decimal, in this order: cpu_cores_count, simd_count, mem_banks_count,
caches_count, io_links_count, p2p_links_count, cpu_core_id_base,
simd_id_base, max_waves_per_simd, lds_size_in_kb, gds_size_in_kb, num_gws,
wave_front_size, array_count, simd_arrays_per_engine, cu_per_simd_array,
simd_per_cu, max_slots_scratch_cu, gfx_target_version, vendor_id,
device_id, location_id, domain, drm_render_minor, hive_id,
num_sdma_engines, num_sdma_xgmi_engines, num_sdma_queues_per_engine,
num_cp_queues, then for a node with a KFD device only
max_engine_clk_fcompute, local_mem_size (always 0 now), fw_version,
capability, debug_prop, sdma_fw_version, unique_id, num_xcc, and last
max_engine_clk_ccompute. A node without a KFD device prints simd_count 0.
Beside `properties` are `gpu_id` (0 for a CPU node) and `name`, and the
topology has `generation_id` and `system_properties`. On the DRM side
/sys/class/drm/renderD<minor>/device is the PCI device, where amdgpu
publishes mem_info_vram_total and, on boards with a FRU EEPROM,
product_name. Device nodes are crw-rw---- root:render (video where there
is no render group), char devices 226:<minor> and a dynamic major for kfd;
here they are char devices with /dev/null's numbers (1:3), so opening one
succeeds exactly where the permission allows it (a plain file where mknod
is refused).

Boxes (the values that matter are those these boards report: target
versions, PCI ids, SIMD counts, VRAM as rocm-smi shows it; bus addresses,
unique ids, clocks and firmware versions are made up):

- `mi300x()`: a two-socket server with eight AMD Instinct MI300X: CPU nodes
  0 and 1, GPU nodes 2-9, gfx_target_version 90402 (gfx942), vendor_id 4098
  (0x1002), device_id 29857 (0x74a1), simd_count 1216 (304 CUs of 4 SIMDs,
  over num_xcc 8), mem_info_vram_total 205822885888, render minors 128-135.
- `rx7900xtx()`: a desktop with one Radeon RX 7900 XTX: CPU node 0, GPU
  node 1, gfx_target_version 110000 (gfx1100), device_id 29772 (0x744c),
  simd_count 192 (96 CUs of 2), wave_front_size 32, mem_info_vram_total
  25753026560, no product_name.
- `apu()`: a Ryzen box whose iGPU ROCm does not support: CPU node 0, and
  node 1 for the iGPU with simd_count 0 (no KFD device), gfx_target_version
  90012 (gfx90c), device_id 5688 (0x1638); its render node exists (it
  drives the display) and is not linked from the topology.

API (root only; the fixture skips elsewhere):

`amd_box` (function) -> `(nodes, **kw) -> AmdBox`, written under tmp_path.
Keywords: kfd_mode / render_mode (default 0o660), render_modes
({minor: mode}), no_kfd, no_render (minors whose /dev node is missing, still
published in /sys/class/drm), extra_render (render minors no topology node
links, as a display-only GPU has).
    .run(code, env=None, uid=None) -> CompletedProcess: `python -c code`
        in a private mount namespace holding this box, as root or as `uid`
        (no groups, the readable package copy of tests/other_user.py).
    .gate(env=None, uid=None, **spec) -> dict: gate.check(gate.GatePlan(**spec))
        there: {"gpus": Gpus.to_json(), "notes": [...]} or
        {"kind": ..., "reason": ..., "message": ..., "notes": [...]}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

VENDOR_AMD = 0x1002


@dataclass(frozen=True)
class KfdNode:
    gpu_id: int = 0
    name: str = ""
    cpu_cores_count: int = 0
    simd_count: int = 0
    gfx_target_version: int = 0
    vendor_id: int = 0
    device_id: int = 0
    location_id: int = 0
    domain: int = 0
    drm_render_minor: int = 0
    hive_id: int = 0
    unique_id: int = 0
    num_xcc: int = 1
    wave_front_size: int = 64
    simd_per_cu: int = 4
    lds_size_in_kb: int = 64
    # Published under /sys/class/drm/renderD<minor>/device/.
    vram: int | None = None
    product_name: str | None = None
    # A GPU node has a KFD device: the GPU-only properties are printed.
    has_device: bool = False

    def properties(self) -> str:
        rows: list[tuple[str, int]] = [
            ("cpu_cores_count", self.cpu_cores_count),
            ("simd_count", self.simd_count if self.has_device else 0),
            ("mem_banks_count", 1),
            ("caches_count", 0 if self.has_device else 3),
            ("io_links_count", 1 if self.cpu_cores_count else 2),
            ("p2p_links_count", 0),
            ("cpu_core_id_base", 0),
            ("simd_id_base", 2147487744 if self.has_device else 0),
            ("max_waves_per_simd", 8 if self.has_device else 0),
            ("lds_size_in_kb", self.lds_size_in_kb if self.has_device else 0),
            ("gds_size_in_kb", 0),
            ("num_gws", 64 if self.has_device else 0),
            ("wave_front_size", self.wave_front_size if self.has_device else 0),
            ("array_count", 4 * self.num_xcc if self.has_device else 0),
            ("simd_arrays_per_engine", 1 if self.has_device else 0),
            ("cu_per_simd_array", 10 if self.has_device else 0),
            ("simd_per_cu", self.simd_per_cu if self.has_device else 0),
            ("max_slots_scratch_cu", 32 if self.has_device else 0),
            ("gfx_target_version", self.gfx_target_version),
            ("vendor_id", self.vendor_id),
            ("device_id", self.device_id),
            ("location_id", self.location_id),
            ("domain", self.domain),
            ("drm_render_minor", self.drm_render_minor),
            ("hive_id", self.hive_id),
            ("num_sdma_engines", 2 if self.has_device else 0),
            ("num_sdma_xgmi_engines", 14 if self.hive_id else 0),
            ("num_sdma_queues_per_engine", 8 if self.has_device else 0),
            ("num_cp_queues", 24 if self.has_device else 0),
        ]
        if self.has_device:
            rows += [
                ("max_engine_clk_fcompute", 2100),
                ("local_mem_size", 0),
                ("fw_version", 177),
                ("capability", 746586752),
                ("debug_prop", 1495),
                ("sdma_fw_version", 19),
                ("unique_id", self.unique_id),
                ("num_xcc", self.num_xcc),
            ]
        rows.append(("max_engine_clk_ccompute", 3700))
        return "".join(f"{key} {value}\n" for key, value in rows)


def cpu_node(cores: int = 96) -> KfdNode:
    return KfdNode(cpu_cores_count=cores)


# Where the eight OAMs sit on a two-socket MI300X board (bus numbers).
MI300X_BUSES = (0x05, 0x26, 0x46, 0x65, 0x85, 0xA6, 0xC6, 0xE5)
MI300X_UNIQUE = 0x3A1F9C0E5B7D2400


def mi300x() -> list[KfdNode]:
    gpus = [
        KfdNode(
            gpu_id=10000 + 1111 * i,
            name="ip discovery",
            simd_count=1216,
            gfx_target_version=90402,
            vendor_id=VENDOR_AMD,
            device_id=0x74A1,
            location_id=bus << 8,
            drm_render_minor=128 + i,
            hive_id=0x5C1A_4B7E_0C3D_9F21,
            unique_id=MI300X_UNIQUE + 0x11 * i,
            num_xcc=8,
            vram=205822885888,
            product_name="AMD Instinct MI300X OAM",
            has_device=True,
        )
        for i, bus in enumerate(MI300X_BUSES)
    ]
    return [cpu_node(), cpu_node(), *gpus]


def mi300x_uuid(i: int) -> str:
    return f"GPU-{MI300X_UNIQUE + 0x11 * i:016x}"


def rx7900xtx_gpu(minor: int = 128, bus: int = 0x03, unique_id: int = 0x0F2C8E41A9D35B70) -> KfdNode:
    return KfdNode(
        gpu_id=46531 + minor,
        name="ip discovery",
        simd_count=192,
        gfx_target_version=110000,
        vendor_id=VENDOR_AMD,
        device_id=0x744C,
        location_id=bus << 8,
        drm_render_minor=minor,
        unique_id=unique_id,
        wave_front_size=32,
        simd_per_cu=2,
        lds_size_in_kb=64,
        vram=25753026560,
        has_device=True,
    )


def rx7900xtx() -> list[KfdNode]:
    return [cpu_node(16), rx7900xtx_gpu()]


def apu() -> list[KfdNode]:
    igpu = KfdNode(
        name="",
        gfx_target_version=90012,
        vendor_id=VENDOR_AMD,
        device_id=0x1638,
        location_id=0x0300,
        simd_count=0,
    )
    return [cpu_node(16), igpu]


def _render_group() -> int:
    import grp

    for name in ("render", "video"):
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            continue
    return 0


@dataclass
class AmdBox:
    root: Path
    python_for: Callable[[int], str]
    readable_root: Callable[[], str]
    devices: list[dict[str, object]] = field(default_factory=list)

    def run(
        self, code: str, env: Mapping[str, str] | None = None, uid: int | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        spec = {
            "code": code,
            "env": dict(env if env is not None else _clean_env()),
            "uid": uid,
            "python": self.python_for(uid) if uid is not None else sys.executable,
            "pythonpath": self.readable_root() if uid is not None else None,
            "devices": self.devices,
        }
        (self.root / "run.json").write_text(json.dumps(spec))
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, __file__, str(self.root)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )

    def gate(self, env: Mapping[str, str] | None = None, uid: int | None = None, **spec: object) -> dict:
        code = (
            "import json\n"
            "from prepare.gpu import gate\n"
            "from prepare.fail import Fail\n"
            "from prepare.spec import PrepareSpec\n"
            "notes = []\n"
            "try:\n"
            f"    gpus = gate.check(gate.GatePlan(**{spec!r}), notes)\n"
            "    print(json.dumps({'gpus': gpus.to_json(), 'notes': notes}))\n"
            "except Fail as f:\n"
            "    print(json.dumps({'kind': f.kind, 'reason': f.reason, 'message': f.message, 'notes': notes}))\n"
        )
        done = self.run(code, env, uid)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


def _clean_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment without NVML and without any mask from outside."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = ""
    for name in (
        "FAKE_NVML_CONFIG",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "ROCR_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "HSA_OVERRIDE_GFX_VERSION",
    ):
        env.pop(name, None)
    return env


clean_env = _clean_env


def write_box(
    root: Path,
    nodes: Sequence[KfdNode],
    *,
    kfd_mode: int = 0o660,
    render_mode: int = 0o660,
    render_modes: Mapping[int, int] | None = None,
    no_kfd: bool = False,
    no_render: Sequence[int] = (),
    extra_render: Sequence[int] = (),
) -> list[dict[str, object]]:
    """The sysfs trees under root/sys, and the device nodes to make (the
    child makes them, in its own /dev)."""
    topology = root / "sys" / "kfd" / "kfd" / "topology"
    (topology / "nodes").mkdir(parents=True)
    (topology / "generation_id").write_text(f"{len(nodes)}\n")
    (topology / "system_properties").write_text("platform_oem 0\nplatform_id 0\nplatform_rev 0\n")
    drm = root / "sys" / "drm"
    drm.mkdir(parents=True)
    group = _render_group()
    devices: list[dict[str, object]] = []
    if not no_kfd:
        devices.append({"path": "kfd", "mode": kfd_mode, "gid": group})
    minors = []
    for number, node in enumerate(nodes):
        where = topology / "nodes" / str(number)
        for sub in ("mem_banks", "caches", "io_links", "p2p_links", "perf"):
            (where / sub).mkdir(parents=True)
        (where / "gpu_id").write_text(f"{node.gpu_id}\n")
        (where / "name").write_text(f"{node.name}\n")
        (where / "properties").write_text(node.properties())
        if node.drm_render_minor:
            minors.append((node.drm_render_minor, node))
    for minor in extra_render:
        minors.append((minor, KfdNode()))
    for card, (minor, node) in enumerate(minors):
        device = drm / f"renderD{minor}" / "device"
        device.mkdir(parents=True)
        (drm / f"renderD{minor}" / "dev").write_text(f"226:{minor}\n")
        (drm / f"card{card}").mkdir()
        (drm / f"card{card}" / "dev").write_text(f"226:{card}\n")
        (device / "vendor").write_text(f"0x{node.vendor_id or VENDOR_AMD:04x}\n")
        (device / "device").write_text(f"0x{node.device_id:04x}\n")
        if node.vram is not None:
            (device / "mem_info_vram_total").write_text(f"{node.vram}\n")
        if node.product_name is not None:
            (device / "product_name").write_text(f"{node.product_name}\n")
        if minor not in no_render:
            mode = (render_modes or {}).get(minor, render_mode)
            devices.append({"path": f"dri/renderD{minor}", "mode": mode, "gid": group})
            devices.append({"path": f"dri/card{card}", "mode": 0o660, "gid": _render_group()})
    for path in (root / "sys").rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o444)
    return devices


@pytest.fixture
def amd_box(tmp_path: Path) -> Callable[..., AmdBox]:
    if os.geteuid() != 0:
        pytest.skip("a private mount namespace with bind mounts needs root")
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("unshare and mount (util-linux) are needed for the fake AMD box")
    import other_user

    made = iter(range(1000))

    def make(nodes: Sequence[KfdNode], **kw: object) -> AmdBox:
        root = tmp_path / f"amd{next(made)}"
        devices = write_box(root, nodes, **kw)  # type: ignore[arg-type]
        return AmdBox(root, other_user.python_for, other_user.readable_package_root, devices)

    return make


# -- the child, in its private mount namespace -------------------------------------


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(f"fake AMD box: mount {' '.join(args)} failed: {done.stderr}")
        sys.exit(97)


def _enter(root: Path) -> int:
    spec = json.loads((root / "run.json").read_text())
    # /sys/class/kfd and /sys/class/drm, over the real ones where they exist;
    # elsewhere a tmpfs over /sys/class (this namespace only) holds the
    # mountpoints, since sysfs takes no mkdir.
    targets = [("/sys/class/kfd", root / "sys" / "kfd"), ("/sys/class/drm", root / "sys" / "drm")]
    if not all(os.path.isdir(target) for target, _ in targets):
        _mount("-t", "tmpfs", "-o", "mode=755", "tmpfs", "/sys/class")
        for target, _ in targets:
            os.mkdir(target)
    for target, source in targets:
        _mount("--bind", str(source), target)

    # A /dev of this box's own: the real essentials bound in, then kfd and
    # the render nodes.
    stage = root / "dev"
    stage.mkdir(exist_ok=True)
    _mount("-t", "tmpfs", "-o", "mode=755", "tmpfs", str(stage))
    for name in ("null", "zero", "full", "random", "urandom", "tty"):
        if os.path.exists(f"/dev/{name}"):
            (stage / name).touch()
            _mount("--bind", f"/dev/{name}", str(stage / name))
    for name in ("shm", "pts"):
        if os.path.isdir(f"/dev/{name}"):
            (stage / name).mkdir()
            _mount("--rbind", f"/dev/{name}", str(stage / name))
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1")):
        os.symlink(target, stage / name)
    os.symlink("/proc/self/fd/2", stage / "stderr")
    # A bound /dev/ptmx finds no devpts beside it; the link does (root only:
    # pts/ptmx is mode 000), for the pseudoterminal a Nix build opens for
    # its builder ("opening pseudoterminal master" without it).
    if os.path.isdir("/dev/pts"):
        os.symlink("pts/ptmx", stage / "ptmx")
    for device in spec["devices"]:
        path = stage / str(device["path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mknod(path, 0o600 | 0o020000, os.makedev(1, 3))
        except OSError:
            path.touch()
        os.chown(path, 0, int(device["gid"]))
        os.chmod(path, int(device["mode"]))
    _mount("--move", str(stage), "/dev")

    env = spec["env"]
    if spec["uid"] is None:
        done = subprocess.run([spec["python"], "-c", spec["code"]], env=env, capture_output=True, text=True, cwd=REPO)
    else:
        uid = int(spec["uid"])
        env = {**env, "PATH": env.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": spec["pythonpath"]}
        done = subprocess.run(
            [spec["python"], "-c", spec["code"]],
            env=env, user=uid, group=uid, extra_groups=[], cwd="/",
            capture_output=True, text=True,
        )  # fmt: skip
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(_enter(Path(sys.argv[1])))
