"""floDl's source spellings, fetched for real: `file://` and `rsync://`
copied with rsync (the loopback sshd for the far side) and then fetched by
Nix as a `path:`, and `git+...#<tag|branch|sha>` against a real git
repository."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
from nix_fixtures import trainer
from sshd_fixtures import free_port

from prepare.build import source, transport
from prepare.build.workspace import Phases, Workspace
from prepare.fail import Fail
from prepare.nix import urls
from prepare.nix.runner import Nix, Prefetched
from prepare.spec import PrepareSpec, SourceSpec, SshSpec


def _need_rsync() -> None:
    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed (scripts/setup installs it)")


def _fetch(tmp_path: Path, nix_env: dict[str, str], url: str, ssh: SshSpec | None = None) -> Prefetched:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True, mode=0o755)
    ws = Workspace(state=str(state), nix=Nix(str(state), env=nix_env), step=Phases(None), system="x", ssh=ssh)
    return source.start_fetch(ws, url).result()


def _tree(root: Path) -> Path:
    """A training tree with what floDl's fetch leaves behind: build output
    at two depths, git metadata, the root's libtorch (a vendored one kept)."""
    for rel, text in {
        "Cargo.toml": "[package]\n",
        "src/main.rs": "fn main() {}\n",
        "target/release/train": "old binary\n",
        "sub/crate/target/debug/x": "old\n",
        ".git/HEAD": "ref: refs/heads/main\n",
        "sub/.git/HEAD": "ref\n",
        "libtorch/lib/libtorch.so": "big\n",
        "vendor/libtorch/keep.rs": "// vendored source\n",
        "gone-later.txt": "here for now\n",
    }.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# -- the spellings ---------------------------------------------------------------


def test_floDl_spellings_parse_as_floDl_means_them():
    assert urls.parse_source("file:///srv/train").path == "/srv/train"
    for spelled, port in (
        ("rsync://flodl@exa:/home/op/train", None),
        ("rsync://exa:2222/home/op/train", 2222),
        ("rsync://exa:2222:/home/op/train", 2222),
    ):
        target = urls.parse_source(spelled).target
        assert target is not None and target.host == "exa" and target.port == port
        assert target.path == "/home/op/train"
    ref = urls.parse_source("git+ssh://git@github.com/me/train#feature/wip")
    assert ref.kind == "git-ref" and ref.ref == "feature/wip" and ref.git_url == "ssh://git@github.com/me/train"
    sha = "a" * 40
    assert urls.parse_source(f"git+https://h/r#{sha}").nix_url == f"git+https://h/r?rev={sha}"
    # Nix's own forms are unchanged.
    assert urls.parse_source("git+https://h/r?ref=main").nix_url == "git+https://h/r?ref=main"


@pytest.mark.parametrize(
    "spelled",
    [
        "git+https://h/r",
        "git+https://h/r#",
        "git+https://h/r#abc1234",
        "git+https://h/r?ref=main#v1",
        "file://srv/train",
        "file:///",
        "rsync://exa",
        "rsync://exa:/",
        "rsync://-oProxyCommand=touch${IFS}x:/p",
        "rsync://-l@exa:/p",
        "rsync://exa:99999:/p",
        "rsync://exa:/p/*",
        "git+https://h/r#-upload-pack=x",
        "git+https://h/r#a..b",
        "git+https://h/r#v1&rev=x",
    ],
)
def test_a_broken_source_spelling_is_permanent_and_its_fix_is_itself_a_valid_spec(spelled):
    with pytest.raises(Fail) as caught:
        urls.parse_source(spelled)
    fail = caught.value
    assert fail.reason == "config.invalid" and fail.permanent
    assert "source.from" in fail.message and "--source" in fail.message
    # Every concrete spec the message offers as the fix parses.
    offered = [part.split('"')[0] for part in fail.message.split('"')[1::2]]
    for fix in offered:
        if "<" in fix or "://" not in fix and not fix.startswith("path:"):
            continue
        assert urls.parse_source(fix).spelled == fix


