"""`fdl-prepare check` and `prepare.check`: everything an attempt settles,
settled without changing the box or building.

The parts are real, as for an attempt: a real sshd on loopback reached with
the real sftp (tests/sshd_fixtures.py), real sshfs mounts where a test needs
one already there, real Nix with the test flake (tests/nix_fixtures.py),
and the directories and the state directory on real file systems. What
each test proves is what the check did not do: no mount in
/proc/self/mountinfo, no directory, state directory or out-link made, no
store path built; and that where the check stops, the attempt stops too,
with the same reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from console import fdl_prepare
from nix_fixtures import build, require_nix, trainer, valid_path

from prepare import check as check_spec
from prepare import pipeline
from prepare.fail import Fail
from prepare.host import mounts
from prepare.nix.log import Log
from prepare.plan import plan
from prepare.spec import Checked, DataSpec, PrepareSpec, SourceSpec, SshSpec, StepCheck

pytestmark = pytest.mark.usefixtures("forget_mount_locks")

STEP_NAMES = ["plan", *(step.name for step in pipeline.STEPS)]


def check(spec: PrepareSpec, notes: list[str] | None = None, **kw: object) -> Checked:
    """The check of `spec`, as `prepare.check` runs it (a plan that fails is
    the check's first verdict), or on its plan with `kw` for the executor."""
    if not kw:
        return check_spec(spec, [] if notes is None else notes)
    return pipeline.run_check(plan(spec), [] if notes is None else notes, **kw)  # type: ignore[arg-type]


def attempt_fail(spec: PrepareSpec) -> Fail:
    with pytest.raises(Fail) as caught:
        pipeline.prepare(spec, [])
    return caught.value


def mount_points() -> list[str]:
    return [m.mount_point for m in mounts.read()]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME whose dataset cache is there already, so a test of another
    step sees the cache step pass without anything made."""
    home = tmp_path / "home"
    (home / ".flodl" / "data").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    return home


# -- the executor -------------------------------------------------------------------


def test_a_check_has_a_verdict_for_the_plan_then_each_step_of_the_pipeline_in_its_order(home):
    checked = check(PrepareSpec(cpu_only=True))
    assert list(checked.steps) == STEP_NAMES
    assert checked.ready and checked.fail is None
    assert checked.steps["gate"].verdict == "skipped" and "cpu_only" in checked.steps["gate"].detail
    assert {checked.steps[name].verdict for name in ("state", "variant", "source", "build", "smoke")} == {"skipped"}


def test_every_step_has_a_check_counterpart_and_the_check_runs_no_step_of_an_attempt(monkeypatch, home):
    # The check counterparts are the pipeline's own steps' (one declaration,
    # one order); an attempt's `run` is never what a check calls.
    def refuse(attempt: object) -> object:
        raise AssertionError("a check ran an attempt's step")

    steps = [pipeline.Step(s.name, refuse, s.check, s.wanted, s.skipped) for s in pipeline.STEPS]
    checked = pipeline.run_check(plan(PrepareSpec(cpu_only=True)), [], steps=steps)
    assert checked.ready and list(checked.steps) == STEP_NAMES


def test_a_spec_the_plan_refuses_is_the_checks_permanent_first_verdict():
    checked = check(PrepareSpec(cpu_only=True, libtorch="cu128"))
    assert checked.fail is not None and checked.fail.reason == "config.invalid" and checked.fail.permanent
    assert checked.steps["plan"].verdict == "failed"
    assert {checked.steps[name].verdict for name in STEP_NAMES[1:]} == {"not checked"}


def test_the_step_that_fails_stops_the_check_as_it_stops_the_attempt(tmp_path, home):
    spec = PrepareSpec(cpu_only=True, data=DataSpec(data_path=str(tmp_path / "absent")))
    checked = check(spec)
    assert checked.fail is not None
    assert checked.fail.reason == attempt_fail(spec).reason == "data.root-unusable"
    assert checked.steps["data"].verdict == "failed" and checked.steps["dirs"].verdict == "not checked"
    assert checked.summary().startswith("not ready: an attempt would stop at data (permanent, data.root-unusable)")


# -- step 2: the dataset root ---------------------------------------------------------


def test_a_bare_data_path_is_listed_as_an_attempt_lists_it(tmp_path, home):
    root = tmp_path / "data"
    root.mkdir()
    checked = check(PrepareSpec(cpu_only=True, data=DataSpec(data_path=str(root))))
    assert checked.steps["data"].verdict == "ok" and f"{root} is a listable directory" in checked.steps["data"].detail


def test_an_sshfs_source_is_reached_with_sftp_and_nothing_is_mounted_or_made(sshd, remote_tree, tmp_path, home):
    point = tmp_path / "not-yet" / "data"
    before = mount_points()
    checked = check(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point)))
    assert checked.ready, checked.fail
    data = checked.steps["data"]
    assert data.verdict == "would mount"
    assert f"{sshd.remote(remote_tree)}` read-only at {point} (the mountpoint made first)" in data.detail
    assert f"the data host reached and {remote_tree} found there (sftp)" in data.detail
    assert mount_points() == before
    assert not point.exists() and not point.parent.exists()


def test_the_sftp_check_uses_the_ssh_options_the_mount_would_and_leaves_out_sshfss_own(sshd):
    from prepare.data import url

    source = url.parse_source(sshd.source("/srv/data"))
    ssh = sshd.ssh_spec(extra=("reconnect", "idmap=user", "Ciphers=aes128-ctr,aes256-ctr", "-o Compression yes"))
    argv = url.sftp_argv(source, ssh)
    options = [argv[i + 1] for i, word in enumerate(argv) if word == "-o"]
    assert options[: len(sshd.options)] == list(sshd.options)
    assert "Ciphers=aes128-ctr,aes256-ctr" in options and "Compression=yes" in options
    assert f"IdentityFile={sshd.user_key}" in options and f"Port={sshd.port}" in options
    assert "BatchMode=yes" in options and not any(o.startswith(("reconnect", "idmap", "ro")) for o in options)
    assert argv[-2:] == ["--", f"{sshd.user}@{sshd.host}"]


def test_a_remote_path_sftp_batch_mode_cannot_take_safely_is_not_given_to_it():
    from prepare.data import url

    assert url.sftp_batch("/srv/data-1.2") == "cd /srv/data-1.2\n"
    assert url.sftp_batch("/srv/my data") == 'cd "/srv/my data"\n'
    for path in ('/srv/a"b', "/srv/a\\b", "/srv/a*", "/srv/a\x07b"):
        assert url.sftp_batch(path) is None, path


def test_an_sshfs_source_on_a_closed_port_is_transient_in_the_check_as_in_the_attempt(
    make_sshd, remote_tree, sshfs_mounts, home
):
    server = make_sshd()
    server.stop()
    spec = server.spec(data_source=server.source(remote_tree), data_path=str(sshfs_mounts.point()))
    checked = check(spec)
    assert checked.fail is not None and not checked.fail.permanent
    assert checked.fail.reason == attempt_fail(spec).reason == "data.unreachable"
    assert "with sftp" in checked.fail.message and "Connection refused" in checked.fail.message


def test_an_unknown_host_key_is_permanent_in_the_check_as_in_the_attempt(
    sshd, remote_tree, sshfs_mounts, tmp_path, home
):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    spec = PrepareSpec(
        data=DataSpec(data_source=sshd.source(remote_tree), data_path=str(sshfs_mounts.point())),
        ssh=SshSpec(
            identity_file=str(sshd.user_key),
            options=(f"UserKnownHostsFile={empty}", "GlobalKnownHostsFile=/dev/null", "StrictHostKeyChecking=yes"),
        ),
        cpu_only=True,
    )
    checked = check(spec)
    assert checked.fail is not None and checked.fail.permanent
    assert checked.fail.reason == attempt_fail(spec).reason == "data.host-key"
    assert "ssh-keyscan" in checked.fail.message


def test_a_remote_directory_that_is_not_there_stops_the_check_as_it_stops_the_attempt(
    sshd, remote_tree, sshfs_mounts, home
):
    spec = sshd.spec(data_source=sshd.source(remote_tree / "absent"), data_path=str(sshfs_mounts.point()))
    checked = check(spec)
    assert checked.fail is not None
    fail = attempt_fail(spec)
    assert (checked.fail.reason, checked.fail.kind) == (fail.reason, fail.kind)


def test_a_mount_of_the_source_already_there_is_judged_and_reused_not_remade(sshd, remote_tree, sshfs_mounts, home):
    point = sshfs_mounts.point()
    sshfs_mounts.sshfs(sshd, remote_tree, point)
    before = mount_points()
    checked = check(sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point)))
    assert checked.steps["data"].verdict == "ok"
    assert "an attempt reuses it" in checked.steps["data"].detail
    assert mount_points() == before and sshfs_mounts.count_at(point) == 1


# -- step 3 and 4: directories made by nothing --------------------------------------------


def test_a_missing_dataset_cache_would_be_created_and_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "fresh-home"))
    checked = check(PrepareSpec(cpu_only=True))
    assert checked.steps["dirs"].verdict == "would create"
    assert str(tmp_path / "fresh-home" / ".flodl" / "data") in checked.steps["dirs"].detail
    assert not (tmp_path / "fresh-home").exists()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_cache_that_could_not_be_created_stops_the_check_as_it_stops_the_attempt(tmp_path, monkeypatch):
    # A file where the cache's parent would be: makedirs fails, permanently.
    (tmp_path / "home").write_text("not a directory\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec = PrepareSpec(cpu_only=True)
    checked = check(spec)
    assert checked.fail is not None and checked.fail.permanent
    assert checked.fail.reason == attempt_fail(spec).reason == "dirs.unwritable"
    assert "cannot be created" in checked.fail.message


def test_the_probes_of_a_check_leave_nothing_behind(home, tmp_path, monkeypatch):
    stage = tmp_path / "stage"
    stage.mkdir()
    monkeypatch.setenv("TMPDIR", str(stage))
    before = sorted(p.name for p in (home / ".flodl" / "data").iterdir()), sorted(stage.iterdir())
    checked = check(PrepareSpec(cpu_only=True))
    assert checked.steps["dirs"].verdict == "ok" and "both writable" in checked.steps["dirs"].detail
    assert (sorted(p.name for p in (home / ".flodl" / "data").iterdir()), sorted(stage.iterdir())) == before


# -- steps 4 to 7 with real Nix --------------------------------------------------------------


def _nix_spec(flake: str, state: Path, source: str | None = None, **kw: object) -> PrepareSpec:
    return PrepareSpec(
        source=SourceSpec(from_=source) if source is not None else None,
        libtorch="cpu",
        cpu_only=True,
        flake=flake,
        state_dir=str(state),
        **kw,  # type: ignore[arg-type]
    )


def _logging_nix(tmp_path: Path) -> tuple[str, Path]:
    """A `nix` in front of the real one that records every argv it is given."""
    real = require_nix()
    calls = tmp_path / "nix-calls.jsonl"
    shim = tmp_path / "nix"
    shim.write_text(
        "#!/bin/sh\n"
        f"""python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' "$@" >> {calls}\n"""
        f'exec {real} "$@"\n'
    )
    shim.chmod(0o755)
    return str(shim), calls


