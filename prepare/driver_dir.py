"""The driver directory: the host's NVIDIA libraries where Nix-built code looks.

A Nix-built program loads its libraries with Nix's own glibc, which never
reads the host's /etc/ld.so.cache: `libcuda.so.1` and `libnvidia-ml.so.1` in
/usr/lib/x86_64-linux-gnu are invisible to it. NixOS solves this with
/run/opengl-driver/lib, a directory of the driver's libraries that nixpkgs'
`addDriverRunpath` puts on the RUNPATH of everything that needs the driver
(`libtorch-bin` among them); Debian and Ubuntu have no such directory, so
the cu128 training binary built there cannot load `libcuda.so.1` (NixOS
issue nixpkgs#77834; numtide/nix-gl-host works around it per program).

So on a box that has NVIDIA cards and is not NixOS, every attempt makes
`driver_dir` (default /run/opengl-driver/lib, the path `addDriverRunpath`
uses) a directory of links to the host's NVIDIA libraries, found with the
host's own linker cache (`ldconfig -p`, the host's ldconfig by path, never
Nix's), and keeps it current: a driver upgrade changes the targets, a
library gone leaves a stale link, and /run is empty after a reboot. On
NixOS the system manages the directory and it is left alone.

Links point at the paths the linker cache names (`libcuda.so.1`, itself a
link to `libcuda.so.<version>`), so they stay valid across an upgrade that
keeps the names. The driver's user space must match the loaded kernel
module: a library of another version (an upgrade without a reboot) fails
every CUDA call, so it is refused here (permanent), naming both versions.

"Has NVIDIA cards" is /proc/driver/nvidia/version: the kernel module only
loads where it finds a card, and without it NVML says what is wrong. This
step is the only subprocess on the NVIDIA gate path (`ldconfig -p`, a few
milliseconds), and it runs only there.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from prepare import human, proc
from prepare.fail import Fail, permanent

DEFAULT = "/run/opengl-driver/lib"
KERNEL_VERSION = "/proc/driver/nvidia/version"
NVML = "libnvidia-ml.so.1"
CUDA = "libcuda.so.1"

# The host's ldconfig, by path: a Nix-built fdl-prepare has Nix's glibc,
# whose ldconfig reads Nix's cache, not the host's.
_LDCONFIG = ("/sbin/ldconfig", "/usr/sbin/ldconfig", "/bin/ldconfig", "/usr/bin/ldconfig")
_LDCONFIG_TIMEOUT_S = 20.0

# The driver's libraries: CUDA and its JIT and debugger, NVML and the other
# libnvidia-*, the video codecs, OptiX, and the GL/EGL/Vulkan vendor
# libraries (lib*_nvidia), as NixOS's driver directory has them.
_DRIVER_LIB = re.compile(
    r"(libcuda|libcudadebugger|libnvcuvid|libnvoptix|libnvidia-[\w.+-]+?|lib\w+_nvidia)\.so(\.\S+)?"
)
_KERNEL = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")
_LISTED = re.compile(r"^\s*(\S+) \(([^)]*)\) => (\S.*)$")
# The name of a link while it is made, before it is renamed into place.
_TMP = ".fdl-prepare-new."


@dataclass(frozen=True)
class Library:
    name: str  # as the linker cache lists it: libcuda.so.1
    path: str  # where it lists it


def is_nixos() -> bool:
    if os.path.exists("/etc/NIXOS"):
        return True
    try:
        with open("/etc/os-release", encoding="utf-8") as handle:
            return any(line.strip() in ("ID=nixos", 'ID="nixos"') for line in handle)
    except OSError:
        return False


def kernel_version() -> str | None:
    """The loaded NVIDIA kernel module's version; None when it is not loaded."""
    try:
        with open(KERNEL_VERSION, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    found = _KERNEL.search(text)
    return found.group(1) if found else ""


def ensure(directory: str, notes: list[str]) -> None:
    """Make `directory` the links the box's NVIDIA driver needs, when the box
    has NVIDIA cards and is not NixOS. Raises a permanent Fail when the
    libraries are missing or of another version than the kernel module, or
    the directory cannot be written."""
    kernel = kernel_version()
    if kernel is None or is_nixos():
        return
    if not os.path.isabs(directory):
        raise permanent(
            f"driver_dir = {directory!r} is not an absolute path: Nix-built programs look for the driver at a fixed "
            f"path. Leave it out for {DEFAULT} (where nixpkgs' addDriverRunpath looks), or give the absolute "
            "path your flake's programs were built for (--driver-dir)",
            reason="config.invalid",
        )
    libraries = _host_libraries(notes)
    if libraries is None:
        return
    _check_versions(libraries, kernel)
    _link(directory, libraries, kernel, notes)


def _host_libraries(notes: list[str]) -> list[Library] | None:
    """The NVIDIA libraries the host's linker cache lists for this machine,
    first listing of a name winning (the cache's own order); None when the
    host has no ldconfig to ask (a note says so)."""
    ldconfig = next((p for p in _LDCONFIG if os.path.exists(p)), None)
    if ldconfig is None:
        notes.append(
            "driver directory not kept: the host has no ldconfig (looked in "
            + ", ".join(_LDCONFIG)
            + "), so its NVIDIA libraries cannot be found for Nix-built programs"
        )
        return None
    try:
        done = proc.run(
            [ldconfig, "-p"], timeout=_LDCONFIG_TIMEOUT_S, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
        )
    except (proc.ExecFailed, proc.TimedOut) as err:
        notes.append(f"driver directory not kept: `{ldconfig} -p` failed ({err})")
        return None
    if not done.ok:
        notes.append(
            f"driver directory not kept: `{ldconfig} -p` exited {done.returncode}: {done.stderr.strip()[:200]}"
        )
        return None
    mine = _elf_kind("/proc/self/exe")
    found: dict[str, Library] = {}
    for line in done.stdout.splitlines():
        listed = _LISTED.match(line)
        if listed is None:
            continue
        name, path = listed.group(1), listed.group(3).strip()
        if name in found or not _DRIVER_LIB.fullmatch(name) or not os.path.exists(path):
            continue
        # A 64-bit box lists the 32-bit libraries too: only this
        # machine's kind of ELF can be loaded by its programs.
        if mine is not None and _elf_kind(path) != mine:
            continue
        found[name] = Library(name, path)
    return sorted(found.values(), key=lambda lib: lib.name)


def _elf_kind(path: str) -> tuple[int, int, int] | None:
    """(class, byte order, machine) of an ELF file; None when it is not one."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    order = "<" if head[5] == 1 else ">"
    (machine,) = struct.unpack(order + "H", head[18:20])
    return head[4], head[5], machine


def library_version(path: str) -> str | None:
    """The driver version a library file carries in its name
    (libcuda.so.570.86.15 -> 570.86.15), through the links to it."""
    real = os.path.basename(os.path.realpath(path))
    _, sep, version = real.partition(".so.")
    if not sep or not re.fullmatch(r"\d+(?:\.\d+)+", version):
        return None
    return version


def _check_versions(libraries: Sequence[Library], kernel: str) -> None:
    names = {lib.name: lib for lib in libraries}
    missing = [name for name in (NVML, CUDA) if name not in names]
    if missing:
        raise permanent(
            f"GPU gate: the NVIDIA kernel module {kernel or '(version unreadable)'} is loaded, but the host's linker "
            f"cache (`ldconfig -p`) lists no {' and no '.join(missing)}: the driver's user-space libraries are not "
            "installed, so no program can use the GPUs. Install them at the kernel module's version (Debian: "
            "`sudo apt install nvidia-driver libcuda1` from non-free; Ubuntu: `sudo apt install "
            "libnvidia-compute-<branch>`, with <branch> the module's), then `sudo ldconfig`; or, for a CPU-only "
            "worker, pass --cpu-only (cpu_only = true under [join]).",
            reason="gpu.no-driver",
        )
    if not kernel:
        return
    for name in (CUDA, NVML):
        version = library_version(names[name].path)
        if version is not None and version != kernel:
            raise permanent(
                f"GPU gate: driver/library version mismatch: the loaded NVIDIA kernel module is {kernel} "
                f"({KERNEL_VERSION}), but {name} is {version} ({names[name].path} -> "
                f"{os.path.realpath(names[name].path)}): every CUDA call would fail. A driver upgrade leaves this "
                "until the next boot: reboot (or reload the modules: `sudo rmmod nvidia_uvm nvidia_drm "
                "nvidia_modeset nvidia && sudo modprobe nvidia`); if it persists, the libraries and the module "
                "come from different packages: install both at one version.",
                reason="gpu.driver-mismatch",
            )


def _link(directory: str, libraries: Sequence[Library], kernel: str, notes: list[str]) -> None:
    """`directory` holding exactly one link per library, each to the path
    the linker cache lists. Links are replaced atomically (a run starting
    meanwhile sees the old link or the new one); anything there that is
    not a link is someone else's, and is left alone with a note."""
    wanted = {lib.name: lib.path for lib in libraries}
    created: list[str] = []
    updated: list[str] = []
    removed: list[str] = []
    try:
        os.makedirs(directory, exist_ok=True)
        present = sorted(os.listdir(directory))
        for name in present:
            path = os.path.join(directory, name)
            # Another attempt's link in the making is that attempt's.
            if name in wanted or _TMP in name or not os.path.islink(path):
                continue
            # Two attempts at once (a restart racing a manual run) may both
            # find the same stale link: gone is what both want.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            removed.append(name)
        for name, target in sorted(wanted.items()):
            path = os.path.join(directory, name)
            if os.path.islink(path):
                if os.readlink(path) == target:
                    continue
                updated.append(name)
            elif os.path.lexists(path):
                notes.append(f"driver directory: {path} is not a link; left alone (it is not fdl-prepare's)")
                continue
            else:
                created.append(name)
            _replace_link(target, path)
    except OSError as err:
        raise _unwritable(directory, err) from None
    if created or updated or removed:
        parts = [f"{len(created)} new"] if created else []
        parts += [f"{len(updated)} updated"] if updated else []
        parts += [f"{len(removed)} stale removed ({', '.join(removed)})"] if removed else []
        version = f" {kernel}" if kernel else ""
        notes.append(
            f"driver directory {directory}: links to the host's NVIDIA{version} libraries "
            f"({len(wanted)} in all: {', '.join(parts)}), where Nix-built programs look for the driver"
        )


def _replace_link(target: str, path: str) -> None:
    tmp = f"{path}{_TMP}{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _unwritable(directory: str, err: OSError) -> Fail:
    return permanent(
        f"GPU gate: the driver directory {directory} cannot be written ({human.oserror(err)}): Nix-built programs "
        "(the training binary, libtorch) find the host's NVIDIA driver only there on a box that is not NixOS. "
        f"Run fdl-prepare as root (the unit does), or create it once for this user (`sudo install -d -o $USER "
        f"{directory}`; /run is emptied at boot, so a systemd-tmpfiles line `d {directory} 0755 <user> - -` keeps "
        "it), or set driver_dir in [join] (--driver-dir) to the directory your flake's programs were built to "
        "look in.",
        reason="gpu.driver-dir-unwritable",
    )


def preload_nvml(directory: str) -> bool:
    """Load NVML from the driver directory into this process, so that
    pynvml's own load by name finds it (the loader matches an already
    loaded library by its soname): how a Nix-built fdl-prepare, whose
    loader ignores the host's cache, reaches the driver the same way a
    pip-installed one does. False when there is none there to load."""
    path = os.path.join(directory, NVML)
    if not os.path.exists(path):
        return False
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    return True
