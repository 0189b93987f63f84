"""The configuration's one field table: every [join] key, its flag, where it
lands on a PrepareSpec, how its value is checked, its default, its
environment fallback, its help text, and the type the NixOS module gives it.

Everything else derives from `TABLE`: the CLI's options (`prepare.cli`), the
TOML schema, the precedence in `resolve`, the checks a spec built in code
gets (`check_spec`), the unknown-key suggestions (`prepare.config`), and
the NixOS module's `settings.join` options (`prepare.fields_json` exports the
table to nix/fields.json, which nix/module.nix reads). Adding a key is one
`Field` here, one attribute on the spec for the step that reads it, and
`python -m prepare.fields_json > nix/fields.json` (a test says so when the
committed file is stale).

Rules that involve more than one field (`RULES`) live here too, and run the
same way on a resolved config and on a spec a join loop built itself, so
neither path can refuse what the other lets through.

This module is imported on every start of the CLI, to build its options:
it must stay as cheap as the CLI's own imports.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time
from typing import Any

from prepare.fail import permanent
from prepare.redact import credentials, redact
from prepare.spec import PrepareSpec

FLAKE_ENV = "FDL_PREPARE_FLAKE"
STATE_ENV = "STATE_DIRECTORY"

# A problem with one value, or None when it is fine.
Checker = Callable[[Any], "str | None"]

# ed25519, as Nix's signing keys are: the public half, and the secret key
# (seed and public half) that must never reach a config or a message.
_PUBLIC_KEY_BYTES = 32
_SECRET_KEY_BYTES = 64


# -- describing values, for messages ----------------------------------------------------------


def kind_of(value: Any) -> str:
    """What a value is, in TOML's words."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, (datetime, date, time)):
        return "a date/time"
    return type(value).__name__


def show(value: Any) -> str:
    """A value as it would be written in TOML, so the operator recognises it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    return repr(value)


# -- checkers ---------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Every string of the config ends up as a path, a URL or an argument, and
# none of those can hold a NUL (the kernel's strings end at it).
_NUL = "contains a NUL character (\\u0000), which no path, URL or command line can hold: remove it"

# The longest values taken, well under what the kernel takes on a command
# line (MAX_ARG_STRLEN, 128 KiB an argument; ARG_MAX, at least 128 KiB for
# all of them and the environment): a value past these is refused by name
# here, not by execve as E2BIG (which would read as a program missing). A
# run manifest's arguments are held to the same (prepare.manifest).
MAX_URL_BYTES = 4 << 10
MAX_STRING_BYTES = 16 << 10
MAX_LIST_BYTES = 64 << 10
LIMITS = "4 KiB a URL, 16 KiB any other value, 64 KiB a list in all"


def too_long(value: str, limit: int, what: str = "value") -> str | None:
    """A problem when `value` is longer than `limit` bytes (UTF-8)."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size <= limit:
        return None
    return (
        f"is {size} bytes long, past the {limit // 1024} KiB a {what} may be (fdl-prepare's limits: {LIMITS}, well "
        "under what the kernel takes on a command line): shorten it"
    )


