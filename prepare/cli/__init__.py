"""The `fdl-prepare` command: its parser and commands (`app`), the one
place an outcome becomes output and an exit code (`report`), the progress
display (`progress`) and shell completion made from the parser
(`completion`)."""

from prepare.cli.app import main, publish_main
from prepare.cli.report import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PERMANENT,
    EXIT_SOFTWARE,
    EXIT_TRANSIENT,
    EXIT_USAGE,
)

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PERMANENT",
    "EXIT_SOFTWARE",
    "EXIT_TRANSIENT",
    "EXIT_USAGE",
    "main",
    "publish_main",
]
