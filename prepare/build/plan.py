"""The build's part of the plan (prepare.plan): what steps 4 to 7 are
given, checked before any of them runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from prepare.spec import NixSpec, SourceSpec, SshSpec


@dataclass(frozen=True)
class BuildPlan:
    # The flake's reference, checked: a URL Nix takes as it is, never a
    # path it would resolve against the working directory.
    flake: str
    # "auto", a variant label, or None (with a source: choose automatically).
    libtorch: str | None = None
    cpu_only: bool = False
    # The box's own recipe, its `from` a pinned URL and its values sane;
    # None: build libtorch alone.
    source: SourceSpec | None = None
    # Where the GC roots, the recipe and the lock live, absolute, and where
    # that came from as a message names it ("--state-dir", "$STATE_DIRECTORY,
    # systemd's StateDirectory=", "the default for root").
    state_dir: str = ""
    state_origin: str = ""
    nix: NixSpec = field(default_factory=NixSpec)
    build_timeout_s: float | None = None
    refresh: bool = False
    # The ssh block: how an rsync:// or git+ssh source is reached.
    ssh: SshSpec | None = None
