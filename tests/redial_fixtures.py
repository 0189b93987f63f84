"""A floDl-shaped training source with real dependencies, for the split
build's tests and bench/redial.py: tests/redial/crate (the run's own crate)
on registry crates, as a floDl source is on crates.io: Debian's packaged cc
and itoa (librust-cc-dev, librust-itoa-dev, a cargo directory registry under
/usr/share/cargo/registry that scripts/setup installs) and the test flake's
own fdl-shim-sys (tests/flake/registry), whose build script compiles a C++
shim against libtorch with the cc crate, as floDl's flodl-sys does.

The source carries only its Cargo.toml, Cargo.lock and code, like a floDl
source; the test flake vendors what Cargo.lock names into the store, as
the production flake's importCargoLock does. Cargo.lock is generated here,
offline, against the same crates.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HERE = Path(__file__).resolve().parent / "redial"
FLAKE_REGISTRY = Path(__file__).resolve().parent / "flake" / "registry"
REGISTRY = Path("/usr/share/cargo/registry")
CARGO = "/usr/bin/cargo"
# Debian's packages of the crates fdl-shim-sys and the run need.
PACKAGED = ("cc", "itoa")


def missing() -> str | None:
    """Why the source cannot be made here, or None."""
    if not os.access(CARGO, os.X_OK):
        return f"{CARGO} is not installed (scripts/setup installs cargo)"
    for name in PACKAGED:
        if not any(REGISTRY.glob(f"{name}-[0-9]*")):
            return f"Debian's librust-{name}-dev is not installed (scripts/setup installs it)"
    return None


def _with_dependencies(names: tuple[str, ...]) -> list[Path]:
    """The registry's newest copy of each crate in `names` and of every crate
    they depend on (optional ones too) that the registry has: what a newer
    Debian's cc needs differs by release (trixie's 1.2.19 wants shlex,
    forky's 1.2.60 find-msvc-tools as well; bookworm's 1.0.73 none), and
    librust-cc-dev installs exactly those."""
    found: dict[str, Path] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        versions = sorted(REGISTRY.glob(f"{name}-[0-9]*"))
        if name in found or not versions:
            continue
        found[name] = versions[-1]
        manifest = tomllib.loads((versions[-1] / "Cargo.toml").read_text())
        tables = [manifest.get("dependencies", {})]
        tables += [t.get("dependencies", {}) for t in manifest.get("target", {}).values()]
        todo += [dep for table in tables for dep in table]
    return list(found.values())


def _digest(tree: Path) -> str:
    """A digest of the crate's files, the `package` checksum of its
    vendored copy (cargo checks it against Cargo.lock, not against a
    download: a directory source has none)."""
    h = hashlib.sha256()
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(tree)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def make_source(dest: Path) -> Path:
    """The run's crate at `dest`, its Cargo.lock generated offline against
    the crates the test flake vendors."""
    shutil.copytree(HERE / "crate", dest)
    scratch = dest.parent / f".cargo-{dest.name}"
    vendor = scratch / "vendor"
    vendor.mkdir(parents=True)
    for found in _with_dependencies(PACKAGED):
        shutil.copytree(found, vendor / found.name)
    for own in FLAKE_REGISTRY.iterdir():
        shutil.copytree(own, vendor / own.name)
        (vendor / own.name / ".cargo-checksum.json").write_text(json.dumps({"package": _digest(own), "files": {}}))
    (scratch / "config.toml").write_text(
        '[source.crates-io]\nreplace-with = "v"\n[source.v]\n' + f"directory = {json.dumps(str(vendor))}\n"
    )
    subprocess.run(
        [CARGO, "generate-lockfile", "--offline"],
        cwd=dest,
        env={"PATH": "/usr/bin:/bin", "CARGO_HOME": str(scratch), "HOME": str(scratch)},
        check=True,
        capture_output=True,
    )
    shutil.rmtree(scratch)
    return dest


def one_line_change(tree: Path, n: int) -> None:
    """The run's crate, changed by one line (the number it asks libtorch to
    sum)."""
    main = tree / "src" / "main.rs"
    text = main.read_text()
    lines = [f"    let n: i64 = {n};" if line.startswith("    let n: i64 = ") else line for line in text.splitlines()]
    main.write_text("\n".join(lines) + "\n")
