"""Real Nix for the runner's tests: the nixpkgs-free test flake, git sources
in temp repositories, and an offline Nix configuration.

Fixture API (register with `pytest_plugins = ["nix_fixtures"]`):

`nix_env` (function) -> dict. Skips when `nix` is not installed. Sets
NIX_CONFIG for this test (flakes on; `substituters =`, so no build waits ~4 s
on cache.nixos.org; no retries on failed downloads) and returns the
environment a child process should get.

`test_flake` (session) -> str: `path:<dir>` of a flat copy of tests/flake
(flake.nix, toolchain.nix, flake.lock, nix/ beside them) whose libtorch
variants are all /bin/sh stand-ins (a stand-in.nix beside it): fast, for
everything that exercises variant logic, the runner or the recipe. Variants
`cpu`, `cu128`, and the ROCm stand-ins `rocm6.4`, `rocm7.0`.

`torch_flake` (session) -> str: the same, with the real libtorch as `cpu`
(PyTorch's CPU wheel, unpacked: about 5 s once per store); skips, naming
why, where the wheel is neither in the store nor fetchable.
`require_torch_wheel()` is that check on its own.

`make_flake` (function) -> `(extra_nix=None, flake_nix=None, heavy=None, real=False) -> str`:
a fresh flat copy (stand-ins; `real=True`: the real cpu libtorch), with
`extra.nix` (a function toolchain -> variants), a replaced flake.nix, and/or
`heavy.nix` (the size of the attribute set the flake generates before `fdl`:
600000 costs about 1.3 s of evaluation here), as `path:<dir>`.

`git_source` (function) -> `(files) -> GitSource`: a git repository on
branch `main` with `files` ({relative path: text}) committed.
    .url          git+file://<dir>?ref=main
    .commit(files, message)  writes files (text None deletes), commits, returns the rev
`trainer(build=..., bin=..., manifest=...)` -> files of a minimal training
source: a build line that writes an executable, and optionally floDl's
manifest (`.fdl-run.yml`, `MANIFEST`; `manifest_text(**fields)` is its YAML),
without a digest: floDl's worker checks none then, and neither does a box.

`git_http` (function) -> `(source) -> HttpRemote`: a bare clone of a
GitSource served over git's "dumb" HTTP protocol by a loopback web server
in this process (stopped at teardown).
    .url          git+http://127.0.0.1:<port>/repo.git?ref=main
    .publish()    pushes the source's main to the remote

`state_dir` (function) -> str: an empty state directory for the runner.

`reset_server` (function) -> int: the port of a loopback TCP listener that
reads each request and resets the connection (RST, SO_LINGER 0): a download
cut by the peer. Stopped at teardown.

`lock_holder` (function) -> `(path, seconds) -> subprocess.Popen`: a second
process (a python child) that takes flock(LOCK_EX) on `path`, as another
fdl-prepare would on <state>/lock, and holds it for `seconds`; returns once
it holds the lock. Killed at teardown.

`build(spec, notes=None, *, progress=None, nix_program="nix", steps=BUILD)` -> Prepared:
the pipeline's build steps (4 to 7: state, variant, source, build) run by
its executor on `spec`'s plan, without the cheap steps or the smoke run;
`steps` names others (`("gate", *BUILD)` puts the GPU gate first).

`valid_path(path)` -> bool: whether the store knows `path` as complete.
`procs_with(text)` -> list of (pid, cmdline) of live processes whose command
line contains `text`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from prepare.spec import Prepared, PrepareSpec

REPO = Path(__file__).resolve().parent.parent
# floDl's run manifest and its digest sidecar, at a published tree's root.
MANIFEST = ".fdl-run.yml"
DIGEST = ".fdl-run.sha256"


# The host paths the test flake's builders use (tests/flake/toolchain.nix),
# lent to Nix's build sandbox where it is on (Debian 13 and testing, NixOS):
# a shell, /usr's tools, the dynamic loader and libraries they link, and
# /etc/alternatives, where Debian's cc and c++ point (the example trainer is
# compiled with them). On a merged-/usr system /bin, /lib and /lib64 are links into /usr; elsewhere
# /bin is lent whole. scripts/demo lends the same list.
SANDBOX_LENT = [
    f"/bin/sh={os.path.realpath('/bin/sh')}" if os.path.islink("/bin") else "/bin",
    "/usr",
    *[p for p in ("/lib", "/lib64", "/etc/alternatives") if os.path.lexists(p)],
]


def _target(entry: str) -> str:
    """Where a sandbox-paths entry appears inside the sandbox:
    `/bin/sh=/usr/bin/dash` at /bin/sh, `/usr` at /usr, `/x?` (optional)
    at /x."""
    return entry.split("=", 1)[0].removesuffix("?")


@functools.cache
def box_settings() -> dict[str, str]:
    """Every setting the box's Nix has, with its value as `nix config show`
    prints it (nix.conf's, or the default); empty without Nix."""
    nix = shutil.which("nix")
    if nix is None:
        return {}
    # `config show` on current Nix (2.34 warns that `show-config` is its
    # deprecated alias); 2.8 has only `show-config`.
    for command in (["config", "show"], ["show-config"]):
        try:
            done = subprocess.run(
                [nix, "--extra-experimental-features", "nix-command", *command],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return {}
        if done.returncode == 0:
            return dict(line.partition(" = ")[::2] for line in done.stdout.splitlines() if " = " in line)
    return {}


def box_sandbox_paths() -> list[str]:
    """The box's own `sandbox-paths`, as Nix resolves it (nix.conf, or the
    built-in `/bin/sh=` shell that Debian's 2.26 and 2.34 have); empty
    without Nix."""
    return box_settings().get("sandbox-paths", "").split()


def nix_version() -> tuple[int, int, int]:
    from prepare.nix.runner import parse_nix_version

    done = subprocess.run([require_nix(), "--version"], capture_output=True, text=True, timeout=60, check=True)
    version = parse_nix_version(done.stdout)
    assert version is not None, done.stdout
    return version


# Where Nix 2.30 and later make a build's directory unless nix.conf sets
# build-dir: `builds` in its state directory, out of other users' reach.
# 2.8 and 2.26 make it under TMPDIR.
NIX_BUILDS = Path("/nix/var/nix/builds")


def builds_follow_tmpdir() -> bool:
    """Whether this Nix, with no build-dir set, makes a build's directory
    under TMPDIR (2.8, 2.26) rather than in NIX_BUILDS (2.30 and later:
    the documented change of build-dir's default)."""
    return nix_version()[:2] < (2, 30)


def private_dir(prefix: str) -> Path:
    """A new directory on a path that no other user can write and every
    user can pass through: where Nix 2.30 and later take a build-dir (they
    refuse one under /tmp, or under any directory others can write, and a
    build with the sandbox off must reach its own directory). Skips where
    the box has none that root may write."""
    for base in ("/run", "/var/lib", "/var/cache"):
        chain = [Path(base), *Path(base).parents]
        modes = [p.lstat().st_mode for p in chain if p.exists()]
        if (
            len(modes) == len(chain)
            and all(stat.S_ISDIR(m) and not m & stat.S_IWOTH and m & stat.S_IXOTH for m in modes)
            and os.access(base, os.W_OK)
        ):
            made = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
            made.chmod(0o755)
            return made
    pytest.skip("no directory here that root may write and no other user can (/run, /var/lib, /var/cache)")


def sandbox_paths(lent: Sequence[str] = SANDBOX_LENT) -> str:
    """The whole `sandbox-paths` setting that lends `lent`: the box's own
    entries that `lent` does not cover, then `lent`.

    Set whole, never added with `extra-sandbox-paths`: Nix 2.34 no longer
    lets an added entry replace one already there for the same path, so
    Debian's built-in `/bin/sh=/usr/bin/bash-static` would win over the
    /bin/sh lent here (a builder would run bash where dash was meant). 2.8,
    2.26 and 2.34 all honour the whole setting."""
    covered = [_target(entry).rstrip("/") for entry in lent]
    kept = [
        entry
        for entry in box_sandbox_paths()
        if not any(_target(entry) == t or _target(entry).startswith(t + "/") for t in covered)
    ]
    return " ".join([*kept, *lent])


NIX_CONFIG = "\n".join(
    [
        "experimental-features = nix-command flakes",
        "substituters =",
        # A refused download is retried with backoff (about 5 s in all); one
        # attempt is enough to show it fails.
        "download-attempts = 1",
        # Ignored where the sandbox is off (Debian 12); where it is on
        # (Debian 13 and testing, NixOS) the test flake's host-tool builders
        # need it.
        f"sandbox-paths = {sandbox_paths()}",
        "",
    ]
)


def nix_path() -> str | None:
    return shutil.which("nix")


def require_nix() -> str:
    path = nix_path()
    if path is None:
        pytest.skip("nix is not installed (Debian: apt-get install nix-bin)")
    return path


@pytest.fixture
def nix_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    require_nix()
    monkeypatch.setenv("NIX_CONFIG", NIX_CONFIG)
    return dict(os.environ)


def flat_copy(dest: Path, *, stand_in: bool = False) -> Path:
    """A flat copy of the test flake at `dest` (a `path:` flake, no git):
    its flake.nix, toolchain.nix and lock beside a copy of nix/. Its cpu
    variant is the real libtorch, or with `stand_in` the /bin/sh stand-in
    (a stand-in.nix beside the flake). The benches use it too."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("flake.nix", "toolchain.nix", "flake.lock"):
        src = REPO / "tests" / "flake" / name
        if src.exists():
            shutil.copy(src, dest / name)
    shutil.copytree(REPO / "nix", dest / "nix", ignore=shutil.ignore_patterns("*.md"))
    # The registry crates the toolchain vendors besides Debian's.
    if (REPO / "tests" / "flake" / "registry").is_dir():
        shutil.copytree(REPO / "tests" / "flake" / "registry", dest / "registry")
    if stand_in:
        (dest / "stand-in.nix").write_text("true\n")
    return dest


def _require_test_flake() -> None:
    if not (REPO / "tests" / "flake" / "flake.nix").exists():
        pytest.skip("the test flake (tests/flake/flake.nix) is not in this checkout")


@pytest.fixture(scope="session")
def test_flake(tmp_path_factory: pytest.TempPathFactory) -> str:
    _require_test_flake()
    return f"path:{flat_copy(tmp_path_factory.mktemp('flake') / 'flake', stand_in=True)}"


def _toolchain_expr(attr: str) -> str:
    """A Nix expression for an attribute of the test flake's toolchain."""
    toolchain = json.dumps(str(REPO / "tests" / "flake" / "toolchain.nix"))
    nix_dir = json.dumps(str(REPO / "nix"))
    return f'(import (/. + {toolchain}) {{ system = "{nix_system()}"; nixDir = /. + {nix_dir}; }}).{attr}'


def torch_wheel_path() -> str:
    """The store path of PyTorch's CPU wheel as the test flake fetches it."""
    expr = _toolchain_expr("torchWheel.outPath")
    done = subprocess.run(
        ["nix-instantiate", "--eval", "--json", "--expr", expr], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout))


def nix_system() -> str:
    return {"x86_64": "x86_64-linux", "aarch64": "aarch64-linux"}.get(os.uname().machine, "x86_64-linux")


_WHEEL_MISSING: list[str] = []


def require_torch_wheel() -> str:
    """Skips unless PyTorch's CPU wheel is in the store or can be fetched
    into it: scripts/setup adds it where pip can get it, and a box that can
    reach download.pytorch.org fetches it. Asked once per session."""
    require_nix()
    if os.uname().machine != "x86_64":
        pytest.skip(f"the real libtorch is PyTorch's x86_64 CPU wheel; this machine is {os.uname().machine}")
    if _WHEEL_MISSING:
        pytest.skip(_WHEEL_MISSING[0])
    wheel = torch_wheel_path()
    if valid_path(wheel):
        return wheel
    expr = _toolchain_expr("torchWheel")
    env = {**os.environ, "NIX_CONFIG": NIX_CONFIG}
    done = subprocess.run(
        ["nix-build", "--no-out-link", "--expr", expr], capture_output=True, text=True, env=env, timeout=1800
    )
    if done.returncode != 0 or not valid_path(wheel):
        said = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[-300:])
        _WHEEL_MISSING.append(
            f"PyTorch's CPU wheel ({wheel}) is not in the Nix store and could not be fetched ({said}): "
            "run scripts/setup on a box whose pip can get torch==2.13.0+cpu, or give it access to "
            "download.pytorch.org"
        )
        pytest.skip(_WHEEL_MISSING[0])
    return wheel


