"""systemd/fdl-prepare.service, the plain unit for boxes without NixOS.

`systemd-analyze verify` checks it for real (it also checks that ExecStart
exists, so a copy is verified with ExecStart pointed at the installed console
script). The console script is run with the unit's own command line and
PATH to show that the exit codes the unit acts on are the ones it gets.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from console import console_script
from module_fixtures import REPO

from prepare.cli import EXIT_PERMANENT, EXIT_SOFTWARE, EXIT_TRANSIENT

UNIT = REPO / "systemd" / "fdl-prepare.service"
DOCS = REPO / "README.md"
# What the journal shows (docs/SYSTEMD.md), and the units' sandbox (docs/HARDENING.md).
JOURNAL_DOCS = REPO / "docs" / "SYSTEMD.md"
SANDBOX_DOCS = REPO / "docs" / "HARDENING.md"

# Keys systemd learnt in 254; older releases warn and ignore them.
NEWER_KEYS = {254: ("RestartSteps", "RestartMaxDelaySec")}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value given (systemd allows repeats)."""
    out: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"key outside a section: {raw!r}"
        key, value = line.split("=", 1)
        section.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def one(unit, section: str, key: str) -> str:
    (value,) = unit[section][key]
    return value


def systemd_version() -> int:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt install systemd)")
    out = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True).stdout
    m = re.match(r"systemd (\d+)", out)
    if m is None:
        pytest.skip(f"cannot read the systemd version from {out[:80]!r}")
    return int(m.group(1))


def installed_copy(tmp_path: Path, config: Path) -> Path:
    """The unit as an operator installs it, with ExecStart pointed at this
    machine's console script (`systemd-analyze verify` requires it to exist)
    and --config at `config`."""
    script = console_script()
    lines = []
    for line in UNIT.read_text().splitlines(keepends=True):
        if line.startswith("ExecStart="):
            line = line.replace("/usr/local/bin/fdl-prepare", shlex.quote(script))
            line = line.replace("/etc/fdl/prepare.toml", str(config))
        lines.append(line)
    text = "".join(lines)
    path = tmp_path / "units" / "fdl-prepare.service"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def run_like_the_unit(unit, tmp_path: Path, config_text: str) -> subprocess.CompletedProcess[str]:
    """The installed copy's ExecStart with the unit's PATH, plus what systemd
    adds (HOME for User=root, STATE_DIRECTORY) moved into a temp dir."""
    config = tmp_path / "prepare.toml"
    config.write_text(config_text)
    copy = parse_unit(installed_copy(tmp_path, config).read_text())
    argv = shlex.split(one(copy, "Service", "ExecStart"))
    (env_line,) = copy["Service"]["Environment"]
    name, path = env_line.split("=", 1)
    assert name == "PATH"
    home, state, stage = tmp_path / "home", tmp_path / "state", tmp_path / "stage"
    for d in (home, state, stage):
        d.mkdir(exist_ok=True)
    env = {
        "PATH": path,
        "HOME": str(home),
        "STATE_DIRECTORY": str(state),
        "TMPDIR": str(stage),
        "LD_LIBRARY_PATH": str(tmp_path / "no-nvml-here"),
    }
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def prevented(unit) -> set[int]:
    return {int(x) for x in one(unit, "Service", "RestartPreventExitStatus").split()}


# -- the file --------------------------------------------------------------------


def test_the_plain_unit_passes_systemd_analyze_verify(tmp_path):
    version = systemd_version()
    path = installed_copy(tmp_path, tmp_path / "prepare.toml")
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # The only complaints allowed are the backoff keys an older systemd
    # does not know yet, which it ignores.
    tolerated = [k for since, keys in NEWER_KEYS.items() if version < since for k in keys]
    for line in done.stderr.splitlines():
        assert any(f"Unknown key '{k}'" in line for k in tolerated), line


def test_the_plain_unit_runs_the_console_script_with_the_documented_config(unit):
    assert one(unit, "Service", "ExecStart") == "/usr/local/bin/fdl-prepare --config /etc/fdl/prepare.toml"
    docs = DOCS.read_text()
    assert "/usr/local/bin/fdl-prepare" in docs and "/etc/fdl/prepare.toml" in docs


def test_the_plain_unit_is_a_oneshot_that_retries_until_prepared(unit):
    assert one(unit, "Service", "Type") == "oneshot"
    assert one(unit, "Service", "RemainAfterExit") == "yes"
    # systemd sets NOTIFY_SOCKET, which the status line goes to, only then.
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert one(unit, "Service", "Restart") == "on-failure"
    assert one(unit, "Unit", "StartLimitIntervalSec") == "0"
    assert one(unit, "Service", "StateDirectory") == "fdl-prepare"
    assert one(unit, "Service", "User") == "root"
    assert one(unit, "Unit", "Wants") == "network-online.target"
    assert {"network-online.target", "nix-daemon.socket"} <= set(one(unit, "Unit", "After").split())
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_the_plain_units_path_finds_nix_where_either_installer_puts_it(unit):
    name, path = one(unit, "Service", "Environment").split("=", 1)
    assert name == "PATH"
    entries = path.split(":")
    assert "/usr/bin" in entries  # Debian's nix-bin, sshfs, ssh, git, fusermount3
    assert "/nix/var/nix/profiles/default/bin" in entries  # the upstream installer


