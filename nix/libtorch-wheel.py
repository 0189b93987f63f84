"""Builds a floDl-shaped libtorch from PyTorch's wheels (nix/libtorch-wheel.nix).

Run by the derivation's builder with the interpreter alone (`python3 -I -S`):
no site-packages, nothing but the standard library and, for a CUDA variant,
patchelf by absolute path. Everything it needs comes from the environment
the derivation sets: the outputs ($out, $dev, $cuda), the wheels, the label,
the versions and the declared arch list.

Outputs:
  out   lib/ (torch's shared libraries), nvidia/<pkg>/lib/ (a CUDA variant's
        libraries, laid out as the wheels have them), build-version, .arch;
        all a binary loads, and nothing it does not
  dev   include/ (torch's headers, the C++ API's under
        torch/csrc/api/include), share/cmake with its library paths at `out`
  cuda  (CUDA variants) a CUDA_HOME: include/ with every nvidia wheel's
        headers, lib64/ with each CUDA library under its soname and its link
        name, pointing into `out`
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from collections import Counter

FATBIN_MAGIC = 0xBA55ED50
ELF_KIND, PTX_KIND = 2, 1


# The variant's label, for messages; set first thing in main().
LABEL = ""


def fail(message: str) -> None:
    print(f"fdl-prepare flake: libtorch {LABEL}: {message}", file=sys.stderr)
    sys.exit(1)


def write(dest: str, source: zipfile.ZipFile, info: zipfile.ZipInfo, mode: int) -> None:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with source.open(info) as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.chmod(dest, mode)


def unpack_torch(wheel: str, out: str, dev: str) -> str:
    """torch/lib's libraries to out/lib, torch/include and torch/share/cmake
    to dev; returns torch/version.py's __version__."""
    version = ""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if name.endswith("/"):
                continue
            rest = name[len("torch/lib/") :]
            if name.startswith("torch/lib/") and "/" not in rest and ".so" in rest:
                write(f"{out}/lib/{rest}", z, info, 0o555)
            elif name.startswith("torch/include/"):
                write(f"{dev}/include/{name[len('torch/include/') :]}", z, info, 0o444)
            elif name.startswith("torch/share/cmake/"):
                write(f"{dev}/share/cmake/{name[len('torch/share/cmake/') :]}", z, info, 0o644)
            elif name == "torch/version.py":
                found = re.search(r"^__version__\s*=\s*'([^']+)'", z.read(info).decode(), re.M)
                version = found.group(1) if found else ""
    return version


