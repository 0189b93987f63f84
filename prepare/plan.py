"""Resolve once, then act: the one checking boundary between a spec and the
steps.

`plan(spec)` turns a PrepareSpec, from a join loop's code or resolved from
flags, a file and the environment (prepare.config), into a frozen, fully
checked `Plan`, before step 1 runs, on the library's path and the CLI's
alike. Everything that can be known wrong without touching the box is
found here: a value set in code of the wrong type or range (a value from a
flag, the file or a variable was checked where it entered, with its name
or line, and is not checked again), the rules across fields, the dataset
root's path and the `sshfs://` source's grammar, the flake and source
URLs (pinned, never resolved against the working directory), and the
box's own recipe values. So a pure spec error is reported before a cheap
step has run, let alone a mount or a build.

Every default a step acts on, and where it came from, is set here too: the
data mountpoint, the driver directory (the spec's default), the state
directory (systemd's StateDirectory=, the XDG state home, the per-user
default) with the words a message names it by. A step takes its own part
of the plan (`Plan.gate`, `.data`, `.build`, `.smoke`) and checks nothing
of it again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from prepare.build.plan import BuildPlan
from prepare.config.fields import TABLE, Table
from prepare.config.resolve import checked, from_environment
from prepare.data.root import DataPlan
from prepare.gpu.gate import GatePlan
from prepare.host.training_user import TrainingUser, training_user
from prepare.smoke import SmokePlan
from prepare.spec import DATA_MOUNTPOINT, PrepareSpec


@dataclass(frozen=True)
class Plan:
    """What each step is given, checked: the GPU gate's settings (step 1),
    the dataset root's (step 2), the build's (steps 4 to 7; None when the
    spec asks for no libtorch and no source) and the smoke run's (step 8)."""

    gate: GatePlan
    data: DataPlan
    build: BuildPlan | None
    smoke: SmokePlan
    # The training user (`user`): step 3 proves its directories, and the
    # smoke run runs as it; None: fdl-prepare's own user's.
    user: TrainingUser | None = None


def plan(spec: PrepareSpec, env: Mapping[str, str] | None = None, *, table: Table = TABLE) -> Plan:
    """The plan for `spec`, or a permanent Fail (config.invalid, or
    config.credentials-in-url for a URL that carries one) naming the field
    and the fix. `env` is where the state directory's defaults are read
    (default: this process's environment)."""
    env = os.environ if env is None else env
    spec = checked(spec, table=table)
    user = training_user(spec)
    return Plan(
        gate=gate_plan(spec),
        data=_data(spec),
        build=_build(spec, env) if spec.wants_build else None,
        # The training user, when set, is whom the binary will run as: the
        # smoke run proves it as that user, not as smoke_user.
        smoke=SmokePlan(timeout_s=spec.smoke_timeout_s, user=user.name if user else spec.smoke_user),
        user=user,
    )


def gate_plan(spec: PrepareSpec) -> GatePlan:
    """The GPU gate's part of a checked spec: also what `fdl-prepare gpus`,
    which needs no other part, judges the box by."""
    return GatePlan(
        cpu_only=spec.cpu_only,
        devices=spec.devices,
        expect_gpus=spec.expect_gpus,
        driver_dir=spec.driver_dir,
        query_timeout_s=spec.gpu_timeout_s,
    )


def _data(spec: PrepareSpec) -> DataPlan:
    """The dataset root: nothing declared, a path (absolute, lexically: the
    path is handed to this host's ranks as written, never symlink-resolved),
    or an `sshfs://` source parsed, with the tunnel's user and port as its
    defaults, and the mountpoint it goes on."""
    data = spec.data
    if data.data_source is None:
        path = None if data.data_path is None else os.path.abspath(data.data_path)
        return DataPlan(path=path, source=None, ssh=spec.ssh, list_timeout_s=spec.list_timeout_s)
    from prepare.data import url

    said: list[str] = []
    source = url.with_tunnel_defaults(url.parse_source(data.data_source), spec.ssh, said)
    mountpoint = os.path.abspath(data.data_path if data.data_path is not None else DATA_MOUNTPOINT)
    return DataPlan(path=mountpoint, source=source, ssh=spec.ssh, list_timeout_s=spec.list_timeout_s, notes=tuple(said))


def _build(spec: PrepareSpec, env: Mapping[str, str]) -> BuildPlan:
    """The flake and the training source, pinned, and the box's own recipe,
    checked before the first nix call: a config that cannot work costs no
    evaluation. Then where the state lives."""
    from prepare.build import manifest
    from prepare.nix import urls

    flake = urls.check_flake_url(spec.flake)
    if spec.source is not None:
        urls.check_source_url(spec.source.from_)
        manifest.check_box(spec.source)
    state, origin = state_dir(spec, env)
    return BuildPlan(
        flake=flake,
        libtorch=spec.libtorch,
        cpu_only=spec.cpu_only,
        source=spec.source,
        state_dir=state,
        state_origin=origin,
        nix=spec.nix,
        build_timeout_s=spec.build_timeout_s,
        refresh=spec.refresh,
        ssh=spec.ssh,
    )


def state_dir(spec: PrepareSpec, env: Mapping[str, str], uid: int | None = None) -> tuple[str, str]:
    """Where the state directory is, absolute, and where that came from in
    a message's words: the spec's own (as the config resolved it: a flag,
    the file, $STATE_DIRECTORY), else the default for this box
    (`default_state_dir`)."""
    if spec.state_dir:
        given = spec.origin("state_dir")
        return os.path.abspath(spec.state_dir), str(given) if given is not None else "state_dir, --state-dir"
    path, origin = default_state_dir(env, uid)
    return os.path.abspath(path), origin


def default_state_dir(env: Mapping[str, str], uid: int | None = None) -> tuple[str, str]:
    """systemd's StateDirectory= first (a unit that declares one owns it),
    read as the config reads `state_dir`'s variable; then the XDG state
    home; then the per-user default, /var/lib for root. Returns the
    directory and where it came from."""
    uid = os.getuid() if uid is None else uid
    unit = from_environment(TABLE.by_key["state_dir"], env)
    if unit is not None:
        return str(unit.value), str(unit)
    # The XDG spec has a relative XDG_STATE_HOME ignored: it would move with
    # the working directory.
    if env.get("XDG_STATE_HOME", "").startswith("/"):
        return os.path.join(env["XDG_STATE_HOME"], "fdl-prepare"), "$XDG_STATE_HOME"
    if uid == 0:
        return "/var/lib/fdl-prepare", "the default for root"
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".local", "state", "fdl-prepare"), "the default for this user"
