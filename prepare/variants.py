"""Which libtorch variant a box gets, and whether it can run on the box's cards.

Pure functions over the variant metadata the flake exposes by evaluation
(`legacyPackages.<system>.fdl.variants`: label, CUDA version, arch list) and
the devices the GPU gate offers. Nothing here downloads or builds: the point
of step 4 is to refuse a variant that ships no kernel for an offered card
*before* gigabytes of libtorch are fetched (the Rust reference learns it only
after the download).

Coverage follows how CUDA loads kernels: SASS compiled for `sm_XY` runs on any
card of the same major version with a minor at or above Y, never across a
major version; PTX (`X.Y+PTX`) is JIT-compiled by the driver for any card at or
above X.Y.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prepare.fail import permanent

if TYPE_CHECKING:
    from prepare.gate import Device, Gpus

CPU = "cpu"
AUTO = "auto"

_ARCH = re.compile(r"^\s*(?:sm_)?(\d+)\.?(\d+)?\s*(\+\s*PTX)?\s*$", re.IGNORECASE)


@dataclass(frozen=True, order=True)
class Arch:
    major: int
    minor: int
    ptx: bool = False

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{'+PTX' if self.ptx else ''}"


@dataclass(frozen=True)
class Variant:
    label: str
    cuda: tuple[int, int] | None
    archs: tuple[Arch, ...]

    @property
    def archs_text(self) -> str:
        return ", ".join(str(a) for a in self.archs) if self.archs else "none (CPU only)"


def parse_arch(text: str) -> Arch:
    """An arch as the flake or nvcc writes it ("8.6", "9.0+PTX", "sm_86"). A
    two-digit "86" is read as 8.6, the way TORCH_CUDA_ARCH_LIST spells it."""
    match = _ARCH.match(str(text))
    if not match:
        raise ValueError(f"not a CUDA arch: {text!r}")
    major, minor, ptx = match.group(1), match.group(2), match.group(3)
    if minor is None:
        if len(major) < 2:
            raise ValueError(f"not a CUDA arch: {text!r}")
        major, minor = major[:-1], major[-1]
    return Arch(int(major), int(minor), ptx is not None)


def parse_cuda_version(text: Any) -> tuple[int, int] | None:
    """A variant's `cuda`: "12.8" -> (12, 8), "12" -> (12, 0), null -> None
    (a CPU build). Not Nix's version: that is `nix.parse_nix_version`."""
    if text is None:
        return None
    match = re.match(r"^\s*(\d+)(?:\.(\d+))?", str(text))
    if not match:
        raise ValueError(f"not a version: {text!r}")
    return int(match.group(1)), int(match.group(2) or 0)


def parse_variants(raw: Any, flake: str) -> dict[str, Variant]:
    """The JSON of `fdl.variants` -> label -> Variant. A shape that does not
    follow the contract is the flake's fault and will not fix itself."""
    if not isinstance(raw, Mapping) or not raw:
        raise permanent(
            f"the flake {flake!r} lists no libtorch variants (fdl.variants is {raw!r}); "
            "it does not follow the fdl-prepare flake contract (nix/CONTRACT.md): fix the flake "
            "or point `flake` (--flake) at one that does"
        )
    out: dict[str, Variant] = {}
    for key, meta in raw.items():
        try:
            if not isinstance(meta, Mapping):
                raise ValueError(f"expected an attribute set, got {meta!r}")
            label = str(meta.get("label", key))
            cuda = parse_cuda_version(meta.get("cuda"))
            archs = tuple(parse_arch(a) for a in (meta.get("archs") or ()))
        except ValueError as bad:
            raise permanent(
                f"the flake {flake!r} has malformed metadata for libtorch variant {key!r}: {bad}; "
                'each variant needs label, cuda ("12.8" or null) and archs (["8.6", "9.0+PTX", ...]) '
                "as nix/CONTRACT.md describes: fix the flake"
            ) from None
        out[str(key)] = Variant(label=label, cuda=cuda, archs=archs)
    return out


def covers(archs: Iterable[Arch], capability: tuple[int, int]) -> bool:
    major, minor = capability
    for arch in archs:
        if arch.ptx and (arch.major, arch.minor) <= (major, minor):
            return True
        if arch.major == major and arch.minor <= minor:
            return True
    return False


def _offered(gpus: Gpus | None) -> tuple[Device, ...]:
    return () if gpus is None else gpus.offered


def _covered(archs: Iterable[Arch], device: Device) -> bool:
    """A card whose compute capability NVML did not report is not refused:
    nothing says the variant cannot serve it."""
    return device.capability is None or covers(archs, device.capability)


def _cap_text(cap: tuple[int, int] | None) -> str:
    return "unknown" if cap is None else f"{cap[0]}.{cap[1]}"


def _device_text(device: Device) -> str:
    return f"GPU {device.index} ({device.name}, compute capability {_cap_text(device.capability)})"


def _listing(variants: Mapping[str, Variant]) -> str:
    return ", ".join(
        f"{label} (CUDA {'.'.join(map(str, v.cuda)) if v.cuda else 'none'}; archs {v.archs_text})"
        for label, v in sorted(variants.items())
    )


