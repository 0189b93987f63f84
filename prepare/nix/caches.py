"""A box's binary caches: what `fdl-prepare publish` pushed is substituted
instead of built, and the notes say what the caches did.

The caches and their keys come from the box's own config (`[join.nix]`) and
reach every nix call as options. A flake's `nixConfig` is never accepted:
what a box trusts must not be decided by what it fetches.

Both lists are *added* to nix.conf's (`extra-substituters`,
`extra-trusted-public-keys`), so a box keeps the caches its installation
already has. With either one set, every call also gets:

- `require-sigs = true`: the default on 2.8 and 2.26, set anyway, so a
  nix.conf that turned it off cannot let an unsigned path from the fleet's
  cache into the store. A path whose signatures match no trusted key is
  not substituted; Nix builds it instead.
- `fallback = true`: a cache that dies between answering "I have it" and
  sending the bytes is built around, not a failed build.
- `connect-timeout`: curl's own default is minutes per attempt, and Nix
  tries five times, so a black-holed cache would hold a box for half an
  hour before it built anything itself.

What each case looks like in Nix's log, on 2.8 and 2.26 (the patterns match
the words both versions share; 2.34 words them as 2.26 does):

- a daemon that does not trust this user drops a client's substituters:
  "ignoring untrusted substituter '<url>'" (2.26 adds ", you are not a
  trusted user"), sent by the daemon and printed by the client;
- a substitute signed by no trusted key: "the substitute for '<path>' from
  '<cache>' is not signed by any of the keys in 'trusted-public-keys'"
  (2.8), "ignoring substitute for '<path>' from '<cache>', as it's not
  signed by any of the keys in 'trusted-public-keys'" (2.26);
- an unreachable cache: "unable to download '<cache>/nix-cache-info':
  Couldn't connect to server (7)", or "disabling binary cache '<cache>' for
  60 seconds" once it failed mid-run; the build goes on without it;
- a substitution: an activity of type 108 whose fields are the store path
  and the cache's URI (its URL without the query), then one of type 100
  copying it, whose progress counts NAR bytes; over HTTP, the transfers
  (101) under the cache's URL count the bytes that crossed the network.
"""

from __future__ import annotations

import getpass
import re
from collections.abc import Sequence

from prepare.fail import Fail
from prepare.host import human
from prepare.nix.log import ACT_COPY_PATH, Log, store_name

# Seconds to establish a connection to a cache (or any other download).
CONNECT_TIMEOUT_S = 15

# 2.8, 2.26 and 2.34 single-quote these; 2.34 double-quotes paths in
# other messages, so each takes either quote, or none (a URL then ends at a
# comma or a space; an unreachable one at the ": " before curl's reason).
_UNTRUSTED = re.compile(r"ignoring untrusted substituter ['\"]?([^'\"\s,]+)['\"]?", re.IGNORECASE)
_KEYS_IGNORED = re.compile(r"client-specified setting ['\"]?(?:extra-)?trusted-public-keys['\"]?", re.IGNORECASE)
_UNSIGNED = re.compile(
    r"substitute for ['\"]?(/[^'\"\s,]+)['\"]? from ['\"]?([^'\"\s,]+)['\"]?"
    r".*not signed by any of the keys in ['\"]?trusted-public-keys",
    re.IGNORECASE,
)
_UNREACHABLE = re.compile(
    r"unable to download (?:['\"](?P<url>[^'\"]*)['\"]|(?P<bare>\S+?)(?=:\s|$))(?::\s*(?P<why>[^;\n]*))?|"
    r"disabling binary cache ['\"]?(?P<cache>[^'\"\s]+)['\"]?",
    re.IGNORECASE,
)


def options(substituters: Sequence[str], keys: Sequence[str]) -> list[str]:
    """The `--option` arguments that give every nix call the box's caches."""
    argv: list[str] = []
    if substituters:
        argv += ["--option", "extra-substituters", " ".join(substituters)]
        argv += ["--option", "fallback", "true"]
        argv += ["--option", "connect-timeout", str(CONNECT_TIMEOUT_S)]
    if keys:
        argv += ["--option", "extra-trusted-public-keys", " ".join(keys)]
    if substituters or keys:
        argv += ["--option", "require-sigs", "true"]
    return argv


def uri(url: str) -> str:
    """A store URL as Nix names the store in its log: no query, no trailing
    slash (`ssh-ng://host?remote-store=x` is `ssh-ng://host`)."""
    return url.split("?", 1)[0].rstrip("/")


def _said(log: Log) -> list[str]:
    return [*log.warnings, *log.errors]


def untrusted(log: Log, substituters: Sequence[str]) -> Fail | None:
    """A permanent Fail when the daemon dropped any of the box's caches.

    A daemon takes substituters from a user only if that user is one of its
    trusted-users or nix.conf lists the cache in trusted-substituters; it
    says so with a warning and carries on, and every box would then build
    what it was meant to substitute, forever, without a word. No retry
    changes nix.conf."""
    ours = {uri(s): s for s in substituters}
    dropped = [ours[uri(m[1])] for text in _said(log) for m in _UNTRUSTED.finditer(text) if uri(m[1]) in ours]
    if not dropped:
        return None
    listed = " ".join(dict.fromkeys(dropped))
    return Fail(
        "nix.cache-untrusted",
        f"the Nix daemon ignores the binary cache {listed} (nix.substituters, --substituter): this user "
        f"({_user()}) is not one of its trusted-users, and it takes a cache from other users only when nix.conf "
        f"lists it in trusted-substituters. Fix, as root: add `trusted-substituters = {listed}` (and its keys to "
        "`trusted-public-keys`) to /etc/nix/nix.conf, or add this user to `trusted-users` there, then "
        "`systemctl restart nix-daemon` (NixOS: nix.settings.trusted-substituters / trusted-users); or run "
        "fdl-prepare as root",
    )


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "this user"