def test_a_refless_git_url_is_answered_with_a_fix_that_parses():
    for spelled in ("git+https://h/r", "git+https://h/r?dir=sub", "git+file:///srv/r"):
        with pytest.raises(Fail) as caught:
            urls.parse_source(spelled)
        assert caught.value.reason == "config.invalid"
        fix = caught.value.message.split('e.g. "')[1].split('"')[0]
        assert urls.parse_source(fix).kind in ("git-ref", "flake")


# -- the -e string rsync splits itself ----------------------------------------------------


def test_ssh_options_with_spaces_and_quotes_reach_ssh_whole_through_rsyncs_e(tmp_path):
    _need_rsync()
    said = tmp_path / "argv"
    fake = tmp_path / "fake-ssh"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {said}\nexit 255\n')
    fake.chmod(0o755)
    ssh = SshSpec(options=("ProxyCommand=ssh -W %h:%p bastion", "SetEnv=A=it's"), identity_file="/k/id ed")
    words = transport.rsh_words(ssh, 2222)
    words[0] = str(fake)
    done = subprocess.run(
        ["rsync", "-s", "-e", transport.rsh(words), "--", "u@h:/p/", str(tmp_path / "d") + "/"],
        capture_output=True,
        timeout=30,
    )
    assert done.returncode != 0  # 255 or 12, as the fake ssh's exit races rsync's read
    argv = said.read_text().splitlines()
    assert "ProxyCommand=ssh -W %h:%p bastion" in argv and "SetEnv=A=it's" in argv
    assert 'IdentityFile="/k/id ed"' in argv  # ssh's parser reads the quotes and argv[argv.index("-p") + 1] == "2222"
    assert "BatchMode=yes" in argv
    # The host is one word after -l user, never an option.
    assert argv[argv.index("-l") + 1 : argv.index("-l") + 3] == ["u", "h"]
    with pytest.raises(Fail) as caught:
        transport.rsh(["ssh", "-o", "User=a\tb"])
    assert caught.value.reason == "config.invalid" and "ssh.options" in caught.value.message


# -- file:// ------------------------------------------------------------------------------


def test_a_file_source_is_copied_without_build_output_or_git_and_fetched_pinned(tmp_path, nix_env):
    _need_rsync()
    tree = _tree(tmp_path / "train")
    url = f"file://{tree}"
    fetched = _fetch(tmp_path, nix_env, url)
    store = Path(fetched.store_path)
    assert fetched.url == url and fetched.nar_hash.startswith("sha256-")
    assert (store / "src/main.rs").read_text() == "fn main() {}\n"
    assert (store / "vendor/libtorch/keep.rs").is_file()  # only the root's libtorch/ is skipped
    for skipped in ("target", "sub/crate/target", ".git", "sub/.git", "libtorch"):
        assert not (store / skipped).exists(), skipped
    copy = Path(transport.tree_dir(str(tmp_path / "state"), None, urls.parse_source(url)))
    assert stat.S_IMODE(os.lstat(copy.parent).st_mode) == 0o700 and copy.parent.name == "sources"
    assert os.lstat(copy).st_mtime == pytest.approx(os.lstat(tree).st_mtime, abs=1)
    assert os.lstat(copy / "src/main.rs").st_mtime == os.lstat(tree / "src/main.rs").st_mtime  # mtimes kept

    # A re-pull sees a change, and a removed file disappears.
    (tree / "src/main.rs").write_text("fn main() { train() }\n")
    (tree / "gone-later.txt").unlink()
    again = _fetch(tmp_path, nix_env, url)
    assert again.nar_hash != fetched.nar_hash
    assert (Path(again.store_path) / "src/main.rs").read_text() == "fn main() { train() }\n"
    assert not (Path(again.store_path) / "gone-later.txt").exists()
    assert not (copy / "gone-later.txt").exists()


