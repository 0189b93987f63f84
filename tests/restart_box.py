"""A unit restarted the way systemd restarts it, around real sshfs mounts.

Run as root, as a script, inside its own mount namespace (`unshare --mount
--propagation private python restart_box.py SPEC.json`): the mounts it
makes, and the `/run/systemd/system` it may lend itself, stay in there.

Each attempt is `fdl-prepare` started in a cgroup of its own, the unit's,
as systemd starts a service. Restarting the unit is what systemd does on
`systemctl restart` with its default KillMode=control-group: every process
still in the unit's cgroup is killed (`cgroup.kill`), whatever process
group or session it made for itself. What moved to another cgroup lives.

With `"systemd": true` in the spec, the namespace gets a
`/run/systemd/system` (what sd_booted(3) checks) and a `systemd-run` that
stands in for the real one's `--scope`: systemd moves the caller into a new
transient scope's cgroup and the caller then executes the command; the
stand-in makes a cgroup of its own and moves itself into it, then executes
the command. fdl-prepare cannot tell the difference, and has no switch for
tests. Prints one JSON object: what each attempt said and where the sshfs
daemon lived.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# What the real one says when the manager will not make the scope.
REFUSING_SYSTEMD_RUN = """#!/bin/sh
echo "Failed to start transient scope unit: Access denied" >&2
exit 1
"""

FAKE_SYSTEMD_RUN = """#!/bin/sh
# Stands in for `systemd-run --scope ... -- COMMAND` (tests/restart_box.py).
set -e
scope="$FDL_TEST_CGROUP/fdl-test-scope-$$"
mkdir "$scope"
echo $$ > "$scope/cgroup.procs"
echo "$scope" >> "$FDL_TEST_SCOPES"
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do printf '%s\\n' "$1" >> "$FDL_TEST_SCOPES.args"; shift; done
shift
exec "$@"
"""


def cgroup2_root() -> str:
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            fields = line.split()
            after = fields.index("-")
            if fields[after + 1] == "cgroup2":
                return fields[4]
    raise SystemExit("no cgroup2 hierarchy is mounted")


def pids_of(cgroup: Path) -> list[int]:
    return [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]


def kill_cgroup(cgroup: Path) -> None:
    """Every process in `cgroup`, as systemd's KillMode=control-group stops a unit."""
    try:
        (cgroup / "cgroup.kill").write_text("1")
    except OSError:
        for pid in pids_of(cgroup):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pids_of(cgroup) and time.monotonic() < deadline:
        time.sleep(0.02)


def sshfs_daemons(point: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"sshfs" and os.fsencode(point) in argv:
            found.append(int(entry))
    return found


def cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return ""


def listable(point: str) -> bool:
    """Whether the mount answers, asked from a child that may hang on it."""
    try:
        done = subprocess.run(["ls", point], capture_output=True, timeout=10, check=False)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["work"])
    point = spec["point"]
    root = Path(cgroup2_root())
    scopes = work / "scopes"
    env = {**spec["env"], "FDL_TEST_CGROUP": str(root), "FDL_TEST_SCOPES": str(scopes)}
    if spec["systemd"]:
        # Over /run/systemd, this namespace only.
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run/systemd"], check=True)
        os.makedirs("/run/systemd/system")
        bin_dir = work / "bin"
        bin_dir.mkdir()
        runner = bin_dir / "systemd-run"
        runner.write_text(REFUSING_SYSTEMD_RUN if spec.get("refuse_scope") else FAKE_SYSTEMD_RUN)
        runner.chmod(0o755)
        env["PATH"] = f"{bin_dir}:{env['PATH']}"

    units: list[Path] = []
    result: dict[str, object] = {"attempts": []}

    def attempt() -> Path:
        unit = root / f"fdl-test-unit-{os.getpid()}-{len(units)}"
        unit.mkdir()
        units.append(unit)
        procs = unit / "cgroup.procs"

        def join_unit() -> None:
            procs.write_text(str(os.getpid()))

        done = subprocess.run(
            [sys.executable, "-m", "prepare", *spec["args"]],
            env=env, cwd=str(REPO), preexec_fn=join_unit,
            capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        result["attempts"].append(  # type: ignore[attr-defined]
            {"code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
        )
        return unit

    try:
        unit = attempt()
        daemons = sshfs_daemons(point)
        result["daemons"] = [cgroup_of(pid) for pid in daemons]
        result["unit"] = "/" + str(unit.relative_to(root))
        result["left_in_unit"] = len(pids_of(unit))
        kill_cgroup(unit)
        result["alive_after_restart"] = bool(sshfs_daemons(point)) and listable(point)
        attempt()
        result["alive_at_the_end"] = listable(point)
        result["scope_args"] = (
            Path(f"{scopes}.args").read_text().splitlines() if Path(f"{scopes}.args").exists() else []
        )
    finally:
        subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True, check=False)
        made = scopes.read_text().split() if scopes.exists() else []
        for cgroup in [*units, *(Path(s) for s in made)]:
            if cgroup.exists():
                kill_cgroup(cgroup)
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
