"""Running a piece of the package as another user, on any box.

Permission checks that root skips are only real for someone else, so some
tests run a child as a uid with no rights. That child must be able to
execute an interpreter and read the package: a virtual environment or a
checkout under a 0700 home (/root on Debian) is neither, so the package
source is copied once per session into a directory every user may read,
and the interpreter is the first of the candidates that uid may execute.
The steps run this way need nothing outside the standard library.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "prepare"


@cache
def readable_package_root() -> str:
    """A PYTHONPATH entry holding a copy of `prepare/` that any uid may read."""
    root = Path(tempfile.mkdtemp(prefix="fdl-readable-"))
    root.chmod(0o755)
    shutil.copytree(PACKAGE, root / "prepare", ignore=shutil.ignore_patterns("__pycache__"))
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return str(root)


def remove_readable_package() -> None:
    if readable_package_root.cache_info().currsize:
        shutil.rmtree(readable_package_root(), ignore_errors=True)
        readable_package_root.cache_clear()


def python_for(uid: int) -> str:
    """An interpreter `uid` may execute (a pyenv or a venv under /root is not one)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            done = subprocess.run(
                [candidate, "-c", "import sys; assert sys.version_info >= (3, 10)"],
                user=uid, group=uid, extra_groups=[], cwd="/",
                capture_output=True, timeout=30, check=False,
            )  # fmt: skip
        except OSError:
            continue
        if done.returncode == 0:
            return candidate
    pytest.skip(f"no Python 3.10+ interpreter that uid {uid} may execute")


def run_as(uid: int, code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -c code` as `uid` (no groups), with the readable package copy."""
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": readable_package_root()}
    return subprocess.run(
        [python_for(uid), "-c", code],
        env={**base, **(env or {})}, user=uid, group=uid, extra_groups=[], cwd="/",
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def real_user(prefix: str = "fdlt") -> Iterator[pwd.struct_passwd]:
    """A user of this box for one test, with a home of its own (0700, its
    own) under a directory every user may enter; removed, home and all,
    afterwards. For the steps that look a user up in the password database
    (the training user): a bare uid has no name, home or groups. Root only."""
    if os.geteuid() != 0:
        pytest.skip("creating a user needs root")
    if shutil.which("useradd") is None:
        pytest.skip("no useradd on this box")
    name = f"{prefix}{os.urandom(4).hex()}"
    top = Path(tempfile.mkdtemp(prefix="fdl-users-", dir="/tmp"))
    top.chmod(0o755)
    home = top / name
    subprocess.run(
        ["useradd", "--home-dir", str(home), "--create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    try:
        home.chmod(0o700)
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60, check=False)
        subprocess.run(["groupdel", name], capture_output=True, timeout=60, check=False)
        shutil.rmtree(top, ignore_errors=True)


def reachable_dir(prefix: str) -> Path:
    """A new directory (0755) every user can reach, outside /tmp, /var/tmp
    and /dev/shm: the smoke run, run as root, gets fresh ones of its own
    there (prepare/host/confine_helper.py), so a binary or an outbox of a
    test's under them would be out of its sight. Skips where root may
    write none of /var/lib, /var/cache, /run."""
    for base in ("/var/lib", "/var/cache", "/run"):
        if os.path.isdir(base) and os.access(base, os.W_OK) and os.stat(base).st_mode & 0o001:
            made = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
            made.chmod(0o755)
            return made
    pytest.skip("no directory outside /tmp that root may write and every user may reach (/var/lib, /var/cache, /run)")
