"""Real kernel tmpfs mounts for tests: plain, read-only, tiny, and full.

A read-only mount or a full disk cannot be faked with permission bits (root
ignores them, and the code under test must not read them anyway), so these
fixtures make the real thing and always take it down again, also when the
test fails. They need root and a kernel that lets this process mount; where
either is missing the test is skipped with the reason.

    def test_x(tmpfs):
        ro = tmpfs(read_only=True, populate=lambda p: (p / "d").mkdir())
        full = tmpfs(size="64k", full=True)

`disk_dir` is the opposite: a directory on a disk-backed filesystem, for
tests that must not see a tmpfs where a box's /tmp happens to be one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Small enough to fill in a millisecond, large enough for a directory or two.
TINY = "64k"


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def _unmount(path: Path) -> None:
    if _run(["umount", str(path)]).returncode != 0:
        # Something still holds it (a leaked fd in a failing test): detach it
        # so the next test and pytest's temp cleanup are not blocked.
        _run(["umount", "-l", str(path)])
    with contextlib.suppress(OSError):
        path.rmdir()


def _fill(path: Path) -> None:
    """Write until the filesystem refuses: genuinely full, not just small."""
    chunk = b"\0" * 4096
    with open(path / "fill", "wb", buffering=0) as fh:
        while True:
            try:
                fh.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    # Pages a byte at a time, in case the last page-sized write was refused
    # with room for less than a page left.
    with open(path / "fill", "ab", buffering=0) as fh:
        while True:
            try:
                fh.write(b"\0")
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break


@pytest.fixture
def tmpfs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Callable[..., Path]:
    """Factory for tmpfs mounts, each unmounted at teardown.

    tmpfs(size="1m", read_only=False, full=False, populate=None, name="tmpfs") -> Path

    `populate(path)` runs while the mount is still writable; `read_only`
    then remounts it read-only, `full` fills it until ENOSPC."""
    if os.geteuid() != 0:
        pytest.skip("kernel mounts need root")

    def make(
        size: str = "1m",
        *,
        read_only: bool = False,
        full: bool = False,
        populate: Callable[[Path], object] | None = None,
        name: str = "tmpfs",
    ) -> Path:
        point = tmp_path_factory.mktemp(name)
        made = _run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(point)])
        if made.returncode != 0:
            pytest.skip(f"cannot mount tmpfs here: {made.stderr.strip() or made.returncode}")
        request.addfinalizer(lambda: _unmount(point))
        if populate is not None:
            populate(point)
        if full:
            _fill(point)
        if read_only:
            ro = _run(["mount", "-o", "remount,ro", str(point)])
            if ro.returncode != 0:
                pytest.skip(f"cannot remount tmpfs read-only here: {ro.stderr.strip()}")
        return point

    return make


@pytest.fixture
def plain_tmpfs(tmpfs: Callable[..., Path]) -> Path:
    return tmpfs()


@pytest.fixture
def read_only_tmpfs(tmpfs: Callable[..., Path]) -> Path:
    return tmpfs(read_only=True)


@pytest.fixture
def tiny_tmpfs(tmpfs: Callable[..., Path]) -> Path:
    """Writable, but far under any sensible free-space threshold."""
    return tmpfs(TINY)


@pytest.fixture
def full_tmpfs(tmpfs: Callable[..., Path]) -> Path:
    """Filled until the kernel answers ENOSPC."""
    return tmpfs(TINY, full=True)


def _on_disk(path: Path) -> bool:
    from prepare.host import dirs, mounts

    mount = mounts.containing(str(path))
    return mount is not None and mount.fstype not in dirs.RAM_FILESYSTEMS


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory on a disk-backed filesystem. pytest's temp dir is
    one on Debian 12, but a tmpfs on Debian 13 (and wherever /tmp is), so
    the tests that need a disk make one: /var/tmp, else beside the checkout."""
    if _on_disk(tmp_path):
        yield tmp_path
        return
    for base in (Path("/var/tmp"), Path(__file__).resolve().parent.parent):
        if base.is_dir() and _on_disk(base):
            path = Path(tempfile.mkdtemp(prefix="fdl-disk-", dir=base))
            try:
                yield path
            finally:
                shutil.rmtree(path, ignore_errors=True)
            return
    pytest.skip("no disk-backed directory here: /tmp, /var/tmp and the checkout are all on RAM filesystems")
