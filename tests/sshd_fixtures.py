"""A real OpenSSH server on 127.0.0.1, and real sshfs mounts that always come down.

The data step's faults are the far side's: a refused key, a closed port, a
server that stops answering mid-mount. Only a real sshd produces those the
way production meets them, so the tests run one: /usr/sbin/sshd with its own
sshd_config (`-f`), generated ed25519 host and user keys, a free port, an
authorized_keys for root, in the foreground (`-D -e`) so it dies with us.

    def test_x(sshd, sshfs_mounts):
        spec = sshd.spec(data_source=sshd.source(tree), data_path=str(sshfs_mounts.point()))

`sshd` is one server for the session; `make_sshd()` starts a private one for
a test that stops, freezes or kills it. `sshfs_mounts` hands out mountpoints
and unmounts whatever ends up mounted on them (fusermount3 -u, then a lazy
umount), after thawing anything a test froze with SIGSTOP.

Everything needs root (sshd, and sshfs as the user the tests run as),
/dev/fuse, sshd, ssh-keygen, sshfs and fusermount3; without them the tests
that ask for these fixtures are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prepare.spec import DataSpec, PrepareSpec, SshSpec

SSHD = "/usr/sbin/sshd"


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "sshd and sshfs mounts need root"
    if not os.path.exists(SSHD):
        return f"{SSHD} is not installed (apt-get install openssh-server)"
    for program in ("ssh-keygen", "ssh", "sshfs", "fusermount3"):
        if shutil.which(program) is None:
            return f"{program} is not installed (apt-get install openssh-client sshfs fuse3)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )


def _children(pid: int) -> list[int]:
    """Every descendant of `pid`, from /proc (no ps, no psutil)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name sits in parentheses and may contain spaces.
        after = stat[stat.rfind(b")") + 2 :].split()
        parents.setdefault(int(after[1]), []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass
class Sshd:
    """One running sshd. `options` are what a client needs to trust it
    without touching ~/.ssh: a known_hosts file holding exactly its host key,
    strict checking, and only the identity given."""

    home: Path
    port: int
    user_key: Path
    stranger_key: Path
    known_hosts: Path
    process: subprocess.Popen[bytes] | None = None
    frozen: list[int] = field(default_factory=list)
    host: str = "127.0.0.1"
    user: str = "root"

    @property
    def options(self) -> tuple[str, ...]:
        return (
            f"UserKnownHostsFile={self.known_hosts}",
            "GlobalKnownHostsFile=/dev/null",
            "StrictHostKeyChecking=yes",
            "IdentitiesOnly=yes",
        )

    def source(self, path: str | os.PathLike[str], *, scp: bool = False) -> str:
        path = os.fspath(path)
        if scp:
            return f"sshfs://{self.user}@{self.host}:{path}"
        return f"sshfs://{self.user}@{self.host}:{self.port}{path}"

    def remote(self, path: str | os.PathLike[str]) -> str:
        """The source as the kernel lists it in mountinfo."""
        return f"{self.user}@{self.host}:{os.fspath(path)}"

    def ssh_spec(self, *, identity: Path | None = None, extra: tuple[str, ...] = ()) -> SshSpec:
        return SshSpec(identity_file=str(identity or self.user_key), options=self.options + extra)

    def spec(
        self,
        *,
        data_source: str | None,
        data_path: str | None,
        identity: Path | None = None,
        extra: tuple[str, ...] = (),
        list_timeout_s: float = 10.0,
    ) -> PrepareSpec:
        return PrepareSpec(
            data=DataSpec(data_path=data_path, data_source=data_source),
            ssh=self.ssh_spec(identity=identity, extra=extra),
            cpu_only=True,
            list_timeout_s=list_timeout_s,
        )

    def log(self) -> str:
        try:
            return (self.home / "sshd.log").read_text(errors="replace")
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start (or restart, on the same port) and wait until it listens."""
        if self.running:
            return
        with open(self.home / "sshd.log", "ab") as log:
            self.process = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(self.home / "sshd_config")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited {self.process.returncode}:\n{self.log()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd did not listen on {self.port} within 10s:\n{self.log()}")

    def sessions(self) -> list[int]:
        """The per-connection sshd processes (privsep monitor, sftp) now running."""
        if self.process is None:
            return []
        return _children(self.process.pid)

    def freeze(self) -> list[int]:
        """SIGSTOP every connection process: the far side stops answering
        while the TCP connection stays open, which is what a hung server or
        a black-holed link looks like to sshfs. Thawed at teardown."""
        pids = self.sessions()
        _signal(pids, signal.SIGSTOP)
        self.frozen.extend(pids)
        return pids

    def thaw(self) -> None:
        _signal(self.frozen, signal.SIGCONT)
        self.frozen.clear()

    def stop(self) -> None:
        """Stop listening and drop every connection."""
        self.thaw()
        if self.process is None:
            return
        sessions = self.sessions()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        _signal(sessions, signal.SIGTERM)


def _write_config(home: Path, port: int) -> None:
    (home / "sshd_config").write_text(
        "\n".join(
            [
                "ListenAddress 127.0.0.1",
                f"Port {port}",
                f"HostKey {home / 'host_ed25519'}",
                f"AuthorizedKeysFile {home / 'authorized_keys'}",
                "PidFile none",
                # The keys live in a pytest temp dir, not a 0700 ~/.ssh.
                "StrictModes no",
                "UsePAM no",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "Subsystem sftp internal-sftp",
                "LogLevel VERBOSE",
                "MaxStartups 64",
                "",
            ]
        )
    )


def start_sshd(home: Path) -> Sshd:
    reason = _missing()
    if reason is not None:
        pytest.skip(reason)
    # sshd refuses to start without its privilege separation directory, which
    # the openssh-server package only creates when its own service starts.
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    _keygen(home / "host_ed25519", "fdl-prepare test host")
    _keygen(home / "user_ed25519", "fdl-prepare test user")
    _keygen(home / "stranger_ed25519", "fdl-prepare test stranger (not authorized)")
    shutil.copy(home / "user_ed25519.pub", home / "authorized_keys")
    host_pub = (home / "host_ed25519.pub").read_text().split()
    last: Exception | None = None
    for _ in range(5):
        port = free_port()
        _write_config(home, port)
        known = home / "known_hosts"
        known.write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
        server = Sshd(
            home=home,
            port=port,
            user_key=home / "user_ed25519",
            stranger_key=home / "stranger_ed25519",
            known_hosts=known,
        )
        check = subprocess.run(
            [SSHD, "-t", "-f", str(home / "sshd_config")], capture_output=True, text=True, check=False
        )
        if check.returncode != 0:
            pytest.skip(f"sshd rejects the test config: {check.stderr.strip()}")
        try:
            server.start()
            return server
        except RuntimeError as err:
            # Another process took the port between probe and bind: pick again.
            last = err
            server.stop()
    raise RuntimeError(f"could not start sshd: {last}")


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """One sshd for the session. Tests that stop or freeze a server use
    `make_sshd` instead, so they cannot break the mounts of the others."""
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield server
    finally:
        server.stop()


class SshdFactory:
    """Starts private servers for one test; `servers` are thawed before the
    test's mounts come down and stopped after."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self.servers: list[Sshd] = []

    def __call__(self) -> Sshd:
        server = start_sshd(self._tmp.mktemp("sshd-private"))
        self.servers.append(server)
        return server


@pytest.fixture
def make_sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdFactory]:
    factory = SshdFactory(tmp_path_factory)
    try:
        yield factory
    finally:
        for server in factory.servers:
            server.stop()


