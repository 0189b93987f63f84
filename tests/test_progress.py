"""Progress display: plain lines off a terminal, a live table on one."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import time

import pytest
from nix_fixtures import build, trainer

from prepare.cli import progress
from prepare.spec import PrepareSpec, SourceSpec

EVENTS = [
    {"type": "step", "name": "build", "detail": "libtorch.cpu, training"},
    {"type": "download-start", "id": 1, "name": "https://cache.example/abc.narinfo"},
    {"type": "download-done", "id": 1, "name": "https://cache.example/abc.narinfo", "bytes": 300, "seconds": 0.1},
    {"type": "download-start", "id": 2, "name": "https://cache.example/nar/abc.nar.xz"},
    {
        "type": "download-progress",
        "id": 2,
        "name": "https://cache.example/nar/abc.nar.xz",
        "done": 1 << 20,
        "expected": 3 << 20,
    },
    {
        "type": "download-done",
        "id": 2,
        "name": "https://cache.example/nar/abc.nar.xz",
        "bytes": 3 << 20,
        "seconds": 2.0,
    },
    {"type": "build-start", "id": 3, "name": "fdl-test-training-cpu"},
    {"type": "build-phase", "id": 3, "name": "fdl-test-training-cpu", "phase": "buildPhase"},
    {"type": "build-done", "id": 3, "name": "fdl-test-training-cpu", "seconds": 1.5, "ok": True, "outcome": "built"},
    {"type": "build-start", "id": 4, "name": "broken"},
    {"type": "build-done", "id": 4, "name": "broken", "seconds": 0.2, "ok": False, "outcome": "failed"},
    {"type": "something-new", "id": 5},
    {"type": "end"},
]


def test_off_a_terminal_each_build_and_download_is_one_plain_line():
    out = io.StringIO()
    render = progress.renderer(out)
    assert isinstance(render, progress.PlainRenderer)
    for event in EVENTS:
        render(event)
    assert out.getvalue().splitlines() == [
        "fdl-prepare: downloading https://cache.example/nar/abc.nar.xz",
        "fdl-prepare: downloaded https://cache.example/nar/abc.nar.xz (3.0 MiB, 2.0s)",
        "fdl-prepare: building fdl-test-training-cpu",
        "fdl-prepare: built fdl-test-training-cpu (1.5s)",
        "fdl-prepare: building broken",
        "fdl-prepare: build failed: broken (0.2s)",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_an_interrupted_build_is_not_reported_as_built():
    out = io.StringIO()
    render = progress.PlainRenderer(out)
    render({"type": "build-done", "id": 1, "name": "train", "seconds": 3.0, "ok": False, "outcome": "stopped"})
    assert out.getvalue() == "fdl-prepare: build stopped: train (3.0s)\n"


def test_on_a_terminal_the_display_is_live_and_shows_builds_and_bytes():
    pytest.importorskip("rich")
    master, slave = pty.openpty()
    stream = os.fdopen(slave, "w", buffering=1)
    seen = b""
    try:
        render = progress.renderer(stream)
        assert isinstance(render, progress.LiveRenderer)
        for event in EVENTS[:-1]:
            render(event)
        time.sleep(0.3)  # at least one refresh of the live display
        render(EVENTS[-1])
        stream.flush()
        while select.select([master], [], [], 0.2)[0]:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            seen += chunk
    finally:
        stream.close()
        os.close(master)
    text = seen.decode("utf-8", "replace")
    assert "fdl-test-training-cpu" in text
    assert "built" in text and "failed" in text
    assert "3.0 MiB" in text
    assert "narinfo" not in text


def test_the_live_table_reads_its_rows_only_under_the_lock_the_reader_thread_inserts_under():
    """Rich redraws from its own thread while nix's reader thread adds rows:
    a redraw that iterated the rows unlocked could meet a dict changing size.
    Every read of the rows container must happen with the lock held."""
    pytest.importorskip("rich")
    render = progress.LiveRenderer(io.StringIO())
    render.live = object()  # as if started: no display thread in this test

    class Guarded(dict):
        def _held(self) -> None:
            assert render.lock.locked(), "rows read without the lock"

        def values(self):
            self._held()
            return super().values()

        def items(self):
            self._held()
            return super().items()

        def __iter__(self):
            self._held()
            return super().__iter__()

    render.rows = Guarded()
    for event in EVENTS[:-1]:
        render(event)
    table = render._render()
    assert not render.lock.locked()
    # The copies it rendered from are what the events said.
    assert table.row_count == 1 + 3  # the step line, one download, two builds (the narinfo is quiet)


def test_a_real_build_prints_its_start_and_finish_off_a_terminal(nix_env, test_flake, git_source, state_dir):
    src = git_source(trainer())
    out = io.StringIO()
    spec = PrepareSpec(
        source=SourceSpec(from_=src.url), libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=state_dir
    )
    build(spec, [], progress=progress.renderer(out))
    lines = out.getvalue().splitlines()
    assert "fdl-prepare: building fdl-test-training-cpu" in lines
    assert any(line.startswith("fdl-prepare: built fdl-test-training-cpu (") for line in lines)


def test_waiting_on_another_prepare_gets_a_line_off_a_terminal_and_other_steps_do_not():
    out = io.StringIO()
    render = progress.PlainRenderer(out)
    render({"type": "step", "name": "evaluate", "detail": "libtorch variants of f"})
    render({"type": "step", "name": "wait", "detail": "another fdl-prepare holds /s/lock; waiting for it (up to 6h)"})
    assert out.getvalue() == "fdl-prepare: another fdl-prepare holds /s/lock; waiting for it (up to 6h)\n"


# -- the heartbeat, off a terminal -------------------------------------------------------------


class Timed(io.StringIO):
    """A stream that keeps when each line was written."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        now = time.monotonic()
        self.lines += [(now, line) for line in text.splitlines()]
        return super().write(text)


