"""The config file, its validation, and precedence: flags > file >
environment defaults > built-in defaults, each rule its own test."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import other_user
import pytest

from prepare import config
from prepare.config.fields import TABLE
from prepare.fail import Fail
from prepare.plan import plan
from prepare.spec import DataSpec, PrepareSpec, SourceSpec, SshSpec

FULL = """\
# other tools share this file
[controller]
listen = "0.0.0.0:7000"

[join]
data_path = "/flodl/data"
data_source = "sshfs://data@storage.example:/srv/datasets"
libtorch = "auto"
devices = [0, 1]
cpu_only = false
flake = "github:example/fdl"
state_dir = "/var/lib/fdl"
list_timeout = 5
build_timeout = 1800.5

[join.source]
from = "git+https://git.example/train.git?ref=main"
cwd = "."
build = "cargo build --release"
bin = "target/release/train"

[join.ssh]
target = "controller.example"
port = 2222
user = "worker"
identity_file = "/etc/fdl/id_ed25519"
options = ["ServerAliveInterval=15", "StrictHostKeyChecking=accept-new"]
"""

FULL_TABLE = {
    "data_path": "/flodl/data",
    "data_source": "sshfs://data@storage.example:/srv/datasets",
    "libtorch": "auto",
    "devices": [0, 1],
    "cpu_only": False,
    "flake": "github:example/fdl",
    "state_dir": "/var/lib/fdl",
    "list_timeout": 5,
    "build_timeout": 1800.5,
    "source": {
        "from": "git+https://git.example/train.git?ref=main",
        "cwd": ".",
        "build": "cargo build --release",
        "bin": "target/release/train",
    },
    "ssh": {
        "target": "controller.example",
        "port": 2222,
        "user": "worker",
        "identity_file": "/etc/fdl/id_ed25519",
        "options": ["ServerAliveInterval=15", "StrictHostKeyChecking=accept-new"],
    },
}


@pytest.fixture
def write(tmp_path: Path):
    def make(text: str | bytes, name: str = "prepare.toml") -> Path:
        path = tmp_path / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
        return path

    return make


def load_fail(path: Path) -> Fail:
    with pytest.raises(Fail) as caught:
        config.load(path)
    return caught.value


def resolve_fail(file: dict, flags: dict, env: dict | None = None) -> Fail:
    """What resolving then planning says, as the CLI does both."""
    with pytest.raises(Fail) as caught:
        plan(config.resolve(file, flags, env or {}), env or {})
    return caught.value


# -- finding the file ------------------------------------------------------------


def test_the_config_flag_wins_over_the_variable_and_the_default(write, tmp_path):
    flag = write("", "flag.toml")
    named = write("", "env.toml")
    default = write("", "default.toml")
    got = config.find_path(str(flag), {config.CONFIG_ENV: str(named)}, default=default)
    assert got == flag


def test_the_variable_is_used_when_there_is_no_flag(write):
    named = write("", "env.toml")
    default = write("", "default.toml")
    assert config.find_path(None, {config.CONFIG_ENV: str(named)}, default=default) == named


def test_the_default_file_is_used_when_present(write):
    default = write("", "default.toml")
    assert config.find_path(None, {}, default=default) == default


def test_no_flag_no_variable_and_no_default_file_means_no_config(tmp_path):
    assert config.find_path(None, {}, default=tmp_path / "absent.toml") is None


def test_an_empty_variable_counts_as_unset(tmp_path):
    assert config.find_path(None, {config.CONFIG_ENV: ""}, default=tmp_path / "absent.toml") is None


def test_a_config_flag_naming_a_missing_file_is_permanent_and_names_the_flag(tmp_path):
    with pytest.raises(Fail) as caught:
        config.find_path(str(tmp_path / "typo.toml"), {}, default=tmp_path / "absent.toml")
    assert caught.value.kind == "permanent"
    assert f"--config {tmp_path / 'typo.toml'}" in caught.value.message


def test_an_empty_config_flag_is_permanent(tmp_path):
    with pytest.raises(Fail) as caught:
        config.find_path("", {}, default=tmp_path / "absent.toml")
    assert caught.value.kind == "permanent" and "--config" in caught.value.message


def test_a_variable_naming_a_missing_file_is_permanent_and_names_the_variable(tmp_path):
    missing = tmp_path / "typo.toml"
    with pytest.raises(Fail) as caught:
        config.find_path(None, {config.CONFIG_ENV: str(missing)}, default=tmp_path / "absent.toml")
    assert caught.value.kind == "permanent"
    assert f"FDL_PREPARE_CONFIG={missing}" in caught.value.message


def test_a_dangling_symlink_at_the_default_place_is_reported_not_skipped(tmp_path):
    link = tmp_path / "prepare.toml"
    link.symlink_to(tmp_path / "gone.toml")
    assert config.find_path(None, {}, default=link) == link
    fail = load_fail(link)
    assert fail.kind == "permanent" and str(link) in fail.message


# -- loading ---------------------------------------------------------------------


def test_a_full_config_loads_as_plain_dicts_and_other_tools_tables_are_ignored(write):
    assert config.load(write(FULL)) == FULL_TABLE


def test_a_file_without_a_join_table_is_an_empty_config(write):
    assert config.load(write('[controller]\nlisten = "x"\n')) == {}


def test_an_empty_file_is_an_empty_config(write):
    assert config.load(write("")) == {}


@pytest.mark.parametrize("header", ["Join", "jion", "joins"])
def test_a_misspelt_join_table_is_refused_rather_than_ignored(write, header):
    path = write(f'[{header}]\ndata_path = "/x"\n')
    fail = load_fail(path)
    assert fail.kind == "permanent"
    assert f"[{header}]" in fail.message and "[join]" in fail.message and str(path) in fail.message


@pytest.mark.parametrize("text", ["join = 3\n", '[[join]]\ndata_path = "/x"\n'])
def test_join_that_is_not_a_table_is_permanent(write, text):
    path = write(text)
    fail = load_fail(path)
    assert fail.kind == "permanent"
    assert "join must be a table" in fail.message and str(path) in fail.message


BAD_TOML = [
    # (text, line, words the message must carry)
    ("[join]\ndata_path = /flodl/data\n", 2, ['strings need double quotes: data_path = "/flodl/data"']),
    ('[join]\ndata_path = "/flodl/data\n', 2, ["closing quote"]),
    ("[join]\nport 22\n", 2, ["Expected '='"]),
    ('[join\ndata_path = "/x"\n', 1, []),
    ("[join]\ndevices = [0, 1\n", 3, []),
    ("[join]\n[join]\n", 2, ["table header appears twice"]),
    ("[join]\ncpu_only = True\n", 2, []),
]


@pytest.mark.parametrize(("text", "line", "words"), BAD_TOML)
def test_a_toml_syntax_error_is_permanent_with_file_line_and_column(write, text, line, words):
    path = write(text)
    fail = load_fail(path)
    assert fail.kind == "permanent"
    # The column is the parser's; only its presence and the line are pinned here.
    assert re.match(rf"config {re.escape(str(path))}, line {line}, column \d+: invalid TOML", fail.message)
    for word in words:
        assert word in fail.message


def test_a_syntax_error_shows_the_line_and_a_caret_under_the_column(write):
    fail = load_fail(write("[join]\ndata_path = /flodl/data\n"))
    shown = fail.message.split("\n")
    assert shown[1] == "    data_path = /flodl/data"
    assert shown[2] == "    " + " " * 12 + "^"


def test_a_key_set_twice_is_a_syntax_error(write):
    fail = load_fail(write('[join]\nflake = "a"\nflake = "b"\n'))
    assert fail.kind == "permanent" and "invalid TOML" in fail.message


def test_a_file_that_is_not_utf8_is_permanent_with_the_line(write):
    path = write(b'[join]\n# caf\xe9\ndata_path = "/x"\n')
    fail = load_fail(path)
    assert fail.kind == "permanent"
    assert f"config {path}, line 2" in fail.message and "0xe9" in fail.message and "UTF-8" in fail.message


def test_a_directory_given_as_the_config_is_permanent(tmp_path):
    fail = load_fail(tmp_path)
    assert fail.kind == "permanent" and f"config {tmp_path} is a directory" in fail.message


@pytest.mark.parametrize("table", ["join", "other"])
def test_deeply_nested_toml_is_permanent_not_a_recursion_error(write, table):
    # Deep enough that the TOML parser itself runs out of stack, in [join]
    # or in a table of another tool.
    path = write(f"[{table}]\nx = " + "[" * 5000 + "]" * 5000 + "\n")
    fail = load_fail(path)
    assert fail.kind == "permanent"
    assert f"config {path} nests arrays or tables too deeply" in fail.message


def test_nesting_the_parser_survives_is_refused_by_the_key_it_is_under(write):
    # Shallow enough to parse, deep enough that a message quoting the value
    # would need a deep walk of its own.
    path = write("[join]\ndevices = " + "[" * 300 + "]" * 300 + "\n")
    fail = load_fail(path)
    assert fail.kind == "permanent" and "join.devices" in fail.message


@pytest.mark.parametrize("key", ["data_path", "state_dir", "flake", "libtorch"])
def test_a_nul_character_in_a_value_is_permanent_and_names_the_key(write, key):
    path = write(f'[join]\n{key} = "/a\\u0000b"\n')
    fail = load_fail(path)
    assert fail.kind == "permanent"
    assert f"join.{key}" in fail.message and "NUL character" in fail.message


def test_a_nul_character_in_a_list_item_is_permanent_and_names_the_key(write):
    path = write('[join.ssh]\noptions = ["Port=22\\u0000"]\n')
    fail = load_fail(path)
    assert fail.kind == "permanent" and "join.ssh.options" in fail.message and "NUL character" in fail.message


def test_dev_zero_as_the_config_is_permanent_at_once_not_an_endless_read():
    fail = load_fail(Path("/dev/zero"))
    assert fail.kind == "permanent"
    assert "config /dev/zero is a character device, not a regular file" in fail.message


def test_dev_null_as_the_config_is_no_config():
    assert config.load(Path("/dev/null")) == {}


def test_a_fifo_as_the_config_is_permanent_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "prepare.toml"
    os.mkfifo(fifo)
    fail = load_fail(fifo)
    assert fail.kind == "permanent" and "is a FIFO (named pipe), not a regular file" in fail.message


def test_a_config_far_larger_than_any_config_is_permanent(write):
    path = write("# padding\n" * (config.MAX_CONFIG_BYTES // 10 + 1))
    fail = load_fail(path)
    assert fail.kind == "permanent" and "more than any config" in fail.message


@pytest.mark.skipif(os.geteuid() != 0, reason="reading as another uid needs root")
def test_a_file_this_user_may_not_read_is_permanent_not_a_traceback():
    uid = 54321
    folder = Path(tempfile.mkdtemp(prefix="fdl-config-"))
    try:
        folder.chmod(0o755)
        path = folder / "prepare.toml"
        path.write_text('[join]\ndata_path = "/x"\n')
        path.chmod(0o600)
        code = (
            "from prepare import config\n"
            "from prepare.fail import Fail\n"
            "try:\n"
            f"    config.load({str(path)!r})\n"
            "except Fail as f:\n"
            "    print(f.kind + ': ' + f.message)\n"
        )
        done = other_user.run_as(uid, code)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"permanent: config {path} cannot be read"), done.stdout + done.stderr
        assert "EACCES" in done.stdout and f"sudo chmod a+r {path}" in done.stdout
    finally:
        path.unlink(missing_ok=True)
        folder.rmdir()


UNKNOWN_KEYS = [
    # (where the key goes, the misspelt key, the suggestion the message must make)
    ("join", "data_pth", "join.data_path"),
    ("join", "data-source", "join.data_source"),
    ("join", "flke", "join.flake"),
    ("join", "cpuonly", "join.cpu_only"),
    ("join", "list_timout", "join.list_timeout"),
    ("join", "port", "join.ssh.port"),
    ("join.source", "from_", "join.source.from"),
    ("join.source", "biuld", "join.source.build"),
    ("join.source", "data_path", "join.data_path"),
    ("join.ssh", "identiy_file", "join.ssh.identity_file"),
    ("join.ssh", "option", "join.ssh.options"),
    ("join.ssh", "hostname", None),
]


@pytest.mark.parametrize(("table", "key", "suggestion"), UNKNOWN_KEYS)
def test_an_unknown_key_is_permanent_and_names_the_nearest_valid_key(write, table, key, suggestion):
    path = write(f'[{table}]\n{key} = "x"\n')
    fail = load_fail(path)
    assert fail.kind == "permanent"
    assert str(path) in fail.message
    assert f"unknown key {table}.{key} (line 2)" in fail.message
    if suggestion is not None:
        assert f"did you mean {suggestion}?" in fail.message
    else:
        assert "did you mean" not in fail.message
        assert f"[{table}] takes: target, port, user, identity_file, options" in fail.message


WRONG_TYPES = [
    # (table, key, TOML value, words the message must carry)
    ("join", "data_path", "42", ["expected a string", 'quote it: data_path = "42"']),
    ("join", "data_path", '""', ["expected a non-empty string"]),
    ("join", "data_source", "true", ["expected a string"]),
    ("join", "libtorch", '["cpu"]', ["expected a string"]),
    ("join", "devices", '"0,1"', ["expected an array", "write it as a list: devices = [0, 1]"]),
    ("join", "devices", "0", ["expected an array", "devices = [0]"]),
    ("join", "devices", "[-1]", ["from 0 up"]),
    ("join", "devices", '[0, "1"]', ['"1" is a string']),
    ("join", "devices", "[true]", ["is a boolean"]),
    ("join", "devices", "[0, 0]", ["listed twice"]),
    ("join", "devices", "[]", ["offers no device"]),
    ("join", "expect_gpus", '"8"', ["expected a whole number", "expect_gpus = 8"]),
    ("join", "expect_gpus", "0", ["from 1 up"]),
    ("join", "expect_gpus", "2.0", ["expected a whole number"]),
    ("join", "cpu_only", '"true"', ["expected true or false", "cpu_only = true"]),
    ("join", "cpu_only", "1", ["expected true or false"]),
    ("join", "refresh", '"yes"', ["expected true or false", "refresh = true"]),
    ("join", "flake", '{ url = "x" }', ["expected a string, got a table"]),
    ("join", "driver_dir", "false", ["expected a string"]),
    ("join", "smoke_timeout", "0", ["greater than 0"]),
    ("join", "smoke_user", "65534", ["expected a string", 'smoke_user = "65534"']),
    ("join.source", "smoke", '"--smoke"', ['expected an array of strings such as ["--smoke"]', 'smoke = ["--smoke"]']),
    ("join", "state_dir", "1979-05-27", ["expected a string, got a date/time"]),
    ("join", "list_timeout", '"30"', ["expected a number", "list_timeout = 30"]),
    ("join", "list_timeout", "0", ["greater than 0"]),
    ("join", "list_timeout", "inf", ["finite"]),
    ("join", "list_timeout", "true", ["got a boolean"]),
    ("join", "user", "1000", ["expected a string", 'user = "1000"']),
    ("join", "user", '"-oops"', ["starts with '-'"]),
    ("join", "gpu_timeout", '"30"', ["expected a number", "gpu_timeout = 30"]),
    ("join", "gpu_timeout", "0", ["greater than 0"]),
    ("join", "build_timeout", "-5", ["greater than 0"]),
    ("join", "build_timeout", "nan", ["finite"]),
    ("join.source", "from", "1", ["expected a string"]),
    ("join.source", "cwd", "false", ["expected a string"]),
    ("join.source", "build", '["cargo", "build"]', ["expected a string, got an array"]),
    ("join.source", "bin", "3.5", ["expected a string"]),
    ("join.ssh", "target", "10", ["expected a string"]),
    ("join.ssh", "port", '"22"', ["expected an integer", "port = 22"]),
    ("join.ssh", "port", "0", ["from 1 to 65535"]),
    ("join.ssh", "port", "65536", ["from 1 to 65535"]),
    ("join.ssh", "port", "22.0", ["expected an integer"]),
    ("join.ssh", "user", "1000", ["expected a string", 'user = "1000"']),
    ("join.ssh", "identity_file", "[]", ["expected a string"]),
    ("join.ssh", "options", '"BatchMode=yes"', ["expected an array of strings", 'options = ["BatchMode=yes"]']),
    ("join.ssh", "options", "[15]", ["15 is an integer"]),
    ("join.ssh", "options", '[""]', ["non-empty"]),
    (
        "join.nix",
        "substituters",
        '"https://cache.example.org"',
        ["expected an array of store URLs", 'substituters = ["https://cache.example.org"]'],
    ),
    ("join.nix", "substituters", '["cache.example.org"]', ['"cache.example.org" is not a store URL', "scheme"]),
    ("join.nix", "substituters", '["http://a http://b"]', ["one URL per item", "no spaces"]),
    ("join.nix", "trusted_public_keys", "[1]", ["1 is an integer"]),
    ("join.nix", "trusted_public_keys", '["cache-1:bm90IGEga2V5"]', ["is not a public key", "name:base64"]),
]


@pytest.mark.parametrize(("table", "key", "value", "words"), WRONG_TYPES)
def test_a_wrong_type_is_permanent_and_names_the_key_the_value_and_the_expected_type(write, table, key, value, words):
    path = write(f"[{table}]\n{key} = {value}\n")
    fail = load_fail(path)
    assert fail.kind == "permanent"
    assert str(path) in fail.message
    assert f"{table}.{key} (line 2) = " in fail.message
    for word in words:
        assert word in fail.message, fail.message


def test_every_key_of_the_schema_has_a_wrong_type_case():
    covered = {f"{t}.{k}" for t, k, _, _ in WRONG_TYPES}
    schema = {f"join.{f.key}" for f in TABLE.fields}
    assert schema <= covered, schema - covered


@pytest.mark.parametrize(
    ("text", "key"), [('[join]\nsource = "x"\n', "join.source"), ("[join]\nssh = 22\n", "join.ssh")]
)
def test_a_table_key_given_a_plain_value_is_permanent(write, text, key):
    fail = load_fail(write(text))
    assert fail.kind == "permanent" and f"{key} (line 2)" in fail.message and "expected a table" in fail.message


def test_dotted_keys_and_inline_tables_are_validated_like_headers(write):
    fail = load_fail(write('[join]\nssh.port = "22"\nsource = { bim = "x" }\n'))
    assert "join.ssh.port (line 2)" in fail.message
    assert "unknown key join.source.bim" in fail.message and "did you mean join.source.bin?" in fail.message


def test_all_problems_are_reported_at_once_in_file_order(write):
    path = write('[join]\nflke = "x"\n\n[join.ssh]\nport = "22"\n\n[join.source]\nfrom_ = "y"\n')
    fail = load_fail(path)
    assert fail.message.startswith(f"config {path}: 3 problems:")
    lines = fail.message.split("\n")[1:]
    assert ["join.flke" in lines[0], "join.ssh.port" in lines[1], "join.source.from_" in lines[2]] == [True] * 3


# -- precedence: flags > file > environment defaults > built-in defaults ------------------


def test_nothing_given_yields_the_built_in_defaults():
    assert config.resolve({}, {}, {}) == PrepareSpec()


def test_an_environment_default_beats_the_built_in_one():
    spec = config.resolve({}, {}, {"FDL_PREPARE_FLAKE": "path:/nix/app", "STATE_DIRECTORY": "/var/lib/fdl"})
    assert spec.flake == "path:/nix/app"
    assert spec.state_dir == "/var/lib/fdl"


def test_the_first_of_several_systemd_state_directories_is_the_state_dir():
    spec = config.resolve({}, {}, {"STATE_DIRECTORY": "/var/lib/fdl:/var/lib/other"})
    assert spec.state_dir == "/var/lib/fdl"


def test_an_empty_environment_default_counts_as_unset():
    assert config.resolve({}, {}, {"FDL_PREPARE_FLAKE": "", "STATE_DIRECTORY": ""}) == PrepareSpec()


def test_the_file_beats_an_environment_default():
    env = {"FDL_PREPARE_FLAKE": "path:/nix/app", "STATE_DIRECTORY": "/run/state"}
    spec = config.resolve({"flake": "github:me/fdl", "state_dir": "/srv/fdl"}, {}, env)
    assert spec.flake == "github:me/fdl"
    assert spec.state_dir == "/srv/fdl"


def test_a_flag_beats_an_environment_default():
    spec = config.resolve({}, {"flake": "path:/mine"}, {"FDL_PREPARE_FLAKE": "path:/nix/app"})
    assert spec.flake == "path:/mine"


SCALARS = [
    # (dotted key, file value, flag value, how to read it off the spec)
    ("data_path", "/file", "/flag", lambda s: s.data.data_path),
    ("data_source", "sshfs://a/x", "sshfs://b/y", lambda s: s.data.data_source),
    ("libtorch", "cu128", "cpu", lambda s: s.libtorch),
    ("devices", [0, 1], [2], lambda s: s.devices),
    ("cpu_only", False, True, lambda s: s.cpu_only),
    ("flake", "github:a/b", "path:/c", lambda s: s.flake),
    ("state_dir", "/file/state", "/flag/state", lambda s: s.state_dir),
    ("list_timeout", 5, 7.5, lambda s: s.list_timeout_s),
    ("build_timeout", 60, 120, lambda s: s.build_timeout_s),
    ("source.from", "git+https://a", "path:/b", lambda s: s.source.from_),
    ("source.cwd", "a", "b", lambda s: s.source.cwd),
    ("source.build", "make", "cargo build", lambda s: s.source.build),
    ("source.bin", "a.out", "train", lambda s: s.source.bin),
    ("ssh.target", "a.example", "b.example", lambda s: s.ssh.target),
    ("ssh.port", 22, 2222, lambda s: s.ssh.port),
    ("ssh.user", "file", "flag", lambda s: s.ssh.user),
    ("ssh.identity_file", "/a", "/b", lambda s: s.ssh.identity_file),
    ("ssh.options", ["A=1"], ["B=2"], lambda s: s.ssh.options),
]


def nested(dotted: str, value):
    head, _, tail = dotted.partition(".")
    return {head: {tail: value}} if tail else {head: value}


def expected(value):
    return tuple(value) if isinstance(value, list) else value


@pytest.mark.parametrize(("key", "file_value", "flag_value", "read"), SCALARS, ids=[s[0] for s in SCALARS])
def test_a_flag_beats_the_file_for_every_key(key, file_value, flag_value, read):
    assert read(config.resolve(nested(key, file_value), {}, {})) == expected(file_value)
    assert read(config.resolve(nested(key, file_value), nested(key, flag_value), {})) == expected(flag_value)


@pytest.mark.parametrize(("key", "file_value", "flag_value", "read"), SCALARS, ids=[s[0] for s in SCALARS])
def test_a_flag_given_as_none_means_not_given(key, file_value, flag_value, read):
    assert read(config.resolve(nested(key, file_value), nested(key, None), {})) == expected(file_value)


def test_a_flag_for_one_field_leaves_the_files_other_fields_alone():
    spec = config.resolve(FULL_TABLE, {"data_path": "/elsewhere"}, {})
    assert spec.data == DataSpec(data_path="/elsewhere", data_source=FULL_TABLE["data_source"])
    assert spec.libtorch == "auto" and spec.devices == (0, 1) and spec.flake == "github:example/fdl"
    assert spec.source == SourceSpec(
        from_="git+https://git.example/train.git?ref=main",
        cwd=".",
        build="cargo build --release",
        bin="target/release/train",
    )
    assert spec.ssh.port == 2222 and spec.ssh.user == "worker"


def test_source_fields_merge_field_by_field():
    spec = config.resolve(FULL_TABLE, {"source": {"from": "path:/checkout", "bin": None}}, {})
    assert spec.source == SourceSpec(
        from_="path:/checkout", cwd=".", build="cargo build --release", bin="target/release/train"
    )


def test_ssh_fields_merge_field_by_field():
    spec = config.resolve(FULL_TABLE, {"ssh": {"port": 22}}, {})
    assert spec.ssh == SshSpec(
        target="controller.example",
        port=22,
        user="worker",
        identity_file="/etc/fdl/id_ed25519",
        options=("ServerAliveInterval=15", "StrictHostKeyChecking=accept-new"),
    )


def test_ssh_options_from_flags_replace_the_files_list_rather_than_extend_it():
    spec = config.resolve(FULL_TABLE, {"ssh": {"options": ["BatchMode=yes"]}}, {})
    assert spec.ssh.options == ("BatchMode=yes",)


def test_ssh_options_from_the_file_stand_when_no_option_flag_is_given():
    spec = config.resolve(FULL_TABLE, {"ssh": {"options": None}}, {})
    assert spec.ssh.options == ("ServerAliveInterval=15", "StrictHostKeyChecking=accept-new")


def test_an_empty_options_list_from_flags_is_given_and_clears_the_files_list():
    assert config.resolve(FULL_TABLE, {"ssh": {"options": []}}, {}).ssh.options == ()


def test_devices_from_flags_replace_the_files_list():
    assert config.resolve({"devices": [0, 1, 2]}, {"devices": [3]}, {}).devices == (3,)


def test_no_cpu_only_flag_beats_cpu_only_in_the_file():
    assert config.resolve({"cpu_only": True}, {"cpu_only": False}, {}).cpu_only is False


def test_no_source_anywhere_means_no_source_spec():
    assert config.resolve({"data_path": "/x"}, {"ssh": {"port": 22}}, {}).source is None


def test_a_source_flag_alone_makes_a_source_spec():
    spec = config.resolve({}, {"source": {"from": "path:/checkout"}}, {})
    assert spec.source == SourceSpec(from_="path:/checkout")
    assert spec.wants_build


def test_source_flags_that_are_all_none_make_no_source_spec():
    assert config.resolve({}, {"source": {"from": None, "bin": None}}, {}).source is None


def test_an_empty_source_table_in_the_file_is_a_source_spec_with_nothing_set():
    assert config.resolve({"source": {}}, {}, {}).source == SourceSpec()


def test_values_come_out_as_the_types_the_spec_declares():
    spec = config.resolve(FULL_TABLE, {}, {})
    assert isinstance(spec.devices, tuple) and isinstance(spec.ssh.options, tuple)
    assert spec.list_timeout_s == 5.0 and isinstance(spec.list_timeout_s, float)
    assert spec.build_timeout_s == 1800.5


def test_a_loaded_file_resolves_end_to_end(write):
    spec = config.resolve(config.load(write(FULL)), {"ssh": {"user": "root"}}, {"FDL_PREPARE_FLAKE": "path:/app"})
    assert spec.ssh.user == "root" and spec.flake == "github:example/fdl" and spec.data.data_path == "/flodl/data"


# -- flags are validated like the file, and named as flags ----------------------------------


BAD_FLAGS = [
    ({"ssh": {"port": 0}}, "--ssh-port (join.ssh.port) = 0"),
    ({"ssh": {"port": "22"}}, '--ssh-port (join.ssh.port) = "22": expected an integer'),
    ({"devices": []}, "--devices (join.devices) = []: an empty list offers no device"),
    ({"devices": [0, -1]}, "--devices (join.devices)"),
    ({"list_timeout": 0.0}, "--list-timeout (join.list_timeout) = 0.0"),
    ({"build_timeout": -1.0}, "--build-timeout (join.build_timeout)"),
    ({"data_path": ""}, "--data-path (join.data_path)"),
    ({"source": {"from": ""}}, "--source (join.source.from)"),
    ({"ssh": {"identity_file": " "}}, "--identity-file (join.ssh.identity_file)"),
    ({"ssh": {"options": ["A=1", 2]}}, "--ssh-option (join.ssh.options)"),
    ({"cpu_only": "yes"}, "--cpu-only (join.cpu_only)"),
]


@pytest.mark.parametrize(("flags", "named"), BAD_FLAGS)
def test_a_bad_flag_value_is_permanent_and_names_the_flag(flags, named):
    fail = resolve_fail({}, flags)
    assert fail.kind == "permanent"
    assert named in fail.message, fail.message
    assert "TOML" not in fail.message and "quotes" not in fail.message


def test_an_unknown_flag_key_is_a_caller_bug_not_an_operator_error():
    with pytest.raises(ValueError, match="ssh.prot"):
        config.resolve({}, {"ssh": {"prot": 22}}, {})


def test_a_bad_file_table_handed_straight_to_resolve_is_still_refused():
    fail = resolve_fail({"ssh": {"port": "22"}}, {})
    assert fail.kind == "permanent" and "join.ssh.port" in fail.message


@pytest.mark.parametrize("libtorch", ["cu128", "cu126"])
def test_cpu_only_with_a_cuda_libtorch_is_permanent_and_names_both_sources(libtorch):
    fail = resolve_fail({"libtorch": libtorch}, {"cpu_only": True})
    assert fail.kind == "permanent"
    assert "--cpu-only" in fail.message and "join.libtorch in the config" in fail.message
    assert f'"{libtorch}"' in fail.message


@pytest.mark.parametrize("libtorch", ["cpu", "auto", None])
def test_cpu_only_allows_the_cpu_and_auto_libtorch(libtorch):
    assert config.resolve({"cpu_only": True}, {"libtorch": libtorch}, {}).cpu_only is True


def test_parse_devices_reads_a_comma_list_and_refuses_garbage():
    assert config.parse_devices("0, 2") == [0, 2]
    for text in ["", "0,,1", "a", "-1", "1.5"]:
        with pytest.raises(Fail) as caught:
            config.parse_devices(text)
        assert caught.value.kind == "permanent" and "--devices" in caught.value.message


# -- origins: where each resolved value came from -------------------------------------------


def test_each_resolved_value_records_where_it_came_from():
    env = {"FDL_PREPARE_FLAKE": "path:/nix/app", "STATE_DIRECTORY": "/var/lib/fdl:/var/lib/other"}
    spec = config.resolve({"libtorch": "cpu", "ssh": {"port": 22}}, {"data_path": "/flag"}, env)
    assert str(spec.origin("data.data_path")) == "--data-path"
    assert str(spec.origin("libtorch")) == "join.libtorch in the config"
    assert str(spec.origin("ssh.port")) == "join.ssh.port in the config"
    assert str(spec.origin("flake")) == "$FDL_PREPARE_FLAKE"
    assert str(spec.origin("state_dir")) == "$STATE_DIRECTORY, systemd's StateDirectory="
    assert spec.origin("list_timeout_s").kind == "default"
    assert [spec.origin(p).value for p in ("data.data_path", "ssh.port", "state_dir")] == ["/flag", 22, "/var/lib/fdl"]


def test_origins_are_not_part_of_equality_and_a_spec_built_in_code_has_none():
    assert config.resolve({"cpu_only": True}, {}, {}) == config.resolve({}, {"cpu_only": True}, {})
    assert PrepareSpec(cpu_only=True).origin("cpu_only") is None


def test_a_value_replaced_after_resolving_no_longer_claims_its_origin():
    from dataclasses import replace

    spec = config.resolve({"state_dir": "/srv/fdl"}, {}, {})
    assert replace(spec, cpu_only=True).origin("state_dir") is not None
    assert replace(spec, state_dir="/elsewhere").origin("state_dir") is None


# -- rules across fields: checked once, by the plan, for the config and a spec built in code -------


def test_the_plan_refuses_cpu_only_with_a_cuda_libtorch_naming_the_spec_fields():
    with pytest.raises(Fail) as caught:
        plan(PrepareSpec(cpu_only=True, libtorch="cu128"))
    assert caught.value.permanent
    assert "cpu_only (from PrepareSpec.cpu_only)" in caught.value.message
    assert 'libtorch is "cu128" (from PrepareSpec.libtorch)' in caught.value.message


def test_the_plan_of_a_resolved_spec_names_where_its_values_came_from():
    from dataclasses import replace

    # A join loop may resolve a config and then change it: the rule still
    # holds, and names the flag for what came from one and the field for the rest.
    spec = replace(config.resolve({}, {"cpu_only": True}, {}), libtorch="cu126")
    with pytest.raises(Fail) as caught:
        plan(spec)
    assert "cpu_only (from --cpu-only)" in caught.value.message
    assert "(from PrepareSpec.libtorch)" in caught.value.message


# -- URLs are normalised once, here -------------------------------------------------------------


def test_urls_from_the_file_and_flags_lose_surrounding_spaces():
    spec = config.resolve(
        {"data_source": " sshfs://h/srv/d ", "source": {"from": " path:/srv/x "}}, {"flake": "\tpath:/srv/fdl\n"}, {}
    )
    assert spec.data.data_source == "sshfs://h/srv/d"
    assert spec.source is not None and spec.source.from_ == "path:/srv/x"
    assert spec.flake == "path:/srv/fdl"


def test_urls_from_the_environment_lose_surrounding_spaces():
    assert config.resolve({}, {}, {"FDL_PREPARE_FLAKE": " path:/nix/app "}).flake == "path:/nix/app"


def test_a_spec_from_code_is_planned_with_its_urls_stripped_and_a_normal_one_left_alone():
    spec = PrepareSpec(source=SourceSpec(from_=" path:/srv/x ", bin="train"), flake="path:/srv/fdl ")
    checked = config.checked(spec)
    assert checked.source == SourceSpec(from_="path:/srv/x", bin="train")
    assert checked.flake == "path:/srv/fdl"
    assert config.checked(checked) is checked
    resolved = config.resolve(FULL_TABLE, {}, {})
    assert config.checked(resolved) is resolved
    built = plan(spec).build
    assert built is not None and built.flake == "path:/srv/fdl" and built.source == checked.source


def test_a_spec_from_code_keeps_its_other_strings_as_given():
    spec = PrepareSpec(source=SourceSpec(from_="path:/x", build=" make "))
    checked = config.checked(spec)
    assert checked.source is not None and checked.source.build == " make "


def test_a_value_resolve_took_is_not_checked_again_by_the_plan():
    # Each value is checked where it enters: the file's by load, a flag's by
    # resolve. The plan checks only what came from code.
    from dataclasses import replace

    from prepare.config.fields import Table

    seen: list[object] = []
    field = TABLE.by_key["smoke_timeout"]
    counted = replace(field.kind, check=lambda v: seen.append(v) or field.kind.check(v))
    table = Table([replace(f, kind=counted) if f is field else f for f in TABLE.fields])
    spec = config.resolve({}, {"smoke_timeout": 60.0}, {}, table=table)
    assert seen == [60.0]
    plan(spec, table=table)
    assert seen == [60.0]
    plan(PrepareSpec(smoke_timeout_s=30.0), table=table)
    assert seen == [60.0, 30.0]


# -- every value in a range the box can act on ---------------------------------------------


@pytest.mark.parametrize(
    ("value", "words"),
    [("var/lib/fdl", "is a relative path"), ("~/state", "starts with '~'"), ("~root/state", "starts with '~'")],
)
def test_a_relative_or_tilde_state_dir_is_permanent(value, words):
    fail = resolve_fail({"state_dir": value}, {})
    assert fail.kind == "permanent" and "join.state_dir" in fail.message and words in fail.message
    fail = resolve_fail({}, {"state_dir": value})
    assert "--state-dir" in fail.message and words in fail.message


def test_a_control_character_in_state_dir_is_permanent_and_forges_no_line():
    forged = "/var/lib/fdl\n[fdl-prepare] prepared in 0.01s\x1b[2J"
    fail = resolve_fail({"state_dir": forged}, {})
    assert fail.reason == "config.invalid" and fail.kind == "permanent", fail.message
    assert "join.state_dir" in fail.message and "has a control character" in fail.message
    assert "\n[fdl-prepare]" not in fail.message and "\x1b" not in fail.message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("list_timeout", 0.001),
        ("list_timeout", 1e300),
        ("list_timeout", 86400.0),
        ("build_timeout", 0.5),
        ("build_timeout", 1e12),
    ],
)
def test_a_timeout_no_timer_can_hold_or_no_work_can_fit_is_permanent(key, value):
    fail = resolve_fail({key: value}, {})
    assert fail.kind == "permanent" and f"join.{key}" in fail.message and "seconds (" in fail.message


def test_the_range_ends_are_accepted():
    spec = config.resolve({"list_timeout": 0.1, "build_timeout": 30 * 86400}, {}, {})
    assert (spec.list_timeout_s, spec.build_timeout_s) == (0.1, 30 * 86400.0)
    spec = config.resolve({"list_timeout": 3600, "build_timeout": 1}, {}, {})
    assert (spec.list_timeout_s, spec.build_timeout_s) == (3600.0, 1.0)


def test_a_hundred_thousand_devices_are_checked_in_linear_time():
    import time

    # floDl keeps a device index in a byte: every one of them is taken...
    every = list(range(256))
    assert config.resolve({"devices": every}, {}, {}).devices == tuple(every)
    many = list(range(100_000))
    start = time.monotonic()
    # ...and a generated list past them is refused at its first index past 255,
    # from the file or a flag, with a short message.
    fail = resolve_fail({"devices": many}, {})
    assert "device 256 is past 255" in fail.message and len(fail.message) < 1000
    fail = resolve_fail({}, {"devices": config.parse_devices(",".join(map(str, many)))})
    assert "--devices" in fail.message and "device 256 is past 255" in fail.message
    assert time.monotonic() - start < 2.0
    # A repeat at the very end is still found, and the message stays short.
    fail = resolve_fail({"devices": [*every, 255]}, {})
    assert "device 255 is listed twice" in fail.message and len(fail.message) < 1000


@pytest.mark.parametrize(("key", "value"), [("ssh.target", "-oProxyCommand=x"), ("ssh.user", "-l")])
def test_an_ssh_target_or_user_that_starts_with_a_dash_is_permanent(key, value):
    table, name = key.split(".")
    fail = resolve_fail({table: {name: value}}, {})
    assert fail.kind == "permanent" and f"join.{key}" in fail.message and "starts with '-'" in fail.message


@pytest.mark.parametrize(
    ("table", "key", "value", "words"),
    [
        ("join.source", "from", '"git+https://h/r?ref=' + "a" * 140_000 + '"', "past the 4 KiB a URL may be"),
        ("join", "flake", '"path:/' + "b" * 5000 + '"', "past the 4 KiB a URL may be"),
        ("join.nix", "substituters", '["https://c/' + "c" * 5000 + '"]', "past the 4 KiB a URL may be"),
        ("join.source", "smoke", '["' + "d" * 200_000 + '"]', "item 0 is 200000 bytes long, past the 16 KiB"),
        ("join.source", "bin", '"' + "e" * 20_000 + '"', "past the 16 KiB a value may be"),
    ],
    ids=["source-from", "flake", "substituter", "smoke-argument", "bin"],
)
def test_an_over_long_value_is_permanent_naming_the_key_and_the_limit(write, table, key, value, words):
    path = write(f"[{table}]\n{key} = {value}\n")
    with pytest.raises(Fail) as caught:
        config.load(path)
    fail = caught.value
    assert fail.permanent and fail.reason == "config.invalid"
    assert f"{table}.{key}" in fail.message and words in fail.message
    assert len(fail.message) < 2000


# -- one config for fdl-prepare and `fdl join` ---------------------------------------------------

FLODL_KEYS_TOML = """\
[join]
controller = "10.0.0.1:1337"
token = "0123456789abcdef0123456789abcdef"
host = "gpu-7"
persist = true
args = ["--epochs", "10"]
gpu_ram_share = 0.5
sig_probe = false
libtorch = "auto"
"""


def test_flodls_join_keys_are_taken_and_named_in_one_note(write):
    notes: list[str] = []
    table = config.load(write(FLODL_KEYS_TOML), notes=notes)
    # Left to `fdl join`: nothing of them reaches the spec.
    assert table == {"libtorch": "auto"}
    assert table.foreign == (
        "join.controller",
        "join.token",
        "join.host",
        "join.persist",
        "join.args",
        "join.gpu_ram_share",
        "join.sig_probe",
    )
    (note,) = notes
    for key in table.foreign:
        assert key in note
    assert "fdl join" in note
    # The admission token is a credential: never repeated.
    assert "0123456789abcdef" not in note


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("persist = 1", ["join.persist (line 2) = 1", "expected true or false"]),
        ("gpu_ram_share = -0.5", ["join.gpu_ram_share (line 2)", "non-negative"]),
        ('args = "--epochs 10"', ["join.args (line 2)", "expected an array of strings"]),
        ('controller = "-oProxyCommand=x"', ["join.controller (line 2)", "starts with '-'"]),
    ],
)
def test_a_flodl_key_of_the_wrong_type_is_refused_as_fdl_join_would(write, line, words):
    fail = load_fail(write(f"[join]\n{line}\n"))
    assert fail.reason == "config.invalid"
    for word in words:
        assert word in fail.message, fail.message


def test_a_bad_token_is_refused_without_repeating_it(write):
    fail = load_fail(write('[join]\ntoken = ""\n'))
    assert fail.reason == "config.invalid"
    assert "join.token (line 2) = <token, not shown>" in fail.message
    fail = load_fail(write("[join]\ntoken = 12345678901\n"))
    assert fail.reason == "config.invalid" and "12345678901" not in fail.message


def test_bin_and_source_together_are_refused_as_fdl_join_refuses_them(write):
    fail = load_fail(write('[join]\nbin = "/opt/train"\n\n[join.source]\nfrom = "path:/srv/train"\n'))
    assert fail.reason == "config.invalid"
    assert "join.bin (line 2) and [join.source] both name" in fail.message


def test_bin_alone_is_fdl_joins_and_builds_nothing(write):
    notes: list[str] = []
    table = config.load(write('[join]\nbin = "/opt/train"\n'), notes=notes)
    assert table == {} and table.foreign == ("join.bin",)
    spec = config.resolve(table, {}, {})
    assert spec.source is None and not spec.wants_build


@pytest.mark.parametrize(
    ("alias", "label"),
    [("12.6", "cu126"), ("12.8", "cu128"), ("rocm70", "rocm7.0"), ("7.0", "rocm7.0"), ("rocm71", "rocm7.1"),
     ("7.1", "rocm7.1"), (" cu128 ", "cu128"), ("rocm7.0", "rocm7.0"), ("auto", "auto"), ("cpu", "cpu")],
)  # fmt: skip
def test_flodls_libtorch_spellings_name_the_flakes_labels(alias, label):
    assert config.resolve({"libtorch": alias}, {}, {}).libtorch == label
    assert config.resolve({}, {"libtorch": alias}, {}).libtorch == label
    # A spec built in code is normalised by the plan the same way.
    built = plan(PrepareSpec(libtorch=alias, flake="github:example/fdl")).build
    assert built is not None and built.libtorch == label


def test_devices_all_offers_every_device_from_the_file_a_flag_or_code(write):
    assert config.resolve(config.load(write('[join]\ndevices = "all"\n')), {}, {}).devices is None
    # `--devices all` replaces the file's list, as any --devices does.
    assert config.resolve({"devices": [0, 1]}, {"devices": config.parse_devices("all")}, {}).devices is None
    assert config.parse_devices(" ALL ") == "all"
    assert plan(PrepareSpec(devices="all")).gate.devices is None  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ['"every"', '"0,1"'])
def test_a_devices_string_other_than_all_is_refused_with_the_list_hint(write, value):
    fail = load_fail(write(f"[join]\ndevices = {value}\n"))
    assert fail.reason == "config.invalid" and "join.devices (line 2)" in fail.message


def test_the_training_user_is_a_key_and_a_flag():
    assert config.resolve({"user": "trainer"}, {}, {}).user == "trainer"
    spec = config.resolve({"user": "trainer"}, {"user": "other"}, {})
    assert spec.user == "other" and str(spec.origin("user")) == "--user"


# -- floDl's fdl.yml ---------------------------------------------------------------------------

FDL_YML = """\
description: a floDl project
commands:
  train:
    run: cargo run --release