def _mounted_points() -> list[str]:
    from prepare.host import mounts

    return [m.mount_point for m in mounts.read()]


def unmount_everything_at(point: str) -> None:
    """Take down every mount stacked at `point`, politely first."""
    for _ in range(8):
        if point not in _mounted_points():
            return
        for argv in (["fusermount3", "-u", point], ["umount", point], ["umount", "-l", point]):
            try:
                done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
            except subprocess.TimeoutExpired:
                continue
            if done.returncode == 0:
                break


@dataclass
class SshfsMounts:
    root: Path
    points: list[Path] = field(default_factory=list)

    def point(self, name: str = "mnt") -> Path:
        """A fresh, empty directory to mount on; unmounted at teardown."""
        path = self.root / name
        n = 1
        while path.exists():
            n += 1
            path = self.root / f"{name}-{n}"
        path.mkdir(parents=True)
        self.points.append(path)
        return path

    def track(self, path: Path) -> Path:
        """Also unmount `path` at teardown (a mountpoint the code made)."""
        self.points.append(path)
        return path

    def count_at(self, path: str | os.PathLike[str]) -> int:
        return _mounted_points().count(os.fspath(path))

    def sshfs(self, sshd: Sshd, remote_dir: str | os.PathLike[str], point: Path, *extra: str) -> None:
        """Mount directly with sshfs, bypassing the code under test: for
        mounts a test needs to find already there."""
        argv = ["sshfs", sshd.remote(remote_dir), str(point), "-o", f"port={sshd.port}"]
        for option in sshd.options + (f"IdentityFile={sshd.user_key}", "BatchMode=yes", *extra):
            argv += ["-o", option]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, f"sshfs failed: {done.stderr}\n{sshd.log()}"


@pytest.fixture
def sshfs_mounts(tmp_path: Path, make_sshd: SshdFactory) -> Iterator[SshfsMounts]:
    # Depending on make_sshd makes its servers outlive these mounts: teardown
    # runs in reverse order of setup, so everything is unmounted first and
    # the private servers stop after.
    mounts = SshfsMounts(root=tmp_path / "mnt")
    mounts.root.mkdir()
    try:
        yield mounts
    finally:
        # Thaw first: a frozen far side would make a polite unmount wait.
        for server in make_sshd.servers:
            server.thaw()
        for path in reversed(mounts.points):
            unmount_everything_at(os.fspath(path))


@pytest.fixture
def remote_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory the sshd serves as a dataset root (the far side is this
    machine, so the "remote" is a local directory reached over ssh)."""
    tree = tmp_path_factory.mktemp("remote")
    (tree / "train").mkdir()
    (tree / "train" / "shard-000.bin").write_bytes(b"\x00" * 1024)
    (tree / "README").write_text("dataset root for fdl-prepare tests\n")
    return tree


@pytest.fixture
def forget_mount_locks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Remove, after the test, the mount lock files the test's mountpoints
    created. Production never removes them (unlinking a lock another
    process may be about to take breaks the exclusion, and /run/lock is
    emptied at boot anyway), but a test suite makes a fresh mountpoint per
    test and would otherwise leave one file per test behind."""
    from prepare.data import root as data

    made: list[str] = []
    real = data.lock_path

    def recording(mountpoint: str) -> str:
        path = real(mountpoint)
        made.append(path)
        return path

    monkeypatch.setattr(data, "lock_path", recording)
    try:
        yield made
    finally:
        for path in set(made):
            Path(path).unlink(missing_ok=True)


@pytest.fixture
def forget_mount_lock_of() -> Iterator[Callable[[Path], None]]:
    """The same clean-up for runs in a child process, where the lock path
    cannot be recorded: the test names the mountpoint it handed over."""
    from prepare.data import root as data

    mountpoints: list[Path] = []
    try:
        yield mountpoints.append
    finally:
        for mountpoint in mountpoints:
            Path(data.lock_path(str(mountpoint))).unlink(missing_ok=True)
