"""The library's face (prepare/__init__.py): what a join loop imports, and
what importing it costs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_JOIN_LOOP = """
import json, sys
from prepare import (
    DataSpec, Fail, NixSpec, Prepared, PrepareSpec, SourceSpec, SshSpec, is_warning, prepare, print_notes,
)

heavy = sorted(m for m in ("prepare.cli", "prepare.gpu.nvml", "pynvml", "argparse", "socket") if m in sys.modules)
notes: list[str] = []
spec = PrepareSpec(data=DataSpec(data_path=sys.argv[1]), ssh=SshSpec(), nix=NixSpec(), cpu_only=True)
try:
    done = prepare(spec, notes)
    outcome = {"prepared": isinstance(done, Prepared)}
except Fail as fail:
    outcome = {"fail": fail.reason, "permanent": fail.permanent}
finally:
    print_notes("join", notes)
print(json.dumps({"heavy": heavy, **outcome, "warnings": [n for n in notes if is_warning(n)],
                  "source_spec": SourceSpec.__name__}))
"""


def test_a_join_loop_imports_everything_it_needs_from_prepare_and_nothing_heavy(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    missing = tmp_path / "no-such-dataset"
    done = subprocess.run(
        [sys.executable, "-c", _JOIN_LOOP, str(missing)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    # Importing the library loads neither the CLI nor NVML's bindings: a
    # join loop pays for the steps it runs.
    assert out["heavy"] == []
    assert out["fail"] == "data.root-unusable" and out["permanent"] is True
    assert done.stderr.startswith("join: GPU gate skipped: cpu_only is set")
