"""Which libtorch variant a box gets, and whether it can run on the box's cards.

Pure functions over the variant metadata the flake exposes by evaluation
(`legacyPackages.<system>.fdl.variants`: label, CUDA version, arch list) and
the devices the GPU gate offers. Nothing here downloads or builds: the point
of step 5 is to refuse a variant that ships no kernel for an offered card
*before* gigabytes of libtorch are fetched (the Rust reference learns it only
after the download).

Coverage follows how CUDA loads kernels: SASS compiled for `sm_XY` runs on any
card of the same major version with a minor at or above Y, never across a
major version; PTX (`X.Y+PTX`) is JIT-compiled by the driver for any card at or
above X.Y.

A ROCm variant (`vendor = "amd"`) lists gfx targets instead, and AMD code
objects have no forward compatibility: a card is covered only by its own
target (gfx1101 does not run gfx1100 kernels). Each variant is checked
against its own vendor's offered cards only: the other vendor's cards sit
idle under it (noted), and never block it. `auto` picks CUDA on a box that
offers NVIDIA cards only, ROCm on one that offers AMD cards only, and on a
box that offers both, the vendor with more cards (NVIDIA on a tie), saying
why; a vendor no variant serves falls back to the other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prepare.fail import Fail
from prepare.notes import warning

if TYPE_CHECKING:
    from prepare.gpu.amd import AmdDevice
    from prepare.gpu.devices import Device, Gpus

CPU = "cpu"
AUTO = "auto"
NVIDIA = "nvidia"
AMD = "amd"
VENDORS = (NVIDIA, AMD)

_ARCH = re.compile(r"^\s*(?:sm_)?(\d+)\.?(\d+)?\s*(\+\s*PTX)?\s*$", re.IGNORECASE)
# A processor, optionally with target features ("gfx90a:xnack-"): the code
# object is for the processor either way. Generic targets (gfx11-generic)
# are not understood here, and the contract refuses them.
_GFX = re.compile(r"^(gfx[0-9a-f]+)(?::[a-z-]+[+-])*$")


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
    # "nvidia", "amd", or None for a CPU build; a flake from before vendors
    # existed says nothing, and a CUDA version then means NVIDIA.
    vendor: str | None = None
    gfx: tuple[str, ...] = ()
    rocm: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.vendor is None and self.cuda is not None:
            object.__setattr__(self, "vendor", NVIDIA)

    @property
    def archs_text(self) -> str:
        return ", ".join(str(a) for a in self.archs) if self.archs else "none (CPU only)"

    @property
    def gfx_text(self) -> str:
        return ", ".join(self.gfx) if self.gfx else "none"

    @property
    def runtime(self) -> str:
        """How the variant is named to an operator: "CUDA 12.8", "ROCm 7.0", "CPU"."""
        if self.vendor == AMD:
            return f"ROCm {_cap_text(self.rocm)}"
        return "CPU" if self.cuda is None else f"CUDA {_cap_text(self.cuda)}"


def nix_attr(label: str) -> str:
    """A label as one attribute in an installable's path: `rocm7.0` unquoted
    would be the attribute `0` of `rocm7`."""
    return label if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_'-]*", label) else f'"{label}"'


def parse_gfx(text: Any) -> str:
    """A ROCm target as PyTorch's PYTORCH_ROCM_ARCH spells it ("gfx942",
    "gfx90a:xnack-"), as the processor name the card reports."""
    match = _GFX.match(str(text).strip().lower()) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"not a ROCm gfx target: {text!r}")
    return match.group(1)


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
        raise Fail(
            "flake.contract-broken",
            f"the flake {flake!r} lists no libtorch variants (fdl.variants is {raw!r}); "
            "it does not follow the fdl-prepare flake contract (nix/CONTRACT.md): fix the flake "
            "or point `flake` (--flake) at one that does",
        )
    out: dict[str, Variant] = {}
    for key, meta in raw.items():
        try:
            if not isinstance(meta, Mapping):
                raise ValueError(f"expected an attribute set, got {meta!r}")
            label = str(meta.get("label", key))
            cuda = parse_cuda_version(meta.get("cuda"))
            archs = tuple(parse_arch(a) for a in (meta.get("archs") or ()))
            vendor = meta.get("vendor")
            if vendor not in (*VENDORS, None):
                raise ValueError(f'vendor {vendor!r} is not "nvidia", "amd" or null')
            gfx = tuple(dict.fromkeys(parse_gfx(g) for g in (meta.get("gfx") or ())))
            rocm = parse_cuda_version(meta.get("rocm"))
            if vendor == AMD and not gfx:
                raise ValueError('a ROCm variant (vendor = "amd") needs gfx targets (["gfx942", ...])')
            if vendor == NVIDIA and cuda is None:
                raise ValueError('vendor "nvidia" needs a cuda version')
        except ValueError as bad:
            raise Fail(
                "flake.contract-broken",
                f"the flake {flake!r} has malformed metadata for libtorch variant {key!r}: {bad}; "
                'each variant needs label, cuda ("12.8" or null) and archs (["8.6", "9.0+PTX", ...]), and a ROCm '
                'one vendor = "amd", rocm ("7.0") and gfx (["gfx942", ...]), as nix/CONTRACT.md describes: fix the flake',
            ) from None
        out[str(key)] = Variant(label=label, cuda=cuda, archs=archs, vendor=vendor, gfx=gfx, rocm=rocm)
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


def _amd_offered(gpus: Gpus | None) -> tuple[AmdDevice, ...]:
    return () if gpus is None else gpus.amd_offered


def _covered(archs: Iterable[Arch], device: Device) -> bool:
    """A card whose compute capability NVML did not report is not refused:
    nothing says the variant cannot serve it."""
    return device.capability is None or covers(archs, device.capability)


def _gfx_covered(gfx: Iterable[str], device: AmdDevice) -> bool:
    """Only the card's own target runs its kernels; a card whose target the
    driver did not report is not refused."""
    return device.target is None or device.target in gfx


def _cap_text(cap: tuple[int, int] | None) -> str:
    return "unknown" if cap is None else f"{cap[0]}.{cap[1]}"


def _device_text(device: Device) -> str:
    return f"GPU {device.index} ({device.name}, compute capability {_cap_text(device.capability)})"


def _amd_text(device: AmdDevice) -> str:
    target = device.target or "target unknown"
    if device.gfx is not None and device.target is not None and device.gfx != device.target:
        target = f"{device.gfx}, run as {device.target} by HSA_OVERRIDE_GFX_VERSION"
    return f"AMD GPU {device.index} ({device.name or 'name unknown'}, {target})"


def _listing(variants: Mapping[str, Variant]) -> str:
    return ", ".join(
        f"{label} (ROCm {_cap_text(v.rocm)}; gfx {v.gfx_text})"
        if v.vendor == AMD
        else f"{label} (CUDA {'.'.join(map(str, v.cuda)) if v.cuda else 'none'}; archs {v.archs_text})"
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
        # The plan refused any other libtorch with cpu_only (a rule across
        # the two fields, prepare.config.fields).
        wanted = CPU
    if wanted == AUTO:
        variant, why = _auto(variants, gpus, flake)
        notes.append(f"libtorch auto: picked {variant.label} ({why})")
    else:
        if wanted not in variants:
            raise Fail(
                "libtorch.unknown-variant",
                f"libtorch = {wanted!r} is not a variant of the flake {flake!r}; it has: {_listing(variants)}. "
                'Set libtorch (--libtorch) to one of those or to "auto", or add the variant by overriding the flake',
            )
        variant = variants[wanted]
    check_coverage(variant, gpus, variants)
    _note_driver(variant, gpus, notes)
    return variant


def _why_cuda(gpus: Gpus) -> str:
    caps = ", ".join(sorted({_cap_text(d.capability) for d in gpus.offered}))
    return f"compute capability {caps}, driver CUDA {_cap_text(gpus.cuda_driver_version)}"


def _why_rocm(gpus: Gpus) -> str:
    targets = ", ".join(sorted({d.target or "unknown" for d in gpus.amd_offered}))
    return f"AMD GPUs with gfx target {targets}: the newest ROCm variant with kernels for all of them"


def _auto(variants: Mapping[str, Variant], gpus: Gpus | None, flake: str) -> tuple[Variant, str]:
    nvidia, amd = _offered(gpus), _amd_offered(gpus)
    if gpus is None or (not nvidia and not amd):
        if CPU not in variants:
            raise Fail(
                "libtorch.no-variant",
                f'libtorch = "auto" on a box with no GPU needs a {CPU!r} variant, and the flake {flake!r} has '
                f"none (it has: {_listing(variants)}): set libtorch (--libtorch) to one of those or fix the flake",
            )
        return variants[CPU], "no GPU offered"
    if not amd:
        return _auto_cuda(variants, gpus, flake), _why_cuda(gpus)
    if not nvidia:
        return _auto_rocm(variants, gpus, flake), _why_rocm(gpus)
    # One libtorch build serves one vendor's cards. More cards is more
    # training; on a tie CUDA, the longer-proven path.
    box = gpus
    count = {NVIDIA: len(nvidia), AMD: len(amd)}
    order = (AMD, NVIDIA) if count[AMD] > count[NVIDIA] else (NVIDIA, AMD)
    name = {NVIDIA: "NVIDIA", AMD: "AMD"}

    def pick(vendor: str) -> tuple[Variant, str]:
        if vendor == NVIDIA:
            return _auto_cuda(variants, box, flake), _why_cuda(box)
        return _auto_rocm(variants, box, flake), _why_rocm(box)

    mixed = (
        f"this box offers {count[NVIDIA]} NVIDIA and {count[AMD]} AMD GPU(s) and one libtorch serves one vendor's cards"
    )
    first, second = order
    try:
        variant, why = pick(first)
    except Fail as missed:
        try:
            variant, why = pick(second)
        except Fail as also:
            raise Fail(
                "libtorch.no-variant",
                f'libtorch = "auto" found no variant for either vendor on this box. {name[first]}: '
                f"{missed.message}. {name[second]}: {also.message}",
            ) from None
        return variant, f"{why}; {mixed}, and no variant serves the {name[first]} ones"
    reason = "more of them" if count[first] != count[second] else "as many, and NVIDIA wins a tie"
    return variant, f"{why}; {mixed}: the {name[first]} ones, {reason}"


def _auto_cuda(variants: Mapping[str, Variant], gpus: Gpus, flake: str) -> Variant:
    offered = gpus.offered
    driver = gpus.cuda_driver_version
    candidates = [v for v in variants.values() if v.cuda is not None and v.vendor != AMD]
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
    raise Fail(
        "libtorch.no-variant",
        f'libtorch = "auto" found no variant for this box: {reason}. Offered: {cards}. '
        f"Variants of the flake {flake!r}: {_listing(variants)}. Fix: update the NVIDIA driver, "
        "offer only covered cards with devices (--devices), or set libtorch (--libtorch) explicitly "
        "(add a variant for these cards by overriding the flake)",
    )


def _auto_rocm(variants: Mapping[str, Variant], gpus: Gpus, flake: str) -> Variant:
    offered = gpus.amd_offered
    candidates = [v for v in variants.values() if v.vendor == AMD]
    fitting = [v for v in candidates if all(_gfx_covered(v.gfx, d) for d in offered)]
    if fitting:
        # The newest ROCm among those that serve every card.
        return max(fitting, key=lambda v: (v.rocm or (0, 0), v.label))
    cards = "; ".join(_amd_text(d) for d in offered)
    if not candidates:
        reason = 'the flake has no ROCm variant (vendor = "amd")'
    else:
        reason = "no ROCm variant has kernels for every offered card"
    raise Fail(
        "libtorch.no-variant",
        f'libtorch = "auto" found no variant for this box: {reason}. Offered: {cards}. '
        f"Variants of the flake {flake!r}: {_listing(variants)}. Fix: offer only covered cards with devices "
        "(--devices) or ROCR_VISIBLE_DEVICES, or add a ROCm variant built for these targets by overriding the "
        'flake (nix/CONTRACT.md, "Adding a variant"), or, for a CPU-only worker, pass --cpu-only',
    )


def check_coverage(variant: Variant, gpus: Gpus | None, variants: Mapping[str, Variant] | None = None) -> None:
    """Permanent Fail naming every offered card of the variant's vendor that
    it ships no kernel for, or, when the box offers only the other vendor's
    cards, naming that."""
    nvidia, amd = _offered(gpus), _amd_offered(gpus)
    # A CPU build runs anywhere; it just leaves the cards idle (noted by `choose`).
    if variant.vendor is None:
        return
    own, other = (amd, nvidia) if variant.vendor == AMD else (nvidia, amd)
    if not own:
        if other:
            _refuse_other_vendor(variant, gpus, variants)
        return
    if variant.vendor == AMD:
        _check_gfx(variant, amd, variants or {})
        return
    offered = nvidia
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
    raise Fail(
        "libtorch.arch-uncovered",
        f"libtorch {variant.label} ships no kernel for {cards}: its CUDA archs are {variant.archs_text}. "
        f"Nothing was downloaded. Fix: {'; or '.join(fixes)}",
    )


def _check_gfx(variant: Variant, offered: Sequence[AmdDevice], variants: Mapping[str, Variant]) -> None:
    uncovered = [d for d in offered if not _gfx_covered(variant.gfx, d)]
    if not uncovered:
        return
    covered = [d for d in offered if d not in uncovered]
    cards = "; ".join(_amd_text(d) for d in uncovered)
    fixes = []
    if covered:
        indices = [str(d.index) for d in covered]
        fixes.append(
            f"offer only covered cards with devices = [{', '.join(indices)}] (--devices {','.join(indices)}) "
            f"or ROCR_VISIBLE_DEVICES={','.join(indices)}"
        )
    else:
        fixes.append("offer only covered cards with devices (--devices) or ROCR_VISIBLE_DEVICES")
    others = [
        v.label
        for v in variants.values()
        if v.vendor == AMD and v.label != variant.label and all(_gfx_covered(v.gfx, d) for d in uncovered)
    ]
    if others:
        fixes.append(f"pick a variant that covers them: libtorch = {others[0]!r} (--libtorch {others[0]})")
    else:
        fixes.append(
            "pick another variant (libtorch / --libtorch), or add a ROCm build for these targets by "
            'overriding the flake (nix/CONTRACT.md, "Adding a variant")'
        )
    raise Fail(
        "libtorch.arch-uncovered",
        f"libtorch {variant.label} ships no kernel for {cards}: its ROCm gfx targets are {variant.gfx_text}, and "
        f"an AMD GPU runs only kernels built for its own target. Nothing was downloaded. Fix: {'; or '.join(fixes)}",
    )


def _refuse_other_vendor(variant: Variant, gpus: Gpus | None, variants: Mapping[str, Variant] | None) -> None:
    """A CUDA build on a box of AMD cards (or the reverse) runs on none of
    them: a golden image's libtorch pinned by label on the wrong box."""
    if variant.vendor == AMD:
        cards = ", ".join(f"GPU {d.index} ({d.name})" for d in _offered(gpus))
        have, want = "NVIDIA", "CUDA"
    else:
        from prepare.gpu.amd import labels

        offered = _amd_offered(gpus)
        targets = ", ".join(dict.fromkeys(d.target or "target unknown" for d in offered))
        cards = f"{labels(offered)}; {targets}"
        have, want = "AMD", "ROCm"
    own = [v.label for v in (variants or {}).values() if v.vendor == (AMD if have == "AMD" else NVIDIA)]
    pick = (
        f"or one of the flake's {want} variants ({', '.join(sorted(own))})"
        if own
        else f"(the flake has no {want} variant)"
    )
    raise Fail(
        "libtorch.wrong-vendor",
        f"libtorch {variant.label} is a {variant.runtime} build, but this box offers {have} GPUs only ({cards}): "
        f'it cannot run on them. Set libtorch = "auto" (--libtorch auto) {pick}, or pass --cpu-only on a '
        "CPU-only worker",
    )


