"""AMD GPUs, surveyed from what the amdgpu kernel driver publishes.

The gate reads the box the way ROCm's own runtime does, and nothing more, so
it works where no ROCm user space is installed (a libtorch ROCm archive brings
its own runtime) and costs a few file reads and opens:

- the KFD topology, `/sys/class/kfd/kfd/topology/nodes/<n>/properties`: one
  `name value` line per property, as drivers/gpu/drm/amd/amdkfd/kfd_topology.c
  writes it (`cpu_cores_count`, `simd_count`, `gfx_target_version`,
  `vendor_id`, `device_id`, `location_id`, `domain`, `drm_render_minor`,
  `unique_id`, ...). A node with `simd_count` > 0 is a GPU (ROCm's thunk,
  libhsakmt, skips the others: CPU nodes, and an APU's iGPU the driver offers
  no compute on); `gfx_target_version` 90402 is the target gfx942 (major,
  minor, stepping as decimal pairs, printed in hex as LLVM names them).
- the DRM class, `/sys/class/drm/renderD<minor>/device/`: the board's VRAM
  (`mem_info_vram_total`) and, where its FRU EEPROM has one, `product_name`.
- `/dev/kfd` and `/dev/dri/renderD<minor>`, opened read-write and closed at
  once, as the runtime opens them: permission is proved by opening, never
  inferred from mode bits (root, ACLs, a device cgroup all disagree with them).

Every one of those reads and opens is made by the query child, under a
deadline (prepare.gpu.query): a sysfs read of a card in a bad state can block
for good. What it met is replayed here (`Recorded`) through the same code.

Numbering follows the runtime, so `devices`, ROCR_VISIBLE_DEVICES and the
run agree on what "GPU 2" is. libhsakmt walks the topology nodes in order
and drops a GPU node whose render node is absent (ENOENT: a container given
only some of /dev/dri) or refused by the device cgroup (EPERM); every other
failure to open one, EACCES included, aborts the whole topology, so no AMD
GPU is usable at all (ROCT-Thunk-Interface src/topology.c,
topology_sysfs_check_node_supported). ROCr then numbers the GPU nodes left
0, 1, ... in node order: that index is what ROCR_VISIBLE_DEVICES, `devices`
and `fdl-prepare gpus` use.

Masks, in order, each with its runtime's own rules:

1. ROCR_VISIBLE_DEVICES (ROCr, core/runtime/amd_filter_device.cpp): set and
   empty means no device; entries are trimmed and upper-cased; an entry
   starting with G is a UUID prefix (`GPU-` and 16 hex digits, from
   `unique_id`) that must match exactly one GPU; anything else is read with
   strtol(.., 0), so `0x1` is 1 and an empty entry is 0; only the first
   (number of GPUs) entries are read; an invalid, out-of-range or repeated
   entry stops parsing.
2. HIP_VISIBLE_DEVICES, or when it is unset or empty CUDA_VISIBLE_DEVICES
   (HIP reads either; CLR rocclr/device/rocm/rocdevice.cpp): indices into
   what ROCR_VISIBLE_DEVICES left, written exactly as decimal (`01` and ` 1`
   are invalid), or a `GPU-` UUID (a substring of one); the first invalid
   entry stops parsing, a repeat is skipped. An empty value hides nothing,
   unlike CUDA's.
3. `devices` (`--devices`), applied by the gate (prepare.gate.check).

HSA_OVERRIDE_GFX_VERSION (`11.0.0`) makes ROCr load kernels for that target
on every GPU: coverage is checked against it, and it is noted.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prepare.gpu.devices import cpu_only
from prepare.gpu.query import QUERY_TIMEOUT_S, Recorded
from prepare.notes import warning

TOPOLOGY = "/sys/class/kfd/kfd/topology/nodes"
DRM = "/sys/class/drm"
KFD = "/dev/kfd"
RENDER = "/dev/dri/renderD{minor}"

ROCR = "ROCR_VISIBLE_DEVICES"
HIP = "HIP_VISIBLE_DEVICES"
CUDA = "CUDA_VISIBLE_DEVICES"
OVERRIDE = "HSA_OVERRIDE_GFX_VERSION"


@dataclass(frozen=True)
class AmdDevice:
    # ROCr's enumeration index (what ROCR_VISIBLE_DEVICES and `devices`
    # take); None for a node the runtime drops (no render node here).
    index: int | None
    node: int  # the KFD topology node
    name: str | None  # the board's product_name, where it has one
    gfx: str | None  # the card's own target, from gfx_target_version
    target: str | None  # what ROCr loads kernels for: gfx, or HSA_OVERRIDE_GFX_VERSION
    unique_id: int | None
    pci: str | None  # domain:bus:device.function
    device_id: int | None
    render_minor: int | None
    memory_total: int | None  # bytes of VRAM
    usable: bool
    error: str | None  # why the device is unusable

    @property
    def uuid(self) -> str | None:
        """The UUID as HIP reports it (lower-case hex); ROCR_VISIBLE_DEVICES
        compares it case-insensitively, HIP_VISIBLE_DEVICES as written."""
        return None if not self.unique_id else f"GPU-{self.unique_id:016x}"

    @property
    def render_node(self) -> str | None:
        return None if self.render_minor is None else RENDER.format(minor=self.render_minor)

    def label(self) -> str:
        what = self.name or self.gfx or "target unknown"
        if self.index is None:
            return f"AMD KFD node {self.node} ({what})"
        return f"AMD GPU {self.index} ({what})"

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "node": self.node,
            "name": self.name,
            "gfx": self.gfx,
            "target": self.target,
            "uuid": self.uuid,
            "pci": self.pci,
            "device_id": None if self.device_id is None else f"0x{self.device_id:04x}",
            "render_node": self.render_node,
            "memory_total": self.memory_total,
            "usable": self.usable,
            "error": self.error,
        }


@dataclass(frozen=True)
class AmdGpus:
    # Every GPU node of the KFD topology, in node order.
    devices: tuple[AmdDevice, ...]
    # Usable devices left by ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES (or
    # CUDA_VISIBLE_DEVICES) and `devices`, in the order the run numbers them.
    offered: tuple[AmdDevice, ...]
    rocr_visible_devices: str | None = None
    # The value HIP filters with, and the variable it came from.
    hip_visible_devices: str | None = None
    hip_from: str | None = None
    # ROCr indices each mask leaves, in its order (None: not set).
    rocr_visible: tuple[int, ...] | None = None
    visible: tuple[int, ...] | None = None
    devices_mask: tuple[int, ...] | None = None
    gfx_override: str | None = None
    # Why the ROCm runtime cannot start on this box at all (/dev/kfd, or a
    # render node it may not open), with the fix; None when it can.
    blocked: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def offered_indices(self) -> tuple[int, ...]:
        return tuple(d.index for d in self.offered if d.index is not None)

    @property
    def runtime_count(self) -> int:
        """How many GPUs the runtime enumerates before any mask."""
        return sum(1 for d in self.devices if d.index is not None)

    def run_index(self, index: int | None) -> int | None:
        """The device number the run sees for ROCr index `index` (HIP's
        ordinal after the masks), or None when a mask hides it."""
        if index is None:
            return None
        order = self.visible if self.visible is not None else tuple(range(self.runtime_count))
        return order.index(index) if index in order else None

    def masked_by(self, index: int | None) -> str | None:
        """Which mask hides a device: ROCR_VISIBLE_DEVICES, the variable HIP
        read, "devices", or None."""
        if index is None:
            return None
        if self.rocr_visible is not None and index not in self.rocr_visible:
            return ROCR
        if self.visible is not None and index not in self.visible:
            return self.hip_from
        if self.devices_mask is not None and index not in self.devices_mask:
            return "devices"
        return None

    def with_devices(self, wanted: Sequence[int]) -> AmdGpus:
        """`devices` (--devices) applied: offered keeps the run's order."""
        kept = tuple(d for d in self.offered if d.index in wanted)
        return replace(self, offered=kept, devices_mask=tuple(wanted))

    def to_json(self) -> dict[str, Any]:
        offered = set(self.offered_indices)
        return {
            "rocr_visible_devices": self.rocr_visible_devices,
            "hip_visible_devices": self.hip_visible_devices,
            "hip_visible_devices_from": self.hip_from,
            "gfx_override": self.gfx_override,
            "devices_mask": None if self.devices_mask is None else list(self.devices_mask),
            "blocked": self.blocked,
            "devices": [
                {
                    **d.to_json(),
                    "run_index": self.run_index(d.index) if d.index in offered else None,
                    "offered": d.index in offered,
                    "masked_by": self.masked_by(d.index),
                }
                for d in self.devices
            ],
            "offered": list(self.offered_indices),
        }


