"""floDl's run manifest (.fdl-run.yml): parsed bounded and hostile-input-proof,
merged over the box's recipe; and the tree checked against its digest
sidecar (.fdl-run.sha256) as floDl's worker checks it."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from pathlib import Path

import pytest
import yaml

from prepare.build import digest
from prepare.build.manifest import (
    DIGEST_FILE,
    FIELDS,
    FILENAME,
    Digest,
    Manifest,
    age,
    check_box,
    dump,
    merge,
    mid_publish,
    notes_for,
    parse,
    read,
)
from prepare.fail import Fail
from prepare.spec import SourceSpec

URL = "git+https://git.example/train?ref=main"
REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "trainer"

# Every field floDl's `Manifest` has, as `fdl publish` writes them.
FULL = """
# Written by `fdl publish`.
cwd: crates/train
build: cargo build --release
bin: train
args:
- --epochs
- '3'
origin: file:///srv/train
rustc: rustc 1.90.0 (1159e78c4 2025-09-14)
published_epoch: 1767225600
run: 5f0c2a9e8d7b6a5f4e3d2c1b0a998877
built: true
digest:
  sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
  files: 3
  bytes: 120
"""


def test_a_full_manifest_parses_every_field():
    assert parse(FULL) == Manifest(
        bin="train",
        cwd="crates/train",
        build="cargo build --release",
        args=("--epochs", "3"),
        origin="file:///srv/train",
        rustc="rustc 1.90.0 (1159e78c4 2025-09-14)",
        published_epoch=1767225600,
        run="5f0c2a9e8d7b6a5f4e3d2c1b0a998877",
        built=True,
        digest=Digest(sha256="9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", files=3, bytes=120),
    )


def test_flodls_defaults_apply_to_what_a_manifest_leaves_out():
    # bin alone: args [] and built false (serde's defaults), the rest unsaid.
    got = parse("bin: target/release/train\n")
    assert got == Manifest(bin="target/release/train", args=(), built=False)
    assert got.cwd is None and got.build is None and got.run is None and got.digest is None and got.rustc is None
    # `~` on an optional field is the field left out, as serde reads it.
    assert parse("bin: t\ncwd: ~\nrun: null\n") == Manifest(bin="t")


def test_a_published_manifest_outranks_the_boxs_own_recipe():
    box = SourceSpec(from_=URL, cwd=".", build="make", bin="old")
    recipe = merge(box, parse(FULL), URL)
    assert (recipe.bin, recipe.cwd, recipe.build) == ("train", "crates/train", "cargo build --release")
    assert recipe.args == ("--epochs", "3") and recipe.run_id == "5f0c2a9e8d7b6a5f4e3d2c1b0a998877"
    assert recipe.flake_input("cu128", 2) == {
        "contract": 2,
        "libtorch": "cu128",
        "cwd": "crates/train",
        "build": "cargo build --release",
        "bin": "train",
    }


def test_a_manifest_that_omits_a_field_keeps_the_boxs_value():
    box = SourceSpec(from_=URL, cwd="app", build="make train", bin="boxbin", smoke=("--smoke",))
    recipe = merge(box, parse("bin: train\nrun: r\n"), URL)
    assert recipe.bin == "train"  # from the manifest
    assert recipe.cwd == "app" and recipe.build == "make train"  # kept from the box
    assert recipe.smoke == ("--smoke",) and recipe.args == ()  # floDl's default args


def test_no_manifest_uses_the_box_recipe_with_defaults():
    recipe = merge(SourceSpec(from_=URL, bin="train"), None, URL)
    assert (recipe.bin, recipe.cwd, recipe.build, recipe.args, recipe.run_id) == ("train", ".", None, None, None)
    assert not recipe.has_manifest


def test_no_manifest_and_no_bin_is_transient_and_names_the_fixes():
    with pytest.raises(Fail) as caught:
        merge(SourceSpec(from_=URL), None, URL)
    assert caught.value.reason == "source.not-published"
    assert URL in caught.value.message
    assert "fdl publish" in caught.value.message and "source.bin" in caught.value.message


def test_a_sidecar_without_a_manifest_is_a_publish_under_way_even_for_a_box_with_a_bin(tmp_path):
    # floDl writes the sidecar first and the manifest last: a tree with the
    # one and not the other was fetched between them.
    assert not mid_publish(str(tmp_path))
    (tmp_path / DIGEST_FILE).write_text("")
    assert mid_publish(str(tmp_path))
    with pytest.raises(Fail) as caught:
        merge(SourceSpec(from_=URL, bin="train"), None, URL, mid_publish=True)
    assert caught.value.reason == "source.not-published" and not caught.value.permanent
    assert DIGEST_FILE in caught.value.message and "a publish is under way" in caught.value.message


def test_a_manifest_without_bin_is_transient_and_names_bin_whatever_the_box_has():
    # floDl's `bin` is required: a manifest without one is not floDl's.
    with pytest.raises(Fail) as caught:
        parse("run: r\n")
    assert caught.value.reason == "source.manifest-invalid"
    assert "has no bin" in caught.value.message and FILENAME in caught.value.message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("bin: train\nargs: --epochs 3\n", "args"),
        ("bin: train\nargs: [1, 2]\n", "args"),
        ("bin: 7\n", "bin"),
        ("bin: [a]\n", "bin"),
        ("bin: t\nbuilt: 'yes'\n", "built"),
        # YAML 1.2, as floDl's serde_yaml_ng reads it: `yes` is a string.
        ("bin: t\nbuilt: yes\n", "built"),
        ("bin: t\npublished_epoch: true\n", "published_epoch"),
        ("bin: t\npublished_epoch: yesterday\n", "published_epoch"),
        ("bin: t\npublished_epoch: -5\n", "published_epoch"),
        ("bin: t\npublished_epoch: 2026-01-01\n", "published_epoch"),
        ("bin: t\npublished_epoch: 1.5\n", "published_epoch"),
        ("bin: t\nrun: 42\n", "run"),
        ("bin: t\nrustc: {v: 1}\n", "rustc"),
        ("bin: t\ndigest: abc\n", "digest"),
        ("bin: t\ndigest: {sha256: abc, files: 1, bytes: 2}\n", "digest.sha256"),
        ("bin: t\ndigest: {sha256: " + "A" * 64 + ", files: 1, bytes: 2}\n", "digest.sha256"),
        ("bin: t\ndigest: {sha256: " + "a" * 64 + ", files: x, bytes: 2}\n", "digest.files"),
        ("bin: t\ndigest: {sha256: " + "a" * 64 + ", files: 1}\n", "digest.bytes"),
        ("bin: !!binary aGVsbG8=\n", "bin"),
    ],
)
def test_a_manifest_with_a_wrong_type_is_transient_and_names_the_key(text, key):
    with pytest.raises(Fail) as caught:
        parse(text)
    assert caught.value.reason == "source.manifest-invalid"
    assert not caught.value.permanent  # the next publish fixes it
    assert f"{key} =" in caught.value.message and FILENAME in caught.value.message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("bin: 'train\n", "not valid YAML"),
        ("bin: [t\n", "not valid YAML"),
        ("bin: " + "[" * 5000 + "]" * 5000 + "\n", "not valid YAML"),  # libyaml's own bound, 1000 levels
        ("bin: t\n---\nbin: u\n", "not valid YAML"),
        ("bin: !!python/object/apply:os.system [id]\n", "not valid YAML"),
        ("- bin\n- t\n", "holds a list, not a mapping"),
        ("just a string\n", "holds a string, not a mapping"),
        ("", "holds nothing, not a mapping"),
        ("# only a comment\n", "holds nothing, not a mapping"),
        ("bin: a\nbin: b\n", "the key 'bin' twice (line 2)"),
        ("bin: t\n1: x\n", "a key that is not a string (1, line 2)"),
        ("bin: t\n[a]: x\n", "a key that is not a string"),
        ("bin: t\nnull: x\n", "a key that is not a string (None"),
    ],
)
def test_a_manifest_that_is_not_flodls_yaml_is_transient_and_says_what(text, words):
    with pytest.raises(Fail) as caught:
        parse(text)
    assert caught.value.reason == "source.manifest-invalid"
    assert words in caught.value.message and f"publish a fixed {FILENAME}" in caught.value.message
    assert len(caught.value.message) < 1000


BILLION_LAUGHS = (
    "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
    + "bin: t\n"
)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (BILLION_LAUGHS, "an anchor (&a, line 1)"),
        ("bin: *nowhere\n", "an alias (*nowhere, line 1)"),
        ("bin: &x t\nrun: r\n", "an anchor (&x, line 1)"),
        ("bin: " + "[" * 100 + "]" * 100 + "\n", "nested more than 16 levels deep"),
        ("bin: t\nx: " + "{a: " * 17 + "1" + "}" * 17 + "\n", "nested more than 16 levels deep"),
        ("bin: t\nx: [" + ", ".join(["[]"] * 60_000) + "]\n", "more than 50000 values"),
        # What once made one 765 KB note: 85,000 keys, never built into a table.
        ("bin: t\n" + "".join(f"k{i}: 1\n" for i in range(85_000)), "more than 50000 values"),
    ],
    ids=["billion-laughs", "alias", "anchor", "deep-lists", "deep-maps", "wide", "85000-unknown-keys"],
)
def test_yaml_bombs_are_refused_before_anything_expands(text, words):
    started = time.monotonic()
    with pytest.raises(Fail) as caught:
        parse(text)
    assert caught.value.reason == "source.manifest-invalid" and not caught.value.permanent
    assert words in caught.value.message and "which a run manifest never does" in caught.value.message
    assert time.monotonic() - started < 10


def test_a_merge_key_is_no_merge_in_yaml_1_2_only_a_key_floDl_does_not_know():
    got = parse("bin: t\n<<: {run: r}\n")
    assert got.unknown == ("<<",) and got.run is None


@pytest.mark.parametrize("bad", ["/usr/bin/train", "../train", "a/../../b"])
def test_a_path_escaping_the_tree_is_refused_transient_from_a_manifest_permanent_from_the_box(bad):
    with pytest.raises(Fail) as caught:
        merge(SourceSpec(from_=URL), parse(f"bin: '{bad}'\n"), URL)
    assert caught.value.reason == "source.manifest-invalid"
    with pytest.raises(Fail) as caught:
        check_box(SourceSpec(from_=URL, bin=bad))
    assert caught.value.reason == "config.invalid"
    assert "source.bin" in caught.value.message and "--source-bin" in caught.value.message
    with pytest.raises(Fail) as caught:
        check_box(SourceSpec(from_=URL, cwd=bad))
    assert "--source-cwd" in caught.value.message


def test_unknown_keys_are_ignored_with_a_note():
    got = parse("bin: t\nepochs: 3\ndigest: {sha256: " + "a" * 64 + ", files: 1, bytes: 2, algo: x}\n")
    assert got.unknown == ("epochs", "digest.algo") and got.unknown_count == 2
    notes = notes_for(merge(SourceSpec(from_=URL), got, URL), got, 0)
    assert any("2 keys this fdl-prepare does not know, ignored: epochs, digest.algo" in n for n in notes)


def test_a_smoke_key_is_not_flodls_so_it_is_noted_and_never_run():
    # floDl's manifest has no smoke: the smoke run is the box's own.
    got = parse("bin: t\nsmoke: [--smoke]\n")
    assert got.unknown == ("smoke",)
    assert merge(SourceSpec(from_=URL, smoke=("--box",)), got, URL).smoke == ("--box",)
    assert merge(SourceSpec(from_=URL), got, URL).smoke is None


def test_the_note_on_unknown_keys_is_bounded_however_many_there_are():
    # 20,000 long keys (the node bound refuses many more): 8 named, each cut, and a count.
    text = "bin: t\n" + "".join(f"{'k' * 40}{i}: 1\n" for i in range(20_000))
    got = parse(text)
    assert got.unknown_count == 20_000 and len(got.unknown) == 8
    note = notes_for(merge(SourceSpec(from_=URL), got, URL), got, 0)[-1]
    assert "20000 keys this fdl-prepare does not know" in note and "and 19992 more" in note
    assert len(note) < 1000


def test_read_returns_none_without_a_manifest_and_parses_one_that_is_there(tmp_path):
    assert read(str(tmp_path)) is None
    (tmp_path / FILENAME).write_text(FULL)
    assert read(str(tmp_path)).run == "5f0c2a9e8d7b6a5f4e3d2c1b0a998877"


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


def test_notes_name_the_run_its_age_and_a_build_the_publisher_did_not_make():
    manifest = parse("bin: t\nrun: run-9\nbuilt: false\npublished_epoch: 1000\norigin: ctl\n")
    notes = notes_for(merge(SourceSpec(from_=URL), manifest, URL), manifest, 1300)
    assert notes[0] == "run run-9, published 5m ago, from ctl"
    assert "NOT built by the publisher" in notes[1]
    # `built` left out is floDl's false: said the same way.
    bare = parse("bin: t\nrun: run-9\n")
    assert any("NOT built" in n for n in notes_for(merge(SourceSpec(from_=URL), bare, URL), bare, 0))


def test_the_publishers_rustc_is_a_note_and_a_different_one_here_says_so():
    manifest = parse("bin: t\nbuilt: true\nrustc: rustc 1.90.0 (1159e78c4 2025-09-14)\n")
    recipe = merge(SourceSpec(from_=URL), manifest, URL)
    assert any("the publisher built with rustc 1.90.0" in n and "advisory" in n for n in notes_for(recipe, manifest, 0))
    assert not any("builds with rustc" in n for n in notes_for(recipe, manifest, 0, toolchain="1.90.0"))
    differs = notes_for(recipe, manifest, 0, toolchain="1.86.0")
    assert any("this box's flake builds with rustc 1.86.0" in n for n in differs)


def test_a_manifest_that_is_not_utf8_is_transient_and_names_the_file(tmp_path):
    # A run id garbled in transit must not reach the run as "run-\ufffd".
    (tmp_path / FILENAME).write_bytes(b"bin: train\nrun: run-\xff42\n")
    with pytest.raises(Fail) as caught:
        read(str(tmp_path))
    assert caught.value.reason == "source.manifest-invalid"
    assert str(tmp_path / FILENAME) in caught.value.message
    assert "UTF-8" in caught.value.message and "line 2" in caught.value.message
    assert "publish a fixed" in caught.value.message


def test_a_manifest_that_cannot_be_read_names_the_os_error_as_the_other_steps_do(tmp_path):
    (tmp_path / FILENAME).mkdir()
    with pytest.raises(Fail) as caught:
        read(str(tmp_path))
    assert caught.value.reason == "source.manifest-invalid"
    assert str(tmp_path / FILENAME) in caught.value.message
    assert "Is a directory (EISDIR)" in caught.value.message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('bin: "tr\\u0000ain"\n', "bin"),
        ('bin: t\ncwd: "a\\0"\n', "cwd"),
        ('bin: t\nargs: ["--x\\u0000"]\n', "args"),
    ],
)
def test_a_nul_character_in_a_manifest_value_is_transient_and_names_the_key(text, key):
    with pytest.raises(Fail) as caught:
        parse(text)
    assert caught.value.reason == "source.manifest-invalid"
    assert f"NUL character (\\u0000) in {key}" in caught.value.message


def test_a_raw_nul_byte_in_a_manifest_is_transient_naming_its_line():
    with pytest.raises(Fail) as caught:
        parse("bin: t\nrun: r\0x\n")
    assert caught.value.reason == "source.manifest-invalid"
    assert "NUL character (\\u0000) on line 2" in caught.value.message


@pytest.mark.parametrize("target", ["/etc/passwd", "/dev/zero"])
def test_a_manifest_that_is_a_symlink_is_not_followed(tmp_path, target):
    # A published tree may hold any symlink: root must not read a file of
    # this box (or /dev/zero, for ever) as the run's manifest.
    (tmp_path / FILENAME).symlink_to(target)
    with pytest.raises(Fail) as caught:
        read(str(tmp_path))
    assert caught.value.reason == "source.manifest-invalid"
    assert f"{tmp_path / FILENAME} is a symlink" in caught.value.message


def test_a_manifest_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / FILENAME)
    with pytest.raises(Fail) as caught:
        read(str(tmp_path))
    assert caught.value.reason == "source.manifest-invalid" and "not a regular file" in caught.value.message


def test_a_manifest_larger_than_any_manifest_is_transient(tmp_path):
    (tmp_path / FILENAME).write_text("bin: t\n" + "# pad\n" * (1 << 18))
    with pytest.raises(Fail) as caught:
        read(str(tmp_path))
    assert caught.value.reason == "source.manifest-invalid" and "EFBIG" in caught.value.message


def test_a_cwd_that_leads_out_of_the_tree_through_a_symlink_is_permanent(tmp_path):
    from prepare.build.manifest import check_tree

    tree = tmp_path / "tree"
    (tree / "inside").mkdir(parents=True)
    (tree / "escape").symlink_to("/etc")
    (tree / "fine").symlink_to("inside")
    recipe = merge(SourceSpec(from_=URL, bin="t"), parse("bin: t\ncwd: escape\n"), URL)
    with pytest.raises(Fail) as caught:
        check_tree(recipe, str(tree), URL)
    assert caught.value.reason == "source.cwd-escapes"
    assert "leads out of the training source through a symlink (to /etc)" in caught.value.message
    assert "the run manifest" in caught.value.message
    # The box's own value, too; and a link that stays inside the tree is fine.
    with pytest.raises(Fail) as caught:
        check_tree(merge(SourceSpec(from_=URL, bin="t", cwd="escape"), None, URL), str(tree), URL)
    assert caught.value.permanent and "source.cwd (--source-cwd)" in caught.value.message
    check_tree(merge(SourceSpec(from_=URL, bin="t", cwd="fine"), None, URL), str(tree), URL)


def test_a_manifests_strings_are_noted_escaped_so_they_forge_no_line_and_drive_no_terminal():
    text = (
        'bin: train\nrun: "r1\\nfdl-prepare: prepared in 0.01s"\n'
        'origin: "ci\\e[2J\\e]0;owned\\a\\u202eevil"\n"\\e[31mkey": 1\n'
    )
    manifest = parse(text)
    notes = notes_for(merge(SourceSpec(from_=URL), manifest, URL), manifest, 0)
    said = "\n".join(notes)
    assert len(said.splitlines()) == len(notes) == 3
    assert all(c not in said for c in ("\x1b", "\x07", "\u202e", "\r"))
    assert "run r1\\nfdl-prepare: prepared in 0.01s" in notes[0]
    assert "from ci\\x1b[2J\\x1b]0;owned\\x07\\u202eevil" in notes[0]
    assert "\\x1b[31mkey" in notes[2]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("bin: train\nargs: ['" + "x" * 200_000 + "']\n", "args item 0 that is 200000 bytes long, past the 16 KiB"),
        ("bin: train\nargs: [" + ", ".join(["'" + "y" * 10_000 + "'"] * 10) + "]\n", "past the 64 KiB a list may"),
        ("bin: '" + "z" * 20_000 + "'\n", "bin that is 20000 bytes long"),
        ("bin: t\nrun: '" + "r" * 20_000 + "'\n", "run that is 20000 bytes long"),
    ],
    ids=["one-argument", "the-list", "a-string", "the-run"],
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


# --- what a publish writes ----------------------------------------------------------------------


def test_the_yaml_written_has_flodls_keys_only_and_reads_back_as_written():
    written = Manifest(
        bin="target/release/train",
        cwd="crates/train",
        # Strings YAML 1.1 or 1.2 would read as something else: quoted.
        args=("--epochs", "2", "yes", "on", "0o17", "1e5", "~", "", "null", "017", "- x", "a: b", "#c"),
        origin="host:/srv/train@abc",
        published_epoch=1767225600,
        run="0123456789abcdef0123456789abcdef",
        built=True,
        digest=Digest(sha256="ab" * 32, files=5, bytes=18980),
    )
    text = dump(written, "# a header\n")
    assert text.startswith("# a header\n") and parse(text) == written
    # Any YAML reader (here PyYAML's own 1.1 one) reads floDl's keys, no
    # other, in floDl's order, `digest` as floDl's TreeDigest.
    plain = yaml.safe_load(text)
    assert list(plain) == [k for k in FIELDS if k not in ("build", "rustc")]
    assert set(plain["digest"]) == {"sha256", "files", "bytes"}
    assert plain["args"] == list(written.args) and plain["built"] is True
    # serde's skip_serializing_if: an unset option is left out, not null.
    assert set(yaml.safe_load(dump(Manifest(bin="t")))) == {"bin", "args", "built"}


# --- the digest -------------------------------------------------------------------------------


def published_tree(root: Path) -> Path:
    """A tree as floDl's publish leaves it: files, a target/ (not in the
    set, at any depth), the sidecar, then the manifest."""
    (root / "src").mkdir(parents=True)
    (root / "Cargo.toml").write_text('[package]\nname = "t"\n')
    (root / "src" / "main.rs").write_text("fn main() {}\n")
    (root / "crates" / "x" / "target" / "debug").mkdir(parents=True)
    (root / "crates" / "x" / "lib.rs").write_text("// x\n")
    (root / "target").mkdir()
    (root / "target" / "built").write_text("a build's output\n")
    (root / "crates" / "x" / "target" / "debug" / "junk").write_text("junk\n")
    sidecar, tree_digest = digest.compute(str(root), digest.tree_files(str(root)))
    (root / DIGEST_FILE).write_text(sidecar)
    (root / FILENAME).write_text(dump(Manifest(bin="target/release/t", digest=tree_digest)))
    return root


def verify(root: Path) -> list[str]:
    manifest = read(str(root))
    assert manifest is not None
    return digest.verify(str(root), manifest)


def test_the_sidecar_is_sha256sum_format_sorted_and_slash_joined_as_flodl_writes_it(tmp_path):
    root = published_tree(tmp_path / "t")
    lines = (root / DIGEST_FILE).read_text().splitlines()
    assert [line.split("  ", 1)[1] for line in lines] == ["Cargo.toml", "crates/x/lib.rs", "src/main.rs"]
    for line in lines:
        hexdigest, rel = line.split("  ", 1)
        assert hexdigest == hashlib.sha256((root / rel).read_bytes()).hexdigest()
    manifest = read(str(root))
    assert manifest.digest.sha256 == hashlib.sha256((root / DIGEST_FILE).read_bytes()).hexdigest()
    assert (manifest.digest.files, manifest.digest.bytes) == (
        3,
        sum((root / r).stat().st_size for r in ["Cargo.toml", "crates/x/lib.rs", "src/main.rs"]),
    )


def test_a_tree_that_matches_its_digest_passes_and_target_dirs_at_any_depth_are_ignored(tmp_path):
    root = published_tree(tmp_path / "t")
    (root / "target" / "later").write_text("a box's own build\n")
    (root / "crates" / "x" / "target" / "debug" / "more").write_text("more\n")
    notes = verify(root)
    assert "matches its digest (3 files" in notes[0]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda r: (r / "src" / "main.rs").write_text("fn main() { evil() }\n"), "src/main.rs differs"),
        (lambda r: (r / "src" / "extra.rs").write_text("// new\n"), "src/extra.rs is not in the published set"),
        (lambda r: (r / "crates" / "x" / "lib.rs").unlink(), "crates/x/lib.rs is missing"),
        (
            lambda r: (r / "src" / "targets").mkdir() or (r / "src" / "targets" / "a").write_text("x"),
            "src/targets/a is not in the published set",
        ),
    ],
    ids=["changed", "extra", "missing", "near-target"],
)
def test_a_tampered_tree_is_a_transient_digest_mismatch_naming_the_file(tmp_path, change, words):
    root = published_tree(tmp_path / "t")
    change(root)
    with pytest.raises(Fail) as caught:
        verify(root)
    fail = caught.value
    assert fail.reason == "source.digest-mismatch" and not fail.permanent
    assert words in fail.message and "(1 file)" in fail.message


def test_a_sidecar_that_does_not_hash_to_the_manifests_digest_is_a_mismatch(tmp_path):
    root = published_tree(tmp_path / "t")
    with open(root / DIGEST_FILE, "a") as sidecar:
        sidecar.write("0" * 64 + "  src/new.rs\n")
    with pytest.raises(Fail) as caught:
        verify(root)
    assert caught.value.reason == "source.digest-mismatch"
    assert f"{DIGEST_FILE} does not match {FILENAME}" in caught.value.message
    assert "different publishes" in caught.value.message


@pytest.mark.parametrize("how", ["missing", "symlink", "directory"])
def test_a_manifest_with_a_digest_and_no_readable_sidecar_is_a_mismatch(tmp_path, how):
    root = published_tree(tmp_path / "t")
    (root / DIGEST_FILE).unlink()
    if how == "symlink":
        (root / DIGEST_FILE).symlink_to("/etc/passwd")
    elif how == "directory":
        (root / DIGEST_FILE).mkdir()
    with pytest.raises(Fail) as caught:
        verify(root)
    assert caught.value.reason == "source.digest-mismatch"
    assert f"no readable {DIGEST_FILE}" in caught.value.message


def test_a_manifest_without_a_digest_checks_nothing_as_flodls_worker_and_says_so(tmp_path):
    root = published_tree(tmp_path / "t")
    (root / FILENAME).write_text("bin: t\n")
    (root / "src" / "main.rs").write_text("changed\n")
    assert "carries no digest" in verify(root)[0]


def test_the_mismatch_message_is_bounded_however_many_files_differ(tmp_path):
    root = published_tree(tmp_path / "t")
    for i in range(500):
        (root / "src" / f"new{i:03d}-{'n' * 150}.rs").write_text("x")
    with pytest.raises(Fail) as caught:
        verify(root)
    assert caught.value.reason == "source.digest-mismatch"
    assert "(500 files)" in caught.value.message and "and 495 more" in caught.value.message
    assert len(caught.value.message) < 2000


def write_sidecar(root: Path, lines: list[str]) -> None:
    sidecar = "".join(line + "\n" for line in lines)
    (root / DIGEST_FILE).write_text(sidecar)
    manifest = read(str(root))
    tree_digest = Digest(hashlib.sha256(sidecar.encode()).hexdigest(), len(lines), 0)
    (root / FILENAME).write_text(dump(dataclasses.replace(manifest, digest=tree_digest)))


def test_a_listed_symlink_is_hashed_through_inside_the_tree_and_never_followed_out(tmp_path):
    # floDl hashes a listed path through a symlink; here only while it stays
    # in the tree: root reads no file of this box on a published tree's word.
    root = published_tree(tmp_path / "t")
    (tmp_path / "secret").write_text("root's own\n")
    (root / "inside").symlink_to("src/main.rs")
    (root / "outside").symlink_to(tmp_path / "secret")
    (root / "dir-out").symlink_to(tmp_path)
    lines = (root / DIGEST_FILE).read_text().splitlines()
    main_hex = hashlib.sha256((root / "src" / "main.rs").read_bytes()).hexdigest()
    secret_hex = hashlib.sha256(b"root's own\n").hexdigest()
    write_sidecar(root, [*lines, f"{main_hex}  inside"])
    assert "matches its digest" in verify(root)[0]  # unlisted symlinks are no files of the tree, as floDl walks
    for rel in ("outside", "dir-out/secret"):
        write_sidecar(root, [*lines, f"{secret_hex}  {rel}"])
        with pytest.raises(Fail) as caught:
            verify(root)
        assert caught.value.reason == "source.digest-mismatch"
        assert f"{rel} leads out of the tree through a symlink (not followed)" in caught.value.message


@pytest.mark.parametrize("rel", ["../escape", "/etc/passwd", "a/../../b", "./x", "a//b"])
def test_a_sidecar_path_that_is_not_inside_the_tree_is_never_opened(tmp_path, rel):
    root = published_tree(tmp_path / "t")
    lines = (root / DIGEST_FILE).read_text().splitlines()
    write_sidecar(root, [*lines, "0" * 64 + "  " + rel])
    with pytest.raises(Fail) as caught:
        verify(root)
    assert caught.value.reason == "source.digest-mismatch"
    assert "is not a path inside the tree" in caught.value.message


def test_a_listed_fifo_is_refused_without_blocking(tmp_path):
    root = published_tree(tmp_path / "t")
    os.mkfifo(root / "pipe")
    lines = (root / DIGEST_FILE).read_text().splitlines()
    write_sidecar(root, [*lines, "0" * 64 + "  pipe"])
    with pytest.raises(Fail) as caught:
        verify(root)
    assert caught.value.reason == "source.digest-mismatch" and "pipe cannot be read" in caught.value.message


def test_a_digest_past_the_bounds_is_refused_before_hashing(tmp_path):
    root = published_tree(tmp_path / "t")
    manifest = read(str(root))
    huge = dataclasses.replace(manifest.digest, files=digest.MAX_FILES + 1)
    (root / FILENAME).write_text(dump(dataclasses.replace(manifest, digest=huge)))
    with pytest.raises(Fail) as caught:
        verify(root)
    assert caught.value.reason == "source.digest-mismatch" and f"{digest.MAX_FILES} files" in caught.value.message


def test_the_example_trainer_carries_flodls_run_files_and_matches_its_digest():
    # As `fdl publish` would leave it; scripts/example-digest rewrites the
    # digest after an edit of the crate.
    manifest = read(str(EXAMPLE))
    assert manifest is not None and manifest.bin == "target/release/train" and manifest.unknown_count == 0
    assert manifest.args == ("--epochs", "2") and manifest.built is False and manifest.digest is not None
    started = time.perf_counter()
    notes = digest.verify(str(EXAMPLE), manifest)
    elapsed = time.perf_counter() - started
    assert "matches its digest (5 files" in notes[0], "run scripts/example-digest after editing examples/trainer"
    assert elapsed < 5


def test_a_tree_of_more_entries_than_a_box_walks_is_refused_naming_the_bound(tmp_path, monkeypatch):
    root = published_tree(tmp_path / "t")
    monkeypatch.setattr(digest, "MAX_ENTRIES", 50)
    for i in range(60):
        (root / "src" / f"empty{i}").mkdir()
    with pytest.raises(Fail) as caught:
        verify(root)
    assert caught.value.reason == "source.digest-mismatch"
    assert "more than 50 files and directories" in caught.value.message


def test_a_file_name_with_a_line_break_is_refused_by_the_publish_that_would_list_it(tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    (root / "evil\nname").write_text("x")
    with pytest.raises(Fail) as caught:
        digest.compute(str(root), digest.tree_files(str(root)))
    assert caught.value.reason == "publish.invalid" and "evil\\nname" in caught.value.message