cluster: {}
join:
  controller: 10.0.0.1:1337
  token: 0123456789abcdef0123456789abcdef
  persist: true
  libtorch: "12.8"
  devices: [0, 1]
  data_path: /flodl/data
  data_source: sshfs://data@storage.example:/srv/datasets
  ssh:
    target: controller.example
    port: 2222
    user: worker
    identity_file: /etc/fdl/id_ed25519
    options: [ServerAliveInterval=15]
  source:
    from: git+https://git.example/train.git?ref=main
    cwd: .
    build: cargo build --release
    bin: target/release/train
"""


@pytest.mark.parametrize("name", ["fdl.yml", "fdl.yaml", "FDL.YML"])
def test_an_fdl_yml_is_read_as_its_join_block_with_flodls_names(write, name):
    notes: list[str] = []
    table = config.load(write(FDL_YML, name), notes=notes)
    assert table == {
        "libtorch": "12.8",
        "devices": [0, 1],
        "data_path": "/flodl/data",
        "data_source": "sshfs://data@storage.example:/srv/datasets",
        "ssh": {
            "target": "controller.example",
            "port": 2222,
            "user": "worker",
            "identity_file": "/etc/fdl/id_ed25519",
            "options": ["ServerAliveInterval=15"],
        },
        "source": {
            "from": "git+https://git.example/train.git?ref=main",
            "cwd": ".",
            "build": "cargo build --release",
            "bin": "target/release/train",
        },
    }
    assert table.foreign == ("join.controller", "join.token", "join.persist")
    assert len(notes) == 1 and "0123456789abcdef" not in notes[0]
    spec = config.resolve(table, {}, {})
    assert spec.libtorch == "cu128" and spec.devices == (0, 1) and spec.ssh.port == 2222


def test_an_fdl_yml_without_join_is_an_empty_config(write):
    assert config.load(write("commands:\n  x: {run: ls}\n", "fdl.yml")) == {}
    assert config.load(write("", "fdl.yml")) == {}
    assert config.load(write("join:\n", "fdl.yml")) == {}


def test_an_fdl_yml_gets_the_same_checks_and_messages_as_the_toml(write):
    fail = load_fail(write("join:\n  ssh:\n    port: 70000\n  devices: [0, 0]\n", "fdl.yml"))
    assert fail.reason == "config.invalid"
    assert "join.ssh.port (line 3) = 70000: expected a port from 1 to 65535" in fail.message
    assert "join.devices (line 4)" in fail.message and "device 0 is listed twice" in fail.message
    fail = load_fail(write("join:\n  data_pth: /x\n", "fdl.yml"))
    assert "unknown key join.data_pth (line 2); did you mean join.data_path?" in fail.message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("join:\n  user: trainer\n", "join.user (line 2)"),
        ("join:\n  expect_gpus: 8\n", "join.expect_gpus (line 2)"),
        ("join:\n  source:\n    from: path:/x\n    smoke: [--smoke]\n", "join.source.smoke (line 4)"),
        ("join:\n  nix:\n    substituters: [https://c.example]\n", "join.nix (line 2)"),
    ],
)
def test_a_key_of_fdl_prepares_alone_in_an_fdl_yml_is_refused_since_fdl_join_would_stop(write, text, key):
    fail = load_fail(write(text, "fdl.yml"))
    assert fail.reason == "config.invalid"
    assert f"{key} is fdl-prepare's alone" in fail.message
    assert "TOML config" in fail.message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        # YAML 1.2, as floDl's serde_yaml reads it: these are strings there.
        ("join:\n  persist: yes\n", ['join.persist (line 2) = "yes"', "expected true or false"]),
        ("join:\n  ssh:\n    port: 1:20\n", ['join.ssh.port (line 3) = "1:20"']),
        ("join:\n  data_path: 2024-01-01\n", ['join.data_path (line 2) = "2024-01-01"']),
    ],
)
def test_an_fdl_yml_is_read_as_yaml_1_2_as_fdl_join_reads_it(write, text, words):
    fail = load_fail(write(text, "fdl.yml"))
    assert fail.reason == "config.invalid"
    for word in words:
        assert word in fail.message, fail.message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("a: &x [0, 1]\njoin:\n  devices: *x\n", ["alias"]),
        ("join:\n  devices: [0]\n  devices: [1]\n", ["line 3", "join.devices is set twice"]),
        ("join: {}\njoin: {}\n", ["join is set twice"]),
        ("join: [\n", ["invalid YAML", "line 2"]),
        ("join:\n  1: x\n", ["line 2", "write the key as a name"]),
        ("join:\n  ? [a]\n  : b\n", ["write the key as a name"]),
        ("join:\n  data_path: !!python/object:os.system x\n", ["invalid YAML"]),
        ("--- {}\n--- {}\n", ["invalid YAML"]),
        ("- join\n", ["is a mapping of keys"]),
        ("join: 3\n", ["join must be a mapping"]),
        ("jion:\n  data_path: /x\n", ["did you mean join:"]),
    ],
)
def test_a_hostile_or_broken_fdl_yml_is_permanent_with_its_line(write, text, words):
    fail = load_fail(write(text, "fdl.yml"))
    assert fail.reason == "config.invalid"
    for word in words:
        assert word in fail.message, fail.message


def test_a_billion_laughs_fdl_yml_is_refused_at_once():
    import time

    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 30)]
    lines += ["join:", "  args: *a29"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fdl.yml"
        path.write_text("\n".join(lines) + "\n")
        start = time.monotonic()
        fail = load_fail(path)
    assert fail.reason == "config.invalid" and "alias" in fail.message
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("depth", [100, 100_000])
def test_a_deeply_nested_fdl_yml_is_permanent_not_a_recursion_error(write, depth):
    fail = load_fail(write("join:\n  args: " + "[" * depth + "]" * depth + "\n", "fdl.yml"))
    assert fail.reason == "config.invalid" and "deeper" in fail.message


def test_an_fdl_yml_is_held_to_the_same_size_bound(write):
    fail = load_fail(write("join: {}\n" + "#" * config.MAX_CONFIG_BYTES + "\n", "fdl.yml"))
    assert fail.reason == "config.unreadable"


def test_a_misspelt_key_of_flodls_is_refused_naming_the_key_meant(write):
    fail = load_fail(write('[join]\ncontroler = "10.0.0.1"\n'))
    assert fail.reason == "config.invalid"
    assert "unknown key join.controler (line 2); did you mean join.controller, `fdl join`'s" in fail.message
