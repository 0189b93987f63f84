"""The `fdl-prepare` command: flags and config in, a summary and an exit code out.

The options come from the field table (prepare.config.fields): one per
[join] key, defaulting to "not given", so defaults and precedence live in
prepare.config.resolve alone. The commands are the default one (prepare
this box), `check` (what an attempt would do, doing nothing), `gpus` (the
survey, and the gate's verdict on it), `publish` (build once, substitute
everywhere) and `completion` (a shell's completion script, made from this
parser). Only this package prints (besides `print_notes`), and every
outcome, with its exit code, is written by prepare.cli.report.

The root and every command take `--version`, `-q/--quiet` and
`-v/--verbose` (before or after the command word); a usage error under
`--json` is also a JSON object on stdout.

The parser is the standard library's argparse, and the steps, pynvml and
rich are imported inside the commands: a warm attempt and `--help` pay for
what they run and no more.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, NoReturn

from prepare.cli.report import EXIT_OK, NAME, NORMAL, QUIET, SCHEMA, VERBOSE, Report, Streams, Usage, usage
from prepare.config.fields import TABLE, Field, Table, nest
from prepare.fail import Fail

ROOT_USAGE = f"{NAME} [OPTIONS] COMMAND [ARGS]..."
DESCRIPTION = (
    "Get this box ready before it dials a training controller: GPU gate, dataset root, writable local "
    "directories, then a pinned libtorch and the training binary through Nix."
)
EPILOG = "Exit codes: 0 prepared, 75 transient (retry), 78 permanent (stop), 2 usage, 70 a bug (stop), 130 interrupted."
GPUS_HELP = (
    "Survey the GPUs and say whether an attempt would pass the GPU gate with them: NVIDIA through NVML (after "
    "CUDA_VISIBLE_DEVICES), AMD from the amdgpu driver's KFD topology (after ROCR_VISIBLE_DEVICES and "
    "HIP_VISIBLE_DEVICES), each numbered as its runtime numbers it, judged by the config's devices, expect_gpus "
    "and driver_dir. A health check: exit 0 ready, 78 the gate would stop the box, 75 a fabric still coming up."
)
CHECK_HELP = (
    "Settle everything an attempt would, except what changes the box or costs minutes: the config, the GPU gate, "
    "the dataset root (an sshfs source is reached, not mounted), the local directories (proven, not made), the "
    "flake, the source and the variant; then say what the build would substitute and build (`nix build "
    "--dry-run`). Exits as the attempt would: 0, 75, 78."
)
PUBLISH_HELP = (
    "Build the run's outputs for each variant, sign them, copy them to a binary cache, then write floDl's "
    ".fdl-run.sha256 and .fdl-run.yml (the commit point): boxes that trust the key substitute instead of "
    "building. --flake must name the flake the boxes build with, at the same revision."
)
COMPLETION_HELP = (
    "Print the shell completion script for bash, zsh or fish (e.g. `source <(fdl-prepare completion bash)`)."
)

# The keys publish shares with prepare: the flake both build with, where the
# GC roots live, how long a build may run. Same flags, same checks. Not the
# smoke run: floDl's manifest has no field for it, so it is each box's own.
PUBLISH_SHARED = ("flake", "state_dir", "build_timeout")
# The keys `gpus` judges the cards by: the gate's.
GPUS_KEYS = ("devices", "expect_gpus", "driver_dir", "gpu_timeout")
# The commands that read the config, and the root options they take, given
# before their word as after it (after it wins): `check` is an attempt's.
TAKES_CONFIG: dict[str, tuple[str, ...] | None] = {"gpus": GPUS_KEYS, "check": None}
CONFIG_HELP = (
    "TOML file with a [join] table, or floDl's fdl.yml (a .yml/.yaml file: its join: block). Default: "
    "$FDL_PREPARE_CONFIG, else /etc/fdl/prepare.toml if present."
)


def revision() -> str:
    """The revision of the flake the app was built from, as nix/app.nix
    writes it into prepare/_revision.py (`self.rev`, or `self.dirtyRev` for
    a tree with uncommitted changes), cut to 12 hex digits; "unknown" from
    a plain pip install, or a build from a tree git did not describe."""
    import importlib
    import re

    try:
        rev = getattr(importlib.import_module("prepare._revision"), "REVISION", None)
    except ImportError:
        return "unknown"
    found = re.fullmatch(r"([0-9a-f]{7,64})(-dirty)?", rev) if isinstance(rev, str) else None
    if found is None:
        return "unknown"
    return found.group(1)[:12] + (found.group(2) or "")


def version_line() -> str:
    from prepare import __version__

    return f"{NAME} {__version__} (rev {revision()})"


class _Version(argparse.Action):
    """`--version`, read only when asked for: the parser is built on every run."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        if _VERSION_AS_JSON.get():
            from prepare import __version__

            out = {"kind": "version", "schema": SCHEMA, "name": NAME, "version": __version__, "revision": revision()}
            print(json.dumps(out), flush=True)
        else:
            print(version_line(), flush=True)
        parser.exit()