def _outputs(drvs: tuple[str, ...]) -> list[str]:
    done = subprocess.run(["nix-store", "--query", "--outputs", *drvs], capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_a_check_says_what_the_attempt_would_build_and_builds_none_of_it(
    nix_env, test_flake, git_source, tmp_path, home
):
    source = git_source(trainer())
    state = tmp_path / "state"
    spec = _nix_spec(test_flake, state, source.url)
    shim, calls = _logging_nix(tmp_path)
    checked = check(spec, nix_program=shim)
    assert checked.ready, checked.fail
    assert checked.steps["state"].verdict == "would create" and not state.exists()
    assert checked.steps["build"].verdict == "would build"
    # The training derivation of this fresh source is new: built by nothing yet.
    training = [d for d in checked.build if "training" in d or "train" in d]
    assert training, checked.build
    assert all(path.endswith(".drv") for path in checked.build)
    outputs = _outputs(checked.build)
    assert outputs and not any(valid_path(out) for out in outputs)
    # Every nix call of the check: none builds, copies or writes a link.
    argvs = [json.loads(line) for line in calls.read_text().splitlines()]
    builds = [a for a in argvs if "build" in a]
    assert builds and all("--dry-run" in a and "--no-link" in a for a in builds)
    assert not any(word in a for a in argvs for word in ("copy", "--out-link", "realise"))
    assert not state.exists()

    # The attempt then builds exactly what the check said it would.
    notes: list[str] = []
    done = build(spec, notes)
    assert done.bin is not None
    assert all(valid_path(out) for out in outputs)
    assert any(n.startswith("built: ") for n in notes), notes


def test_a_check_after_an_attempt_finds_nothing_to_build_and_changes_nothing_in_the_state_directory(
    nix_env, test_flake, git_source, tmp_path, home
):
    source = git_source(trainer())
    state = tmp_path / "state"
    spec = _nix_spec(test_flake, state, source.url)
    build(spec, [])
    before = _tree(state)
    checked = check(spec)
    assert checked.ready, checked.fail
    assert checked.steps["state"].verdict == "ok"
    assert checked.steps["build"].verdict == "ok" and checked.build == () and checked.substitute == ()
    # Every entry as it was: the same names, links to the same places, files
    # holding the same bytes (a probe's write and removal leave none).
    assert _tree(state) == before


def _tree(root: Path) -> dict[str, object]:
    found: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            found[name] = ("link", os.readlink(path))
        elif path.is_file():
            found[name] = ("file", path.read_bytes())
        else:
            found[name] = ("dir",)
    return found


def test_a_state_directory_the_attempt_would_refuse_is_refused_by_the_check_and_left_as_it_was(
    nix_env, test_flake, tmp_path, home
):
    state = tmp_path / "state"
    state.mkdir()
    (state / "someone-elses").write_text("x\n")
    spec = _nix_spec(test_flake, state)
    checked = check(spec)
    assert checked.fail is not None and checked.fail.reason == "state.untrusted"
    assert attempt_fail(spec).reason == "state.untrusted"
    assert sorted(p.name for p in state.iterdir()) == ["someone-elses"]


def test_a_check_says_so_when_another_prepare_holds_the_state_lock_and_does_not_wait(
    nix_env, test_flake, tmp_path, home, lock_holder
):
    state = tmp_path / "state"
    spec = _nix_spec(test_flake, state)
    build(spec, [])
    lock_holder(str(state / "lock"), 60)
    notes: list[str] = []
    checked = check(spec, notes)
    assert checked.ready, checked.fail
    assert any(f"another fdl-prepare holds {state / 'lock'} now" in n for n in notes), notes


def test_an_unknown_variant_stops_the_check_before_any_dry_run_as_it_stops_the_attempt(
    nix_env, test_flake, tmp_path, home
):
    spec = PrepareSpec(libtorch="cu999", flake=test_flake, state_dir=str(tmp_path / "state"))
    checked = check(spec, steps=[s for s in pipeline.STEPS if s.name != "gate"])
    assert checked.fail is not None and checked.fail.reason == "libtorch.unknown-variant"
    assert checked.steps["build"].verdict == "not checked"


def test_a_check_on_a_gpu_box_gates_and_picks_the_variant_an_attempt_would(
    nix_env, test_flake, tmp_path, home, nvml_box
):
    from nvml_fixtures import ampere_pair

    nvml_box(ampere_pair())
    spec = PrepareSpec(libtorch="auto", flake=test_flake, state_dir=str(tmp_path / "state"))
    checked = check(spec)
    assert checked.ready, checked.fail
    assert checked.steps["gate"] == StepCheck("ok", "offering NVIDIA GPU 0, 1")
    assert checked.steps["variant"].detail.startswith("cu128 (CUDA 12.8, kernels for ")
    assert checked.steps["variant"].detail.endswith("): covers the offered cards")


def test_a_card_the_variant_ships_no_kernel_for_stops_the_check_as_it_stops_the_attempt(
    nix_env, test_flake, tmp_path, home, nvml_box
):
    from nvml_fixtures import pascal_card

    nvml_box(pascal_card())
    spec = PrepareSpec(libtorch="cu128", flake=test_flake, state_dir=str(tmp_path / "state"))
    checked = check(spec)
    assert checked.fail is not None and checked.fail.reason == attempt_fail(spec).reason == "libtorch.arch-uncovered"
    assert checked.steps["variant"].verdict == "failed" and checked.steps["build"].verdict == "not checked"


def test_a_sick_card_devices_names_stops_the_check_at_the_gate(home, nvml_box):
    from nvml_fixtures import FakeGpu

    nvml_box([FakeGpu(), FakeGpu(ecc=2)])
    checked = check(PrepareSpec(devices=(0, 1)))
    assert checked.fail is not None and checked.fail.reason == "gpu.device-unhealthy"
    assert checked.steps["gate"].verdict == "failed" and checked.steps["data"].verdict == "not checked"


# -- what a dry run says, on every Nix ---------------------------------------------------------

# What `nix build --dry-run --log-format internal-json` wrote, message by
# message, on Nix 2.8 (Debian 12), 2.26 (Debian 13) and 2.34 (Debian testing).
DRY_RUN_SAID = {
    "2.8": [
        "these 2 derivations will be built:",
        "  /nix/store/lzvz93nlmj4nd61sr8xz2y9aw0q0fnav-dry-b2-3827.drv",
        "  /nix/store/slpkajlh5ylpq2z0i2ai5q1wafa24gak-dry-b1-3827.drv",
        "these 2 paths will be fetched (0.00 MiB download, 0.00 MiB unpacked):",
        "  /nix/store/g2icin1l502p47hd33fgv3dgjclxqy9x-dry-f2-3827",
        "  /nix/store/n26xq5lc3a6fl95q69v7p4ha2x00x1hq-dry-f1-3827",
    ],
    "2.26": [
        "this derivation will be built:",
        "  /nix/store/ckjnlq1s1yq8hmy5gjc3c4vx3l3xmnwz-dry-b3-26922.drv",
        "this path will be fetched (0.00 MiB download, 0.00 MiB unpacked):",
        "  /nix/store/aspix738lbb6f6ln8np3bvzc2jdrszd4-dry-f3-26922",
    ],
    "2.34": [
        "these 2 derivations will be built:",
        "  /nix/store/cg24hsy0wnszn3apksxqhqjxmzd9zmzj-dry-b1-4856.drv",
        "  /nix/store/kazwzhf7pypbbdqn5gpqs0d8vc72wcg0-dry-b2-4856.drv",
        "these 2 paths will be fetched (0.3 KiB download, 0.2 KiB unpacked):",
        "  /nix/store/c1cnqnb2h36h375lcwsgsncig81lfrx6-dry-f1-4856",
        "  /nix/store/f3f6a3sbxwzba2pk487g3ri5hnwly61g-dry-f2-4856",
    ],
}


@pytest.mark.parametrize("version", sorted(DRY_RUN_SAID))
def test_what_a_dry_run_would_build_and_fetch_is_read_alike_from_every_nix(version):
    log = Log()
    log.feed('@nix {"action":"start","id":1,"level":6,"text":"querying info about missing paths","type":0}')
    for said in DRY_RUN_SAID[version]:
        log.feed("@nix " + json.dumps({"action": "msg", "level": 0, "msg": said}))
    log.feed('@nix {"action":"stop","id":1}')
    missing = log.missing
    said = DRY_RUN_SAID[version]
    assert missing.build == [line.strip() for line in said if line.endswith(".drv")]
    assert missing.fetch == [line.strip() for line in said if line.startswith("  ") and not line.endswith(".drv")]
    assert missing.counts["build"] == len(missing.build) and missing.counts["fetch"] == len(missing.fetch)
    assert missing.fetch_size is not None and "download" in missing.fetch_size


def test_a_dry_run_list_is_bounded_but_counted_whole():
    from prepare.nix import log as nix_log

    log = Log()
    log.feed("@nix " + json.dumps({"action": "msg", "level": 0, "msg": "these 20000 paths will be fetched (1 GiB):"}))
    for i in range(nix_log.MAX_LISTED + 5):
        log.feed("@nix " + json.dumps({"action": "msg", "level": 0, "msg": f"  /nix/store/{i:032d}-p"}))
    assert len(log.missing.fetch) == nix_log.MAX_LISTED and log.missing.counts["fetch"] == nix_log.MAX_LISTED + 5


def test_a_real_dry_run_names_the_derivations_the_build_would_run(nix_env, tmp_path):
    from prepare.nix.runner import Nix

    marker = tmp_path.name
    expr = tmp_path / "flake.nix"
    expr.write_text(
        '{ outputs = { self }: { x = derivation { name = "dry-' + marker + '"; system = "' + _system() + '"; '
        'builder = "/bin/sh"; args = [ "-c" "echo > $out" ]; }; }; }\n'
    )
    dry = Nix(str(tmp_path)).dry_run([f"path:{tmp_path}#x"])
    assert dry.build_count == 1 and dry.build[0].endswith(f"-dry-{marker}.drv")
    assert dry.fetch == () and not valid_path(dry.results[0]["outputs"]["out"])


def _system() -> str:
    from prepare.nix.runner import system

    return system()


# -- the command ---------------------------------------------------------------------------------


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FDL_PREPARE_CONFIG",)}
    env["HOME"] = str(home)
    return env


def test_check_takes_an_attempts_options_after_its_word_and_the_roots_before_it(tmp_path, home):
    config = tmp_path / "prepare.toml"
    config.write_text(f'[join]\ncpu_only = true\ndata_path = "{tmp_path / "absent"}"\n')
    done = fdl_prepare(_env(home), "check", "--config", str(config), "--json")
    assert done.returncode == 78, done.stderr
    out = json.loads(done.stdout)
    assert out["kind"] == "check" and out["schema"] == 1 and out["ready"] is False
    assert out["fail"]["reason"] == "data.root-unusable" and list(out["steps"]) == STEP_NAMES
    root = tmp_path / "root"
    root.mkdir()
    done = fdl_prepare(_env(home), "--config", str(config), "check", "--data-path", str(root))
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())
    assert f"data ok: {root} is a listable directory" in said
    assert "fdl-prepare check: ready: an attempt would prepare this box" in said


