"""The two URLs fdl-prepare hands to Nix, the flake and the training
source, checked before the first nix call: a config that cannot work costs
no evaluation, and nothing from a config reaches Nix as an option, a
credential or a path Nix would resolve against the working directory."""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from prepare.data.url import SshTree
from prepare.fail import Fail
from prepare.host import redact

_GIT_SCHEMES = ("git+https", "git+http", "git+ssh", "git+file", "git")
_FORGE_SCHEMES = ("github", "gitlab", "sourcehut")
_WHERE = "[join.source] from (--source)"
# A ref floDl's `#<ref>` may name here: what git allows in a ref name, less
# what a URL query would split on or misread (& = # % + ? and whitespace).
_REF = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/,@-]*")
_FULL_SHA = re.compile(r"[0-9a-f]{40}")
_SHORT_SHA = re.compile(r"[0-9a-f]{7,39}")
# A host or user an ssh command line takes as one plain word.
_WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]+")
# What rsync's far side would still expand in a path under --protect-args.
_GLOB = re.compile(r"[*?\[\]]")


@dataclass(frozen=True)
class RsyncTarget(SshTree):
    """`rsync://[user@]host[:port]:/abs/path`, parsed: a tree pulled over ssh."""


@dataclass(frozen=True)
class SourceRef:
    """What `source.from` names, as fdl-prepare fetches it.

    - `flake`: a URL Nix fetches itself (`nix_url`; floDl's `#<40-hex sha>`
      already translated to `?rev=`);
    - `file`: a directory on this box (`path`), copied with rsync into a
      directory of fdl-prepare's, and fetched by Nix from there;
    - `rsync`: a tree pulled over ssh (`target`), the same way;
    - `git-ref`: floDl's `git+...#<tag or branch>`: the ref's commit asked
      of `git_url` (`git ls-remote`), then fetched by Nix at that commit.
    """

    spelled: str
    kind: str
    nix_url: str | None = None
    path: str | None = None
    target: RsyncTarget | None = None
    git_url: str | None = None
    ref: str | None = None

    @property
    def copied(self) -> bool:
        return self.kind in ("file", "rsync")

    @property
    def over_ssh(self) -> bool:
        """Whether ssh carries the fetch (rsync://, git+ssh://)."""
        if self.kind == "rsync":
            return True
        return (self.nix_url or self.spelled).startswith("git+ssh://")


def check_source_url(url: str | None) -> str:
    """`parse_source`'s check alone: the URL as given, when it is one."""
    return parse_source(url).spelled


