"""The configuration: every [join] key once (`fields`) and the kinds of
value they take (`kinds`); the TOML file, read safely (`file`) and checked
against the table (`schema`); and flags, file and environment resolved into
a PrepareSpec (`resolve`)."""

from prepare.config.fields import FLAKE_ENV, STATE_ENV
from prepare.config.file import CONFIG_ENV, DEFAULT_PATH, MAX_CONFIG_BYTES, find_path, load
from prepare.config.kinds import parse_devices
from prepare.config.resolve import checked, from_environment, resolve

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_PATH",
    "FLAKE_ENV",
    "MAX_CONFIG_BYTES",
    "STATE_ENV",
    "checked",
    "from_environment",
    "find_path",
    "load",
    "parse_devices",
    "resolve",
]