def test_the_plain_unit_and_the_nixos_module_share_one_restart_policy(unit, evaluate_module):
    module = evaluate_module("{ services.fdl-prepare.enable = true; }", systemd_version="256")
    service, unit_config = module.service_config, module.unit_config

    def norm(value) -> str:
        if value is True:
            return "yes"
        return str(value)

    for key in (
        "Type",
        "RemainAfterExit",
        "NotifyAccess",
        "Restart",
        "RestartSec",
        "RestartSteps",
        "RestartMaxDelaySec",
        "RestartPreventExitStatus",
        "StateDirectory",
        "StateDirectoryMode",
        "User",
    ):
        assert norm(service[key]) == one(unit, "Service", key), key
    assert norm(unit_config["StartLimitIntervalSec"]) == one(unit, "Unit", "StartLimitIntervalSec")
    assert norm(unit_config["Wants"]) == one(unit, "Unit", "Wants")
    assert set(unit_config["After"].split()) <= set(one(unit, "Unit", "After").split())


# -- the exit codes it acts on ---------------------------------------------------


def test_the_exit_codes_the_unit_acts_on_are_the_clis(unit):
    assert (EXIT_TRANSIENT, EXIT_PERMANENT) == (75, 78)
    assert EXIT_PERMANENT in prevented(unit)
    assert EXIT_TRANSIENT not in prevented(unit)
    # A bug is said once, with its traceback, not retried for ever.
    assert EXIT_SOFTWARE == 70 and EXIT_SOFTWARE in prevented(unit)
    assert "| 70 | a bug in fdl-prepare" in DOCS.read_text()


def test_a_permanent_failure_exits_78_and_stops_the_restart_loop(unit, tmp_path):
    done = run_like_the_unit(unit, tmp_path, f'[join]\ncpu_only = true\ndata_path = "{tmp_path}/nonexistent"\n')
    assert done.returncode == 78, done.stderr
    assert "fdl-prepare: permanent failure [data.root-unusable]: " in done.stderr
    assert "exit 78" in done.stderr
    assert done.returncode in prevented(unit)


def test_a_transient_failure_exits_75_and_the_restart_loop_retries_it(unit, tmp_path, forget_mount_lock_of):
    if shutil.which("sshfs") is None:
        pytest.skip("sshfs is not installed (apt install sshfs)")
    mountpoint = tmp_path / "mnt"
    forget_mount_lock_of(mountpoint)
    # Nothing listens on loopback port 1: refused at once, as when the data
    # host is down.
    done = run_like_the_unit(
        unit,
        tmp_path,
        f'[join]\ncpu_only = true\ndata_source = "sshfs://root@127.0.0.1:1/srv/data"\ndata_path = "{mountpoint}"\n',
    )
    assert done.returncode == 75, done.stderr
    assert "fdl-prepare: transient failure [data.unreachable]: " in done.stderr
    assert "exit 75" in done.stderr
    assert done.returncode not in prevented(unit)
    assert one(unit, "Service", "Restart") == "on-failure"


def test_systemd_names_the_two_exit_codes_as_the_docs_show_them():
    systemd_version()
    done = subprocess.run(["systemd-analyze", "exit-status", "75", "78"], capture_output=True, text=True)
    assert re.search(r"^TEMPFAIL\s+75\b", done.stdout, re.M), done.stdout
    assert re.search(r"^CONFIG\s+78\b", done.stdout, re.M), done.stdout
    docs = JOURNAL_DOCS.read_text()
    assert "status=75/TEMPFAIL" in docs and "status=78/CONFIG" in docs


# -- the sandbox -------------------------------------------------------------------------

# Options that give a unit a mount namespace of its own (systemd's
# exec_needs_mount_namespace): an sshfs mount made inside one never reaches
# the host. And device ACLs, which would shut out the GPUs and /dev/fuse.
NAMESPACING = (
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts", "PrivateNetwork",
    "PrivateIPC", "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
    "ProtectProc", "ProcSubset", "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "ExecPaths",
    "NoExecPaths", "BindPaths", "BindReadOnlyPaths", "TemporaryFileSystem", "RootDirectory", "RootImage",
    "MountImages", "ExtensionImages", "ExtensionDirectories", "MountFlags", "LogNamespace",
)  # fmt: skip
DEVICE_ACLS = ("DeviceAllow", "DevicePolicy", "ProtectClock")
SANDBOX = (
    "NoNewPrivileges", "ProtectHostname", "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality",
    "SystemCallArchitectures", "RestrictAddressFamilies", "SystemCallFilter", "CapabilityBoundingSet",
)  # fmt: skip