# Whether --json was given beside --version: argparse runs the action as it
# meets the flag, before --json (which may come after it) is parsed.
_VERSION_AS_JSON: ContextVar[bool] = ContextVar("version_as_json", default=False)


class Interrupted(KeyboardInterrupt):
    """SIGTERM (systemd stopping the unit) unwinds like Ctrl-C, so the seam in
    prepare.host.proc stops any running child before we exit."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted()


# -- the parser ------------------------------------------------------------------------------


class _Help(argparse.HelpFormatter):
    """argparse's help, with the options' help in one column as click's is."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)

    def add_usage(self, usage: Any, actions: Any, groups: Any, prefix: str | None = None) -> None:
        super().add_usage(usage, actions, groups, "Usage: " if prefix is None else prefix)


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors raised as `Usage` (worded as click words
    them, naming the option) for prepare.cli.report to write, instead of
    argparse's own message and exit."""

    def __init__(self, *args: Any, command: str = NAME, usage_line: str = ROOT_USAGE, **kwargs: Any) -> None:
        kwargs.update(usage=usage_line, add_help=False, formatter_class=_Help)
        super().__init__(*args, **kwargs)
        self.command = command
        self.usage_line = usage_line
        self.add_argument("-h", "--help", action="help", help="Show this message and exit.")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        words = sys.argv[1:] if args is None else args
        return super().parse_known_args(_values_joined(words, self), namespace)

    def error(self, message: str) -> NoReturn:
        raise Usage(_clicked(message), usage=self.usage_line, command=self.command)


def _clicked(message: str) -> str:
    """argparse's words for a usage error, as the command has always said them."""
    for start, said in (
        ("unrecognized arguments: ", "No such option: {}"),
        ("the following arguments are required: ", "Missing option '{}'."),
    ):
        if message.startswith(start):
            rest = message.removeprefix(start).split(", ")[0].split(" ")[0]
            if start.startswith("the following") and not rest.startswith("-"):
                return f"Missing argument '{rest}'."
            return said.format(rest)
    if message.startswith("argument "):
        option, _, said = message.removeprefix("argument ").partition(": ")
        option = option.split("/")[0]
        if said.startswith("invalid choice: "):
            return f"No such command {said.removeprefix('invalid choice: ').split(' ')[0]}."
        if said.startswith("ignored explicit argument"):
            return f"Option '{option}' does not take a value."
        if said.startswith("expected one argument"):
            return f"Option '{option}' requires an argument."
        return f"Invalid value for '{option}': {said}"
    return message


def _typed(kind: type, name: str) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {name}.") from None

    return read


def _read_flag(f: Field) -> Callable[[str], Any]:
    """A flag whose text needs more reading (`--devices 0,1`): a malformed
    one is a usage error (exit 2), not a broken box."""
    reader = f.kind.read_flag
    assert reader is not None

    def read(text: str) -> Any:
        try:
            return reader(text, f.flag)
        except Fail as fail:
            raise argparse.ArgumentTypeError(fail.message) from None

    return read


