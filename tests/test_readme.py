"""README.md, run as written.

Every fenced block of the README says in its info string what it is:
`sh` (commands, one a line), `toml config` (the example config), `python`
(the library example), `nix flake` and `nix module` (the NixOS wiring and
the host's module), `ini drop-in` (systemd drop-ins), `text output=NAME`
(what a command prints; `…` stands for any text). Each is run here against
the test rig: the offline Nix configuration and the test flake, the fake
NVML, the loopback sshd, a loopback binary cache.

The examples name an operator's own hosts and paths (`storage.example`,
`github:example/fleet`, `/etc/fdl/`, ...). `PLACEHOLDERS` lists each, and a
rig puts its own in their place; nothing else of a command is changed.
A command that cannot run here is listed in `ACCOUNTED` with the test that
checks it as far as it can be checked, and that test says why.

Commands of the interface still being built elsewhere (`check`, `gpus` as
a health check, `--version` with the revision, `-q`, the `[reason]` on a
failure line, journal priorities) are marked `PENDING`: strict xfails that
turn into passes, and so into failures to remove the mark, when their
branches land.

The links: every relative link of the README and of docs/ leads to a file
that exists and, with an `#anchor`, to a heading that does.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from console import console_script
from nix_fixtures import NIX_CONFIG, GitSource, require_nix, valid_path
from nvml_fixtures import FakeGpu, ampere_pair, hgx_h100, host_has_nvml, no_driver_env

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"

# -- the README's blocks -------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    role: str | None
    name: str | None
    text: str


FENCE = re.compile(r"^```(\S*)(?:[ \t]+(.*))?$")
ROLES = {
    ("sh", None),
    ("toml", "config"),
    ("python", None),
    ("nix", "flake"),
    ("nix", "module"),
    ("ini", "drop-in"),
    ("text", "output"),
}


def blocks(path: Path = README) -> list[Block]:
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        lang, info = opened.group(1), (opened.group(2) or "").strip()
        role, _, name = info.partition("=")
        start = i + 1
        i = start
        while i < len(lines) and lines[i] != "```":
            i += 1
        assert i < len(lines), f"README.md:{start}: a fence that never closes"
        found.append(Block(start, lang, role or None, name or None, "\n".join(lines[start:i]) + "\n"))
        i += 1
    return found


def of(lang: str, role: str | None = None) -> list[Block]:
    return [b for b in blocks() if (b.lang, b.role) == (lang, role)]


def commands() -> list[str]:
    """Each command of the README's `sh` blocks, without its comment, with
    its continuation lines joined."""
    out: list[str] = []
    for block in of("sh"):
        for line in block.text.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s{2,}#.*$", "", line).strip()
            if command and not command.startswith("#"):
                out.append(command)
    return out


def command(text: str) -> str:
    """`text`, which must be a command of the README as it is written there."""
    assert text in commands(), f"README.md has no command {text!r}: update ACCOUNTED and its test"
    return text


def output(name: str) -> str:
    (block,) = [b for b in of("text", "output") if b.name == name]
    return block.text


def one(lang: str, role: str | None = None) -> str:
    (block,) = of(lang, role)
    return block.text


# Every command of the README, and the test here that runs it (or, where it
# cannot run here, checks it as far as it can).
ACCOUNTED: dict[str, str] = {
    "./scripts/demo --cpu-only": "test_the_demo_prepares_a_cpu_box_and_shows_its_smoke_step",
    "./scripts/test": "test_the_test_command_is_this_suite",
    "fdl-prepare --config /etc/fdl/prepare.toml": "test_an_attempt_with_the_example_config_prepares_the_box",
    "fdl-prepare check --config /etc/fdl/prepare.toml": "test_check_with_the_example_config_is_ready_and_changes_nothing",
    "fdl-prepare gpus --config /etc/fdl/prepare.toml": "test_gpus_with_the_example_config_gives_the_gates_verdict",
    "fdl-prepare gpus --expect-gpus 8 -q": "test_gpus_as_a_health_check_is_silent_on_eight_cards_and_78_on_seven",
    "source <(fdl-prepare completion bash)": "test_completion_for_bash_is_loaded_by_bash",
    "fdl-prepare --version": "test_the_version_names_the_revision",
    "nix --extra-experimental-features 'nix-command flakes' run .#prepare -- --config /etc/fdl/prepare.toml": (
        "test_nix_run_names_an_app_of_this_flake_and_flags_the_cli_takes"
    ),
    "sudo apt install python3-venv nix-bin nix-setup-systemd sshfs fuse3 openssh-client git": (
        "test_the_install_commands_name_what_the_repository_ships"
    ),
    "sudo python3 -m venv /opt/fdl-prepare": "test_the_install_commands_name_what_the_repository_ships",
    "sudo /opt/fdl-prepare/bin/pip install ./": "test_the_install_commands_name_what_the_repository_ships",
    "sudo ln -sf /opt/fdl-prepare/bin/fdl-prepare /usr/local/bin/fdl-prepare": (
        "test_the_install_commands_name_what_the_repository_ships"
    ),
    "sudo install -d /etc/fdl": "test_the_install_commands_name_what_the_repository_ships",
    "sudoedit /etc/fdl/prepare.toml": "test_the_install_commands_name_what_the_repository_ships",
    "sudo install -m 0644 systemd/fdl-prepare.service /etc/systemd/system/": (
        "test_the_install_commands_name_what_the_repository_ships"
    ),
    "sudo systemctl daemon-reload": "test_the_install_commands_name_what_the_repository_ships",
    "sudo systemctl enable --now --no-block fdl-prepare.service": (
        "test_the_install_commands_name_what_the_repository_ships"
    ),
    "journalctl -u fdl-prepare -o cat -p warning": "test_journalctl_takes_the_flags_the_readme_gives",
    "(umask 077; nix --extra-experimental-features nix-command key generate-secret --key-name cache.example.org-1 "
    "> /etc/fdl/cache.secret)": "test_publish_fills_a_cache_and_commits_and_pushes_the_manifest",
    "nix --extra-experimental-features nix-command key convert-secret-to-public < /etc/fdl/cache.secret": (
        "test_publish_fills_a_cache_and_commits_and_pushes_the_manifest"
    ),
    "fdl-prepare publish ~/src/train --bin train --variant cpu --variant cu128 --arg --epochs --arg 90 "
    "--to file:///srv/cache --signing-key /etc/fdl/cache.secret --flake github:example/fleet "
    "--commit --push": "test_publish_fills_a_cache_and_commits_and_pushes_the_manifest",
    "fdl-prepare publish ~/src/train --bin train --variant cpu --to file:///var/cache/fdl-stage --signing-key "
    "/etc/fdl/cache.secret --flake github:example/fleet --json | jq -r '.outputs[] | .libtorch, .training' > "
    "fdl-paths.txt": "test_a_publish_for_attic_or_cachix_leaves_the_paths_to_push_and_the_manifest_uncommitted",
    "cachix push example-fleet < fdl-paths.txt": (
        "test_a_publish_for_attic_or_cachix_leaves_the_paths_to_push_and_the_manifest_uncommitted"
    ),
}

# Each output block, and the test that produces it and compares.
OUTPUTS = {
    "demo-cpu-only": "test_the_demo_prepares_a_cpu_box_and_shows_its_smoke_step",
    "demo-no-gpu": "test_the_demo_without_a_gpu_prints_the_failure_the_readme_shows",
    "module-typo": "test_a_typo_in_the_module_is_the_evaluation_error_the_readme_shows",
    "journal-warning": "test_the_journal_at_warning_priority_shows_the_failure_the_readme_shows",
}


def test_every_block_of_the_readme_says_what_it_is():
    unknown = [(b.line, b.lang, b.role) for b in blocks() if (b.lang, b.role) not in ROLES]
    assert not unknown, f"fenced blocks with an info string this test does not know: {unknown}"
    assert all(b.name for b in of("text", "output")), "an output block needs a name: ```text output=NAME"


def test_every_command_of_the_readme_is_run_or_checked_by_a_test_here():
    assert sorted(set(commands())) == sorted(ACCOUNTED), "README commands and ACCOUNTED differ"
    here = set(globals())
    assert not [name for name in ACCOUNTED.values() if name not in here]


def test_every_output_of_the_readme_is_compared_by_a_test_here():
    assert sorted(b.name or "" for b in of("text", "output")) == sorted(OUTPUTS)
    assert not [name for name in OUTPUTS.values() if name not in globals()]


def test_there_is_one_config_one_python_example_one_module_and_its_wiring():
    assert [len(of(*kind)) for kind in (("toml", "config"), ("python", None), ("nix", "module"), ("nix", "flake"))] == [
        1,
        1,
        1,
        1,
    ]


def test_the_readme_stays_an_operators_guide():
    assert len(README.read_text().splitlines()) <= 400


# -- placeholders and output ---------------------------------------------------------------------

# What the examples name that is an operator's own, and the rig's value that
# stands in for it (a key of Rig.values).
PLACEHOLDERS = {
    "sshfs://data@storage.example/srv/datasets/imagenet": "data_source",
    "/flodl/data": "mountpoint",
    "github:example/fleet": "flake",
    "git+https://git.example/train.git?ref=main": "source",
    "https://cache.example.org": "cache",
    "file:///var/cache/fdl-stage": "stage",
    "file:///srv/cache": "cache_dir",
    "~/src/train": "checkout",
    "/etc/fdl/": "etc",
}


def test_every_placeholder_is_one_the_readme_uses():
    text = README.read_text()
    assert [p for p in PLACEHOLDERS if p not in text] == []


@dataclass
class Rig:
    values: dict[str, str]
    env: dict[str, str]
    cwd: Path

    def sub(self, text: str) -> str:
        for placeholder in sorted(PLACEHOLDERS, key=len, reverse=True):
            if placeholder in text:
                text = text.replace(placeholder, self.values[PLACEHOLDERS[placeholder]])
        assert "storage.example" not in text and "example/fleet" not in text and "git.example" not in text, text
        return text

    def sh(
        self, text: str, *, timeout: float = 300, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", self.sub(text)],
            cwd=self.cwd,
            env=dict(self.env if env is None else env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def unmatched(expected: str, actual: str) -> str | None:
    """The first line of `expected` not found, in order, among the lines
    of `actual` (each compared whole, leading and trailing blanks aside;
    `…` in `expected` stands for any text); None when all are found."""
    lines = [line.strip() for line in actual.splitlines()]
    at = 0
    for want in expected.strip("\n").splitlines():
        pattern = re.compile(".*".join(re.escape(part) for part in want.strip().split("…")))
        while at < len(lines) and pattern.fullmatch(lines[at]) is None:
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


def test_an_output_is_matched_line_by_line_in_order_with_the_ellipsis_for_any_text():
    assert unmatched("a …\nc", "a b\nx\nc") is None
    assert unmatched("c\na …", "a b\nx\nc") == "a …"
    assert unmatched("a", "ab") == "a"


def bin_path(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the installed console scripts first on PATH, as an
    operator's shell has them."""
    out = dict(env)
    out["PATH"] = f"{Path(console_script()).parent}:{env.get('PATH', os.defpath)}"
    return out


