from __future__ import annotations

import errno
import os
import pwd

import pytest

from prepare.host import human


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (64 << 10, "64.0 KiB"),
        (5 << 30, "5.0 GiB"),
        (3 << 40, "3.0 TiB"),
    ],
)
def test_sizes_read_in_binary_units(n, text):
    assert human.size(n) == text


def test_an_os_error_reads_as_its_text_and_its_symbol():
    assert human.oserror(OSError(errno.EROFS, "x")) == "Read-only file system (EROFS)"
    assert human.oserror(OSError("no errno at all")) == "no errno at all"


def test_the_user_is_named_as_chown_takes_it():
    assert human.user() == pwd.getpwuid(os.geteuid()).pw_name


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.6, "0.6s"), (315.0, "315s"), (3600.0, "1 h"), (21600.0, "6 h"), (5400.0, "5400s")]
)
def test_a_duration_reads_in_whole_hours_or_in_seconds(seconds, text):
    assert human.duration(seconds) == text