def require_cuda_wheels() -> None:
    """Skips unless every wheel of the cu128 libtorch (nix/wheels.nix) is in
    the store: scripts/setup adds them where pip can get them (3.9 GB).
    Nothing is fetched here: a multi-gigabyte download inside a test run is
    the setup's business, not a test's."""
    require_nix()
    if os.uname().machine != "x86_64":
        pytest.skip(f"the cu128 wheels the tests use are x86_64 ones; this machine is {os.uname().machine}")
    done = subprocess.run(
        [
            "nix-instantiate",
            "--eval",
            "--strict",
            "--json",
            "--expr",
            f"map (w: w.outPath) {_toolchain_expr('cudaWheels')}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    missing = [path for path in json.loads(done.stdout) if not valid_path(path)]
    if missing and os.environ.get("FDL_PREPARE_NO_CUDA_WHEELS"):
        pytest.skip(
            f"FDL_PREPARE_NO_CUDA_WHEELS is set, so scripts/setup fetched none of the cu128 wheels ({len(missing)} "
            "missing from the Nix store): the CUDA build is proven where they are (CI's own machine)"
        )
    if missing:
        pytest.skip(
            f"{len(missing)} of the cu128 wheels are not in the Nix store (first: {missing[0]}): run scripts/setup "
            "on a box whose pip can get torch==2.10.0 and its nvidia-*-cu12 wheels from PyPI"
        )


@pytest.fixture(scope="session")
def torch_flake(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`path:<dir>` of a flat copy of the test flake whose cpu variant is the
    real libtorch (PyTorch's CPU wheel); skips, naming why, without it."""
    _require_test_flake()
    require_torch_wheel()
    return f"path:{flat_copy(tmp_path_factory.mktemp('torch-flake') / 'flake')}"


@pytest.fixture
def make_flake(tmp_path: Path) -> Callable[..., str]:
    counter = iter(range(1000))

    def make(
        extra_nix: str | None = None, flake_nix: str | None = None, heavy: int | None = None, real: bool = False
    ) -> str:
        if real:
            require_torch_wheel()
        dest = flat_copy(tmp_path / f"flake{next(counter)}", stand_in=not real)
        if extra_nix is not None:
            (dest / "extra.nix").write_text(extra_nix)
        if heavy is not None:
            (dest / "heavy.nix").write_text(f"{heavy}\n")
        if flake_nix is not None:
            (dest / "flake.nix").write_text(flake_nix)
        return f"path:{dest}"

    return make


def _git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "fdl tests",
        "GIT_AUTHOR_EMAIL": "tests@fdl.invalid",
        "GIT_COMMITTER_NAME": "fdl tests",
        "GIT_COMMITTER_EMAIL": "tests@fdl.invalid",
    }
    done = subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True)
    return done.stdout.strip()


@dataclass
class GitSource:
    path: Path

    @property
    def url(self) -> str:
        return f"git+file://{self.path}?ref=main"

    def commit(self, files: Mapping[str, str | None], message: str = "change") -> str:
        for rel, text in files.items():
            target = self.path / rel
            if text is None:
                if target.exists():
                    _git(self.path, "rm", "-q", rel)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            _git(self.path, "add", rel)
        _git(self.path, "commit", "-q", "--allow-empty", "-m", message)
        return _git(self.path, "rev-parse", "HEAD")


@pytest.fixture
def git_source(tmp_path: Path) -> Callable[[Mapping[str, str | None]], GitSource]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    counter = iter(range(1000))

    def make(files: Mapping[str, str | None]) -> GitSource:
        path = tmp_path / f"source{next(counter)}"
        path.mkdir()
        _git(path, "init", "-q", "-b", "main")
        source = GitSource(path)
        source.commit(files, "initial")
        return source

    return make


def manifest_text(**fields: object) -> str:
    """floDl's run manifest (.fdl-run.yml) holding `fields`, as YAML."""
    import yaml

    return yaml.safe_dump(
        {key: list(value) if isinstance(value, tuple) else value for key, value in fields.items()},
        sort_keys=False,
        default_flow_style=False,
    )


def trainer(
    *,
    build: str | None = "printf '#!/bin/sh\\necho trained\\n' > train && chmod +x train",
    bin: str = "train",
    manifest: Mapping[str, object] | None = None,
    nonce: str | None = None,
) -> dict[str, str | None]:
    """A training source the test flake can build with /bin/sh. The default
    carries a manifest with bin and build; `manifest={}` gives none."""
    files: dict[str, str | None] = {"README": f"a training source for tests {nonce or time.time_ns()}\n"}
    if manifest is None:
        manifest = {"bin": bin, **({"build": build} if build is not None else {})}
    if manifest:
        files[MANIFEST] = manifest_text(**manifest)
    return files


@dataclass
class HttpRemote:
    source: GitSource
    bare: Path
    port: int

    @property
    def url(self) -> str:
        return f"git+http://127.0.0.1:{self.port}/repo.git?ref=main"

    def publish(self) -> None:
        _git(self.source.path, "push", "-q", "--force", str(self.bare), "main")
        _git(self.bare, "update-server-info")


@pytest.fixture
def git_http(tmp_path: Path) -> Iterator[Callable[[GitSource], HttpRemote]]:
    import functools
    import http.server
    import threading

    servers: list[http.server.ThreadingHTTPServer] = []

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            return  # the test output is no place for an access log

    def make(source: GitSource) -> HttpRemote:
        root = tmp_path / f"http{len(servers)}"
        root.mkdir()
        bare = root / "repo.git"
        _git(tmp_path, "clone", "-q", "--bare", str(source.path), str(bare))
        _git(bare, "update-server-info")
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return HttpRemote(source, bare, server.server_address[1])

    try:
        yield make
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def state_dir(tmp_path: Path) -> str:
    path = tmp_path / "state"
    path.mkdir()
    return str(path)


def valid_path(path: str) -> bool:
    done = subprocess.run(
        ["nix-store", "--check-validity", path],
        capture_output=True,
        text=True,
        env={**os.environ, "NIX_CONFIG": NIX_CONFIG},
    )
    return done.returncode == 0


def procs_left(text: str, within_s: float = 5.0) -> list[tuple[int, str]]:
    """The processes whose command line holds `text` once `within_s` has
    passed for them to go. A process group killed with SIGKILL is gone only
    when the kernel has scheduled each of its members to exit: on a loaded
    machine that can take a moment after the leader was reaped, and a
    process still there after seconds is one that outlived its kill."""
    deadline = time.monotonic() + within_s
    while (found := procs_with(text)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def procs_with(text: str) -> list[tuple[int, str]]:
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        cmdline = raw.replace(b"\0", b" ").decode("utf-8", "replace")
        if text in cmdline:
            found.append((int(entry), cmdline))
    return found


@pytest.fixture
def reset_server() -> Iterator[int]:
    import socket
    import struct
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                # Linger 0: close() sends RST, "Connection reset by peer".
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(timeout=5)


_HOLD = """
import fcntl, sys, time
handle = open(sys.argv[1], "a+")
fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def lock_holder() -> Iterator[Callable[[str, float], subprocess.Popen[str]]]:
    import sys

    children: list[subprocess.Popen[str]] = []

    def hold(path: str, seconds: float) -> subprocess.Popen[str]:
        child = subprocess.Popen([sys.executable, "-c", _HOLD, path, str(seconds)], stdout=subprocess.PIPE, text=True)
        children.append(child)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "held", "the lock holder never took the lock"
        return child

    try:
        yield hold
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
            if child.stdout is not None:
                child.stdout.close()


def nix_as(uid: int, directory: Path, *extra: str) -> Path:
    """A `nix` in `directory` that runs the real one as `uid` (no groups),
    with a home of its own there and `extra` arguments first: how a test
    meets the store or the daemon as a user without rights. `directory`
    must be one that `uid` may enter (not pytest's 0700 temp dir)."""
    import shlex

    home = directory / "home"
    home.mkdir()
    os.chown(home, uid, uid)
    shim = directory / "nix"
    real = shlex.join([require_nix(), *extra])
    shim.write_text(
        f'#!/bin/sh\nexport HOME={home}\nexec setpriv --reuid={uid} --regid={uid} --clear-groups {real} "$@"\n'
    )
    shim.chmod(0o755)
    return shim


OTHER_UID = 54321


@contextlib.contextmanager
def nix_daemon_client(
    test_flake: str, *, private_socket: bool = False, daemon_env: Mapping[str, str] | None = None, **runner: object
) -> Iterator[tuple[object, Path]]:
    """A real `nix-daemon` on a socket of its own, and a runner (`prepare.nix.Nix`,
    with `runner` as its keyword arguments) that talks to it as another user
    (OTHER_UID, no groups), with a copy of the test flake that user may read.
    `private_socket` puts the socket in a directory only root may enter, so
    the kernel refuses that user's connect; `daemon_env` is added to the
    daemon's environment. Yields (runner, flake directory); skips without
    root, nix-daemon or setpriv."""
    from prepare.nix.runner import Nix

    if os.geteuid() != 0:
        pytest.skip("needs root (a daemon, and a client as another user)")
    daemon = shutil.which("nix-daemon")
    if daemon is None or shutil.which("setpriv") is None:
        pytest.skip("nix-daemon or setpriv (util-linux) is not installed")
    shared = Path(tempfile.mkdtemp(prefix="fdl-daemon-"))
    proc = None
    try:
        shared.chmod(0o755)
        socket_dir = shared / "private" if private_socket else shared
        socket_dir.mkdir(mode=0o700, exist_ok=True)
        sock = socket_dir / "socket"
        proc = subprocess.Popen(
            [daemon],
            env={**os.environ, **(daemon_env or {}), "NIX_DAEMON_SOCKET_PATH": str(sock)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "nix-daemon never opened its socket"
            time.sleep(0.05)
        shim = nix_as(OTHER_UID, shared, "--store", f"unix://{sock}")
        flake = shared / "flake"
        shutil.copytree(test_flake.removeprefix("path:"), flake)
        for path in [flake, *flake.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        state = shared / "state"
        state.mkdir()
        os.chown(state, OTHER_UID, OTHER_UID)
        yield Nix(str(state), program=str(shim), **runner), flake
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        shutil.rmtree(shared, ignore_errors=True)


@contextlib.contextmanager
def small_disk(*, private: bool) -> Iterator[Path]:
    """A 4 MiB tmpfs for a build's directory to fill: under /tmp and open
    to all (1777, like a TMPDIR), or with `private` on a path no other user
    can write (`private_dir`: a build-dir Nix 2.30 and later accept).
    Skips without root or where no tmpfs can be mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    point = private_dir("fdl-small-builds-") if private else Path(tempfile.mkdtemp(prefix="fdl-small-tmp-", dir="/tmp"))
    point.chmod(0o755)
    mode = "755" if private else "1777"
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=4m,mode={mode}", "tmpfs", str(point)], check=False)
    if made.returncode != 0:
        point.rmdir()
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
        point.rmdir()


# The build steps of the pipeline (prepare.pipeline.STEPS), by name.
BUILD = ("state", "variant", "source", "build")


def build(
    spec: PrepareSpec,
    notes: list[str] | None = None,
    *,
    progress: Callable[[dict], None] | None = None,
    nix_program: str = "nix",
    steps: Sequence[str] = BUILD,
) -> Prepared:
    """The pipeline's `steps` on `spec`'s plan, through its one executor."""
    from prepare import pipeline
    from prepare.plan import plan

    chosen = [step for step in pipeline.STEPS if step.name in steps]
    return pipeline.run(
        plan(spec), [] if notes is None else notes, progress=progress, steps=chosen, nix_program=nix_program
    )
