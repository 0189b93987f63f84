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

A token in a URL's query is the same secret in another place
(`?access_token=...`, `&private_token=`, an S3 or Azure signature): its
value is hidden wherever a URL's query is, and such a URL is refused in the
settings as one with user-info is. A parameter counts when its name says it
holds a secret (`SECRET_PARAMS`, or a name holding "token", "passw",
"secret" or "signature"), and its value is not a file's path (Nix's
`secret-key=/etc/nix/key` names a file, it is not the key).

ssh options whose values can carry a secret (`SSH_SECRET_OPTIONS`: a
ProxyCommand or KnownHostsCommand with a token in its arguments, SetEnv
with one in a variable, a LocalCommand or RemoteCommand, sshfs's own
ssh_command) have their values hidden too, as `Key=***`, wherever an option
is written `Key=Value`: in `ssh.options` quoted back, in a command line
(`-o 'ProxyCommand=...'`, `-oSetEnv=...`), in a list. A quoted value is
hidden up to its closing quote; an unquoted one to the end of its line,
since such a value may hold spaces and nothing marks where it ends.
"""

from __future__ import annotations

import re

HIDDEN = "***"

# scheme://user-info@ : the user-info stops at the first character a URL's
# authority cannot hold before the host.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^\s/@'\"`<>?#]+)@")


SECRET_PARAMS = frozenset(
    {
        "access_token", "token", "private_token", "auth", "auth_token", "id_token", "refresh_token", "password",
        "passwd", "pass", "pwd", "secret", "client_secret", "api_key", "apikey", "key", "sig", "signature",
        "x-amz-signature", "x-amz-security-token", "x-amz-credential", "aws_secret_access_key",
        "aws_session_token", "sas", "sv_sig",
    }
)  # fmt: skip
_SECRET_WORDS = ("token", "passw", "secret", "signature", "credential")
# name=value in a URL's query (after ? or &, up to the next & # or a
# character no URL carries).
_QUERY_PARAM = re.compile(r"(?P<lead>[?&;])(?P<name>[A-Za-z0-9_.~+%-]+)=(?P<value>[^&#\s'\"`<>]*)")


# ssh_config keywords (case-insensitive) whose value is a command, or
# environment handed to the far side: a credential fits in any of them.
SSH_SECRET_OPTIONS = (
    "setenv", "sendenv", "proxycommand", "localcommand", "remotecommand", "knownhostscommand", "ssh_command",
)  # fmt: skip
# Key= for one of them: after a quote (the quote then ends the value),
# after -o (`-oSetEnv=...`), or at a word's start.
_SSH_OPTION = re.compile(
    r"(?P<q>['\"]?)(?P<o>-o)?(?P<key>(?:(?<=-o)|(?<![\w-]))(?:" + "|".join(SSH_SECRET_OPTIONS) + r"))\s*=",
    re.IGNORECASE,
)


def _hide_ssh_options(text: str) -> str:
    """Each secret-carrying option's value as ***: a quoted one (the quote
    before the key, or one opening the value) up to its closing quote,
    an unquoted one to the end of its line."""
    out: list[str] = []
    at = 0
    while (match := _SSH_OPTION.search(text, at)) is not None:
        q = match["q"]
        start = match.end()
        line_end = text.find("\n", start)
        line_end = len(text) if line_end < 0 else line_end
        if q and q in text[start:line_end]:
            end = text.index(q, start)
        elif text[start : start + 1] in ("'", '"') and text[start] in text[start + 1 : line_end]:
            end = text.index(text[start], start + 1) + 1
        else:
            end = line_end
        out.append(text[at : match.start()] + f"{q}{match['o'] or ''}{match['key']}={HIDDEN}")
        at = end
    return "".join(out) + text[at:]


def secret_param(name: str, value: str) -> bool:
    """Whether the query parameter `name=value` carries a credential."""
    from urllib.parse import unquote

    low = unquote(name).lower()
    plain = unquote(value)
    if not plain or plain == HIDDEN or plain.startswith("/"):
        return False
    return low in SECRET_PARAMS or low.replace("-", "_") in SECRET_PARAMS or any(w in low for w in _SECRET_WORDS)


def _hide_param(match: re.Match[str]) -> str:
    if secret_param(match["name"], match["value"]):
        return f"{match['lead']}{match['name']}={HIDDEN}"
    return match[0]


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
    """`text` with every URL's secret user-info, every secret query
    parameter's value and every secret-carrying ssh option's value
    replaced by ***."""
    if "@" in text:
        text = _USERINFO.sub(_hide, text)
    if "=" in text:
        text = _QUERY_PARAM.sub(_hide_param, text)
        text = _hide_ssh_options(text)
    return text


def credentials(url: str) -> str | None:
    """What in `url` is a credential ("a password", "a user name or token",
    "a token in its query (access_token=)"), or None when it carries none."""
    match = _USERINFO.match(url.strip())
    if match is not None:
        info = match["info"]
        if ":" in info:
            return "a password"
        if _http(match["scheme"]):
            return "a user name or token"
    _, sep, query = url.partition("?")
    if sep:
        for found in _QUERY_PARAM.finditer("?" + query.split("#", 1)[0]):
            if secret_param(found["name"], found["value"]):
                return f"a token in its query ({found['name']}=)"
    return None