def parse_source(url: str | None) -> SourceRef:
    """Refuse, before any nix call, a source URL that is not a pin, and say
    how it is fetched (`SourceRef`): floDl's spellings (flodl-cli
    source.rs) beside the flake URLs Nix takes.

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
            f'current branch) or a plain directory. Write it as floDl does: "file://{os.path.abspath(url)}" (the '
            f'directory, copied), or as a flake URL: "path:{os.path.abspath(url)}", or '
            f'"git+file://{os.path.abspath(url)}#main" (--source)',
        )
    scheme, sep, rest = url.partition(":")
    if not sep or not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise Fail(
            "config.invalid",
            f"source.from = {url!r} names no scheme: use floDl's file:///abs, rsync://[user@]host:/abs or "
            "git+https://host/repo#<ref>, or a flake URL (path:, git+https://...?ref=, a tarball https:// URL) "
            "(--source)",
        )
    if scheme == "file":
        return SourceRef(url, "file", path=_file_path(url, rest))
    if scheme == "rsync":
        return SourceRef(url, "rsync", target=_rsync_target(url, rest))
    _check_local_path(url, scheme, "source.from", _WHERE, "/srv/train", "?ref=main")
    if (scheme in _GIT_SCHEMES or scheme.startswith("git+")) and "#" in url:
        return _git_ref(url)
    query = parse_qs(urlsplit(url).query)
    if scheme in _GIT_SCHEMES or scheme.startswith("git+"):
        if not query.get("ref") and not query.get("rev"):
            fixed = f"{url}&ref=main" if "?" in url else f"{url}#main"
            raise Fail(
                "config.invalid",
                f"source.from = {url!r} names no ref or rev: a git source without one follows the remote's default "
                f"branch, which is not a pin. Name one, floDl's way (#<tag|branch|sha>) or Nix's (?ref=<branch>, "
                f'?rev=<commit>): e.g. "{fixed}" in {_WHERE}',
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
    return SourceRef(url, "flake", nix_url=url)


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


def _bad_source(url: str, why: str, fix: str) -> Fail:
    return Fail("config.invalid", f"source.from = {url!r} {why}: {fix} in {_WHERE}")


def _file_path(url: str, rest: str) -> str:
    """floDl's `file:///abs/path`: a directory on this box, absolute and
    never `/` (the whole machine would be copied)."""
    path = rest[2:] if rest.startswith("//") else rest
    if not rest.startswith("//") or not path.startswith("/"):
        # `file://srv/train` (two slashes) names a host `srv` to a URL
        # parser; floDl means the directory, and says three slashes.
        shown = "/" + path.lstrip("/")
        raise _bad_source(
            url,
            "is not an absolute file:// path (three slashes, then the path)",
            f'write "file://{posixpath.normpath(shown)}"',
        )
    normal = posixpath.normpath(path)
    if normal.startswith("//"):
        normal = "/" + normal.lstrip("/")
    if normal == "/":
        raise _bad_source(
            url,
            "names the root directory `/`, which would copy the whole machine",
            'name the tree, e.g. "file:///srv/train"',
        )
    return normal


def _rsync_target(url: str, rest: str) -> RsyncTarget:
    """floDl's `rsync://[user@]host[:port]:/abs/path` (the `:` before the
    path optional, as floDl takes it). Every part reaches ssh or rsync as
    an argument, so each is held to a plain word: nothing that starts with
    `-`, no whitespace, quotes or control characters."""
    example = "rsync://user@host:/abs/path"
    if not rest.startswith("//"):
        raise _bad_source(url, "is not an rsync:// URL", f'write it as "{example}"')
    rest = rest[2:]
    slash = rest.find("/")
    if slash < 0:
        raise _bad_source(
            url, "names no absolute path on the far side", f'write "rsync://{rest.rstrip(":")}:/abs/path"'
        )
    authority, path = rest[:slash].removesuffix(":"), rest[slash:]
    user: str | None = None
    if "@" in authority:
        user, authority = authority.rsplit("@", 1)
        if not _WORD.fullmatch(user):
            raise _bad_source(
                url,
                f"has a user {user!r} that is not a plain login name (letters, digits, . _ -, not starting with '-')",
                f'write it as "{example}"',
            )
    port_text: str | None = None
    if authority.startswith("["):
        host, _, after = authority[1:].partition("]")
        if not _IPV6.fullmatch(host) or (after and not after.startswith(":")):
            raise _bad_source(
                url, f"has a bracketed host {authority!r} that is not an IPv6 address", f'write "{example}"'
            )
        port_text = after[1:] or None
    else:
        host, _, port_text = authority.partition(":")
        port_text = port_text or None
        if not _WORD.fullmatch(host):
            raise _bad_source(
                url,
                f"has a host {host!r} that is not a plain host name (letters, digits, . _ -, not starting with '-'; "
                "an IPv6 address in brackets)",
                f'write it as "{example}"',
            )
    port: int | None = None
    if port_text is not None:
        if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
            raise _bad_source(url, f"has a port {port_text!r} that is not one from 1 to 65535", f'write "{example}"')
        port = int(port_text)
    normal = posixpath.normpath(path)
    if normal.startswith("//"):
        normal = "/" + normal.lstrip("/")
    if normal == "/":
        raise _bad_source(
            url,
            "names the far side's root `/`, a whole machine",
            f'name the tree, e.g. "rsync://{rest[:slash]}/srv/train"',
        )
    if _GLOB.search(normal) or "\\" in normal or "'" in normal or '"' in normal:
        raise _bad_source(
            url,
            f"has a path {normal!r} with a wildcard, a quote or a backslash, which rsync on the far side would "
            "expand or read",
            "name the directory by a plain path (link it there under one if need be)",
        )
    return RsyncTarget(user=user, host=host, port=port, path=normal)


def _git_ref(url: str) -> SourceRef:
    """floDl's `git+<transport>://...#<ref>`, the ref mandatory: a 40-hex
    commit becomes Nix's `?rev=`, and a tag or branch a `git-ref`, whose
    commit each attempt asks of the remote (Nix's own `?ref=` takes a
    branch only, and a tag of the same name is what git, and floDl,
    prefer)."""
    base, _, ref = url.partition("#")
    query = parse_qs(urlsplit(base).query)
    if not ref:
        raise _bad_source(
            url, "ends at `#` with no ref", f'name the tag, branch or 40-hex commit after it, e.g. "{base}#main"'
        )
    if query.get("ref") or query.get("rev"):
        raise _bad_source(
            url,
            "names a ref twice, in its query (?ref=, ?rev=) and after `#`",
            f'keep one: "{base.split("?", 1)[0]}#{ref}"',
        )
    if _FULL_SHA.fullmatch(ref):
        return SourceRef(url, "flake", nix_url=f"{base}{'&' if '?' in base else '?'}rev={ref}")
    if ref.startswith("-") or not _REF.fullmatch(ref) or ".." in ref or ref.endswith(("/", ".", ".lock")):
        raise _bad_source(
            url,
            f"names a ref {ref!r} this fetch does not take (a git ref name of letters, digits and . _ / , @ -, not "
            "starting with '-', with no `..`)",
            f'name a tag or branch so spelled, or the 40-hex commit: "{base}#<40-hex commit>"',
        )
    if _SHORT_SHA.fullmatch(ref) and any(c.isdigit() for c in ref) and any(c in "abcdef" for c in ref):
        # An abbreviated commit: no remote serves one by that name, and no
        # fetch may guess which commit it abbreviates.
        raise _bad_source(
            url,
            f"names {ref!r}, an abbreviated commit, which a remote does not serve by that name",
            f'name the whole commit (`git rev-parse {ref}` in a clone): "{base}#<its 40 hex digits>"; or, for a '
            f'tag or branch of that name, "{base}#refs/tags/{ref}" or "{base}#refs/heads/{ref}"',
        )
    git_url = base.removeprefix("git+")
    return SourceRef(url, "git-ref", git_url=git_url, ref=ref, nix_url=base)
