"""Property-based tests (hypothesis): every input to the config loader, the
manifest reader, and the `data_source` and `source.from` grammars ends in a
valid value or a `Fail` that names the field, never another exception.

Each property runs EXAMPLES generated inputs, derandomized (the same
inputs on every run, so the suite stays green or red for a reason) and
without an example database (nothing is written into the checkout). The
strategies mix structured inputs (documents and URLs of the right shape
with hostile values in them: NUL and control characters, a leading '-',
user-info, deep nesting, every TOML type where a string belongs) with
arbitrary text, which is where a parser's edge cases live.
"""

from __future__ import annotations

import os
import string
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prepare import config
from prepare.build import manifest
from prepare.config.fields import TABLE
from prepare.data import url as sshfs_url
from prepare.fail import Fail
from prepare.host.redact import credentials
from prepare.nix import urls
from prepare.plan import Plan, plan
from prepare.spec import DataSpec, NixSpec, PrepareSpec, SourceSpec, SshSpec

# The budget per property.
EXAMPLES = 400

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- building blocks ---------------------------------------------------------------------

HOSTILE = st.sampled_from(["\0", "\n", "\t", "\x07", "-", "--", "-oProxyCommand=x", "~", "..", "/", "@", ":", "%"])
TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
WORDS = st.one_of(TEXT, st.builds(lambda a, b, c: a + b + c, TEXT, HOSTILE, TEXT))

SCALARS = st.one_of(
    WORDS,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)


def _values(depth: int = 3) -> st.SearchStrategy[Any]:
    return st.recursive(
        SCALARS,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(st.text(string.ascii_letters + "_-", min_size=1, max_size=8), inner, max_size=3),
        ),
        max_leaves=8,
    )


def _toml_key(key: str) -> str:
    if key and all(c in string.ascii_letters + string.digits + "_-" for c in key):
        return key
    return _toml_string(key)


def _toml_string(text: str) -> str:
    out = ['"']
    for c in text:
        if c == '"' or c == "\\":
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    out.append('"')
    return "".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise AssertionError(type(value))


def _document(tables: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# Keys the schema has, with a typo now and then, and values of any type.
KEYS = {sub: list(schema) for sub, schema in TABLE.tables.items()}
GOOD = {
    "data_path": st.just("/flodl/data"),
    "data_source": st.just("sshfs://data@storage.example:/srv/data"),
    "libtorch": st.sampled_from(["auto", "cpu", "cu128"]),
    "devices": st.lists(st.integers(min_value=0, max_value=7), max_size=3, unique=True),
    "cpu_only": st.booleans(),
    "flake": st.just("github:example/fleet"),
    "state_dir": st.just("/var/lib/fdl-prepare"),
    "list_timeout": st.floats(min_value=0.1, max_value=3600),
    "gpu_timeout": st.floats(min_value=0.1, max_value=3600),
    "build_timeout": st.integers(min_value=1, max_value=86400),
}


def _table(sub: str) -> st.SearchStrategy[dict[str, Any]]:
    key = st.one_of(st.sampled_from(KEYS[sub]), st.text(string.ascii_lowercase + "_", min_size=1, max_size=10))

    def value_for(k: str) -> st.SearchStrategy[Any]:
        good = GOOD.get(k)
        return st.one_of(good, _values()) if good is not None else _values()

    return st.lists(key, max_size=6, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: value_for(k) for k in keys})
    )


CONFIG_DOCS = st.fixed_dictionaries(
    {"join": _table("")},
    optional={"join.source": _table("source"), "join.ssh": _table("ssh"), "join.nix": _table("nix")},
).map(_document)


def _write(raw: bytes) -> Path:
    folder = tempfile.mkdtemp(prefix="fdl-fuzz-")
    path = Path(folder) / "prepare.toml"
    path.write_bytes(raw)
    return path


def _remove(path: Path) -> None:
    path.unlink()
    os.rmdir(path.parent)


# -- the config loader -------------------------------------------------------------------