def labels(devices: Sequence[AmdDevice]) -> str:
    """Cards for a message, those alike together: "AMD GPU 0, 1, 2
    (AMD Instinct MI300X OAM)" rather than the name eight times."""
    groups: dict[str, list[AmdDevice]] = {}
    for d in devices:
        groups.setdefault(d.name or d.gfx or "target unknown", []).append(d)
    parts = []
    for what, alike in groups.items():
        numbered = [str(d.index) for d in alike if d.index is not None]
        nodes = [str(d.node) for d in alike if d.index is None]
        if numbered:
            parts.append(f"AMD GPU {', '.join(numbered)} ({what})")
        if nodes:
            parts.append(f"AMD KFD node {', '.join(nodes)} ({what})")
    return ", ".join(parts)


def gfx_name(version: int) -> str | None:
    """gfx_target_version as LLVM names the target: 90402 -> gfx942,
    90010 -> gfx90a, 110000 -> gfx1100. 0 (a CPU node) has none."""
    if version <= 0:
        return None
    major, minor, stepping = version // 10000, (version // 100) % 100, version % 100
    if minor > 15 or stepping > 15:
        return None
    return f"gfx{major}{minor:x}{stepping:x}"


def parse_override(value: str | None) -> str | None:
    """HSA_OVERRIDE_GFX_VERSION ("major.minor.stepping", decimal) as a
    target name; None when unset or unreadable."""
    if value is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\.(\d+)\s*", value)
    if not match:
        return None
    major, minor, stepping = (int(g) for g in match.groups())
    return gfx_name(major * 10000 + minor * 100 + stepping)


