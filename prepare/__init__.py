"""fdl-prepare: get a GPU worker box ready before it dials a training controller.

    from prepare import prepare, check, print_notes, PrepareSpec, DataSpec, SourceSpec, SshSpec, NixSpec, Prepared, Fail

The library never prints and never exits: `prepare` returns a `Prepared` or
raises a `Fail` (`.permanent`, `.reason`, `.message`) and appends advisory lines to the
caller's `notes`; `check` says what an attempt would do without doing it (a `Checked`,
whose `.fail` is the Fail the attempt would stop on); only `print_notes` and the CLI write
anything.
"""

from __future__ import annotations

from prepare.fail import Fail
from prepare.notes import print_notes
from prepare.pipeline import check, prepare
from prepare.spec import (
    Binary,
    Checked,
    DataSpec,
    Libtorch,
    NixSpec,
    Prepared,
    PrepareSpec,
    SourceSpec,
    SshSpec,
    StepCheck,
)

__version__ = "0.1.0"

__all__ = [
    "Binary",
    "Checked",
    "DataSpec",
    "Fail",
    "Libtorch",
    "NixSpec",
    "PrepareSpec",
    "Prepared",
    "SourceSpec",
    "SshSpec",
    "StepCheck",
    "__version__",
    "check",
    "prepare",
    "print_notes",
]
