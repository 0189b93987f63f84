"""The field table is the one place a config key is declared: the spec,
the CLI, the TOML schema, resolve and check_spec all follow it, and adding a
key is one entry there (nix/module.nix is held to it in test_module.py)."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from prepare import config
from prepare.cli import app
from prepare.config.fields import FIELDS, TABLE, Env, Field, Table, nest, value_at
from prepare.config.kinds import SECONDS
from prepare.fail import Fail
from prepare.plan import plan
from prepare.spec import PrepareSpec, SourceSpec

PACKAGE = Path(config.__file__).resolve().parent


def spec_paths(cls: type, prefix: str = "") -> set[str]:
    """Every leaf attribute path of a spec class, through its nested specs."""
    hints = typing.get_type_hints(cls)
    paths: set[str] = set()
    for f in dataclasses.fields(cls):
        if f.name == "origins":
            continue
        nested = [t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if dataclasses.is_dataclass(t)]
        if nested:
            paths |= spec_paths(nested[0], f"{prefix}{f.name}.")
        else:
            paths.add(prefix + f.name)
    return paths


# -- the table against the spec ------------------------------------------------------------------


def test_every_spec_field_has_exactly_one_entry_in_the_table():
    assert sorted(f.spec for f in FIELDS) == sorted(spec_paths(PrepareSpec))


def test_the_tables_defaults_are_the_specs_own():
    defaults = PrepareSpec(source=SourceSpec())
    for f in FIELDS:
        assert value_at(defaults, f.spec) == f.default, f.key


def test_every_field_has_a_flag_help_and_a_key_a_toml_file_can_hold():
    for f in FIELDS:
        assert re.fullmatch(r"--[a-z][a-z0-9-]*", f.flag), f.key
        assert re.fullmatch(r"[a-z_]+(\.[a-z_]+)?", f.key), f.key
        assert f.help.strip(), f.key


@pytest.mark.parametrize("attr", ["key", "flag", "spec"])
def test_a_table_where_two_fields_share_a_name_is_refused(attr):
    twin = replace(FIELDS[1], **{attr: getattr(FIELDS[0], attr)})
    with pytest.raises(ValueError, match=attr):
        Table((FIELDS[0], twin))


def test_the_sub_tables_are_those_the_keys_name_in_file_order():
    assert TABLE.subtables == ["source", "ssh", "nix"]
    assert list(TABLE.tables["ssh"]) == ["target", "port", "user", "identity_file", "options"]


def test_nest_gives_dotted_keys_the_files_shape():
    assert nest({"data_path": "/x", "ssh.port": 22, "ssh.user": "u"}) == {
        "data_path": "/x",
        "ssh": {"port": 22, "user": "u"},
    }


def test_an_environment_default_takes_the_first_entry_of_a_list_when_told_to():
    assert Env("X", separator=":").read({"X": "/a:/b"}) == "/a"
    assert Env("X", separator=":").read({"X": ":/b"}) is None
    assert Env("X").read({"X": "/a:/b"}) == "/a:/b"
    assert Env("X").read({"X": ""}) is None and Env("X").read({}) is None


# -- adding a key touches only the table ---------------------------------------------------------


def _code_strings_and_names(path: Path) -> tuple[set[str], set[str]]:
    """The string constants (not docstrings) and the identifiers of a module."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    strings = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
    return strings, names


# Before the table, one more key meant about nine edits: spec.py; in cli.py
# the typer option, _flags and the call; in config.py FLAG_NAMES, the schema,
# the resolve pick, check_spec's table and _SPEC_FIELDS; and module.nix. Each
# of those spelled the key, its flag or its parameter out. Now the code that
# applies the configuration spells none of them, so it has nothing to edit for
# a new key: the table entry, the spec attribute its step reads, and the
# module's option when the module types it (test_module.py) are the places.


@pytest.mark.parametrize("module", ["file.py", "schema.py", "resolve.py"])
def test_the_config_names_no_key_flag_or_parameter_of_its_own(module):
    strings, names = _code_strings_and_names(PACKAGE / module)
    for f in FIELDS:
        assert {f.key, f.name, f"join.{f.key}", f.flag} & strings == set(), f.key
        assert f.param not in names, f.key


def test_the_cli_declares_no_option_for_a_field_of_its_own():
    # Its messages and summary may still say "--cpu-only" or "libtorch" in passing.
    strings, names = _code_strings_and_names(PACKAGE.parent / "cli" / "app.py")
    for f in FIELDS:
        assert f.flag not in strings and f"{f.flag}/--no-{f.flag[2:]}" not in strings, f.flag
        assert f.param not in names, f.param


@dataclass(frozen=True)
class WithStageTimeout(PrepareSpec):
    stage_timeout_s: float | None = None


STAGE_TIMEOUT = Field(
    "stage_timeout",
    "--stage-timeout",
    "stage_timeout_s",
    SECONDS,
    metavar="SECONDS",
    help="Give up proving the stage writable after this long.",
)
WIDER = Table((*FIELDS, STAGE_TIMEOUT), spec_type=WithStageTimeout)