def paths() -> dict[str, str]:
    """What the query child reads and opens (prepare.gpu._query)."""
    return {"topology": TOPOLOGY, "drm": DRM, "kfd": KFD, "render": RENDER}


def survey(
    env: Mapping[str, str] | None = None, *, files: Recorded | None = None, timeout: float = QUERY_TIMEOUT_S
) -> AmdGpus | None:
    """The AMD GPUs of this box after the masks in `env` (default: this
    process's environment). None when the amdgpu driver publishes no KFD
    topology: no AMD GPU to speak of. Every file is read, and every device
    opened, by the query child under a deadline (prepare.gpu.query): `files`
    is what it recorded, else it is asked here within `timeout` seconds. A
    node that cannot be read is noted, a device that cannot be used is
    marked unusable; only a driver that does not answer in time raises
    (gpu.query-timeout, transient)."""
    env = os.environ if env is None else env
    if files is None:
        from prepare.gpu import query

        answers = query.ask(amd=paths(), driver_dir=None, mig=False, timeout=timeout)
        files = Recorded((answers.amd or {}).get("ops") or {})
    try:
        entries = files.listdir(TOPOLOGY)
    except FileNotFoundError:
        return None
    except OSError as err:
        return AmdGpus(devices=(), offered=(), notes=(f"AMD: cannot list {TOPOLOGY}: {_why(err)}.",))

    notes: list[str] = []
    override_raw = env.get(OVERRIDE)
    override = parse_override(override_raw)
    if override_raw is not None and override is None:
        notes.append(
            f"{OVERRIDE}={override_raw!r} is not major.minor.stepping (e.g. '11.0.0'): "
            "fdl-prepare checks coverage against the cards' own targets."
        )
    found: list[tuple[int, dict[str, int]]] = []
    for node in sorted(int(e) for e in entries if e.isdigit()):
        props, why = _read_properties(files, node)
        if props is None:
            notes.append(f"AMD: KFD topology node {node} is skipped, as the ROCm runtime skips it: {why}.")
            continue
        if props.get("simd_count", 0) <= 0:
            gfx = gfx_name(props.get("gfx_target_version", 0))
            if gfx is not None or props.get("device_id", 0):
                notes.append(
                    f"AMD: KFD topology node {node} ({gfx or 'target unknown'}, device "
                    f"0x{props.get('device_id', 0):04x}) has simd_count 0: the amdgpu driver offers no compute "
                    "on it (an APU's iGPU that ROCm does not support), so it is not counted as a GPU."
                )
            continue
        found.append((node, props))

    devices, blocked, render_notes = _open_devices(files, found, override)
    notes.extend(render_notes)
    if override is not None and devices:
        notes.append(
            f"{OVERRIDE}={override_raw!r}: ROCm loads {override} kernels on every AMD GPU, and coverage is "
            "checked against that target."
        )

    # The runtime's GPUs, whose positions are their ROCr indices.
    runtime = [d for d in devices if d.index is not None]
    rocr_raw = env.get(ROCR)
    rocr_visible, rocr_notes = parse_rocr_visible_devices(rocr_raw, runtime)
    notes.extend(rocr_notes)
    after_rocr = list(runtime) if rocr_visible is None else [runtime[i] for i in rocr_visible]

    hip_raw: str | None = env.get(HIP)
    hip_from: str | None = HIP
    if not hip_raw:
        if hip_raw is not None and runtime:
            notes.append(
                f"{HIP} is set and empty: HIP ignores an empty value (unlike CUDA's empty "
                f"{CUDA}, which hides every card)."
            )
        hip_raw, hip_from = env.get(CUDA) or None, CUDA
        if hip_raw is not None and runtime:
            notes.append(
                f"HIP reads {CUDA}={hip_raw!r} for the AMD GPUs too, since {HIP} is unset or empty (set {HIP} "
                "to number them on their own)."
            )
    if hip_raw is None:
        hip_from = None
    chosen, hip_notes = parse_hip_visible_devices(hip_raw, hip_from or HIP, after_rocr)
    notes.extend(hip_notes)

    # HIP's positions are into what ROCR_VISIBLE_DEVICES left.
    rocr_order = tuple(range(len(runtime))) if rocr_visible is None else rocr_visible
    visible = rocr_visible if chosen is None else tuple(rocr_order[i] for i in chosen)
    offered = tuple(runtime[i] for i in (visible if visible is not None else rocr_order) if runtime[i].usable)

    hidden = [d for d in runtime if visible is not None and d.index not in visible]
    if hidden:
        masks = " then ".join(
            f"{name}={raw!r}" for name, raw in ((ROCR, rocr_raw), (hip_from, hip_raw)) if name and raw is not None
        )
        notes.append(f"{masks} hides {labels(hidden)}.")
    # A blocked runtime is the gate's failure, or its note where other
    # cards pass (prepare.gate.check); here it would only say it twice.
    if blocked is None:
        for d in devices:
            if not d.usable and d.index is not None:
                notes.append(warning(f"{d.label()} is unusable and will not be offered: {d.error}."))
    return AmdGpus(
        devices=tuple(devices),
        offered=offered,
        rocr_visible_devices=rocr_raw,
        hip_visible_devices=hip_raw,
        hip_from=hip_from,
        rocr_visible=rocr_visible,
        visible=visible,
        gfx_override=override,
        blocked=blocked,
        notes=tuple(notes),
    )


