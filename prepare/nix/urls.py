"""The two URLs fdl-prepare hands to Nix, the flake and the training
source, checked before the first nix call: a config that cannot work costs
no evaluation, and nothing from a config reaches Nix as an option, a
credential or a path Nix would resolve against the working directory."""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qs, urlsplit

from prepare.fail import Fail
from prepare.host import redact

_GIT_SCHEMES = ("git+https", "git+http", "git+ssh", "git+file", "git")
_FORGE_SCHEMES = ("github", "gitlab", "sourcehut")


def check_source_url(url: str | None) -> str:
    """Refuse, before any nix call, a source URL that is not a pin.

    A git source without `ref` or `rev` follows whatever the remote's default
    branch is today: two boxes prepared an hour apart could train different
    code under one run. Registry names (`nixpkgs`, `flake:x`) need the global
    registry this runner never consults."""
    if url is None or not str(url).strip():
        raise Fail(
            "config.invalid",
            "the training source has no URL: set source.from in [join.source] (--source), e.g. "
            '"git+https://host/repo?ref=main" or "path:/srv/train"',
        )
    url = str(url).strip()
    _refuse_credentials("source.from", url, "[join.source] from (--source)")
    if url.startswith("-"):
        raise Fail("config.invalid", _leading_dash("source.from", url, "[join.source] from (--source)"))
    if any(c.isspace() for c in url):
        raise Fail(
            "config.invalid",
            f'source.from = {url!r} contains whitespace, which Nix refuses in a URL ("is not a valid URL"; '
            "path: URLs are not percent-decoded either): move or link the tree to a path without spaces and "
            "name that in [join.source] from (--source)",
        )
    if any(not c.isprintable() for c in url):
        raise Fail("config.invalid", _control("source.from", url, "[join.source] from (--source)"))
    if url.startswith("/") or url.startswith("."):
        raise Fail(
            "config.invalid",
            f"source.from = {url!r} is a bare path; Nix would guess whether it is a git checkout (following its "
            f'current branch) or a plain directory. Write it as a flake URL: "path:{os.path.abspath(url)}", or '
            f'"git+file://{os.path.abspath(url)}?ref=main" (--source)',
        )
    scheme, sep, rest = url.partition(":")
    if not sep or not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise Fail(
            "config.invalid",
            f"source.from = {url!r} is not a flake URL (no scheme): use git+https://, git+ssh://, git+file://, "
            "path: or a tarball https:// URL (--source)",
        )
    _check_local_path(url, scheme, "source.from", "[join.source] from (--source)", "/srv/train", "?ref=main")
    query = parse_qs(urlsplit(url).query)
    if scheme in _GIT_SCHEMES or scheme.startswith("git+"):
        if not query.get("ref") and not query.get("rev"):
            raise Fail(
                "config.invalid",
                f"source.from = {url!r} names no ref or rev: a git source without one follows the remote's default "
                f"branch, which is not a pin. Add ?ref=<branch> (re-resolved on every attempt) or ?rev=<commit> "
                f'(fixed): e.g. "{url}{"&" if "?" in url else "?"}ref=main" in [join.source] from (--source)',
            )
    elif scheme in _FORGE_SCHEMES:
        path = rest.split("?")[0].strip("/").split("/")
        if len(path) < 3 and not query.get("ref") and not query.get("rev"):
            raise Fail(
                "config.invalid",
                f"source.from = {url!r} names no ref or rev, so it follows the default branch, which is not a pin: "
                f"write {scheme}:<owner>/<repo>/<branch or commit> in [join.source] from (--source)",
            )
    elif scheme == "flake":
        raise Fail(
            "config.invalid",
            f"source.from = {url!r} looks like a flake registry name; fdl-prepare consults no registry (a box "
            "without internet would wait on it). Write the full URL (git+https://...?ref=..., path:...) (--source)",
        )
    return url


def _refuse_credentials(field: str, url: str, where: str) -> None:
    """A credential in a URL would sit on nix's and git's command lines,
    which every user of the box can read (`ps`), and in every message that
    names the source. Nix has its own places for one."""
    what = redact.credentials(url)
    if what is None:
        return
    raise Fail(
        "config.credentials-in-url",
        f"{field} = {redact.redact(url)!r} carries {what} in the URL (hidden here): on a command line every user "
        f"of this box can read it (`ps`), and it would be in every message. Remove it from the URL in {where}, "
        "treat it as leaked, and give Nix the credential its own way: a netrc file (`netrc-file = /etc/nix/netrc` "
        "in nix.conf; a line `machine HOST login USER password TOKEN`, mode 0600), or for GitHub and GitLab "
        "`access-tokens = github.com=TOKEN` in a nix.conf only root can read; or fetch over git+ssh:// with a "
        "deploy key",
    )