def test_the_heartbeat_interval_is_ten_seconds_unless_a_caller_says_otherwise():
    import inspect

    assert progress.HEARTBEAT_S == 10.0
    assert inspect.signature(progress.renderer).parameters["heartbeat_s"].default == progress.HEARTBEAT_S
    render = progress.renderer(io.StringIO())
    assert isinstance(render, progress.PlainRenderer) and render.heartbeat_s == 10.0


def test_a_slow_real_build_prints_a_line_at_least_every_interval(nix_env, test_flake, git_source, state_dir):
    slow = "sleep 4 && printf '#!/bin/sh\\necho trained\\n' > train && chmod +x train"
    src = git_source(trainer(build=slow))
    out = Timed()
    spec = PrepareSpec(
        source=SourceSpec(from_=src.url), libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=state_dir
    )

    build(spec, [], progress=progress.renderer(out, heartbeat_s=0.5))

    said = [line for _, line in out.lines]
    start = said.index("fdl-prepare: building fdl-test-training-cpu")
    end = next(i for i, line in enumerate(said) if line.startswith("fdl-prepare: built fdl-test-training-cpu ("))
    during = out.lines[start : end + 1]
    beats = [line for _, line in during if line.startswith("fdl-prepare: build: ")]
    assert len(beats) >= 2, said
    assert all(re.fullmatch(r"fdl-prepare: build: \d+ s, building fdl-test-training-cpu", b) for b in beats), beats
    # Four seconds of a builder that says nothing, never that long without a line.
    gaps = [later - earlier for (earlier, _), (later, _) in zip(during, during[1:], strict=False)]
    assert max(gaps) < 2.5, (gaps, said)
    # After the last step, nothing more.
    time.sleep(1.0)
    assert [line for _, line in out.lines] == said


