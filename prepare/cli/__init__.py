"""The `fdl-prepare` command (`app`) and its progress display (`progress`)."""

from prepare.cli.app import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PERMANENT,
    EXIT_SOFTWARE,
    EXIT_TRANSIENT,
    EXIT_USAGE,
    main,
    publish_main,
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
