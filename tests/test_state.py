"""The state directory root writes and removes in (prepare/host/state.py): every
entry of ours is opened without following a link, is of the type we keep
and is owned by this user, and anything else is a permanent Fail naming the
entry and the fix, before anything is written. Real directories, links and
a full tmpfs; the pipeline's step 4 (prepare.build.workspace) finds them."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

import pytest
from nix_fixtures import build

from prepare.build import outputs
from prepare.fail import Fail
from prepare.host import state
from prepare.spec import PrepareSpec


def open_state(state_dir: Path) -> None:
    """Step 4 alone on `state_dir`, run and closed by the pipeline's executor."""
    spec = PrepareSpec(libtorch="cpu", cpu_only=True, flake="path:/srv/fdl-prepare", state_dir=str(state_dir))
    build(spec, [], steps=("state",))


def start_fail(state_dir: Path) -> Fail:
    """What step 4 says about `state_dir`: it is vetted before the first nix
    call, so no Nix is needed to see it."""
    with pytest.raises(Fail) as caught:
        open_state(state_dir)
    return caught.value


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory whose files must survive whatever a prepare does."""
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "precious").write_text("keep me")
    (folder / "sub").mkdir()
    (folder / "sub" / "also").write_text("keep me too")
    return folder


def intact(folder: Path) -> bool:
    return (folder / "precious").read_text() == "keep me" and (folder / "sub" / "also").exists()


@pytest.mark.parametrize(
    ("name", "make", "words"),
    [
        ("recipe", lambda p: p.write_text("x"), "is a file, where fdl-prepare keeps a directory"),
        ("lock", lambda p: p.mkdir(), "is a directory, where fdl-prepare keeps a file"),
        ("gcroots", lambda p: p.write_text("x"), "is a file, where fdl-prepare keeps a directory"),
        ("flake-registry.json", lambda p: p.mkdir(), "is a directory, where fdl-prepare keeps a file"),
        ("nix-version.json", lambda p: os.mkfifo(p), "is a special file"),
        ("warm.json", lambda p: p.mkdir(), "is a directory, where fdl-prepare keeps a file"),
    ],
)
def test_a_state_entry_of_the_wrong_type_is_permanent_and_names_it(tmp_path, name, make, words):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    make(state_dir / name)
    fail = start_fail(state_dir)
    assert fail.permanent
    assert f"{state_dir / name}, the state directory's" in fail.message and words in fail.message
    assert "remove it" in fail.message


@pytest.mark.parametrize("name", ["recipe", "gcroots", "lock", "flake-registry.json", "nix-version.json"])
def test_a_state_entry_that_is_a_symlink_is_refused_and_its_target_left_alone(tmp_path, victim, name):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    target = victim if name in ("recipe", "gcroots") else victim / "precious"
    (state_dir / name).symlink_to(target)
    fail = start_fail(state_dir)
    assert fail.permanent and "is a symlink" in fail.message and f"rm {state_dir / name}" in fail.message
    assert intact(victim)


def test_a_warm_record_that_is_a_symlink_is_only_ever_replaced(tmp_path, victim):
    # prepare.build.record reads it with O_NOFOLLOW and renames a new file over it:
    # a link there is a missing record, not a refusal (tests/test_warm.py).
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "warm.json").symlink_to(victim / "precious")
    state.vet(str(state_dir), "--state-dir", "state_dir (--state-dir)")
    assert intact(victim)


def test_the_state_directory_itself_as_a_symlink_is_refused(tmp_path, victim):
    link = tmp_path / "state"
    link.symlink_to(victim)
    fail = start_fail(link)
    assert fail.permanent and f"{link}, the state directory (from state_dir, --state-dir), is a symlink" in fail.message
    assert intact(victim) and not (victim / "gcroots").exists()


def test_a_state_directory_others_may_write_is_refused(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    state_dir.chmod(0o777)
    fail = start_fail(state_dir)
    assert fail.permanent and "writable by" in fail.message and f"chmod go-w {state_dir}" in fail.message


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_state_directory_of_another_user_is_refused(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    os.chown(state_dir, 54321, 54321)
    fail = start_fail(state_dir)
    assert fail.permanent and "owned by uid 54321" in fail.message and f"chown root: {state_dir}" in fail.message


@pytest.mark.skipif(os.geteuid() != 0, reason="giving an entry to another user needs root")
def test_a_state_entry_of_another_user_is_refused(tmp_path):
    state_dir = tmp_path / "state"
    (state_dir / "recipe").mkdir(parents=True)
    os.chown(state_dir / "recipe", 54321, 54321)
    fail = start_fail(state_dir)
    assert fail.permanent and "recipe directory" in fail.message and "owned by uid 54321" in fail.message


@pytest.mark.skipif(os.geteuid() != 0, reason="the walk up the path is root's")
def test_as_root_a_state_directory_under_a_directory_others_may_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone may rename the state directory away and plant another
    fail = start_fail(shared / "state")
    assert fail.permanent and "is not trusted" in fail.message and f"chmod go-w {shared}" in fail.message


@pytest.mark.skipif(os.geteuid() != 0, reason="the walk up the path is root's")
def test_as_root_a_state_directory_in_a_sticky_directory_is_fine_when_it_is_roots(tmp_path):
    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    state.vet(str(shared / "state"), "--state-dir", "state_dir (--state-dir)")
    assert (shared / "state" / "gcroots").is_dir()


# -- the recipe: written whole, never through a link ---------------------------------------


def test_the_recipe_is_written_whole_alone_in_its_directory(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    got = outputs.write_recipe(str(state_dir), {"bin": "train", "contract": 2})
    assert got == str(state_dir / "recipe")
    assert sorted(os.listdir(state_dir / "recipe")) == ["recipe.json"]
    assert json.loads((state_dir / "recipe" / "recipe.json").read_text()) == {"bin": "train", "contract": 2}
    # Nothing else left in the state directory: the temporary file was renamed.
    assert sorted(os.listdir(state_dir)) == ["recipe"]


def test_a_recipe_directory_holding_what_fdl_prepare_never_writes_there_is_permanent_and_nothing_in_it_goes(
    tmp_path, victim
):
    state_dir = tmp_path / "state"
    recipe_dir = state_dir / "recipe"
    recipe_dir.mkdir(parents=True)
    (recipe_dir / "old.json").write_text("{}")
    (recipe_dir / "notes").mkdir()
    (recipe_dir / "notes" / "draft").write_text("someone's")
    (recipe_dir / "to-victim").symlink_to(victim)
    for fail in (start_fail(state_dir), _write_fail(state_dir)):
        assert fail.permanent and fail.reason == "state.untrusted"
        assert "holds what fdl-prepare never writes there (notes, old.json, to-victim)" in fail.message
    assert sorted(os.listdir(recipe_dir)) == ["notes", "old.json", "to-victim"]
    assert (recipe_dir / "notes" / "draft").read_text() == "someone's" and intact(victim)


def _write_fail(state_dir: Path) -> Fail:
    with pytest.raises(Fail) as caught:
        outputs.write_recipe(str(state_dir), {"bin": "train"})
    return caught.value


def test_a_state_directory_holding_entries_fdl_prepare_does_not_know_is_permanent_naming_them(tmp_path):
    # state_dir pointed at someone's directory that happens to hold a recipe/.
    theirs = tmp_path / "srv"
    (theirs / "recipe").mkdir(parents=True)
    (theirs / "recipe" / "recipe.json").write_text("their recipe\n")
    (theirs / "website").mkdir()
    (theirs / "backup.tar").write_text("x")
    fail = start_fail(theirs)
    assert fail.permanent and fail.reason == "state.untrusted"
    assert "holds entries fdl-prepare did not make (backup.tar, website)" in fail.message
    assert "--state-dir" in fail.message
    assert (theirs / "recipe" / "recipe.json").read_text() == "their recipe\n"
    assert sorted(os.listdir(theirs)) == ["backup.tar", "recipe", "website"]


def test_a_temporary_file_a_killed_write_left_is_removed_and_any_other_hidden_file_refused(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    left = state_dir / f".warm.json.{os.urandom(8).hex()}.tmp"
    left.write_text("{")
    # What an earlier version named one.
    older = state_dir / "recipe.json.4242.tmp"
    older.write_text("{")
    with contextlib.suppress(Fail):
        open_state(state_dir)
    assert not left.exists() and not older.exists()
    (state_dir / ".bashrc").write_text("")
    assert "(.bashrc)" in start_fail(state_dir).message


@pytest.mark.parametrize("where", ["/", "/proc", "/proc/fdl-prepare", "/sys/fs/cgroup", "/dev/shm/fdl-prepare"])
def test_the_root_directory_or_a_pseudo_file_system_as_the_state_directory_is_permanent(where):
    fail = start_fail(Path(where))
    assert fail.permanent and fail.reason == "state.untrusted"
    assert f"the state directory {where} (from" in fail.message and "/var/lib/fdl-prepare" in fail.message
    assert not os.path.exists("/gcroots")


def test_the_recipe_through_a_linked_directory_deletes_nothing(tmp_path, victim):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "recipe").symlink_to(victim)
    with pytest.raises(Fail) as caught:
        outputs.write_recipe(str(state_dir), {"bin": "train"})
    assert caught.value.permanent and "is a symlink" in caught.value.message
    assert intact(victim) and not (victim / "recipe.json").exists()


def test_a_planted_file_at_the_old_predictable_temporary_name_is_not_written_through(tmp_path, victim):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / f"recipe.json.{os.getpid()}.tmp").symlink_to(victim / "precious")
    outputs.write_recipe(str(state_dir), {"bin": "train"})
    assert intact(victim)


def test_a_full_disk_while_writing_the_recipe_is_permanent_and_leaves_no_temporary_file(full_tmpfs: Path):
    before = sorted(os.listdir(full_tmpfs))
    with pytest.raises(Fail) as caught:
        outputs.write_recipe(str(full_tmpfs), {"bin": "train", "build": "x" * 8192})
    fail = caught.value
    assert fail.permanent
    assert "ENOSPC" in fail.message and "full" in fail.message and "state_dir (--state-dir)" in fail.message
    # The recipe directory may stay (empty); no temporary file does, here or in it.
    assert sorted(set(os.listdir(full_tmpfs)) - set(before)) == ["recipe"]
    assert os.listdir(full_tmpfs / "recipe") == []


def test_new_state_files_are_created_with_a_random_name_and_o_excl(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        state.write_at(fd, "x.json", b"{}")
    finally:
        os.close(fd)
    assert os.listdir(tmp_path) == ["x.json"]
    assert stat.S_IMODE((tmp_path / "x.json").stat().st_mode) == 0o644


@pytest.mark.skipif(os.geteuid() != 0, reason="running as another uid needs root")
def test_a_users_own_group_writable_state_directory_is_theirs_but_one_others_may_write_is_not():
    # umask 002 (Ubuntu's for users) makes 0775 directories in the user's own group.
    import shutil
    import tempfile

    import other_user

    folder = Path(tempfile.mkdtemp(prefix="fdl-state-"))
    try:
        folder.chmod(0o755)
        for mode, ok in ((0o775, True), (0o777, False)):
            state_dir = folder / f"state-{mode:o}"
            state_dir.mkdir()
            state_dir.chmod(mode)
            os.chown(state_dir, 54321, 54321)
            code = (
                "from prepare.host import state\nfrom prepare.fail import Fail\ntry:\n"
                f"    state.vet({str(state_dir)!r}, '--state-dir', 'state_dir (--state-dir)')\n    print('ok')\n"
                "except Fail as f:\n    print(f.message)\n"
            )
            done = other_user.run_as(54321, code)
            assert done.returncode == 0, done.stderr
            assert (done.stdout.strip() == "ok") is ok, done.stdout
    finally:
        shutil.rmtree(folder)
