"""services.fdl-prepare, evaluated by nixpkgs' real module system.

The module is evaluated with `lib.evalModules` from a real nixpkgs lib
(NIXPKGS_LIB) by real Nix; the NixOS options it sets and the packages it
names are stand-ins (tests/module_eval.nix says which and why). The settings
file it renders is loaded by the CLI's own config loader, and the unit's
ExecStart is run as written to check the exit codes it acts on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

import pytest
from module_fixtures import NIX_CONFIG, EvalError

from prepare import config as prepare_config
from prepare.cli import EXIT_PERMANENT, EXIT_SOFTWARE, EXIT_TRANSIENT, EXIT_USAGE
from prepare.config.fields import TABLE
from prepare.fail import Fail

ENABLED = "{ services.fdl-prepare.enable = true; }"


def host(body: str) -> str:
    """A NixOS configuration with the service enabled and `body` merged into
    services.fdl-prepare (Nix attribute-set text without the braces)."""
    return f"{{ services.fdl-prepare = {{ enable = true; {body} }}; }}"


def unit_sections(text: str) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif "=" in line and current is not None:
            key, value = line.split("=", 1)
            current.append((key, value))
    return sections


def systemd_version() -> int | None:
    if shutil.which("systemd-analyze") is None:
        return None
    out = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True).stdout
    m = re.match(r"systemd (\d+)", out)
    return int(m.group(1)) if m else None


# -- the unit ------------------------------------------------------------------


def test_the_unit_is_a_oneshot_that_stays_active_once_prepared(evaluate_module):
    unit = evaluate_module(ENABLED)
    assert unit.failed_assertions == []
    assert unit.service_config["Type"] == "oneshot"
    assert unit.service_config["RemainAfterExit"] is True
    assert unit.service["wantedBy"] == ["multi-user.target"]


def test_transient_failures_are_retried_and_permanent_ones_stop_the_loop(evaluate_module):
    unit = evaluate_module(ENABLED)
    assert unit.service_config["Restart"] == "on-failure"
    assert unit.service_config["RestartSec"] == "10s"
    assert EXIT_PERMANENT == 78 and EXIT_TRANSIENT == 75
    assert EXIT_PERMANENT in unit.prevent_exit_statuses
    assert EXIT_USAGE in unit.prevent_exit_statuses
    # A bug (exit 70) is reported once, not retried every RestartSec for ever.
    assert EXIT_SOFTWARE == 70 and EXIT_SOFTWARE in unit.prevent_exit_statuses
    assert EXIT_TRANSIENT not in unit.prevent_exit_statuses


def test_a_long_run_of_transient_failures_is_never_rate_limited_into_giving_up(evaluate_module):
    unit = evaluate_module(ENABLED)
    assert unit.unit_config["StartLimitIntervalSec"] == 0
    assert ("StartLimitIntervalSec", "0") in unit_sections(unit.service["unitText"])["Unit"]


def test_exponential_backoff_is_set_only_where_systemd_has_it(evaluate_module):
    old = evaluate_module(ENABLED, systemd_version="253.5")
    assert "RestartSteps" not in old.service_config
    assert "RestartMaxDelaySec" not in old.service_config
    assert old.service_config["RestartSec"] == "10s"

    new = evaluate_module(ENABLED, systemd_version="254")
    assert new.service_config["RestartSteps"] == 8
    assert new.service_config["RestartMaxDelaySec"] == "10min"


def test_a_systemd_that_refuses_restart_on_a_oneshot_is_named(evaluate_module):
    unit = evaluate_module(ENABLED, systemd_version="243")
    (message,) = unit.failed_assertions
    assert "systemd 244" in message and "243" in message
    assert evaluate_module(ENABLED, systemd_version="244").failed_assertions == []


def test_the_backoff_can_be_tuned_through_service_config(evaluate_module):
    unit = evaluate_module(
        "{ services.fdl-prepare.enable = true;"
        '  systemd.services.fdl-prepare.serviceConfig = { RestartSec = "30s"; RestartMaxDelaySec = "1h"; }; }'
    )
    assert unit.service_config["RestartSec"] == "30s"
    assert unit.service_config["RestartMaxDelaySec"] == "1h"


def test_the_unit_waits_for_the_network_and_the_nix_daemon(evaluate_module):
    unit = evaluate_module(ENABLED)
    assert unit.service["wants"] == ["network-online.target"]
    assert "network-online.target" in unit.service["after"]
    assert "nix-daemon.socket" in unit.service["after"]
    section = dict(unit_sections(unit.service["unitText"])["Unit"])
    assert section["Wants"] == "network-online.target"
    assert section["After"] == "network-online.target nix-daemon.socket"


def test_path_holds_nix_sshfs_fuse_openssh_and_git(evaluate_module):
    unit = evaluate_module(ENABLED)
    root = unit.fake_root
    for package in ("nix", "sshfs", "fuse3", "fuse", "openssh", "git"):
        assert f"{root}/{package}/bin" in unit.path_entries, package
    # The system's nix comes first: it must speak the running daemon's protocol.
    assert unit.path_entries[0] == f"{root}/nix/bin"


def test_the_nix_on_path_is_the_systems_own(evaluate_module, tmp_path):
    other = tmp_path / "other-nix"
    unit = evaluate_module(
        "{ services.fdl-prepare.enable = true;"
        f'  nix.package = {{ type = "derivation"; name = "nix-2.24"; outPath = "{other}"; outputs = [ "out" ]; }}; }}'
    )
    assert unit.path_entries[0] == f"{other}/bin"


def test_the_state_directory_holds_the_gc_roots_and_sets_home(evaluate_module):
    unit = evaluate_module(ENABLED)
    assert unit.service_config["StateDirectory"] == "fdl-prepare"
    # User= is what makes systemd set HOME, where the dataset cache lives.
    assert unit.service_config["User"] == "root"


def test_execstart_runs_the_package_with_the_rendered_config(evaluate_module):
    unit = evaluate_module(ENABLED)
    argv = unit.exec_start
    assert argv[0] == f"{unit.fake_root}/fdl-prepare/bin/fdl-prepare"
    assert argv[1:2] == ["--config"]
    assert re.fullmatch(r"/nix/store/[0-9a-z]{32}-fdl-prepare\.toml", str(unit.config_path))
    assert unit.config_path.is_file()


def test_the_package_option_replaces_the_flakes_front_end(evaluate_module, tmp_path):
    mine = tmp_path / "my-fdl-prepare"
    unit = evaluate_module(
        host(
            f'package = {{ type = "derivation"; name = "fdl-prepare-dev"; outPath = "{mine}"; outputs = [ "out" ]; }};'
        )
    )
    assert unit.exec_start[0] == f"{mine}/bin/fdl-prepare"


def test_every_option_is_documented_for_the_manual(evaluate_module):
    unit = evaluate_module(ENABLED)
    names = {o["name"] for o in unit.options}
    for name in (
        "enable",
        "package",
        "flake",
        "settings",
        "settings.join.data_source",
        "settings.join.ssh.identity_file",
        "settings.join.source.from",
        "before",
        "sshAuthSock",
    ):
        assert f"services.fdl-prepare.{name}" in names, name
    for option in unit.options:
        assert option["description"], option["name"]


SETTINGS = "services.fdl-prepare.settings.join."


def _type_descriptions(lib: Path, expressions: dict[str, str]) -> dict[str, str]:
    """What the manual says for each `lib.types` expression, from the same lib."""
    body = " ".join(f"{json.dumps(k)} = ({e}).description;" for k, e in expressions.items())
    expression = f"let lib = import {lib}; in with lib.types; {{ {body} }}"
    done = subprocess.run(
        ["nix-instantiate", "--eval", "--strict", "--json", "--expr", expression],
        capture_output=True,
        text=True,
        env=dict(os.environ, NIX_CONFIG=NIX_CONFIG),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_modules_typed_settings_are_the_field_tables_with_its_types(evaluate_module, module_nixpkgs_lib):
    unit = evaluate_module(ENABLED)
    typed = {
        o["name"].removeprefix(SETTINGS): o
        for o in unit.options
        if o["name"].startswith(SETTINGS) and o["name"].removeprefix(SETTINGS) not in TABLE.subtables
    }
    wanted = {f.key: f for f in TABLE.fields if f.nix is not None}
    # Both ways: a field the table says the module types is there, and the
    # module types nothing the table does not know (or leaves free-form).
    assert set(typed) == set(wanted)
    types = _type_descriptions(module_nixpkgs_lib, {k: f.nix for k, f in wanted.items() if f.nix})
    for key, f in wanted.items():
        assert typed[key]["type"] == types[key], key
        # Unset (null) leaves the key out of the file, so the table's default applies.
        assert typed[key]["default"] in ("null", json.dumps(f.default)), key


# -- the rendered settings -----------------------------------------------------


def test_the_rendered_settings_load_through_the_clis_config_loader(evaluate_module, tmp_path):
    unit = evaluate_module(
        host(
            """
            settings.join = {
              data_source = "sshfs://data@storage.example:2222/srv/datasets/imagenet";
              data_path = "/flodl/data";
              libtorch = "auto";
              devices = [ 0 1 ];
              ssh = {
                identity_file = "/var/lib/fdl-prepare/id_ed25519";
                options = [ "StrictHostKeyChecking=accept-new" ];
                port = 2222;
              };
              source = {
                from = "git+https://git.example/train.git?ref=main";
                bin = "train";
              };
              build_timeout = 3600;
            };
            """
        )
    )
    assert unit.failed_assertions == []
    table = prepare_config.load(unit.config_path)
    assert table == {
        "data_source": "sshfs://data@storage.example:2222/srv/datasets/imagenet",
        "data_path": "/flodl/data",
        "libtorch": "auto",
        "devices": [0, 1],
        "cpu_only": False,
        "flake": f"path:{unit.fake_root}/flake-source?narHash=sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=",
        "ssh": {
            "identity_file": "/var/lib/fdl-prepare/id_ed25519",
            "options": ["StrictHostKeyChecking=accept-new"],
            "port": 2222,
        },
        "source": {"from": "git+https://git.example/train.git?ref=main", "bin": "train"},
        "build_timeout": 3600,
    }
    state = tmp_path / "state"
    spec = prepare_config.resolve(table, {}, {"STATE_DIRECTORY": str(state)})
    assert spec.data.data_source == "sshfs://data@storage.example:2222/srv/datasets/imagenet"
    assert spec.devices == (0, 1)
    assert spec.ssh.identity_file == "/var/lib/fdl-prepare/id_ed25519"
    assert spec.ssh.options == ("StrictHostKeyChecking=accept-new",)
    assert spec.source is not None and spec.source.bin == "train" and spec.source.cwd is None
    assert spec.flake == table["flake"]
    # systemd's StateDirectory= reaches the CLI as $STATE_DIRECTORY.
    assert spec.state_dir == str(state)
    assert spec.build_timeout_s == 3600.0


def test_a_boxs_caches_and_keys_reach_the_config_as_the_join_nix_table(evaluate_module):
    key = "fleet-1:nTCg+w7fzWq/2GnSQsukdCOyvv3lZ8Sr6Hu7I5UqB7E="
    unit = evaluate_module(
        host(
            f"""
            settings.join.nix = {{
              substituters = [ "https://cache.example.org" ];
              trusted_public_keys = [ "{key}" ];
            }};
            """
        )
    )
    table = prepare_config.load(unit.config_path)
    assert table["nix"] == {"substituters": ["https://cache.example.org"], "trusted_public_keys": [key]}
    spec = prepare_config.resolve(table, {}, {})
    assert spec.nix.substituters == ("https://cache.example.org",) and spec.nix.trusted_public_keys == (key,)


def test_unset_options_are_left_out_of_the_file(evaluate_module):
    unit = evaluate_module(host("flake = null;"))
    text = unit.config_path.read_text()
    assert tomllib.loads(text) == {"join": {"cpu_only": False}}
    assert "[join.ssh]" not in text and "[join.source]" not in text and "[join.nix]" not in text
    assert prepare_config.load(unit.config_path) == {"cpu_only": False}


def test_the_default_flake_is_the_modules_own_pinned_by_nar_hash(evaluate_module):
    unit = evaluate_module(ENABLED)
    flake = prepare_config.load(unit.config_path)["flake"]
    assert flake.startswith(f"path:{unit.fake_root}/flake-source?narHash=sha256-")


def test_a_flake_in_settings_outranks_the_flake_option(evaluate_module):
    unit = evaluate_module(host('flake = "github:example/a"; settings.join.flake = "github:example/b";'))
    assert prepare_config.load(unit.config_path)["flake"] == "github:example/b"
    unit = evaluate_module(host('flake = "github:example/a";'))
    assert prepare_config.load(unit.config_path)["flake"] == "github:example/a"


def test_a_misspelt_free_form_key_is_refused_by_the_cli_naming_the_right_one(evaluate_module):
    # Free-form settings pass any key to the file; the CLI is what refuses a
    # typo, permanently, at the first start.
    unit = evaluate_module(host('settings.join.data_sorce = "sshfs://x/y";'))
    with pytest.raises(Fail) as caught:
        prepare_config.load(unit.config_path)
    assert caught.value.permanent
    assert "data_sorce" in caught.value.message and "data_source" in caught.value.message


def test_a_mistyped_typed_option_is_refused_at_evaluation_naming_the_option(evaluate_module):
    with pytest.raises(EvalError) as caught:
        evaluate_module(host('settings.join.devices = [ "0" ];'))
    assert "services.fdl-prepare.settings.join.devices" in str(caught.value)
    with pytest.raises(EvalError) as caught:
        evaluate_module(host("settings.join.ssh.port = 70000;"))
    assert "services.fdl-prepare.settings.join.ssh.port" in str(caught.value)


def test_the_toml_writer_stand_in_round_trips_awkward_strings_and_keys(evaluate_module):
    unit = evaluate_module(
        host(
            r"""
            flake = null;
            settings.join.source.build = "make \"all\" && echo 'done' # not a comment\n\tnext line \\ back";
            settings.join.source.bin = "träin-ü";
            settings.other = { "a.b" = 1; "with space" = [ true false ]; nested.deeper = { x = 1.5; }; };
            """
        )
    )
    loaded = tomllib.loads(unit.config_path.read_text())
    expected = {
        "join": {
            "cpu_only": False,
            "source": {
                "build": "make \"all\" && echo 'done' # not a comment\n\tnext line \\ back",
                "bin": "träin-ü",
            },
        },
        "other": {"a.b": 1, "with space": [True, False], "nested": {"deeper": {"x": 1.5}}},
    }
    assert loaded == expected
    assert prepare_config.load(unit.config_path) == expected["join"]


# -- re-preparing on a settings change ----------------------------------------


def test_a_settings_change_changes_the_unit_so_switch_restarts_it(evaluate_module):
    a = evaluate_module(host('settings.join.data_path = "/flodl/data";'))
    b = evaluate_module(host('settings.join.data_path = "/flodl/other";'))
    again = evaluate_module(host('settings.join.data_path = "/flodl/data";'))
    assert a.service_config["ExecStart"] != b.service_config["ExecStart"]
    assert a.service_config["ExecStart"] == again.service_config["ExecStart"]
    assert a.service["restartIfChanged"] is True
    # One `systemctl restart` after activation, so Requires= carries the
    # restart to the units in `before`.
    assert a.service["stopIfChanged"] is False
    assert "X-StopIfChanged=false" in a.service["unitText"]
    assert "X-RestartIfChanged=false" not in a.service["unitText"]


# -- units that run on a prepared box -------------------------------------------


def test_units_named_in_before_require_preparation_and_are_started_once_it_succeeds(evaluate_module):
    unit = evaluate_module(host('before = [ "fdl-join.service" ];'))
    assert unit.failed_assertions == []
    assert unit.service["before"] == ["fdl-join.service"]
    assert unit.service["requiredBy"] == ["fdl-join.service"]
    (post,) = unit.service_config["ExecStartPost"]
    assert post == f"{unit.fake_root}/systemd/bin/systemctl start --no-block -- fdl-join.service"
    assert ("Before", "fdl-join.service") in unit_sections(unit.service["unitText"])["Unit"]


def test_with_nothing_in_before_preparation_starts_no_other_unit(evaluate_module):
    unit = evaluate_module(ENABLED)
    assert unit.service["before"] == [] and unit.service["requiredBy"] == []
    assert "ExecStartPost" not in unit.service_config


def test_a_disabled_module_defines_no_unit_and_asserts_nothing(evaluate_module):
    unit = evaluate_module(
        "{ services.fdl-prepare.settings.join = {"
        '    data_source = "sshfs://h/x"; cpu_only = true; libtorch = "cu128"; }; }'
    )
    assert unit.service is None
    assert unit.failed_assertions == []


# -- assertions ------------------------------------------------------------------


def test_an_sshfs_source_without_a_key_or_agent_names_the_options_to_set(evaluate_module):
    unit = evaluate_module(host('settings.join.data_source = "sshfs://data@storage.example:/srv/d";'))
    (message,) = unit.failed_assertions
    assert "services.fdl-prepare.settings.join.data_source" in message
    assert "sshfs://data@storage.example:/srv/d" in message
    assert "services.fdl-prepare.settings.join.ssh.identity_file" in message
    assert "services.fdl-prepare.sshAuthSock" in message


@pytest.mark.parametrize(
    "body",
    [
        'settings.join.ssh.identity_file = "/var/lib/fdl-prepare/id_ed25519";',
        'settings.join.ssh.options = [ "IdentityFile=/var/lib/fdl-prepare/id_ed25519" ];',
        'sshAuthSock = "/run/fdl-prepare/agent.sock";',
    ],
    ids=["identity_file", "IdentityFile option", "agent"],
)
def test_an_sshfs_source_with_a_key_or_an_agent_passes(evaluate_module, body):
    unit = evaluate_module(host('settings.join.data_source = "sshfs://data@storage.example:/srv/d"; ' + body))
    assert unit.failed_assertions == []


def test_the_agent_socket_reaches_the_service_environment(evaluate_module):
    unit = evaluate_module(host('sshAuthSock = "/run/fdl-prepare/agent.sock";'))
    assert unit.service["environment"]["SSH_AUTH_SOCK"] == "/run/fdl-prepare/agent.sock"
    assert 'Environment="SSH_AUTH_SOCK=/run/fdl-prepare/agent.sock"' in unit.service["unitText"]


def test_cpu_only_with_a_cuda_libtorch_names_both_options(evaluate_module):
    unit = evaluate_module(host('settings.join = { cpu_only = true; libtorch = "cu128"; };'))
    (message,) = unit.failed_assertions
    assert "services.fdl-prepare.settings.join.cpu_only" in message
    assert 'services.fdl-prepare.settings.join.libtorch = "cu128"' in message


@pytest.mark.parametrize("libtorch", ["cpu", "auto"])
def test_cpu_only_with_the_cpu_or_auto_libtorch_passes(evaluate_module, libtorch):
    unit = evaluate_module(host(f'settings.join = {{ cpu_only = true; libtorch = "{libtorch}"; }};'))
    assert unit.failed_assertions == []


@pytest.mark.parametrize(
    "identity",
    ["/nix/store/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-key", "keys/id_ed25519"],
    ids=["in the store", "relative"],
)
def test_an_identity_file_in_the_store_or_relative_is_refused(evaluate_module, identity):
    unit = evaluate_module(host(f'settings.join.ssh.identity_file = "{identity}";'))
    (message,) = unit.failed_assertions
    assert "services.fdl-prepare.settings.join.ssh.identity_file" in message
    assert identity in message


def test_an_identity_file_given_as_a_nix_path_is_a_type_error(evaluate_module, tmp_path):
    # A path literal would copy the private key into the world-readable store.
    key = tmp_path / "id_ed25519"
    key.write_text("not a key\n")
    with pytest.raises(EvalError) as caught:
        evaluate_module(host(f"settings.join.ssh.identity_file = {key};"))
    assert "services.fdl-prepare.settings.join.ssh.identity_file" in str(caught.value)


def test_a_relative_data_path_is_refused(evaluate_module):
    unit = evaluate_module(host('settings.join.data_path = "flodl/data";'))
    (message,) = unit.failed_assertions
    assert "services.fdl-prepare.settings.join.data_path" in message and '"flodl/data"' in message


def test_before_takes_full_unit_names(evaluate_module):
    unit = evaluate_module(host('before = [ "fdl-join" ];'))
    (message,) = unit.failed_assertions
    assert "services.fdl-prepare.before" in message and "fdl-join.service" in message


# -- the generated unit, for real --------------------------------------------------


def test_the_generated_unit_passes_systemd_analyze_verify(evaluate_module, tmp_path):
    version = systemd_version()
    if version is None:
        pytest.skip("systemd-analyze is not installed")
    unit = evaluate_module(host('before = [ "fdl-join.service" ];'), systemd_version=str(version))
    path = tmp_path / "units" / "fdl-prepare.service"
    path.parent.mkdir()
    path.write_text(unit.service["unitText"])
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # Evaluated for the systemd installed here, the unit has no key it does not know.
    assert "Unknown key" not in done.stderr, done.stderr
    assert "fdl-prepare.service" not in done.stderr, done.stderr


def _run_exec_start(unit, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The unit's ExecStart as systemd would run it: its argv and PATH, and
    the variables systemd sets (HOME from User=root, STATE_DIRECTORY), moved
    into a temp dir; no NVML library reachable."""
    home = tmp_path / "home"
    state = tmp_path / "state"
    stage = tmp_path / "stage"
    for d in (home, state, stage):
        d.mkdir(exist_ok=True)
    env = {
        "PATH": unit.service["environment"]["PATH"],
        "HOME": str(home),
        "STATE_DIRECTORY": str(state),
        "TMPDIR": str(stage),
        "LD_LIBRARY_PATH": str(tmp_path / "no-nvml-here"),
    }
    return subprocess.run(unit.exec_start, env=env, capture_output=True, text=True, timeout=120)


