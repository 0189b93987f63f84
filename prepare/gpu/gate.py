"""Step 1, the GPU gate: refuse a box that has no usable GPU, before anything
expensive happens.

The bar is *any usable device*, not *nothing to report*: a box with one broken
card beside two good ones is trainable, so a device whose queries fail is
marked unusable (and noted) instead of failing the box. What fails the box is
permanent, because no retry can fix it: no driver, a driver that is not
loaded, a user-space library that does not match the kernel module, no
permission on /dev/nvidia*, no usable device left after the masks, or
`devices` naming a card that is not there. NVML saying it is not ready yet
(early in boot), of itself or of a card the box needs (NOT_READY or TIMEOUT
on that card's query), is transient, and so is a driver that does not
answer at all (prepare.gpu.query).

The survey itself is prepare.gpu.nvml for NVIDIA cards (NVML, and how
CUDA_VISIBLE_DEVICES and MIG ids are read) and prepare.gpu.amd for AMD ones;
what it found is prepare.gpu.devices.

Health, not just presence: a card NVML lists and answers for can still be
unable to train (a pending row remap, uncorrectable ECC errors, an NVLink
fabric that is not up, compute mode Prohibited; prepare.gpu.health reads them).
Such a card is a note and is not offered; with no healthy card left the
gate stops (permanent), unless a card's fabric is still being set up, which
the next attempt may find done (transient).

Masks, in order:

1. `CUDA_VISIBLE_DEVICES`, read as CUDA reads it (prepare.gpu.nvml).
2. `devices` (`--devices`): the NVML indices, as `nvidia-smi` and
   `fdl-prepare gpus` number them, that this box offers to the run. A card
   it names is one the operator means the run to have: unusable or sick,
   it stops the box (`gpu.device-unhealthy`) rather than being left out
   with a note as an unnamed one is (its fabric still coming up: transient).

The same verdict serves `fdl-prepare gpus` as a health check (`health`):
the survey, and the Fail an attempt would stop on, with the driver
directory only looked at.

AMD: the same image serves NVIDIA and AMD boxes, so the gate also surveys
the AMD GPUs the amdgpu driver publishes (prepare.gpu.amd, its masks
ROCR_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES, and its permission checks on
/dev/kfd and the render nodes). Any usable device of either vendor passes.
On a box with AMD GPUs, NVML missing or unable to reach an NVIDIA kernel
module is a note, not a failure; with no AMD GPU either, the NVIDIA messages
are what they always were. `devices` takes each vendor's own indices (NVML's
for NVIDIA, ROCm's for AMD), as each vendor's runtime numbers its cards.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from prepare.fail import Fail
from prepare.gpu import nvml
from prepare.gpu.devices import AMD, NVIDIA, Device, Gpus, cpu_only
from prepare.gpu.nvml import NvmlUnusable
from prepare.gpu.query import QUERY_TIMEOUT_S
from prepare.spec import DRIVER_DIR

if TYPE_CHECKING:
    from prepare.gpu.amd import AmdGpus

__all__ = ["AMD", "NVIDIA", "Device", "GatePlan", "Gpus", "Health", "check", "health", "survey"]


@dataclass(frozen=True)
class GatePlan:
    """The gate's part of the plan (prepare.plan): whether it runs at all,
    the `devices` mask, how many healthy cards the box must offer, and the
    driver directory NVML is also looked for in."""

    cpu_only: bool = False
    devices: tuple[int, ...] | None = None
    expect_gpus: int | None = None
    driver_dir: str = DRIVER_DIR
    # How long the drivers get to answer the survey (prepare.gpu.query).
    query_timeout_s: float = QUERY_TIMEOUT_S


@dataclass(frozen=True)
class Health:
    """`fdl-prepare gpus`: the survey, and whether an attempt on this box
    would pass the gate with it. `fail` is what would stop it (the survey
    itself failing included: then `survey` is None); `skipped` says the
    gate would not run at all (cpu_only), whatever the cards."""

    survey: Gpus | None
    fail: Fail | None = None
    skipped: bool = False

    @property
    def ready(self) -> bool:
        return self.fail is None

    def to_json(self) -> dict[str, Any]:
        survey = {} if self.survey is None else self.survey.to_json()
        return {
            "kind": "gpus",
            "schema": 1,
            "ready": self.ready,
            "gate_skipped": self.skipped,
            **survey,
            "devices": survey.get("devices", []),
            "fail": None if self.fail is None else self.fail.to_json(),
        }


def health(plan: GatePlan, notes: list[str]) -> Health:
    """The gate run as a health check: the survey and its verdict, the
    driver directory only looked at. A box set cpu_only is ready whatever
    its cards (an attempt skips the gate); its survey, if one can be made,
    is still shown."""
    if plan.cpu_only:
        notes.append(
            "cpu_only is set: an attempt skips the GPU gate, so the cards below do not decide whether this box is ready"
        )
        try:
            return Health(surveyed(plan, notes, change=False), skipped=True)
        except Fail as fail:
            notes.append(f"no GPU survey: {fail.message}")
            return Health(None, skipped=True)
    try:
        gpus = surveyed(plan, notes, change=False)
    except Fail as failed:
        return Health(None, failed)
    judged, stopped = verdict(plan, gpus, notes)
    return Health(judged, stopped)


def survey(
    env: Mapping[str, str] | None = None,
    *,
    driver_dir: str = DRIVER_DIR,
    timeout: float = QUERY_TIMEOUT_S,
    nvml_path: str | None = None,
) -> Gpus:
    """Ask NVML about every NVIDIA device and the amdgpu driver about every
    AMD one, then apply each vendor's masks from `env` (default: this
    process's environment). Raises a Fail when NVML itself cannot be used
    and the box has no AMD GPU; a device whose queries fail is only marked
    unusable. NVML is what the loader finds, else `nvml_path`, else the one
    in `driver_dir` (prepare.gpu.driver_dir), as a Nix-built program finds
    the driver. Every call is made in one child within `timeout` seconds
    (prepare.gpu.query): a driver that does not answer is
    `gpu.query-timeout`, transient."""
    env = os.environ if env is None else env
    from prepare.gpu import amd as amd_survey
    from prepare.gpu import query

    answers = query.ask(
        amd=amd_survey.paths(), driver_dir=driver_dir, mig=nvml.wants_mig(env), timeout=timeout, nvml_path=nvml_path
    )
    amd = amd_survey.survey(env, files=query.Recorded((answers.amd or {}).get("ops") or {}))
    try:
        gpus = nvml.survey(env, answers.nvml, answers.preload)
    except NvmlUnusable as fail:
        # One image serves NVIDIA and AMD boxes: on an AMD box the NVML
        # library is missing, or installed with no NVIDIA kernel module to
        # talk to. Not ready yet is another matter: the next attempt may
        # find NVIDIA cards, and auto would pick another libtorch.
        if not fail.permanent or amd is None or not amd.devices:
            raise
        note = f"NVIDIA: no usable NVML on this box of AMD GPUs ({fail.said}): only the AMD GPUs are surveyed."
        gpus = Gpus(None, None, devices=(), offered=(), nvidia_error=fail.said, notes=(note,))
    if amd is None:
        return gpus
    return replace(gpus, amd=amd, notes=gpus.notes + amd.notes)


def check(plan: GatePlan, notes: list[str], *, change: bool = True) -> Gpus | None:
    """The pipeline step: survey, apply `devices`, and refuse a box that
    offers no usable GPU. Every note gathered is appended to `notes`, also
    when a Fail is raised. `change` False (`fdl-prepare check`, `fdl-prepare
    gpus`): the driver directory is looked at and what an attempt would
    link there said, but nothing is linked (prepare.gpu.driver_dir)."""
    if plan.cpu_only:
        notes.append("GPU gate skipped: cpu_only is set, so only the cpu libtorch variant can be used.")
        if plan.devices is not None:
            listed = ",".join(str(i) for i in plan.devices)
            notes.append(f"devices ({listed}) is ignored with cpu_only: no GPU is offered to the run.")
        if plan.expect_gpus is not None:
            notes.append(f"expect_gpus ({plan.expect_gpus}) is ignored with cpu_only: no GPU is checked.")
        return None
    gpus = surveyed(plan, notes, change=change)
    judged, fail = verdict(plan, gpus, notes)
    if fail is not None:
        raise fail
    return judged


def surveyed(plan: GatePlan, notes: list[str], *, change: bool = True) -> Gpus:
    """The survey as the gate takes it: after the driver directory (made,
    or with `change` False only looked at), its notes appended to `notes`."""
    from prepare.gpu import driver_dir

    # Before NVML: on a box that is not NixOS, this is also where a
    # Nix-built fdl-prepare finds NVML itself.
    host_nvml = driver_dir.ensure(plan.driver_dir, notes, change=change)
    gpus = survey(driver_dir=plan.driver_dir, timeout=plan.query_timeout_s, nvml_path=host_nvml)
    notes.extend(gpus.notes)
    return gpus


def verdict(plan: GatePlan, gpus: Gpus, notes: list[str]) -> tuple[Gpus, Fail | None]:
    """The gate's verdict on a survey: `devices` applied, then whether the
    box offers a usable, healthy GPU (and `expect_gpus` of them). Returns
    the survey as far as the gate got with it (the masks applied, the
    offered cards named), and the Fail that stops the box, or None."""
    try:
        _refuse_no_device(gpus)
        gpus = _with_devices(plan, gpus, notes)
        return _judged(plan, gpus, notes), None
    except Fail as fail:
        return gpus, fail


def _refuse_no_device(gpus: Gpus) -> None:
    if not gpus.devices and (gpus.amd is None or not gpus.amd.devices):
        raise Fail(
            "gpu.no-device",
            f"GPU gate: NVML reports no NVIDIA device (driver {gpus.driver_version or 'version unknown'} is "
            "loaded). `nvidia-smi -L` and `lspci | grep -i nvidia` show what the machine has; a container "
            f"needs the GPUs passed in (the NVIDIA container toolkit), {cpu_only()}.",
        )


def _with_devices(plan: GatePlan, gpus: Gpus, notes: list[str]) -> Gpus:
    """`devices` applied: a card it names must be there and able to train.

    NVIDIA cards are named as floDl names them (its `devices` are CUDA's
    ordinals): ordinal k is the k-th card CUDA_VISIBLE_DEVICES leaves, in its
    order, and with the variable unset, NVML index k. The gate keeps NVML
    indices, so an ordinal is turned into one here; AMD cards keep ROCm's
    numbering."""
    devices = gpus.devices
    amd = gpus.amd
    if plan.devices is None:
        return gpus
    ordinals = tuple(dict.fromkeys(plan.devices))
    cuda = gpus.visible if gpus.visible is not None else tuple(d.index for d in devices)
    # NVML's indices of the NVIDIA cards the ordinals name.
    wanted = tuple(cuda[i] for i in ordinals if 0 <= i < len(cuda))
    amd_count = 0 if amd is None else amd.runtime_count
    absent = [i for i in ordinals if not (0 <= i < len(cuda) or 0 <= i < amd_count)]
    if absent and gpus.visible is not None and amd is None:
        raise Fail(
            "gpu.device-absent",
            f"GPU gate: devices = {list(plan.devices)} (--devices) names "
            + ", ".join(f"CUDA device {i}" for i in absent)
            + f", but CUDA_VISIBLE_DEVICES={gpus.cuda_visible_devices!r} leaves {len(cuda)} device(s), CUDA "
            f"ordinals 0-{len(cuda) - 1} (devices counts, as floDl does, among the cards CUDA_VISIBLE_DEVICES "
            "leaves, in its order). Change devices in [join] (or --devices), or CUDA_VISIBLE_DEVICES; "
            "`fdl-prepare gpus` lists the cards.",
        )
    if absent and amd is None:
        raise Fail(
            "gpu.device-absent",
            f"GPU gate: devices = {list(plan.devices)} (--devices) names "
            + ", ".join(f"GPU {i}" for i in absent)
            + f", but this box has {len(devices)} device(s), indices 0-{len(devices) - 1}. Change devices in [join] "
            "(or --devices) to indices that exist; `fdl-prepare gpus` lists them.",
        )
    if absent:
        have = [
            f"{count} {vendor} GPU(s), indices 0-{count - 1}"
            for vendor, count in (("NVIDIA", len(devices)), ("AMD", amd_count))
            if count
        ]
        raise Fail(
            "gpu.device-absent",
            f"GPU gate: devices = {list(plan.devices)} (--devices) names "
            + ", ".join(f"GPU {i}" for i in absent)
            + f", but this box has {' and '.join(have) or 'no GPU the runtimes can see'} (each vendor numbers "
            "its own from 0, as its runtime does). Change devices in [join] (or --devices) to indices that "
            "exist; `fdl-prepare gpus` lists them.",
        )
    _refuse_named_sick(plan.devices, gpus, nvml_named=wanted)
    kept = tuple(d for d in gpus.offered if d.index in wanted)
    gpus = replace(gpus, offered=kept, devices_mask=wanted)
    dropped: list[str] = [d.label() for d in devices if d.usable and gpus.masked_by(d.index) == "devices"]
    if amd is not None:
        amd = amd.with_devices(ordinals)
        gpus = replace(gpus, amd=amd)
        dropped += [d.label() for d in amd.devices if d.usable and amd.masked_by(d.index) == "devices"]
    if dropped:
        line = f"devices = {list(ordinals)} (--devices) leaves out " + ", ".join(dropped) + "."
        notes.append(line)
        gpus = replace(gpus, notes=gpus.notes + (line,))
    return gpus


def _refuse_named_sick(named: Sequence[int], gpus: Gpus, *, nvml_named: Sequence[int] | None = None) -> None:
    """A card `devices` names is one the operator means to train on: when
    it cannot (unusable, sick, or its fabric not up), the box stops, naming
    it, rather than train on fewer cards with only a note to say so. Cards
    CUDA_VISIBLE_DEVICES or the ROCm masks hide are the masks' business.
    `nvml_named`: the NVML indices `named` stands for (its CUDA ordinals turned
    into them), where they differ."""
    wanted = set(named)
    nvml = set(named if nvml_named is None else nvml_named)
    nvidia = [d for d in gpus.devices if d.index in nvml and gpus.masked_by(d.index) is None and not d.healthy]
    amd = gpus.amd
    amd_bad = []
    if amd is not None and amd.blocked is None:
        amd_bad = [a for a in amd.devices if a.index in wanted and not a.usable and amd.masked_by(a.index) is None]
    if not nvidia and not amd_bad:
        return
    said = [
        f"{d.label()} is unusable: {d.error}" if not d.usable else f"{d.label()}: {d.health_line()}" for d in nvidia
    ] + [f"{a.label()} is unusable: {a.error}" for a in amd_bad]
    head = f"GPU gate: devices = {list(named)} (--devices) names a card that cannot train: " + "; ".join(said) + ". "
    if not amd_bad and all(d.waiting for d in nvidia):
        raise Fail(
            "gpu.not-ready",
            head + "The driver says it is not ready yet (still coming up, or a reset in progress): the next "
            "attempt asks again; if it stays so, `nvidia-smi -q` shows the driver's view.",
        )
    if not amd_bad and all(d.usable and not d.problems for d in nvidia):
        raise Fail(
            "gpu.fabric-not-ready",
            head + "Its NVLink fabric is still being set up: the next attempt retries; "
            "`nvidia-smi -q | grep -i -A3 fabric` shows each card's fabric state.",
        )
    raise Fail(
        "gpu.device-unhealthy",
        head + "A card named in devices is one the run is meant to have, so the box stops rather than train "
        "without it: fix the card as said above, or take it out of devices in [join] (--devices) until it is "
        "fixed; `fdl-prepare gpus` shows each card's health.",
    )


def _judged(plan: GatePlan, gpus: Gpus, notes: list[str]) -> Gpus:
    """Whether the masked survey offers a usable, healthy GPU, and as many
    as `expect_gpus` asks for."""
    devices = gpus.devices
    amd = gpus.amd
    amd_devices = () if amd is None else amd.devices
    usable = [d for d in devices if d.usable]
    usable_amd = [d for d in amd_devices if d.usable]
    if not usable and not usable_amd:
        nvidia_why = (
            "every device failed its queries: "
            + "; ".join(f"{d.label()}: {d.error}" for d in devices)
            + f". `nvidia-smi -q` shows the driver's view, `sudo dmesg | grep -i xid` shows GPU faults; "
            f"a lost GPU needs a reset (`sudo nvidia-smi -r`) or a reboot, {cpu_only()}."
        )
        if any(d.waiting for d in devices):
            raise _not_ready(devices)
        if amd is None or not amd_devices:
            raise Fail("gpu.unusable", "GPU gate: no usable GPU: " + nvidia_why)
        message = "GPU gate: no usable GPU: " + _no_usable_amd(amd) + "."
        if devices:
            message += " NVIDIA: " + nvidia_why
        elif gpus.nvidia_error is not None:
            message += f" No NVIDIA GPU either ({gpus.nvidia_error})."
        # A ROCm runtime that cannot open the device nodes is this user's or
        # this container's access, not the cards.
        raise Fail("gpu.no-access" if amd.blocked is not None else "gpu.unusable", message)
    # Usable NVIDIA cards the masks leave, none of them healthy: what stops
    # the box is the cards' health, not the masks.
    left = [d for d in usable if gpus.masked_by(d.index) is None]
    if not gpus.offered and not gpus.amd_offered and left:
        raise _no_healthy(gpus, left)
    if not gpus.offered and not gpus.amd_offered:
        masks = []
        if gpus.cuda_visible_devices is not None and (devices or amd is None):
            masks.append(f"CUDA_VISIBLE_DEVICES={gpus.cuda_visible_devices!r}")
        if amd is not None:
            if amd.rocr_visible_devices is not None:
                masks.append(f"ROCR_VISIBLE_DEVICES={amd.rocr_visible_devices!r}")
            if amd.hip_from is not None and f"{amd.hip_from}={amd.hip_visible_devices!r}" not in masks:
                masks.append(f"{amd.hip_from}={amd.hip_visible_devices!r}")
        if gpus.devices_mask is not None:
            masks.append(f"devices = {list(gpus.devices_mask)} (--devices)")
        variables = (
            "CUDA_VISIBLE_DEVICES"
            if amd is None
            else "CUDA_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES"
        )
        from prepare.gpu.amd import labels

        raise Fail(
            "gpu.masked",
            "GPU gate: every usable GPU is masked: "
            + (" then ".join(masks) or "the masks")
            + " leave none of "
            + ", ".join([d.label() for d in usable] + ([labels(usable_amd)] if usable_amd else []))
            + f". Fix {variables} in the worker's environment (unset "
            + ("it" if amd is None else "them")
            + " to see every card) or devices in [join] (--devices); `fdl-prepare gpus` lists the cards and what "
            "masks them.",
        )
    if plan.expect_gpus is not None:
        _check_expected(gpus, plan.expect_gpus)
    if amd is not None:
        # The same image serves either vendor: say which cards this box offers.
        lines = [_offered_note(gpus)]
        if amd.blocked is not None and amd_devices:
            lines.insert(0, f"AMD: no AMD GPU is usable: {amd.blocked}.")
        notes.extend(lines)
        gpus = replace(gpus, notes=gpus.notes + tuple(lines))
    return gpus


def _check_expected(gpus: Gpus, expected: int) -> None:
    """`expect_gpus`: the box must offer that many healthy cards of the
    vendor its run uses. Each one short is named: missing from the driver's
    list (fallen off the bus), unusable, sick, not ready, or masked."""
    vendor = gpus.primary_vendor
    offered: tuple[int, ...]
    short: list[str] = []
    not_ready = 0
    # Cards the driver says are not ready yet (prepare.gpu.devices.Device.waiting).
    waiting = 0
    if vendor == AMD and gpus.amd is not None:
        amd = gpus.amd
        offered = amd.offered_indices
        count, name, lister = amd.runtime_count, "AMD", "the ROCm runtime"
        for a in amd.devices:
            if a.index is not None and a.index in offered:
                continue
            why = f"unusable: {a.error}" if not a.usable else f"masked by {amd.masked_by(a.index) or 'the masks'}"
            short.append(f"{a.label()} is {why}")
    else:
        offered = gpus.offered_indices
        count, name, lister = len(gpus.devices), "NVIDIA", "NVML"
        for d in gpus.devices:
            if d.index in offered:
                continue
            if not d.usable:
                short.append(f"{d.label()} is unusable: {d.error}")
                waiting += d.waiting
            elif d.problems or d.not_ready:
                short.append(f"{d.label()}: {d.health_line()}")
                not_ready += bool(d.not_ready and not d.problems)
            else:
                short.append(f"{d.label()} is masked by {gpus.masked_by(d.index) or 'the masks'}")
    if len(offered) >= expected:
        return
    if count < expected:
        gone = f"GPU {count}" if expected - count == 1 else f"GPUs {count}-{expected - 1}"
        short.append(
            f"{gone} {'is' if expected - count == 1 else 'are'} missing: {lister} lists {count} "
            f"{name} GPU{'s' if count != 1 else ''}"
        )
    said = (
        f"GPU gate: expect_gpus = {expected} (--expect-gpus), but this box offers {len(offered)} healthy {name} "
        f"GPU{'s' if len(offered) != 1 else ''}"
        + (f" ({', '.join(str(i) for i in offered)})" if offered else "")
        + ": "
        + "; ".join(short)
        + ". "
    )
    if waiting and len(offered) + not_ready + waiting >= expected:
        raise Fail(
            "gpu.not-ready",
            said + "The cards the driver says are not ready yet (still coming up, or a reset in progress) may be "
            "ready on the next attempt, which retries.",
        )
    if len(offered) + not_ready >= expected:
        raise Fail(
            "gpu.fabric-not-ready",
            said + "The cards still setting up their NVLink fabric may be ready on the next attempt, which retries.",
        )
    raise Fail(
        "gpu.expected-missing",
        said + "A card missing from the list has usually fallen off the bus: `lspci | grep -i -e nvidia -e amd` shows "
        "what the machine has, `sudo dmesg | grep -i -e xid -e nvrm -e amdgpu` why (Xid 79: fallen off the bus); "
        "reboot, then reseat or replace it. Fix a sick card as said above, or change expect_gpus in [join] "
        "(--expect-gpus) or the masks if this box is meant to offer fewer; `fdl-prepare gpus` lists the cards.",
    )


def _card_states(gpus: Gpus) -> str:
    """Each NVIDIA card and what keeps it from the run, for a Fail."""
    parts = []
    for d in gpus.devices:
        if not d.usable:
            parts.append(f"{d.label()} is unusable: {d.error}")
        elif d.problems or d.not_ready:
            parts.append(f"{d.label()}: {d.health_line()}")
        elif gpus.masked_by(d.index) is not None:
            parts.append(f"{d.label()} is healthy but masked by {gpus.masked_by(d.index)}")
        else:
            parts.append(f"{d.label()} is healthy")
    return "; ".join(parts)


def _not_ready(devices: Sequence[Device]) -> Fail:
    """No card is usable, and the driver says of one that it is not ready
    yet: what it says at start-up, said of a card (transient)."""
    return Fail(
        "gpu.not-ready",
        "GPU gate: no usable GPU yet: "
        + "; ".join(f"{d.label()}: {d.error}" for d in devices)
        + ". The driver says "
        + ", ".join(d.label() for d in devices if d.waiting)
        + " not ready yet (still coming up, or a reset in progress): the next attempt asks again. If it stays "
        "so, `nvidia-smi -q` shows the driver's view and `sudo dmesg | grep -i xid` the card's faults.",
    )


def _no_healthy(gpus: Gpus, left: Sequence[Device]) -> Fail:
    """The masks leave usable cards and none is healthy. A card whose
    NVLink fabric is still being set up may be ready on the next attempt
    (transient); otherwise a person must reset, reboot or replace (permanent)."""
    if any(d.not_ready for d in left):
        return Fail(
            "gpu.fabric-not-ready",
            "GPU gate: no GPU is ready to train yet: "
            + _card_states(gpus)
            + ". The next attempt retries; `nvidia-smi -q | grep -i -A3 fabric` shows each card's fabric state.",
        )
    return Fail(
        "gpu.unhealthy",
        "GPU gate: no healthy GPU: "
        + _card_states(gpus)
        + ". `nvidia-smi -q -i <index>` shows the driver's view of a card, `sudo dmesg | grep -i xid` its faults; "
        f"{cpu_only()}.",
    )


def _no_usable_amd(amd: AmdGpus) -> str:
    if amd.blocked is not None:
        return amd.blocked
    return (
        "every AMD GPU is unusable: "
        + "; ".join(f"{d.label()}: {d.error}" for d in amd.devices)
        + f". `ls -l /dev/kfd /dev/dri` and `sudo dmesg | grep -i amdgpu` show what is wrong, {cpu_only()}"
    )


def _offered_note(gpus: Gpus) -> str:
    parts = []
    if gpus.offered:
        parts.append("NVIDIA GPU " + ", ".join(str(i) for i in gpus.offered_indices))
    if gpus.amd_offered:
        targets = ", ".join(dict.fromkeys(d.target or "target unknown" for d in gpus.amd_offered))
        parts.append("AMD GPU " + ", ".join(str(d.index) for d in gpus.amd_offered) + f" ({targets})")
    line = "GPU gate: offering " + " and ".join(parts) + " to the run"
    if len(parts) == 2:
        return line + (
            "; one libtorch build serves one vendor's cards, so the libtorch variant decides which the run uses."
        )
    if not gpus.offered:
        return line + "; no NVIDIA GPU" + (f" ({gpus.nvidia_error})." if gpus.nvidia_error else " is offered.")
    return line + "; no AMD GPU is offered."