def test_an_unchanged_file_source_refetches_fast_and_to_the_same_store_path(tmp_path, nix_env):
    _need_rsync()
    tree = _tree(tmp_path / "train")
    for i in range(200):
        (tree / "src" / f"m{i}.rs").write_text(f"// {i}\n" * 50)
    url = f"file://{tree}"
    start = time.monotonic()
    first = _fetch(tmp_path, nix_env, url)
    cold = time.monotonic() - start
    start = time.monotonic()
    second = _fetch(tmp_path, nix_env, url)
    warm = time.monotonic() - start
    print(f"file:// source of 200 files: first fetch {cold:.2f}s, unchanged re-fetch {warm:.2f}s")
    assert second.store_path == first.store_path and second.nar_hash == first.nar_hash
    assert warm < 10


def test_a_file_source_that_is_not_there_is_transient_naming_the_path(tmp_path, nix_env):
    _need_rsync()
    with pytest.raises(Fail) as caught:
        _fetch(tmp_path, nix_env, f"file://{tmp_path}/not-mounted-yet")
    fail = caught.value
    assert fail.reason == "source.missing" and not fail.permanent
    assert "not-mounted-yet" in fail.message and "source.from" in fail.message


def test_symlinks_out_of_the_tree_are_not_copied_and_nix_keeps_a_link_a_link(tmp_path, nix_env):
    _need_rsync()
    tree = _tree(tmp_path / "train")
    (tmp_path / "outside").write_text("secret\n")
    os.symlink("/etc/shadow", tree / "leak")
    os.symlink("../outside", tree / "up")
    os.symlink("src/main.rs", tree / "inside")
    fetched = _fetch(tmp_path, nix_env, f"file://{tree}")
    store = Path(fetched.store_path)
    assert not os.path.lexists(store / "leak") and not os.path.lexists(store / "up")
    assert os.path.islink(store / "inside") and os.readlink(store / "inside") == "src/main.rs"
    # And Nix's own path: fetch (a `path:` source, fetched as it is) stores
    # a link as a link: never the file it points at.
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a").write_text("a\n")
    os.symlink("/etc/shadow", raw / "leak")
    direct = Nix(str(tmp_path / "state"), env=nix_env).prefetch(f"path:{raw}")
    leak = Path(direct.store_path) / "leak"
    assert os.path.islink(leak) and os.readlink(leak) == "/etc/shadow"


# -- rsync:// over the loopback sshd --------------------------------------------------------


def _rsync_url(sshd, path: Path | str, port: int | None = None) -> str:
    return f"rsync://{sshd.user}@{sshd.host}:{port or sshd.port}:{path}"


def test_an_rsync_source_is_pulled_over_ssh_with_the_ssh_block_and_fetched_pinned(tmp_path, nix_env, sshd):
    _need_rsync()
    tree = _tree(tmp_path / "served")
    url = _rsync_url(sshd, tree)
    fetched = _fetch(tmp_path, nix_env, url, sshd.ssh_spec())
    store = Path(fetched.store_path)
    assert fetched.url == url and (store / "src/main.rs").is_file()
    assert not (store / "target").exists() and not (store / ".git").exists() and not (store / "libtorch").exists()
    (tree / "gone-later.txt").unlink()
    (tree / "Cargo.toml").write_text("[package]\nname = 'x'\n")
    start = time.monotonic()
    again = _fetch(tmp_path, nix_env, url, sshd.ssh_spec())
    print(f"rsync:// re-pull after a change: {time.monotonic() - start:.2f}s")
    assert not (Path(again.store_path) / "gone-later.txt").exists()
    assert "name = 'x'" in (Path(again.store_path) / "Cargo.toml").read_text()
    start = time.monotonic()
    same = _fetch(tmp_path, nix_env, url, sshd.ssh_spec())
    print(f"rsync:// re-pull with nothing changed: {time.monotonic() - start:.2f}s")
    assert same.store_path == again.store_path


