"""The kinds of value a config key takes: how each is checked, quoted in a
message, given on the command line and stored on the spec.

A checker returns the problem with a value, or None; it never raises, so
the file loader can gather every problem of a file (with its line) and a
flag or a spec from code can name its own field. The bounds here (lengths,
ranges) hold for a value from any of them, and a run manifest's arguments
are held to the same (prepare.build.manifest).

Imported on every start of the CLI, through the field table: it must stay
as cheap as the CLI's own imports.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, time
from typing import Any

from prepare.fail import Fail
from prepare.host.redact import credentials, redact
from prepare.spec import DATA_MOUNTPOINT, DRIVER_DIR

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

# floDl keeps a device index in a u8.
MAX_DEVICE = 255

# The longest values taken, well under what the kernel takes on a command
# line (MAX_ARG_STRLEN, 128 KiB an argument; ARG_MAX, at least 128 KiB for
# all of them and the environment): a value past these is refused by name
# here, not by execve as E2BIG (which would read as a program missing). A
# run manifest's arguments are held to the same (prepare.build.manifest).
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
def _absolute_path(example: str) -> Checker:
    def check(value: Any) -> str | None:
        problem = _string(value)
        if problem is not None:
            return problem
        if value.startswith("~"):
            return (
                "starts with '~', which only a shell expands (here it would be a directory named '~'): write the "
                f"absolute path, e.g. {example}"
            )
        if not value.startswith("/"):
            return (
                "is a relative path, which would resolve against the working directory (`/` under systemd): write "
                f"the absolute path, e.g. {example}"
            )
        if _printable(value) != value:
            return (
                "has a control character (or one that hides text), which every message naming the path would "
                f"print: a newline there forges a whole line of fdl-prepare's output. Use a plain path, e.g. {example}"
            )
        return None

    return check


def _printable(value: str) -> str:
    from prepare.host.human import printable

    return printable(value)


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


# floDl's word for "every device this box has" (`fdl join --devices all`):
# the same as leaving devices out.
DEVICES_ALL = "all"


def _is_all(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == DEVICES_ALL


def _devices(value: Any) -> str | None:
    if _is_all(value):
        return None
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
        if item > MAX_DEVICE:
            # floDl holds a device index in a byte: a larger one is refused by `fdl join`.
            return f"device {item} is past {MAX_DEVICE}, the largest device index floDl takes"
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


# Store URL settings that make Nix take paths without checking a signature:
# `trusted` (any store: "paths from this store can be used as substitutes
# even if they are not signed by a key listed in trusted-public-keys") and
# `require-sigs` turned off (a local store's). A store URL inside another's
# (ssh-ng://host?remote-store=...) is read too.
def weakens_signatures(url: str, depth: int = 0) -> str | None:
    """The setting in a store URL's query that turns signature checks off
    (`trusted=1`, `require-sigs=false`), or None."""
    from urllib.parse import parse_qsl, unquote

    _, sep, query = url.partition("?")
    if not sep or depth > 4:
        return None
    for name, value in parse_qsl(query.split("#", 1)[0], keep_blank_values=True):
        setting = name.strip().lower().replace("_", "-")
        flag = value.strip().lower()
        if setting == "trusted" and flag not in ("0", "false", "no"):
            return f"{name}={value}"
        if setting == "require-sigs" and flag not in ("1", "true", "yes"):
            return f"{name}={value}"
        if setting in ("remote-store", "store"):
            nested = weakens_signatures(unquote(value), depth + 1)
            if nested is not None:
                return f"{name}=...{nested}"
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


def parse_devices(text: str, field: str = "--devices") -> list[int] | str:
    """`0,1` -> [0, 1], and `all` (floDl's `--devices all`) as itself, for a
    flag or an environment variable. Bad input is a permanent Fail naming
    `field`."""
    if _is_all(text):
        return DEVICES_ALL
    parts = [p.strip() for p in text.split(",")]
    # isascii: str.isdigit() also admits digits such as '²' that int() refuses.
    if not text.strip() or any(not (p.isascii() and p.isdigit()) for p in parts):
        raise Fail(
            "config.invalid",
            f"{field} {show(text)}: expected comma-separated device indices such as {field} 0,1 "
            f"(or {field} all, or omit it, to offer every visible device)",
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
    # the plan apply it, so a value reaches the steps the same either way.
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
# The same rule for every path a step is handed, each with its own example.
STATE_PATH = Kind("absolute path", _absolute_path("/var/lib/fdl-prepare"), str, show=lambda v: _show_short(v))
DATA_PATH = Kind("absolute path", _absolute_path(DATA_MOUNTPOINT), str, show=lambda v: _show_short(v))
DRIVER_PATH = Kind("absolute path", _absolute_path(DRIVER_DIR), str, show=lambda v: _show_short(v))
SSH_HOST = Kind("ssh host", _ssh_target, str)
SSH_USER = Kind("ssh user", _ssh_user, str)


def _smoke_user(value: Any) -> str | None:
    problem = _ssh_target(value)
    return problem.replace("host name", "user name") if problem else None


SMOKE_USER = Kind("user", _smoke_user, str)
# The training user (`user`): a name the password database is asked for
# when the plan is made (prepare.host.training_user).
USER = Kind("user", _smoke_user, str, to_spec=_stripped)

# floDl's spellings of a libtorch variant (`fdl join --libtorch 12.8`,
# `fdl libtorch download`'s flags as one token) and the label the flake
# gives the same build: one value means one build under both tools.
LIBTORCH_ALIASES = {
    "12.6": "cu126",
    "12.8": "cu128",
    "rocm70": "rocm7.0",
    "7.0": "rocm7.0",
    "rocm71": "rocm7.1",
    "7.1": "rocm7.1",
}


def libtorch_label(value: Any) -> Any:
    """A libtorch value in the flake's words: floDl's aliases mapped, spaces
    dropped (floDl trims them too); anything else as it is."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    return LIBTORCH_ALIASES.get(text, text)


LIBTORCH = Kind("libtorch variant", _string, str, to_spec=libtorch_label, show=lambda v: _show_short(v))


def _devices_to_spec(value: Any) -> tuple[int, ...] | None:
    return None if _is_all(value) else tuple(value)


DEVICES = Kind(
    "devices",
    _devices,
    str,
    example="[0, 1]",
    read_flag=parse_devices,
    to_spec=_devices_to_spec,
    show=lambda v: _show_short(v),
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


# -- floDl's own keys ---------------------------------------------------------------------------
# Checked as `fdl join` reads them (flodl-cli's WorkerJoin), so a value it
# would refuse is refused here first, with the key and its line.


def _share(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a fraction of the box's memory such as 0.5, got {kind_of(value)}"
    if not math.isfinite(value) or value < 0:
        return f"expected a non-negative fraction of the box's memory such as 0.5, got {value!r}"
    return None


def _flodl_args(value: Any) -> str | None:
    if isinstance(value, (list, tuple)) and not value:
        return None
    return _strings(value, '["--epochs", "10"]')


FLODL_CONTROLLER = Kind("controller address", _ssh_target, str)
# A session credential: never quoted, whatever is wrong with it.
FLODL_TOKEN = Kind("token", _string, str, show=lambda v: "<token, not shown>")
FLODL_PATH = Kind("path", _string, str, show=lambda v: _show_short(v))
FLODL_HOST = Kind("host name", _ssh_target, str)
FLODL_ARGS = Kind("arguments", _flodl_args, list, example='["--epochs", "10"]', show=lambda v: _show_short(v))
FLODL_SHARE = Kind("fraction", _share, float, example="0.5")
