"""A host NVIDIA driver as the driver directory step meets one: its libraries
in a library directory registered with the host's real `ldconfig`, a loaded
kernel module's /proc/driver/nvidia/version, and the box's os-release, put
where prepare/gpu/driver_dir.py reads them, in a private mount namespace of a
child process. prepare/gpu/driver_dir.py has no test-only switch: the child
imports the package and runs the host's own `ldconfig -p`.

The library directory is registered honestly, without touching the
machine's linker cache: `ldconfig -X -C <cache> -f <conf>` builds a cache of
this test's own from the system's configuration plus the test directory
(-X: no links made anywhere, the test lays out its own, as a driver package
ships them), and the child binds it over /etc/ld.so.cache. A tmpfs over
/proc/driver holds the kernel module's version file, and one over /run keeps
the default driver directory (/run/opengl-driver/lib) inside the namespace.

Libraries, compiled once per session with gcc: `libcuda.so.<version>` (soname
libcuda.so.1; `cuInit` answers 0), `libnvidia-ptxjitcompiler.so.<version>`
(a stand-in with soname libnvidia-ptxjitcompiler.so.1) and
`libnvidia-ml.so.<version>`, the fake NVML of tests/fake_nvml (soname
libnvidia-ml.so.1), each with its soname link beside it. The libcuda stand-in
and the smoke binary use no libc at all, so the binary's only dependency is
libcuda.so.1.

`smoke_binary(compiled, driver_dir, out)` (`compiled` from the session
fixture `driver_libraries`, which needs only gcc): a program that,
like a Nix-built one, looks for libcuda.so.1 only in `driver_dir`: RUNPATH
`driver_dir` (gcc -Wl,-rpath) and DF_1_NODEFLIB (-z nodefaultlib: neither
the default directories nor the system's entries of the linker cache), and
it calls cuInit(0) and exits 0. Run it outside the namespace, where the
cache does not know the test directory.

API (root only; the fixture skips elsewhere):

`driver_host` (function) -> `DriverHost`, in a temporary directory every user can read.
    .install(version="570.86.15", libs=("cuda", "ml", "ptxjit"), into=None)
                      lays out the libraries (into: another directory of
                      the test's, registered too) and rebuilds the cache.
    .remove(lib)      removes one library ("cuda", "ml", "ptxjit") everywhere
                      and rebuilds the cache.
    .run(code, kernel="570.86.15", nixos=False, uid=None, env=None)
                      -> CompletedProcess of `python -c code` in a private
                      mount namespace with this host (kernel None: no NVIDIA
                      kernel module loaded).
    .ensure(driver_dir, **run_kw) -> dict: driver_dir.ensure there:
                      {"notes": [...], "links": {name: target}} or
                      {"fail": {"kind", "reason", "message"}, "notes": [...]}.
    .smoke_binary(driver_dir) -> Path, under the host's directory
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NVML_SOURCE = Path(__file__).parent / "fake_nvml" / "fake_nvml.c"

# No libc: _start calls cuInit and exits through the kernel, so the only
# library the loader must find is libcuda.so.1.
_EXIT = {
    "x86_64": '__asm__ volatile("syscall" : : "a"(60), "D"(code) : "rcx", "r11", "memory");',
    "aarch64": 'register long x0 __asm__("x0") = code; register long x8 __asm__("x8") = 93;\n'
    '    __asm__ volatile("svc 0" : : "r"(x0), "r"(x8) : "memory");',
}
SMOKE_C = """
extern int cuInit(unsigned int flags);
static void leave(long code)
{
    %s
    __builtin_unreachable();
}
__attribute__((force_align_arg_pointer)) void _start(void)
{
    leave(cuInit(0) == 0 ? 0 : 3);
}
"""
CUDA_C = "int cuInit(unsigned int flags) { (void)flags; return 0; }\n"
PTXJIT_C = "int fdl_fake_ptxjit(void) { return 0; }\n"

LIBS = {
    "cuda": ("libcuda.so", "libcuda.so.1"),
    "ml": ("libnvidia-ml.so", "libnvidia-ml.so.1"),
    "ptxjit": ("libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"),
}


def kernel_banner(version: str) -> str:
    # The open kernel module's first line, as /proc/driver/nvidia/version has it.
    return (
        f"NVRM version: NVIDIA UNIX Open Kernel Module for {platform.machine()}  {version}  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Thu Jan  9 09:39:20 UTC 2025\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )


@dataclass
class Compiled:
    gcc: str
    build: Path  # built libraries, by soname


def _gcc(gcc: str, *args: str) -> None:
    done = subprocess.run([gcc, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"gcc {' '.join(args)} failed: {done.stderr}")


@pytest.fixture(scope="session")
def driver_libraries() -> Iterator[Compiled]:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("gcc is not installed: the stand-in driver libraries cannot be compiled")
    if platform.machine() not in _EXIT:
        pytest.skip(f"the libc-free smoke binary knows x86_64 and aarch64, not {platform.machine()}")
    from other_user import reachable_dir

    # The smoke run loads them as an unprivileged user (prepare/host/confine.py),
    # outside the /tmp it gets fresh.
    build = reachable_dir("fake-driver-")
    try:
        (build / "cuda.c").write_text(CUDA_C)
        (build / "ptxjit.c").write_text(PTXJIT_C)
        flat = ["-shared", "-fPIC", "-O1", "-nostdlib", "-Wall", "-Werror"]
        _gcc(gcc, *flat, "-Wl,-soname,libcuda.so.1", "-o", str(build / "libcuda.so.1"), str(build / "cuda.c"))
        _gcc(
            gcc,
            *flat,
            "-Wl,-soname,libnvidia-ptxjitcompiler.so.1",
            "-o",
            str(build / "libnvidia-ptxjitcompiler.so.1"),
            str(build / "ptxjit.c"),
        )
        _gcc(
            gcc,
            "-shared",
            "-fPIC",
            "-O1",
            "-fvisibility=hidden",
            "-Wl,-soname,libnvidia-ml.so.1",
            "-o",
            str(build / "libnvidia-ml.so.1"),
            str(NVML_SOURCE),
        )
        yield Compiled(gcc, build)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def smoke_binary(compiled: Compiled, driver_dir: Path | str, out: Path) -> Path:
    """A program that looks for libcuda.so.1 only in `driver_dir`, as a
    Nix-built one does (see the module's docstring)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    source = out.parent / f"{out.name}.c"
    source.write_text(SMOKE_C % _EXIT[platform.machine()])
    _gcc(
        compiled.gcc,
        "-O1",
        "-nostdlib",
        "-fno-stack-protector",
        "-fno-pie",
        "-no-pie",
        f"-Wl,-rpath,{driver_dir}",
        "-Wl,--enable-new-dtags",
        "-Wl,-z,nodefaultlib",
        "-o",
        str(out),
        str(source),
        str(compiled.build / "libcuda.so.1"),
    )
    return out


class DriverHost:
    def __init__(self, root: Path, compiled: Compiled) -> None:
        self.root = root
        self.compiled = compiled
        self.lib_dir = root / "host-lib"
        self.lib_dir.mkdir(parents=True)
        self.dirs: list[Path] = [self.lib_dir]
        self.cache = root / "ld.so.cache"
        self._rebuild()

    # -- the host's driver -------------------------------------------------------
    def install(
        self, version: str = "570.86.15", libs: Sequence[str] = ("cuda", "ml", "ptxjit"), into: Path | None = None
    ) -> None:
        where = into or self.lib_dir
        where.mkdir(parents=True, exist_ok=True)
        if where not in self.dirs:
            # Listed first: the cache then names this directory's copy.
            self.dirs.insert(0, where)
        for lib in libs:
            stem, soname = LIBS[lib]
            real = where / f"{stem}.{version}"
            shutil.copy(self.compiled.build / soname, real)
            link = where / soname
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(real.name)
        self._rebuild()

    def remove(self, lib: str) -> None:
        stem, _ = LIBS[lib]
        for where in self.dirs:
            for path in where.glob(f"{stem}.*"):
                path.unlink()
        self._rebuild()

    def _rebuild(self) -> None:
        conf = self.root / "ld.so.conf"
        lines = ["include /etc/ld.so.conf.d/*.conf", *(str(d) for d in self.dirs)]
        conf.write_text("\n".join(lines) + "\n")
        ldconfig = next(p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p))
        done = subprocess.run(
            [ldconfig, "-X", "-C", str(self.cache), "-f", str(conf)], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr

    # -- a program built like a Nix one ------------------------------------------------
    def smoke_binary(self, driver_dir: Path | str, name: str = "train") -> Path:
        return smoke_binary(self.compiled, driver_dir, self.root / "bin" / name)

    # -- the namespace -----------------------------------------------------------------
    def run(
        self,
        code: str,
        *,
        kernel: str | None = "570.86.15",
        nixos: bool = False,
        uid: int | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        import other_user

        spec = {
            "code": code,
            "cache": str(self.cache),
            "kernel": None if kernel is None else kernel_banner(kernel),
            "os_release": 'NAME=NixOS\nID=nixos\nVERSION_ID="25.05"\n' if nixos else None,
            "uid": uid,
            "python": other_user.python_for(uid) if uid is not None else sys.executable,
            "pythonpath": other_user.readable_package_root() if uid is not None else None,
            "env": dict(os.environ if env is None else env),
        }
        run_file = self.root / "run.json"
        run_file.write_text(json.dumps(spec))
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, __file__, str(run_file)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )

    def ensure(self, driver_dir: Path | str, **run_kw: object) -> dict:
        code = (
            "import json, os\n"
            "from prepare.gpu import driver_dir\n"
            "from prepare.fail import Fail\n"
            "notes = []\n"
            f"d = {str(driver_dir)!r}\n"
            "try:\n"
            "    driver_dir.ensure(d, notes)\n"
            "except Fail as f:\n"
            "    print(json.dumps({'fail': f.to_json(), 'notes': notes}))\n"
            "else:\n"
            "    links = {n: os.readlink(os.path.join(d, n)) for n in sorted(os.listdir(d)) "
            "if os.path.islink(os.path.join(d, n))} if os.path.isdir(d) else None\n"
            "    print(json.dumps({'notes': notes, 'links': links}))\n"
        )
        done = self.run(code, **run_kw)  # type: ignore[arg-type]
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


@pytest.fixture
def driver_host(driver_libraries: Compiled) -> Iterator[DriverHost]:
    if os.geteuid() != 0:
        pytest.skip("a private mount namespace with bind mounts needs root")
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("unshare and mount (util-linux) are needed for the fake driver host")
    if not any(os.path.exists(p) for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig")):
        pytest.skip("the host has no ldconfig")
    # Not under tmp_path (0700): a child run as another user must reach the
    # libraries, as every user reaches a real driver's.
    from other_user import reachable_dir

    root = reachable_dir("fdl-driver-host-")
    try:
        yield DriverHost(root, driver_libraries)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- the child, in its private mount namespace ----------------------------------------


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(f"fake driver host: mount {' '.join(args)} failed: {done.stderr}")
        sys.exit(97)


def _enter(run_file: Path) -> int:
    spec = json.loads(run_file.read_text())
    stage = run_file.parent
    # The kernel module's version file, or none: a tmpfs over /proc/driver.
    _mount("-t", "tmpfs", "-o", "mode=755", "tmpfs", "/proc/driver")
    if spec["kernel"] is not None:
        os.mkdir("/proc/driver/nvidia")
        Path("/proc/driver/nvidia/version").write_text(spec["kernel"])
    # The test's linker cache where the host's ldconfig -p (and the loader)
    # read it; the machine's own cache is untouched outside this namespace.
    _mount("--bind", spec["cache"], "/etc/ld.so.cache")
    if spec["os_release"] is not None:
        release = stage / "os-release"
        release.write_text(spec["os_release"])
        _mount("--bind", str(release), "/etc/os-release")
    # /run of this namespace's own, so the default driver directory is too.
    _mount("-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run")

    env = spec["env"]
    if spec["uid"] is None:
        done = subprocess.run([spec["python"], "-c", spec["code"]], env=env, capture_output=True, text=True, cwd=REPO)
    else:
        uid = int(spec["uid"])
        env = {**env, "PATH": "/usr/bin:/bin", "PYTHONPATH": spec["pythonpath"]}
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
