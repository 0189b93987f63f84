"""The `fdl-prepare` command: flags and config in, a summary and an exit code out.

Only this module prints (besides `print_notes`) and only `main` exits. The
exit code carries the permanent/transient split so a shell loop or systemd can
act on it without parsing text: 0 prepared, 75 transient (EX_TEMPFAIL: retry),
78 permanent (EX_CONFIG: stop), 2 usage, 130 interrupted.

Heavy modules (the steps, pynvml, rich) are imported inside the commands so
`--help` stays fast.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Optional

import typer

from prepare.fail import Fail
from prepare.notes import print_notes

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_TRANSIENT = 75
EXIT_PERMANENT = 78
EXIT_INTERRUPTED = 130

NAME = "fdl-prepare"

app = typer.Typer(
    name=NAME,
    add_completion=False,
    no_args_is_help=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help=(
        "Get this box ready before it dials a training controller: GPU gate, dataset root, "
        "writable local directories, then a pinned libtorch and the training binary through Nix.\n\n"
        "Exit codes: 0 prepared, 75 transient (retry), 78 permanent (stop), 2 usage, 130 interrupted."
    ),
)


class Interrupted(KeyboardInterrupt):
    """SIGTERM (systemd stopping the unit) unwinds like Ctrl-C, so the seam in
    prepare.proc stops any running child before we exit."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted()


def _version(value: bool) -> None:
    if value:
        from prepare import __version__

        typer.echo(f"{NAME} {__version__}")
        raise typer.Exit(EXIT_OK)


def _parse_devices(value: Optional[str]) -> Optional[list[int]]:
    if value is None:
        return None
    from prepare import config

    try:
        return config.parse_devices(value)
    except Fail as fail:
        # A malformed flag is a usage error (exit 2), not a broken box.
        raise typer.BadParameter(fail.message) from None


def _flags(**given: Any) -> dict[str, Any]:
    """Flags in the shape of the config's [join] table, None meaning not given,
    so precedence can live in one place (prepare.config.resolve)."""
    source = {
        "from": given.pop("source"),
        "cwd": given.pop("source_cwd"),
        "build": given.pop("source_build"),
        "bin": given.pop("source_bin"),
    }
    ssh = {
        "target": given.pop("ssh_target"),
        "port": given.pop("ssh_port"),
        "user": given.pop("ssh_user"),
        "identity_file": given.pop("identity_file"),
        "options": given.pop("ssh_option") or None,
    }
    flags = {k: v for k, v in given.items() if v is not None}
    if any(v is not None for v in source.values()):
        flags["source"] = {k: v for k, v in source.items() if v is not None}
    if any(v is not None for v in ssh.values()):
        flags["ssh"] = {k: v for k, v in ssh.items() if v is not None}
    return flags