def test_a_new_field_is_read_from_the_file_with_its_origin(tmp_path):
    path = tmp_path / "prepare.toml"
    path.write_text("[join]\nstage_timeout = 5\n")
    spec = config.resolve(config.load(path, table=WIDER), {}, {}, table=WIDER)
    assert isinstance(spec, WithStageTimeout) and spec.stage_timeout_s == 5.0
    assert str(spec.origin("stage_timeout_s")) == "join.stage_timeout in the config"


def test_a_new_fields_flag_beats_the_file():
    spec = config.resolve({"stage_timeout": 5}, {"stage_timeout": 7.5}, {}, table=WIDER)
    assert isinstance(spec, WithStageTimeout) and spec.stage_timeout_s == 7.5
    assert str(spec.origin("stage_timeout_s")) == "--stage-timeout"


def test_a_new_field_is_checked_hinted_and_suggested_like_the_others(tmp_path):
    path = tmp_path / "prepare.toml"
    path.write_text('[join]\nstage_timeout = "30"\nstage_timout = 1\n')
    with pytest.raises(Fail) as caught:
        config.load(path, table=WIDER)
    message = caught.value.message
    assert 'join.stage_timeout (line 2) = "30": expected a number' in message
    assert "write it without quotes: stage_timeout = 30" in message
    assert "unknown key join.stage_timout (line 3); did you mean join.stage_timeout?" in message
    # The table it was not added to does not know it.
    with pytest.raises(Fail, match="unknown key join.stage_timeout"):
        config.load(tmp_path.joinpath("prepare.toml"))


def test_a_new_field_set_in_code_is_checked_by_the_plan():
    with pytest.raises(Fail) as caught:
        plan(WithStageTimeout(stage_timeout_s=-1), table=WIDER)
    assert "PrepareSpec.stage_timeout_s = -1: expected a finite number of seconds" in caught.value.message


def test_a_new_field_is_an_option_of_the_command(tmp_path, monkeypatch, capsys):
    (tmp_path / "prepare.toml").write_text("[join]\n")
    monkeypatch.setenv("FDL_PREPARE_CONFIG", str(tmp_path / "prepare.toml"))
    assert app.run(["--help"], table=WIDER) == 0
    assert "--stage-timeout SECONDS" in capsys.readouterr().out
    assert app.run(["--help"]) == 0
    assert "--stage-timeout" not in capsys.readouterr().out
    # Given on the command line, it reaches resolve as a flag and is named as one.
    assert app.run(["--stage-timeout", "0", "--json"], table=WIDER) == 78
    assert "--stage-timeout (join.stage_timeout) = 0.0" in capsys.readouterr().out


# A value for each kind as typed on the command line, and as it reaches resolve.
FLAG_SAMPLES = {
    "string": (["x"], "x"),
    "libtorch variant": (["12.8"], "12.8"),
    "url": (["path:/x"], "path:/x"),
    "identity file": (["/etc/fdl/id_ed25519"], "/etc/fdl/id_ed25519"),
    "absolute path": (["/var/lib/x"], "/var/lib/x"),
    "ssh host": (["ctrl.example"], "ctrl.example"),
    "ssh user": (["worker"], "worker"),
    "user": (["fdl-smoke"], "fdl-smoke"),
    "boolean": ([], True),
    "port": (["2222"], 2222),
    "seconds": (["2.5"], 2.5),
    "count": (["8"], 8),
    "devices": (["0, 2"], [0, 2]),
    "strings": (["A=1"], ["A=1"]),
    "arguments": (["--smoke"], ["--smoke"]),
    "store URLs": (["http://127.0.0.1:8080"], ["http://127.0.0.1:8080"]),
    "public keys": (
        ["cache-1:nTCg+w7fzWq/2GnSQsukdCOyvv3lZ8Sr6Hu7I5UqB7E="],
        ["cache-1:nTCg+w7fzWq/2GnSQsukdCOyvv3lZ8Sr6Hu7I5UqB7E="],
    ),
}


@pytest.mark.parametrize("f", FIELDS, ids=[f.key for f in FIELDS])
def test_every_fields_flag_reaches_resolve_under_its_key(f):
    text, value = FLAG_SAMPLES[f.kind.name]
    given, extra = app.parser().parse_known_args([f.flag, *text])
    assert extra == [] and given.command is None
    assert app.flags(TABLE, given) == nest({f.key: value})


def test_flodls_keys_are_its_own_or_ours_with_its_names():
    from prepare.config.fields import FOREIGN_BY_KEY, SHARED_WITH_FLODL

    # A key fdl join alone acts on is none of ours, and a key both read is one.
    assert not set(FOREIGN_BY_KEY) & set(TABLE.by_key)
    assert set(TABLE.by_key) >= SHARED_WITH_FLODL
    # floDl's join block (flodl-cli's WorkerJoin, SshConfig, WorkerSource), whole.
    assert set(FOREIGN_BY_KEY) | SHARED_WITH_FLODL == {
        "controller", "ssh.target", "ssh.port", "ssh.user", "ssh.identity_file", "ssh.options", "token", "bin",
        "source.from", "source.cwd", "source.build", "source.bin", "libtorch", "host", "devices", "persist",
        "data_path", "data_source", "gpu_ram_share", "sig_probe", "args",
    }  # fmt: skip
