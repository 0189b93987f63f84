"""Two machines on one: node A is this machine's Nix store (the controller
that publishes), node B is a box with a store of its own; between them, a
binary cache served over HTTP on 127.0.0.1.

Node B is a private mount namespace in which a directory of the test's
(`<tmp>/nodeB/nix`, empty at first) is bound over /nix: B's Nix has its own
store, database and caches, and starts with nothing, as a fresh box does,
while the network (the cache's port, the sshd) is the same loopback. Paths
stay where Nix says they are (/nix/store/...), so the runner reads the
fetched manifest and the built binary as it does on any box. (A store
directory given to Nix as `--store DIR` or `store = DIR` keeps its files
under DIR/nix/store while Nix names them /nix/store/...: the runner, which
reads the manifest from the fetched tree, would find nothing there.)
Needs root and util-linux's unshare; skipped otherwise.

Fixture API (register with `pytest_plugins = ["fleet_fixtures"]`):

`signing_key` (function, with nix_env) -> `(name) -> Key`: a Nix signing key pair made by
`nix key generate-secret`. `.secret` (the file), `.public` (name:base64).

`binary_cache` (function) -> `() -> Cache`: an empty directory and an HTTP
server on 127.0.0.1 serving it. `.file_url` (what `publish --to` writes),
`.url` (what a box substitutes from), `.stop()`; stopped at teardown.

`node_b` (function) -> `() -> NodeB`: a fresh box store. `.prepare(spec)`
runs the whole pipeline there (in a child, in the namespace) and returns
`{"prepared": {...}} or {"fail": {"kind", "message"}}`, with the notes and
the progress events (from Nix's internal-json records: `build-start` is a
derivation built, `substitute-start` a path substituted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from nix_fixtures import NIX_CONFIG, require_nix

from prepare.spec import PrepareSpec

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Key:
    secret: Path
    public: str


@pytest.fixture
def signing_key(tmp_path: Path, nix_env: dict[str, str]) -> Callable[[str], Key]:
    nix = require_nix()
    env = {**os.environ, "NIX_CONFIG": NIX_CONFIG}

    def make(name: str) -> Key:
        secret = tmp_path / f"{name}.secret"
        with open(secret, "w") as out:
            subprocess.run(
                [nix, "key", "generate-secret", "--key-name", name], stdout=out, env=env, check=True, timeout=30
            )
        secret.chmod(0o600)
        with open(secret) as given:
            public = subprocess.run(
                [nix, "key", "convert-secret-to-public"],
                stdin=given, env=env, check=True, capture_output=True, text=True, timeout=30,
            ).stdout.strip()  # fmt: skip
        return Key(secret, public)

    return make


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        return  # the test output is no place for an access log


@dataclass
class Cache:
    root: Path
    server: http.server.ThreadingHTTPServer | None = None

    @property
    def file_url(self) -> str:
        return f"file://{self.root}"

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        """Stop serving: the port refuses connections from now on."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def binary_cache(tmp_path: Path, nix_env: dict[str, str]) -> Iterator[Callable[[], Cache]]:
    caches: list[Cache] = []

    def make() -> Cache:
        root = tmp_path / f"cache{len(caches)}"
        root.mkdir()
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        cache = Cache(root, server)
        caches.append(cache)
        return cache

    try:
        yield make
    finally:
        for cache in caches:
            with contextlib.suppress(OSError):
                cache.stop()


_ON_B = r"""
import dataclasses, json, os, subprocess, sys
args = json.loads(sys.argv[1])
subprocess.run(["mount", "--bind", args["nix"], "/nix"], check=True)
from prepare.fail import Fail
from prepare.pipeline import prepare
from prepare.spec import NixSpec, PrepareSpec, SourceSpec
raw = args["spec"]
spec = PrepareSpec(
    source=SourceSpec(**raw["source"]) if raw["source"] else None,
    nix=NixSpec(**{k: tuple(v) for k, v in raw["nix"].items()}),
    **{k: v for k, v in raw.items() if k not in ("source", "nix", "data", "ssh", "devices")},
)
events, notes, out = [], [], {}
try:
    out["prepared"] = prepare(spec, notes, progress=events.append).to_json()
except Fail as fail:
    out["fail"] = {"kind": fail.kind, "message": fail.message}
out["notes"], out["events"] = notes, events
print(json.dumps(out))
"""


@dataclass
class NodeB:
    root: Path
    env: dict[str, str]

    @property
    def store(self) -> Path:
        return self.root / "nix" / "store"

    def prepare(self, spec: PrepareSpec, *, timeout: float = 300) -> dict[str, Any]:
        raw = dataclasses.asdict(spec)
        raw.pop("origins", None)
        arg = json.dumps({"nix": str(self.root / "nix"), "spec": raw})
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _ON_B, arg],
            env=self.env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result


def built(result: dict[str, Any]) -> list[str]:
    """The derivations node B built, from the build activities Nix logged."""
    return [e["name"] for e in result["events"] if e["type"] == "build-start"]


def substituted(result: dict[str, Any]) -> list[str]:
    """The paths node B substituted, from the substitution activities."""
    return [e["name"] for e in result["events"] if e["type"] == "substitute-start"]


@pytest.fixture
def node_b(tmp_path: Path, nix_env: dict[str, str]) -> Callable[[], NodeB]:
    if os.geteuid() != 0:
        pytest.skip("node B is a private mount namespace over /nix: needs root")
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    counter = iter(range(100))

    def make() -> NodeB:
        root = tmp_path / f"nodeB{next(counter)}"
        (root / "nix").mkdir(parents=True)
        home = root / "home"
        home.mkdir()
        # Nothing of node A's: its own home, caches (Nix's git and narinfo
        # caches live there) and state.
        env = {
            **nix_env,
            "HOME": str(home),
            "XDG_CACHE_HOME": str(root / "cache"),
            "XDG_STATE_HOME": str(root / "state"),
            "PYTHONPATH": str(REPO),
        }
        probe = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "mount", "--bind", str(root / "nix"), "/nix"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if probe.returncode != 0:
            pytest.skip(f"cannot make a private mount namespace here: {probe.stderr.strip()[-300:]}")
        return NodeB(root, env)

    return make
