"""`fdl-prepare gpus`: the survey as tables, one per vendor, and the
health of each NVIDIA card, fitted to the terminal.

A table fits `width` columns (prepare.cli.report passes the terminal's,
80 when stdout is not one): the columns that identify a card least (the
UUID, then the PCI address) are left out first, said under the head, since
`--json` (and `nvidia-smi -L`) carry them; then the NAME is cut, with
"..."; the STATUS column, which says why a card is not offered, is
wrapped, never cut; only where even that leaves it no room does it move
to lines of its own under the row. No line is ever wider than `width`.

Every string a driver gave (a card's name, NVML's error words, a board's
product_name from sysfs) is escaped (prepare.host.human.printable, and a
tab as \\t), so a name cannot drive the terminal, forge a line or break
the columns.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prepare.host.human import MIN_WIDTH, printable, wrapped

if TYPE_CHECKING:
    from prepare.gpu.amd import AmdGpus
    from prepare.gpu.devices import Gpus


# What a wrapped STATUS column keeps at the least before it moves to
# lines of its own.
MIN_STATUS = 30


def format_table(gpus: Gpus, width: int | None = None) -> str:
    """The survey as aligned plain text: one row per device, its status
    saying whether it is offered, masked (and by what) or unusable (and why).
    A box with AMD GPUs gets a second table, numbered as ROCm numbers them.
    `width`: the columns every line fits in (None: no limit)."""
    if gpus.amd is None:
        return _nvidia_table(gpus, width)
    nvidia = (
        wrapped(_safe(f"NVIDIA: none ({gpus.nvidia_error})"), width)
        if gpus.nvidia_error is not None
        else _nvidia_table(gpus, width)
    )
    return nvidia + "\n\n" + _amd_table(gpus.amd, width)


def _safe(text: str) -> str:
    """A string from a driver, safe in a table: escaped, one line, no tab."""
    return printable(text).replace("\t", "\\t")


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 3, 1)] + "..."


def _aligned(
    head: str,
    rows: Sequence[tuple[str, ...]],
    last: str,
    width: int | None,
    drop: Sequence[int] = (),
    shrink: tuple[int, int] | None = None,
) -> str:
    """`rows` (the first is the header) in columns two spaces apart, the
    last column free text. Within `width`, the first of these that works:
    the columns as they are; without the `drop` columns, one more at a
    time (said under the head); then the `shrink` column (index, narrowest)
    cut as far as needed. Works means the whole last column fits beside
    them, else that MIN_STATUS of it does (it wraps under itself); else a
    status too long for its place goes on lines of its own under its row,
    beside the first of them whose other columns fit."""
    rows = [tuple(_safe(cell) for cell in row) for row in rows]
    head = "\n".join(_safe(line) for line in head.split("\n"))
    columns = len(rows[0]) - 1
    natural = [max(len(row[c]) for row in rows) for c in range(columns)]
    longest = max(len(row[-1]) for row in rows)
    # Each layout: the width of each column, None for one left out.
    layouts: list[list[int | None]] = [list(natural)]
    if width is not None:
        width = max(width, MIN_WIDTH)
        for column in drop:
            layouts.append([None if c == column else w for c, w in enumerate(layouts[-1])])
        if shrink is not None:
            column, narrowest = shrink
            widths = list(layouts[-1])
            shown = [w for w in widths if w is not None]
            over = sum(shown) + 2 * len(shown) + MIN_STATUS - width
            current = widths[column]
            if over > 0 and current is not None:
                widths[column] = max(min(narrowest, current), current - over)
                layouts.append(widths)

    def lead(widths: Sequence[int | None]) -> int:
        shown = [w for w in widths if w is not None]
        return sum(shown) + 2 * len(shown)

    chosen = layouts[0]
    if width is not None:
        fitting = (
            [w for w in layouts if lead(w) + longest <= width]
            or [w for w in layouts if width - lead(w) >= MIN_STATUS]
            or [w for w in layouts if lead(w) - 2 <= width]
            or [layouts[-1]]
        )
        chosen = fitting[0]
    room = None if width is None else width - lead(chosen)
    left_out = [rows[0][c] for c, w in enumerate(chosen) if w is None]
    if left_out:
        head += f"\n({', '.join(left_out)} left out to fit {width} columns; --json has {'it' if len(left_out) == 1 else 'them'})"
    lines = [wrapped(head, width)]
    for row in rows:
        cells = [_cut(cell, w).ljust(w) for cell, w in zip(row, chosen, strict=False) if w is not None]
        status = row[-1]
        if room is None or len(status) <= room:
            lines.append("  ".join([*cells, status]).rstrip())
        elif room >= MIN_STATUS:
            parts = textwrap.wrap(status, room, break_on_hyphens=False)
            lines.append("  ".join([*cells, parts[0]]).rstrip())
            lines += [" " * lead(chosen) + part for part in parts[1:]]
        else:
            assert width is not None
            lines.append(_cut("  ".join(cells).rstrip(), width))
            lines.append(wrapped("     " + status, width))
    lines.append(wrapped(last, width, "  "))
    return "\n".join(lines)


def _nvidia_table(gpus: Gpus, width: int | None) -> str:
    cuda = gpus.cuda_driver_version
    head = (
        f"NVIDIA driver {gpus.driver_version or 'unknown'}, "
        f"CUDA {'unknown' if cuda is None else f'{cuda[0]}.{cuda[1]}'}"
    )
    if not gpus.devices:
        return wrapped(f"{_safe(head)}\nno NVIDIA device", width)
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
    offered_line = "offered: " + (", ".join(str(i) for i in gpus.offered_indices) or "none")
    # Cut first what --json and `nvidia-smi -L` give whole: the UUID.
    return _aligned(head, rows, offered_line, width, drop=(2,), shrink=(1, 16))


def format_health(gpus: Gpus, width: int | None = None) -> str:
    """Each NVIDIA card's health checks, a line a card, with what fixes a
    sick one; "" on a box without NVIDIA cards. Lines wrap at `width`."""
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
    return "\n".join(wrapped(_safe(line), width, "  ") for line in lines)


def _amd_table(amd: AmdGpus, width: int | None) -> str:
    head = "AMD (amdgpu KFD topology)" + (
        f", HSA_OVERRIDE_GFX_VERSION: kernels for {amd.gfx_override}" if amd.gfx_override else ""
    )
    if not amd.devices:
        return wrapped(f"{_safe(head)}\nno AMD GPU with compute units", width)
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
    offered_line = "offered (AMD): " + (", ".join(str(i) for i in amd.offered_indices) or "none")
    return _aligned(head, rows, offered_line, width, drop=(4, 5), shrink=(2, 16))


def _gib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**30:.1f} GiB"
