"""The training user: whom floDl's data plane runs as on this box.

fdl-prepare runs as root (its units do), but `fdl join` and the ranks it
starts usually do not: they read the dataset cache under their own home
(`$HOME/.flodl/data`) and stage in their own temp dir. Proving root's
directories would prove nothing about theirs. `user` (`--user`) names that
account; the dataset cache and stage are then proven as that user (step 3,
prepare.host.dirs), the cache created owned by it, and the smoke run runs
as it (prepare.smoke). The steps that write where floDl reads (the run
directory, libtorch's `.active`) ask `training_user(spec)` whom to write
for.

Three accounts are refused, with the fix: root (the training source's code
would run with everything), a user the password database does not know,
and a Nix build user (the Nix daemon runs other people's builds as it, so
whatever it owns a build can read and change).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from prepare.fail import Fail
from prepare.host.confine import NIX_BUILD_GROUP, is_nix_build_user
from prepare.spec import PrepareSpec

# The group Nix's daemon builds as (build-users-group), and its users' names.


@dataclass(frozen=True)
class TrainingUser:
    """An account from the password database, checked."""

    name: str
    uid: int
    gid: int
    # From the password database, never from $HOME: fdl-prepare's HOME is
    # root's, and the data plane's is this.
    home: str

    @property
    def is_self(self) -> bool:
        """Whether fdl-prepare already runs as this user."""
        return os.geteuid() == self.uid


def training_user(spec: PrepareSpec) -> TrainingUser | None:
    """The training user `spec` names (`user`, `--user`), looked up and
    checked; None when it names none (fdl-prepare's own user trains).
    Raises a permanent Fail (config.invalid) naming `user` / `--user` for
    root, an unknown user, a Nix build user, and, when fdl-prepare is not
    root, anyone but itself."""
    if spec.user is None:
        return None
    origin = spec.origin("user")
    return lookup(spec.user, f" (from {origin})" if origin is not None else "")


def lookup(name: str, where: str = "") -> TrainingUser:
    """`name` as a TrainingUser, or the Fail `training_user` describes."""
    import pwd

    fix = (
        "set user in [join] (--user) to the account `fdl join` runs as, or leave it out to keep the directories of "
        "the user fdl-prepare runs as"
    )
    said = f"user = {name!r}{where}"
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise Fail(
            "config.invalid",
            f"{said} is not a user of this box (the password database has no such name). Fix: create it "
            f"(sudo useradd --create-home --shell /usr/sbin/nologin {name}), or {fix}",
        ) from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise Fail(
            "config.invalid",
            f"{said} is root (uid {entry.pw_uid}, gid {entry.pw_gid}): the training user runs the training source's "
            f"code, which must never run as root. Fix: {fix}",
        )
    if is_nix_build_user(name, entry.pw_gid):
        raise Fail(
            "config.invalid",
            f"{said} is a Nix build user (group {NIX_BUILD_GROUP}): the Nix daemon runs other people's builds as it, "
            f"so they could read and change its dataset cache. Fix: create an account of its own for training "
            f"(sudo useradd --create-home --shell /usr/sbin/nologin fdl-train), and {fix}",
        )
    if os.geteuid() not in (0, entry.pw_uid):
        raise Fail(
            "config.invalid",
            f"{said}, but fdl-prepare runs as uid {os.geteuid()}, which is neither root nor {name}: it cannot prove "
            f"{name}'s directories or run as {name}. Fix: run fdl-prepare as root (its units do) or as {name}, or "
            f"drop user",
        )
    return TrainingUser(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)