def test_an_rsync_source_on_a_closed_port_is_transient(tmp_path, nix_env, sshd):
    _need_rsync()
    with pytest.raises(Fail) as caught:
        _fetch(tmp_path, nix_env, _rsync_url(sshd, tmp_path, port=free_port()), sshd.ssh_spec())
    fail = caught.value
    assert fail.reason == "source.unreachable" and not fail.permanent
    # rsync says 255 (ssh failed) or, from 3.2 on, often 12 (the stream
    # closed before it began); ssh's own words are quoted either way.
    assert "exited 255 (ssh failed)" in fail.message or "exited 12 (error in the rsync" in fail.message
    assert "Connection refused" in fail.message


def test_an_rsync_source_whose_host_key_ssh_does_not_know_is_permanent_naming_ssh_keyscan(tmp_path, nix_env, sshd):
    _need_rsync()
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    ssh = SshSpec(
        identity_file=str(sshd.user_key),
        options=(f"UserKnownHostsFile={empty}", "GlobalKnownHostsFile=/dev/null", "StrictHostKeyChecking=yes"),
    )
    with pytest.raises(Fail) as caught:
        _fetch(tmp_path, nix_env, _rsync_url(sshd, _tree(tmp_path / "served")), ssh)
    fail = caught.value
    assert fail.reason == "source.host-key" and fail.permanent
    assert "ssh-keyscan" in fail.message and "known_hosts" in fail.message


def test_an_rsync_source_whose_path_is_missing_on_the_far_side_is_transient(tmp_path, nix_env, sshd):
    _need_rsync()
    with pytest.raises(Fail) as caught:
        _fetch(tmp_path, nix_env, _rsync_url(sshd, tmp_path / "not-published"), sshd.ssh_spec())
    fail = caught.value
    assert fail.reason == "source.missing" and not fail.permanent
    assert "not-published" in fail.message and "fdl publish" in fail.message


# -- git+...#<ref> -------------------------------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_git_source_with_floDls_tag_branch_or_sha_fetches_that_commit(tmp_path, nix_env):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "train.rs").write_text("// one\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    _git(repo, "tag", "-a", "v1", "-m", "annotated")
    one = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "-b", "side")
    (repo / "train.rs").write_text("// two\n")
    _git(repo, "commit", "-q", "-am", "two")
    two = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "main")
    base = f"git+file://{repo}"
    for ref, commit, text in (("v1", one, "// one\n"), ("side", two, "// two\n"), (two, two, "// two\n")):
        fetched = _fetch(tmp_path, nix_env, f"{base}#{ref}")
        # Nix 2.8 prints no `locked`; later ones say the commit.
        assert (fetched.locked or {}).get("rev", commit) == commit, ref
        assert (Path(fetched.store_path) / "train.rs").read_text() == text
        assert fetched.url == f"{base}#{ref}"
    # A branch that moves is seen by the next fetch (the ref is asked anew).
    _git(repo, "checkout", "-q", "side")
    (repo / "train.rs").write_text("// three\n")
    _git(repo, "commit", "-q", "-am", "three")
    assert (Path(_fetch(tmp_path, nix_env, f"{base}#side").store_path) / "train.rs").read_text() == "// three\n"
    with pytest.raises(Fail) as caught:
        _fetch(tmp_path, nix_env, f"{base}#v9")
    assert caught.value.reason == "source.unreachable" and not caught.value.permanent
    assert "no tag or branch 'v9'" in caught.value.message


