"""The run manifest (.fdl-run.toml) and its merge over the box's recipe."""

from __future__ import annotations

import pytest

from prepare.build.manifest import FILENAME, Manifest, age, check_box, merge, notes_for, parse, read
from prepare.fail import Fail
from prepare.spec import SourceSpec

URL = "git+https://git.example/train?ref=main"

FULL = """
bin = "train"
cwd = "crates/train"
build = "cargo build --release"
args = ["--epochs", "3"]
run = "run-42"
built = true
published_epoch = 1767225600
origin = "controller-a"
"""


def test_a_full_manifest_parses_every_field():
    got = parse(FULL)
    assert got == Manifest(
        bin="train",
        cwd="crates/train",
        build="cargo build --release",
        args=("--epochs", "3"),
        run="run-42",
        built=True,
        published_epoch=1767225600,
        origin="controller-a",
    )


def test_a_published_manifest_outranks_the_boxs_own_recipe():
    box = SourceSpec(from_=URL, cwd=".", build="make", bin="old")
    recipe = merge(box, parse(FULL), URL)
    assert (recipe.bin, recipe.cwd, recipe.build) == ("train", "crates/train", "cargo build --release")
    assert recipe.args == ("--epochs", "3") and recipe.run_id == "run-42"
    assert recipe.flake_input("cu128", 1) == {
        "contract": 1,
        "libtorch": "cu128",
        "cwd": "crates/train",
        "build": "cargo build --release",
        "bin": "train",
    }


def test_a_manifest_that_omits_a_field_keeps_the_boxs_value():
    box = SourceSpec(from_=URL, cwd="app", build="make train", bin="boxbin")
    recipe = merge(box, parse('bin = "train"\nrun = "r"\n'), URL)
    assert recipe.bin == "train"  # from the manifest
    assert recipe.cwd == "app" and recipe.build == "make train"  # kept from the box


def test_no_manifest_uses_the_box_recipe_with_defaults():
    recipe = merge(SourceSpec(from_=URL, bin="train"), None, URL)
    assert (recipe.bin, recipe.cwd, recipe.build, recipe.args, recipe.run_id) == ("train", ".", None, None, None)
    assert not recipe.has_manifest


def test_no_manifest_and_no_bin_is_transient_and_names_the_fixes():
    with pytest.raises(Fail) as caught:
        merge(SourceSpec(from_=URL), None, URL)
    assert not caught.value.permanent
    assert URL in caught.value.message
    assert "fdl publish" in caught.value.message and "source.bin" in caught.value.message


def test_a_manifest_without_bin_on_a_box_without_bin_is_transient():
    with pytest.raises(Fail) as caught:
        merge(SourceSpec(from_=URL), parse('run = "r"\n'), URL)
    assert not caught.value.permanent
    assert FILENAME in caught.value.message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('bin = "train"\nargs = "--epochs 3"\n', "args"),
        ('bin = "train"\nargs = [1, 2]\n', "args"),
        ("bin = 7\n", "bin"),
        ('bin = "t"\nbuilt = "yes"\n', "built"),
        ('bin = "t"\npublished_epoch = true\n', "published_epoch"),
        ('bin = "t"\npublished_epoch = "yesterday"\n', "published_epoch"),
    ],
)
def test_a_manifest_with_a_wrong_type_is_transient_and_names_the_key(text, key):
    with pytest.raises(Fail) as caught:
        parse(text)
    assert not caught.value.permanent  # the next publish fixes it
    assert f"{key} =" in caught.value.message and FILENAME in caught.value.message


def test_a_manifest_that_is_not_toml_is_transient():
    with pytest.raises(Fail) as caught:
        parse('bin = "train\n')
    assert not caught.value.permanent
    assert "not valid TOML" in caught.value.message


@pytest.mark.parametrize("bad", ["/usr/bin/train", "../train", "a/../../b"])
def test_a_path_escaping_the_tree_is_refused_transient_from_a_manifest_permanent_from_the_box(bad):
    with pytest.raises(Fail) as caught:
        merge(SourceSpec(from_=URL), parse(f'bin = "{bad}"\n'), URL)
    assert not caught.value.permanent
    with pytest.raises(Fail) as caught:
        check_box(SourceSpec(from_=URL, bin=bad))
    assert caught.value.permanent
    assert "source.bin" in caught.value.message and "--source-bin" in caught.value.message
    with pytest.raises(Fail) as caught:
        check_box(SourceSpec(from_=URL, cwd=bad))
    assert "--source-cwd" in caught.value.message


