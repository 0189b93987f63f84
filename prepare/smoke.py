"""The smoke run: the built binary, run once, before the box says it is ready.

Everything before this proves the parts (a driver, healthy cards, a binary
in the store); only running the binary proves they meet. A training binary
that cannot load `libcuda.so.1` (no driver directory on a box that is not
NixOS), that links a library its closure lacks, or that cannot initialise
the GPU fails here instead of after the controller admitted the box.

The run's recipe says how (`smoke`, a list of arguments: `[join.source]
smoke`, outranked by the run manifest's, since the publisher knows what its
binary takes); an empty list, or none, runs nothing. The binary starts in
its run's cwd (the run directory, prepare.build.rundir), as the training
would: never as
root, with no capabilities, a clean environment and everything it starts
stopped when it ends (prepare.host.confine, `smoke_user`), and is killed at
`smoke_timeout` (`--smoke-timeout`). What it prints is kept to its last
OUTPUT_BYTES, whatever it prints, and a message quotes its last lines.

Kinds: the loader refusing the binary (a library not found, a symbol
missing, a wrong ELF) is permanent: no retry puts a library where the
binary looks, a person must (install the driver, fix the driver directory,
fix the flake). A timeout is transient: the box may be busy, the GPU still
waking. Any other non-zero exit is transient too, as a failed training build
is: the training source's to fix, and the next publish may.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prepare.fail import Fail
from prepare.host import confine, human, proc
from prepare.spec import Binary


@dataclass(frozen=True)
class SmokePlan:
    """The smoke run's part of the plan (prepare.plan): how long the binary
    may run, and whom it runs as when fdl-prepare is root. What it runs
    with is the recipe's (`smoke`), known only once the source is fetched."""

    timeout_s: float = 60.0
    user: str = confine.DEFAULT_USER


# Enough of the end of the output to show why; the start is usually banners.
LAST_LINES = 20
# Of each line quoted, and of all the output kept: a binary that prints a
# gigabyte costs this much memory and message, no more.
LINE_CHARS = 400
OUTPUT_BYTES = 64 << 10