def _read_properties(files: Recorded, node: int) -> tuple[dict[str, int] | None, str]:
    path = f"{TOPOLOGY}/{node}/properties"
    try:
        text = files.read(path)
    except PermissionError as err:
        # kfd_topology.c answers EPERM for a GPU the device cgroup hides.
        return None, f"reading {path} was refused ({_why(err)}): the device cgroup hides this GPU"
    except OSError as err:
        return None, f"{path} cannot be read ({_why(err)})"
    props: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            props[parts[0]] = int(parts[1])
    return props, ""


def _open_devices(
    files: Recorded, found: Sequence[tuple[int, dict[str, int]]], override: str | None
) -> tuple[list[AmdDevice], str | None, list[str]]:
    """Each GPU node with its render node opened for real, then /dev/kfd:
    the devices (indices as the runtime assigns them), why the runtime
    cannot start (None when it can), and notes."""
    notes: list[str] = []
    devices: list[AmdDevice] = []
    blocked: str | None = None
    index = 0
    for node, props in found:
        minor = props.get("drm_render_minor") or None
        gfx = gfx_name(props.get("gfx_target_version", 0))
        device = AmdDevice(
            index=None,
            node=node,
            name=_read_drm(files, minor, "product_name"),
            gfx=gfx,
            target=override or gfx,
            unique_id=props.get("unique_id") or None,
            pci=_pci(props),
            device_id=props.get("device_id") or None,
            render_minor=minor,
            memory_total=_int_or_none(_read_drm(files, minor, "mem_info_vram_total")),
            usable=True,
            error=None,
        )
        if minor is None:
            devices.append(
                replace(device, usable=False, error=f"KFD topology node {node} publishes no drm_render_minor")
            )
            continue
        render = RENDER.format(minor=minor)
        err = files.try_open(render)
        if err is not None and err.errno in (errno.ENOENT, errno.EPERM):
            # libhsakmt drops the node and numbers the GPUs after it down.
            missing = _render_missing(files, render, minor, err)
            devices.append(replace(device, usable=False, error=missing))
            notes.append(f"AMD: {device.label()} is not seen by the ROCm runtime: {missing}.")
            continue
        device = replace(device, index=index)
        index += 1
        if err is not None:
            device = replace(device, usable=False, error=f"{render} cannot be opened ({_why(err)}{_owner(render)})")
            if blocked is None:
                blocked = _blocked(render, err)
        devices.append(device)

    if any(d.index is not None for d in devices):
        err = files.try_open(KFD)
        if err is not None:
            blocked = _blocked(KFD, err)
            short = f"the ROCm runtime cannot open {KFD} ({_why(err)})"
            devices = [d if d.index is None else replace(d, usable=False, error=d.error or short) for d in devices]
    if blocked is not None:
        # libhsakmt aborts its whole topology at a render node it may not
        # open: the other GPUs are lost with it.
        short = "the ROCm runtime cannot start: " + next(d.error for d in devices if d.error and d.index is not None)
        devices = [d if d.index is None or d.error else replace(d, usable=False, error=short) for d in devices]
    return devices, blocked, notes