def test_the_generated_execstart_exits_78_on_a_permanent_failure_which_stops_the_loop(evaluate_module, tmp_path):
    unit = evaluate_module(host(f'settings.join = {{ cpu_only = true; data_path = "{tmp_path}/nonexistent"; }};'))
    done = _run_exec_start(unit, tmp_path)
    assert done.returncode == 78, done.stderr
    assert "permanent failure" in done.stderr and "data_path" in done.stderr
    assert done.returncode in unit.prevent_exit_statuses


def test_the_generated_execstart_exits_75_on_a_transient_failure_which_is_retried(
    evaluate_module, tmp_path, forget_mount_lock_of
):
    if shutil.which("sshfs") is None:
        pytest.skip("sshfs is not installed (apt install sshfs)")
    mountpoint = tmp_path / "mnt"
    forget_mount_lock_of(mountpoint)
    key = tmp_path / "id_ed25519"
    key.write_text("")
    # As a private key must be: ssh ignores one others can read (permanent).
    key.chmod(0o600)
    # Port 1 on loopback: nothing listens, the connection is refused at once,
    # as when the data host is down.
    unit = evaluate_module(
        host(
            f"""settings.join = {{
              cpu_only = true;
              data_source = "sshfs://root@127.0.0.1:1/srv/data";
              data_path = "{mountpoint}";
              ssh.identity_file = "{key}";
            }};"""
        )
    )
    assert unit.failed_assertions == []
    done = _run_exec_start(unit, tmp_path)
    assert done.returncode == 75, done.stderr
    assert "transient failure" in done.stderr and "127.0.0.1" in done.stderr
    assert done.returncode not in unit.prevent_exit_statuses
    assert unit.service_config["Restart"] == "on-failure"
    assert not os.path.ismount(mountpoint)