def note(log: Log, substituters: Sequence[str], notes: list[str]) -> None:
    """What the caches did in one build: paths and bytes substituted from
    each, derivations built here, and any cache that was unreachable or
    whose paths were refused for their signatures."""
    by_cache: dict[str, list[str]] = {}
    for act in log.substitutions():
        if len(act.fields) >= 2 and isinstance(act.fields[0], str):
            by_cache.setdefault(_configured(str(act.fields[1]), substituters), []).append(act.fields[0])
    built = [store_name(a.fields[0]) for a in log.builds() if a.fields and isinstance(a.fields[0], str)]
    for cache, paths in by_cache.items():
        size = _bytes(log, cache, len(by_cache))
        names = ", ".join(sorted(store_name(p) for p in paths))
        notes.append(
            f"binary cache {cache}: substituted {len(paths)} path{'s' if len(paths) != 1 else ''}"
            + (f" ({size})" if size else "")
            + f": {names}"
        )
    if substituters or by_cache:
        notes.append(
            f"built here: {len(built)} derivation{'s' if len(built) != 1 else ''}"
            + (f" ({', '.join(built)})" if built else "")
        )
    _note_refused(log, notes, bool(built))
    _note_unreachable(log, substituters, notes, bool(built))
    if any(_KEYS_IGNORED.search(text) for text in _said(log)):
        notes.append(
            "the Nix daemon ignored trusted_public_keys (nix.trusted_public_keys, --trusted-public-key): this "
            "user is not one of its trusted-users, so only the keys in its own nix.conf count. Add them to "
            "`trusted-public-keys` in /etc/nix/nix.conf, or this user to `trusted-users`"
        )


def _configured(reported: str, substituters: Sequence[str]) -> str:
    """The store a substitution came from, named as 2.8 names it. 2.26
    reports an `ssh-ng://host?remote-store=...` store as a bare `ssh-ng://`;
    the one configured substituter of that scheme is the store it means."""
    if not reported.endswith("://"):
        return reported
    matching = [s for s in substituters if s.startswith(reported)]
    return uri(matching[0]) if len(matching) == 1 else reported


def _bytes(log: Log, cache: str, caches: int) -> str:
    """How much came from `cache`: over HTTP the bytes downloaded under its
    URL; otherwise the NAR bytes its copies counted, or, with one cache
    only, the NAR bytes Nix announced for all of them."""
    downloaded = sum(t.done for t in log.transfers() if isinstance(t.name, str) and t.name.startswith(cache + "/"))
    if downloaded:
        return f"{human.size(downloaded)} downloaded"
    copied = sum(
        max(a.done, a.expected) for a in log.copies() if len(a.fields) >= 2 and uri(str(a.fields[1])) == uri(cache)
    )
    if not copied and caches == 1:
        copied = log.expected.get(ACT_COPY_PATH, 0)
    return f"{human.size(copied)} unpacked" if copied else ""


def _note_refused(log: Log, notes: list[str], built: bool) -> None:
    refused: dict[str, list[str]] = {}
    for text in _said(log):
        for m in _UNSIGNED.finditer(text):
            refused.setdefault(m[2], []).append(store_name(m[1]))
    for cache, names in refused.items():
        notes.append(
            f"binary cache {cache} offered {', '.join(sorted(set(names)))} signed by no trusted key: refused (nothing "
            f"unsigned enters the store){', built here instead' if built else ''}. If the cache is yours, add the "
            "public key of the key it was published with to nix.trusted_public_keys (--trusted-public-key); "
            "`nix key convert-secret-to-public < SECRET_FILE` prints it"
        )


def _note_unreachable(log: Log, substituters: Sequence[str], notes: list[str], built: bool) -> None:
    ours = [uri(s) for s in substituters]
    seen: dict[str, tuple[str, bool]] = {}
    for text in _said(log):
        for line in text.splitlines():
            m = _UNREACHABLE.search(line)
            if m is None:
                continue
            url = m["url"] or m["bare"] or m["cache"] or ""
            why = m["why"]
            cache = next((c for c in ours if url == c or url.startswith(c + "/")), None)
            # curl's reason ("Couldn't connect to server") over Nix's own
            # "disabling binary cache", whichever came first.
            if cache is not None and (cache not in seen or (why and not seen[cache][1])):
                seen[cache] = ((why or "").strip() or line.strip().removeprefix("warning:").strip(), bool(why))
    for cache, (why, _) in seen.items():
        notes.append(
            f"binary cache {cache} could not be reached ({why})"
            + (": built here instead" if built else "")
            + "; check the cache's server and the network, or nix.substituters (--substituter)"
        )