def _add_field(parser: argparse.ArgumentParser, f: Field, dest: str) -> None:
    """The option for one field of the config. It defaults to None, "not
    given", whatever the field's default."""
    kind = f.kind.flag_type
    if kind is bool:
        parser.add_argument(f.flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=f.help)
        return
    read: Callable[[str], Any] = str
    if f.kind.read_flag is not None:
        read = _read_flag(f)
    elif kind is int:
        read = _typed(int, "int")
    elif kind is float:
        read = _typed(float, "float")
    # A repeatable flag: each occurrence is one item of the list.
    action = "append" if kind is list else "store"
    parser.add_argument(f.flag, dest=dest, action=action, type=read, metavar=f.metavar, default=None, help=f.help)


def parser(table: Table = TABLE) -> Parser:
    """The command line: the root's options (one per field of `table`) and
    its commands. A root option's dest is its field's param; a command's own
    options are under `<command>.<name>`, so the root's and a command's never
    share one (save -q and -v, which are one setting wherever given)."""
    root = Parser(prog=NAME, description=DESCRIPTION, epilog=EPILOG)
    root.add_argument("--config", metavar="PATH", help=CONFIG_HELP)
    for f in table.fields:
        _add_field(root, f, f.param)
    root.add_argument("--json", action="store_true", help="Print one JSON object on stdout: the Prepared, or the Fail.")
    _everywhere(root, root=True)
    commands = root.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=Parser)

    check = _command(commands, "check", CHECK_HELP, f"{NAME} check [OPTIONS]")
    check.add_argument("--config", dest="check.config", metavar="PATH", help=CONFIG_HELP)
    for f in table.fields:
        _add_field(check, f, f"check.{f.param}")
    check.add_argument(
        "--json", dest="check.json", action="store_true", help="Print one JSON object on stdout: the check."
    )

    gpus = _command(commands, "gpus", GPUS_HELP, f"{NAME} gpus [OPTIONS]")
    gpus.add_argument("--config", dest="gpus.config", metavar="PATH", help=CONFIG_HELP)
    for f in _keys(table, GPUS_KEYS).fields:
        _add_field(gpus, f, f"gpus.{f.param}")
    gpus.add_argument(
        "--json", dest="gpus.json", action="store_true", help="Print the survey and the gate's verdict as JSON."
    )

    publish = _command(commands, "publish", PUBLISH_HELP, f"{NAME} publish [OPTIONS] SOURCE_DIR")
    publish.add_argument(
        "source", metavar="SOURCE_DIR", help="The training source tree (a git checkout or not).", nargs="?"
    )
    publish.add_argument("--bin", dest="publish.bin", metavar="NAME", help="The training binary the build installs.")
    publish.add_argument(
        "--variant",
        dest="publish.variant",
        action="append",
        metavar="LABEL",
        help="libtorch variant to build and serve, repeatable (cpu, cu128).",
    )
    publish.add_argument(
        "--to", dest="publish.to", metavar="URL", help="The binary cache: a store URL `nix copy --to` takes."
    )
    publish.add_argument(
        "--signing-key",
        dest="publish.signing_key",
        metavar="FILE",
        help="Nix secret key file the outputs are signed with (read by nix).",
    )
    publish.add_argument(
        "--cwd",
        dest="publish.cwd",
        metavar="DIR",
        default=".",
        help="Directory inside the source the build and run use. Default: .",
    )
    publish.add_argument("--build", dest="publish.build", metavar="CMD", help="Build line (default: the flake's).")
    publish.add_argument(
        "--arg",
        dest="publish.arg",
        action="append",
        metavar="ARG",
        help="An argument of the run, repeatable, in order.",
    )
    publish.add_argument(
        "--commit",
        dest="publish.commit",
        action="store_true",
        help="git: commit the run files alone on the commit built.",
    )
    publish.add_argument("--push", dest="publish.push", action="store_true", help="git: commit and push the run files.")
    publish.add_argument(
        "--json",
        dest="publish.json",
        action="store_true",
        help="Print one JSON object on stdout: the publish, or the Fail.",
    )
    for f in _shared(table).fields:
        _add_field(publish, f, f"publish.{f.param}")

    completion = _command(commands, "completion", COMPLETION_HELP, f"{NAME} completion {{bash,zsh,fish}}")
    completion.add_argument("shell", choices=("bash", "zsh", "fish"), metavar="{bash,zsh,fish}")
    return root


