"""services.fdl-prepare, evaluated by nixpkgs' real module system.

The module is evaluated with `lib.evalModules` from a real nixpkgs lib
(NIXPKGS_LIB) by real Nix; the NixOS options it sets and the packages it
names are stand-ins (tests/module_eval.nix says which and why). The settings
file it renders is loaded by the CLI's own config loader, and the unit's
ExecStart is run as written to check the exit codes it acts on.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

import pytest
from module_fixtures import NIX_CONFIG, REPO, EvalError

from prepare import config as prepare_config
from prepare.cli import EXIT_PERMANENT, EXIT_SOFTWARE, EXIT_TRANSIENT, EXIT_USAGE
from prepare.config import fields_json
from prepare.config.fields import TABLE

FIELDS_JSON = REPO / "nix" / "fields.json"

ENABLED = "{ services.fdl-prepare.enable = true; }"
# What switch-to-configuration holds while it runs.
SWITCH_LOCK = "/run/nixos/switch-to-configuration.lock"


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
    assert unit.failed_assertions == [] and unit.warnings == []
    assert unit.service_config["Type"] == "oneshot"
    assert unit.service_config["RemainAfterExit"] is True


def test_at_boot_multi_user_target_waits_for_the_first_attempt_in_both_switch_modes(evaluate_module):
    # Background (the default): the target wants fdl-prepare-start.service,
    # a oneshot whose start (outside a switch) is `systemctl start
    # fdl-prepare.service`, so the target's own ordering waits through it.
    background = evaluate_module(ENABLED)
    start = background.services["fdl-prepare-start"]
    assert start["wantedBy"] == ["multi-user.target"] and background.service["wantedBy"] == []
    assert start["serviceConfig"]["Type"] == "oneshot" and start["serviceConfig"]["RemainAfterExit"] is True
    argv = shlex.split(start["serviceConfig"]["ExecStart"])
    assert argv[0] == f"{background.fake_root}/bash/bin/bash"
    assert argv[2:] == [SWITCH_LOCK]
    script = Path(argv[1]).read_text()
    assert f"{background.fake_root}/systemd/bin/systemctl start fdl-prepare.service" in script
    # Off: the target wants the unit itself, as before the option existed.
    waiting = evaluate_module(host("backgroundOnSwitch = false;"))
    assert waiting.service["wantedBy"] == ["multi-user.target"]
    assert "fdl-prepare-start" not in waiting.services


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
        "settings.join.list_timeout",
        "gatedUnits",
        "backgroundOnSwitch",
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


# The keys of the table the module does not type from it: `flake` it
# declares itself (its `flake` option gives the default); the others are
# decided by the unit and the system, and refused with a message.
MODULE_OWN = {"flake"}
REFUSED = {"state_dir": "StateDirectory=", "driver_dir": "/run/opengl-driver/lib"}


def test_the_modules_typed_settings_are_the_field_tables_with_its_types(evaluate_module, module_nixpkgs_lib):
    unit = evaluate_module(ENABLED)
    typed = {
        o["name"].removeprefix(SETTINGS): o
        for o in unit.options
        if o["name"].startswith(SETTINGS) and o["name"].removeprefix(SETTINGS) not in TABLE.subtables
    }
    wanted = {f.key: f for f in TABLE.fields if f.nix is not None}
    # Both ways: a field the table types is an option with that type, and
    # the module offers nothing else but its own `flake`.
    assert set(typed) == set(wanted) | MODULE_OWN
    assert {f.key for f in TABLE.fields if f.nix is None} == MODULE_OWN | set(REFUSED)
    types = _type_descriptions(module_nixpkgs_lib, {k: f.nix for k, f in wanted.items() if f.nix})
    for key, f in wanted.items():
        assert typed[key]["type"] == types[key], key
        # Unset (null) leaves the key out of the file, so the table's default applies.
        assert typed[key]["default"] in ("null", json.dumps(f.default)), key


def test_the_committed_fields_json_is_what_the_field_table_exports_now():
    committed = FIELDS_JSON.read_text()
    assert committed == fields_json.render(), (
        f"nix/fields.json differs from prepare/config/fields.py's table; regenerate it: `{fields_json.COMMAND}` "
        "(from the repository root, with the package's Python)"
    )
    exported = json.loads(committed)
    assert [f["key"] for f in exported["fields"]] == [f.key for t in TABLE.tables.values() for f in t.values()]
    assert exported["tables"] == TABLE.subtables
    # What an operator reads in the manual when the module adds no prose of its own.
    by_key = {f["key"]: f for f in exported["fields"]}
    assert by_key["list_timeout"]["description"] == TABLE.by_key["list_timeout"].help
    assert by_key["devices"]["example"] == [0, 1] and by_key["cpu_only"]["default"] is False


def test_the_fields_json_command_writes_the_committed_file():
    out = subprocess.run(
        [sys.executable, "-m", fields_json.__name__], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout == FIELDS_JSON.read_text()


@pytest.mark.parametrize(
    ("expression", "tree"),
    [
        ("str", "str"),
        ("nullOr str", ["nullOr", "str"]),
        ("nullOr (listOf ints.unsigned)", ["nullOr", ["listOf", "ints.unsigned"]]),
        ("nullOr (numbers.between 0.1 3600)", ["nullOr", ["numbers.between", 0.1, 3600]]),
        (" (ints.between 1 65535) ", ["ints.between", 1, 65535]),
    ],
)
def test_a_types_expression_becomes_the_tree_nix_applies(expression, tree):
    assert fields_json.type_tree(expression) == tree


@pytest.mark.parametrize(
    "expression",
    ['strMatching "a.*"', "nullOr (str", "str)", "()", "1", "(listOf str) int", "x: x", "[ str ]"],
)
def test_anything_but_a_types_expression_is_refused_by_the_export(expression):
    with pytest.raises(ValueError, match="nix type"):
        fields_json.type_tree(expression)


# Values of every TOML kind, at and past the bounds the table's checkers
# draw (ports, counts, each timeout's range, device lists).
PROBES: list[Any] = [
    "", " ", "x", "/abs/path", "sshfs://data@h:/srv/d", "git+https://h/r?ref=main",
    0, 1, -1, 8, 22, 65535, 65536, 3600, 3601, 86400, 86401, 2592000, 2592001,
    0.05, 0.1, 0.5, 1.0, 2.5, 3600.5,
    True, False,
    [], [0, 1], [0, 0], [-1], ["0"], ["a"], ["StrictHostKeyChecking=accept-new"], [""], [1.5],
    {"a": 1},
]  # fmt: skip


def _nix_accepts(lib: Path, probes: dict[str, list[Any]], tmp_path: Path) -> dict[str, list[bool]]:
    """Whether each probe evaluates as a definition of the option the module
    builds for that key (nix/fields.nix, the module's own type interpreter)."""
    data = tmp_path / "probes.json"
    data.write_text(json.dumps(probes))
    expression = f"""
      let
        lib = import {lib};
        fields = builtins.listToAttrs (map (f: {{ name = f.key; value = f; }})
          (import {REPO}/nix/fields.nix {{ inherit lib; own = [ "flake" "state_dir" "driver_dir" ]; }}).fields);
        typeOf = (import {REPO}/nix/fields.nix {{ inherit lib; }}).typeOf;
        accepts = key: value: (builtins.tryEval (builtins.deepSeq (lib.evalModules {{
          modules = [ {{ options.x = lib.mkOption {{ type = typeOf fields.${{key}}.type; }}; config.x = value; }} ];
        }}).config.x true)).success;
      in builtins.mapAttrs (key: values: map (accepts key) values)
        (builtins.fromJSON (builtins.readFile {data}))
    """
    done = subprocess.run(
        ["nix-instantiate", "--eval", "--strict", "--json", "--expr", expression],
        capture_output=True,
        text=True,
        env=dict(os.environ, NIX_CONFIG=NIX_CONFIG),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_modules_types_and_fdl_prepares_checks_agree_on_every_probe(module_nixpkgs_lib, tmp_path):
    typed = [f for f in TABLE.fields if f.nix is not None]
    nix = _nix_accepts(module_nixpkgs_lib, {f.key: PROBES for f in typed}, tmp_path)
    for f in typed:
        for value, nix_ok in zip(PROBES, nix[f.key], strict=True):
            python_ok = f.kind.check(value) is None
            what = f"join.{f.key} = {value!r}: Nix {'takes' if nix_ok else 'refuses'} it, fdl-prepare {'takes' if python_ok else 'refuses'} it"
            # The module never refuses what fdl-prepare takes.
            assert nix_ok or not python_ok, what
            # And refuses what fdl-prepare does, but for what only a string's
            # or a list's content says (a URL's pin, a path, a device twice),
            # which the CLI checks at start: a wrong kind of value, or a
            # number out of range, fails the evaluation.
            if nix_ok and not python_ok:
                assert isinstance(value, (str, list)), what


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


@pytest.mark.parametrize(
    ("body", "option", "meant"),
    [
        ('settings.join.libtroch = "cpu";', "settings.join.libtroch", "settings.join.libtorch"),
        ('settings.join.data_sorce = "sshfs://x/y";', "settings.join.data_sorce", "settings.join.data_source"),
        ("settings.join.ssh.prot = 22;", "settings.join.ssh.prot", "settings.join.ssh.port"),
        ('settings.jion.libtorch = "cpu";', "settings.jion", "settings.join"),
    ],
    ids=["in join", "another in join", "in a sub-table", "a table beside join"],
)
def test_a_misspelt_key_is_refused_at_evaluation_naming_it_and_the_key_meant(evaluate_module, body, option, meant):
    with pytest.raises(EvalError) as caught:
        evaluate_module(host(body))
    message = str(caught.value)
    assert f"The option `services.fdl-prepare.{option}' does not exist" in message
    assert f"`services.fdl-prepare.{meant}'" in message
    # Where the definition is, for the operator who has many files.
    assert "host-1.nix" in message


@pytest.mark.parametrize(
    ("body", "option", "kind"),
    [
        ('settings.join.devices = [ "0" ];', "settings.join.devices", "unsigned integer"),
        ("settings.join.ssh.port = 70000;", "settings.join.ssh.port", "integer between 1 and 65535"),
        ("settings.join.ssh.port = 0;", "settings.join.ssh.port", "integer between 1 and 65535"),
        ('settings.join.cpu_only = "yes";', "settings.join.cpu_only", "boolean"),
        ("settings.join.smoke_timeout = 0.5;", "settings.join.smoke_timeout", "between 1 and 86400"),
        ("settings.join.expect_gpus = 0;", "settings.join.expect_gpus", "positive integer"),
    ],
    ids=["devices", "port too high", "port zero", "boolean", "timeout range", "count"],
)
def test_a_mistyped_option_is_refused_at_evaluation_naming_the_option(evaluate_module, body, option, kind):
    with pytest.raises(EvalError) as caught:
        evaluate_module(host(body))
    message = str(caught.value)
    assert f"services.fdl-prepare.{option}" in message
    assert "is not of type" in message and kind in message


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_a_key_the_unit_or_the_system_decides_is_refused_saying_what_decides_it(evaluate_module, key):
    unit = evaluate_module(host(f'settings.join.{key} = "/srv/elsewhere";'))
    (message,) = unit.failed_assertions
    assert f'services.fdl-prepare.settings.join.{key} = "/srv/elsewhere"' in message
    assert REFUSED[key] in message and "Remove it" in message


def test_the_timeouts_and_refresh_are_typed_and_reach_the_file(evaluate_module):
    unit = evaluate_module(
        host("settings.join = { list_timeout = 2.5; build_timeout = 7200; smoke_timeout = 90; refresh = true; };")
    )
    table = prepare_config.load(unit.config_path)
    assert (table["list_timeout"], table["build_timeout"], table["smoke_timeout"]) == (2.5, 7200, 90)
    assert table["refresh"] is True
    spec = prepare_config.resolve(table, {}, {})
    assert (spec.list_timeout_s, spec.build_timeout_s, spec.smoke_timeout_s, spec.refresh) == (2.5, 7200.0, 90.0, True)


def test_the_toml_writer_stand_in_round_trips_awkward_strings_lists_and_floats(evaluate_module):
    unit = evaluate_module(
        host(
            r"""
            flake = null;
            settings.join.source.build = "make \"all\" && echo 'done' # not a comment\n\tnext line \\ back";
            settings.join.source.bin = "träin-ü";
            settings.join.source.smoke = [ "--say=\"ok\"" "tab\tand ü" ];
            settings.join.list_timeout = 1.5;
            settings.join.ssh.options = [ ];
            """
        )
    )
    loaded = tomllib.loads(unit.config_path.read_text())
    expected = {
        "join": {
            "cpu_only": False,
            "list_timeout": 1.5,
            "source": {
                "build": "make \"all\" && echo 'done' # not a comment\n\tnext line \\ back",
                "bin": "träin-ü",
                "smoke": ['--say="ok"', "tab\tand ü"],
            },
            "ssh": {"options": []},
        },
    }
    assert loaded == expected
    assert prepare_config.load(unit.config_path) == expected["join"]


# -- re-preparing on a settings change ----------------------------------------


def _triggers(unit, name: str = "fdl-prepare-start") -> str:
    (path,) = [v for k, v in unit_sections(unit.services[name]["unitText"])["Unit"] if k == "X-Restart-Triggers"]
    return Path(path).read_text()


def test_in_the_background_mode_a_settings_change_restarts_the_start_unit_not_the_switch_waiting_on_preparation(
    evaluate_module,
):
    a = evaluate_module(host('settings.join.data_path = "/flodl/data";'))
    b = evaluate_module(host('settings.join.data_path = "/flodl/other";'))
    again = evaluate_module(host('settings.join.data_path = "/flodl/data";'))
    assert a.service_config["ExecStart"] != b.service_config["ExecStart"]
    # What the switch compares: the start unit's triggers carry the
    # preparation's command line (and so its config file), environment and
    # post-start, so a change there restarts the start unit...
    assert a.service_config["ExecStart"] in _triggers(a)
    assert _triggers(a) != _triggers(b) and _triggers(a) == _triggers(again)
    start = a.services["fdl-prepare-start"]
    assert start["restartIfChanged"] is True and start["stopIfChanged"] is False
    # ... and the switch leaves preparation itself alone.
    assert a.service["restartIfChanged"] is False
    assert "X-RestartIfChanged=false" in a.service["unitText"]
    assert "X-RestartIfChanged=false" not in start["unitText"]


def test_with_background_on_switch_off_a_settings_change_changes_the_unit_so_switch_restarts_it(evaluate_module):
    off = "backgroundOnSwitch = false; "
    a = evaluate_module(host(off + 'settings.join.data_path = "/flodl/data";'))
    b = evaluate_module(host(off + 'settings.join.data_path = "/flodl/other";'))
    again = evaluate_module(host(off + 'settings.join.data_path = "/flodl/data";'))
    assert a.service_config["ExecStart"] != b.service_config["ExecStart"]
    assert a.service_config["ExecStart"] == again.service_config["ExecStart"]
    assert a.service["restartIfChanged"] is True
    # One `systemctl restart` after activation, so Requires= carries the
    # restart to the gated units.
    assert a.service["stopIfChanged"] is False
    assert "X-StopIfChanged=false" in a.service["unitText"]
    assert "X-RestartIfChanged=false" not in a.service["unitText"]


@pytest.fixture
def start_unit(evaluate_module, tmp_path):
    """fdl-prepare-start.service's script, runnable as systemd runs it, with
    systemctl and systemd-run replaced by recorders (no systemd is PID 1
    here) and the real flock; each recorder appends its argv to calls.log
    (one call a line, arguments apart by US, \\x1f) and exits with the
    status in its own .status file (0 when there is none)."""
    unit = evaluate_module(ENABLED)
    bin_dir = unit.fake_root / "systemd" / "bin"
    log = tmp_path / "calls.log"
    for name in ("systemctl", "systemd-run"):
        (bin_dir / name).unlink()
        # Builtins only: the unit's scripts run with no PATH of use.
        (bin_dir / name).write_text(
            "#!/bin/sh\n"
            f'{{ printf %s {name}; for a in "$@"; do printf \'\\037%s\' "$a"; done; echo; }} >> {log}\n'
            'if [ -f "$0.status" ]; then read -r status < "$0.status"; exit "$status"; fi\n'
        )
        (bin_dir / name).chmod(0o755)
    argv = shlex.split(unit.services["fdl-prepare-start"]["serviceConfig"]["ExecStart"])
    assert argv[-1] == SWITCH_LOCK

    class Start:
        root = unit.fake_root
        calls = log

        @staticmethod
        def run(lock: Path, **kw) -> subprocess.CompletedProcess[str]:
            # Run as systemd would, with the lock this test holds or not.
            return subprocess.run(
                [*argv[:-1], str(lock)], env={"PATH": "/nonexistent"}, capture_output=True, text=True, timeout=30, **kw
            )

        @staticmethod
        def logged() -> list[list[str]]:
            return [line.split("\x1f") for line in log.read_text().splitlines()] if log.exists() else []

        @staticmethod
        def fail(name: str, status: int) -> None:
            (bin_dir / f"{name}.status").write_text(str(status))

    return Start


@contextlib.contextmanager
def switch_in_progress(lock: Path):
    """The lock held as switch-to-configuration holds it (flock(2),
    exclusive, on a descriptor of its own) for as long as the block runs."""
    fd = os.open(lock, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


@pytest.mark.parametrize("lock_exists", [False, True], ids=["no lock file (boot)", "a lock nobody holds"])
def test_outside_a_switch_the_start_unit_waits_for_the_first_attempt_and_leaves_its_result_to_preparation(
    start_unit, tmp_path, lock_exists
):
    lock = tmp_path / "nixos" / "switch-to-configuration.lock"
    if lock_exists:
        lock.parent.mkdir()
        lock.touch()
    done = start_unit.run(lock)
    assert done.returncode == 0, done.stderr
    assert start_unit.logged() == [["systemctl", "start", "fdl-prepare.service"]]
    # systemd fails the start job on the first transient failure while the
    # unit retries; the start unit failing too would mark the system
    # degraded on every such boot.
    start_unit.fail("systemctl", 1)
    done = start_unit.run(lock)
    assert done.returncode == 0
    assert "fdl-prepare.service says why" in done.stdout


def test_during_a_switch_the_start_unit_returns_at_once_leaving_a_restart_for_after_it(start_unit, tmp_path):
    lock = tmp_path / "switch-to-configuration.lock"
    lock.touch()
    with switch_in_progress(lock):
        done = start_unit.run(lock)
        assert done.returncode == 0, done.stderr
        assert "a switch is in progress" in done.stdout
        (call,) = start_unit.logged()
        # Nothing started now: a transient unit waits for the switch.
        assert call[:2] == ["systemd-run", "--no-block"]
        assert "--unit=fdl-prepare-after-switch" in call and "--collect" in call
        after = call[call.index("--") + 1 :]
        assert after[0] == f"{start_unit.root}/bash/bin/bash" and after[2:] == [str(lock)]
        assert after[1].endswith("-fdl-prepare-after-switch.sh")

        # That unit's command, run for real: it waits while the switch runs...
        waiting = subprocess.Popen(
            after, env={"PATH": "/nonexistent"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=1)
        assert start_unit.logged() == [call]
    # ... and restarts preparation, without waiting on it, once the switch is over.
    assert waiting.wait(timeout=10) == 0, waiting.stderr.read() if waiting.stderr else ""
    assert start_unit.logged() == [call, ["systemctl", "restart", "--no-block", "fdl-prepare.service"]]


def test_a_second_start_in_one_switch_leaves_the_first_ones_restart_waiting(start_unit, tmp_path):
    lock = tmp_path / "switch-to-configuration.lock"
    lock.touch()
    # systemd-run refuses a unit name that exists: the first start's unit is still waiting.
    start_unit.fail("systemd-run", 1)
    with switch_in_progress(lock):
        done = start_unit.run(lock)
    assert done.returncode == 0, done.stderr
    assert start_unit.logged()[1] == ["systemctl", "--quiet", "is-active", "fdl-prepare-after-switch.service"]
    # Were it gone (it failed to start at all), the start unit says so by failing.
    start_unit.fail("systemctl", 3)
    with switch_in_progress(lock):
        assert start_unit.run(lock).returncode == 3


# -- units that run on a prepared box -------------------------------------------


def test_gated_units_require_preparation_and_are_started_once_it_succeeds(evaluate_module):
    unit = evaluate_module(host('gatedUnits = [ "fdl-join.service" ];'))
    assert unit.failed_assertions == [] and unit.warnings == []
    assert unit.service["before"] == ["fdl-join.service"]
    assert unit.service["requiredBy"] == ["fdl-join.service"]
    (post,) = unit.service_config["ExecStartPost"]
    assert post == f"{unit.fake_root}/systemd/bin/systemctl start --no-block -- fdl-join.service"
    assert ("Before", "fdl-join.service") in unit_sections(unit.service["unitText"])["Unit"]
    # A change to the gated units changes what preparation does after it succeeds: it re-prepares.
    assert post in _triggers(unit)


def test_the_old_name_before_is_still_taken_with_a_warning_naming_the_new_one(evaluate_module):
    old = evaluate_module(host('before = [ "fdl-join.service" ];'))
    new = evaluate_module(host('gatedUnits = [ "fdl-join.service" ];'))
    assert old.services == new.services
    (warning,) = old.warnings
    assert "services.fdl-prepare.before" in warning and "services.fdl-prepare.gatedUnits" in warning
    assert "services.fdl-prepare.before" not in {o["name"] for o in old.options}


def test_a_gated_unit_a_target_wants_is_warned_about_in_the_background_mode(evaluate_module):
    join = 'systemd.services.fdl-join = { wantedBy = [ "multi-user.target" ]; };'
    unit = evaluate_module(
        f'{{ services.fdl-prepare = {{ enable = true; gatedUnits = [ "fdl-join.service" ]; }}; {join} }}'
    )
    (warning,) = unit.warnings
    assert "fdl-join.service" in warning and "multi-user.target" in warning
    assert "systemd.services.fdl-join.wantedBy" in warning and "lib.mkForce [ ]" in warning
    quiet = evaluate_module(
        f'{{ services.fdl-prepare = {{ enable = true; backgroundOnSwitch = false; gatedUnits = [ "fdl-join.service" ]; }}; {join} }}'
    )
    assert quiet.warnings == []


def test_with_nothing_gated_preparation_starts_no_other_unit(evaluate_module):
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


def test_the_training_user_reaches_the_config_and_the_spec(evaluate_module):
    unit = evaluate_module(host('settings.join.user = "fdl-train";'))
    assert unit.failed_assertions == []
    table = prepare_config.load(unit.config_path)
    assert table["user"] == "fdl-train"
    assert prepare_config.resolve(table, {}, {}).user == "fdl-train"


def test_the_training_user_option_says_what_it_changes(evaluate_module):
    unit = evaluate_module(ENABLED)
    (description,) = [o["description"] for o in unit.options if o["name"] == f"{SETTINGS}user"]
    # The consequences, not the mechanism: whose cache step 3 proves, who the smoke run is.
    for said in ("fdl join", "root", ".flodl/data", "smoke run", "nixbld"):
        assert said in description


@pytest.mark.parametrize("user", ["root", ""])
def test_root_as_the_training_user_is_refused_at_evaluation(evaluate_module, user):
    unit = evaluate_module(host(f'settings.join.user = "{user}";'))
    (message,) = unit.failed_assertions
    assert "services.fdl-prepare.settings.join.user" in message and "never be root" in message


def test_a_relative_data_path_is_refused(evaluate_module):
    unit = evaluate_module(host('settings.join.data_path = "flodl/data";'))
    (message,) = unit.failed_assertions
    assert "services.fdl-prepare.settings.join.data_path" in message and '"flodl/data"' in message


def test_gated_units_take_full_unit_names(evaluate_module):
    unit = evaluate_module(host('gatedUnits = [ "fdl-join" ];'))
    (message,) = unit.failed_assertions
    assert "services.fdl-prepare.gatedUnits" in message and "fdl-join.service" in message


# -- the generated unit, for real --------------------------------------------------


@pytest.mark.parametrize("background", [True, False], ids=["background on switch", "switch waits"])
def test_the_generated_units_pass_systemd_analyze_verify(evaluate_module, tmp_path, background):
    version = systemd_version()
    if version is None:
        pytest.skip("systemd-analyze is not installed")
    body = f'gatedUnits = [ "fdl-join.service" ]; backgroundOnSwitch = {str(background).lower()};'
    unit = evaluate_module(host(body), systemd_version=str(version))
    assert set(unit.services) == ({"fdl-prepare", "fdl-prepare-start"} if background else {"fdl-prepare"})
    units = tmp_path / "units"
    units.mkdir()
    paths = []
    for name, service in unit.services.items():
        paths.append(units / f"{name}.service")
        paths[-1].write_text(service["unitText"])
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *map(str, paths)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # Evaluated for the systemd installed here, the units have no key it does not know.
    assert "Unknown key" not in done.stderr, done.stderr
    assert "fdl-prepare" not in done.stderr, done.stderr


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


# -- the flake's module check ------------------------------------------------------


def test_the_flakes_module_check_holds_for_the_module(evaluate_module):
    results = evaluate_module.check()
    assert len(results) >= 8
    assert all(results.values()), [name for name, ok in results.items() if not ok]


def test_the_flakes_module_check_fails_for_a_module_whose_settings_are_free_form_again(evaluate_module):
    # The regression the check is there for: `join` (and the file) taking any key.
    loosened = """
      { lib, ... }:
      let anyKey = lib.types.attrsOf lib.types.anything; in {
        options.services.fdl-prepare.settings = lib.mkOption {
          type = lib.types.submodule {
            freeformType = anyKey;
            options.join = lib.mkOption { type = lib.types.submodule { freeformType = anyKey; }; };
          };
        };
      }
    """
    results = evaluate_module.check(loosened)
    failed = {name for name, ok in results.items() if not ok}
    assert failed == {
        "a misspelt key in settings.join fails evaluation",
        "a misspelt table beside join fails evaluation",
    }


def test_the_fields_module_refuses_a_table_and_a_module_that_disagree(module_nixpkgs_lib, tmp_path):
    exported = json.loads(FIELDS_JSON.read_text())
    for f in exported["fields"]:
        if f["key"] == "list_timeout":
            f["type"] = None
    doctored = tmp_path / "fields.json"
    doctored.write_text(json.dumps(exported))
    expression = (
        f"(import {REPO}/nix/fields.nix {{ lib = import {module_nixpkgs_lib}; file = {doctored};"
        ' own = [ "flake" "state_dir" "driver_dir" ]; docs.source.bin = { description = "x"; }; }).options'
    )
    done = subprocess.run(
        ["nix-instantiate", "--eval", "--strict", "--expr", expression],
        capture_output=True,
        text=True,
        env=dict(os.environ, NIX_CONFIG=NIX_CONFIG),
        timeout=120,
    )
    assert done.returncode != 0
    assert "nix/fields.json and nix/module.nix disagree" in done.stderr
    assert "leaves join.list_timeout untyped" in done.stderr and "regenerate nix/fields.json" in done.stderr
    assert "documents join.source, which the field table does not have" in done.stderr


@pytest.mark.parametrize("path", ["flake.nix", "nix/module.nix", "nix/fields.nix", "nix/module-check.nix"])
def test_the_nix_the_flake_check_evaluates_parses(path):
    # The flake's check needs current nixpkgs, which this box's Nix cannot
    # evaluate; its cases run above through the stand-ins, and its wiring
    # must at least parse.
    if shutil.which("nix-instantiate") is None:
        pytest.skip("nix-instantiate is not installed (apt install nix-bin)")
    done = subprocess.run(["nix-instantiate", "--parse", str(REPO / path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    if path == "flake.nix":
        assert "module-check.nix" in done.stdout and "nixosSystem" in done.stdout
