"""Reading /proc/self/mountinfo: escapes, optional fields, stacking, symlinks.

The decoding is checked twice: on literal lines (every escape the kernel
writes, and shapes a future kernel might add), and on real tmpfs mounts at
paths with a space, a tab, a newline, a backslash and a byte that is not
UTF-8, read back from the live table.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prepare.host import mounts

SSHFS_LINE = (
    "512 27 0:77 / /flodl/data ro,nosuid,nodev,relatime shared:301 master:4 - fuse.sshfs "
    "flodl@exa:/srv/data ro,user_id=0,group_id=0\n"
)


def test_a_plain_line_gives_every_field() -> None:
    (mount,) = mounts.parse(SSHFS_LINE)
    assert mount.mount_id == 512
    assert mount.parent_id == 27
    assert mount.root == "/"
    assert mount.mount_point == "/flodl/data"
    assert mount.fstype == "fuse.sshfs"
    assert mount.source == "flodl@exa:/srv/data"
    assert mount.options == ("ro", "nosuid", "nodev", "relatime")
    assert mount.super_options == ("ro", "user_id=0", "group_id=0")
    assert mount.read_only
    assert mount.is_fuse


def test_the_four_escapes_the_kernel_writes_are_decoded_in_every_path_field() -> None:
    line = (
        r"40 27 0:39 /sub\040dir /mnt/a\040b\011c\012d\134e rw,relatime - tmpfs "
        r"my\040src rw,size=1024k"
    )
    (mount,) = mounts.parse(line)
    assert mount.root == "/sub dir"
    assert mount.mount_point == "/mnt/a b\tc\nd\\e"
    assert mount.source == "my src"
    assert not mount.read_only
    assert not mount.is_fuse


def test_a_line_without_optional_fields_and_one_with_several_parse_alike() -> None:
    bare = "41 27 0:40 / /x rw - tmpfs none rw\n"
    many = "41 27 0:40 / /x rw shared:1 master:2 propagate_from:3 unbindable - tmpfs none rw\n"
    assert mounts.parse(bare) == mounts.parse(many)


def test_a_line_with_an_empty_source_or_no_super_options_still_parses() -> None:
    (mount,) = mounts.parse("42 27 0:41 / /y rw - fuse.sshfs  ")
    assert mount.fstype == "fuse.sshfs"
    assert mount.source == ""
    (mount,) = mounts.parse("42 27 0:41 / /y rw - fuse.sshfs src")
    assert mount.super_options == ()


def test_lines_that_do_not_have_the_documented_shape_are_skipped_not_fatal() -> None:
    text = "garbage\n\n1 2 3\nx y 0:1 / /z rw - tmpfs t rw\n" + SSHFS_LINE
    assert [m.mount_point for m in mounts.parse(text)] == ["/flodl/data"]


def test_stacked_mounts_answer_with_the_one_on_top() -> None:
    table = mounts.parse("50 27 0:50 / /stack rw - tmpfs below rw\n51 50 0:51 / /stack rw - tmpfs above rw\n")
    found = mounts.mounted_at("/stack", table)
    assert found is not None and found.source == "above"
    assert mounts.mounted_at("/stack/inner", table) is None
    assert mounts.mounted_at("/", table) is None


def test_the_live_table_contains_the_root_mount() -> None:
    table = mounts.read()
    assert any(m.mount_point == "/" for m in table)
    assert mounts.mounted_at("/", table) is not None


# -- real mounts ---------------------------------------------------------------


def _mount_tmpfs(point: Path | bytes, source: str = "tmpfs", options: str = "size=64k") -> None:
    done = subprocess.run(
        [b"mount", b"-t", b"tmpfs", b"-o", options.encode(), source.encode(), os.fsencode(point)],
        capture_output=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {done.stderr.decode(errors='replace').strip()}")


@pytest.fixture
def tmpfs_at(tmp_path: Path) -> Iterator[Callable[..., None]]:
    """Mount a tmpfs on any path (created), unmounted at teardown, stacked
    ones too."""
    if os.geteuid() != 0:
        pytest.skip("kernel mounts need root")
    made: list[bytes] = []

    def mount(point: Path | bytes, source: str = "tmpfs", options: str = "size=64k") -> None:
        os.makedirs(point, exist_ok=True)
        _mount_tmpfs(point, source, options)
        made.append(os.fsencode(point))

    try:
        yield mount
    finally:
        for point in reversed(made):
            done = subprocess.run([b"umount", point], capture_output=True, timeout=30, check=False)
            if done.returncode != 0:
                subprocess.run([b"umount", b"-l", point], capture_output=True, timeout=30, check=False)


@pytest.mark.mounts
@pytest.mark.parametrize(
    "name",
    ["with space", "with\ttab", "with\nnewline", "with\\backslash", "all of \t\n\\ them"],
    ids=["space", "tab", "newline", "backslash", "all"],
)
def test_a_real_mount_at_a_path_with_an_escaped_character_is_found_by_its_real_name(
    tmp_path: Path, tmpfs_at: Callable[..., None], name: str
) -> None:
    point = tmp_path / name
    tmpfs_at(point, source="source with space")
    with open("/proc/self/mountinfo", "rb") as f:
        raw = f.read()
    # The kernel really escapes it: the raw bytes never hold the bare name.
    assert os.fsencode(str(point)) not in raw
    found = mounts.mounted_at(str(point))
    assert found is not None
    assert found.mount_point == str(point)
    assert found.source == "source with space"
    assert found.fstype == "tmpfs"


@pytest.mark.mounts
def test_a_real_mount_at_a_name_that_is_not_utf8_round_trips(tmp_path: Path, tmpfs_at: Callable[..., None]) -> None:
    point = os.fsencode(str(tmp_path)) + b"/caf\xe9 \xff"
    tmpfs_at(point)
    found = mounts.mounted_at(os.fsdecode(point))
    assert found is not None
    assert os.fsencode(found.mount_point) == point


@pytest.mark.mounts
def test_a_read_only_real_mount_reads_as_read_only(tmp_path: Path, tmpfs_at: Callable[..., None]) -> None:
    tmpfs_at(tmp_path / "ro", options="size=64k,ro")
    found = mounts.mounted_at(str(tmp_path / "ro"))
    assert found is not None and found.read_only


@pytest.mark.mounts
def test_two_real_mounts_stacked_on_one_point_answer_with_the_top_one(
    tmp_path: Path, tmpfs_at: Callable[..., None]
) -> None:
    tmpfs_at(tmp_path / "s", source="below")
    tmpfs_at(tmp_path / "s", source="above")
    found = mounts.mounted_at(str(tmp_path / "s"))
    assert found is not None and found.source == "above"


@pytest.mark.mounts
def test_a_mount_is_found_through_a_symlinked_parent_and_through_a_symlink_to_it(
    tmp_path: Path, tmpfs_at: Callable[..., None]
) -> None:
    real = tmp_path / "real"
    tmpfs_at(real / "data", source="via-links")
    (tmp_path / "parent-link").symlink_to(real)
    (tmp_path / "point-link").symlink_to(real / "data")
    for declared in (tmp_path / "parent-link" / "data", tmp_path / "point-link"):
        found = mounts.mounted_at(str(declared))
        assert found is not None, declared
        assert found.source == "via-links"
        assert found.mount_point == str(real / "data")


@pytest.mark.mounts
def test_a_directory_below_a_mount_is_not_itself_a_mountpoint(tmp_path: Path, tmpfs_at: Callable[..., None]) -> None:
    tmpfs_at(tmp_path / "m")
    (tmp_path / "m" / "inner").mkdir()
    assert mounts.mounted_at(str(tmp_path / "m" / "inner")) is None
    assert mounts.mounted_at(str(tmp_path / "m" / "inner" / "..")) is not None