def _load_then_resolve(raw: bytes) -> None:
    path = _write(raw)
    try:
        try:
            table = config.load(path)
        except Fail as fail:
            assert fail.permanent
            # The file is named; a problem with a key names the key.
            assert f"config {path}" in fail.message
            return
        try:
            spec = config.resolve(table, {}, {})
        except Fail as fail:
            assert fail.permanent and "join." in fail.message, fail.message
            return
        assert isinstance(spec, PrepareSpec)
        try:
            plan(spec, {})
        except Fail as fail:
            # What is wrong with the spec as a whole (the rules, the URLs,
            # the source's grammar): still the config's, never a traceback.
            assert fail.reason in ("config.invalid", "config.credentials-in-url"), fail.message
    finally:
        _remove(path)


@FUZZ
@given(CONFIG_DOCS)
def test_any_config_document_loads_to_a_spec_or_a_fail_naming_the_key(text: str) -> None:
    _load_then_resolve(text.encode("utf-8"))


@FUZZ
@given(st.one_of(st.binary(max_size=200), TEXT.map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_any_bytes_as_a_config_load_or_fail_naming_the_file(raw: bytes) -> None:
    _load_then_resolve(b"[join]\n" + raw)


# -- the manifest reader -----------------------------------------------------------------

MANIFEST_KEYS = [*manifest.FIELDS, "epochs", "smoke"]


def _yaml(table: dict[str, Any]) -> str:
    """floDl's YAML manifest holding `table`; what YAML cannot represent
    (a lone surrogate) is fuzzed as the text of the mapping instead."""
    import yaml

    try:
        return yaml.safe_dump(table, allow_unicode=True)
    except yaml.YAMLError:
        return repr(table)


MANIFESTS = st.dictionaries(st.sampled_from(MANIFEST_KEYS), _values(), max_size=6).map(_yaml)


@FUZZ
@given(st.one_of(MANIFESTS, TEXT))
def test_any_manifest_parses_or_fails_transient_naming_the_manifest(text: str) -> None:
    try:
        got = manifest.parse(text)
    except Fail as fail:
        assert not fail.permanent  # the next publish fixes a manifest
        assert manifest.FILENAME in fail.message
        return
    # What it keeps is what the steps can use: strings without NUL, a list of strings.
    for key in ("bin", "cwd", "build", "run", "origin"):
        value = getattr(got, key)
        assert value is None or (isinstance(value, str) and "\0" not in value)
    assert all(isinstance(a, str) and "\0" not in a for a in got.args)
    assert got.unknown_count >= len(got.unknown) and len(got.unknown) <= manifest.NOTED_UNKNOWN


@FUZZ
@given(st.one_of(MANIFESTS, TEXT), st.sampled_from(["train", "t\0", "../x", "/abs", "."]))
def test_a_manifest_merged_over_a_box_recipe_is_a_recipe_or_a_fail(text: str, box_bin: str) -> None:
    from prepare.spec import SourceSpec

    url = "git+https://git.example/train.git?ref=main"
    try:
        recipe = manifest.merge(SourceSpec(from_=url, bin=box_bin), manifest.parse(text), url)
    except Fail as fail:
        assert "bin" in fail.message or "cwd" in fail.message or manifest.FILENAME in fail.message
        return
    assert not recipe.bin.startswith(("/", "../")) and recipe.bin not in (".", "..")


# -- the data_source grammar -------------------------------------------------------------

SSHFS_URLS = st.builds(
    lambda user, host, port, path: f"sshfs://{user}{host}{port}{path}",
    st.one_of(st.just(""), WORDS.map(lambda u: u + "@")),
    st.one_of(st.sampled_from(["data.example", "[::1]", "10.0.0.5", "-oX", ""]), WORDS),
    st.one_of(st.just(""), st.integers(-5, 70000).map(lambda p: f":{p}"), WORDS.map(lambda p: ":" + p)),
    st.one_of(st.sampled_from(["/srv/data", "/", "//", "/./", ":/srv", ""]), WORDS),
)


@FUZZ
@given(st.one_of(SSHFS_URLS, TEXT))
def test_any_data_source_parses_to_a_safe_source_or_a_permanent_fail_naming_data_source(value: str) -> None:
    try:
        source = sshfs_url.parse_source(value)
    except Fail as fail:
        assert fail.permanent and "data_source" in fail.message
        return
    assert source.host and not source.host.startswith("-")
    assert not any(c.isspace() or not c.isprintable() for c in source.host)
    assert source.user is None or (source.user and not source.user.startswith("-") and ":" not in source.user)
    assert source.port is None or 1 <= source.port <= 65535
    assert source.path.startswith("/") and source.path != "/"
    # What reaches sshfs: options, then `--`, then the source and the mountpoint.
    argv = sshfs_url.sshfs_argv(source, "/flodl/data")
    assert argv[-3:] == ["--", source.remote, "/flodl/data"]


# -- the source.from grammar -------------------------------------------------------------

FLAKE_URLS = st.builds(
    lambda scheme, userinfo, rest, query: f"{scheme}{userinfo}{rest}{query}",
    st.sampled_from(["git+https://", "git+ssh://", "git+file://", "path:", "github:", "https://", "flake:", "", "-"]),
    st.one_of(st.just(""), WORDS.map(lambda u: u + "@"), st.just("user:tok@")),
    st.one_of(st.sampled_from(["git.example/train.git", "/srv/train", "/", "owner/repo", "rel/dir"]), WORDS),
    st.sampled_from(["", "?ref=main", "?rev=0123abc", "#frag", "?dir=x"]),
)


@FUZZ
@given(st.one_of(FLAKE_URLS, TEXT))
def test_any_source_from_is_a_pinned_safe_url_or_a_permanent_fail_naming_source_from(value: str) -> None:
    try:
        url = urls.check_source_url(value)
    except Fail as fail:
        assert fail.permanent and "source.from" in fail.message
        # A credential in the value's user-info is never quoted back.
        assert credentials(value) is None or "tok@" not in fail.message
        return
    assert url == url.strip() and not any(c.isspace() for c in url)
    assert not url.startswith(("-", "/", "."))
    assert credentials(url) is None and "\0" not in url


@FUZZ
@given(st.one_of(FLAKE_URLS, TEXT))
def test_any_flake_is_a_safe_url_or_a_permanent_fail_naming_flake(value: str) -> None:
    try:
        url = urls.check_flake_url(value)
    except Fail as fail:
        assert fail.permanent and "flake" in fail.message
        assert credentials(value) is None or "tok@" not in fail.message
        return
    assert not url.startswith("-") and "#" not in url and not any(c.isspace() for c in url)
    assert credentials(url) is None


# -- a spec built in code ----------------------------------------------------------------

ANY = st.one_of(st.none(), _values())
SPECS = st.builds(
    PrepareSpec,
    data=st.one_of(st.builds(DataSpec, data_path=ANY, data_source=ANY), ANY),
    ssh=st.one_of(
        st.builds(SshSpec, target=ANY, port=ANY, user=ANY, identity_file=ANY, options=st.one_of(ANY, st.tuples())),
        ANY,
    ),
    source=st.one_of(st.none(), st.builds(SourceSpec, from_=ANY, cwd=ANY, build=ANY, bin=ANY), ANY),
    nix=st.one_of(st.builds(NixSpec, substituters=ANY, trusted_public_keys=ANY), ANY),
    libtorch=ANY,
    devices=ANY,
    cpu_only=st.one_of(st.booleans(), ANY),
    flake=ANY,
    state_dir=ANY,
    list_timeout_s=st.one_of(st.floats(0.1, 3600), ANY),
    gpu_timeout_s=st.one_of(st.floats(0.1, 3600), ANY),
    build_timeout_s=ANY,
    refresh=st.one_of(st.booleans(), ANY),
)


@FUZZ
@given(SPECS)
def test_any_spec_built_in_code_is_checked_into_a_spec_or_a_fail_naming_a_spec_field(spec: PrepareSpec) -> None:
    try:
        checked = config.checked(spec)
    except Fail as fail:
        assert fail.permanent and "PrepareSpec" in fail.message, fail.message
        return
    assert isinstance(checked, PrepareSpec)


@FUZZ
@given(SPECS)
def test_any_spec_built_in_code_is_planned_or_refused_as_config_never_a_traceback(spec: PrepareSpec) -> None:
    try:
        made = plan(spec, {})
    except Fail as fail:
        assert fail.reason in ("config.invalid", "config.credentials-in-url"), fail.message
        return
    assert isinstance(made, Plan) and (made.build is None) == (not spec.wants_build)
