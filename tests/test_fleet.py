"""Build once, substitute everywhere: `fdl-prepare publish` on node A (this
machine's store) fills a signed binary cache, and node B (a box with an
empty store of its own, tests/fleet_fixtures.py) prepares from it.

Everything is real and on loopback: Nix 2.8 or later on both nodes, the
cache a directory served over HTTP on 127.0.0.1 (or an ssh-ng store behind
the tests' sshd), the training source a git repository or a directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from console import console_script
from fleet_fixtures import built, substituted
from nix_fixtures import DIGEST, MANIFEST, NIX_CONFIG, build, nix_daemon_client, procs_with, trainer

from prepare.build import manifest as manifest_mod
from prepare.fail import Fail
from prepare.nix import runner as nix_mod
from prepare.nix.runner import Nix
from prepare.publish import PublishSpec, publish
from prepare.spec import NixSpec, PrepareSpec, SourceSpec

pytestmark = pytest.mark.nix

BUILD = "printf '#!/bin/sh\\necho trained on $FDL_LIBTORCH_VARIANT \"$@\"\\n' > train && chmod +x train"
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "fdl tests",
    "GIT_AUTHOR_EMAIL": "tests@fdl.invalid",
    "GIT_COMMITTER_NAME": "fdl tests",
    "GIT_COMMITTER_EMAIL": "tests@fdl.invalid",
}


@pytest.fixture(autouse=True)
def _git_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in GIT_IDENTITY.items():
        monkeypatch.setenv(name, value)


def publish_spec(source: Path, flake: str, to: str, key: Path, tmp_path: Path, **kw: object) -> PublishSpec:
    values: dict[str, object] = {
        "source": str(source),
        "bin": "train",
        "build": BUILD,
        "args": ("--epochs", "3"),
        "variants": ("cpu",),
        "to": to,
        "signing_key": str(key),
        "flake": flake,
        "state_dir": str(tmp_path / "publish-state"),
        **kw,
    }
    return PublishSpec(**values)  # type: ignore[arg-type]


def box(source: str, flake: str, state: Path, caches: tuple[str, ...] = (), keys: tuple[str, ...] = ()) -> PrepareSpec:
    """A CPU box that names no binary itself: what it builds is the publish's."""
    return PrepareSpec(
        source=SourceSpec(from_=source),
        nix=NixSpec(substituters=caches, trusted_public_keys=keys),
        libtorch="cpu",
        cpu_only=True,
        flake=flake,
        state_dir=str(state),
    )


def nonce() -> str:
    return str(time.time_ns())


def published_source(git_source):  # type: ignore[no-untyped-def]
    """A git training source with no manifest yet (a fresh nonce: its own derivations)."""
    return git_source(trainer(manifest={}, nonce=nonce()))


# -- node B substitutes what node A published -----------------------------------------------------


def test_a_box_substitutes_everything_a_publish_pushed_and_builds_nothing(
    test_flake, git_source, binary_cache, signing_key, node_b, tmp_path
):
    src = published_source(git_source)
    cache = binary_cache()
    key = signing_key("fleet-test-1")
    notes: list[str] = []
    done = publish(publish_spec(src.path, test_flake, cache.file_url, key.secret, tmp_path, commit=True), notes)
    b = node_b()

    result = b.prepare(box(src.url, test_flake, b.root / "state", (cache.url,), (key.public,)))

    assert "prepared" in result, str(result.get("fail"))
    assert built(result) == []
    assert sorted(substituted(result)) == ["fdl-test-libtorch-cpu", "fdl-test-training-cpu"]
    prepared = result["prepared"]
    assert prepared["bin"]["path"] == done.outputs["cpu"].bin
    assert prepared["libtorch"]["path"] == done.outputs["cpu"].libtorch
    assert prepared["run_id"] == done.run_id and prepared["args"] == ["--epochs", "3"]
    said = "\n".join(result["notes"])
    assert f"binary cache {cache.url}: substituted 2 paths" in said and "downloaded" in said
    assert "built here: 0 derivations" in said
    # The binary B got is the one A built: it runs on B's store.
    assert (b.store / Path(prepared["bin"]["path"]).relative_to("/nix/store")).exists()
    # floDl's two run files are committed alone, on the commit that was built,
    # and the box checked the tree it fetched against their digest.
    files = subprocess.run(
        ["git", "-C", str(src.path), "show", "--name-only", "--format=", "HEAD"], capture_output=True, text=True
    )
    assert sorted(files.stdout.split()) == [DIGEST, MANIFEST] and done.commit is not None and done.rev is not None
    assert "the fetched tree matches its digest (1 file," in said
    assert any(f"variant cpu: built, signed and copied to {cache.file_url}" in n for n in notes)