# What glibc's loader (and musl's) says when it cannot start a program:
# "error while loading shared libraries: libcuda.so.1: cannot open shared
# object file", "symbol lookup error", "version `GLIBC_2.38' not found".
_LOADER = re.compile(
    r"error while loading shared libraries|cannot open shared object file|symbol lookup error|"
    r"version `[^']*' not found|undefined symbol:|Error loading shared library|wrong ELF class|"
    r"cannot execute binary file|exec format error"
)
_LIBRARY = re.compile(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file")


def run(
    binary: Binary, args: Sequence[str], timeout_s: float, notes: list[str], *, user: str = confine.DEFAULT_USER
) -> None:
    """Run `binary` with `args` once, confined (as `user` when root); raise
    a Fail when it does not exit 0."""
    argv = [binary.path, *args]
    confinement = confine.enter(user)
    command = human.printable(shlex.join(argv))
    if len(command) > LINE_CHARS:
        command = command[:LINE_CHARS] + " ... (cut)"
    shown = f"`{command}` (in {binary.cwd})"
    started = time.monotonic()
    try:
        done = proc.run(argv, timeout=timeout_s, cwd=binary.cwd, max_stdout=OUTPUT_BYTES, confine=confinement)
    except proc.Missing:
        raise Fail(
            "smoke.loader",
            f"smoke run: the built binary {binary.path} cannot be run (missing, or not executable by "
            f"{confinement.user}): the flake built a training output without its binary; fix the flake "
            "(nix/CONTRACT.md: bin/ holds the recipe's bin, executable)",
        ) from None
    except proc.TooLong:
        size = sum(len(a.encode()) + 1 for a in argv)
        raise Fail(
            "smoke.failed",
            f"smoke run {shown}: the kernel refused its command line ({human.size(size)}, E2BIG): the smoke "
            "arguments are longer than a program can be given. Shorten the run manifest's smoke list and publish "
            "again (or [join.source] smoke, --smoke, on the box)",
        ) from None
    except proc.ConfinementFailed as failed:
        raise Fail(
            "smoke.confinement",
            f"smoke run {shown}: could not drop to {confinement.user} ({failed.step.replace('_', ' ')} failed: "
            f"{failed}); the training source's code is never run with root's. fdl-prepare needs CAP_SETUID, "
            "CAP_SETGID and CAP_SETPCAP for it (the units keep them): give them back to the unit or container, "
            "or run fdl-prepare as an unprivileged user",
        ) from None
    except proc.ExecFailed as failed:
        raise Fail(
            "smoke.failed",
            f"smoke run {shown} could not be started ({failed}): the box is short of processes or memory; the "
            "next attempt retries",
        ) from None
    except proc.TimedOut as late:
        raise Fail(
            "smoke.timeout",
            f"smoke run {shown} did not finish within {timeout_s:g}s and was stopped, with everything it started"
            + _tail("its last lines on stderr", late.stderr)
            + ". The next attempt retries; raise smoke_timeout (--smoke-timeout) if its start is legitimately "
            "slow, or make the smoke arguments do less",
        ) from None
    finally:
        confine.leave(confinement)
    seconds = time.monotonic() - started
    if done.ok:
        # The binary's own last word (a training step's loss, say) is the
        # evidence; one line, bounded, is enough to show it.
        said = next((line.strip() for line in reversed(done.stdout.splitlines()) if line.strip()), "")
        notes.append(
            f"smoke run {shown} passed in {seconds:.2f}s ({confinement.describe(done.confined)})"
            + (f": {said[:LINE_CHARS]}" if said else "")
        )
        return
    raise _failed(shown, done, binary)


def _failed(shown: str, done: proc.Completed, binary: Binary) -> Fail:
    output = "\n".join(part for part in (done.stdout, done.stderr) if part.strip())
    said = _tail("its last lines", output)
    if _LOADER.search(output) or (done.returncode == 127 and "No such file" in output):
        missing = _LIBRARY.search(output)
        library = missing.group(1) if missing else None
        if library is not None and (library.startswith("libcuda") or library.startswith("libnvidia")):
            fix = (
                f"{library} is the NVIDIA driver's, which a Nix-built program finds only in the driver directory "
                "(driver_dir, --driver-dir, default /run/opengl-driver/lib): on a box that is not NixOS, "
                "fdl-prepare links it there when the box has NVIDIA cards (see the notes, and "
                f"`ls -l /run/opengl-driver/lib`); on NixOS, enable the NVIDIA driver (hardware.nvidia, "
                "hardware.graphics.enable). A CPU-only worker needs the cpu libtorch (--libtorch cpu)"
            )
        else:
            fix = (
                "the binary's closure lacks a library it links, or was built for another machine: fix the flake "
                f"that builds it (`ldd {binary.path}` shows what is not found)"
            )
        return Fail(
            "smoke.loader",
            f"smoke run {shown}: the loader could not start it (exit {done.returncode}){said}. Fix: {fix}",
        )
    return Fail(
        "smoke.failed",
        f"smoke run {shown} exited {done.returncode}{said}. The binary starts but fails its smoke run: fix the "
        "training source (or the manifest's smoke arguments) and publish again; the next attempt retries",
    )


def _tail(what: str, text: str) -> str:
    """The last lines of what the binary said, each cut and escaped: its
    output is the training source's, and must not write on the operator's
    terminal or forge a line of ours."""
    lines = [line for line in text.splitlines() if line.strip()][-LAST_LINES:]
    if not lines:
        return ""
    shown = [human.printable(line if len(line) <= LINE_CHARS else line[:LINE_CHARS] + " ... (cut)") for line in lines]
    return f"; {what}:\n  " + "\n  ".join(shown)
