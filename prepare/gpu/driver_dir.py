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
import errno
import json
import os
import re
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from prepare.fail import Fail
from prepare.gpu.devices import cpu_only
from prepare.host import human, proc
from prepare.host.state import write_at
from prepare.notes import warning
from prepare.spec import DRIVER_DIR

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
# The links fdl-prepare made in the directory, with their targets: the only
# entries it ever replaces or removes there.
MANIFEST = ".fdl-prepare-links.json"


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


def ensure(directory: str, notes: list[str], *, change: bool = True) -> str | None:
    """Make `directory` the links the box's NVIDIA driver needs, when the box
    has NVIDIA cards and is not NixOS. Raises a permanent Fail when the
    libraries are missing or of another version than the kernel module, or
    the directory cannot be written. `change` False: the same judgement of
    the libraries and of the directory, and a note of what an attempt would
    link, with nothing linked or made (`fdl-prepare check`, `fdl-prepare
    gpus`); the host's NVML is then returned from where the linker cache
    lists it, for the survey to load as the attempt would have it from the
    directory (prepare.gpu.query); otherwise None."""
    kernel = kernel_version()
    if kernel is None or is_nixos():
        return None
    libraries = _host_libraries(notes)
    if libraries is None:
        return None
    _check_versions(libraries, kernel)
    if change:
        _link(directory, libraries, kernel, notes)
        return None
    return _preview(directory, libraries, notes)