def test_a_git_ssh_source_reaches_the_host_with_the_ssh_block(tmp_path, nix_env, sshd, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    monkeypatch.delenv("GIT_SSH_COMMAND", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "train.rs").write_text("// over ssh\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    _git(repo, "tag", "-a", "v1", "-m", "annotated")
    _git(repo, "checkout", "-q", "-b", "side")
    (repo / "train.rs").write_text("// on a side branch\n")
    _git(repo, "commit", "-q", "-am", "side")
    side = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "main")
    bare = tmp_path / "repo.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(repo), str(bare)], check=True, timeout=60)
    remote = f"git+ssh://{sshd.user}@{sshd.host}:{sshd.port}{bare}"
    nix_env = {k: v for k, v in nix_env.items() if k != "GIT_SSH_COMMAND"}
    fetched = _fetch(tmp_path, nix_env, f"{remote}#v1", sshd.ssh_spec())
    assert (Path(fetched.store_path) / "train.rs").read_text() == "// over ssh\n"
    assert str(sshd.user_key) not in repr(fetched)
    # A branch over the wire (Nix's own ?ref= would take it for a branch
    # too, but not the tag above), and a commit on no default branch.
    for ref in ("side", side):
        fetched = _fetch(tmp_path, nix_env, f"{remote}#{ref}", sshd.ssh_spec())
        assert (Path(fetched.store_path) / "train.rs").read_text() == "// on a side branch\n", ref


# -- through the pipeline, and the warm path --------------------------------------------------


def _served(root: Path, files: dict[str, str | None]) -> Path:
    for rel, text in files.items():
        if text is not None:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    return root


@pytest.mark.nix
def test_an_rsync_source_re_dial_with_nothing_changed_evaluates_and_builds_nothing(
    tmp_path, nix_env, test_flake, state_dir, sshd
):
    _need_rsync()
    from test_warm import Counting, attempt

    tree = _served(tmp_path / "run-tree", trainer())
    spec = PrepareSpec(
        source=SourceSpec(from_=_rsync_url(sshd, tree)),
        libtorch="cpu",
        cpu_only=True,
        flake=test_flake,
        state_dir=state_dir,
        ssh=sshd.ssh_spec(),
    )
    nix = Counting(tmp_path)
    first = attempt(nix, spec)
    assert first.bin is not None and os.access(first.bin.path, os.X_OK)
    nix.calls()
    notes: list[str] = []
    start = time.monotonic()
    second = attempt(nix, spec, notes)
    warm = time.monotonic() - start
    print(f"rsync:// source, a re-dial with nothing changed: {warm:.2f}s")
    assert second == first and nix.evaluations() == 0
    assert any(n.startswith("nothing evaluated:") for n in notes)
    # A publish on the far side: the next dial builds the new tree.
    (tree / "README").write_text("a new run\n")
    third = attempt(nix, spec)
    assert third.bin != first.bin


@pytest.mark.nix
def test_a_check_of_a_file_source_copies_into_its_scratch_and_changes_nothing_in_the_state_directory(
    tmp_path, nix_env, test_flake, monkeypatch
):
    _need_rsync()
    from nix_fixtures import build
    from test_check import _tree as listing
    from test_check import check

    home = tmp_path / "home"
    (home / ".flodl" / "data").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    tree = _served(tmp_path / "train", trainer())
    state = tmp_path / "state"
    spec = PrepareSpec(
        source=SourceSpec(from_=f"file://{tree}"), libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=str(state)
    )
    build(spec, [])
    before = listing(state)
    (tree / "README").write_text("changed after the attempt\n")
    checked = check(spec)
    assert checked.ready, checked.fail
    assert checked.steps["source"].verdict == "ok" and f"file://{tree}" in checked.steps["source"].detail
    # The changed tree was copied (the check would build it), into the
    # check's own scratch: the attempt's copy is as the attempt left it.
    assert checked.steps["build"].verdict == "would build"
    assert listing(state) == before


def test_an_rsync_source_with_an_identity_file_that_is_not_there_is_permanent_naming_identity_file(tmp_path, sshd):
    _need_rsync()
    ref = urls.parse_source(_rsync_url(sshd, tmp_path))
    ssh = SshSpec(identity_file=str(tmp_path / "no-such-key"), options=sshd.options)
    with pytest.raises(Fail) as caught:
        transport.start_pull(ref, str(tmp_path / "dest"), ssh)
    fail = caught.value
    assert fail.reason == "data.identity-unreadable" and fail.permanent
    assert "ssh.identity_file" in fail.message and "source host" in fail.message


def test_a_file_source_without_rsync_installed_is_permanent_naming_the_install(tmp_path, monkeypatch):
    tree = _tree(tmp_path / "train")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(Fail) as caught:
        transport.start_pull(urls.parse_source(f"file://{tree}"), str(tmp_path / "dest"), None)
    fail = caught.value
    assert fail.reason == "source.rsync-missing" and fail.permanent
    assert "apt-get install rsync" in fail.message


def test_a_git_ssh_ref_whose_host_key_ssh_does_not_know_is_permanent_before_nix_runs(tmp_path, nix_env, sshd):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    ssh = SshSpec(
        identity_file=str(sshd.user_key),
        options=(f"UserKnownHostsFile={empty}", "GlobalKnownHostsFile=/dev/null", "StrictHostKeyChecking=yes"),
    )
    with pytest.raises(Fail) as caught:
        _fetch(tmp_path, nix_env, f"git+ssh://{sshd.user}@{sshd.host}:{sshd.port}/srv/none.git#v1", ssh)
    fail = caught.value
    assert fail.reason == "nix.host-key" and fail.permanent
    assert "git ls-remote" in fail.message and f"ssh-keyscan -p {sshd.port} 127.0.0.1" in fail.message


def test_an_identity_file_whose_path_has_a_space_reaches_ssh_under_rsync(tmp_path, nix_env, sshd):
    _need_rsync()
    keys = tmp_path / "key dir"
    keys.mkdir()
    key = keys / "id ed25519"
    shutil.copy(sshd.user_key, key)
    key.chmod(0o600)
    tree = _tree(tmp_path / "served")
    fetched = _fetch(tmp_path, nix_env, _rsync_url(sshd, tree), SshSpec(identity_file=str(key), options=sshd.options))
    assert (Path(fetched.store_path) / "src/main.rs").is_file()


@pytest.mark.nix
def test_a_re_dial_of_a_file_source_gone_from_the_box_is_transient_at_the_fetch_step(
    tmp_path, nix_env, test_flake, state_dir
):
    _need_rsync()
    from nix_fixtures import build

    tree = _served(tmp_path / "train", trainer())
    spec = PrepareSpec(
        source=SourceSpec(from_=f"file://{tree}"), libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=state_dir
    )
    build(spec, [])
    shutil.rmtree(tree)
    events: list[dict] = []
    with pytest.raises(Fail) as caught:
        build(spec, [], progress=events.append)
    fail = caught.value
    assert fail.reason == "source.missing" and not fail.permanent
    # Started beside the flake's resolution (step 5), failed as step 6's.
    assert any(e["type"] == "step" and e["name"] == "fetch" for e in events)


def test_a_link_planted_as_the_copys_directory_is_refused_not_followed(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, state / "sources")
    with pytest.raises(Fail) as caught:
        transport.tree_dir(str(state), None, urls.parse_source("file:///srv/train"))
    assert caught.value.reason == "state.untrusted" and caught.value.permanent
    assert os.listdir(elsewhere) == []


def test_an_rsync_source_whose_host_accepts_but_never_answers_is_transient(tmp_path, nix_env, make_sshd, monkeypatch):
    _need_rsync()
    import signal

    server = make_sshd()
    # ssh's bound on the banner exchange, shortened so the test is quick.
    monkeypatch.setattr(transport, "CONNECT_TIMEOUT_S", 2)
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)  # the kernel still accepts; nobody answers
    server.frozen.append(server.process.pid)
    started = time.monotonic()
    with pytest.raises(Fail) as caught:
        _fetch(tmp_path, nix_env, _rsync_url(server, _tree(tmp_path / "served")), server.ssh_spec())
    server.thaw()
    fail = caught.value
    assert fail.reason == "source.unreachable" and not fail.permanent
    assert "banner exchange" in fail.message and time.monotonic() - started < 30
