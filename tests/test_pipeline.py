"""The library entry point as a join loop calls it: a spec built in code is
checked like a config file before any step runs, and the steps run in their
load-bearing order."""

from __future__ import annotations

from pathlib import Path

import pytest

from prepare import DataSpec, Fail, PrepareSpec, SourceSpec, SshSpec, prepare


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


def test_a_spec_from_code_with_cpu_only_and_a_cuda_libtorch_is_refused_before_any_step_runs(
    box: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prepare.build import steps as build

    builds: list[PrepareSpec] = []
    monkeypatch.setattr(build, "build", lambda spec, *args, **kwargs: builds.append(spec))
    state = box / "state"
    notes: list[str] = []
    with pytest.raises(Fail) as caught:
        prepare(PrepareSpec(cpu_only=True, libtorch="cu128", flake="path:/srv/fdl", state_dir=str(state)), notes)
    assert caught.value.permanent
    message = caught.value.message
    assert "PrepareSpec.cpu_only" in message and "PrepareSpec.libtorch" in message and '"cu128"' in message
    assert 'set libtorch to "cpu" or "auto"' in message
    # No step ran: no note from the gate, no build (so no nix call), no state directory.
    assert notes == [] and builds == [] and not state.exists()


def test_a_source_url_from_code_reaches_the_build_without_surrounding_spaces(
    box: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prepare.build import steps as build

    builds: list[PrepareSpec] = []

    class Reached(Exception):
        """Steps 4 and 5 were started: what they got is all this test reads."""

    def fake_start(spec: PrepareSpec, *args: object, **kwargs: object) -> build.Session:
        builds.append(spec)
        raise Reached

    monkeypatch.setattr(build, "start", fake_start)
    spec = PrepareSpec(cpu_only=True, libtorch="cpu", flake=" path:/srv/fdl ", source=SourceSpec(from_=" path:/srv/x "))
    with pytest.raises(Reached):
        prepare(spec, [])
    (built,) = builds
    assert built.source is not None and built.source.from_ == "path:/srv/x"
    assert built.flake == "path:/srv/fdl"
