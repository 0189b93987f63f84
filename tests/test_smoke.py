"""The smoke run of the built binary: once, with a timeout, before prepare
succeeds. A program that, like a Nix-built one, looks for libcuda.so.1 only
in the driver directory (tests/driver_fixtures.py) passes when the driver
directory holds it and fails, permanently and with the loader's words, when
it does not; a timeout and any other failure are transient. Through the
pipeline, the example trainer (a Rust crate over the real libtorch) takes
one training step in the box's smoke run (`--smoke`), and the same crate
linked without a RUNPATH to libtorch fails it permanently."""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from driver_fixtures import smoke_binary
from nix_fixtures import DIGEST, MANIFEST, manifest_text, procs_with
from nvml_fixtures import ampere_pair
from other_user import reachable_dir, run_as

from prepare import smoke
from prepare.fail import Fail
from prepare.pipeline import prepare
from prepare.spec import Binary, PrepareSpec, SourceSpec

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "trainer"


def script(path: Path, body: str) -> Binary:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return Binary(path=str(path), cwd=str(path.parent))


@pytest.fixture
def public() -> Iterator[Path]:
    """A directory the smoke run's unprivileged user can reach (pytest's own
    are under a 0700 directory of root's), outside the /tmp it gets fresh."""
    path = reachable_dir("fdl-smoke-test-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fail_of(binary: Binary, args: list[str], timeout: float = 30) -> Fail:
    with pytest.raises(Fail) as failed:
        smoke.run(binary, args, timeout, [])
    return failed.value


# -- a program built like a Nix one --------------------------------------------------------


def test_a_binary_that_finds_libcuda_in_the_driver_directory_passes(driver_libraries, public):
    driver = public / "driver"
    driver.mkdir()
    (driver / "libcuda.so.1").symlink_to(driver_libraries.build / "libcuda.so.1")
    train = smoke_binary(driver_libraries, driver, public / "bin" / "train")
    notes: list[str] = []
    smoke.run(Binary(str(train), str(public)), [], 30, notes)
    assert len(notes) == 1 and notes[0].startswith(f"smoke run `{train}` (in {public}) passed in ")


def test_a_binary_whose_libcuda_is_not_in_the_driver_directory_fails_permanently_with_the_loaders_words(
    driver_libraries, public
):
    driver = public / "driver"
    driver.mkdir()
    train = smoke_binary(driver_libraries, driver, public / "bin" / "train")
    fail = fail_of(Binary(str(train), str(public)), ["--smoke"])
    assert fail.permanent and fail.reason == "smoke.loader"
    message = fail.message
    assert message.startswith(f"smoke run `{train} --smoke` (in {public}): the loader could not start it (exit 127)")
    assert "error while loading shared libraries: libcuda.so.1: cannot open shared object file" in message
    assert "driver_dir" in message and "/run/opengl-driver/lib" in message


def test_the_driver_directory_kept_by_the_gate_is_where_the_binary_finds_the_hosts_driver(driver_host, public):
    """The whole chain: the host's libcuda, registered with its linker cache,
    linked into the driver directory by the step, loaded from there by a
    binary that never reads the cache; gone from the host, the box stops
    at the gate, and the binary no longer starts."""
    driver_host.install("570.86.15")
    driver = driver_host.root / "driver"
    train = driver_host.smoke_binary(driver)
    binary = Binary(str(train), str(driver_host.root))
    assert "links" in driver_host.ensure(driver)
    smoke.run(binary, [], 30, [])

    driver_host.remove("cuda")
    assert driver_host.ensure(driver)["fail"]["reason"] == "gpu.no-driver"
    fail = fail_of(binary, [])
    assert fail.reason == "smoke.loader" and "libcuda.so.1" in fail.message


# -- kinds ------------------------------------------------------------------------------------


def test_a_smoke_run_past_its_timeout_is_transient_with_its_last_lines(public):
    binary = script(public / "train", "echo 'initialising CUDA' >&2\nexec sleep 30\n")
    fail = fail_of(binary, ["--smoke"], timeout=0.5)
    assert not fail.permanent and fail.reason == "smoke.timeout"
    assert "did not finish within 0.5s" in fail.message and "initialising CUDA" in fail.message
    assert "smoke_timeout (--smoke-timeout)" in fail.message


def test_a_binary_that_starts_and_fails_is_transient_with_the_last_lines_of_its_output(public):
    lines = "".join(f"echo 'line {i}'\n" for i in range(40))
    binary = script(public / "train", lines + "echo 'CUDA error: no kernel image is available' >&2\nexit 1\n")
    fail = fail_of(binary, ["--smoke"])
    assert not fail.permanent and fail.reason == "smoke.failed"
    assert "exited 1" in fail.message and "CUDA error: no kernel image is available" in fail.message
    assert "line 39" in fail.message and "line 20" not in fail.message
    assert "publish again" in fail.message


def test_a_binary_that_is_not_there_is_permanent(public):
    fail = fail_of(Binary(str(public / "no-such-train"), str(public)), [])
    assert fail.permanent and fail.reason == "smoke.loader"
    assert str(public / "no-such-train") in fail.message


def test_smoke_arguments_the_kernel_refuses_are_transient_not_a_missing_binary(public):
    binary = script(public / "train", "exit 0\n")
    fail = fail_of(binary, ["x" * 200_000])
    assert not fail.permanent and fail.reason == "smoke.failed"
    assert "E2BIG" in fail.message and "smoke" in fail.message and len(fail.message) < 2000


def test_the_binary_runs_in_its_cwd_with_the_arguments_given(public):
    # The binary writes down where it ran and what it was given; the test
    # reads that back, so a run in another directory or with the arguments
    # split differently is seen, not only a non-zero exit.
    seen = public / "seen"
    seen.mkdir(mode=0o1777)
    seen.chmod(0o1777)  # the run may not be root: a place it can write
    seen = seen / "where"
    binary = script(public / "train", 'pwd > "$1"; printf "%s\\n" "$#" "$2" >> "$1"\n')
    smoke.run(binary, [str(seen), "two words"], 30, [])
    assert seen.read_text().splitlines() == [str(public), "2", "two words"]


# -- the training source's code, run as the training would ------------------------------------

# The groups a GPU's device nodes belong to (AMD's /dev/kfd and /dev/dri).
GPU_GROUPS = ("render", "video")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
NOBODY = 65534

# What a test binary prints about itself: who it is, its capabilities and
# no_new_privs from the kernel, its environment, and whether its home is its own.
REPORT = """#!/bin/sh
{
  echo "uid=$(id -u) gid=$(id -g) groups=$(id -G)"
  grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status
  env | sort | sed 's/^/env /'
  touch "$HOME/written" && echo "home writable"
} > "$1"
"""


def _report(path: Path) -> dict[str, object]:
    lines = path.read_text().splitlines()
    status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    env = dict(line[4:].split("=", 1) for line in lines if line.startswith("env "))
    ids = dict(part.split("=", 1) for part in lines[0].split(" ", 2))
    return {"ids": ids, "status": status, "env": env, "home_writable": "home writable" in lines}


def _outbox(public: Path) -> Path:
    # Somewhere the unprivileged run may write its report.
    out = public / "out"
    out.mkdir()
    out.chmod(0o1777)
    return out / "report"


@root_only
def test_the_smoke_run_runs_as_nobody_with_no_capabilities_and_a_clean_environment(public, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI-not-for-the-training")
    monkeypatch.setenv("SSH_AUTH_SOCK", "/run/user/0/ssh-agent")
    monkeypatch.setenv("NIX_CONFIG", "access-tokens = github.com=ghp_secret")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    monkeypatch.setenv("NVIDIA_DRIVER_CAPABILITIES", "compute,utility")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    binary = script(public / "train", REPORT.removeprefix("#!/bin/sh\n"))
    report = _outbox(public)
    notes: list[str] = []
    smoke.run(binary, [str(report)], 30, notes, user="nobody")
    seen = _report(report)
    # What the test binary printed, for the record (and the report).
    print(json.dumps(seen, indent=2, sort_keys=True))

    gpu_groups = sorted(g.gr_gid for g in grp.getgrall() if g.gr_name in GPU_GROUPS)
    ids = seen["ids"]
    assert isinstance(ids, dict)
    assert (ids["uid"], ids["gid"]) == (str(NOBODY), str(NOBODY))
    # Its own group and the GPUs' only: none of root's.
    assert sorted(map(int, ids["groups"].split())) == sorted({NOBODY, *gpu_groups})
    none = "0000000000000000"
    assert seen["status"] == {
        "CapInh": none, "CapPrm": none, "CapEff": none, "CapBnd": none, "CapAmb": none, "NoNewPrivs": "1",
    }  # fmt: skip
    env = seen["env"]
    assert isinstance(env, dict)
    home = env["HOME"]
    assert set(env) - {"PWD", "SHLVL", "_", "OLDPWD"} == {
        "PATH", "HOME", "TMPDIR", "CUDA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "LC_ALL",
        *(k for k in ("LANG", "LANGUAGE", "TZ", "LOCALE_ARCHIVE") if k in os.environ),
    }  # fmt: skip
    assert env["CUDA_VISIBLE_DEVICES"] == "1,0" and env["PATH"] == os.environ["PATH"]
    assert env["TMPDIR"] == home and home.startswith(("/tmp/fdl-smoke-", "/var/tmp/fdl-smoke-"))
    assert seen["home_writable"] and not os.path.exists(home), "the run's home outlived it"
    assert notes[0].endswith(
        "(as nobody"
        + "".join(
            f", {n}" if i else f" with {n}"
            for i, n in enumerate([n for n in GPU_GROUPS if n in {g.gr_name for g in grp.getgrall()}])
        )
        + ", no capabilities, a clean environment, in a PID namespace of its own, with its own /proc, /tmp, /var/tmp and /dev/shm)"
    ), notes


@pytest.fixture
def trainer() -> Iterator[Any]:
    from other_user import real_user

    yield from real_user()


@root_only
def test_with_a_training_user_the_smoke_run_runs_as_it_with_no_capabilities_and_a_clean_environment(
    public, trainer, monkeypatch
):
    from prepare.plan import plan

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI-not-for-the-training")
    binary = script(public / "train", REPORT.removeprefix("#!/bin/sh\n"))
    report = _outbox(public)
    # `user` outranks smoke_user: the binary is proven as whom it will train as.
    planned = plan(PrepareSpec(user=trainer.pw_name, smoke_user="nobody"))
    notes: list[str] = []
    smoke.run(binary, [str(report)], planned.smoke.timeout_s, notes, user=planned.smoke.user)
    seen = _report(report)
    ids = seen["ids"]
    assert isinstance(ids, dict)
    assert (ids["uid"], ids["gid"]) == (str(trainer.pw_uid), str(trainer.pw_gid))
    assert seen["status"]["CapEff"] == "0000000000000000" and seen["status"]["NoNewPrivs"] == "1"
    env = seen["env"]
    assert isinstance(env, dict) and "AWS_SECRET_ACCESS_KEY" not in env
    assert f"(as {trainer.pw_name}" in notes[0]


def _devices_allowed() -> Path:
    """A directory every user can reach on a file system that honours
    device nodes (a tmpfs /tmp is often mounted nodev, as Debian 13's is)."""
    for base in ("/var/lib", "/var/cache"):
        if os.path.isdir(base) and not os.statvfs(base).f_flag & os.ST_NODEV:
            path = Path(tempfile.mkdtemp(prefix="fdl-smoke-nodes-", dir=base))
            path.chmod(0o755)
            return path
    pytest.skip("neither /var/lib nor /var/cache is on a file system that allows device nodes")


@root_only
def test_a_gpu_device_node_of_the_video_group_stays_usable_and_roots_own_do_not():
    try:
        video = grp.getgrnam("video").gr_gid
    except KeyError:
        pytest.skip("this box has no video group")
    where = _devices_allowed()
    # The binary and the parents of the nodes must be reachable by nobody.
    if not all(os.stat(p).st_mode & 0o001 for p in [where, *where.parents]):
        shutil.rmtree(where)
        pytest.skip(f"{where} is not reachable by other users")
    try:
        # Device nodes as a GPU's are: the same character device as
        # /dev/null, owned by root, readable by one group.
        for name, group in (("renderD128", video), ("roots", 0)):
            os.mknod(where / name, 0o660 | 0o020000, os.makedev(1, 3))
            os.chown(where / name, 0, group)
            (where / name).chmod(0o660)
        opens = f"cat {where / 'renderD128'} || exit 3\ncat {where / 'roots'} 2>/dev/null && exit 4\nexit 0\n"
        smoke.run(script(where / "train", opens), [], 30, [])
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _gone(marker: str, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while procs_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not procs_with(marker)


LEAVES = """setsid sleep {m}1 > /dev/null 2>&1 < /dev/null &
sleep {m}2 &
sh -c 'sleep {m}3 & exit 0'
"""


@pytest.mark.parametrize("ends", ["success", "timeout"])
def test_everything_the_smoke_run_started_is_stopped_when_it_ends_a_setsid_child_too(public, ends):
    marker = f"9{os.getpid() % 1000:03d}{time.time_ns() % 100}"
    body = LEAVES.format(m=marker) + ("exit 0\n" if ends == "success" else "echo 'waiting' >&2\nexec sleep 60\n")
    binary = script(public / "train", body)
    try:
        started = time.monotonic()
        if ends == "success":
            smoke.run(binary, [], 30, [])
        else:
            fail = fail_of(binary, [], timeout=1.5)
            assert fail.reason == "smoke.timeout" and "with everything it started" in fail.message
        assert time.monotonic() - started < 10
        assert _gone(f"sleep {marker}", 2), procs_with(f"sleep {marker}")
    finally:
        for pid, _ in procs_with(f"sleep {marker}"):
            os.kill(pid, signal.SIGKILL)


@root_only
def test_as_another_user_the_smoke_run_runs_as_itself_cleanly_and_still_stops_what_it_started(public):
    marker = f"8{os.getpid() % 1000:03d}{time.time_ns() % 100}"
    binary = script(public / "train", REPORT.removeprefix("#!/bin/sh\n") + LEAVES.format(m=marker))
    report = _outbox(public)
    code = (
        "from prepare import smoke\nfrom prepare.spec import Binary\nnotes = []\n"
        f"smoke.run(Binary({binary.path!r}, {binary.cwd!r}), [{str(report)!r}], 30, notes, user='root')\n"
        "print(notes[0])\n"
    )
    try:
        done = run_as(NOBODY, code, env={"GITHUB_TOKEN": "ghp_not_for_the_training", "LANG": "C.UTF-8"})
        assert done.returncode == 0, done.stderr
        print(done.stdout)
        seen = _report(report)
        print(json.dumps(seen, indent=2, sort_keys=True))
        assert seen["ids"]["uid"] == str(NOBODY)
        status = seen["status"]
        assert isinstance(status, dict)
        assert (status["CapEff"], status["CapPrm"], status["CapInh"], status["CapAmb"], status["NoNewPrivs"]) == (
            "0000000000000000", "0000000000000000", "0000000000000000", "0000000000000000", "1",
        )  # fmt: skip
        assert "GITHUB_TOKEN" not in seen["env"] and "PYTHONPATH" not in seen["env"]  # type: ignore[operator]
        assert "(fdl-prepare is not root)" in done.stdout and "under a subreaper" in done.stdout
        assert _gone(f"sleep {marker}", 2), procs_with(f"sleep {marker}")
    finally:
        for pid, _ in procs_with(f"sleep {marker}"):
            os.kill(pid, signal.SIGKILL)


@root_only
@pytest.mark.parametrize("user", ["fdl-no-such-user", "root"])
def test_a_smoke_user_that_does_not_exist_or_is_root_is_permanent_naming_smoke_user(public, user):
    binary = script(public / "train", "exit 0\n")
    with pytest.raises(Fail) as failed:
        smoke.run(binary, [], 30, [], user=user)
    fail = failed.value
    assert fail.permanent and fail.reason == "config.invalid"
    assert f"smoke_user = {user!r}" in fail.message and "--smoke-user" in fail.message


GIGABYTE = """
import resource, sys
from prepare import smoke
from prepare.fail import Fail
from prepare.spec import Binary
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    smoke.run(Binary(sys.argv[1], sys.argv[2]), [], 120, [])
except Fail as fail:
    message, reason = fail.message, fail.reason
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before, after, len(message), reason)
print(message[-300:])
"""


def test_a_smoke_binary_printing_a_gigabyte_leaves_the_preparers_memory_flat_and_its_message_bounded(public):
    # A gigabyte on stdout, a gigabyte without a newline on stderr, then a
    # last line that says why.
    body = (
        "head -c 1073741824 /dev/zero | tr '\\0' x\n"
        "head -c 1073741824 /dev/zero | tr '\\0' y >&2\n"
        "echo >&2; echo 'the reason it failed' >&2\nexit 1\n"
    )
    binary = script(public / "train", body)
    done = subprocess.run(
        [sys.executable, "-c", GIGABYTE, binary.path, binary.cwd],
        cwd=str(REPO), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    first, _, tail = done.stdout.partition("\n")
    before, after, length, reason = first.split()
    grew_mib = (int(after) - int(before)) / 1024
    print(f"resident set grew {grew_mib:.1f} MiB; message {length} characters")
    assert reason == "smoke.failed"
    assert grew_mib < 64, f"the preparer's resident set grew {grew_mib:.0f} MiB"
    assert int(length) < 16384
    assert "the reason it failed" in tail


# -- through the pipeline ----------------------------------------------------------------------


@pytest.fixture
def shared_stage() -> Iterator[Path]:
    """A stage the Nix build users can enter (see test_end_to_end)."""
    stage = Path(tempfile.mkdtemp(prefix="fdl-smoke-stage-", dir="/tmp"))
    stage.chmod(0o1777)
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def example_files() -> dict[str, str | None]:
    """The example trainer's source as published: every tracked file of it."""
    files: dict[str, str | None] = {}
    for path in sorted(EXAMPLE.rglob("*")):
        rel = path.relative_to(EXAMPLE)
        if path.is_file() and "target" not in rel.parts:
            files[str(rel)] = path.read_text()
    return files


@pytest.fixture
def example_source(git_source):
    """The example trainer (a Rust crate over the real libtorch) as a
    published source, its run files as shipped (floDl's manifest and digest;
    the smoke run, `--smoke`, is the box's)."""
    return git_source(example_files())


# A training source the test flake builds with /bin/sh, whose `train
# --smoke` loads what a CUDA binary links the way the loader would: from the
# driver directory, the one place a Nix-built program looks for
# libcuda.so.1 (nixpkgs' addDriverRunpath). A missing one is reported in the
# loader's words, so fdl-prepare's smoke run reads it as a real binary's.
DRIVER_PROBE = r"""
cat > train <<'SCRIPT'
#!/bin/sh
if [ "${1:-}" = --smoke ]; then
    [ -e /run/opengl-driver/lib/libcuda.so.1 ] || {
        echo "$0: error while loading shared libraries: libcuda.so.1: cannot open shared object file: No such file or directory" >&2
        exit 127
    }
fi
echo "driver probe: libcuda.so.1 loads"
SCRIPT
chmod +x train
"""


@pytest.fixture
def driver_probe_source(git_source):
    return git_source(
        {
            "build.sh": DRIVER_PROBE,
            MANIFEST: manifest_text(bin="train", build="/bin/sh build.sh"),
        }
    )


@pytest.fixture
def box(monkeypatch, tmp_path, shared_stage) -> None:
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(shared_stage))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _spec(test_flake: str, state_dir: str, url: str, **kw: object) -> PrepareSpec:
    source = SourceSpec(from_=url, smoke=kw.pop("smoke", None))  # type: ignore[arg-type]
    return PrepareSpec(source=source, flake=test_flake, state_dir=state_dir, **kw)  # type: ignore[arg-type]


@pytest.mark.nix
def test_the_example_trainers_smoke_run_takes_a_training_step_before_prepare_succeeds(
    nix_env, torch_flake, state_dir, example_source, box
):
    notes: list[str] = []
    spec = _spec(torch_flake, state_dir, example_source.url, libtorch="cpu", cpu_only=True, smoke=("--smoke",))
    done = prepare(spec, notes)
    assert done.bin is not None
    assert list(done.timings)[-2:] == ["build", "smoke"]
    passed = [n for n in notes if n.startswith(f"smoke run `{done.bin.path} --smoke`") and " passed in " in n]
    assert len(passed) == 1, notes
    # The step's own last line: forward, backward and SGD through libtorch.
    before, after = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", passed[0]).groups())  # type: ignore[union-attr]
    assert after < before and "one training step (forward, backward, SGD)" in passed[0]


@pytest.mark.nix
def test_a_binary_whose_libtorch_is_out_of_its_reach_fails_the_smoke_run_permanently_with_the_loaders_words(
    nix_env, torch_flake, state_dir, git_source, box
):
    # Built as a merged root in the build directory leaves it: linked against
    # libtorch there, with no RUNPATH to the store's (no NIX_LDFLAGS).
    files = example_files()
    files[MANIFEST] = manifest_text(
        bin="target/release/train", build="NIX_LDFLAGS= /usr/bin/cargo build --release --offline"
    )
    del files[DIGEST]  # no digest: the tree is not the example's as published
    source = git_source(files)
    with pytest.raises(Fail) as failed:
        prepare(_spec(torch_flake, state_dir, source.url, libtorch="cpu", cpu_only=True, smoke=("--smoke",)), [])
    fail = failed.value
    assert fail.permanent and fail.reason == "smoke.loader"
    assert "error while loading shared libraries: libtorch_cpu.so: cannot open shared object file" in fail.message
    assert "the loader could not start it" in fail.message


@pytest.mark.nix
def test_a_cuda_build_on_a_box_without_the_driver_directory_stops_at_the_smoke_run(
    nix_env, test_flake, state_dir, driver_probe_source, box, nvml_box
):
    if os.path.exists("/run/opengl-driver/lib/libcuda.so.1"):
        pytest.skip("this machine has a driver directory holding libcuda.so.1")
    nvml_box(ampere_pair())
    with pytest.raises(Fail) as failed:
        prepare(_spec(test_flake, state_dir, driver_probe_source.url, libtorch="cu128", smoke=("--smoke",)), [])
    fail = failed.value
    assert fail.permanent and fail.reason == "smoke.loader"
    assert "libcuda.so.1: cannot open shared object file" in fail.message
    assert "driver directory" in fail.message


@pytest.mark.nix
def test_the_smoke_run_is_the_boxs_and_a_manifests_smoke_key_is_only_noted(
    nix_env, test_flake, state_dir, git_source, box
):
    # floDl's manifest has no smoke: a publisher's `smoke` key is not floDl's,
    # so it is named as unknown and runs nothing; the box's own runs.
    build = (
        'printf \'#!/bin/sh\\n[ "$1" = --ok ] || { echo "bad smoke: $*" >&2; exit 4; }\\n\' > train && chmod +x train'
    )
    published = git_source({MANIFEST: manifest_text(bin="train", build=build, smoke=["--wrong"])})
    spec = _spec(test_flake, state_dir, published.url, libtorch="cpu", cpu_only=True, smoke=("--ok",))
    notes: list[str] = []
    prepare(spec, notes)
    assert any(n.startswith("smoke run ") and "--ok` " in n for n in notes), notes
    assert any("has 1 key this fdl-prepare does not know, ignored: smoke" in n for n in notes)

    with pytest.raises(Fail) as failed:
        prepare(_spec(test_flake, state_dir, published.url, libtorch="cpu", cpu_only=True, smoke=("--wrong",)), [])
    assert failed.value.reason == "smoke.failed" and "bad smoke: --wrong" in failed.value.message

    notes = []
    done = prepare(_spec(test_flake, state_dir, published.url, libtorch="cpu", cpu_only=True), notes)
    assert "smoke" not in done.timings and not any(n.startswith("smoke run") for n in notes)


# -- the recipe ---------------------------------------------------------------------------


def test_the_recipe_takes_the_boxs_smoke_whatever_the_manifest_says():
    from prepare.build import manifest

    box = SourceSpec(from_="path:/x", bin="train", smoke=("--box",))
    assert manifest.merge(box, manifest.parse("bin: train\nsmoke: []\n"), "path:/x").smoke == ("--box",)
    assert manifest.merge(box, manifest.parse("bin: train\n"), "path:/x").smoke == ("--box",)
    assert manifest.merge(box, None, "path:/x").smoke == ("--box",)
    # Not part of the build: the flake gets the same recipe either way.
    with_smoke = manifest.merge(box, None, "path:/x").flake_input("cpu", 1)
    without = manifest.merge(SourceSpec(from_="path:/x", bin="train"), None, "path:/x").flake_input("cpu", 1)
    assert with_smoke == without