def test_unknown_keys_are_ignored_with_a_note():
    got = parse('bin = "t"\nepochs = 3\n')
    assert got.unknown == ("epochs",)
    notes = notes_for(merge(SourceSpec(from_=URL), got, URL), got, 0)
    assert any("epochs" in n for n in notes)


def test_read_returns_none_without_a_manifest_and_parses_one_that_is_there(tmp_path):
    assert read(str(tmp_path)) is None
    (tmp_path / FILENAME).write_text(FULL)
    assert read(str(tmp_path)).run == "run-42"


@pytest.mark.parametrize(
    ("delta", "want"),
    [
        (0, "0s ago"),
        (42, "42s ago"),
        (300, "5m ago"),
        (3 * 3600 + 600, "3h10m ago"),
        (20 * 3600, "20h ago"),
        (30 * 3600, "1d ago"),
        (3 * 86400, "3d ago"),
    ],
)
def test_the_age_reads_like_published_5m_ago(delta, want):
    assert age(1_000_000, 1_000_000 + delta) == want


def test_a_publish_from_the_future_says_to_check_the_clock():
    assert "clock" in age(1_000_000 + 7200, 1_000_000)


def test_notes_name_the_run_its_age_and_a_build_the_controller_did_not_make():
    manifest = parse('bin = "t"\nrun = "run-9"\nbuilt = false\npublished_epoch = 1000\norigin = "ctl"\n')
    notes = notes_for(merge(SourceSpec(from_=URL), manifest, URL), manifest, 1300)
    assert notes[0] == "run run-9, published 5m ago, from ctl"
    assert "NOT built by the controller" in notes[1]


def test_a_manifest_that_is_not_utf8_is_transient_and_names_the_file(tmp_path):
    # A run id garbled in transit must not reach the run as "run-\ufffd".
    (tmp_path / FILENAME).write_bytes(b'bin = "train"\nrun = "run-\xff42"\n')
    with pytest.raises(Fail) as caught:
        read(str(tmp_path))
    assert not caught.value.permanent  # like any other malformed manifest: the next publish fixes it
    assert str(tmp_path / FILENAME) in caught.value.message
    assert "UTF-8" in caught.value.message and "line 2" in caught.value.message
    assert "publish a fixed" in caught.value.message


def test_a_manifest_that_cannot_be_read_names_the_os_error_as_the_other_steps_do(tmp_path):
    (tmp_path / FILENAME).mkdir()
    with pytest.raises(Fail) as caught:
        read(str(tmp_path))
    assert not caught.value.permanent
    assert str(tmp_path / FILENAME) in caught.value.message
    assert "Is a directory (EISDIR)" in caught.value.message


def test_a_manifest_nested_thousands_deep_is_transient_not_a_recursion_error():
    with pytest.raises(Fail) as caught:
        parse("bin = " + "[" * 5000 + "]" * 5000 + "\n")
    assert not caught.value.permanent
    assert "nests arrays or tables" in caught.value.message and "publish a fixed" in caught.value.message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('bin = "tr\\u0000ain"\n', "bin"),
        ('bin = "t"\ncwd = "a\\u0000"\n', "cwd"),
        ('bin = "t"\nargs = ["--x\\u0000"]\n', "args"),
    ],
)
def test_a_nul_character_in_a_manifest_value_is_transient_and_names_the_key(text, key):
    with pytest.raises(Fail) as caught:
        parse(text)
    assert not caught.value.permanent
    assert f"NUL character (\\u0000) in {key}" in caught.value.message


@pytest.mark.parametrize("target", ["/etc/passwd", "/dev/zero"])
def test_a_manifest_that_is_a_symlink_is_not_followed(tmp_path, target):
    # A published tree may hold any symlink: root must not read a file of
    # this box (or /dev/zero, for ever) as the run's manifest.
    (tmp_path / FILENAME).symlink_to(target)
    with pytest.raises(Fail) as caught:
        read(str(tmp_path))
    assert not caught.value.permanent
    assert f"{tmp_path / FILENAME} is a symlink" in caught.value.message


def test_a_manifest_larger_than_any_manifest_is_transient(tmp_path):
    (tmp_path / FILENAME).write_text('bin = "t"\n' + "# pad\n" * (1 << 18))
    with pytest.raises(Fail) as caught:
        read(str(tmp_path))
    assert not caught.value.permanent and "EFBIG" in caught.value.message