def _command(commands: Any, name: str, help: str, usage_line: str) -> Parser:
    made: Parser = commands.add_parser(
        name, help=help, description=help, command=f"{NAME} {name}", usage_line=usage_line
    )
    _everywhere(made, root=False)
    return made


def _everywhere(parser: Parser, *, root: bool) -> None:
    """The options the root and every command take. After a command word,
    -q and -v default to "not given" (SUPPRESS), so `fdl-prepare -v gpus`
    keeps the root's -v."""
    default: Any = False if root else argparse.SUPPRESS
    parser.add_argument("--version", action=_Version, help="Print the version and the revision, and exit.")
    parser.add_argument(
        "-q", "--quiet", action="store_true", default=default, help="Print only warnings and failures on stderr."
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default,
        help="Also print each command fdl-prepare runs (credentials hidden) and each step's time.",
    )


def level(given: argparse.Namespace) -> int:
    """QUIET, NORMAL or VERBOSE, as -q and -v said."""
    if getattr(given, "quiet", False):
        return QUIET
    if getattr(given, "verbose", False):
        return VERBOSE
    return NORMAL


def report_for(given: argparse.Namespace, name: str, as_json: bool) -> Report:
    """The Report of a command run with `given`: its -q/-v level."""
    return Report(name, as_json=as_json, level=level(given))


def _shared(table: Table) -> Table:
    return _keys(table, PUBLISH_SHARED)


def _keys(table: Table, keys: Sequence[str]) -> Table:
    return Table([table.by_key[key] for key in keys if key in table.by_key])


def _taken(command: str, table: Table) -> Table:
    """The fields `command` takes from the config and the command line."""
    keys = TAKES_CONFIG.get(command, ())
    return table if keys is None else _keys(table, keys)


