"""Build once, substitute everywhere: node B's prepare through a binary cache
against node A's cold build of the same recipe.

    sudo python bench/fleet.py [--sleep 5]

One run, offline, on loopback. A training source whose build line sleeps
`--sleep` seconds (5 by default: the build the cache saves must cost
something) is published from node A (this machine's store) with
`fdl-prepare publish` to a signed binary cache directory, served over HTTP
on 127.0.0.1. Then, each with a fresh source (so nothing is warm):

- node A, cold: `fdl-prepare` with no cache, building libtorch and the
  training binary itself;
- node B: `fdl-prepare` on a box with an empty store of its own (a private
  mount namespace with a directory bound over /nix, as tests/fleet_fixtures.py
  makes it), whose `--substituter` is the cache and whose
  `--trusted-public-key` is the publisher's.

Both are the CLI as an operator or systemd runs it, timed from outside.
Printed: each time, what node B built and substituted (from the notes), and
the ratio B / A (target: at most 0.1x). Needs root and util-linux's unshare.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# The test flake's flat copy, shared with the tests and bench/warm_path.py.
sys.path.insert(0, str(REPO / "tests"))
from nix_fixtures import flat_copy  # noqa: E402 - found through the path set just above

NIX_CONFIG = "experimental-features = nix-command flakes\nsubstituters =\ndownload-attempts = 1\n"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@fdl.invalid",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@fdl.invalid",
}


def git_source(dest: Path, env: dict[str, str]) -> str:
    dest.mkdir(parents=True)
    (dest / "README").write_text(f"a training source for the fleet bench {time.time_ns()}\n")
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "source"]):
        subprocess.run(argv, cwd=dest, env=env, check=True)
    return f"git+file://{dest}?ref=main"


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        return


def cli() -> list[str]:
    return [sys.executable, "-m", "prepare"]


def run(argv: list[str], env: dict[str, str], label: str) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{label} failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return seconds, json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sleep", type=float, default=5.0, help="seconds the training build sleeps (default 5)")
    args = parser.parse_args()
    if shutil.which("nix") is None:
        print("nix is not installed: nothing to measure", file=sys.stderr)
        return 1
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("node B is a private mount namespace over /nix: run as root, with unshare", file=sys.stderr)
        return 1

    tmp = Path(tempfile.mkdtemp(prefix="fdl-bench-fleet-"))
    server = None
    try:
        env = {**os.environ, **GIT_ENV, "NIX_CONFIG": NIX_CONFIG, "PYTHONPATH": str(REPO)}
        flake = f"path:{flat_copy(tmp / 'flake', stand_in=True)}"
        build = f"sleep {args.sleep:g}; printf '#!/bin/sh\\necho trained\\n' > train && chmod +x train"
        recipe = ["--source-bin", "train", "--source-build", build]

        secret = tmp / "fleet.secret"
        with open(secret, "w") as out:
            subprocess.run(["nix", "key", "generate-secret", "--key-name", "bench-1"], stdout=out, env=env, check=True)
        secret.chmod(0o600)
        with open(secret) as given:
            public = subprocess.run(
                ["nix", "key", "convert-secret-to-public"], stdin=given, env=env, check=True, capture_output=True,
                text=True,
            ).stdout.strip()  # fmt: skip
        cache = tmp / "cache"
        cache.mkdir()
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(cache)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"

        # Node A, cold: a fresh source, no cache, everything built here.
        source_a = git_source(tmp / "source-a", env)
        (tmp / "home-a").mkdir()
        a_env = {**env, "HOME": str(tmp / "home-a")}
        a_argv = cli() + ["--cpu-only", "--libtorch", "cpu", "--flake", flake, "--source", source_a, *recipe]
        a_s, a_out = run(a_argv + ["--state-dir", str(tmp / "state-a"), "--json"], a_env, "node A's cold prepare")

        # The publish, from node A, of another fresh source.
        source_b = git_source(tmp / "source-b", env)
        start = time.perf_counter()
        published = subprocess.run(
            cli() + ["publish", str(tmp / "source-b"), "--bin", "train", "--build", build, "--variant", "cpu"]
            + ["--to", f"file://{cache}", "--signing-key", str(secret), "--flake", flake, "--commit"]
            + ["--state-dir", str(tmp / "state-publish"), "--json"],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        publish_s = time.perf_counter() - start
        if published.returncode != 0:
            raise SystemExit(f"publish failed:\n{published.stdout[-3000:]}{published.stderr[-3000:]}")
        run_id = json.loads(published.stdout)["run"]

        # Node B: an empty store of its own, the cache and the key.
        node = tmp / "nodeB"
        (node / "nix").mkdir(parents=True)
        (node / "home").mkdir()
        b_env = {**env, "HOME": str(node / "home"), "XDG_CACHE_HOME": str(node / "cache")}
        b_argv = cli() + ["--cpu-only", "--libtorch", "cpu", "--flake", flake, "--source", source_b]
        b_argv += ["--substituter", url, "--trusted-public-key", public]
        b_argv += ["--state-dir", str(node / "state"), "--json"]
        timer = (
            "import subprocess, sys, time; subprocess.run(['mount', '--bind', sys.argv[1], '/nix'], check=True); "
            "s = time.perf_counter(); d = subprocess.run(sys.argv[2:], capture_output=True, text=True); "
            "e = time.perf_counter(); sys.stdout.write(f'{e - s}\\n' + d.stdout); sys.stderr.write(d.stderr); "
            "sys.exit(d.returncode)"
        )
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", timer, str(node / "nix"), *b_argv],
            env=b_env, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"node B's prepare failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        first, rest = done.stdout.split("\n", 1)
        b_s, b_out = float(first), json.loads(rest)

        assert b_out["run_id"] == run_id, (b_out["run_id"], run_id)
        b_notes = [n for n in b_out["notes"] if n.startswith(("binary cache", "built here"))]
        a_built = [n for n in a_out["notes"] if n.startswith("built:")]
        print(f"training build line: sleep {args.sleep:g}, then write the binary")
        print(f"node A, cold prepare (builds everything):   {a_s:7.3f} s   {'; '.join(a_built)}")
        print(f"node A, publish (build, sign, copy):        {publish_s:7.3f} s   run {run_id}")
        print(f"node B, prepare through the cache:          {b_s:7.3f} s   {'; '.join(b_notes)}")
        print(f"node B's binary: {b_out['bin']['path']}")
        print(f"ratio node B / node A cold: {b_s / a_s:.3f}x  (target <= 0.1x)")
        return 0
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
