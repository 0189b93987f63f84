"""`fdl-prepare gpus`: the survey as tables, one per vendor, and the
health of each NVIDIA card."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prepare.gpu.amd import AmdGpus
    from prepare.gpu.devices import Gpus


def format_table(gpus: Gpus) -> str:
    """The survey as aligned plain text: one row per device, its status
    saying whether it is offered, masked (and by what) or unusable (and why).
    A box with AMD GPUs gets a second table, numbered as ROCm numbers them."""
    if gpus.amd is None:
        return _nvidia_table(gpus)
    nvidia = f"NVIDIA: none ({gpus.nvidia_error})" if gpus.nvidia_error is not None else _nvidia_table(gpus)
    return nvidia + "\n\n" + _amd_table(gpus.amd)


def _aligned(head: str, rows: Sequence[tuple[str, ...]], last: str) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]) - 1)]
    lines = [head]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    lines.append(last)
    return "\n".join(lines)


def _nvidia_table(gpus: Gpus) -> str:
    cuda = gpus.cuda_driver_version
    head = (
        f"NVIDIA driver {gpus.driver_version or 'unknown'}, "
        f"CUDA {'unknown' if cuda is None else f'{cuda[0]}.{cuda[1]}'}"
    )
    if not gpus.devices:
        return f"{head}\nno NVIDIA device"
    offered = set(gpus.offered_indices)
    rows = [("IDX", "NAME", "UUID", "CC", "MEMORY", "STATUS")]
    for d in gpus.devices:
        if not d.usable:
            status = f"unusable: {d.error}"
        elif d.problems:
            status = "unhealthy, not offered: " + "; ".join(c.detail for c in d.problems)
        elif d.not_ready:
            status = "not ready, not offered: " + "; ".join(c.detail for c in d.not_ready)
        elif d.index in offered:
            status = "offered"
        else:
            status = f"masked by {gpus.masked_by(d.index) or 'the masks'}"
        rows.append(
            (str(d.index), d.name or "-", d.uuid or "-", d.capability_label or "-", _gib(d.memory_total), status)
        )
    return _aligned(head, rows, "offered: " + (", ".join(str(i) for i in gpus.offered_indices) or "none"))


def format_health(gpus: Gpus) -> str:
    """Each NVIDIA card's health checks, a line a card, with what fixes a
    sick one; "" on a box without NVIDIA cards."""
    if not gpus.devices:
        return ""
    lines = ["NVIDIA health (NVML):"]
    for d in gpus.devices:
        if not d.health:
            lines.append(f"  GPU {d.index}: not read ({d.error or 'unusable'})")
            continue
        verdict = "sick" if d.problems else "not ready" if d.not_ready else "ok"
        lines.append(f"  GPU {d.index}: {verdict}: " + "; ".join(c.detail for c in d.health))
        lines += [f"    fix ({c.name}): {c.action}" for c in d.problems + d.not_ready if c.action]
    return "\n".join(lines)


def _amd_table(amd: AmdGpus) -> str:
    head = "AMD (amdgpu KFD topology)" + (
        f", HSA_OVERRIDE_GFX_VERSION: kernels for {amd.gfx_override}" if amd.gfx_override else ""
    )
    if not amd.devices:
        return f"{head}\nno AMD GPU with compute units"
    if amd.blocked is not None:
        head += f"\nno AMD GPU is usable: {amd.blocked}"
    offered = set(amd.offered_indices)
    # IDX is ROCm's number (devices, ROCR_VISIBLE_DEVICES); RUN is the
    # device number the run sees after the masks.
    rows = [("IDX", "RUN", "NAME", "GFX", "UUID", "PCI", "MEMORY", "STATUS")]
    for d in amd.devices:
        if not d.usable:
            status = f"unusable: {d.error}"
        elif d.index in offered:
            status = "offered"
        else:
            status = f"masked by {amd.masked_by(d.index) or 'the masks'}"
        run = amd.run_index(d.index) if d.index in offered else None
        gfx = d.gfx or "-"
        if d.target is not None and d.target != d.gfx:
            gfx = f"{gfx}->{d.target}"
        rows.append(
            (
                "-" if d.index is None else str(d.index),
                "-" if run is None else str(run),
                d.name or "-",
                gfx,
                d.uuid or "-",
                d.pci or "-",
                _gib(d.memory_total),
                status,
            )
        )
    return _aligned(head, rows, "offered (AMD): " + (", ".join(str(i) for i in amd.offered_indices) or "none"))


def _gib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**30:.1f} GiB"