def _host_libraries(notes: list[str]) -> list[Library] | None:
    """The NVIDIA libraries the host's linker cache lists for this machine,
    first listing of a name winning (the cache's own order); None when the
    host has no ldconfig to ask (a note says so)."""
    ldconfig = next((p for p in _LDCONFIG if os.path.exists(p)), None)
    if ldconfig is None:
        notes.append(
            warning(
                "driver directory not kept: the host has no ldconfig (looked in "
                + ", ".join(_LDCONFIG)
                + "), so its NVIDIA libraries cannot be found for Nix-built programs"
            )
        )
        return None
    try:
        done = proc.run(
            [ldconfig, "-p"], timeout=_LDCONFIG_TIMEOUT_S, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
        )
    except (proc.ExecFailed, proc.TimedOut) as err:
        notes.append(warning(f"driver directory not kept: `{ldconfig} -p` failed ({err})"))
        return None
    if not done.ok:
        notes.append(
            warning(f"driver directory not kept: `{ldconfig} -p` exited {done.returncode}: {done.stderr.strip()[:200]}")
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
        raise Fail(
            "gpu.no-driver",
            f"GPU gate: the NVIDIA kernel module {kernel or '(version unreadable)'} is loaded, but the host's linker "
            f"cache (`ldconfig -p`) lists no {' and no '.join(missing)}: the driver's user-space libraries are not "
            "installed, so no program can use the GPUs. Install them at the kernel module's version (Debian: "
            "`sudo apt install nvidia-driver libcuda1` from non-free; Ubuntu: `sudo apt install "
            f"libnvidia-compute-<branch>`, with <branch> the module's), then `sudo ldconfig`; {cpu_only()}.",
        )
    if not kernel:
        return
    for name in (CUDA, NVML):
        version = library_version(names[name].path)
        if version is not None and version != kernel:
            raise Fail(
                "gpu.driver-mismatch",
                f"GPU gate: driver/library version mismatch: the loaded NVIDIA kernel module is {kernel} "
                f"({KERNEL_VERSION}), but {name} is {version} ({names[name].path} -> "
                f"{os.path.realpath(names[name].path)}): every CUDA call would fail. A driver upgrade leaves this "
                "until the next boot: reboot (or reload the modules: `sudo rmmod nvidia_uvm nvidia_drm "
                "nvidia_modeset nvidia && sudo modprobe nvidia`); if it persists, the libraries and the module "
                "come from different packages: install both at one version.",
            )


def _link(directory: str, libraries: Sequence[Library], kernel: str, notes: list[str]) -> None:
    """`directory` holding one link per library, each to the path the
    linker cache lists. Links are replaced atomically (a run starting
    meanwhile sees the old link or the new one). Only fdl-prepare's own
    links are ever replaced or removed: those it recorded in MANIFEST when
    it made them, still pointing where it made them point. Anything else
    there is someone else's, and is left alone with a note."""
    wanted = {lib.name: lib.path for lib in libraries}
    created: list[str] = []
    updated: list[str] = []
    removed: list[str] = []
    theirs: list[str] = []
    try:
        fd = _open_directory(directory, libraries)
    except OSError as err:
        raise _unwritable(directory, err) from None
    try:
        ours = _read_manifest(fd)
        mine = dict(ours)
        for name in sorted(os.listdir(fd)):
            # Another attempt's link in the making is that attempt's.
            if name in wanted or _TMP in name or name == MANIFEST:
                continue
            recorded = ours.get(name)
            if recorded is not None and _readlink(fd, name) == recorded:
                # Two attempts at once (a restart racing a manual run) may
                # both find the same stale link: gone is what both want.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
                removed.append(name)
            mine.pop(name, None)
        for name, target in sorted(wanted.items()):
            found = _readlink(fd, name)
            if found == target:
                # Already what fdl-prepare makes: its own from now on.
                mine[name] = target
                continue
            if found is not None and ours.get(name) == found:
                updated.append(name)
            elif found is None and not _exists(fd, name):
                created.append(name)
            else:
                theirs.append(name)
                mine.pop(name, None)
                continue
            _replace_link(fd, target, name)
            mine[name] = target
        if mine != ours:
            write_at(fd, MANIFEST, (json.dumps(mine, indent=1, sort_keys=True) + "\n").encode())
    except OSError as err:
        raise _unwritable(directory, err) from None
    finally:
        os.close(fd)
    for name in theirs:
        notes.append(
            warning(
                f"driver directory: {os.path.join(directory, name)} is not a link fdl-prepare made; left alone (remove "
                "it if it should be, and the next attempt links it)"
            )
        )
    if created or updated or removed:
        parts = [f"{len(created)} new"] if created else []
        parts += [f"{len(updated)} updated"] if updated else []
        parts += [f"{len(removed)} stale removed ({', '.join(removed)})"] if removed else []
        version = f" {kernel}" if kernel else ""
        notes.append(
            f"driver directory {directory}: links to the host's NVIDIA{version} libraries "
            f"({len(wanted)} in all: {', '.join(parts)}), where Nix-built programs look for the driver"
        )


def _not_the_hosts(directory: str, libraries: Sequence[Library]) -> str:
    """`directory`, normalised, refused when it is where the host's own
    libraries are: its links are the system's, never fdl-prepare's."""
    path = os.path.normpath(directory)
    hosts = {os.path.dirname(lib.path) for lib in libraries} | {
        os.path.dirname(os.path.realpath(lib.path)) for lib in libraries
    }
    if path in hosts:
        raise _refused(
            directory,
            "is where the host's own libraries are (the linker cache lists its NVIDIA libraries there)",
            f"leave driver_dir out for {DRIVER_DIR}, or point it at a directory that holds nothing but these links",
        )
    return path


def _preview(directory: str, libraries: Sequence[Library], notes: list[str]) -> str | None:
    """What `_link` would do to `directory`, said in a note, after the same
    judgement of every directory on the way; nothing is made or linked. The
    directory (or, while it is missing, the nearest one on its way) must
    take a probe link, made and removed at once."""
    path = _not_the_hosts(directory, libraries)
    current, missing = "/", ""
    parts = [p for p in path.split("/") if p]
    for index, part in enumerate(parts):
        here = os.path.join(current, part)
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            missing = here
            break
        _judge(directory, here, st, index == len(parts) - 1)
        current = here
    wanted = {lib.name: lib.path for lib in libraries}
    try:
        _probe_link(current)
    except OSError as err:
        raise _unwritable(directory, err) from None
    if missing:
        notes.append(
            f"driver directory {directory}: an attempt would make it (from {missing}) and link the host's "
            f"{len(wanted)} NVIDIA libraries there, where Nix-built programs look for the driver"
        )
    else:
        stale = [name for name, target in wanted.items() if _readlink_at(os.path.join(path, name)) != target]
        if stale:
            notes.append(
                f"driver directory {directory}: an attempt would link {len(stale)} of the host's {len(wanted)} "
                f"NVIDIA libraries there anew ({', '.join(sorted(stale)[:4])}{', ...' if len(stale) > 4 else ''})"
            )
    if _readlink_at(os.path.join(path, NVML)) != wanted.get(NVML):
        return _host_nvml(wanted[NVML])
    return None


def _probe_link(directory: str) -> None:
    """Prove `directory` takes a link: one made under a name of ours and
    removed at once."""
    name = os.path.join(directory, f"{_TMP}probe.{os.getpid()}.{os.urandom(4).hex()}")
    os.symlink("/nonexistent", name)
    os.unlink(name)


def _readlink_at(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _host_nvml(path: str) -> str:
    """The host's NVML for the survey to load (by the path its linker cache
    lists, trusted as the directory's would be), so the survey of a check
    finds what an attempt's finds through the directory it links."""
    from prepare.host import trust

    found = trust.doubt(path)
    if found is not None:
        raise Fail(
            "gpu.driver-dir-untrusted",
            f"GPU gate: NVML would be loaded from {path}, which the host's linker cache lists, but {found.path} "
            f"{found.why}: whoever could change it could run code as this process. Fix: {found.fix}",
        )
    return path


def _readlink(fd: int, name: str) -> str | None:
    try:
        return os.readlink(name, dir_fd=fd)
    except OSError:
        return None


def _exists(fd: int, name: str) -> bool:
    try:
        os.lstat(name, dir_fd=fd)
    except FileNotFoundError:
        return False
    return True


def _read_manifest(fd: int) -> dict[str, str]:
    """The links fdl-prepare made here, by name, with their targets; {}
    for a missing, unreadable or malformed record (then nothing is ours)."""
    try:
        record = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return {}
    try:
        with os.fdopen(record, "rb") as handle:
            data = json.loads(handle.read(1 << 20))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and "/" not in k}


def _refused(directory: str, why: str, fix: str) -> Fail:
    return Fail(
        "gpu.driver-dir-untrusted",
        f"GPU gate: the driver directory {directory} (driver_dir, --driver-dir) {why}. fdl-prepare writes and removes "
        f"links there as root, and every Nix-built program loads the driver from it, so it must be a real "
        f"directory of fdl-prepare's own, owned by root and writable by nobody else, reached through no symlink. "
        f"Fix: {fix}",
    )


def _open_directory(directory: str, libraries: Sequence[Library]) -> int:
    """An fd on `directory`, reached from / one directory at a time without
    following a symlink and made where missing (0755), each directory on the
    way held to what `prepare.host.trust` asks of a config's (owned by root or
    this user, writable by nobody else unless sticky), and the directory
    itself owned by this user (root, as the units run it) and writable by
    nobody else. A directory the linker cache lists libraries in (a shared
    library directory) is never one: its links are the system's."""
    path = _not_the_hosts(directory, libraries)
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    current = "/"
    parts = [p for p in path.split("/") if p]
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            current = os.path.join(current, part)
            try:
                st = os.lstat(part, dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=fd)
                st = os.lstat(part, dir_fd=fd)
            _judge(directory, current, st, last)
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refused(
                        directory, f"leads through {current}, which changed while it was opened", "retry"
                    ) from None
                raise
            os.close(fd)
            fd = child
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                raise _refused(directory, f"leads through {current}, which changed while it was opened", "retry")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _judge(directory: str, current: str, st: os.stat_result, last: bool) -> None:
    """Refuse (permanent) a directory on the way that could send root's
    links elsewhere, or the driver directory itself when it is not one
    fdl-prepare may keep."""
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(current)
        raise _refused(
            directory,
            f"{'is' if last else 'leads through'} a symlink ({current} -> {target})",
            f"set driver_dir to the real directory (`realpath {directory}`) if it is meant for these links, or "
            f"remove the link (`sudo rm {current}`) so that fdl-prepare makes the directory",
        )
    if not stat.S_ISDIR(st.st_mode):
        what = "a file" if stat.S_ISREG(st.st_mode) else "not a directory"
        raise _refused(
            directory,
            f"{'is' if last else 'leads through'} {current}, which is {what}",
            f"remove it (`sudo rm {current}`) if nothing needs it, or set driver_dir to another directory",
        )
    owner_ok = st.st_uid in (0, me)
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if not owner_ok:
        raise _refused(
            directory,
            f"{'is' if last else 'leads through'} {current}, owned by uid {st.st_uid}, not {human.user()}",
            f"`sudo chown root: {current}`, or set driver_dir to a directory of root's",
        )
    if writable and (last or not st.st_mode & stat.S_ISVTX):
        raise _refused(
            directory,
            f"{'is' if last else 'leads through'} {current}, which others may write (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): they could swap libcuda.so.1 between the gate and the run",
            f"`sudo chmod go-w {current}`",
        )


def _replace_link(fd: int, target: str, name: str) -> None:
    tmp = f"{name}{_TMP}{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=fd)
    os.symlink(target, tmp, dir_fd=fd)
    try:
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=fd)
        raise


