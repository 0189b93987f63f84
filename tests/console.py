"""The installed console script, as operators and systemd run it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def console_script() -> str:
    beside = Path(sys.executable).parent / "fdl-prepare"
    if beside.exists():
        return str(beside)
    found = shutil.which("fdl-prepare")
    if found is None:
        pytest.skip("the fdl-prepare console script is not installed (pip install -e .)")
    return found


def fdl_prepare(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([console_script(), *args], env=env, capture_output=True, text=True, timeout=timeout)