def test_a_cache_signed_with_a_key_the_box_does_not_trust_is_refused_and_the_box_builds_and_says_why(
    test_flake, git_source, binary_cache, signing_key, node_b, tmp_path
):
    src = published_source(git_source)
    cache = binary_cache()
    publisher, stranger = signing_key("fleet-test-1"), signing_key("someone-else-1")
    done = publish(publish_spec(src.path, test_flake, cache.file_url, publisher.secret, tmp_path, commit=True), [])
    b = node_b()

    result = b.prepare(box(src.url, test_flake, b.root / "state", (cache.url,), (stranger.public,)))

    assert "prepared" in result, str(result.get("fail"))
    assert substituted(result) == []
    # The build root (nix/training-env.nix): two links, built where the binary is.
    assert sorted(built(result)) == ["fdl-build-root", "fdl-test-libtorch-cpu", "fdl-test-training-cpu"]
    said = "\n".join(result["notes"])
    assert f"binary cache {cache.url} offered" in said and "signed by no trusted key: refused" in said
    assert "built here instead" in said and "trusted_public_keys (--trusted-public-key)" in said
    # Built here, from the same derivation: the same store path.
    assert result["prepared"]["bin"]["path"] == done.outputs["cpu"].bin


def test_a_stopped_cache_server_falls_back_to_building_here_with_a_note(
    test_flake, git_source, binary_cache, signing_key, node_b, tmp_path
):
    src = published_source(git_source)
    cache = binary_cache()
    key = signing_key("fleet-test-1")
    publish(publish_spec(src.path, test_flake, cache.file_url, key.secret, tmp_path, commit=True), [])
    url = cache.url
    cache.stop()
    b = node_b()

    result = b.prepare(box(src.url, test_flake, b.root / "state", (url,), (key.public,)))

    assert "prepared" in result, str(result.get("fail"))
    assert substituted(result) == [] and "fdl-test-training-cpu" in built(result)
    said = "\n".join(result["notes"])
    assert f"binary cache {url} could not be reached" in said and "built here instead" in said


def test_an_ssh_ng_store_is_a_cache_for_publish_and_box_alike(
    test_flake, git_source, signing_key, node_b, sshd, tmp_path, monkeypatch
):
    # The store behind ssh is a directory on the far side (remote-store);
    # ssh reaches it through a config file naming the tests' sshd, its key
    # and its host key (NIX_SSHOPTS is how Nix is given ssh options).
    config = tmp_path / "ssh_config"
    config.write_text(
        "Host fdl-cache\n  HostName 127.0.0.1\n"
        f"  Port {sshd.port}\n  User {sshd.user}\n  IdentityFile {sshd.user_key}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {sshd.known_hosts}\n  StrictHostKeyChecking yes\n  BatchMode yes\n"
    )
    monkeypatch.setenv("NIX_SSHOPTS", f"-F {config}")
    store = tmp_path / "ssh-store"
    to = f"ssh-ng://fdl-cache?remote-store={store}"
    src = published_source(git_source)
    key = signing_key("fleet-test-1")
    done = publish(publish_spec(src.path, test_flake, to, key.secret, tmp_path, commit=True), [])
    b = node_b()
    b.env["NIX_SSHOPTS"] = f"-F {config}"

    result = b.prepare(box(src.url, test_flake, b.root / "state", (to,), (key.public,)))

    assert "prepared" in result, str(result.get("fail"))
    assert built(result) == []
    assert sorted(substituted(result)) == ["fdl-test-libtorch-cpu", "fdl-test-training-cpu"]
    assert result["prepared"]["bin"]["path"] == done.outputs["cpu"].bin
    assert "binary cache ssh-ng://fdl-cache: substituted 2 paths" in "\n".join(result["notes"])