def choose(
    requested: str | None,
    variants: Mapping[str, Variant],
    gpus: Gpus | None,
    cpu_only: bool,
    flake: str,
    notes: list[str],
) -> Variant:
    """Resolve `libtorch` (a label, "auto", or None meaning auto) to one of the
    flake's variants, and refuse one that cannot serve an offered card."""
    wanted = AUTO if requested is None else requested.strip()
    if cpu_only:
        if wanted not in (AUTO, CPU):
            raise permanent(
                f"libtorch = {wanted!r} needs a GPU, but cpu_only is set (--cpu-only), which allows only "
                f'the {CPU!r} variant: set libtorch = "{CPU}" (--libtorch {CPU}) or "auto", or drop '
                "cpu_only (--no-cpu-only) on a box with a GPU"
            )
        wanted = CPU
    if wanted == AUTO:
        variant = _auto(variants, gpus, flake)
        notes.append(f"libtorch auto: picked {variant.label} ({_why_auto(variant, gpus)})")
    else:
        if wanted not in variants:
            raise permanent(
                f"libtorch = {wanted!r} is not a variant of the flake {flake!r}; it has: {_listing(variants)}. "
                'Set libtorch (--libtorch) to one of those or to "auto", or add the variant by overriding the flake'
            )
        variant = variants[wanted]
    check_coverage(variant, gpus, variants)
    _note_driver(variant, gpus, notes)
    return variant


def _why_auto(variant: Variant, gpus: Gpus | None) -> str:
    if gpus is None or not gpus.offered:
        return "no GPU offered"
    caps = ", ".join(sorted({_cap_text(d.capability) for d in gpus.offered}))
    return f"compute capability {caps}, driver CUDA {_cap_text(gpus.cuda_driver_version)}"


def _auto(variants: Mapping[str, Variant], gpus: Gpus | None, flake: str) -> Variant:
    if gpus is None or not gpus.offered:
        if CPU not in variants:
            raise permanent(
                f'libtorch = "auto" on a box with no GPU needs a {CPU!r} variant, and the flake {flake!r} has '
                f"none (it has: {_listing(variants)}): set libtorch (--libtorch) to one of those or fix the flake"
            )
        return variants[CPU]
    offered = gpus.offered
    driver = gpus.cuda_driver_version
    candidates = [v for v in variants.values() if v.cuda is not None]
    # A driver that reports no CUDA version runs none of them.
    runnable = [v for v in candidates if driver is not None and v.cuda is not None and v.cuda <= driver]
    fitting = [v for v in runnable if all(_covered(v.archs, d) for d in offered)]
    if fitting:
        # The newest CUDA the driver can run: it carries the newest kernels
        # and arch list among those that serve every card.
        return max(fitting, key=lambda v: (v.cuda, v.label))
    cards = "; ".join(_device_text(d) for d in offered)
    if driver is None:
        reason = "the driver did not report the CUDA version it supports"
    elif not runnable:
        reason = f"the driver supports CUDA up to {_cap_text(driver)}, older than every CUDA variant"
    else:
        reason = "no variant the driver can run has kernels for every offered card"
    raise permanent(
        f'libtorch = "auto" found no variant for this box: {reason}. Offered: {cards}. '
        f"Variants of the flake {flake!r}: {_listing(variants)}. Fix: update the NVIDIA driver, "
        "offer only covered cards with devices (--devices), or set libtorch (--libtorch) explicitly "
        "(add a variant for these cards by overriding the flake)"
    )


def check_coverage(variant: Variant, gpus: Gpus | None, variants: Mapping[str, Variant] | None = None) -> None:
    """Permanent Fail naming every offered card the variant ships no kernel for."""
    offered = _offered(gpus)
    # A CPU build runs anywhere; it just leaves the cards idle (noted by `choose`).
    if not offered or variant.cuda is None:
        return
    uncovered = [d for d in offered if not _covered(variant.archs, d)]
    if not uncovered:
        return
    covered = [d for d in offered if d not in uncovered]
    cards = "; ".join(_device_text(d) for d in uncovered)
    fixes = []
    if covered:
        fixes.append(
            f"offer only covered cards with devices = [{', '.join(str(d.index) for d in covered)}] "
            f"(--devices {','.join(str(d.index) for d in covered)})"
        )
    else:
        fixes.append("offer only covered cards with devices (--devices)")
    others = [
        v.label
        for v in (variants or {}).values()
        if v.label != variant.label and all(_covered(v.archs, d) for d in uncovered) and v.archs
    ]
    if others:
        fixes.append(f"pick a variant that covers them: libtorch = {others[0]!r} (--libtorch {others[0]})")
    else:
        fixes.append(
            "pick another variant (libtorch / --libtorch), or add one built for these cards by "
            "overriding the flake (e.g. a cu126 build for Pascal/Volta)"
        )
    raise permanent(
        f"libtorch {variant.label} ships no kernel for {cards}: its CUDA archs are {variant.archs_text}. "
        f"Nothing was downloaded. Fix: {'; or '.join(fixes)}"
    )


def _note_driver(variant: Variant, gpus: Gpus | None, notes: list[str]) -> None:
    if variant.cuda is None and _offered(gpus):
        notes.append(
            f"libtorch {variant.label} has no CUDA: the offered GPUs will sit idle; "
            'set libtorch = "auto" (--libtorch auto) to use them'
        )
        return
    driver = gpus.cuda_driver_version if gpus is not None else None
    if variant.cuda is None or driver is None or not _offered(gpus):
        return
    if variant.cuda > driver:
        notes.append(
            f"libtorch {variant.label} is built for CUDA {_cap_text(variant.cuda)} but the driver supports "
            f"CUDA {_cap_text(driver)}: CUDA calls may fail with 'driver too old' unless a "
            "forward-compatibility package is installed; update the NVIDIA driver"
        )
