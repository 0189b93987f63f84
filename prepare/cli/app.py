"""The `fdl-prepare` command: flags and config in, a summary and an exit code out.

Only this module prints (besides `print_notes`) and only `main` exits. The
exit code carries the permanent/transient split so a shell loop or systemd can
act on it without parsing text: 0 prepared, 75 transient (EX_TEMPFAIL: retry),
78 permanent (EX_CONFIG: stop), 2 usage, 70 a bug (EX_SOFTWARE: stop), 130
interrupted.

An exception that is not a `Fail` is a bug in fdl-prepare, never the box's
state: it is reported with its traceback and exits 70, which the units do not
retry (a bug retried every 10 s for ever hides itself in the journal), where
Python's own exit 1 would be retried as if transient.

Output that cannot be written is no bug either (`_Output`). stdout carries
the result a caller reads (`--json`): when it cannot take it, an attempt that
prepared the box exits 78 for a full disk (ENOSPC, EDQUOT, EFBIG, EROFS: a
person frees space, as for every other full disk) and 75 otherwise (EPIPE: the
reader went away, a journal restarted; EIO), since the caller never got the
answer. stderr carries only what people read: a failure to write it leaves
the exit code the outcome's.

Heavy modules (the steps, pynvml, rich) are imported inside the commands so
`--help` stays fast.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any, cast

import typer

from prepare.config.fields import TABLE, Field, Table, nest
from prepare.fail import Fail
from prepare.host import human
from prepare.host.human import printable
from prepare.host.redact import redact
from prepare.notes import print_notes

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_SOFTWARE = 70
EXIT_TRANSIENT = 75
EXIT_PERMANENT = 78
EXIT_INTERRUPTED = 130

NAME = "fdl-prepare"


class Interrupted(KeyboardInterrupt):
    """SIGTERM (systemd stopping the unit) unwinds like Ctrl-C, so the seam in
    prepare.host.proc stops any running child before we exit."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted()


def _version(value: bool) -> None:
    if value:
        from prepare import __version__

        typer.echo(f"{NAME} {__version__}")
        raise typer.Exit(EXIT_OK)


def _option(f: Field) -> inspect.Parameter:
    """The command-line option for one field of the config. It defaults to
    None, "not given", whatever the field's default: defaults and
    precedence live in prepare.config.resolve alone."""
    decls = [f.flag]
    if f.kind.flag_type is bool:
        decls = [f"{f.flag}/--no-{f.flag.removeprefix('--')}"]
    # A repeatable flag: each occurrence is one item of the list.
    annotation = list[str] | None if f.kind.flag_type is list else f.kind.flag_type | None
    return inspect.Parameter(
        f.param,
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(None, *decls, metavar=f.metavar, help=f.help),
        annotation=annotation,
    )