def _string(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"expected a string, got {kind_of(value)}"
    if not value.strip():
        return "expected a non-empty string; leave it out to keep it unset"
    if "\0" in value:
        return _NUL
    return too_long(value, MAX_STRING_BYTES)


def _url(value: Any) -> str | None:
    if isinstance(value, str) and "\0" not in value:
        long = too_long(value, MAX_URL_BYTES, "URL")
        if long:
            return long
    return _string(value)


def _boolean(value: Any) -> str | None:
    if isinstance(value, bool):
        return None
    return f"expected true or false (unquoted), got {kind_of(value)}"


def _port(value: Any) -> str | None:
    if not _is_int(value):
        return f"expected an integer port from 1 to 65535, got {kind_of(value)}"
    if not 1 <= value <= 65535:
        return "expected a port from 1 to 65535"
    return None


def _count(value: Any) -> str | None:
    if not _is_int(value):
        return f"expected a whole number from 1 up, got {kind_of(value)}"
    if value < 1:
        return "expected a number of GPUs from 1 up; leave it out to expect none in particular"
    return None


def _seconds(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a number of seconds greater than 0, got {kind_of(value)}"
    if not math.isfinite(value) or value <= 0:
        return "expected a finite number of seconds greater than 0"
    return None


def _seconds_within(low: float, high: float, what: str) -> Checker:
    """A bound in seconds that a timer can hold and that leaves the work
    time to happen: far below `low`, every attempt times out, transient for
    ever; past `high`, a wedged call holds the box for good (and a timer
    past what the OS can wait crashes its thread)."""

    def check(value: Any) -> str | None:
        problem = _seconds(value)
        if problem is not None:
            return problem
        if not low <= value <= high:
            return f"expected {low:g} to {high:g} seconds ({what}), got {value:g}"
        return None

    return check


# Absolute, and nothing a shell would have expanded: `~` is taken literally
# by everything below the shell, and a relative path resolves against the
# working directory, `/` under systemd.
def _absolute_path(value: Any) -> str | None:
    problem = _string(value)
    if problem is not None:
        return problem
    if value.startswith("~"):
        return (
            "starts with '~', which only a shell expands (here it would be a directory named '~'): write the "
            "absolute path, e.g. /var/lib/fdl-prepare"
        )
    if not value.startswith("/"):
        return (
            "is a relative path, which would resolve against the working directory (`/` under systemd): write "
            "the absolute path, e.g. /var/lib/fdl-prepare"
        )
    return None


def _ssh_target(value: Any) -> str | None:
    problem = _string(value)
    if problem is not None:
        return problem
    if value.strip().startswith("-"):
        return "starts with '-', which ssh would read as an option: write the host name"
    if any(c.isspace() or not c.isprintable() for c in value.strip()):
        return "has whitespace or a control character, which no host name has"
    return None


def _ssh_user(value: Any) -> str | None:
    problem = _ssh_target(value)
    return problem.replace("host name", "user name") if problem else None


def _devices(value: Any) -> str | None:
    if not isinstance(value, (list, tuple)):
        return f"expected an array of device indices such as [0, 1], got {kind_of(value)}"
    if not value:
        return (
            "an empty list offers no device at all; leave it out to offer every visible device, "
            "or set cpu_only for a box without one"
        )
    # One pass with a set: a list of 100,000 entries (a generated config)
    # is checked in milliseconds, not the minutes a pairwise search takes.
    seen: set[int] = set()
    for item in value:
        if not _is_int(item):
            return f"expected device indices (integers from 0), but {_show_short(item)} is {kind_of(item)}"
        if item < 0:
            return f"expected device indices from 0 up, got {item}"
        if item in seen:
            return f"device {item} is listed twice"
        seen.add(item)
    return None


def _show_short(value: Any) -> str:
    return cut(show(value))


def cut(text: str, limit: int = 200) -> str:
    """A value as a message quotes it: its start, when it is long."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _strings(value: Any, example: str = '["ServerAliveInterval=15"]') -> str | None:
    if not isinstance(value, (list, tuple)):
        return f"expected an array of strings such as {example}, got {kind_of(value)}"
    total = 0
    for index, item in enumerate(value):
        if not isinstance(item, str):
            return f"expected an array of strings, but {_show_short(item)} is {kind_of(item)}"
        if not item.strip():
            return "expected non-empty strings, got an empty one"
        if "\0" in item:
            return f"{_show_short(item)} {_NUL}"
        long = too_long(item, MAX_STRING_BYTES, "list item")
        if long:
            return f"item {index} {long}"
        total += len(item.encode("utf-8", "surrogatepass")) + 1
    if total > MAX_LIST_BYTES:
        return f"holds {total} bytes in all, past the {MAX_LIST_BYTES // 1024} KiB a list may (limits: {LIMITS})"
    return None


# A store URL as Nix takes one for `substituters`: `scheme://...`, or an
# absolute path (a local store directory).
_STORE_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+|/\S*")


def store_urls(value: Any) -> str | None:
    if not isinstance(value, (list, tuple)):
        return f'expected an array of store URLs such as ["https://cache.example.org"], got {kind_of(value)}'
    for item in value:
        if not isinstance(item, str):
            return f"expected an array of store URLs, but {show(item)} is {kind_of(item)}"
        long = too_long(item, MAX_URL_BYTES, "URL")
        if long:
            return f"{cut(redact(show(item)))} {long}"
        found = credentials(item)
        if found is not None:
            return (
                f"{redact(show(item))} carries {found} in the URL (hidden here), which would sit on every nix "
                "command line (`ps` shows it to every user): remove it, treat it as leaked, and give Nix the "
                "credential in a netrc file (`netrc-file = /etc/nix/netrc` in nix.conf, mode 0600)"
            )
        from prepare.caches import weakens_signatures

        weak = weakens_signatures(item)
        if weak is not None:
            return (
                f"{redact(show(item))} sets {weak}, which makes Nix take paths from that store without a signature "
                "from a trusted key: anything the store (or whoever reaches it) serves would be run as root. Remove "
                "it: `fdl-prepare publish` signs what it pushes, and boxes trust its public key "
                "(nix.trusted_public_keys, --trusted-public-key)"
            )
        # Nix splits the setting on whitespace: one URL with a space would
        # reach it as two, neither of them the cache meant.
        if not _STORE_URL.fullmatch(item.strip()) or "\0" in item:
            return (
                f"{show(item)} is not a store URL: write one URL per item, with its scheme and no spaces "
                "(https://host/path, s3://bucket, ssh-ng://user@host, file:///abs/dir)"
            )
    return None


def _public_key(item: str) -> tuple[str, int | None]:
    """A `name:base64` key's name and decoded length (None: not base64)."""
    name, _, data = item.strip().partition(":")
    try:
        return name, len(base64.b64decode(data, validate=True))
    except (ValueError, binascii.Error):
        return name, None


def _public_keys(value: Any) -> str | None:
    if not isinstance(value, (list, tuple)):
        return f'expected an array of keys such as ["cache.example.org-1:<base64>"], got {kind_of(value)}'
    for item in value:
        if not isinstance(item, str):
            return f"expected an array of public keys, but {show(item)} is {kind_of(item)}"
        name, size = _public_key(item)
        if size == _SECRET_KEY_BYTES:
            # Said without the value: this is the signing key itself.
            return (
                f"the key named {name!r} is a SECRET signing key, not a public one: remove it from the config, "
                "treat it as leaked (make a new key pair and publish again), and list the public half here "
                "(`nix key convert-secret-to-public < SECRET_FILE`)"
            )
        if not name or any(c.isspace() or c == "\0" for c in item.strip()) or size != _PUBLIC_KEY_BYTES:
            return (
                f"{show(item)} is not a public key: expected name:base64 of an ed25519 key, as "
                "`nix key convert-secret-to-public < SECRET_FILE` prints it"
            )
    return None


# What a private key's text holds and no path does: a PEM or OpenSSH
# armour line, or the base64 of OpenSSH's "openssh-key-v1" magic.
_KEY_MATERIAL = re.compile(r"-----BEGIN|PRIVATE KEY|b3BlbnNzaC1rZXktdjE|\n")


def looks_like_key(value: Any) -> bool:
    """Whether a value meant as a key's path is the key itself, pasted in."""
    return isinstance(value, str) and (len(value) > 4096 or bool(_KEY_MATERIAL.search(value)))


def _identity_file(value: Any) -> str | None:
    if looks_like_key(value):
        # Said without the value: it is a secret, and messages land in journals.
        return (
            "holds what looks like a private key itself, not the path of a key file: put the key in a file "
            "only root can read (e.g. /etc/fdl/id_ed25519, mode 0600) and its path here; the key has been in "
            "the config (and anything that copied it), so treat it as leaked and make a new one"
        )
    return _string(value)


def _show_identity(value: Any) -> str:
    return "<private key material, not shown>" if looks_like_key(value) else show(value)


def _show_keys(value: Any) -> str:
    """A key list for a message, with any secret key left out."""
    if isinstance(value, (list, tuple)):
        shown = [
            f"<secret key {_public_key(v)[0]!r}, not shown>"
            if isinstance(v, str) and _public_key(v)[1] == _SECRET_KEY_BYTES
            else show(v)
            for v in value
        ]
        return "[" + ", ".join(shown) + "]"
    return show(value)


def parse_devices(text: str, field: str = "--devices") -> list[int]:
    """`0,1` -> [0, 1], for a flag or an environment variable. Bad input is a
    permanent Fail naming `field`."""
    parts = [p.strip() for p in text.split(",")]
    # isascii: str.isdigit() also admits digits such as '²' that int() refuses.
    if not text.strip() or any(not (p.isascii() and p.isdigit()) for p in parts):
        raise permanent(
            f"{field} {show(text)}: expected comma-separated device indices such as {field} 0,1 "
            f"(omit it to offer every visible device)",
            reason="config.invalid",
        )
    return [int(p) for p in parts]


def _same(value: Any) -> Any:
    return value


def _stripped(value: Any) -> Any:
    return value.strip()


# -- kinds of value -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """One sort of value: how it is checked, written in TOML, given on the
    command line, and stored on the spec."""

    name: str
    check: Checker
    # What the flag's text is parsed into by the CLI; `list` is a repeatable flag.
    flag_type: type
    # How to write a value of this kind in TOML, for the "write it as" hint;
    # None where quoting is the hint.
    example: str | None = None
    # A flag whose text needs more reading than flag_type gives (`--devices 0,1`).
    read_flag: Callable[[str, str], Any] | None = None
    # Into the type the spec declares, in its normal form. Both the config and
    # check_spec apply it, so a value reaches the steps the same either way.
    to_spec: Callable[[Any], Any] = _same
    # How a bad value is quoted in a message (a key list hides a secret key).
    show: Callable[[Any], str] = show


STRING = Kind("string", _string, str, show=lambda v: _show_short(v))
# A URL handed to Nix: surrounding spaces (easy to leave in a hand-edited file
# or a join loop's string) would reach `nix flake prefetch` as part of it.
URL = Kind("url", _url, str, to_spec=_stripped, show=lambda v: cut(redact(show(v))))
BOOLEAN = Kind("boolean", _boolean, bool, example="true", to_spec=bool)
PORT = Kind("port", _port, int, example="22")
SECONDS = Kind("seconds", _seconds, float, example="30", to_spec=float)
COUNT = Kind("count", _count, int, example="8")
# A listing answers in milliseconds; past an hour a mount is dead.
LIST_SECONDS = Kind(
    "seconds", _seconds_within(0.1, 3600, "a tenth of a second to an hour"), float, example="30", to_spec=float
)
# A cold build of libtorch and a training binary takes hours, not months.
BUILD_SECONDS = Kind(
    "seconds", _seconds_within(1, 30 * 86400, "a second to 30 days"), float, example="3600", to_spec=float
)
# Loading libtorch and waking a GPU takes seconds: under one, every attempt
# would time out, transient for ever; past a day, a wedged run holds the box.
SMOKE_SECONDS = Kind("seconds", _seconds_within(1, 86400, "a second to a day"), float, example="60", to_spec=float)
ABSOLUTE_PATH = Kind("absolute path", _absolute_path, str)
SSH_HOST = Kind("ssh host", _ssh_target, str)
SSH_USER = Kind("ssh user", _ssh_user, str)


def _smoke_user(value: Any) -> str | None:
    problem = _ssh_target(value)
    return problem.replace("host name", "user name") if problem else None


SMOKE_USER = Kind("user", _smoke_user, str)
DEVICES = Kind(
    "devices", _devices, str, example="[0, 1]", read_flag=parse_devices, to_spec=tuple, show=lambda v: _show_short(v)
)
STRINGS = Kind(
    "strings", _strings, list, example='["ServerAliveInterval=15"]', to_spec=tuple, show=lambda v: _show_short(v)
)


def _arguments(value: Any) -> str | None:
    return _strings(value, '["--smoke"]')


# A program's arguments: strings, as a list; an empty list is a choice (none).
ARGUMENTS = Kind("arguments", _arguments, list, example='["--smoke"]', to_spec=tuple, show=lambda v: _show_short(v))


def _stripped_all(value: Any) -> Any:
    return tuple(v.strip() for v in value)


IDENTITY = Kind("identity file", _identity_file, str, show=_show_identity)
STORE_URLS = Kind(
    "store URLs",
    store_urls,
    list,
    example='["https://cache.example.org"]',
    to_spec=_stripped_all,
    show=lambda v: cut(redact(show(v))),
)
PUBLIC_KEYS = Kind(
    "public keys",
    _public_keys,
    list,
    example='["cache.example.org-1:<base64>"]',
    to_spec=_stripped_all,
    show=_show_keys,
)


# -- fields --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Env:
    """An environment variable that gives a field its default when neither a
    flag nor the file sets it."""

    name: str
    # Said after the variable in messages, where its name alone would not say who set it.
    note: str | None = None
    # A variable holding a list whose first entry is the value.
    separator: str | None = None

    def read(self, env: Mapping[str, str]) -> str | None:
        """The value, None when unset or empty."""
        value = env.get(self.name)
        if value and self.separator is not None:
            value = value.split(self.separator, 1)[0]
        return value or None


@dataclass(frozen=True)
class Field:
    # Dotted below [join]: "ssh.port" is `port` in [join.ssh].
    key: str
    flag: str
    # The attribute path on PrepareSpec: "ssh.port", "data.data_path".
    spec: str
    kind: Kind
    help: str
    metavar: str | None = None
    # The spec's own default, which resolve gives when nothing else does.
    default: Any = None
    env: Env | None = None
    # The type nix/module.nix gives settings.join.<key>, as a `lib.types`
    # expression (exported to nix/fields.json, which the module reads); None
    # where the module decides the key itself (it declares `flake`, and
    # refuses the others in settings, saying what decides them).
    nix: str | None = None

    @property
    def table(self) -> str:
        """The sub-table of [join] the key is in, "" for [join] itself."""
        return self.key.rpartition(".")[0]

    @property
    def name(self) -> str:
        """The key inside its table."""
        return self.key.rpartition(".")[2]

    @property
    def param(self) -> str:
        """The key as a Python identifier, for the CLI's parameters."""
        return self.key.replace(".", "_")


FIELDS: tuple[Field, ...] = (
    Field(
        key="data_path",
        flag="--data-path",
        spec="data.data_path",
        kind=STRING,
        metavar="PATH",
        nix="nullOr str",
        help="Dataset root (or where to mount data_source; default /flodl/data).",
    ),
    Field(
        key="data_source",
        flag="--data-source",
        spec="data.data_source",
        kind=URL,
        metavar="URL",
        nix="nullOr str",
        help="sshfs://[user@]host[:port]/abs/path, mounted read-only at --data-path.",
    ),
    Field(
        key="libtorch",
        flag="--libtorch",
        spec="libtorch",
        kind=STRING,
        metavar="VARIANT",
        nix="nullOr str",
        help="libtorch variant: auto, cpu, cu128, ... (whatever the flake provides).",
    ),
    Field(
        key="devices",
        flag="--devices",
        spec="devices",
        kind=DEVICES,
        metavar="LIST",
        nix="nullOr (listOf ints.unsigned)",
        help="GPU indices this box offers, e.g. 0,1, in the vendor's own numbering (NVML's, or ROCm's), after the runtime's masks (CUDA_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES).",
    ),
    Field(
        key="expect_gpus",
        flag="--expect-gpus",
        spec="expect_gpus",
        kind=COUNT,
        metavar="N",
        nix="nullOr ints.positive",
        help="Healthy GPUs this box must offer (after the masks); fewer is permanent, naming the missing or sick ones.",
    ),
    Field(
        key="cpu_only",
        flag="--cpu-only",
        spec="cpu_only",
        kind=BOOLEAN,
        default=False,
        nix="bool",
        help="Skip the GPU gate (CPU-only workers, demos); only the cpu libtorch is allowed.",
    ),
    # Not in the module's settings: on NixOS the system keeps the driver directory (the module says so).
    Field(
        key="driver_dir",
        flag="--driver-dir",
        spec="driver_dir",
        kind=STRING,
        metavar="DIR",
        default="/run/opengl-driver/lib",
        help="Where links to the host's NVIDIA libraries are kept for Nix-built programs on a box that is not NixOS. "
        "Default: /run/opengl-driver/lib (nixpkgs' addDriverRunpath).",
    ),
    # The module declares settings.join.flake itself, defaulting to its own `flake` option.
    Field(
        key="flake",
        flag="--flake",
        spec="flake",
        kind=URL,
        metavar="URL",
        env=Env(FLAKE_ENV),
        help="Flake providing libtorch variants and the training build. Default: $FDL_PREPARE_FLAKE.",
    ),
    # Under the module, systemd's StateDirectory= decides it (the module says so).
    Field(
        key="state_dir",
        flag="--state-dir",
        spec="state_dir",
        kind=ABSOLUTE_PATH,
        metavar="DIR",
        # systemd joins several StateDirectory= entries with ':'; the first is the unit's own.
        env=Env(STATE_ENV, note="systemd's StateDirectory=", separator=":"),
        help="Where GC roots of built outputs live. Default: $STATE_DIRECTORY (systemd), else a per-user directory.",
    ),
    Field(
        key="list_timeout",
        flag="--list-timeout",
        spec="list_timeout_s",
        kind=LIST_SECONDS,
        metavar="SECONDS",
        default=10.0,
        nix="nullOr (numbers.between 0.1 3600)",
        help="Give up listing the dataset root after this long (dead mount). Default: 10.",
    ),
    Field(
        key="build_timeout",
        flag="--build-timeout",
        spec="build_timeout_s",
        kind=BUILD_SECONDS,
        metavar="SECONDS",
        nix="nullOr (numbers.between 1 2592000)",
        help="Abandon a build running longer than this (transient).",
    ),
    Field(
        key="smoke_timeout",
        flag="--smoke-timeout",
        spec="smoke_timeout_s",
        kind=SMOKE_SECONDS,
        metavar="SECONDS",
        default=60.0,
        nix="nullOr (numbers.between 1 86400)",
        help="Stop the smoke run of the built binary after this long (transient). Default: 60.",
    ),
    Field(
        key="smoke_user",
        flag="--smoke-user",
        spec="smoke_user",
        kind=SMOKE_USER,
        metavar="USER",
        default="nobody",
        nix="nullOr str",
        help="The unprivileged user the smoke run runs as when fdl-prepare is root (never root itself); it gets "
        "only the render and video groups for the GPUs, no capabilities and a clean environment. Default: nobody.",
    ),
    Field(
        key="refresh",
        flag="--refresh",
        spec="refresh",
        kind=BOOLEAN,
        default=False,
        nix="nullOr bool",
        help="Evaluate and build as if nothing were known from earlier attempts (the warm-path record is ignored).",
    ),
    Field(
        key="source.from",
        flag="--source",
        spec="source.from_",
        kind=URL,
        metavar="URL",
        nix="nullOr str",
        help="Training source as a flake URL (git+https://...?ref=..., path:...).",
    ),
    Field(
        key="source.cwd",
        flag="--source-cwd",
        spec="source.cwd",
        kind=STRING,
        metavar="DIR",
        nix="nullOr str",
        help="Directory inside the source the build and run use.",
    ),
    Field(
        key="source.build",
        flag="--source-build",
        spec="source.build",
        kind=STRING,
        metavar="CMD",
        nix="nullOr str",
        help="Build line for the source.",
    ),
    Field(
        key="source.bin",
        flag="--source-bin",
        spec="source.bin",
        kind=STRING,
        metavar="NAME",
        nix="nullOr str",
        help="The training binary the build installs.",
    ),
    Field(
        key="source.smoke",
        flag="--smoke",
        spec="source.smoke",
        kind=ARGUMENTS,
        metavar="ARG",
        nix="nullOr (listOf str)",
        help="Argument of one run of the built binary before the box counts as prepared, repeatable (a run "
        "manifest's smoke outranks them).",
    ),
    Field(
        key="ssh.target",
        flag="--ssh-target",
        spec="ssh.target",
        kind=SSH_HOST,
        metavar="HOST",
        nix="nullOr str",
        help="ssh host of the controller tunnel (the join loop dials it); a data_source on this host takes "
        "--ssh-user and --ssh-port as its defaults.",
    ),
    Field(
        key="ssh.port",
        flag="--ssh-port",
        spec="ssh.port",
        kind=PORT,
        metavar="PORT",
        nix="nullOr (ints.between 1 65535)",
        help="ssh port on --ssh-target; the port of a data_source on that host that names none.",
    ),
    Field(
        key="ssh.user",
        flag="--ssh-user",
        spec="ssh.user",
        kind=SSH_USER,
        metavar="USER",
        nix="nullOr str",
        help="ssh user on --ssh-target; the user of a data_source on that host that names none.",
    ),
    Field(
        key="ssh.identity_file",
        flag="--identity-file",
        spec="ssh.identity_file",
        kind=IDENTITY,
        metavar="PATH",
        nix="nullOr str",
        help="ssh identity file (used for the sshfs mount).",
    ),
    Field(
        key="ssh.options",
        flag="--ssh-option",
        spec="ssh.options",
        kind=STRINGS,
        metavar="OPT",
        default=(),
        nix="nullOr (listOf str)",
        help="ssh -o option, repeatable; replaces the file's list. These come first, so they win.",
    ),
    # What a publish pushed (`fdl-prepare publish --to`) is substituted from
    # these instead of built; both are added to nix.conf's own lists.
    Field(
        key="nix.substituters",
        flag="--substituter",
        spec="nix.substituters",
        kind=STORE_URLS,
        metavar="URL",
        default=(),
        nix="nullOr (listOf str)",
        help="Binary cache to substitute builds from (a store URL), repeatable; replaces the file's list.",
    ),
    Field(
        key="nix.trusted_public_keys",
        flag="--trusted-public-key",
        spec="nix.trusted_public_keys",
        kind=PUBLIC_KEYS,
        metavar="KEY",
        default=(),
        nix="nullOr (listOf str)",
        help="Public key (name:base64) cached paths must be signed with, repeatable; replaces the file's list.",
    ),
)


class Table:
    """The fields, and the lookups the config and the CLI derive from them.
    `spec_type` is the class a resolved config becomes."""

    def __init__(self, fields: Sequence[Field], spec_type: type[PrepareSpec] = PrepareSpec) -> None:
        self.fields = tuple(fields)
        self.spec_type = spec_type
        for attr in ("key", "flag", "spec", "param"):
            seen = [getattr(f, attr) for f in self.fields]
            twice = sorted({v for v in seen if seen.count(v) > 1})
            if twice:
                raise ValueError(f"two fields share the {attr} {twice[0]!r}")
        self.by_key = {f.key: f for f in self.fields}
        # [join] first, then its sub-tables, each with its keys in table order.
        self.tables: dict[str, dict[str, Field]] = {"": {}}
        for f in self.fields:
            self.tables.setdefault(f.table, {})[f.name] = f
        self.subtables = [t for t in self.tables if t]
        self.flag_names = {f.key: f.flag for f in self.fields}
        self.envs = {f.env.name: f.env for f in self.fields if f.env is not None}


TABLE = Table(FIELDS)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"ssh.port": 22} -> {"ssh": {"port": 22}}: dotted keys in the [join]
    table's shape, as the file has them."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        table, _, name = key.rpartition(".")
        (out.setdefault(table, {}) if table else out)[name] = value
    return out


def value_at(obj: Any, path: str) -> Any:
    """The value at a dotted attribute path, None where a step of it is None."""
    for part in path.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part, None)
    return obj


# -- rules across fields ---------------------------------------------------------------------------

# Names where a spec value came from ("--cpu-only", "join.libtorch in the
# config", "PrepareSpec.libtorch"), given its spec path.
Where = Callable[[str], str]
Rule = Callable[[PrepareSpec, Where], "str | None"]


def _cpu_only_takes_the_cpu_libtorch(spec: PrepareSpec, where: Where) -> str | None:
    if spec.cpu_only and spec.libtorch is not None and spec.libtorch not in ("cpu", "auto"):
        return (
            f"cpu_only (from {where('cpu_only')}) allows only the cpu libtorch, but libtorch is "
            f'{show(spec.libtorch)} (from {where("libtorch")}): set libtorch to "cpu" or "auto", '
            f"or drop cpu_only on a box with a GPU"
        )
    return None


RULES: tuple[Rule, ...] = (_cpu_only_takes_the_cpu_libtorch,)
