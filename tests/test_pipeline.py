"""The library entry point as a join loop calls it: a spec built in code is
checked like a config file before any step runs, and the steps run in their
load-bearing order."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from prepare import DataSpec, Fail, PrepareSpec, SourceSpec, SshSpec, prepare
from prepare.plan import plan


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "home").mkdir()
    (tmp_path / "stage").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "stage"))
    return tmp_path


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (PrepareSpec(cpu_only=True, list_timeout_s=-1), "PrepareSpec.list_timeout_s"),
        (PrepareSpec(cpu_only=True, gpu_timeout_s=-1), "PrepareSpec.gpu_timeout_s"),
        (PrepareSpec(cpu_only=True, gpu_timeout_s=5000), "PrepareSpec.gpu_timeout_s"),
        (PrepareSpec(cpu_only=True, build_timeout_s=0), "PrepareSpec.build_timeout_s"),
        (PrepareSpec(cpu_only=True, data=DataSpec(data_path=5)), "PrepareSpec.data.data_path"),  # type: ignore[arg-type]
        (PrepareSpec(cpu_only=True, data=DataSpec(data_source=["x"])), "PrepareSpec.data.data_source"),  # type: ignore[arg-type]
        (PrepareSpec(cpu_only="yes"), "PrepareSpec.cpu_only"),  # type: ignore[arg-type]
        (PrepareSpec(cpu_only=True, devices=(0, -1)), "PrepareSpec.devices"),
        (PrepareSpec(cpu_only=True, ssh=SshSpec(port=70000)), "PrepareSpec.ssh.port"),
        (PrepareSpec(cpu_only=True, ssh=SshSpec(options=("",))), "PrepareSpec.ssh.options"),
        (PrepareSpec(cpu_only=True, source=SourceSpec(from_=3)), "PrepareSpec.source.from_"),  # type: ignore[arg-type]
        # Groups of the wrong class, or None where the spec has no optional group.
        (PrepareSpec(cpu_only=True, data=None), "PrepareSpec.data = None"),  # type: ignore[arg-type]
        (PrepareSpec(cpu_only=True, data="/flodl/data"), "PrepareSpec.data = '/flodl/data'"),  # type: ignore[arg-type]
        (PrepareSpec(cpu_only=True, ssh={"port": 22}), "PrepareSpec.ssh = {'port': 22}"),  # type: ignore[arg-type]
        (PrepareSpec(cpu_only=True, nix=None), "PrepareSpec.nix = None"),  # type: ignore[arg-type]
        (PrepareSpec(cpu_only=True, source=DataSpec()), "PrepareSpec.source = DataSpec"),  # type: ignore[arg-type]
        (PrepareSpec(cpu_only=True, origins=None), "PrepareSpec.origins = None"),  # type: ignore[arg-type]
        # None where the spec's default is a value the steps compute with.
        (PrepareSpec(cpu_only=True, list_timeout_s=None), "PrepareSpec.list_timeout_s = None"),  # type: ignore[arg-type]
        (PrepareSpec(cpu_only=True, ssh=SshSpec(options=None)), "PrepareSpec.ssh.options = None"),  # type: ignore[arg-type]
        (PrepareSpec(cpu_only=None), "PrepareSpec.cpu_only = None"),  # type: ignore[arg-type]
        # A NUL in any string: no path, URL or argument can hold one.
        (PrepareSpec(cpu_only=True, data=DataSpec(data_path="/flodl/\0data")), "PrepareSpec.data.data_path"),
        (PrepareSpec(cpu_only=True, state_dir="/var/lib/\0x"), "PrepareSpec.state_dir"),
        (PrepareSpec(cpu_only=True, ssh=SshSpec(identity_file="/k\0")), "PrepareSpec.ssh.identity_file"),
        (PrepareSpec(cpu_only=True, ssh=SshSpec(options=("Port=2\0",))), "PrepareSpec.ssh.options"),
        (PrepareSpec(cpu_only=True, source=SourceSpec(from_="path:/x\0")), "PrepareSpec.source.from_"),
    ],
)
def test_a_malformed_spec_from_code_is_permanent_and_names_the_spec_field(
    box: Path, spec: PrepareSpec, field: str
) -> None:
    notes: list[str] = []
    with pytest.raises(Fail) as caught:
        prepare(spec, notes)
    assert caught.value.permanent
    assert field in caught.value.message
    assert notes == []  # refused before any step ran


def test_something_that_is_not_a_spec_is_refused_as_permanent(box: Path) -> None:
    with pytest.raises(Fail) as caught:
        prepare({"cpu_only": True}, [])  # type: ignore[arg-type]
    assert caught.value.permanent and "expected a PrepareSpec, got dict" in caught.value.message


def test_a_well_formed_cpu_only_spec_runs_the_cheap_steps_in_order(box: Path) -> None:
    notes: list[str] = []
    done = prepare(PrepareSpec(cpu_only=True, data=DataSpec(data_path=str(box))), notes)
    assert done.data_path == str(box)
    assert list(done.timings) == ["gate", "data", "dirs"]
    assert done.devices is None
    assert (box / "home" / ".flodl" / "data").is_dir()


class Reached(Exception):
    """A step was started: what it got is all the test reads."""


def test_a_spec_from_code_with_cpu_only_and_a_cuda_libtorch_is_refused_before_any_step_runs(box: Path) -> None:
    from prepare import pipeline

    steps_run: list[str] = []
    steps = [replace_run(step, steps_run) for step in pipeline.STEPS]
    state = box / "state"
    notes: list[str] = []
    spec = PrepareSpec(cpu_only=True, libtorch="cu128", flake="path:/srv/fdl", state_dir=str(state))
    with pytest.raises(Fail) as caught:
        pipeline.run(plan(spec), notes, steps=steps)
    assert caught.value.reason == "config.invalid"
    message = caught.value.message
    assert "PrepareSpec.cpu_only" in message and "PrepareSpec.libtorch" in message and '"cu128"' in message
    assert 'set libtorch to "cpu" or "auto"' in message
    # No step ran: not the gate (no note), not step 4 (no state directory,
    # so no nix call).
    assert steps_run == [] and notes == [] and not state.exists()
    # And the same spec, fixed, reaches the steps in their order.
    with pytest.raises(Reached):
        pipeline.run(plan(dataclasses.replace(spec, libtorch="cpu")), notes, steps=steps)
    assert steps_run == ["gate"]


def replace_run(step, seen: list[str]):
    """`step` with its run replaced by one that records it and stops there."""

    def run(attempt):
        seen.append(step.name)
        raise Reached(step.name)

    return dataclasses.replace(step, run=run)


def test_a_source_url_from_code_reaches_the_build_without_surrounding_spaces(box: Path) -> None:
    spec = PrepareSpec(cpu_only=True, libtorch="cpu", flake=" path:/srv/fdl ", source=SourceSpec(from_=" path:/srv/x "))
    got = plan(spec).build
    # What steps 4 to 7 are given: the URLs as Nix gets them.
    assert got is not None and got.source is not None and got.source.from_ == "path:/srv/x"
    assert got.flake == "path:/srv/fdl"


# -- a pure spec error is reported before any step runs -------------------------------------------

NO_REF = SourceSpec(from_="git+https://h/r")


def test_a_source_with_no_ref_is_refused_before_the_data_root_is_looked_at(box: Path) -> None:
    notes: list[str] = []
    spec = PrepareSpec(
        cpu_only=True,
        libtorch="cpu",
        flake="path:/srv/fdl",
        state_dir=str(box / "state"),
        data=DataSpec(data_path=str(box / "no-such-root")),
        source=NO_REF,
    )
    with pytest.raises(Fail) as caught:
        prepare(spec, notes)
    # The source's error, not the data root's (data.root-unusable), and no
    # step ran: the gate said nothing, the state directory was not made.
    assert caught.value.reason == "config.invalid"
    assert "source.from = 'git+https://h/r' names no ref or rev" in caught.value.message
    assert notes == [] and not (box / "state").exists()


@pytest.mark.sshfs
def test_a_source_with_no_ref_is_refused_before_an_sshfs_source_is_mounted(
    box: Path, sshd, sshfs_mounts, remote_tree: Path
) -> None:
    from dataclasses import replace

    from prepare.host import mounts

    point = sshfs_mounts.track(box / "dataset")
    spec = sshd.spec(data_source=sshd.source(remote_tree), data_path=str(point))
    spec = replace(spec, libtorch="cpu", flake="path:/srv/fdl", state_dir=str(box / "state"), source=NO_REF)
    notes: list[str] = []
    with pytest.raises(Fail) as caught:
        prepare(spec, notes)
    assert caught.value.reason == "config.invalid" and "names no ref or rev" in caught.value.message
    # Nothing was mounted, nor the mountpoint made.
    assert mounts.mounted_at(str(point)) is None and not point.exists()
    assert notes == []