def flags(table: Table, given: argparse.Namespace | Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The options given, in the shape of the config's [join] table, so
    precedence can live in one place (prepare.config.resolve)."""
    values = vars(given) if isinstance(given, argparse.Namespace) else given
    flat: dict[str, Any] = {}
    for f in table.fields:
        value = values.get(prefix + f.param)
        if value is not None:
            flat[f.key] = value
    return nest(flat)


# -- the commands --------------------------------------------------------------------------------


def run(args: Sequence[str] | None = None, *, table: Table = TABLE) -> int:
    """Parse `args` (default: the process's) and run the command they name;
    the exit code. Writes to sys.stdout and sys.stderr as they are."""
    argv = sys.argv[1:] if args is None else list(args)
    the_parser = parser(table)
    try:
        as_json = "--json" in _options_given(argv, the_parser)
    except Exception:  # noqa: BLE001 (no word of a command line may turn its usage error into a bug)
        as_json = False
    _VERSION_AS_JSON.set(as_json)
    try:
        if argv[:1] == ["publish"] and len(argv) == 1:
            # No arguments at all is a request for help, as a usage error.
            _commands(the_parser)["publish"].print_help(sys.stderr)
            return 2
        given, extra = the_parser.parse_known_args(argv)
        if extra:
            # Named by the command they were given to, with its usage.
            (_commands(the_parser)[given.command] if given.command else the_parser).error(
                f"unrecognized arguments: {' '.join(extra)}"
            )
        if given.quiet and given.verbose:
            raise Usage("Invalid value for -q/--quiet: give -q or -v, not both", usage=ROOT_USAGE)
        if given.command is not None:
            _nothing_for(given, table)
        if given.command == "publish":
            _publish_args(given, _commands(the_parser)["publish"])
    except Usage as error:
        return usage(error, as_json=as_json)
    except SystemExit as done:  # --help, --version: argparse has printed them
        return int(done.code or 0)
    command = given.command or "prepare"
    return COMMANDS[command](given, table)


def _values_joined(argv: Sequence[str], root: argparse.ArgumentParser) -> list[str]:
    """`argv` with each option that takes a value joined to it (`--smoke
    --steps` as `--smoke=--steps`): the next word is the value whatever it
    looks like, as the command has always read it, where argparse would take
    one that starts with '-' for an option. A training binary's arguments
    (`--smoke`, `--arg`) usually do."""
    commands = _commands(root)
    valued = _valued(root)
    out: list[str] = []
    words = list(argv)
    while words:
        word = words.pop(0)
        if word == "--":
            out += [word, *words]
            break
        if word in valued and words:
            out.append(f"{word}={words.pop(0)}")
            continue
        if word in commands:
            valued = _valued(commands[word])
            commands = {}
        out.append(word)
    return out


def _options_given(argv: Sequence[str], root: argparse.ArgumentParser) -> list[str]:
    """The words of `argv` before `--` that are options, not an option's
    value (`--smoke --json` gives the smoke run `--json`)."""
    words = _values_joined(argv, root)
    return words[: words.index("--")] if "--" in words else words


def _valued(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for a in parser._actions if a.option_strings and a.nargs != 0 for flag in a.option_strings}


def _commands(parser: argparse.ArgumentParser) -> dict[str, Parser]:
    """The commands of `parser` (none for a command's own)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _nothing_for(given: argparse.Namespace, table: Table) -> None:
    """Before a command, the root's --json is the command's (`fdl-prepare
    --json gpus` prints JSON, as `fdl-prepare gpus --json` does), and so are
    --config and the options of the fields it takes (TAKES_CONFIG); any
    other root option would be silently ignored there, so it is a usage
    error."""
    taken = {f.key for f in _taken(given.command, table).fields}
    ignored = [f.flag for f in table.fields if f.key not in taken and getattr(given, f.param) not in (None, [])]
    if given.config is not None and given.command not in TAKES_CONFIG:
        ignored.insert(0, "--config")
    if not ignored:
        return
    them = "it" if len(ignored) == 1 else "them"
    raise Usage(
        f"Invalid value for {', '.join(ignored)}: given before `{given.command}`, which would ignore {them}: drop "
        f"{them}, or see `{NAME} {given.command} --help` for its own options",
        usage=ROOT_USAGE,
    )


def _publish_args(given: argparse.Namespace, publish: Parser) -> None:
    """What publish requires, and what it cannot take together."""
    values = vars(given)
    if values["source"] is None:
        publish.error("the following arguments are required: SOURCE_DIR")
    for option, dest in (("--bin", "bin"), ("--to", "to"), ("--signing-key", "signing_key")):
        if values[f"publish.{dest}"] is None:
            publish.error(f"the following arguments are required: {option}")


def _spec(given: argparse.Namespace, table: Table, command: str | None = None, notes: list[str] | None = None) -> Any:
    """The PrepareSpec of the config file and the options: the root's, and
    after a command's word (`command`) that command's own, which win. For
    a command that takes only some fields, only those are read from the
    options (the file is read whole: it is the unit's)."""
    from prepare import config

    values = vars(given)
    own = None if command is None else values.get(f"{command}.config")
    path = config.find_path(own if own is not None else given.config, os.environ)
    file = config.load(path, table=table, notes=notes) if path is not None else {}
    given_flags = flags(table, given)
    if command is not None:
        taken = _taken(command, table)
        given_flags = _merged(flags(taken, given), flags(taken, given, f"{command}."))
    return config.resolve(file, given_flags, os.environ, table=table)


def _merged(under: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Nested option values, `over`'s winning key by key."""
    out = dict(under)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def progress_for(report: Report) -> Any:
    """What a command's steps report to: the display on stderr (none under
    -q), and the report's own receiver (the unit's status line, -v's step
    times)."""
    from prepare.cli import progress as display

    shown = None if report.level == QUIET else display.renderer(sys.stderr, prefix=report.name)
    return display.chain(shown, report.event)


def watched(report: Report) -> Any:
    """Under -v, each program started is shown (prepare.host.proc)."""
    import contextlib

    if report.level < VERBOSE:
        return contextlib.nullcontext()
    from prepare.host import proc

    return proc.watching(report.command)


def _prepare(given: argparse.Namespace, table: Table) -> int:
    report = report_for(given, NAME, given.json)

    def work() -> Any:
        from prepare import pipeline

        spec = _spec(given, table, notes=report.notes)
        with watched(report):
            return pipeline.prepare(spec, report.notes, progress=progress_for(report))

    return report.outcome(work)


# `gpus` takes no --cpu-only: a box that should not be gated is told how it
# is not, instead.
GPUS_CPU_ONLY = (
    "or, if this box is meant to train on its CPU, it needs no GPU health check: set cpu_only = true under "
    "[join], and an attempt skips the gate"
)


def _gpus(given: argparse.Namespace, table: Table) -> int:
    report = report_for(given, f"{NAME} gpus", given.json or vars(given)["gpus.json"])

    def work() -> Any:
        from prepare.gpu import gate
        from prepare.gpu.devices import CPU_ONLY_ADVICE
        from prepare.plan import gate_plan

        plan = gate_plan(_spec(given, table, "gpus"))
        advice = CPU_ONLY_ADVICE.set(GPUS_CPU_ONLY)
        try:
            return gate.health(plan, report.notes)
        finally:
            CPU_ONLY_ADVICE.reset(advice)

    return report.outcome(work)


def _check(given: argparse.Namespace, table: Table) -> int:
    report = report_for(given, f"{NAME} check", given.json or vars(given)["check.json"])

    def work() -> Any:
        from prepare import pipeline

        spec = _spec(given, table, "check", notes=report.notes)
        with watched(report):
            return pipeline.check(spec, report.notes, progress=progress_for(report))

    return report.outcome(work)


def _publish(given: argparse.Namespace, table: Table) -> int:
    values = vars(given)
    report = report_for(given, f"{NAME} publish", given.json or values["publish.json"])

    def work() -> Any:
        from prepare import config
        from prepare.publish import PublishSpec, publish

        # The same flags, checks and environment defaults as prepare's.
        shared_table = _shared(table)
        shared = config.resolve({}, flags(shared_table, given, "publish."), os.environ, table=shared_table)
        spec = PublishSpec(
            source=values["source"],
            bin=values["publish.bin"],
            variants=tuple(values["publish.variant"] or ()),
            to=values["publish.to"],
            signing_key=values["publish.signing_key"],
            cwd=values["publish.cwd"],
            build=values["publish.build"],
            args=tuple(values["publish.arg"] or ()),
            flake=shared.flake,
            state_dir=shared.state_dir,
            build_timeout_s=shared.build_timeout_s,
            commit=values["publish.commit"] or values["publish.push"],
            push=values["publish.push"],
        )
        with watched(report):
            return publish(spec, report.notes, progress_for(report))

    return report.outcome(work)


def _completion(given: argparse.Namespace, table: Table) -> int:
    from prepare.cli import completion

    print(completion.script(given.shell, parser(table)), end="")
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace, Table], int]] = {
    "prepare": _prepare,
    "check": _check,
    "gpus": _gpus,
    "publish": _publish,
    "completion": _completion,
}


def main(args: Sequence[str] | None = None) -> None:
    """The console script: the command's outcome as its exit code, SIGTERM
    taken as an interruption, and output that cannot be written reported
    as such (prepare.cli.report.Streams)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    streams = Streams()
    code: Any
    try:
        code = run(args)
    except KeyboardInterrupt:
        # Outside a command's own report: an interruption while parsing.
        code = Report().interrupted()
    except Exception as bug:  # noqa: BLE001 (a bug: reported with its traceback, exit 70)
        # Outside the commands' own reports: the option parsing, the
        # imports. Still a bug, still not retried.
        code = Report().bug(bug)
    sys.exit(streams.close(code))


def publish_main() -> None:
    """`fdl-prepare-publish ARGS` is `fdl-prepare publish ARGS`: a flake app
    is one program, and `nix run .#publish -- ARGS` runs this one."""
    main(["publish", *sys.argv[1:]])