def _unwritable(directory: str, err: OSError) -> Fail:
    return Fail(
        "gpu.driver-dir-unwritable",
        f"GPU gate: the driver directory {directory} cannot be written ({human.oserror(err)}): Nix-built programs "
        "(the training binary, libtorch) find the host's NVIDIA driver only there on a box that is not NixOS. "
        f"Run fdl-prepare as root (the unit does), or create it once for this user (`sudo install -d -o $USER "
        f"{directory}`; /run is emptied at boot, so a systemd-tmpfiles line `d {directory} 0755 <user> - -` keeps "
        "it), or set driver_dir in [join] (--driver-dir) to the directory your flake's programs were built to "
        "look in.",
    )


def nvml_in(directory: str) -> tuple[str | None, Fail | None]:
    """NVML in the driver directory, for the GPU query to load when the
    loader finds none (prepare.gpu.query): how a Nix-built fdl-prepare, whose
    loader ignores the host's cache, reaches the driver the same way a
    pip-installed one does. Its path (None: there is none there), and the
    Fail loading it would be: it is loaded into a process of root's, so only
    from where nobody else could have put it (on NixOS the directory is a
    link into the store). The query raises that Fail only if it needs the
    library."""
    path = os.path.join(directory, NVML)
    if not os.path.exists(path):
        return None, None
    from prepare.host import trust

    found = trust.doubt(path)
    if found is None:
        return path, None
    return path, Fail(
        "gpu.driver-dir-untrusted",
        f"GPU gate: NVML would be loaded from the driver directory {directory} (driver_dir, --driver-dir), but "
        f"{found.path} {found.why}: whoever could change it could run code as this process. Fix: {found.fix}",
    )