def unpack_nvidia(wheel: str, out: str, cuda: str) -> None:
    """nvidia/<pkg>/lib's shared libraries to out/nvidia/<pkg>/lib (the
    layout their own RPATHs expect), every header to the CUDA_HOME's
    include/. Headers two wheels share are the same file; the first stays."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if info.filename.endswith("/") or len(parts) < 4 or parts[0] != "nvidia":
                continue
            if parts[2] == "lib" and len(parts) == 4 and ".so" in parts[3]:
                write(f"{out}/nvidia/{parts[1]}/lib/{parts[3]}", z, info, 0o555)
            elif parts[2] == "include" and not parts[-1].endswith(".py"):
                dest = f"{cuda}/include/{'/'.join(parts[3:])}"
                if not os.path.exists(dest):
                    write(dest, z, info, 0o444)


def sections(path: str) -> dict[str, tuple[int, int]]:
    """An ELF64 little-endian file's sections: name -> (offset, size)."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            fail(f"{path} is not a 64-bit little-endian ELF file")
        (shoff,) = struct.unpack_from("<Q", header, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", header, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        entries = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
        f.seek(entries[shstrndx][4])
        names = f.read(entries[shstrndx][5])
    found = {}
    for entry in entries:
        name = names[entry[0] : names.index(b"\0", entry[0])].decode()
        found[name] = (entry[4], entry[5])
    return found


def kernel_archs(path: str) -> list[str]:
    """The compute capabilities the library's fatbinary carries kernels for,
    as "M.m" (SASS) and "M.m+PTX" (PTX), read from its .nv_fatbin section.

    A few kernels are built for one extra arch (a sm_89-only kernel, say);
    an arch counts when it carries at least half as many kernels as the
    best-served one, which is what TORCH_CUDA_ARCH_LIST compiled for."""
    offset, size = sections(path).get(".nv_fatbin", (0, 0))
    if size == 0:
        fail(f"{os.path.basename(path)} has no .nv_fatbin section: not a CUDA build")
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    counts: Counter[tuple[int, int]] = Counter()
    pos = 0
    while pos + 16 <= len(data):
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        entry, end = pos + header_size, pos + header_size + fat_size
        while entry + 32 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            if kind in (ELF_KIND, PTX_KIND):
                counts[(kind, arch)] += 1
            if entry_header == 0:
                break
            entry += entry_header + payload
        pos = end
    if not counts:
        fail(f"{os.path.basename(path)}'s .nv_fatbin holds no kernels")
    most = max(counts.values())
    archs = []
    for (kind, arch), count in sorted(counts.items(), key=lambda item: (item[0][1], item[0][0])):
        if 2 * count >= most:
            name = f"{arch // 10}.{arch % 10}"
            archs.append(name + ("+PTX" if kind == PTX_KIND else ""))
    return archs


def check_archs(library: str, declared: list[str]) -> list[str]:
    """The archs `library` carries kernels for, which must be the declared
    ones: the runner decides coverage from the declaration alone."""
    found = kernel_archs(library)
    if found != declared:
        fail(
            f"libtorch_cuda.so carries kernels for {' '.join(found)}, and nix/wheels.nix declares "
            f"{' '.join(declared)} for it: set `archs` to what the wheel carries"
        )
    return found


def patch_rpaths(out: str, patchelf: str, driver_dir: str) -> None:
    """torch's libraries find the CUDA ones through $ORIGIN/../../nvidia/…
    (site-packages/torch/lib to site-packages/nvidia); here they sit in
    $out/lib and $out/nvidia, one level up. And every CUDA library gets the
    driver directory, where libcudart and c10_cuda dlopen libcuda.so.1 and
    libnvidia-ml.so.1 from: a dlopen searches the caller's own RPATH, not the
    program's. DT_RPATH is kept (--force-rpath): the wheels rely on it being
    inherited by what a library loads."""
    for top in [f"{out}/lib"] + sorted(
        f"{out}/nvidia/{p}/lib" for p in os.listdir(f"{out}/nvidia") if os.path.isdir(f"{out}/nvidia/{p}/lib")
    ):
        for name in sorted(os.listdir(top)):
            path = f"{top}/{name}"
            if os.path.islink(path) or ".so" not in name:
                continue
            with open(path, "rb") as f:
                if f.read(4) != b"\x7fELF":
                    continue
            old = subprocess.run([patchelf, "--print-rpath", path], check=True, capture_output=True, text=True)
            entries = [e for e in old.stdout.strip().split(":") if e]
            if top == f"{out}/lib":
                entries = [e.replace("$ORIGIN/../../", "$ORIGIN/../", 1) for e in entries]
            entries.append(driver_dir)
            os.chmod(path, 0o755)
            subprocess.run([patchelf, "--force-rpath", "--set-rpath", ":".join(entries), path], check=True)
            os.chmod(path, 0o555)


def link_lib64(out: str, cuda: str) -> None:
    """CUDA_HOME/lib64: each CUDA library under its soname (libcudart.so.12,
    what the binary loads) and its link name (libcudart.so, what -lcudart
    finds), both pointing into `out`, which the binary's RUNPATH names."""
    os.makedirs(f"{cuda}/lib64")
    for package in sorted(os.listdir(f"{out}/nvidia")):
        lib = f"{out}/nvidia/{package}/lib"
        for name in sorted(os.listdir(lib)) if os.path.isdir(lib) else []:
            found = re.fullmatch(r"(lib[^/]+\.so)\.\d+", name)
            if found:
                for link in (name, found.group(1)):
                    if not os.path.lexists(f"{cuda}/lib64/{link}"):
                        os.symlink(f"{lib}/{name}", f"{cuda}/lib64/{link}")


def main() -> None:
    env = os.environ
    out, dev, cuda = env["out"], env["dev"], env.get("cuda", "")
    global LABEL
    label, version, cuda_version = env["label"], env["version"], env["cudaVersion"]
    LABEL = label
    wheels = env["wheels"].split()
    torch_version = unpack_torch(wheels[0], out, dev)
    if torch_version != f"{version}+{label}":
        fail(
            f"{os.path.basename(wheels[0])} is torch {torch_version!r}, not {version}+{label}: fix its pin in nix/wheels.nix"
        )
    if not os.path.isfile(f"{dev}/include/torch/csrc/api/include/torch/torch.h") or not os.path.isfile(
        f"{out}/lib/libtorch_cpu.so"
    ):
        fail(f"{wheels[0]} holds no libtorch (torch/include, torch/lib)")
    for cmake, prefix in (
        ("Torch/TorchConfig.cmake", "${TORCH_INSTALL_PREFIX}/lib"),
        ("Caffe2/Caffe2Targets-release.cmake", "${_IMPORT_PREFIX}/lib"),
    ):
        path = f"{dev}/share/cmake/{cmake}"
        if os.path.isfile(path):
            with open(path) as f:
                text = f.read()
            with open(path, "w") as f:
                f.write(text.replace(prefix, f"{out}/lib"))

    if cuda_version == "none":
        archs = "cpu"
    else:
        for wheel in wheels[1:]:
            unpack_nvidia(wheel, out, cuda)
        for header in ("cuda_runtime.h", "nccl.h", "cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h"):
            if not os.path.isfile(f"{cuda}/include/{header}"):
                fail(f"no wheel brought {header}, which floDl's CUDA shim includes: add its nvidia wheel")
        archs = " ".join(check_archs(f"{out}/lib/libtorch_cuda.so", env["archs"].split()))
        patch_rpaths(out, env["patchelf"], env["driverDir"])
        link_lib64(out, cuda)

    with open(f"{out}/build-version", "w") as f:
        f.write(f"{version}+{label}\n")
    with open(f"{out}/.arch", "w") as f:
        f.write(f"cuda={cuda_version}\ntorch={version}\narchs={archs}\nsource=precompiled\nvariant={label}\n")


if __name__ == "__main__":
    main()
