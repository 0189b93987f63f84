"""The hand-off to an unchanged `fdl join`: what a prepared box leaves where
floDl, and whoever starts it, will look (docs/FLODL.md).

- `libtorch/.active` under the training user's `$FLODL_HOME` (else
  `~/.flodl`), floDl's own file (flodl-cli's libtorch/detect.rs): a variant
  path relative to `libtorch/`, here `fdl-prepare/<variant>`, a symlink to
  the libtorch this attempt built (GC-rooted under the state directory).
- `<state>/current/`: `bin`, `cwd` and `libtorch`, symlinks to what the run
  uses, each swapped by renaming a new link over it, so a reader sees the
  old set or the new, never a missing link.
- `<state>/prepared.json`: the last Prepared, root's, readable by all,
  replaced whole.
- The devices a run is offered, as CUDA ordinals (what floDl's `devices:`
  and its ranks take), beside their NVML indices.

Writing in a training user's home as root is writing in a directory that
user controls: every directory on the way below the home is opened with
O_NOFOLLOW through the one above it, must be the training user's (or
root's), and what is made there is made under a random name, chowned to
the training user and renamed into place, so no link of theirs is ever
followed and nothing of root's is left there.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import stat
from typing import TYPE_CHECKING

from prepare.fail import Fail
from prepare.host import state as state_dir

if TYPE_CHECKING:
    from prepare.build.rundir import Owner
    from prepare.gpu.devices import Gpus
    from prepare.plan import Plan
    from prepare.spec import Prepared

# floDl's layout under its root ($FLODL_HOME or ~/.flodl).
LIBTORCH = "libtorch"
ACTIVE = ".active"
OURS = "fdl-prepare"
CURRENT = "current"
PREPARED = "prepared.json"
# A variant label as a file name: the flake's labels (cpu, cu128, rocm6.4).
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_STRAY = re.compile(r"\.(?:bin|cwd|libtorch)\.[0-9a-f]{16}\.tmp")


def training_user(plan: Plan) -> str | None:
    """Who runs the training: the user the run directory and the hand-off
    belong to. The training user (`user`) when one is set; None without
    one, fdl-prepare's own user, whom the `fdl join` beside it then runs as
    too (the smoke run still runs as `smoke_user`: plan.smoke.user)."""
    return plan.user.name if plan.user is not None else None


def owner(name: str | None) -> Owner:
    """The training user resolved: as root, `name` from the password
    database (never root, an unknown user or a Nix build user); None, or
    not root, this process's own user, whose files these are anyway."""
    from prepare.build.rundir import Owner

    if name is None or os.geteuid() != 0:
        try:
            me = pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:
            me = f"uid {os.geteuid()}"
        return Owner(me, None, None)
    # Refused as the plan refuses `user` (prepare.host.training_user).
    from prepare.host.training_user import lookup

    found = lookup(name)
    return Owner(name, found.uid, found.gid)


def cuda_ordinals(gpus: Gpus, indices: tuple[int, ...]) -> tuple[int, ...]:
    """NVML indices as the CUDA runtime numbers them in a process that sees
    this CUDA_VISIBLE_DEVICES: by position in the mask (under `2,1`, NVML's
    2 is ordinal 0), else the index itself (NVML and CUDA both in PCI bus
    order: CUDA_DEVICE_ORDER=PCI_BUS_ID, docs/FLODL.md)."""
    if gpus.visible is None:
        return indices
    position = {index: ordinal for ordinal, index in enumerate(gpus.visible)}
    return tuple(position[i] for i in indices if i in position)


def flodl_home(user: Owner, environ: dict[str, str] | os._Environ[str] | None = None) -> str | None:
    """floDl's root for the training user (flodl-cli's context.rs):
    $FLODL_HOME as this process has it (the units share it), else the
    training user's home's `.flodl`; None when neither is usable."""
    environ = os.environ if environ is None else environ
    home = environ.get("FLODL_HOME", "")
    if home:
        return home if os.path.isabs(home) else None
    if user.uid is None:
        base = environ.get("HOME") or os.path.expanduser("~")
    else:
        try:
            base = pwd.getpwuid(user.uid).pw_dir
        except KeyError:
            return None
    return os.path.join(base, ".flodl") if os.path.isabs(base) else None


def hand_off(plan: Plan, state: str | None, done: Prepared, notes: list[str]) -> None:
    """Everything above, for `done`. A hand-off that cannot be written where
    the training user lives is said in a note (the Prepared is still
    right, and a library caller has it); the state directory's part is
    root's own and must be written."""
    if state is None:
        return
    try:
        with state_dir.opened_dir(state, "state directory") as state_fd:
            _current(state_fd, done)
            body = json.dumps({"kind": "prepared", "schema": 1, **done.to_json()}, indent=2, sort_keys=True)
            state_dir.write_at(state_fd, PREPARED, (body + "\n").encode(), mode=0o644)
    except OSError as err:
        raise Fail(
            "state.run-dir",
            f"the hand-off in the state directory {state} ({CURRENT}/, {PREPARED}) could not be written: "
            f"{os.strerror(err.errno or 0)}. Free space there, or set state_dir (--state-dir) elsewhere",
        ) from None
    if done.libtorch is not None:
        _active(owner(training_user(plan)), done.libtorch.variant, done.libtorch.path, notes)


