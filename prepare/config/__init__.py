"""The configuration: every [join] key once (`fields`), and the TOML file
and the flags resolved into a PrepareSpec (`file`)."""

from prepare.config.file import (
    CONFIG_ENV,
    DEFAULT_PATH,
    FLAG_NAMES,
    FLAKE_ENV,
    MAX_CONFIG_BYTES,
    STATE_ENV,
    check_spec,
    env_value,
    find_path,
    load,
    parse_devices,
    resolve,
)

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_PATH",
    "FLAG_NAMES",
    "FLAKE_ENV",
    "MAX_CONFIG_BYTES",
    "STATE_ENV",
    "check_spec",
    "env_value",
    "find_path",
    "load",
    "parse_devices",
    "resolve",
]
