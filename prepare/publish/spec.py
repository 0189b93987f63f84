"""What a publish is asked for (`PublishSpec`) and what it gives back
(`Published`, an `Output` per variant)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PublishSpec:
    """What to publish and where. `source` is the training source tree (a
    directory; a git checkout is published as its committed HEAD)."""

    source: str
    bin: str
    variants: tuple[str, ...]
    to: str
    signing_key: str
    cwd: str = "."
    build: str | None = None
    args: tuple[str, ...] = ()
    flake: str | None = None
    state_dir: str | None = None
    build_timeout_s: float | None = None
    commit: bool = False
    push: bool = False


@dataclass(frozen=True)
class Output:
    libtorch: str
    training: str
    bin: str


@dataclass(frozen=True)
class Published:
    run_id: str
    manifest: str
    to: str
    outputs: Mapping[str, Output]
    # git only: the commit that was built, the manifest's commit, whether it was pushed.
    rev: str | None = None
    commit: str | None = None
    pushed: bool = False
    # What to run next, when the manifest still has to be committed or pushed.
    next_step: str | None = None
    timings: dict[str, float] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run_id,
            "manifest": self.manifest,
            "to": self.to,
            "outputs": {label: dataclasses.asdict(out) for label, out in self.outputs.items()},
            "rev": self.rev,
            "commit": self.commit,
            "pushed": self.pushed,
            "next": self.next_step,
        }