def test_the_heartbeat_names_what_runs_and_the_bytes_so_far():
    render = progress.PlainRenderer(io.StringIO(), heartbeat_s=0)
    render({"type": "step-start", "name": "build", "detail": "building libtorch and the training binary"})
    assert render.heartbeat(render.step_since + 40.2) == "build: 40 s, building libtorch and the training binary"
    render({"type": "step", "name": "build", "detail": "libtorch.cpu, training"})
    render({"type": "build-start", "id": 1, "name": "libtorch-cpu"})
    render({"type": "download-start", "id": 2, "name": "https://cache.example/nar/a.nar.xz"})
    render({"type": "download-progress", "id": 2, "name": "x", "done": 812 << 20, "expected": 900 << 20})
    assert render.heartbeat(render.step_since + 41) == (
        "build: 41 s, downloading https://cache.example/nar/a.nar.xz (and 1 more), 812.0 MiB so far"
    )
    render({"type": "download-done", "id": 2, "name": "x", "bytes": 900 << 20, "seconds": 2.0})
    assert render.heartbeat(render.step_since + 42) == "build: 42 s, building libtorch-cpu, 900.0 MiB so far"
    render({"type": "build-done", "id": 1, "name": "libtorch-cpu", "seconds": 3.0, "outcome": "built"})
    assert render.heartbeat(render.step_since + 43) == "build: 43 s, building libtorch.cpu, training, 900.0 MiB so far"
    render({"type": "step-done", "name": "build", "seconds": 43.0, "ok": True})
    assert render.heartbeat() is None


def test_the_heartbeat_off_a_terminal_goes_to_the_journal_at_info(tmp_path, monkeypatch):
    err = tmp_path / "stderr"
    with err.open("w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        render = progress.PlainRenderer(stream, heartbeat_s=0.2)
        render({"type": "step-start", "name": "gate", "detail": "checking the GPUs"})
        time.sleep(0.7)
        render({"type": "step-done", "name": "gate", "seconds": 0.7, "ok": True})
    lines = err.read_text().splitlines()
    assert lines and all(re.fullmatch(r"<6>fdl-prepare: gate: 0 s, checking the GPUs", line) for line in lines), lines


# -- a fetch that fails ------------------------------------------------------------------------


def test_a_failed_git_fetch_never_says_downloaded_or_fetched(nix_env, test_flake, git_source, git_http, state_dir):
    from prepare.fail import Fail

    remote = git_http(git_source(trainer()))
    out = io.StringIO()
    events: list[dict] = []
    spec = PrepareSpec(
        # A remote (a local git+file tree is read without a fetch activity),
        # asked for a branch nobody pushed: git fails, Nix stops the fetch.
        source=SourceSpec(from_=remote.url.replace("ref=main", "ref=not-pushed-yet")),
        libtorch="cpu",
        cpu_only=True,
        flake=test_flake,
        state_dir=state_dir,
    )

    with pytest.raises(Fail) as failed:
        build(spec, [], progress=progress.chain(progress.renderer(out), events.append))

    assert failed.value.reason == "source.unreachable"
    assert any(e["type"] == "fetch-start" and "Git repository" in e["name"] for e in events), events
    assert [e.get("ok") for e in events if e["type"] == "fetch-done"] == [False]
    said = out.getvalue()
    assert "fetching Git repository" in said
    assert "downloaded" not in said and "fetched" not in said, said


def test_a_git_fetch_that_succeeds_says_fetched_not_downloaded(nix_env, test_flake, git_source, git_http, state_dir):
    remote = git_http(git_source(trainer()))
    out = io.StringIO()
    spec = PrepareSpec(
        source=SourceSpec(from_=remote.url), libtorch="cpu", cpu_only=True, flake=test_flake, state_dir=state_dir
    )

    build(spec, [], progress=progress.renderer(out))

    lines = out.getvalue().splitlines()
    assert any(re.fullmatch(r"fdl-prepare: fetched Git repository '.+' \(\d+\.\ds\)", line) for line in lines), lines
    assert not [line for line in lines if line.startswith("fdl-prepare: downloaded fetching")]
