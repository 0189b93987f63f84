"""Shell completion, made from the parser itself (`fdl-prepare completion
bash|zsh|fish`): every option of the root and of each command, and which of
them take a path, so a field added to the table completes without an edit
here.

    source <(fdl-prepare completion bash)                       # bash
    fdl-prepare completion zsh > "${fpath[1]}/_fdl-prepare"     # zsh
    fdl-prepare completion fish > ~/.config/fish/completions/fdl-prepare.fish
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

NAME = "fdl-prepare"
# Options whose value is a file or a directory on this box, by metavar.
PATHS = frozenset({"PATH", "DIR", "FILE", "SOURCE_DIR"})


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    help: str
    # None: a switch; else what its value is.
    metavar: str | None
    choices: tuple[str, ...] = ()

    @property
    def path(self) -> bool:
        return self.metavar in PATHS


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    options: tuple[Option, ...]
    # The values of its positional argument, when they are a fixed few.
    choices: tuple[str, ...] = ()
    # Whether its positional argument is a path.
    path: bool = False


def read(parser: argparse.ArgumentParser) -> tuple[tuple[Option, ...], tuple[Command, ...]]:
    """The root's options and the commands, with theirs."""
    commands: list[Command] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                positional = [a for a in sub._actions if not a.option_strings]
                choices = tuple(positional[0].choices or ()) if positional else ()
                path = bool(positional) and positional[0].metavar in PATHS
                commands.append(Command(name, first_sentence(helps.get(name, "")), _options(sub), choices, path))
    return _options(parser), tuple(commands)


def _options(parser: argparse.ArgumentParser) -> tuple[Option, ...]:
    out = []
    for action in parser._actions:
        if not action.option_strings:
            continue
        takes = action.nargs != 0
        metavar = (action.metavar if isinstance(action.metavar, str) else None) or (
            action.dest.upper() if takes else None
        )
        out.append(Option(tuple(action.option_strings), first_sentence(action.help or ""), metavar if takes else None))
    return tuple(out)


def first_sentence(text: str) -> str:
    """A help text's first sentence: what fits beside a completion."""
    return re.split(r"(?<=\.)\s+(?=[A-Z$-])", text.strip(), maxsplit=1)[0]


def script(shell: str, parser: argparse.ArgumentParser) -> str:
    options, commands = read(parser)
    return {"bash": _bash, "zsh": _zsh, "fish": _fish}[shell](options, commands)


def _words(options: tuple[Option, ...]) -> str:
    return " ".join(flag for option in options for flag in option.flags)


def _bash(options: tuple[Option, ...], commands: tuple[Command, ...]) -> str:
    valued = [flag for option in options for flag in option.flags if option.metavar and not option.path]
    paths = [flag for option in options for flag in option.flags if option.path]
    for command in commands:
        valued += [flag for option in command.options for flag in option.flags if option.metavar and not option.path]
        paths += [flag for option in command.options for flag in option.flags if option.path]
    cases = "\n".join(
        f'        {c.name}) opts="{_words(c.options)}"; args="{" ".join(c.choices)}"; path={int(c.path)};;'
        for c in commands
    )
    names = " ".join(c.name for c in commands)
    return f"""# bash completion for {NAME}: source <({NAME} completion bash)
_fdl_prepare() {{
    local cur prev command="" word opts args="" path=0
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    for word in "${{COMP_WORDS[@]:1:COMP_CWORD-1}}"; do
        case "$word" in {names.replace(" ", "|")}) command="$word"; break;; esac
    done
    case "$prev" in
        {"|".join(paths) or "--"}) COMPREPLY=($(compgen -f -- "$cur")); return;;
        {"|".join(valued) or "--"}) COMPREPLY=(); return;;
    esac
    opts="{_words(options)}"
    case "$command" in
{cases}
        *) args="{names}";;
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    elif [[ $path == 1 ]]; then
        COMPREPLY=($(compgen -f -- "$cur"))
    else
        COMPREPLY=($(compgen -W "$args" -- "$cur"))
    fi
}}
complete -o filenames -F _fdl_prepare {NAME}
complete -o filenames -F _fdl_prepare {NAME}-publish
"""


def _zsh_quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "'\\''").replace("[", "\\[").replace("]", "\\]").replace(":", "\\:")


def _zsh_specs(options: tuple[Option, ...]) -> list[str]:
    specs = []
    for option in options:
        value = ""
        if option.metavar:
            value = f":{option.metavar.lower()}:" + ("_files" if option.path else " ")
        for flag in option.flags:
            specs.append(f"'{flag}[{_zsh_quote(option.help)}]{value}'")
    return specs


def _zsh(options: tuple[Option, ...], commands: tuple[Command, ...]) -> str:
    described = " ".join(f"'{c.name}:{_zsh_quote(c.help)}'" for c in commands)
    blocks = []
    for c in commands:
        positional = "'1:source:_files'" if c.path else (f"'1:{c.name}:({' '.join(c.choices)})'" if c.choices else "")
        specs = " \\\n        ".join([*_zsh_specs(c.options), *([positional] if positional else [])])
        blocks.append(f"    {c.name})\n      _arguments -s \\\n        {specs}\n      ;;")
    root = " \\\n    ".join(_zsh_specs(options))
    return f"""#compdef {NAME} {NAME}-publish
# zsh completion for {NAME}: {NAME} completion zsh > "${{fpath[1]}}/_{NAME}"
_fdl_prepare() {{
  local -a commands
  commands=({described})
  local curcontext="$curcontext" state line
  _arguments -C \\
    {root} \\
    '1: :->command' \\
    '*:: :->args'
  case $state in
    command) _describe 'command' commands ;;
    args)
      case $line[1] in
{chr(10).join(blocks)}
      esac
      ;;
  esac
}}
_fdl_prepare "$@"
"""


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_lines(options: tuple[Option, ...], condition: str) -> list[str]:
    lines = []
    for option in options:
        parts = [f"complete -c {NAME} -n {_fish_quote(condition)}"]
        for flag in option.flags:
            parts.append(f"-l {flag[2:]}" if flag.startswith("--") else f"-s {flag[1:]}")
        if option.metavar:
            parts.append("-r -F" if option.path else "-r -f")
        parts.append(f"-d {_fish_quote(option.help)}")
        lines.append(" ".join(parts))
    return lines


def _fish(options: tuple[Option, ...], commands: tuple[Command, ...]) -> str:
    lines = [f"# fish completion for {NAME}: {NAME} completion fish > ~/.config/fish/completions/{NAME}.fish"]
    lines.append(f"complete -c {NAME} -f")
    lines += _fish_lines(options, "__fish_use_subcommand")
    for c in commands:
        lines.append(f"complete -c {NAME} -n '__fish_use_subcommand' -a {c.name} -d {_fish_quote(c.help)}")
        seen = f"__fish_seen_subcommand_from {c.name}"
        lines += _fish_lines(c.options, seen)
        if c.choices:
            lines.append(f"complete -c {NAME} -n {_fish_quote(seen)} -a {_fish_quote(' '.join(c.choices))}")
        if c.path:
            lines.append(f"complete -c {NAME} -n {_fish_quote(seen)} -F")
    return "\n".join(lines) + "\n"