def _current(state_fd: int, done: Prepared) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(CURRENT, 0o755, dir_fd=state_fd)
    with state_dir.opened_dir(CURRENT, "state directory's links to the current run", dir_fd=state_fd) as fd:
        links = {
            "bin": done.bin.path if done.bin else None,
            "cwd": done.bin.cwd if done.bin else None,
            "libtorch": done.libtorch.path if done.libtorch else None,
        }
        # What an attempt stopped midway (SIGKILL) left of a swap.
        for stray in os.listdir(fd):
            if _STRAY.fullmatch(stray):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stray, dir_fd=fd)
        for name, target in links.items():
            if target is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
            else:
                _swap_link(fd, name, target, None)


def _swap_link(dir_fd: int, name: str, target: str, user: Owner | None) -> None:
    """`name` in `dir_fd` made a symlink to `target`, atomically: a new link
    under a random name, owned by `user` (when given, and root), renamed
    over the old one."""
    tmp = f".{name}.{os.urandom(8).hex()}.tmp"
    os.symlink(target, tmp, dir_fd=dir_fd)
    try:
        if user is not None and user.uid is not None:
            os.chown(tmp, user.uid, user.gid if user.gid is not None else -1, dir_fd=dir_fd, follow_symlinks=False)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


class _Refused(Exception):
    """A directory on the way is not one to write in."""


def _enter(parent: int, name: str, user: Owner, *, make: bool = True) -> int:
    """The directory `name` below `parent`, made (the training user's) when
    missing and `make`, opened without following a link; the training
    user's or root's, else refused."""
    if make:
        try:
            os.mkdir(name, 0o755, dir_fd=parent)
        except FileExistsError:
            pass
        else:
            if user.uid is not None:
                os.chown(name, user.uid, user.gid if user.gid is not None else -1, dir_fd=parent, follow_symlinks=False)
    try:
        fd = os.open(name, _DIR, dir_fd=parent)
    except FileNotFoundError:
        raise _Refused(f"{name} does not exist") from None
    except OSError as err:
        raise _Refused(f"{name} is not a directory (a symlink, or a file): {os.strerror(err.errno or 0)}") from None
    uid = os.fstat(fd).st_uid
    if uid not in (0, os.geteuid() if user.uid is None else user.uid):
        os.close(fd)
        raise _Refused(f"{name} is owned by uid {uid}, neither {user.name}'s nor root's")
    return fd


def _active(user: Owner, variant: str, libtorch: str, notes: list[str]) -> None:
    home = flodl_home(user)
    if home is None:
        notes.append(
            f"libtorch/.active not written: no floDl root for {user.name} (FLODL_HOME unset or relative, and no "
            "absolute home): set FLODL_HOME for both units, as `fdl join` reads it"
        )
        return
    if not _LABEL.fullmatch(variant):
        notes.append(f"libtorch/.active not written: the variant label {variant!r} is not a plain name")
        return
    parts = [p for p in os.path.normpath(home).split("/") if p]
    fds: list[int] = []
    try:
        try:
            # From `/`, each directory opened through the one above it without
            # following a link: a link the training user placed on the way
            # would send root's writes anywhere. Above the floDl root nothing
            # is made (it is the operator's FLODL_HOME, or the home).
            fds.append(os.open("/", _DIR))
            for name in parts[:-1]:
                fds.append(_enter(fds[-1], name, user, make=False))
            for name in (parts[-1], LIBTORCH, OURS):
                fds.append(_enter(fds[-1], name, user))
            _swap_link(fds[-1], variant, libtorch, user)
            before = _read_small(fds[-2], ACTIVE)
            owner = (user.uid, user.gid if user.gid is not None else -1) if user.uid is not None else None
            state_dir.write_at(fds[-2], ACTIVE, f"{OURS}/{variant}\n".encode(), owner=owner)
        except _Refused as why:
            notes.append(
                f"libtorch/.active not written under {home}: {why}. Set FLODL_HOME for both units to a directory "
                f"of {user.name}'s reached through real directories"
            )
            return
        except OSError as err:
            notes.append(f"libtorch/.active not written under {home}: {os.strerror(err.errno or 0)}")
            return
    finally:
        for fd in fds:
            os.close(fd)
    said = f"{home}/{LIBTORCH}/{ACTIVE} names {OURS}/{variant} (-> {libtorch}), for fdl join"
    if before and before != f"{OURS}/{variant}":
        said += f"; it named {before!r}"
    notes.append(said)


def _read_small(dir_fd: int, name: str) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, 256).decode(errors="replace").strip()
    finally:
        os.close(fd)