def _with_field_options(command: Callable[..., None], table: Table, after: int | None = 2) -> Callable[..., None]:
    """`command` with one option per field of `table` after its first `after`
    parameters (prepare: the context and --config; None: after all of its
    own), which take the rest as **given."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    split = len(own) if after is None else after
    params = [*own[:split], *(_option(f) for f in table.fields), *own[split:]]
    # typer reads a command's options from its signature, and a declared
    # __signature__ is what inspect.signature reports.
    cast(Any, command).__signature__ = signature.replace(parameters=params)
    return command


def _fresh(command: Callable[..., None]) -> Callable[..., None]:
    """A new function running `command`, to carry a signature of its own:
    `command` itself stays as written, however many apps are made."""

    @functools.wraps(command)
    def call(*args: Any, **kwargs: Any) -> None:
        command(*args, **kwargs)

    return call


def _flags(table: Table, given: Mapping[str, Any]) -> dict[str, Any]:
    """The options given, in the shape of the config's [join] table, so
    precedence can live in one place (prepare.config.resolve)."""
    flat: dict[str, Any] = {}
    for f in table.fields:
        value = given.get(f.param)
        # A repeatable flag that was not given comes as an empty list.
        if value is None or (f.kind.flag_type is list and not value):
            continue
        if f.kind.read_flag is not None:
            try:
                value = f.kind.read_flag(value, f.flag)
            except Fail as fail:
                # A malformed flag is a usage error (exit 2), not a broken box.
                raise typer.BadParameter(fail.message) from None
        flat[f.key] = value
    return nest(flat)


# The keys publish shares with prepare: the flake both build with, where the
# GC roots live, how long a build may run, and the smoke run (which publish
# writes into the manifest, where it outranks the boxes' own). Same flags,
# same checks.
PUBLISH_SHARED = Table([TABLE.by_key[key] for key in ("flake", "state_dir", "build_timeout", "source.smoke")])


def make_app(table: Table = TABLE) -> typer.Typer:
    """The command, with an option for each field of `table`."""
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
            "Exit codes: 0 prepared, 75 transient (retry), 78 permanent (stop), 2 usage, 70 a bug (stop), "
            "130 interrupted."
        ),
    )

    def run(
        ctx: typer.Context,
        *,
        config: str | None = typer.Option(
            None,
            "--config",
            metavar="PATH",
            help="TOML file with a [join] table. Default: $FDL_PREPARE_CONFIG, else /etc/fdl/prepare.toml if present.",
        ),
        as_json: bool = typer.Option(
            False, "--json", help="Print one JSON object on stdout: the Prepared, or the Fail."
        ),
        version: bool | None = typer.Option(
            None, "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
        **given: Any,
    ) -> None:
        """Prepare this box (the default command)."""
        if ctx.invoked_subcommand is not None:
            _pass_to_subcommand(ctx, config, as_json, table, given)
            return
        raise typer.Exit(_prepare(config, _flags(table, given), as_json, table))

    app.callback(invoke_without_command=True)(_with_field_options(run, table))
    app.command("gpus")(gpus)
    app.command("publish", no_args_is_help=True)(_with_field_options(_fresh(publish), PUBLISH_SHARED, after=None))
    return app


def _pass_to_subcommand(
    ctx: typer.Context, config: str | None, as_json: bool, table: Table, given: Mapping[str, Any]
) -> None:
    """Before a subcommand, the root's --json is the subcommand's (`fdl-prepare
    --json gpus` prints JSON, as `fdl-prepare gpus --json` does); any other
    root flag would be silently ignored there, so it is a usage error."""
    ignored = [f.flag for f in table.fields if given.get(f.param) not in (None, [])]
    if config is not None:
        ignored.insert(0, "--config")
    if ignored:
        them = "it" if len(ignored) == 1 else "them"
        raise typer.BadParameter(
            f"given before `{ctx.invoked_subcommand}`, which would ignore {them}: drop {them}, or see "
            f"`{NAME} {ctx.invoked_subcommand} --help` for its own options",
            ctx=ctx,
            param_hint=", ".join(ignored),
        )
    ctx.obj = {"json": as_json}


def _root_json(ctx: typer.Context) -> bool:
    """Whether --json was given before the subcommand."""
    obj = ctx.find_root().obj
    return bool(isinstance(obj, dict) and obj.get("json"))


def _prepare(config_flag: str | None, flags: dict[str, Any], as_json: bool, table: Table = TABLE) -> int:
    from prepare import config
    from prepare.pipeline import prepare

    notes: list[str] = []
    start = time.monotonic()
    try:
        path = config.find_path(config_flag, os.environ)
        file_table = config.load(path, table=table) if path is not None else {}
        spec = config.resolve(file_table, flags, os.environ, table=table)
        progress = None
        if spec.wants_build:
            from prepare.cli import progress as progress_mod

            progress = progress_mod.renderer(sys.stderr)
        done = prepare(spec, notes, progress=progress)
    except Fail as fail:
        return _report_fail(fail, notes, as_json)
    except KeyboardInterrupt:
        return _report_interrupted(notes, as_json)
    except Exception as bug:  # noqa: BLE001 (a bug: reported with its traceback, exit 70)
        return _report_bug(bug, notes, as_json)

    if as_json:
        out = done.to_json()
        out["notes"] = [redact(n) for n in notes]
        # Keys in pipeline order, not sorted: the timings read as the steps ran.
        print(json.dumps(out))
        return EXIT_OK
    print_notes(NAME, notes)
    _summary(done, time.monotonic() - start)
    return EXIT_OK


def _report_fail(fail: Fail, notes: list[str], as_json: bool, name: str = NAME) -> int:
    code = EXIT_PERMANENT if fail.permanent else EXIT_TRANSIENT
    # Credentials in URLs never reach a journal or a JSON consumer, whoever
    # wrote the text (prepare.host.redact).
    message = redact(fail.message)
    if as_json:
        out = {**fail.to_json(), "message": message, "notes": [redact(n) for n in notes]}
        print(json.dumps(out, sort_keys=True))
        return code
    print_notes(name, notes)
    then = (
        "retrying cannot help: fix the cause above, then run again"
        if fail.permanent
        else "the next attempt may succeed: retry with backoff"
    )
    print(f"{name}: {fail.kind} failure: {printable(message, lines=True)}", file=sys.stderr)
    print(f"{name}: exit {code}: {then}", file=sys.stderr)
    return code


def _report_interrupted(notes: list[str], as_json: bool, name: str = NAME) -> int:
    """SIGINT, or SIGTERM from systemd stopping the unit: the seam in
    prepare.host.proc has stopped any running child by now."""
    message = (
        "interrupted (SIGINT or SIGTERM) before preparation finished: the running step and its child were "
        "stopped; the next attempt starts over"
    )
    if as_json:
        out = {"kind": "interrupted", "message": message, "notes": [redact(n) for n in notes]}
        print(json.dumps(out, sort_keys=True), flush=True)
    else:
        print_notes(name, notes)
    print(f"{name}: interrupted", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def _report_bug(bug: BaseException, notes: list[str], as_json: bool, name: str = NAME) -> int:
    """An exception that is not a Fail: a bug, said as one, with the
    traceback a report needs, and an exit code no unit retries."""
    import traceback

    trace = redact("".join(traceback.format_exception(type(bug), bug, bug.__traceback__)))
    message = redact(
        f"internal error: {type(bug).__name__}: {bug}. This is a bug in fdl-prepare, not a problem of this box: "
        "retrying would only repeat it. Report it with the traceback, and the config and flags that led to it"
    )
    if as_json:
        out = {"kind": "bug", "message": message, "traceback": trace, "notes": [redact(n) for n in notes]}
        print(json.dumps(out, sort_keys=True), flush=True)
    else:
        print_notes(name, notes)
    print(trace, file=sys.stderr, end="")
    print(f"{name}: {message}", file=sys.stderr)
    print(f"{name}: exit {EXIT_SOFTWARE}: a bug; the unit does not restart on it", file=sys.stderr, flush=True)
    return EXIT_SOFTWARE


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
        rows.append(("args", shlex.join(done.args)))
    if done.run_id is not None:
        rows.append(("run", done.run_id))
    err = sys.stderr
    print(f"{NAME}: prepared in {seconds:.2f}s", file=err)
    # The run's values come from its manifest: escaped, one line each.
    for key, value in rows:
        print(f"  {key:<9} {printable(value)}", file=err)


def gpus(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print the survey as JSON on stdout."),
) -> None:
    """Survey the GPUs and print them: NVIDIA through NVML (after CUDA_VISIBLE_DEVICES), AMD from the
    amdgpu driver's KFD topology (after ROCR_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES), each numbered
    as its runtime numbers it."""
    from prepare.gpu import gate
    from prepare.gpu import table as gpu_table

    as_json = as_json or _root_json(ctx)
    name = f"{NAME} gpus"
    try:
        survey = gate.survey(os.environ)
    except Fail as fail:
        raise typer.Exit(_report_fail(fail, [], as_json, name)) from None
    except KeyboardInterrupt:
        raise typer.Exit(_report_interrupted([], as_json, name)) from None
    except Exception as bug:  # noqa: BLE001 (a bug: reported with its traceback, exit 70)
        raise typer.Exit(_report_bug(bug, [], as_json, name)) from None
    if as_json:
        print(json.dumps(survey.to_json()))
    else:
        print(gpu_table.format_table(survey))
        health = gpu_table.format_health(survey)
        if health:
            print("\n" + health)
        print_notes(name, survey.notes)
    raise typer.Exit(EXIT_OK)


def publish(
    ctx: typer.Context,
    source: str = typer.Argument(..., metavar="SOURCE_DIR", help="The training source tree (a git checkout or not)."),
    bin_: str = typer.Option(..., "--bin", metavar="NAME", help="The training binary the build installs."),
    variants: Annotated[
        list[str] | None,
        typer.Option(
            "--variant", metavar="LABEL", help="libtorch variant to build and serve, repeatable (cpu, cu128)."
        ),
    ] = None,
    to: str = typer.Option(..., "--to", metavar="URL", help="The binary cache: a store URL `nix copy --to` takes."),
    signing_key: str = typer.Option(
        ..., "--signing-key", metavar="FILE", help="Nix secret key file the outputs are signed with (read by nix)."
    ),
    cwd: str = typer.Option(".", "--cwd", metavar="DIR", help="Directory inside the source the build and run use."),
    build: str | None = typer.Option(None, "--build", metavar="CMD", help="Build line (default: the flake's)."),
    args: Annotated[
        list[str] | None, typer.Option("--arg", metavar="ARG", help="An argument of the run, repeatable, in order.")
    ] = None,
    no_smoke: bool = typer.Option(False, "--no-smoke", help="Write `smoke = []`: the boxes make no smoke run."),
    commit: bool = typer.Option(False, "--commit", help="git: commit the manifest alone on the commit built."),
    push: bool = typer.Option(False, "--push", help="git: commit and push the manifest."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout: the publish, or the Fail."),
    **given: Any,
) -> None:
    """Build the run's outputs for each variant, sign them, copy them to a binary cache, then write
    .fdl-run.toml (the commit point): boxes that trust the key substitute instead of building.
    --flake must name the flake the boxes build with, at the same revision."""
    from prepare import config
    from prepare.cli import progress as progress_mod
    from prepare.publish.spec import PublishSpec
    from prepare.publish.steps import publish as run_publish

    as_json = as_json or _root_json(ctx)
    notes: list[str] = []
    start = time.monotonic()
    name = f"{NAME} publish"
    try:
        # The same flags, checks and environment defaults as prepare's.
        shared = config.resolve({}, _flags(PUBLISH_SHARED, given), os.environ, table=PUBLISH_SHARED)
    except Fail as fail:
        raise typer.Exit(_report_fail(fail, notes, as_json, name)) from None
    except Exception as bug:  # noqa: BLE001 (a bug: reported with its traceback, exit 70)
        raise typer.Exit(_report_bug(bug, notes, as_json, name)) from None
    smoke = None if shared.source is None else shared.source.smoke
    if smoke and no_smoke:
        raise typer.BadParameter("give --smoke ARG to set the smoke run, or --no-smoke to turn it off, not both")
    spec = PublishSpec(
        source=source,
        bin=bin_,
        variants=tuple(variants or ()),
        to=to,
        signing_key=signing_key,
        cwd=cwd,
        build=build,
        args=tuple(args or ()),
        smoke=() if no_smoke else smoke,
        flake=shared.flake,
        state_dir=shared.state_dir,
        build_timeout_s=shared.build_timeout_s,
        commit=commit or push,
        push=push,
    )
    try:
        done = run_publish(spec, notes, progress_mod.renderer(sys.stderr, prefix=name))
    except Fail as fail:
        raise typer.Exit(_report_fail(fail, notes, as_json, name)) from None
    except KeyboardInterrupt:
        raise typer.Exit(_report_interrupted(notes, as_json, name)) from None
    except Exception as bug:  # noqa: BLE001 (a bug: reported with its traceback, exit 70)
        raise typer.Exit(_report_bug(bug, notes, as_json, name)) from None
    if as_json:
        print(json.dumps({**done.to_json(), "notes": notes}))
        raise typer.Exit(EXIT_OK)
    print_notes(name, notes)
    err = sys.stderr
    print(f"{name}: run {done.run_id} published in {time.monotonic() - start:.2f}s", file=err)
    rows = [("source", os.path.abspath(source) + (f" (git {done.rev[:12]})" if done.rev else ""))]
    rows += [("to", done.to)]
    rows += [(label, f"{out.bin}  (libtorch {out.libtorch})") for label, out in done.outputs.items()]
    rows += [("manifest", done.manifest + (f" (commit {done.commit[:12]})" if done.commit else ""))]
    if done.next_step:
        rows.append(("next", done.next_step))
    for key, value in rows:
        print(f"  {key:<9} {value}", file=err)
    raise typer.Exit(EXIT_OK)


app = make_app()


class _Output:
    """sys.stdout or sys.stderr, whose writes never raise: the first error
    (a full disk, a reader gone) is kept in `failed`, and the stream is
    pointed at /dev/null so that nothing written later, the interpreter's
    last flush included, fails again."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        if self.failed is None:
            try:
                return int(self._stream.write(text))
            except (OSError, ValueError) as err:
                self._fail(err if isinstance(err, OSError) else OSError(errno.EBADF, str(err)))
        return len(text)

    def flush(self) -> None:
        if self.failed is None:
            try:
                self._stream.flush()
            except (OSError, ValueError) as err:
                self._fail(err if isinstance(err, OSError) else OSError(errno.EBADF, str(err)))

    def _fail(self, err: OSError) -> None:
        self.failed = err
        with contextlib.suppress(OSError, ValueError, AttributeError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


# A result that could not be written to a full disk: a person frees space.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def main(args: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    # (None: Python found no open fd there at start; nothing is written.)
    out, err = _Output(sys.stdout), _Output(sys.stderr)
    if sys.stdout is not None:
        sys.stdout = cast(Any, out)
    if sys.stderr is not None:
        sys.stderr = cast(Any, err)
    code: Any = EXIT_OK
    try:
        app(args=args, prog_name=NAME, standalone_mode=True)
    except SystemExit as done:
        code = done.code
    except KeyboardInterrupt:
        # The commands say it themselves (typer turns an interrupt that
        # escapes them into a silent exit 130); this is one outside typer.
        print(f"{NAME}: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except Exception as bug:  # noqa: BLE001 (a bug: reported with its traceback, exit 70)
        # Outside the commands' own reports: the option parsing, the
        # imports. Still a bug, still not retried.
        code = _report_bug(bug, [], False)
    if sys.stdout is not None:
        out.flush()
    if sys.stderr is not None:
        err.flush()
    if out.failed is not None and code in (None, EXIT_OK):
        full = out.failed.errno in _DISK_FULL
        code = EXIT_PERMANENT if full else EXIT_TRANSIENT
        print(
            f"{NAME}: the result could not be written to stdout ({human.oserror(out.failed)}): "
            + ("free space where stdout goes, then run again" if full else "the next attempt writes it again")
            + f"; exit {code}",
            file=sys.stderr,
        )
        if sys.stderr is not None:
            err.flush()
    sys.exit(code)


def publish_main() -> None:
    """`fdl-prepare-publish ARGS` is `fdl-prepare publish ARGS`: a flake app
    is one program, and `nix run .#publish -- ARGS` runs this one."""
    main(["publish", *sys.argv[1:]])