def _blocked(path: str, err: OSError) -> str:
    """Why the ROCm runtime cannot start on this box, with the fix."""
    user, login = _user()
    if err.errno == errno.EACCES:
        what = "/dev/kfd" if path == KFD else "a render node"
        return (
            f"this user ({user}) cannot open {path} ({_why(err)}{_owner(path)}): the ROCm runtime needs "
            f"read-write access to /dev/kfd and to every GPU's render node /dev/dri/renderD*, and with {what} "
            "refused no AMD GPU is usable. `ls -l /dev/kfd /dev/dri/renderD*` shows the owning group, usually "
            f"render (Debian 11+, Ubuntu 20.04+) or video: `sudo usermod -aG render,video {login}`, then log in "
            "again (a systemd unit: SupplementaryGroups=render video); in a container pass the devices and "
            f"groups in (--device=/dev/kfd --device=/dev/dri --group-add render --group-add video), {cpu_only()}"
        )
    if err.errno == errno.ENOENT:
        return (
            f"{path} does not exist although the amdgpu driver publishes GPUs in {TOPOLOGY}: the ROCm "
            "runtime cannot start without it. In a container pass it in (--device=/dev/kfd --device=/dev/dri); "
            f"on the host udev creates it (`ls -l /dev/kfd`, `sudo udevadm trigger`), {cpu_only()}"
        )
    if err.errno == errno.EPERM:
        return (
            f"the device cgroup refuses {path} ({_why(err)}): a container started without "
            "--device=/dev/kfd --device=/dev/dri, or a systemd unit with DevicePolicy=closed or strict "
            f"(allow it: DeviceAllow=/dev/kfd rw and DeviceAllow=char-drm rw), {cpu_only()}"
        )
    return (
        f"{path} cannot be opened ({_why(err)}): the ROCm runtime cannot start. `sudo dmesg | grep -i amdgpu` "
        f"shows the driver's view (a GPU reset in progress answers EAGAIN until it is done), {cpu_only()}"
    )


