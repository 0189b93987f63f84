"""Step 5: the libtorch variant, and its arch coverage of the offered cards.

The variants and the CUDA arches each ships kernels for come from
*evaluating* the flake's `fdl.variants` (nix/CONTRACT.md): nothing is
fetched or built before a card that the chosen variant ships no kernel for
is refused (permanent). The flake is resolved once first (`pin`), and every
evaluation and build of the attempt names the locked reference that
resolution returned, never the flake's own URL, which could resolve to
another tree a moment later.

These are the plain parts; whether the variants are evaluated at all, or
taken from what an earlier attempt recorded, is the warm path's decision
(prepare.build.warm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prepare.build import record, variants
from prepare.build.plan import BuildPlan
from prepare.fail import Fail

if TYPE_CHECKING:
    from prepare.build.workspace import Workspace
    from prepare.gpu.devices import Gpus

# The version of nix/CONTRACT.md this fdl-prepare speaks.
CONTRACT = 2


@dataclass(frozen=True)
class Flake:
    """The flake as this attempt names it."""

    # As configured, for messages.
    url: str
    # Its `fdl` attribute set: of the locked reference when the resolution
    # could be told, else of the URL.
    fdl: str
    # The warm path's key of that resolution (prepare.build.record); None
    # when it could not be told, and nothing is recorded for it.
    key: str | None = None


def pin(ws: Workspace, url: str) -> Flake:
    """Resolve the flake once (`nix flake metadata`) and pin the attempt to
    it: the warm-path key comes from that resolution, and every evaluation
    and build after it names the locked reference it returned (a flake
    changed between the two, then rolled back, would otherwise leave the
    other tree's outputs recorded under this one's key). A flake whose
    resolution cannot be told is evaluated by its URL."""
    identity = ws.nix.flake_identity(url)
    if identity is None:
        return Flake(url=url, fdl=f"{url}#legacyPackages.{ws.system}.fdl")
    return Flake(
        url=url,
        fdl=f"{identity.locked_url}#legacyPackages.{ws.system}.fdl",
        key=record.key(identity.key, ws.system, CONTRACT),
    )


def evaluate(ws: Workspace, flake: Flake, setting: str = "flake (--flake)") -> Any:
    """The flake's `fdl.variants` as Nix prints them, its contract checked:
    one evaluation, nothing fetched or built. `setting` names where the
    flake was given, for the messages (publish has only the flag)."""
    ws.step("evaluate", f"libtorch variants of {flake.url}")
    meta = ws.nix.eval_json(
        flake.fdl,
        apply="fdl: { contract = fdl.contract or null; variants = fdl.variants or null; }",
        doing=f"evaluating the flake {flake.url!r} ({setting}) for legacyPackages.{ws.system}.fdl",
        fix=f"point {setting} at a flake that follows the fdl-prepare contract (nix/CONTRACT.md) "
        f"for {ws.system}, or fix this one",
    )
    contract = meta.get("contract") if isinstance(meta, dict) else None
    if contract != CONTRACT:
        raise Fail(
            "flake.contract-mismatch",
            f"the flake {flake.url!r} speaks contract {contract!r} (legacyPackages.{ws.system}.fdl.contract), this "
            f"fdl-prepare speaks {CONTRACT}: upgrade fdl-prepare or point {setting} at a matching revision",
        )
    return meta.get("variants")


def choose(plan: BuildPlan, raw: Any, gpus: Gpus | None, notes: list[str]) -> variants.Variant:
    """The variant the spec asks for (`auto`: the one the offered cards
    favour) among the flake's metadata `raw`, its coverage of the offered
    cards checked."""
    offered = variants.parse_variants(raw, plan.flake)
    return variants.choose(plan.libtorch, offered, gpus, plan.cpu_only, plan.flake, notes)