def _control(field: str, url: str, where: str) -> str:
    return (
        f"{field} = {url!r} contains a control character (a NUL, an escape, ...), which no URL holds and no "
        f"command line can carry: write the URL as printable text in {where}"
    )


def _leading_dash(field: str, url: str, where: str) -> str:
    """A URL Nix would read as one of its options (`-f/file` evaluates a
    file impurely); Nix is also given `--` before every URL, but a URL
    that starts with `-` is never a flake reference anyway."""
    return (
        f"{field} = {url!r} starts with '-', so a command would read it as an option, not a URL: write the flake "
        f'URL with its scheme (e.g. "path:/srv/fdl-prepare", "git+https://host/repo?ref=main") in {where}'
    )


def _check_local_path(url: str, scheme: str, field: str, where: str, example: str, git_query: str = "") -> None:
    """A `path:` or `git+file:` URL with an empty or relative path is
    resolved by Nix against the working directory: `/` under systemd, which
    copies the whole filesystem into the store, and another tree for every
    shell a manual run starts from."""
    if scheme != "path" and not scheme.endswith("+file"):
        return
    parts = urlsplit(url)
    if parts.path.startswith("/") and not parts.netloc and os.path.normpath(parts.path) in ("/", "//"):
        raise Fail(
            "config.invalid",
            f"{field} = {url!r} names the root directory `/`: Nix would copy the whole filesystem into the "
            f'store (and fail on what it cannot read). Name the directory that holds it, e.g. "path:{example}", '
            f"in {where}",
        )
    if parts.netloc or parts.path.startswith("/"):
        return  # absolute (an authority is Nix's to refuse, as a URL that does not parse)
    rel = parts.path
    target = os.path.abspath(rel) if rel else example
    query = f"?{parts.query}" if parts.query else (git_query if scheme.startswith("git+") else "")
    fixed = f"path:{target}{query}" if scheme == "path" else f"{scheme}://{target}{query}"
    what = "names no directory" if not rel else f"names a relative directory ({rel!r})"
    raise Fail(
        "config.invalid",
        f"{field} = {url!r} {what}: Nix would resolve it against the working directory (here {os.getcwd()!r}; "
        f"`/` under systemd, copying the whole filesystem into the store). Write an absolute path, e.g. "
        f'"{fixed}", in {where}',
    )


def check_flake_url(flake: str | None) -> str:
    """Refuse, before any nix call, a flake reference that cannot be the
    flake: nothing else checks it before Nix would evaluate it."""
    url = (flake or "").strip()
    where = "[join] flake (--flake; $FDL_PREPARE_FLAKE is the default the app sets)"
    if not url:
        raise Fail(
            "config.invalid",
            'no flake to build from: set flake in [join] (--flake), e.g. "github:owner/fdl-prepare" or '
            '"git+file:///srv/fdl-prepare?ref=main"; `nix run .#prepare` sets it to its own flake',
        )
    _refuse_credentials("flake", url, where)
    if url.startswith("-"):
        raise Fail("config.invalid", _leading_dash("flake", url, where))
    if any(c.isspace() for c in url):
        raise Fail(
            "config.invalid",
            f'flake = {url!r} contains whitespace, which Nix refuses in a URL ("is not a valid URL"): move or '
            f"link the flake to a path without spaces and name that in {where}",
        )
    if any(not c.isprintable() for c in url):
        raise Fail("config.invalid", _control("flake", url, where))
    if "#" in url:
        bare, _, fragment = url.partition("#")
        raise Fail(
            "config.invalid",
            f"flake = {url!r} names an attribute (#{fragment}); fdl-prepare picks the attributes itself "
            f"(legacyPackages.<system>.fdl, nix/CONTRACT.md), so Nix would get two fragments. Name the flake "
            f'alone: "{bare}" in {where}',
        )
    if url.startswith("."):
        raise Fail(
            "config.invalid",
            f"flake = {url!r} is a relative path: Nix would resolve it against the working directory (here "
            f'{os.getcwd()!r}; `/` under systemd). Write it absolute, e.g. "path:{os.path.abspath(url)}", '
            f"in {where}",
        )
    scheme = url.partition(":")[0] if ":" in url else ""
    _check_local_path(url, scheme, "flake", where, "/srv/fdl-prepare")
    return url
