"""fdl-prepare: get a GPU worker box ready before it dials a training controller.

    from prepare import prepare, check, print_notes, PrepareSpec, DataSpec, SourceSpec, SshSpec, NixSpec, Prepared, Fail

The library never prints and never exits: `prepare` returns a `Prepared` or
raises a `Fail` (`.permanent`, `.reason`, `.message`) and appends advisory lines to the
caller's `notes`; `check` says what an attempt would do without doing it (a `Checked`,
whose `.fail` is the Fail the attempt would stop on); only `print_notes` and the CLI write
anything. A note that says something is wrong (a sick card left out) is still a `str`;
`is_warning(note)` tells it apart, and `print_notes` writes it at warning priority when
stderr is the journal.
"""

from __future__ import annotations

from prepare.fail import Fail
from prepare.notes import is_warning, print_notes
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
    "is_warning",
    "prepare",
    "print_notes",
]