def test_check_prints_a_line_a_step_within_80_columns_when_stdout_is_not_a_terminal(tmp_path, home):
    env = _env(home)
    env.pop("COLUMNS", None)
    done = fdl_prepare(env, "check", "--cpu-only", "--data-path", str(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines and max(len(line) for line in lines) <= 80
    steps = lines[: next(i for i, line in enumerate(lines) if line.startswith("fdl-prepare check: "))]
    assert [line.split()[0] for line in steps if not line.startswith("   ")] == STEP_NAMES


def test_a_check_of_a_box_without_a_gpu_exits_as_the_attempt_would_and_advises_cpu_only(tmp_path, home):
    from nvml_fixtures import host_has_nvml, no_driver_env

    if host_has_nvml():
        pytest.skip("this host has a real libnvidia-ml.so.1")
    env = {**no_driver_env(), "HOME": str(home)}
    attempt = fdl_prepare(env, "--json")
    done = fdl_prepare(env, "check", "--json")
    assert done.returncode == attempt.returncode == 78
    assert json.loads(done.stdout)["fail"]["reason"] == json.loads(attempt.stdout)["reason"] == "gpu.no-driver"
    assert "--cpu-only" in json.loads(done.stdout)["fail"]["message"]


def test_the_check_command_leaves_no_state_directory_and_no_scratch_behind(tmp_path, home, nix_env, test_flake):
    state = tmp_path / "state"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**_env(home), "TMPDIR": str(scratch), "NIX_CONFIG": nix_env["NIX_CONFIG"]}
    done = fdl_prepare(
        env, "check", "--cpu-only", "--libtorch", "cpu", "--flake", test_flake, "--state-dir", str(state), timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert not state.exists() and list(scratch.iterdir()) == []
    assert shutil.which("nix") is not None