def _render_missing(files: Recorded, render: str, minor: int, err: OSError) -> str:
    if err.errno == errno.EPERM:
        return f"the device cgroup refuses {render} ({_why(err)})"
    if files.exists(f"{DRM}/renderD{minor}"):
        return (
            f"the kernel made renderD{minor} ({DRM}/renderD{minor}) but this /dev has no {render}: in a "
            "container pass it in (--device=/dev/dri)"
        )
    return f"there is no {render} and the kernel publishes no renderD{minor}"


def _read_drm(files: Recorded, minor: int | None, name: str) -> str | None:
    if minor is None:
        return None
    try:
        value = files.read(f"{DRM}/renderD{minor}/device/{name}").strip()
    except OSError:
        return None
    return value or None


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def _pci(props: Mapping[str, int]) -> str | None:
    """location_id is the PCI bus/device/function (pci_dev_id: bus << 8 |
    devfn); `domain` is the PCI domain."""
    location = props.get("location_id")
    if not location:
        return None
    bus, devfn = location >> 8, location & 0xFF
    return f"{props.get('domain', 0):04x}:{bus:02x}:{devfn >> 3:02x}.{devfn & 7}"


def _why(err: OSError) -> str:
    name = errno.errorcode.get(err.errno or 0, str(err.errno))
    return f"{name}: {err.strerror or err}"


