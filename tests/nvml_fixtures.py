"""A fake NVIDIA driver: tests/fake_nvml/fake_nvml.c compiled into a
`libnvidia-ml.so.1` that the real pynvml loads and calls through ctypes, so
the GPU gate's real code path runs on a machine without a GPU.

Fixture API (register with `pytest_plugins = ["nvml_fixtures"]`):

`fake_nvml` (session) -> `FakeNvml`. Compiles the library once per session
with gcc (skips when gcc is missing).
    .lib_dir          the directory holding libnvidia-ml.so.1
    .library          its path
    .box(gpus, **kw)  writes a config for one fake box and returns a `FakeBox`;
                      changes no environment. Keywords: init_error,
                      count_error, driver, driver_error, cuda ((12, 8) or
                      12080), cuda_error, count (overrides len(gpus)).

`FakeBox`
    .env(base=None)   environment for a subprocess that should see this box:
                      `base` (default os.environ) plus LD_LIBRARY_PATH with
                      the fake first, and FAKE_NVML_CONFIG.
    .calls()          the init/shutdown log, e.g. ["init 0", "shutdown 0"].
    .config, .log     paths.

`nvml_box` (function) -> a callable `(gpus=..., **kw) -> FakeBox` for code
that runs in the test process itself (gate.check, prepare(), an in-process
CLI runner). It loads the fake into this process by path with RTLD_GLOBAL
(once; it stays loaded), so pynvml's own dlopen of the soname finds it, and
points FAKE_NVML_CONFIG at the new box until the test ends. The fake answers
NVML_ERROR_LIBRARY_NOT_FOUND whenever FAKE_NVML_CONFIG is unset, so tests
that ask for no box still see "no driver installed", as on this machine.
Skips if pynvml already loaded a real libnvidia-ml in this process.

`FAKE_NVML_HANG=FUNCTION` in a box's environment makes that exported
function (nvmlInitWithFlags, nvmlDeviceGetHandleByIndex_v2, ...) block for
good, as a call into a driver whose card fell off the bus can; the box's log
then says `hang FUNCTION PID`. `hung_pids(box)` reads those pids back and
`query_processes(mark)` lists the GPU query children (prepare.gpu.query)
still alive with `mark` in their environment, so a test proves the hung
one was killed.

`no_driver_env(base=None)`: environment for a subprocess with no NVML at all
(empty LD_LIBRARY_PATH, no FAKE_NVML_CONFIG); `host_has_nvml()` says whether
the host's own driver would still be found, in which case such tests skip.

Cards (`FakeGpu`): name, uuid (default derived from the index), capability,
memory (bytes), fail (an NVML error code every query, or only `fail_on`,
returns: "all", "handle", "name", "uuid", "cc", "mem", "mig", and the health
queries "remap", "pages", "ecc", "fabric", "fabricv", "compute"), mig (MIG
instance UUIDs: the card is in MIG mode). Health: remap (corrected rows,
uncorrected rows, pending, failure occurred), pages_pending, ecc (volatile
uncorrectable errors), compute (the compute mode), fabric ((state, status),
or None: the card answers NOT_SUPPORTED, as parts before Hopper do), and
unsupported (health queries that answer NOT_SUPPORTED). The defaults are a
healthy card. Presets: `ampere_pair()` (two RTX 3090, capability 8.6),
`pascal_card()` (one GTX 1080 Ti, 6.1), `hopper_mig(*uuids)` (an H100 in MIG
mode), `hgx_h100(n)` (H100 SXM cards on NVSwitch, fabric registered). NVML
error codes, compute modes and fabric states are module constants.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

SOURCE = Path(__file__).parent / "fake_nvml" / "fake_nvml.c"
SONAME = "libnvidia-ml.so.1"

# nvml.h return codes the tests script.
NO_PERMISSION = 4
NOT_SUPPORTED = 3
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
GPU_IS_LOST = 15
LIB_RM_VERSION_MISMATCH = 18
NOT_READY = 27
ARGUMENT_VERSION_MISMATCH = 25
UNKNOWN = 999

# nvml.h: compute modes and NVLink fabric states.
COMPUTE_DEFAULT = 0
COMPUTE_PROHIBITED = 2
COMPUTE_EXCLUSIVE_PROCESS = 3
FABRIC_NOT_SUPPORTED = 0
FABRIC_NOT_STARTED = 1
FABRIC_IN_PROGRESS = 2
FABRIC_COMPLETED = 3

HEALTH_QUERIES = ("remap", "pages", "ecc", "fabric", "compute")

GIB = 1 << 30


@dataclass(frozen=True)
class FakeGpu:
    name: str = "NVIDIA GeForce RTX 3090"
    uuid: str | None = None
    capability: tuple[int, int] = (8, 6)
    memory: int = 24 * GIB
    fail: int | None = None
    fail_on: str = "all"
    mig: tuple[str, ...] = ()
    remap: tuple[int, int, int, int] = (0, 0, 0, 0)
    pages_pending: bool = False
    ecc: int = 0
    compute: int = COMPUTE_DEFAULT
    fabric: tuple[int, int] | None = None
    unsupported: tuple[str, ...] = ()


def default_uuid(index: int) -> str:
    return f"GPU-{index:08x}-1111-2222-3333-{index:012x}"


def ampere_pair() -> list[FakeGpu]:
    return [FakeGpu(), FakeGpu()]


def pascal_card() -> list[FakeGpu]:
    return [FakeGpu(name="NVIDIA GeForce GTX 1080 Ti", capability=(6, 1), memory=11 * GIB)]


def hgx_h100(n: int = 8) -> list[FakeGpu]:
    return [
        FakeGpu(name="NVIDIA H100 80GB HBM3", capability=(9, 0), memory=80 * GIB, fabric=(FABRIC_COMPLETED, 0))
        for _ in range(n)
    ]


def hopper_mig(*mig_uuids: str) -> list[FakeGpu]:
    return [FakeGpu(name="NVIDIA H100 80GB HBM3", capability=(9, 0), memory=80 * GIB, mig=tuple(mig_uuids))]


@dataclass(frozen=True)
class FakeBox:
    lib_dir: Path
    config: Path
    log: Path

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{self.lib_dir}:{old}" if old else str(self.lib_dir)
        env["FAKE_NVML_CONFIG"] = str(self.config)
        return env

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


class FakeNvml:
    def __init__(self, lib_dir: Path) -> None:
        self.lib_dir = lib_dir
        self.library = lib_dir / SONAME
        self._boxes = itertools.count()

    def box(
        self,
        gpus: Sequence[FakeGpu] = (),
        *,
        init_error: int = 0,
        count_error: int = 0,
        driver: str = "570.86.15",
        driver_error: int = 0,
        cuda: tuple[int, int] | int = (12, 8),
        cuda_error: int = 0,
        count: int | None = None,
        directory: Path | None = None,
    ) -> FakeBox:
        where = directory or (self.lib_dir / "boxes")
        where.mkdir(parents=True, exist_ok=True)
        n = next(self._boxes)
        config, log = where / f"box{n}.conf", where / f"box{n}.log"
        cuda_int = cuda if isinstance(cuda, int) else cuda[0] * 1000 + cuda[1] * 10
        lines = [
            f"init_error {init_error}",
            f"count_error {count_error}",
            f"driver {driver}",
            f"driver_error {driver_error}",
            f"cuda {cuda_int}",
            f"cuda_error {cuda_error}",
            f"log {log}",
            f"count {len(gpus) if count is None else count}",
        ]
        for i, gpu in enumerate(gpus):
            lines += [
                f"dev {i} name {gpu.name}",
                f"dev {i} uuid {gpu.uuid or default_uuid(i)}",
                f"dev {i} cc {gpu.capability[0]} {gpu.capability[1]}",
                f"dev {i} mem {gpu.memory}",
            ]
            if gpu.fail is not None:
                lines.append(f"dev {i} fail {gpu.fail} {gpu.fail_on}")
            lines += [f"dev {i} mig {m}" for m in gpu.mig]
            lines += [
                f"dev {i} remap {' '.join(str(v) for v in gpu.remap)}",
                f"dev {i} pages_pending {int(gpu.pages_pending)}",
                f"dev {i} ecc_volatile_unc {gpu.ecc}",
                f"dev {i} compute {gpu.compute}",
            ]
            if gpu.fabric is not None:
                lines.append(f"dev {i} fabric {gpu.fabric[0]} {gpu.fabric[1]}")
            lines += [f"dev {i} fail {NOT_SUPPORTED} {q}" for q in gpu.unsupported]
        config.write_text("\n".join(lines) + "\n")
        return FakeBox(self.lib_dir, config, log)


def hung_pids(box: FakeBox) -> list[int]:
    """The processes that entered a call FAKE_NVML_HANG blocked."""
    return [int(line.split()[-1]) for line in box.calls() if line.startswith("hang ")]


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def query_processes(mark: str) -> list[int]:
    """Live processes running this checkout's GPU query child with `mark`
    in their environment (a box's config path: other runs of the suite
    may be surveying at the same time)."""
    from prepare.gpu.query import SCRIPT

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            continue
        if SCRIPT.encode() in argv and mark.encode() in environ and alive(int(entry)):
            found.append(int(entry))
    return found


def no_driver_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = ""
    env.pop("FAKE_NVML_CONFIG", None)
    return env


def host_has_nvml() -> bool:
    probe = "import ctypes\ntry:\n ctypes.CDLL('libnvidia-ml.so.1')\nexcept OSError:\n raise SystemExit(1)\n"
    return subprocess.run([sys.executable, "-c", probe], env=no_driver_env(), check=False).returncode == 0


@pytest.fixture(scope="session")
def fake_nvml() -> Iterator[FakeNvml]:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("gcc is not installed: the fake libnvidia-ml.so.1 cannot be compiled")
    lib_dir = Path(tempfile.mkdtemp(prefix="fake-nvml-"))
    try:
        subprocess.run(
            [
                gcc,
                "-shared",
                "-fPIC",
                "-O1",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-fvisibility=hidden",
                f"-Wl,-soname,{SONAME}",
                "-o",
                str(lib_dir / SONAME),
                str(SOURCE),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        yield FakeNvml(lib_dir)
    finally:
        shutil.rmtree(lib_dir, ignore_errors=True)


_loaded: list[ctypes.CDLL] = []


def _load_into_this_process(fake: FakeNvml) -> None:
    import pynvml

    if not _loaded:
        if pynvml.nvmlLib is not None:
            pytest.skip("pynvml already loaded the host's libnvidia-ml in this process; the fake cannot replace it")
        _loaded.append(ctypes.CDLL(str(fake.library), mode=ctypes.RTLD_GLOBAL))
    elif pynvml.nvmlLib is not None:
        ours = ctypes.cast(_loaded[0].nvmlInitWithFlags, ctypes.c_void_p).value
        theirs = ctypes.cast(pynvml.nvmlLib.nvmlInitWithFlags, ctypes.c_void_p).value
        if ours != theirs:
            pytest.skip("pynvml is bound to another libnvidia-ml in this process")


@pytest.fixture
def nvml_box(fake_nvml: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeBox]:
    _load_into_this_process(fake_nvml)

    def make(gpus: Sequence[FakeGpu] = (), **kw: object) -> FakeBox:
        box = fake_nvml.box(gpus, directory=tmp_path / "nvml", **kw)  # type: ignore[arg-type]
        monkeypatch.setenv("FAKE_NVML_CONFIG", str(box.config))
        # The survey's NVML calls are made in a child (prepare.gpu.query),
        # which finds the library as any process does.
        old = os.environ.get("LD_LIBRARY_PATH")
        monkeypatch.setenv("LD_LIBRARY_PATH", f"{fake_nvml.lib_dir}:{old}" if old else str(fake_nvml.lib_dir))
        return box

    return make
