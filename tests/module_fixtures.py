"""Evaluating nix/module.nix with nixpkgs' real `lib` and real Nix.

The lib comes from the pinned copy of nix-community/nixpkgs.lib (MIT) that
the project keeps beside the repository, `../shared/vendor/nixpkgs.lib/lib`,
or from NIXPKGS_LIB (the `lib` directory itself) where set; it is never
committed. Without either, or without `nix-instantiate`, the tests that
need it skip and say why.

tests/module_eval.nix holds the stand-ins for the NixOS options the module
sets; its packages live under a per-test fake root, where this fixture
links the host's real executables (the console script, nix, sshfs, ssh,
fusermount, git, systemctl) so the unit's ExecStart and PATH can be run and
verified as they are.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from console import console_script

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "module_eval.nix"
MODULE = REPO / "nix" / "module.nix"

STORE_PATH = re.compile(r"/nix/store/[0-9a-z]{32}-[^\s\"'/]+")

NIX_CONFIG = "substituters =\nexperimental-features = nix-command flakes\n"

# What each stand-in package provides on the unit's PATH, from the host.
LINKED: dict[str, tuple[str, ...]] = {
    "nix": ("nix", "nix-store", "nix-instantiate", "nix-build"),
    "sshfs": ("sshfs",),
    "fuse3": ("fusermount3",),
    "fuse": ("fusermount",),
    "openssh": ("ssh",),
    "git": ("git",),
    "systemd": ("systemctl", "systemd-run"),
    "bash": ("bash",),
    "util-linux": ("flock",),
}


@dataclass
class Evaluated:
    """One evaluation of the module: the failed assertions' messages, the
    warnings, and the services as NixOS would hold them."""

    failed_assertions: list[str]
    warnings: list[str]
    services: dict[str, dict[str, Any]]
    settings: dict[str, Any]
    systemd_version: str
    fake_root: Path
    options: list[dict[str, Any]]

    @property
    def service(self) -> dict[str, Any] | None:
        """fdl-prepare.service, None when the module is not enabled."""
        return self.services.get("fdl-prepare")

    @property
    def service_config(self) -> dict[str, Any]:
        assert self.service is not None, "the module defined no fdl-prepare service"
        return self.service["serviceConfig"]

    @property
    def unit_config(self) -> dict[str, Any]:
        assert self.service is not None, "the module defined no fdl-prepare service"
        return self.service["unitConfig"]

    @property
    def exec_start(self) -> list[str]:
        return shlex.split(self.service_config["ExecStart"])

    @property
    def config_path(self) -> Path:
        argv = self.exec_start
        return Path(argv[argv.index("--config") + 1])

    @property
    def path_entries(self) -> list[str]:
        assert self.service is not None
        return self.service["environment"]["PATH"].split(":")

    @property
    def prevent_exit_statuses(self) -> set[int]:
        return {int(x) for x in str(self.service_config["RestartPreventExitStatus"]).split()}


@dataclass
class ModuleEvaluator:
    lib: Path
    fake_root: Path
    work: Path
    store_paths: set[str] = field(default_factory=set)
    count: int = 0

    def __call__(self, configuration: str, *, systemd_version: str = "256.8") -> Evaluated:
        """Evaluate the module with `configuration`, the body of a NixOS module
        (Nix text, e.g. `{ services.fdl-prepare.enable = true; }`)."""
        raw = self.run(configuration, systemd_version=systemd_version)
        return Evaluated(
            failed_assertions=raw["failedAssertions"],
            warnings=raw["warnings"],
            services=raw["services"],
            settings=raw["settings"],
            systemd_version=raw["systemdVersion"],
            fake_root=self.fake_root,
            options=raw["options"],
        )

    def check(self, configuration: str = "{ }") -> dict[str, bool]:
        """nix/module-check.nix's cases (the flake's module check), each
        evaluated with `configuration` added: case name -> whether it held."""
        raw = self.run(configuration, output="check")
        assert raw["typical"] is True
        return {r["name"]: r["ok"] for r in raw["results"]}

    def run(self, configuration: str, *, systemd_version: str = "256.8", output: str = "configuration") -> Any:
        self.count += 1
        host = self.work / f"host-{self.count}.nix"
        host.write_text(configuration)
        argv = [
            "nix-instantiate",
            # The rendered config file must really be written to the store, so
            # the CLI can load it and the ExecStart can run.
            "--read-write-mode",
            "--eval",
            "--strict",
            "--json",
            str(HARNESS),
            "--argstr",
            "libPath",
            str(self.lib),
            "--argstr",
            "configuration",
            str(host),
            "--argstr",
            "fakeRoot",
            str(self.fake_root),
            "--argstr",
            "systemdVersion",
            systemd_version,
            "--argstr",
            "output",
            output,
        ]
        env = dict(os.environ, NIX_CONFIG=NIX_CONFIG)
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        if done.returncode != 0:
            raise EvalError(done.stderr)
        self.store_paths.update(STORE_PATH.findall(done.stdout))
        return json.loads(done.stdout)

    def cleanup(self) -> None:
        # Unrooted, content-addressed files; removing them keeps repeated runs
        # (each with its own fake root in the text) from piling up in the store.
        # The unit's scripts name a second script only inside their text.
        paths = set(self.store_paths)
        for path in self.store_paths:
            if os.path.isfile(path) and os.path.getsize(path) < 1 << 20:
                paths.update(STORE_PATH.findall(Path(path).read_text(errors="replace")))
        if paths:
            # One call: Nix deletes a referrer before what it refers to.
            subprocess.run(["nix-store", "--delete", *sorted(paths)], capture_output=True, timeout=60)


class EvalError(Exception):
    """nix-instantiate refused the configuration (a type error, a throw)."""


VENDORED_LIB = Path(__file__).resolve().parent.parent.parent / "shared" / "vendor" / "nixpkgs.lib" / "lib"


def nixpkgs_lib() -> Path:
    """nixpkgs' lib/ for evaluating Nix code that needs it: NIXPKGS_LIB,
    else the pinned copy beside the repository; skips when neither is one."""
    value = os.environ.get("NIXPKGS_LIB") or str(VENDORED_LIB)
    lib = Path(value)
    if not (lib / "default.nix").is_file():
        pytest.skip(
            f"no nixpkgs lib at {value}: the pinned copy of nix-community/nixpkgs.lib is expected at "
            "../shared/vendor/nixpkgs.lib/lib beside the repository; or set NIXPKGS_LIB to the lib/ directory of "
            "a checkout"
        )
    return lib


@pytest.fixture(scope="session")
def module_nixpkgs_lib() -> Path:
    lib = nixpkgs_lib()
    if shutil.which("nix-instantiate") is None:
        pytest.skip("nix-instantiate is not installed (apt install nix-bin)")
    return lib


@pytest.fixture
def module_fake_root(tmp_path: Path) -> Path:
    root = tmp_path / "pkgs"
    (root / "fdl-prepare" / "bin").mkdir(parents=True)
    (root / "fdl-prepare" / "bin" / "fdl-prepare").symlink_to(console_script())
    for package, programs in LINKED.items():
        bin_dir = root / package / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for program in programs:
            found = shutil.which(program)
            if found is not None:
                (bin_dir / program).symlink_to(found)
    (root / "flake-source").mkdir()
    return root


@pytest.fixture
def evaluate_module(module_nixpkgs_lib: Path, module_fake_root: Path, tmp_path: Path) -> Iterator[ModuleEvaluator]:
    work = tmp_path / "eval"
    work.mkdir()
    evaluator = ModuleEvaluator(lib=module_nixpkgs_lib, fake_root=module_fake_root, work=work)
    yield evaluator
    evaluator.cleanup()
