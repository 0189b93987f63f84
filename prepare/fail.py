"""Why preparation stopped, and whether trying again could help.

The permanent/transient split is the product: a persist loop or systemd's
restart loop retries a transient Fail (the far side of a mount is down, nothing
is published yet) and stops on a permanent one (no GPU, a spec that does not
parse), so a misprovisioned box stops instead of hot-looping.
"""

from __future__ import annotations


class Fail(Exception):
    """Preparation stopped. `message` is written for an operator: it quotes the
    bad value, names the field or flag to change, and the command that fixes it."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.message = message
        self.permanent = permanent

    @property
    def kind(self) -> str:
        return "permanent" if self.permanent else "transient"

    def __repr__(self) -> str:
        return f"Fail({self.message!r}, permanent={self.permanent})"


def permanent(message: str) -> Fail:
    """Retrying cannot help: report and stop, even under a persist loop."""
    return Fail(message, permanent=True)


def transient(message: str) -> Fail:
    """The next attempt may work: back off and retry."""
    return Fail(message, permanent=False)