# -- Quick start ----------------------------------------------------------------------------------


@pytest.mark.nix
def test_the_demo_prepares_a_cpu_box_and_shows_its_smoke_step(tmp_path):
    from nix_fixtures import require_torch_wheel

    require_torch_wheel()
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run(
        ["bash", "-c", command("./scripts/demo --cpu-only")],
        cwd=REPO,
        env={**os.environ, "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert unmatched(output("demo-cpu-only"), done.stderr) is None, done.stderr[-3000:]


@pytest.mark.nix
def test_the_demo_without_a_gpu_prints_the_failure_the_readme_shows(tmp_path):
    if host_has_nvml():
        pytest.skip("this host has a real libnvidia-ml.so.1: the demo would pass its gate")
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run(
        ["./scripts/demo"], cwd=REPO, env=no_driver_env({**os.environ, "HOME": str(home)}),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 78, done.stderr[-3000:]
    assert unmatched(output("demo-no-gpu"), done.stderr) is None, done.stderr[-3000:]


def test_the_test_command_is_this_suite():
    # Not run here: it is the suite this test is part of. CI runs it on this
    # machine and in a fresh container of each Debian release (.ci/run).
    script = REPO / command("./scripts/test")
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    lines = script.read_text().splitlines()
    assert "scripts/setup" in lines and lines[-1] == 'exec .venv/bin/python -m pytest "$@"'
    # The containers skip the CUDA wheels (docs/TESTING.md, "CI"): the same
    # README commands, the CUDA build tests skipping with their reason.
    ci = (REPO / ".ci" / "run").read_text()
    assert "'./scripts/demo --cpu-only && nix --version && FDL_PREPARE_NO_CUDA_WHEELS=1 ./scripts/test -q'" in ci


# -- the rigs ---------------------------------------------------------------------------------------

# A training source cargo builds offline in a second: no dependencies, and
# a `cuda` feature, which a CUDA variant's build turns on.
CRATE = {
    "Cargo.toml": '[package]\nname = "train"\nversion = "0.1.0"\nedition = "2021"\n\n[features]\ncuda = []\n',
    "Cargo.lock": '# This file is automatically @generated by Cargo.\nversion = 3\n\n[[package]]\nname = "train"\nversion = "0.1.0"\n',
    "src/main.rs": (
        "fn main() {\n"
        "    let args: Vec<String> = std::env::args().skip(1).collect();\n"
        '    println!("train: {}", args.join(" "));\n'
        "}\n"
    ),
}


@pytest.fixture
def shared_stage() -> Iterator[Path]:
    """A stage Nix's build users can enter, as /tmp is (pytest's own temp
    tree is private to root)."""
    stage = Path(tempfile.mkdtemp(prefix="fdl-readme-stage-", dir="/tmp"))
    stage.chmod(0o1777)
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def etc_dir(tmp_path: Path) -> Path:
    """What the README keeps under /etc/fdl/, root's alone."""
    etc = tmp_path / "etc" / "fdl"
    etc.mkdir(parents=True)
    etc.chmod(0o755)
    etc.parent.chmod(0o755)
    return etc


def base_env(nix_env: Mapping[str, str], tmp_path: Path, stage: Path | None = None) -> dict[str, str]:
    """A box's environment, with nothing of this machine's own state: a home,
    a state directory (systemd's StateDirectory=) and a stage of its own."""
    home, state = tmp_path / "home", tmp_path / "state"
    home.mkdir(exist_ok=True)
    state.mkdir(exist_ok=True)
    env = bin_path(nix_env)
    env.update(HOME=str(home), STATE_DIRECTORY=str(state), TMPDIR=str(stage or tmp_path))
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "FDL_PREPARE_CONFIG", "FDL_PREPARE_FLAKE"):
        env.pop(name, None)
    return env


def write_config(rig: Rig) -> Path:
    path = Path(rig.values["etc"]) / "prepare.toml"
    path.write_text(rig.sub(one("toml", "config")))
    path.chmod(0o644)
    return path


@pytest.fixture
def gpu_rig(fake_nvml, nix_env, tmp_path) -> Callable[[list[FakeGpu]], Rig]:
    """A box of fake NVIDIA cards, and the README's config under its /etc/fdl/,
    for what reads the config without mounting or building."""
    etc = etc_dir(tmp_path)

    def make(gpus: list[FakeGpu]) -> Rig:
        env = fake_nvml.box(gpus).env(base_env(nix_env, tmp_path))
        values = {
            "data_source": "sshfs://data@127.0.0.1/srv/datasets/imagenet",
            "mountpoint": str(tmp_path / "data"),
            "flake": "path:/nonexistent/flake",
            "source": "git+file:///nonexistent/train?ref=main",
            "cache": "http://127.0.0.1:9",
            "etc": f"{etc}/",
        }
        rig = Rig(values, env, tmp_path)
        write_config(rig)
        return rig

    return make


@pytest.fixture
def box_rig(
    fake_nvml, sshd, sshfs_mounts, remote_tree, forget_mount_lock_of, nix_env, test_flake, git_source,
    binary_cache, shared_stage, tmp_path,
) -> Rig:  # fmt: skip
    """The whole README box: two Ampere cards (the fake NVML), the dataset on
    the loopback sshd, the training source a git repository of a small crate,
    the test flake (stand-in variants), a binary cache over HTTP on
    loopback, and the README's config under its /etc/fdl/."""
    point = sshfs_mounts.point("data")
    forget_mount_lock_of(point)
    source: GitSource = git_source(CRATE)
    cache = binary_cache()
    (cache.root / "nix-cache-info").write_text("StoreDir: /nix/store\n")
    etc = etc_dir(tmp_path)
    shutil.copy(sshd.user_key, etc / "id_ed25519")
    (etc / "id_ed25519").chmod(0o600)
    shutil.copy(sshd.known_hosts, etc / "known_hosts")
    env = fake_nvml.box(ampere_pair()).env(base_env(nix_env, tmp_path, shared_stage))
    values = {
        "data_source": sshd.source(remote_tree),
        "mountpoint": str(point),
        "flake": test_flake,
        "source": source.url,
        "cache": cache.url,
        "etc": f"{etc}/",
    }
    rig = Rig(values, env, tmp_path)
    write_config(rig)
    return rig


# -- Commands -----------------------------------------------------------------------------------------


@pytest.mark.nix
@pytest.mark.sshfs
def test_an_attempt_with_the_example_config_prepares_the_box(box_rig):
    from prepare.host import mounts

    done = box_rig.sh(command("fdl-prepare --config /etc/fdl/prepare.toml"))
    assert done.returncode == 0, done.stderr[-3000:]
    point = box_rig.values["mountpoint"]
    assert (
        unmatched(f"fdl-prepare: prepared in …s\ngpus      0, 1\ndata      {point}\nlibtorch  cu128  …", done.stderr)
        is None
    ), done.stderr
    assert "smoke run" in done.stderr and "train: --smoke" in done.stderr, done.stderr
    mount = mounts.mounted_at(point)
    assert mount is not None and mount.fstype == "fuse.sshfs" and mount.read_only


@pytest.mark.nix
@pytest.mark.sshfs
def test_check_with_the_example_config_is_ready_and_changes_nothing(box_rig):
    from prepare.host import mounts

    done = box_rig.sh(command("fdl-prepare check --config /etc/fdl/prepare.toml"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fdl-prepare check: ready: an attempt would" in done.stdout + done.stderr
    assert mounts.mounted_at(box_rig.values["mountpoint"]) is None, "check mounted the dataset"
    assert not list(Path(box_rig.env["STATE_DIRECTORY"]).glob("gcroots/run*")), "check built something"


@pytest.mark.nix
def test_gpus_with_the_example_config_gives_the_gates_verdict(gpu_rig):
    text = command("fdl-prepare gpus --config /etc/fdl/prepare.toml")
    two = gpu_rig(ampere_pair()).sh(text)
    assert two.returncode == 0, two.stderr
    # The config's devices = [0, 1] and expect_gpus = 2: a box with one card
    # left would fail the gate, which `gpus` alone would not know.
    lone = gpu_rig([FakeGpu()]).sh(text)
    assert lone.returncode == 78, lone.stderr
    assert "permanent failure [gpu." in lone.stderr


def test_gpus_as_a_health_check_is_silent_on_eight_cards_and_78_on_seven(gpu_rig):
    text = command("fdl-prepare gpus --expect-gpus 8 -q")
    eight = gpu_rig(hgx_h100(8)).sh(text)
    assert eight.returncode == 0 and eight.stderr == "", eight.stderr
    seven = gpu_rig(hgx_h100(7)).sh(text)
    assert seven.returncode == 78, seven.stderr
    assert "permanent failure [gpu.expected-missing]" in seven.stderr
    assert "GPU 7 is missing" in seven.stderr


def test_completion_for_bash_is_loaded_by_bash():
    done = subprocess.run(
        ["bash", "-c", f"{command('source <(fdl-prepare completion bash)')} && complete -p fdl-prepare"],
        env=bin_path(os.environ), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(" fdl-prepare"), done.stdout


def test_the_version_names_the_revision():
    done = subprocess.run(
        ["bash", "-c", command("fdl-prepare --version")], env=bin_path(os.environ), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"fdl-prepare \d+\.\d+\.\d+ \(rev ([0-9a-f]{12}|unknown)\)\n", done.stdout), done.stdout


def test_nix_run_names_an_app_of_this_flake_and_flags_the_cli_takes():
    # Not run here: the app is built with nixpkgs, which this box cannot
    # fetch (no network; the repository has no flake.lock yet). Checked:
    # the flake's wiring, evaluated with nixpkgs left unforced, has the app,
    # and what follows `--` is a command line the CLI parses.
    text = command(
        "nix --extra-experimental-features 'nix-command flakes' run .#prepare -- --config /etc/fdl/prepare.toml"
    )
    words = shlex.split(text)
    assert words[words.index("run") + 1] == ".#prepare"
    assert "prepare" in flake_outputs()["apps"]
    from prepare.cli.app import parser

    given, extra = parser().parse_known_args(words[words.index("--") + 1 :])
    assert extra == [] and given.config == "/etc/fdl/prepare.toml" and given.command is None


def flake_outputs() -> dict[str, object]:
    """This repository's flake.nix outputs, evaluated with stand-in inputs
    that are never forced: the app and module names, not their builds."""
    require_nix()
    expr = (
        f"let flake = import {REPO}/flake.nix; out = flake.outputs {{ self = out // {{ outPath = {REPO}; }}; "
        'nixpkgs = throw "nixpkgs is not needed to list outputs"; source = null; recipe = null; }; in '
        "{ apps = builtins.attrNames out.apps.x86_64-linux; module = builtins.isFunction out.nixosModules.default; }"
    )
    done = subprocess.run(
        ["nix-instantiate", "--eval", "--strict", "--json", "--expr", expr],
        capture_output=True, text=True, timeout=60, env={**os.environ, "NIX_CONFIG": NIX_CONFIG},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_the_install_commands_name_what_the_repository_ships():
    # Not run here: they install onto this machine (apt, /opt, /usr/local/bin,
    # /etc/systemd). Checked: apt names only packages scripts/setup installs
    # (which CI proves on a brand-new box of each Debian release); pip
    # installs a package whose console script is the one the link names;
    # the unit installed is the repository's, whose ExecStart is that link
    # and the config the README edits.
    apt = shlex.split(command("sudo apt install python3-venv nix-bin nix-setup-systemd sshfs fuse3 openssh-client git"))
    setup = (REPO / "scripts" / "setup").read_text()
    (listed,) = re.findall(r"^packages=\((.*)\)$", setup, re.MULTILINE)
    assert set(apt[3:]) <= set(listed.split())
    command("sudo python3 -m venv /opt/fdl-prepare")
    command("sudo /opt/fdl-prepare/bin/pip install ./")
    command("sudo install -d /etc/fdl")
    command("sudoedit /etc/fdl/prepare.toml")
    command("sudo systemctl daemon-reload")
    command("sudo systemctl enable --now --no-block fdl-prepare.service")
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^fdl-prepare = "prepare\.cli:main"$', pyproject, re.MULTILINE), pyproject
    link = shlex.split(command("sudo ln -sf /opt/fdl-prepare/bin/fdl-prepare /usr/local/bin/fdl-prepare"))
    unit = shlex.split(command("sudo install -m 0644 systemd/fdl-prepare.service /etc/systemd/system/"))
    text = (REPO / unit[-2]).read_text()
    assert f"ExecStart={link[-1]} --config /etc/fdl/prepare.toml" in text.splitlines()


def test_journalctl_takes_the_flags_the_readme_gives(tmp_path):
    # Not run against a journal: this machine has no journald. Checked: the
    # journalctl systemd ships parses the very flags, over an empty journal.
    if shutil.which("journalctl") is None:
        pytest.skip("journalctl is not installed (apt install systemd)")
    words = shlex.split(command("journalctl -u fdl-prepare -o cat -p warning"))
    done = subprocess.run([*words, f"--directory={tmp_path}", "--no-pager"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_journal_at_warning_priority_shows_the_failure_the_readme_shows(tmp_path):
    """journald reads a `<N>` prefix on each line of a unit's stderr as its
    priority (an unprefixed line is info, 6); `-p warning` keeps 0 to 4 and
    `-o cat` prints the rest of the line. No journald runs here, so the
    stream is a file whose device and inode are in JOURNAL_STREAM, as
    systemd sets it, and its lines are read as journald reads them."""
    if host_has_nvml():
        pytest.skip("this host has a real libnvidia-ml.so.1: the gate would pass")
    config = tmp_path / "prepare.toml"
    config.write_text("[join]\n")
    stream = tmp_path / "stderr"
    with open(stream, "w") as err:
        st = os.fstat(err.fileno())
        env = no_driver_env({**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}", "HOME": str(tmp_path)})
        done = subprocess.run(
            [console_script(), "--config", str(config)], env=env, stdout=subprocess.DEVNULL, stderr=err, timeout=120
        )
    assert done.returncode == 78
    shown = []
    for line in stream.read_text().splitlines():
        prefix = re.match(r"<([0-7])>", line)
        priority, text = (int(prefix.group(1)), line[prefix.end() :]) if prefix else (6, line)
        if priority <= 4:
            shown.append(text)
    assert unmatched(output("journal-warning"), "\n".join(shown)) is None, stream.read_text()


# -- Configuration ------------------------------------------------------------------------------------


def test_the_example_config_as_written_loads_resolves_and_plans(tmp_path):
    from prepare import config
    from prepare.plan import plan

    path = tmp_path / "prepare.toml"
    path.write_text(one("toml", "config"))
    spec = config.resolve(config.load(path), {}, {})
    planned = plan(spec, {"HOME": str(tmp_path)})
    assert spec.data.data_source == "sshfs://data@storage.example/srv/datasets/imagenet"
    assert spec.devices == (0, 1) and spec.expect_gpus == 2 and spec.libtorch == "auto"
    assert spec.source is not None and spec.source.smoke == ("--smoke",) and spec.source.bin == "train"
    assert spec.nix.substituters == ("https://cache.example.org",)
    assert planned.build is not None


def test_the_configuration_docs_list_every_key_with_its_flag_in_the_tables_order():
    from prepare.config.fields import TABLE

    text = (REPO / "docs" / "CONFIGURATION.md").read_text()
    section = text.split("\n## The keys\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_.]+)` \| `(--[a-z-]+)` \|", section, re.MULTILINE)
    assert rows == [(f.key, f.flag) for f in TABLE.fields]


# -- As a library ---------------------------------------------------------------------------------------


def test_the_library_example_imports_what_it_names_from_prepare():
    imports = re.findall(r"^from prepare import (.+)$", one("python"), re.MULTILINE)
    assert imports, "the example imports from prepare"
    import prepare

    for name in ", ".join(imports).split(", "):
        assert hasattr(prepare, name), f"prepare has no {name}"


@pytest.mark.nix
@pytest.mark.sshfs
def test_the_library_example_prepares_the_box_as_written(box_rig):
    script = box_rig.cwd / "join.py"
    script.write_text(box_rig.sub(one("python")))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=box_rig.cwd, env=box_rig.env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.fullmatch(
        r"fdl-join: prepared: /nix/store/\S+-fdl-test-training-cu128/bin/train on GPUs \(0, 1\)\n", done.stdout
    ), done.stdout + done.stderr[-2000:]
    assert "transient failure" not in done.stderr, done.stderr


# -- The NixOS module -------------------------------------------------------------------------------------

# NixOS's programs.ssh.knownHosts, which the module rig's stand-ins lack:
# the option the README's module sets beside the service.
KNOWN_HOSTS_OPTION = """
  options.programs.ssh.knownHosts = lib.mkOption {
    type = lib.types.attrsOf (lib.types.submodule { options.publicKey = lib.mkOption { type = lib.types.str; }; });
    default = { };
  };
"""


def host_module(work: Path, module: str) -> str:
    (work / "gpu01.nix").write_text(module)
    return f"{{ lib, ... }}: {{\n  imports = [ {work}/gpu01.nix ];\n{KNOWN_HOSTS_OPTION}}}\n"


def test_the_modules_wiring_is_nix_and_names_the_module_this_flake_exports():
    # Not evaluated whole: nixosSystem is nixpkgs', which this box cannot
    # fetch. Checked: it parses, and the module it names is this flake's.
    require_nix()
    text = one("nix", "flake")
    parsed = subprocess.run(["nix-instantiate", "--parse", "-E", text], capture_output=True, text=True, timeout=60)
    assert parsed.returncode == 0, parsed.stderr
    assert "fdl-prepare.nixosModules.default" in text
    assert flake_outputs()["module"] is True


def test_the_readme_module_evaluates_and_its_config_loads_with_fdl_prepares_own_loader(evaluate_module, tmp_path):
    from prepare import config
    from prepare.plan import plan

    module = one("nix", "module")
    evaluated = evaluate_module(host_module(evaluate_module.work, module))
    assert evaluated.failed_assertions == [] and evaluated.warnings == []
    assert evaluated.service is not None
    assert evaluated.service["requiredBy"] == ["fdl-join.service"] and evaluated.service["before"] == [
        "fdl-join.service"
    ]
    assert any("start --no-block -- fdl-join.service" in line for line in evaluated.service_config["ExecStartPost"])
    spec = config.resolve(config.load(evaluated.config_path), {}, {})
    plan(spec, {"HOME": str(tmp_path)})
    assert spec.data.data_source == "sshfs://data@storage.example/srv/datasets/imagenet"
    assert spec.source is not None and spec.source.smoke == ("--smoke",) and spec.expect_gpus == 2


def test_a_typo_in_the_module_is_the_evaluation_error_the_readme_shows(evaluate_module):
    from module_fixtures import EvalError

    module = one("nix", "module")
    assert "libtorch = " in module
    with pytest.raises(EvalError) as refused:
        evaluate_module(host_module(evaluate_module.work, module.replace("libtorch = ", "libtroch = ")))
    assert unmatched(output("module-typo"), str(refused.value)) is None, str(refused.value)


# -- Other systemd boxes ------------------------------------------------------------------------------------


def test_the_drop_ins_are_units_systemd_verifies_with_the_plain_unit(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt install systemd)")
    units = tmp_path / "units"
    units.mkdir()
    script = console_script()
    unit = (REPO / "systemd" / "fdl-prepare.service").read_text().replace("/usr/local/bin/fdl-prepare", script)
    (units / "fdl-prepare.service").write_text(unit)
    (units / "fdl-join.service").write_text("[Unit]\nDescription=floDl join\n[Service]\nExecStart=/bin/true\n")
    for block in of("ini", "drop-in"):
        first = block.text.splitlines()[0]
        where = Path(first.removeprefix("# "))
        assert where.parent.parent == Path("/etc/systemd/system"), first
        (units / where.parent.name).mkdir(exist_ok=True)
        (units / where.parent.name / where.name).write_text(block.text)
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(units / "fdl-join.service"), str(units / "fdl-prepare.service")],
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    complaints = [
        line for line in done.stderr.splitlines() if "RestartSteps" not in line and "RestartMaxDelaySec" not in line
    ]
    assert done.returncode == 0 and complaints == [], done.stderr


# -- Publish and binary caches ------------------------------------------------------------------------------

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "fdl tests",
    "GIT_AUTHOR_EMAIL": "tests@fdl.invalid",
    "GIT_COMMITTER_NAME": "fdl tests",
    "GIT_COMMITTER_EMAIL": "tests@fdl.invalid",
}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, env={**os.environ, **GIT_IDENTITY}, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def publish_rig(nix_env, test_flake, git_source, shared_stage, tmp_path) -> Rig:
    """The controller: a checkout of the training source with an upstream to
    push to, the test flake, and directories for /etc/fdl/ and the caches."""
    source: GitSource = git_source(CRATE)
    upstream = tmp_path / "upstream.git"
    git(tmp_path, "clone", "-q", "--bare", str(source.path), str(upstream))
    git(source.path, "remote", "add", "origin", str(upstream))
    git(source.path, "fetch", "-q", "origin")
    git(source.path, "branch", "-q", "--set-upstream-to=origin/main", "main")
    etc = etc_dir(tmp_path)
    env = {**base_env(nix_env, tmp_path, shared_stage), **GIT_IDENTITY}
    values = {
        "checkout": str(source.path),
        "flake": test_flake,
        "cache_dir": f"file://{tmp_path / 'srv-cache'}",
        "stage": f"file://{tmp_path / 'fdl-stage'}",
        "etc": f"{etc}/",
    }
    return Rig(values, env, tmp_path)


def keys(rig: Rig) -> str:
    """The README's two key commands, as written, on a Nix that has only its
    own configuration (no experimental features turned on for it); the
    public key."""
    env = dict(rig.env)
    env.pop("NIX_CONFIG", None)
    made = rig.sh(
        command(
            "(umask 077; nix --extra-experimental-features nix-command key generate-secret --key-name "
            "cache.example.org-1 > /etc/fdl/cache.secret)"
        ),
        env=env,
    )
    assert made.returncode == 0, made.stderr
    secret = Path(rig.values["etc"]) / "cache.secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    public = rig.sh(
        command("nix --extra-experimental-features nix-command key convert-secret-to-public < /etc/fdl/cache.secret"),
        env=env,
    )
    assert public.returncode == 0, public.stderr
    assert re.fullmatch(r"cache\.example\.org-1:[A-Za-z0-9+/]{43}=\n?", public.stdout), public.stdout
    return public.stdout.strip()


@pytest.mark.nix
def test_publish_fills_a_cache_and_commits_and_pushes_the_manifest(publish_rig):
    from prepare.build import manifest as run_manifest

    keys(publish_rig)
    done = publish_rig.sh(
        command(
            "fdl-prepare publish ~/src/train --bin train --variant cpu --variant cu128 --arg --epochs --arg 90 "
            "--to file:///srv/cache --signing-key /etc/fdl/cache.secret --flake github:example/fleet "
            "--commit --push"
        ),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    pushed = git(publish_rig.cwd / "upstream.git", "show", f"main:{run_manifest.FILENAME}")
    manifest = run_manifest.parse(pushed)
    assert manifest.bin == "train" and manifest.args == ("--epochs", "90") and manifest.unknown_count == 0
    sidecar = git(publish_rig.cwd / "upstream.git", "show", f"main:{run_manifest.DIGEST_FILE}")
    assert manifest.digest is not None and manifest.digest.files == len(sidecar.splitlines())
    cache = Path(publish_rig.values["cache_dir"].removeprefix("file://"))
    assert len(list(cache.glob("*.narinfo"))) >= 4, sorted(p.name for p in cache.iterdir())


@pytest.mark.nix
def test_a_publish_for_attic_or_cachix_leaves_the_paths_to_push_and_the_manifest_uncommitted(publish_rig):
    # `cachix push` (or `attic push`) is not run: neither is installed here,
    # and each needs its server and an account. Checked: what it is handed
    # is the store paths of the run's outputs, valid in the store, and the
    # manifest waits, uncommitted, for the push to be done.
    if shutil.which("jq") is None:
        pytest.skip("jq is not installed (apt install jq; scripts/setup installs it)")
    keys(publish_rig)
    done = publish_rig.sh(
        command(
            "fdl-prepare publish ~/src/train --bin train --variant cpu --to file:///var/cache/fdl-stage --signing-key "
            "/etc/fdl/cache.secret --flake github:example/fleet --json | jq -r '.outputs[] | .libtorch, .training' > "
            "fdl-paths.txt"
        ),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    paths = (publish_rig.cwd / "fdl-paths.txt").read_text().split()
    assert len(paths) == 2 and all(p.startswith("/nix/store/") and valid_path(p) for p in paths), paths
    pusher = shlex.split(command("cachix push example-fleet < fdl-paths.txt").replace("<", "'<'"))
    assert pusher[:3] == ["cachix", "push", "example-fleet"] and pusher[-1] == "fdl-paths.txt"
    checkout = Path(publish_rig.values["checkout"])
    for name in (".fdl-run.yml", ".fdl-run.sha256"):
        assert (checkout / name).is_file()
        assert git(checkout, "status", "--porcelain", "--", name).startswith("??")


# -- Links ------------------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The heading anchors GitHub makes for `path`: lower case, punctuation
    but hyphens dropped, spaces as hyphens."""
    found = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        heading = re.match(r"#{1,6} (.+)$", line)
        if heading and not in_fence:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower().replace("`", "")).replace(" ", "-")
            found.add(slug)
    return found


DOCS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "nix" / "CONTRACT.md"]


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(doc: Path):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        missing = not path.exists()
        if missing or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(target)
    assert broken == []


def test_every_doc_the_readme_lists_exists_and_every_doc_is_listed():
    listed = set(re.findall(r"\]\((docs/[A-Z-]+\.md)\)", README.read_text()))
    present = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert listed == present