# -- the manifest is the commit point ---------------------------------------------------------------


def _directory_source(tmp_path: Path) -> Path:
    """A plain directory (no git) holding a manifest from an earlier publish."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "README").write_text(f"a training source {nonce()}\n")
    (tree / MANIFEST).write_text("bin: train\nrun: the-previous-run\nbuilt: true\n")
    return tree


def _box_finds_nothing_published(tree: Path, flake: str, tmp_path: Path) -> None:
    with pytest.raises(Fail) as caught:
        build(box(f"path:{tree}", flake, tmp_path / "box-state"), [])
    assert not caught.value.permanent
    assert "nothing is published yet" in caught.value.message


def test_a_publish_that_fails_on_its_second_variant_leaves_no_manifest_and_names_the_variant_and_step(
    test_flake, binary_cache, signing_key, tmp_path
):
    tree = _directory_source(tmp_path)
    failing = f'[ "$FDL_LIBTORCH_VARIANT" = cu128 ] && exit 3; {BUILD}'
    spec = publish_spec(
        tree, test_flake, binary_cache().file_url, signing_key("k-1").secret, tmp_path, build=failing,
        variants=("cpu", "cu128"),
    )  # fmt: skip
    notes: list[str] = []

    with pytest.raises(Fail) as caught:
        publish(spec, notes)

    fail = caught.value
    assert "publish stopped at variant cu128, step build" in fail.message and "exit code 3" in fail.message
    assert not fail.permanent  # a failed training build: the next publish may fix it
    assert any("variant cpu: built, signed and copied" in n for n in notes)
    assert any("removed the previous manifest (run the-previous-run)" in n for n in notes)
    assert not (tree / MANIFEST).exists()
    assert [p.name for p in tree.iterdir()] == ["README"]
    _box_finds_nothing_published(tree, test_flake, tmp_path)


def test_a_publish_stopped_by_sigterm_midway_leaves_no_manifest(test_flake, binary_cache, signing_key, tmp_path):
    tree = _directory_source(tmp_path)
    marker = f"fdl-publish-sigterm-{nonce()}"
    env = {**os.environ, "NIX_CONFIG": NIX_CONFIG}
    argv = [console_script(), "publish", str(tree), "--bin", "train", "--build", f"sleep 60 # {marker}"]
    argv += ["--variant", "cpu", "--to", binary_cache().file_url, "--signing-key", str(signing_key("k-1").secret)]
    argv += ["--flake", test_flake, "--state-dir", str(tmp_path / "publish-state")]
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        # The builder's shell, not a child of the publish between its fork
        # and its exec (which still has the publish's command line, marker
        # and all: a loaded machine makes that window long).
        while not [
            p for p in procs_with(marker) if p[0] != child.pid and "sleep" in p[1] and "--signing-key" not in p[1]
        ]:
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.1)
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130, err
    assert not (tree / MANIFEST).exists()
    assert [p.name for p in tree.iterdir()] == ["README"]
    deadline = time.monotonic() + 15
    while [p for p in procs_with(marker) if "sleep" in p[1]]:
        assert time.monotonic() < deadline, "the builder outlived the publish"
        time.sleep(0.1)
    _box_finds_nothing_published(tree, test_flake, tmp_path)


def test_publish_without_a_flag_writes_the_manifest_and_says_how_to_commit_it(
    test_flake, git_source, binary_cache, signing_key, tmp_path
):
    src = published_source(git_source)
    head = subprocess.run(["git", "-C", str(src.path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    (src.path / "README").write_text("an uncommitted edit\n")

    notes: list[str] = []
    done = publish(
        publish_spec(src.path, test_flake, binary_cache().file_url, signing_key("k-1").secret, tmp_path), notes
    )

    assert done.rev == head.strip() and done.commit is None and not done.pushed
    assert (src.path / MANIFEST).exists()
    assert done.next_step is not None and f"on top of {head.strip()[:12]}" in done.next_step
    assert f"-- {DIGEST} {MANIFEST}" in done.next_step
    assert any("uncommitted change(s)" in n and "README" in n for n in notes)
    after = subprocess.run(["git", "-C", str(src.path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert after == head


def test_push_publishes_the_manifest_to_the_remote_the_boxes_fetch(
    test_flake, git_source, git_http, binary_cache, signing_key, tmp_path
):
    src = published_source(git_source)
    remote = git_http(src)
    subprocess.run(["git", "-C", str(src.path), "remote", "add", "origin", str(remote.bare)], check=True)
    subprocess.run(["git", "-C", str(src.path), "fetch", "-q", "origin"], check=True)
    subprocess.run(["git", "-C", str(src.path), "branch", "-q", "--set-upstream-to", "origin/main"], check=True)
    spec = publish_spec(src.path, test_flake, binary_cache().file_url, signing_key("k-1").secret, tmp_path, push=True)

    done = publish(spec, [])

    assert done.pushed and done.commit is not None
    remote_head = subprocess.run(
        ["git", "-C", str(remote.bare), "rev-parse", "main"], capture_output=True, text=True
    ).stdout.strip()
    assert remote_head == done.commit


def test_the_signing_key_is_never_on_a_command_line_nor_in_a_message(
    test_flake, git_source, binary_cache, signing_key, tmp_path, monkeypatch
):
    key = signing_key("k-1")
    secret = key.secret.read_text().strip()
    seen: list[list[str]] = []
    real = nix_mod.proc.start

    # `start` is where every program begins (`run` calls it too).
    def spy(argv, **kw):  # type: ignore[no-untyped-def]
        seen.append(list(argv))
        return real(argv, **kw)

    monkeypatch.setattr(nix_mod.proc, "start", spy)
    src = published_source(git_source)
    notes: list[str] = []
    # A cache nobody can write: the copy fails, after the key was used.
    with pytest.raises(Fail) as caught:
        publish(publish_spec(src.path, test_flake, "bogus-store://x", key.secret, tmp_path), notes)
    assert "variant cpu, step copy" in caught.value.message and caught.value.permanent
    signing = [a for a in seen if "sign" in a and "store" in a]
    assert signing and all(str(key.secret) in a for a in signing)
    everything = "\n".join(" ".join(a) for a in seen) + caught.value.message + "\n".join(notes)
    assert secret not in everything and secret.split(":", 1)[1] not in everything


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"variants": ("auto",)}, ['--variant "auto"']),
        ({"variants": ()}, ["no --variant given"]),
        ({"variants": ("cpu", "cu999")}, ["--variant 'cu999': not a variant of the flake", "cpu, cu128"]),
        ({"bin": "../escape"}, ["--bin '../escape'", "relative to --cwd that stays inside the source"]),
        ({"to": "not a url"}, ["--to 'not a url'", "not a store URL"]),
        ({"signing_key": "/nonexistent/key"}, ["--signing-key '/nonexistent/key' is not a readable file"]),
        ({"commit": True}, ["--commit/--push need a git checkout"]),
    ],
)
def test_a_publish_that_cannot_work_is_refused_before_anything_is_built(
    change, words, test_flake, binary_cache, signing_key, tmp_path
):
    tree = _directory_source(tmp_path)
    spec = replace(
        publish_spec(tree, test_flake, binary_cache().file_url, signing_key("k-1").secret, tmp_path), **change
    )
    events: list[dict] = []
    with pytest.raises(Fail) as caught:
        publish(spec, [], events.append)
    assert caught.value.permanent
    for word in words:
        assert word in caught.value.message, caught.value.message
    assert [e for e in events if e["type"] == "build-start"] == []


def _broken_flake(tmp_path: Path) -> str:
    flake = tmp_path / "broken-flake"
    flake.mkdir()
    (flake / "flake.nix").write_text('{ outputs = { self }: { legacyPackages = throw "broken on purpose"; }; }\n')
    return f"path:{flake}"


def _untrusted_state(tmp_path: Path) -> str:
    state = tmp_path / "someones-dir"
    state.mkdir()
    (state / "their-file").write_text("x")
    return str(state)


@pytest.mark.parametrize(
    "case", ["a variant typo", "a flake that does not evaluate", "a state directory not its own", "a cwd not there"]
)
def test_a_publish_that_cannot_work_is_permanent_and_leaves_the_live_manifest_and_the_fleets_run_alone(
    case, test_flake, binary_cache, signing_key, tmp_path
):
    tree = _directory_source(tmp_path)
    live = (tree / MANIFEST).read_text()
    spec = publish_spec(tree, test_flake, binary_cache().file_url, signing_key("k-1").secret, tmp_path)
    change = {
        "a variant typo": {"variants": ("cpu", "cu999")},
        "a flake that does not evaluate": {"flake": _broken_flake(tmp_path)},
        "a state directory not its own": {"state_dir": _untrusted_state(tmp_path)},
        "a cwd not there": {"cwd": "not-there"},
    }[case]
    notes: list[str] = []
    with pytest.raises(Fail) as caught:
        publish(replace(spec, **change), notes)  # type: ignore[arg-type]
    assert caught.value.permanent, caught.value.message
    assert (tree / MANIFEST).read_text() == live
    assert not any("removed the previous manifest" in n for n in notes)


def test_a_signing_key_others_can_read_is_permanent_and_treated_as_leaked(
    test_flake, binary_cache, signing_key, tmp_path
):
    tree = _directory_source(tmp_path)
    key = signing_key("k-1").secret
    key.chmod(0o644)
    events: list[dict] = []
    with pytest.raises(Fail) as caught:
        publish(publish_spec(tree, test_flake, binary_cache().file_url, key, tmp_path), [], events.append)
    fail = caught.value
    assert fail.permanent and fail.reason == "publish.invalid"
    assert "can be read by other users (mode 0644)" in fail.message and "Treat it as leaked" in fail.message
    assert (tree / MANIFEST).exists() and not events


def test_publish_encodes_the_path_it_makes_a_url_of_and_quotes_the_commands_it_prints(
    test_flake, binary_cache, signing_key, tmp_path
):
    import shlex

    # A checkout whose path a URL reads as a fragment and a shell as two commands.
    odd = tmp_path / "train;id;x#1"
    odd.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "main", str(odd)], check=True)
    (odd / "README").write_text(f"a training source {nonce()}\n")
    subprocess.run(["git", "-C", str(odd), "add", "README"], check=True)
    subprocess.run(["git", "-C", str(odd), "commit", "-q", "-m", "initial"], check=True)
    done = publish(publish_spec(odd, test_flake, binary_cache().file_url, signing_key("k-1").secret, tmp_path), [])
    assert (odd / MANIFEST).exists() and done.next_step is not None
    commands = done.next_step.rsplit(": ", 1)[1]
    words = shlex.split(commands)
    assert words[:4] == ["git", "-C", str(odd), "add"] and words.count("&&") == 2
    assert words[words.index("&&") + 3] == str(odd)


# -- a daemon that does not trust the box's user ------------------------------------------------------


def test_a_daemon_that_ignores_the_boxs_cache_for_an_untrusted_user_stops_preparation(nix_env, test_flake, tmp_path):
    # A real nix-daemon and a client that is another user, not in its
    # trusted-users (root only, the default): the daemon drops the cache the
    # client names and says so; the build would go on without it.
    with (
        nix_daemon_client(test_flake, substituters=("http://127.0.0.1:9/fleet",)) as (runner, flake),
        pytest.raises(Fail) as caught,
    ):
        runner.eval_json(f"path:{flake}#legacyPackages.{nix_mod.system()}.fdl.contract")
    fail = caught.value
    assert fail.permanent
    assert "ignores the binary cache http://127.0.0.1:9/fleet (nix.substituters, --substituter)" in fail.message
    assert "trusted-substituters" in fail.message and "trusted-users" in fail.message


def test_the_flag_reaches_every_nix_call_as_an_option_and_never_through_the_flake(tmp_path):
    runner = Nix(str(tmp_path), substituters=("http://a:1", "s3://b"), trusted_public_keys=("a-1:x", "b-1:y"))
    argv = runner._common()
    pairs = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--option"}
    assert pairs["extra-substituters"] == "http://a:1 s3://b"
    assert pairs["extra-trusted-public-keys"] == "a-1:x b-1:y"
    assert pairs["require-sigs"] == "true" and pairs["fallback"] == "true"
    assert pairs["accept-flake-config"] == "false"
    assert "--accept-flake-config" not in argv
    # No caches configured: nix.conf decides, as before.
    plain = Nix(str(tmp_path))._common()
    assert not any("substituters" in a or "require-sigs" in a for a in plain)


def test_the_cli_takes_the_caches_as_flags(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "prepare", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert "--substituter" in done.stdout and "--trusted-public-key" in done.stdout


def test_publish_takes_preparations_shared_flags_with_the_same_checks(tmp_path):
    publish_script = Path(console_script()).with_name("fdl-prepare-publish")
    if not publish_script.exists():
        pytest.skip("the fdl-prepare-publish console script is not installed (pip install -e .)")
    key = tmp_path / "key"
    key.write_text("unused\n")
    argv = [str(publish_script), str(tmp_path), "--bin", "train", "--variant", "cpu", "--to", "file:///x"]
    done = subprocess.run(
        [*argv, "--signing-key", str(key), "--build-timeout", "0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 78, done.stderr
    assert "fdl-prepare publish: permanent failure" in done.stderr
    assert "--build-timeout (join.build_timeout) = 0.0" in done.stderr


def test_a_publish_through_fdl_prepare_publish_prints_one_json_object_of_kind_published(
    test_flake, git_source, binary_cache, signing_key, tmp_path
):
    publish_script = Path(console_script()).with_name("fdl-prepare-publish")
    if not publish_script.exists():
        pytest.skip("the fdl-prepare-publish console script is not installed (pip install -e .)")
    src = published_source(git_source)
    cache = binary_cache()
    argv = [str(publish_script), str(src.path), "--bin", "train", "--build", BUILD, "--variant", "cpu"]
    argv += ["--to", cache.file_url, "--signing-key", str(signing_key("k-json").secret), "--flake", test_flake]
    argv += ["--state-dir", str(tmp_path / "publish-state"), "--json", "-q"]

    done = subprocess.run(
        argv, env={**os.environ, "NIX_CONFIG": NIX_CONFIG}, capture_output=True, text=True, timeout=600
    )

    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert list(out)[:2] == ["kind", "schema"] and (out["kind"], out["schema"]) == ("published", 1)
    assert out["outputs"]["cpu"]["bin"].startswith("/nix/store/") and out["to"] == cache.file_url
    assert any("variant cpu: built, signed and copied" in note for note in out["notes"])
    # -q: nothing for people but warnings (the publish has none here).
    assert done.stderr == ""


# -- floDl's run files, as a publish writes them ---------------------------------------------------


def test_publish_writes_flodls_two_run_files_which_a_box_reads_and_checks_the_tree_against(
    test_flake, git_source, binary_cache, signing_key, tmp_path
):
    import yaml

    src = published_source(git_source)
    (src.path / "crate" / "src").mkdir(parents=True)
    (src.path / "crate" / "src" / "lib.rs").write_text("// the crate\n")
    (src.path / "crate" / "target").mkdir()
    (src.path / "crate" / "target" / "stale").write_text("a local build's output, never committed\n")
    src.commit({"crate/src/lib.rs": "// the crate\n"}, "a crate")
    spec = publish_spec(src.path, test_flake, binary_cache().file_url, signing_key("k-1").secret, tmp_path)
    notes: list[str] = []
    done = publish(replace(spec, commit=True), notes)

    # floDl's keys only (its older workers refuse any other), no smoke: the
    # smoke run is each box's own.
    written = yaml.safe_load((src.path / MANIFEST).read_text())
    assert set(written) <= set(manifest_mod.FIELDS) and "smoke" not in written
    assert written["bin"] == "train" and written["args"] == ["--epochs", "3"] and written["built"] is True
    assert written["run"] == done.run_id and len(done.run_id) == 32 and int(done.run_id, 16) >= 0
    assert set(written["digest"]) == {"sha256", "files", "bytes"} and written["digest"]["files"] == 2
    # The sidecar first, the manifest last: its presence is the commit point.
    assert (src.path / DIGEST).stat().st_mtime_ns <= (src.path / MANIFEST).stat().st_mtime_ns
    sidecar = (src.path / DIGEST).read_text()
    assert [line.split("  ", 1)[1] for line in sidecar.splitlines()] == ["README", "crate/src/lib.rs"]
    assert any("tree: 2 files" in n and DIGEST in n for n in notes)
    # What a box fetches is the commit: a clone of it reads and verifies.
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(src.path), str(clone)], check=True)
    subprocess.run(["rm", "-rf", str(clone / ".git")], check=True)
    read_back = manifest_mod.read(str(clone))
    assert read_back is not None and read_back.unknown_count == 0
    from prepare.build import digest

    assert "matches its digest (2 files" in digest.verify(str(clone), read_back)[0]
    recipe = manifest_mod.merge(SourceSpec(from_=src.url, smoke=("--box",)), read_back, src.url)
    assert recipe.smoke == ("--box",) and recipe.run_id == done.run_id


def test_the_manifest_is_not_written_through_a_file_planted_at_a_guessable_name(
    test_flake, git_source, binary_cache, signing_key, tmp_path
):
    src = published_source(git_source)
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    # The name the manifest's temporary file once had: the pid, guessable.
    (src.path / f"{MANIFEST}.{os.getpid()}.tmp").symlink_to(victim)
    publish(publish_spec(src.path, test_flake, binary_cache().file_url, signing_key("k-1").secret, tmp_path), [])
    assert victim.read_text() == "untouched\n"
    manifest = src.path / MANIFEST
    assert manifest.is_file() and not manifest.is_symlink() and "built: true" in manifest.read_text()
    assert not [p for p in src.path.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]


def test_publish_takes_no_smoke_run_since_flodls_manifest_has_no_field_for_it(tmp_path):
    publish_script = Path(console_script()).with_name("fdl-prepare-publish")
    if not publish_script.exists():
        pytest.skip("the fdl-prepare-publish console script is not installed (pip install -e .)")
    argv = [str(publish_script), str(tmp_path), "--bin", "train", "--to", "file:///x", "--signing-key", "/k"]
    for flag in (["--smoke", "--quick"], ["--no-smoke"]):
        done = subprocess.run([*argv, *flag], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert f"No such option: {flag[0]}" in done.stderr


def test_a_publish_pushes_the_dependency_artefacts_and_a_box_substitutes_them_with_the_binary(
    test_flake, git_source, binary_cache, signing_key, node_b, tmp_path
):
    # A cargo source (built in two derivations, nix/cargo-split.nix): the
    # box gets the dependency artefacts from the cache with the binary, so a
    # later change of the crate alone compiles the crate alone there too.
    files = trainer(manifest={}, nonce=nonce())
    files.update(
        {
            "Cargo.toml": '[package]\nname = "small"\nversion = "0.1.0"\nedition = "2021"\n',
            "Cargo.lock": 'version = 3\n\n[[package]]\nname = "small"\nversion = "0.1.0"\n',
            "src/main.rs": f'fn main() {{\n    println!("{nonce()}");\n}}\n',
        }
    )
    src = git_source(files)
    cache = binary_cache()
    key = signing_key("fleet-test-deps")
    publish(
        publish_spec(
            src.path,
            test_flake,
            cache.file_url,
            key.secret,
            tmp_path,
            commit=True,
            bin="target/release/small",
            build=None,
        ),
        [],
    )
    b = node_b()

    result = b.prepare(box(src.url, test_flake, b.root / "state", (cache.url,), (key.public,)))

    assert "prepared" in result, str(result.get("fail"))
    assert built(result) == []
    assert sorted(substituted(result)) == [
        "fdl-test-libtorch-cpu",
        "fdl-test-training-cpu",
        "fdl-test-training-deps-cpu",
    ]
    roots = b.root / "state" / "gcroots"
    assert any(os.readlink(p).endswith("-fdl-test-training-deps-cpu") for p in roots.iterdir())