def test_a_cwd_that_leads_out_of_the_tree_through_a_symlink_is_permanent(tmp_path):
    from prepare.build.manifest import check_tree

    tree = tmp_path / "tree"
    (tree / "inside").mkdir(parents=True)
    (tree / "escape").symlink_to("/etc")
    (tree / "fine").symlink_to("inside")
    recipe = merge(SourceSpec(from_=URL, bin="t"), parse('cwd = "escape"\n'), URL)
    with pytest.raises(Fail) as caught:
        check_tree(recipe, str(tree), URL)
    assert caught.value.permanent
    assert "leads out of the training source through a symlink (to /etc)" in caught.value.message
    assert "the run manifest" in caught.value.message
    # The box's own value, too; and a link that stays inside the tree is fine.
    with pytest.raises(Fail) as caught:
        check_tree(merge(SourceSpec(from_=URL, bin="t", cwd="escape"), None, URL), str(tree), URL)
    assert caught.value.permanent and "source.cwd (--source-cwd)" in caught.value.message
    check_tree(merge(SourceSpec(from_=URL, bin="t", cwd="fine"), None, URL), str(tree), URL)


def test_a_manifests_strings_are_noted_escaped_so_they_forge_no_line_and_drive_no_terminal():
    text = (
        'bin = "train"\nrun = "r1\\nfdl-prepare: prepared in 0.01s"\n'
        'origin = "ci\\u001b[2J\\u001b]0;owned\\u0007\\u202eevil"\n"\\u001b[31mkey" = 1\n'
    )
    manifest = parse(text)
    notes = notes_for(merge(SourceSpec(from_=URL), manifest, URL), manifest, 0)
    said = "\n".join(notes)
    assert len(said.splitlines()) == len(notes) == 2
    assert all(c not in said for c in ("\x1b", "\x07", "\u202e", "\r"))
    assert "run r1\\nfdl-prepare: prepared in 0.01s" in notes[0]
    assert "from ci\\x1b[2J\\x1b]0;owned\\x07\\u202eevil" in notes[0]
    assert "\\x1b[31mkey" in notes[1]


def test_a_nul_inside_the_manifests_smoke_list_is_transient_naming_smoke():
    # Before: it reached execve, which refuses it as a ValueError (exit 70).
    with pytest.raises(Fail) as caught:
        parse('bin = "train"\nsmoke = ["--steps", "1\\u0000; rm -rf /"]\n')
    fail = caught.value
    assert not fail.permanent and fail.reason == "source.manifest-invalid"
    assert "a NUL character (\\u0000) in smoke" in fail.message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (
            'bin = "train"\nsmoke = ["' + "x" * 200_000 + '"]\n',
            "smoke item 0 that is 200000 bytes long, past the 16 KiB",
        ),
        ('bin = "train"\nargs = [' + ", ".join(['"' + "y" * 10_000 + '"'] * 10) + "]\n", "past the 64 KiB a list may"),
        ('bin = "' + "z" * 20_000 + '"\n', "bin that is 20000 bytes long"),
    ],
    ids=["one-argument", "the-list", "a-string"],
)
def test_an_over_long_manifest_value_is_transient_naming_the_limit(text, words):
    with pytest.raises(Fail) as caught:
        parse(text)
    fail = caught.value
    assert not fail.permanent and fail.reason == "source.manifest-invalid"
    assert words in fail.message and "4 KiB a URL, 16 KiB any other value, 64 KiB a list in all" in fail.message
    assert len(fail.message) < 1000


def test_a_members_bin_may_climb_out_of_cwd_to_the_workspace_target_never_out_of_the_source():
    # floDl's `bin` is relative to `cwd`: a member names the workspace's target/.
    got = merge(SourceSpec(from_=URL), Manifest(bin="../target/release/app", cwd="crates/app"), URL)
    assert (got.cwd, got.bin) == ("crates/app", "../target/release/app")
    check_box(SourceSpec(from_=URL, cwd="app", bin="../target/release/app"))

    with pytest.raises(Fail) as caught:
        merge(SourceSpec(from_=URL), Manifest(bin="../../target/release/app", cwd="crates"), URL)
    assert caught.value.reason == "source.manifest-invalid" and not caught.value.permanent
    assert "that stays inside the source" in caught.value.message
    with pytest.raises(Fail) as caught:
        check_box(SourceSpec(from_=URL, bin="../target/release/app"))
    assert caught.value.reason == "config.invalid" and caught.value.permanent