@app.callback(invoke_without_command=True)
def run(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(
        None, "--config", metavar="PATH",
        help="TOML file with a [join] table. Default: $FDL_PREPARE_CONFIG, else /etc/fdl/prepare.toml if present.",
    ),
    data_path: Optional[str] = typer.Option(None, "--data-path", metavar="PATH", help="Dataset root (or where to mount data_source; default /flodl/data)."),
    data_source: Optional[str] = typer.Option(None, "--data-source", metavar="URL", help="sshfs://[user@]host[:port]/abs/path, mounted read-only at --data-path."),
    libtorch: Optional[str] = typer.Option(None, "--libtorch", metavar="VARIANT", help="libtorch variant: auto, cpu, cu128, ... (whatever the flake provides)."),
    devices: Optional[str] = typer.Option(None, "--devices", metavar="LIST", help="GPU indices this box offers, e.g. 0,1 (after CUDA_VISIBLE_DEVICES)."),
    cpu_only: Optional[bool] = typer.Option(None, "--cpu-only/--no-cpu-only", help="Skip the GPU gate (CPU-only workers, demos); only the cpu libtorch is allowed."),
    flake: Optional[str] = typer.Option(None, "--flake", metavar="URL", help="Flake providing libtorch variants and the training build."),
    source: Optional[str] = typer.Option(None, "--source", metavar="URL", help="Training source as a flake URL (git+https://...?ref=..., path:...)."),
    source_cwd: Optional[str] = typer.Option(None, "--source-cwd", metavar="DIR", help="Directory inside the source the build and run use."),
    source_build: Optional[str] = typer.Option(None, "--source-build", metavar="CMD", help="Build line for the source."),
    source_bin: Optional[str] = typer.Option(None, "--source-bin", metavar="NAME", help="The training binary the build installs."),
    ssh_target: Optional[str] = typer.Option(None, "--ssh-target", metavar="HOST", help="ssh target of the controller tunnel."),
    ssh_port: Optional[int] = typer.Option(None, "--ssh-port", metavar="PORT", help="ssh port."),
    ssh_user: Optional[str] = typer.Option(None, "--ssh-user", metavar="USER", help="ssh user."),
    identity_file: Optional[str] = typer.Option(None, "--identity-file", metavar="PATH", help="ssh identity file (used for the sshfs mount)."),
    ssh_option: Optional[list[str]] = typer.Option(None, "--ssh-option", metavar="OPT", help="ssh -o option, repeatable; replaces the file's list. These come first, so they win."),
    state_dir: Optional[str] = typer.Option(None, "--state-dir", metavar="DIR", help="Where GC roots of built outputs live."),
    list_timeout: Optional[float] = typer.Option(None, "--list-timeout", metavar="SECONDS", help="Give up listing the dataset root after this long (dead mount)."),
    build_timeout: Optional[float] = typer.Option(None, "--build-timeout", metavar="SECONDS", help="Abandon a build running longer than this (transient)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout: the Prepared, or the Fail."),
    version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Prepare this box (the default command)."""
    if ctx.invoked_subcommand is not None:
        return
    flags = _flags(
        data_path=data_path,
        data_source=data_source,
        libtorch=libtorch,
        devices=_parse_devices(devices),
        cpu_only=cpu_only,
        flake=flake,
        state_dir=state_dir,
        list_timeout=list_timeout,
        build_timeout=build_timeout,
        source=source,
        source_cwd=source_cwd,
        source_build=source_build,
        source_bin=source_bin,
        ssh_target=ssh_target,
        ssh_port=ssh_port,
        ssh_user=ssh_user,
        identity_file=identity_file,
        ssh_option=ssh_option,
    )
    raise typer.Exit(_prepare(config, flags, as_json))


def _prepare(config_flag: Optional[str], flags: dict[str, Any], as_json: bool) -> int:
    from prepare import config
    from prepare.pipeline import prepare

    notes: list[str] = []
    start = time.monotonic()
    try:
        path = config.find_path(config_flag, os.environ)
        file_table = config.load(path) if path is not None else {}
        spec = config.resolve(file_table, flags, os.environ)
        progress = None
        if spec.wants_build:
            from prepare import progress as progress_mod

            progress = progress_mod.renderer(sys.stderr)
        done = prepare(spec, notes, progress=progress)
    except Fail as fail:
        return _report_fail(fail, notes, as_json)

    if as_json:
        out = done.to_json()
        out["notes"] = notes
        # Keys in pipeline order, not sorted: the timings read as the steps ran.
        print(json.dumps(out))
        return EXIT_OK
    print_notes(NAME, notes)
    _summary(done, time.monotonic() - start)
    return EXIT_OK


def _report_fail(fail: Fail, notes: list[str], as_json: bool) -> int:
    code = EXIT_PERMANENT if fail.permanent else EXIT_TRANSIENT
    if as_json:
        print(json.dumps({"kind": fail.kind, "message": fail.message, "notes": notes}, sort_keys=True))
        return code
    print_notes(NAME, notes)
    then = (
        "retrying cannot help: fix the cause above, then run again"
        if fail.permanent
        else "the next attempt may succeed: retry with backoff"
    )
    print(f"{NAME}: {fail.kind} failure: {fail.message}", file=sys.stderr)
    print(f"{NAME}: exit {code}: {then}", file=sys.stderr)
    return code


def _summary(done: Any, seconds: float) -> None:
    rows: list[tuple[str, str]] = []
    if done.devices is None:
        rows.append(("gpus", "gate skipped (--cpu-only)"))
    else:
        rows.append(("gpus", ", ".join(str(i) for i in done.devices)))
    rows.append(("data", done.data_path or "(none declared)"))
    if done.libtorch is not None:
        rows.append(("libtorch", f"{done.libtorch.variant}  {done.libtorch.path}"))
    if done.bin is not None:
        rows.append(("bin", f"{done.bin.path}  (cwd {done.bin.cwd})"))
    if done.args is not None:
        rows.append(("args", " ".join(done.args)))
    if done.run_id is not None:
        rows.append(("run", done.run_id))
    err = sys.stderr
    print(f"{NAME}: prepared in {seconds:.2f}s", file=err)
    for key, value in rows:
        print(f"  {key:<9} {value}", file=err)


@app.command("gpus")
def gpus(
    as_json: bool = typer.Option(False, "--json", help="Print the survey as JSON on stdout."),
) -> None:
    """Survey the GPUs through NVML (after CUDA_VISIBLE_DEVICES) and print them."""
    from prepare import gate

    try:
        survey = gate.survey(os.environ)
    except Fail as fail:
        raise typer.Exit(_report_fail(fail, [], as_json))
    if as_json:
        print(json.dumps(survey.to_json()))
    else:
        print(gate.format_table(survey))
        print_notes(f"{NAME} gpus", survey.notes)
    raise typer.Exit(EXIT_OK)


def main() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        app(prog_name=NAME, standalone_mode=True)
    except KeyboardInterrupt:
        print(f"{NAME}: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
