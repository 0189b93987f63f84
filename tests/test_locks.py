"""The one lock helper both serialised steps use: taken at once when free,
waited for within a bound when busy, a transient Fail naming the lock when
the bound runs out. The holder is another process, as in production."""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

import pytest

from prepare.fail import Fail
from prepare.host import locks


def _unopenable(err: OSError) -> Fail:
    return Fail("dirs.unwritable", f"cannot open the test lock: {err.strerror}")


def _taken_elsewhere(path: str) -> bool:
    """Whether another open file description can take the lock right now."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_free_lock_is_taken_at_once_without_a_word(tmp_path: Path) -> None:
    path = str(tmp_path / "lock")
    said: list[str] = []
    notes: list[str] = []
    start = time.monotonic()
    with locks.held(path, 30.0, cannot_open=_unopenable, stuck="stuck", waiting=said.append, notes=notes):
        assert time.monotonic() - start < 1.0
        assert _taken_elsewhere(path)
    assert not _taken_elsewhere(path)
    assert said == [] and notes == []


def test_a_lock_held_past_the_bound_is_a_transient_fail_with_the_callers_message(tmp_path: Path, lock_holder) -> None:
    path = str(tmp_path / "lock")
    lock_holder(path, 600)
    said: list[str] = []
    notes: list[str] = []
    ran: list[bool] = []
    start = time.monotonic()
    with (
        pytest.raises(Fail) as caught,
        locks.held(path, 0.5, cannot_open=_unopenable, stuck=f"held {path} too long", waiting=said.append, notes=notes),
    ):
        ran.append(True)
    took = time.monotonic() - start
    assert not caught.value.permanent
    assert caught.value.message == f"held {path} too long"
    assert 0.5 <= took < 5.0
    assert ran == [] and notes == []
    # Said once, before the wait, naming the lock and the bound.
    assert len(said) == 1 and path in said[0] and "another fdl-prepare" in said[0] and "0.5s" in said[0]


def test_a_lock_freed_during_the_wait_is_taken_and_the_wait_is_noted(tmp_path: Path, lock_holder) -> None:
    path = str(tmp_path / "lock")
    lock_holder(path, 1.0)
    said: list[str] = []
    notes: list[str] = []
    start = time.monotonic()
    with locks.held(path, 30.0, cannot_open=_unopenable, stuck="stuck", waiting=said.append, notes=notes):
        assert time.monotonic() - start >= 0.5
        assert _taken_elsewhere(path)
    assert len(said) == 1 and path in said[0]
    assert len(notes) == 1 and path in notes[0] and "waited" in notes[0]


def test_a_lock_that_cannot_be_opened_is_the_callers_fail(tmp_path: Path) -> None:
    with (
        pytest.raises(Fail) as caught,
        locks.held(str(tmp_path / "missing" / "lock"), 1.0, cannot_open=_unopenable, stuck="stuck"),
    ):
        pytest.fail("a lock in a missing directory was taken")
    assert caught.value.permanent
    assert caught.value.message.startswith("cannot open the test lock: ")


def test_a_new_lock_file_is_its_owners_alone_and_an_old_open_one_is_tightened(tmp_path: Path) -> None:
    # Whoever can open a lock file can hold it (a shared flock is enough).
    path = str(tmp_path / "lock")
    old = os.umask(0)
    try:
        os.close(locks.open_lock(path))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # One an earlier version made 0644 (the state lock was) is made 0600.
    os.chmod(path, 0o644)
    os.close(locks.open_lock(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