def _owner(path: str) -> str:
    """`; crw-rw---- root:render` for a message, or nothing."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    import grp
    import pwd

    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"; {stat.filemode(st.st_mode)} {owner}:{group}"


def _user() -> tuple[str, str]:
    """This user for a message, and for a command line."""
    import pwd

    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}", "<the worker's user>"
    return f"{name}, uid {uid}", name


def parse_rocr_visible_devices(
    value: str | None, devices: Sequence[AmdDevice]
) -> tuple[tuple[int, ...] | None, list[str]]:
    """ROCR_VISIBLE_DEVICES as ROCr reads it: positions into `devices` (the
    GPUs the runtime enumerates, in ROCr order) in the variable's order, or
    None when it is unset; and notes on what was ignored."""
    if value is None:
        return None, []
    notes: list[str] = []
    if value == "":
        notes.append(f"{ROCR} is set and empty: ROCm sees no AMD GPU.")
        return (), notes
    tokens = value.split(",")
    if len(tokens) > 1 and tokens[-1] == "":
        tokens.pop()  # getline yields no token after a trailing comma
    if len(tokens) > len(devices):
        notes.append(
            f"{ROCR}={value!r} has {len(tokens)} entries and this box {len(devices)} AMD GPU(s): as in ROCm, "
            f"only the first {len(devices)} are read."
        )
    chosen: list[int] = []
    uuids = [f"GPU-{d.unique_id:016X}" if d.unique_id else "" for d in devices]
    for raw in tokens[: len(devices)]:
        token = raw.upper().strip()
        position, why = _rocr_entry(token, uuids)
        if position is not None and position in chosen:
            position, why = None, f"it repeats GPU {position}"
        if position is None:
            if token == "-1" and not chosen:
                notes.append(f"{ROCR}={value!r}: ROCm sees no AMD GPU.")
            else:
                notes.append(
                    f"{ROCR}={value!r}: parsing stops at {raw!r} ({why}); as in ROCm, it and every entry "
                    "after it are ignored."
                )
            break
        if token == "":
            notes.append(f"{ROCR}={value!r}: the empty entry reads as GPU 0, as ROCm's parser (strtol) reads it.")
        chosen.append(position)
    return tuple(chosen), notes


def _rocr_entry(token: str, uuids: Sequence[str]) -> tuple[int | None, str]:
    if token.startswith("G"):
        if not 5 <= len(token) <= 20:
            return None, "a UUID entry is GPU- and up to 16 hex digits"
        matches = [i for i, uuid in enumerate(uuids) if uuid and uuid.startswith(token)]
        if len(matches) == 1:
            return matches[0], ""
        if not matches:
            return None, "no AMD GPU has a UUID starting with it"
        return None, "it is ambiguous, matching " + ", ".join(f"GPU {i}" for i in matches) + ": give more of it"
    number = _strtol0(token)
    if number is None:
        return None, "not an index or a GPU- UUID"
    if not 0 <= number < len(uuids):
        return None, f"there is no AMD GPU {number} on this box of {len(uuids)}"
    return number, ""


def _strtol0(token: str) -> int | None:
    """strtol(token, &end, 0) with *end required to be the terminator:
    decimal, 0x hex, 0 octal; an empty token reads as 0."""
    match = re.fullmatch(r"([+-]?)(0[X][0-9A-F]+|0[0-7]*|[1-9][0-9]*)?", token)
    if match is None:
        return None
    sign, digits = match.groups()
    if digits is None:
        return 0 if sign == "" else None
    number = int(digits, 16) if digits.startswith("0X") else int(digits, 8) if digits.startswith("0") else int(digits)
    return -number if sign == "-" else number


def parse_hip_visible_devices(
    value: str | None, name: str, devices: Sequence[AmdDevice]
) -> tuple[tuple[int, ...] | None, list[str]]:
    """HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES, `name` says which) as
    HIP reads it: positions into `devices` (what ROCR_VISIBLE_DEVICES left)
    in the variable's order, or None when it filters nothing."""
    if not value:
        return None, []
    notes: list[str] = []
    entries = value.split(",")
    if len(entries) > 1 and entries[-1] == "":
        entries.pop()  # the parser stops at the end of the string
    chosen: list[int] = []
    for entry in entries:
        text = entry
        if "GPU-" in text:
            # HIP takes the first GPU whose UUID contains the entry.
            for i, d in enumerate(devices):
                if text in (d.uuid or "GPU-XX"):
                    text = str(i)
                    break
        if re.fullmatch(r"0|[1-9][0-9]*", text) is None or int(text) >= len(devices):
            why = (
                "no AMD GPU's UUID contains it"
                if "GPU-" in entry
                else f"HIP numbers the {len(devices)} AMD GPU(s) {ROCR} leaves from 0"
                if text.isdigit() and not text.startswith("0")
                else "not a plain decimal index or a GPU- UUID"
            )
            notes.append(
                f"{name}={value!r}: HIP stops at {entry!r} ({why}); as in HIP, it and every entry after it are ignored."
            )
            break
        position = int(text)
        if position in chosen:
            notes.append(f"{name}={value!r}: {entry!r} repeats a GPU already listed; HIP skips it.")
            continue
        chosen.append(position)
    return tuple(chosen), notes
