"""Credentials out of everything fdl-prepare says.

A URL can carry a secret in its user-info: `https://user:token@host/...`,
or a token as the whole user part (`https://ghp_...@github.com/...`, which
GitHub and GitLab accept). fdl-prepare refuses such URLs in its own
settings (`credentials`, below), so they never reach a command line, where
any user can read them in `ps`; what it prints still goes through `redact`,
because text it did not write (Nix's and git's errors, a flake's own lock
file) may carry one.

Over HTTP the whole user-info is hidden (a user alone may be a token); over
other schemes (ssh, sshfs) the user is a login name and stays, and only a
password after it is hidden.
"""

from __future__ import annotations

import re

HIDDEN = "***"

# scheme://user-info@ : the user-info stops at the first character a URL's
# authority cannot hold before the host.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^\s/@'\"`<>?#]+)@")


def _http(scheme: str) -> bool:
    return "http" in scheme.lower()


def _hide(match: re.Match[str]) -> str:
    scheme, info = match["scheme"], match["info"]
    if _http(scheme):
        return f"{scheme}{HIDDEN}@"
    if ":" in info:
        return f"{scheme}{info.split(':', 1)[0]}:{HIDDEN}@"
    return match[0]


def redact(text: str) -> str:
    """`text` with every URL's secret user-info replaced by ***."""
    if "@" not in text:
        return text
    return _USERINFO.sub(_hide, text)


def credentials(url: str) -> str | None:
    """What in `url` is a credential ("a password", "a user name or token"),
    or None when it carries none."""
    match = _USERINFO.match(url.strip())
    if match is None:
        return None
    info = match["info"]
    if ":" in info:
        return "a password"
    if _http(match["scheme"]):
        return "a user name or token"
    return None