def test_the_plain_unit_is_sandboxed_without_a_mount_namespace_or_a_device_acl(unit):
    service = unit["Service"]
    assert all(key in service for key in SANDBOX), [k for k in SANDBOX if k not in service]
    assert not [key for key in (*NAMESPACING, *DEVICE_ACLS) if key in service]
    kept = {"CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_SYS_CHROOT"}
    kept |= {"CAP_NET_ADMIN", "CAP_SYS_MODULE", "CAP_MKNOD", "CAP_DAC_OVERRIDE", "CAP_FOWNER"}
    dropped = set(one(unit, "Service", "CapabilityBoundingSet").removeprefix("~").split())
    assert not dropped & kept


def test_the_nixos_module_sandboxes_its_unit_as_the_plain_unit_does(unit, evaluate_module):
    module = evaluate_module("{ services.fdl-prepare.enable = true; }", systemd_version="256")
    service = parse_unit(module.service["unitText"])["Service"]
    for key in SANDBOX:
        got = " ".join(service[key]).replace("true", "yes")
        assert got == " ".join(unit["Service"][key]), key
    assert not [key for key in (*NAMESPACING, *DEVICE_ACLS) if key in service]


def _exposure(path: Path) -> float:
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d)", done.stdout + done.stderr)
    assert found, done.stdout + done.stderr
    return float(found.group(1))


def _unsandboxed(path: Path) -> Path:
    """The same unit without the sandbox: what it scored before."""
    out = path.with_name("unsandboxed-" + path.name)
    keep = [line for line in path.read_text().splitlines() if line.split("=", 1)[0].strip() not in SANDBOX]
    out.write_text("\n".join(keep) + "\n")
    return out


def test_systemd_analyze_security_scores_both_units_as_the_readme_says(tmp_path, evaluate_module):
    version = systemd_version()
    if version < 250:
        pytest.skip("systemd-analyze security --offline needs systemd 250")
    plain = installed_copy(tmp_path, tmp_path / "prepare.toml")
    module = evaluate_module("{ services.fdl-prepare.enable = true; }", systemd_version=str(version))
    generated = tmp_path / "module" / "fdl-prepare.service"
    generated.parent.mkdir()
    generated.write_text(module.service["unitText"])
    scores = [(_exposure(_unsandboxed(unit)), _exposure(unit)) for unit in (plain, generated)]
    # Each systemd release weighs its checks a little differently; on every
    # one the sandbox takes about three points off.
    for before, after in scores:
        assert after <= before - 2.5, scores
    if version == 252:
        assert scores == [(9.6, 6.6), (9.6, 6.6)]
    assert "`systemd-analyze security` scores both units 9.6 before and 6.6 now" in SANDBOX_DOCS.read_text()


@pytest.mark.nix
@pytest.mark.sshfs
def test_under_the_units_capability_bounding_set_and_no_new_privileges_a_box_still_mounts_and_builds(
    unit, tmp_path, sshd, remote_tree, sshfs_mounts, nix_env, test_flake, git_source
):
    # The seccomp filters need systemd to apply them; what setpriv can apply
    # (the capability bounding set, no_new_privs) is applied for real, to
    # the whole preparation: an sshfs mount, a Nix build as root.
    from nix_fixtures import NIX_CONFIG, trainer

    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    assert one(unit, "Service", "NoNewPrivileges") == "yes"
    caps = one(unit, "Service", "CapabilityBoundingSet").removeprefix("~").split()
    bounding = ",".join("-" + cap.removeprefix("CAP_").lower() for cap in caps)
    limits = ["setpriv", "--no-new-privs", f"--bounding-set={bounding}", "--"]
    probe = subprocess.run([*limits, "true"], capture_output=True, text=True, timeout=30, check=False)
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot apply the unit's limits here: {probe.stderr.strip()}")
    point = sshfs_mounts.point()
    src = git_source(trainer())
    argv = [*limits, console_script(), "--json"]
    argv += ["--config", "/dev/null", "--cpu-only", "--libtorch", "cpu", "--flake", test_flake, "--source", src.url]
    argv += ["--state-dir", str(tmp_path / "state"), "--data-source", sshd.source(remote_tree)]
    argv += ["--data-path", str(point), "--identity-file", str(sshd.user_key)]
    for option in sshd.options:
        argv += ["--ssh-option", option]
    (tmp_path / "home").mkdir()
    env = {**os.environ, "NIX_CONFIG": NIX_CONFIG, "HOME": str(tmp_path / "home")}
    env.pop("FDL_PREPARE_CONFIG", None)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["data_path"] == str(point) and os.access(out["bin"]["path"], os.X_OK)
