"""Step 3, node-local directories, against real filesystems: kernel tmpfs
mounts that are read-only, small, or genuinely full, and real users."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import pwd
import shutil
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import other_user
import pytest

from prepare.fail import Fail
from prepare.host import dirs, mounts

# Uid and gid with no password-database entry on any sane test machine.
NOBODY_UID = 54321


def probes(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(dirs.PROBE_PREFIX))


@pytest.fixture
def box(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A HOME and a TMPDIR of the test's own, on a disk (not a tmpfs, which
    would add RAM notes of its own)."""
    home = disk_dir / "home"
    stage = disk_dir / "stage"
    home.mkdir()
    stage.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(stage))
    monkeypatch.delenv("TEMP", raising=False)
    monkeypatch.delenv("TMP", raising=False)
    return SimpleNamespace(home=home, stage=stage, cache=home / ".flodl" / "data")


def check_failing(notes: list[str] | None = None) -> Fail:
    with pytest.raises(Fail) as caught:
        dirs.check(notes if notes is not None else [])
    return caught.value


def as_user(uid: int, env: dict[str, str]) -> dict:
    """Run dirs.check in a child process as `uid`: permission checks that
    root skips are only real for someone else."""
    code = (
        "import json\n"
        "from prepare.host import dirs\n"
        "from prepare.fail import Fail\n"
        "notes = []\n"
        "try:\n"
        "    d = dirs.check(notes)\n"
        "    print(json.dumps({'cache': d.cache, 'stage': d.stage, 'notes': notes}))\n"
        "except Fail as f:\n"
        "    print(json.dumps({'kind': f.kind, 'message': f.message}))\n"
    )
    done = other_user.run_as(uid, code, {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def open_tmp():
    """A temp dir every uid may traverse (pytest's own is private to root),
    so that a permission failure is the one under test, not the path to it."""
    if os.geteuid() != 0:
        pytest.skip("running as another uid needs root")
    path = Path(tempfile.mkdtemp(prefix="fdl-dirs-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# -- the ordinary case -------------------------------------------------------


def test_a_writable_home_and_stage_pass_with_the_cache_created_and_no_probe_left(box):
    notes: list[str] = []
    got = dirs.check(notes)
    assert got == dirs.LocalDirs(cache=str(box.cache), stage=str(box.stage))
    assert box.cache.is_dir()
    assert probes(box.cache) == [] and probes(box.stage) == []


def test_checking_twice_is_idempotent(box):
    first = dirs.check([])
    second = dirs.check([])
    assert first == second
    assert os.listdir(box.cache) == [] and os.listdir(box.stage) == []


def test_a_disk_backed_home_and_stage_get_no_ram_note(box):
    mount = mounts.containing(str(box.stage))
    assert mount is not None and mount.fstype not in dirs.RAM_FILESYSTEMS, mount
    notes: list[str] = []
    dirs.check(notes)
    assert not any("spend RAM" in n for n in notes), notes


# -- the stage: TMPDIR must hold, no silent fallback -------------------------


def test_tmpdir_pointing_at_a_missing_directory_is_permanent_and_names_tmpdir(box, monkeypatch):
    missing = box.stage / "gone"
    monkeypatch.setenv("TMPDIR", str(missing))
    fail = check_failing()
    assert fail.kind == "permanent"
    assert f"TMPDIR={missing}" in fail.message
    assert "ENOENT" in fail.message
    assert f"mkdir -p {missing}" in fail.message


def test_a_control_character_in_tmpdir_is_permanent_and_forges_no_line(box, monkeypatch):
    # A real directory whose name carries a newline and an escape: every
    # message naming it would print a forged line.
    forged = box.stage / "x\n[fdl-prepare] prepared\x1b[2J"
    forged.mkdir()
    monkeypatch.setenv("TMPDIR", str(forged))
    fail = check_failing()
    assert fail.reason == "dirs.unwritable" and fail.kind == "permanent", fail.message
    assert "has a control character" in fail.message and "\n" not in fail.message and "\x1b" not in fail.message
    assert "x\\n[fdl-prepare] prepared\\x1b[2J" in fail.message


def test_python_itself_would_have_fallen_back_silently_where_the_check_refuses(box, monkeypatch):
    missing = box.stage / "gone"
    monkeypatch.setenv("TMPDIR", str(missing))
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert tempfile.gettempdir() != str(missing)
    assert check_failing().kind == "permanent"


def test_temp_is_used_when_tmpdir_is_unset_and_tmpdir_wins_over_temp(box, monkeypatch, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("TEMP", str(other))
    assert dirs.check([]).stage == str(box.stage)
    monkeypatch.delenv("TMPDIR")
    assert dirs.check([]).stage == str(other)


def test_a_stage_that_is_a_file_is_permanent(box, monkeypatch):
    file = box.stage / "file"
    file.write_text("")
    monkeypatch.setenv("TMPDIR", str(file))
    fail = check_failing()
    assert fail.kind == "permanent"
    assert "not a directory" in fail.message and "TMPDIR" in fail.message


# -- the cache path ----------------------------------------------------------


def test_a_home_that_is_a_file_fails_permanently_naming_the_file(box, monkeypatch):
    file = box.home / "not-a-dir"
    file.write_text("")
    monkeypatch.setenv("HOME", str(file))
    fail = check_failing()
    assert fail.kind == "permanent"
    assert "ENOTDIR" in fail.message
    assert f"mv {file} {file}.bak" in fail.message
    assert "HOME" in fail.message


def test_a_cache_whose_parent_is_a_file_fails_permanently_naming_that_file(box):
    (box.home / ".flodl").write_text("")
    fail = check_failing()
    assert fail.kind == "permanent"
    assert str(box.cache) in fail.message
    assert f"mv {box.home / '.flodl'} " in fail.message


def test_a_cache_that_is_itself_a_file_fails_permanently(box):
    box.cache.parent.mkdir(parents=True)
    box.cache.write_text("")
    fail = check_failing()
    assert fail.kind == "permanent"
    assert f"mv {box.cache} {box.cache}.bak" in fail.message


def test_a_relative_home_is_refused_because_the_cache_would_move(box, monkeypatch):
    monkeypatch.setenv("HOME", "relative/home")
    fail = check_failing()
    assert fail.kind == "permanent"
    assert "HOME='relative/home'" in fail.message


def test_an_unset_home_uses_the_password_database_home_with_a_note(box, monkeypatch):
    monkeypatch.delenv("HOME")
    entry = pwd.getpwuid(os.getuid())
    flodl = Path(entry.pw_dir) / ".flodl"
    existed = flodl.exists()
    had_data = (flodl / "data").exists()
    notes: list[str] = []
    try:
        got = dirs.check(notes)
    finally:
        # The fallback writes to the real home: leave it as it was found.
        if not had_data:
            with contextlib.suppress(OSError):
                (flodl / "data").rmdir()
        if not existed:
            with contextlib.suppress(OSError):
                flodl.rmdir()
    assert got.cache == os.path.join(entry.pw_dir, ".flodl", "data")
    assert any("HOME is unset" in n and entry.pw_dir in n for n in notes), notes


def test_an_unset_home_with_no_password_entry_is_permanent(open_tmp):
    if NOBODY_UID in {entry.pw_uid for entry in pwd.getpwall()}:
        pytest.skip(f"uid {NOBODY_UID} exists here")
    got = as_user(NOBODY_UID, {"TMPDIR": "/tmp"})
    assert got["kind"] == "permanent"
    assert f"uid {NOBODY_UID}" in got["message"] and "set HOME" in got["message"]


def test_a_home_owned_by_someone_else_fails_with_the_chown_fix(open_tmp):
    # Root's, 0755: another uid may enter it but not create in it.
    home = open_tmp / "home"
    stage = open_tmp / "stage"
    home.mkdir(mode=0o755)
    stage.mkdir()
    stage.chmod(0o1777)
    cache = home / ".flodl" / "data"
    got = as_user(NOBODY_UID, {"HOME": str(home), "TMPDIR": str(stage)})
    assert got["kind"] == "permanent", got
    assert f"dataset cache {cache} (from HOME={home}) cannot be created" in got["message"]
    assert "EACCES" in got["message"]
    assert f"sudo mkdir -p {cache} && sudo chown {NOBODY_UID} {cache}" in got["message"]


def test_a_stage_that_others_may_not_write_fails_although_it_exists(open_tmp):
    home = open_tmp / "theirs"
    stage = open_tmp / "stage"
    home.mkdir()
    os.chown(home, NOBODY_UID, NOBODY_UID)
    stage.mkdir(mode=0o755)
    got = as_user(NOBODY_UID, {"HOME": str(home), "TMPDIR": str(stage)})
    assert got["kind"] == "permanent", got
    assert f"stage directory {stage} (from TMPDIR={stage}) is not writable" in got["message"]
    assert "EACCES" in got["message"]
    assert f"sudo chown {NOBODY_UID} {stage}" in got["message"]
    assert (home / ".flodl" / "data").is_dir()
    assert probes(stage) == [] and probes(home / ".flodl" / "data") == []


def test_another_user_with_a_home_of_their_own_passes(open_tmp):
    home = open_tmp / "theirs"
    home.mkdir()
    os.chown(home, NOBODY_UID, NOBODY_UID)
    stage = open_tmp / "stage"
    stage.mkdir()
    stage.chmod(0o1777)
    got = as_user(NOBODY_UID, {"HOME": str(home), "TMPDIR": str(stage)})
    assert got.get("cache") == str(home / ".flodl" / "data"), got
    assert (home / ".flodl" / "data").stat().st_uid == NOBODY_UID
    assert probes(stage) == []


# -- real kernel mounts ------------------------------------------------------


def test_a_read_only_tmpfs_as_home_fails_permanently_naming_remount(box, monkeypatch, read_only_tmpfs):
    monkeypatch.setenv("HOME", str(read_only_tmpfs))
    fail = check_failing()
    assert fail.kind == "permanent"
    assert "EROFS" in fail.message and "HOME=" in fail.message
    assert f"sudo mount -o remount,rw {read_only_tmpfs}" in fail.message


def test_a_read_only_tmpfs_with_the_cache_already_there_fails_at_the_probe(box, monkeypatch, tmpfs):
    ro = tmpfs(read_only=True, populate=lambda p: (p / ".flodl" / "data").mkdir(parents=True))
    monkeypatch.setenv("HOME", str(ro))
    fail = check_failing()
    assert fail.kind == "permanent"
    assert "is not writable" in fail.message and "EROFS" in fail.message
    assert f"remount,rw {ro}" in fail.message


def test_a_read_only_stage_fails_permanently_naming_tmpdir(box, monkeypatch, read_only_tmpfs):
    monkeypatch.setenv("TMPDIR", str(read_only_tmpfs))
    fail = check_failing()
    assert fail.kind == "permanent"
    assert f"TMPDIR={read_only_tmpfs}" in fail.message and "EROFS" in fail.message


def test_a_small_tmpfs_cache_passes_with_a_free_space_note_and_a_ram_note(box, monkeypatch, tiny_tmpfs):
    monkeypatch.setenv("HOME", str(tiny_tmpfs))
    notes: list[str] = []
    got = dirs.check(notes)
    assert got.cache == str(tiny_tmpfs / ".flodl" / "data")
    low = [n for n in notes if "under 1 GiB" in n]
    assert len(low) == 1 and got.cache in low[0] and "KiB free" in low[0] and "HOME" in low[0]
    ram = [n for n in notes if "spend RAM" in n]
    assert len(ram) == 1 and "tmpfs" in ram[0] and got.cache in ram[0]
    assert probes(Path(got.cache)) == []


def test_a_tmpfs_stage_passes_with_a_note_naming_tmpdir(box, monkeypatch, plain_tmpfs):
    monkeypatch.setenv("TMPDIR", str(plain_tmpfs))
    notes: list[str] = []
    got = dirs.check(notes)
    assert got.stage == str(plain_tmpfs)
    ram = [n for n in notes if "spend RAM" in n]
    assert len(ram) == 1 and f"stage directory {plain_tmpfs} is on tmpfs" in ram[0] and "TMPDIR" in ram[0]
    assert probes(plain_tmpfs) == []


def test_a_genuinely_full_cache_fails_with_enospc_and_leaves_no_probe(box, monkeypatch, tmpfs):
    full = tmpfs("64k", full=True, populate=lambda p: (p / ".flodl" / "data").mkdir(parents=True))
    monkeypatch.setenv("HOME", str(full))
    fail = check_failing()
    assert fail.kind == "permanent"
    assert "ENOSPC" in fail.message and "HOME=" in fail.message
    assert f"du -xsh {full}/*" in fail.message
    assert probes(full / ".flodl" / "data") == []


def test_a_genuinely_full_stage_fails_with_enospc_and_leaves_no_probe(box, monkeypatch, full_tmpfs):
    monkeypatch.setenv("TMPDIR", str(full_tmpfs))
    fail = check_failing()
    assert fail.kind == "permanent"
    assert f"TMPDIR={full_tmpfs}" in fail.message and "ENOSPC" in fail.message
    assert probes(full_tmpfs) == []


def test_the_filesystem_type_is_found_under_a_mountpoint_with_a_space(tmpfs):
    point = tmpfs(name="with space")
    nested = point / "a" / "b"
    nested.mkdir(parents=True)
    mount = mounts.containing(str(nested))
    assert (mount.mount_point, mount.fstype) == (str(point), "tmpfs")


# -- concurrency -------------------------------------------------------------


def test_many_threads_checking_at_once_all_pass_and_leave_nothing_behind(box):
    barrier = threading.Barrier(32)
    errors: list[BaseException] = []
    results: list[dirs.LocalDirs] = []

    def one() -> None:
        barrier.wait()
        try:
            for _ in range(10):
                results.append(dirs.check([]))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 320 and len(set(results)) == 1
    assert os.listdir(box.cache) == [] and os.listdir(box.stage) == []


def _check_in_child(_: int) -> str:
    return dirs.check([]).cache


def test_several_processes_checking_at_once_all_pass_and_leave_nothing_behind(box):
    with multiprocessing.get_context("fork").Pool(4) as pool:
        caches = pool.map(_check_in_child, range(40))
    assert set(caches) == {str(box.cache)}
    assert os.listdir(box.cache) == [] and os.listdir(box.stage) == []


# -- the training user's directories -------------------------------------------------------------


@pytest.fixture
def trainer(box, open_tmp, monkeypatch):
    """A real user, and a stage it may write (a sticky 1777 directory, as
    /tmp is): pytest's own is root's alone."""
    stage = open_tmp / "stage"
    stage.mkdir()
    stage.chmod(0o1777)
    monkeypatch.setenv("TMPDIR", str(stage))
    box.stage = stage
    yield from other_user.real_user()


def _user(entry: pwd.struct_passwd):
    from prepare.host.training_user import lookup

    return lookup(entry.pw_name)


def test_the_training_users_cache_is_made_by_it_under_its_home_and_the_stage_proven_as_it(box, trainer):
    notes: list[str] = []
    got = dirs.check(notes, user=_user(trainer))
    cache = Path(trainer.pw_dir) / ".flodl" / "data"
    # Its home from the password database, not fdl-prepare's $HOME.
    assert got == dirs.LocalDirs(cache=str(cache), stage=str(box.stage))
    assert not box.cache.exists()
    for made in (cache, cache.parent):
        st = made.lstat()
        assert (st.st_uid, st.st_gid) == (trainer.pw_uid, trainer.pw_gid), made
    assert probes(cache) == [] and probes(box.stage) == []


def test_a_check_for_the_training_user_creates_nothing_and_names_the_missing_cache(box, trainer):
    before = sorted(os.listdir(trainer.pw_dir))
    got = dirs.check([], change=False, user=_user(trainer))
    cache = Path(trainer.pw_dir) / ".flodl" / "data"
    assert got.missing == (str(cache),)
    assert not cache.parent.exists() and sorted(os.listdir(trainer.pw_dir)) == before


def test_a_stage_root_may_write_but_the_training_user_may_not_fails_naming_the_user(
    box, trainer, open_tmp, monkeypatch
):
    # 0755 and root's: root would pass its own probe here, the user cannot write.
    monkeypatch.setenv("TMPDIR", str(open_tmp))
    fail = check_failing_for(trainer)
    assert fail.reason == "dirs.unwritable"
    assert f"stage directory {open_tmp}" in fail.message and f"{trainer.pw_name} may not write there" in fail.message
    assert probes(open_tmp) == []


@pytest.mark.parametrize("planted", [".flodl", ".flodl/data"])
def test_a_link_the_training_user_planted_leads_root_nowhere(box, trainer, open_tmp, planted):
    # Root's own directory, which a root-made cache through the link would land in.
    target = open_tmp / "roots"
    target.mkdir()
    (target / "data").mkdir() if planted == ".flodl" else None
    link = Path(trainer.pw_dir) / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    os.lchown(link.parent, trainer.pw_uid, trainer.pw_gid)
    link.symlink_to(target)
    os.lchown(link, trainer.pw_uid, trainer.pw_gid)
    before = sorted(p.name for p in target.rglob("*"))
    fail = check_failing_for(trainer)
    assert fail.reason == "dirs.unwritable"
    assert f"{link} is a symbolic link" in fail.message and "sudo rm" in fail.message
    # Nothing made or written through the link: no cache, no probe.
    assert sorted(p.name for p in target.rglob("*")) == before


def check_failing_for(entry: pwd.struct_passwd) -> Fail:
    with pytest.raises(Fail) as caught:
        dirs.check([], user=_user(entry))
    return caught.value


def test_a_training_user_whose_home_is_missing_fails_with_the_fix(box, trainer):
    shutil.rmtree(trainer.pw_dir)
    fail = check_failing_for(trainer)
    assert fail.reason == "dirs.unwritable"
    assert "cannot be created" in fail.message and trainer.pw_name in fail.message


@pytest.mark.parametrize(
    ("name", "words"),
    [("root", "is root"), ("nixbld1", "Nix build user"), ("fdl-no-such-user", "is not a user of this box")],
)
def test_root_an_unknown_user_and_a_nix_build_user_are_refused_as_the_training_user(name, words):
    from prepare.plan import plan
    from prepare.spec import PrepareSpec

    if name == "nixbld1":
        try:
            pwd.getpwnam(name)
        except KeyError:
            pytest.skip("no Nix build users on this box")
    with pytest.raises(Fail) as caught:
        plan(PrepareSpec(user=name))
    assert caught.value.reason == "config.invalid"
    assert f"user = {name!r}" in caught.value.message and words in caught.value.message
    assert "(--user)" in caught.value.message


def test_without_a_training_user_the_plan_keeps_todays_directories_and_smoke_user():
    from prepare.plan import plan
    from prepare.spec import PrepareSpec

    planned = plan(PrepareSpec())
    assert planned.user is None and planned.smoke.user == "dynamic"


def test_the_training_user_is_the_smoke_runs_user(trainer):
    from prepare.host.training_user import training_user
    from prepare.plan import plan
    from prepare.spec import PrepareSpec

    spec = PrepareSpec(user=trainer.pw_name, smoke_user="nobody")
    planned = plan(spec)
    assert planned.smoke.user == trainer.pw_name
    assert planned.user == training_user(spec)
    assert planned.user is not None and planned.user.home == trainer.pw_dir and planned.user.uid == trainer.pw_uid


def test_an_attempt_and_a_check_with_a_training_user_prove_its_directories(box, trainer):
    from prepare.pipeline import check, prepare
    from prepare.spec import PrepareSpec

    spec = PrepareSpec(cpu_only=True, user=trainer.pw_name)
    cache = Path(trainer.pw_dir) / ".flodl" / "data"
    checked = check(spec, [])
    assert checked.steps["dirs"].verdict == "would create" and str(cache) in checked.steps["dirs"].detail
    assert not cache.exists() and not box.cache.exists()
    prepare(spec, [])
    assert cache.is_dir() and cache.stat().st_uid == trainer.pw_uid
    # Root's own $HOME/.flodl/data is not the training user's, and is left alone.
    assert not box.cache.exists()