def _note_driver(variant: Variant, gpus: Gpus | None, notes: list[str]) -> None:
    nvidia, amd = _offered(gpus), _amd_offered(gpus)
    if variant.vendor is None and (nvidia or amd):
        if not amd:
            notes.append(
                warning(
                    f"libtorch {variant.label} has no CUDA: the offered GPUs will sit idle; "
                    'set libtorch = "auto" (--libtorch auto) to use them'
                )
            )
        else:
            notes.append(
                warning(
                    f"libtorch {variant.label} is a CPU build: the offered GPUs will sit idle; "
                    'set libtorch = "auto" (--libtorch auto) to use them'
                )
            )
        return
    idle = amd if variant.vendor == NVIDIA else nvidia
    if idle and (nvidia if variant.vendor == NVIDIA else amd):
        which = "AMD" if variant.vendor == NVIDIA else "NVIDIA"
        notes.append(
            warning(
                f"libtorch {variant.label} is a {variant.runtime} build: the {len(idle)} offered {which} GPU(s) sit "
                "idle in this run"
            )
        )
    if variant.vendor != NVIDIA:
        return
    driver = gpus.cuda_driver_version if gpus is not None else None
    if variant.cuda is None or driver is None or not nvidia:
        return
    if variant.cuda > driver:
        notes.append(
            warning(
                f"libtorch {variant.label} is built for CUDA {_cap_text(variant.cuda)} but the driver supports "
                f"CUDA {_cap_text(driver)}: CUDA calls may fail with 'driver too old' unless a "
                "forward-compatibility package is installed; update the NVIDIA driver"
            )
        )
