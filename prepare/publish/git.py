"""A publish of a git checkout: its committed HEAD is what is published (by
revision: uncommitted changes are not), HEAD must not move while it is
built, and `--commit` / `--push` put the two run files (floDl's digest
sidecar and manifest) alone on top of the commit that was built. Every git call goes through the subprocess seam
with a deadline; the commands a person must run are printed quoted."""

from __future__ import annotations

import os
import shlex

from prepare.build.manifest import DIGEST_FILE, FILENAME
from prepare.fail import Fail
from prepare.host import human, proc
from prepare.notes import warning

GIT_TIMEOUT_S = 120.0
# What a publish adds to the commit that was built: floDl's run files.
RUN_FILES = (DIGEST_FILE, FILENAME)


PUSH_TIMEOUT_S = 600.0


def _git(root: str, *args: str, timeout: float = GIT_TIMEOUT_S) -> proc.Completed:
    try:
        return proc.run(["git", "-C", root, *args], timeout=timeout)
    except proc.Missing:
        raise Fail(
            "publish.git-missing", f"{root} is a git checkout but git is not installed: `sudo apt-get install git`"
        ) from None
    except proc.ExecFailed as failed:
        raise Fail("publish.git-timeout", f"git could not be started ({failed}); publish again") from None
    except proc.TimedOut:
        raise Fail(
            "publish.git-timeout", f"`git {' '.join(args)}` in {root} did not finish within {timeout:g}s"
        ) from None


def rev(root: str, notes: list[str]) -> str | None:
    """HEAD's commit when `root` is the top of a git checkout; None for a
    plain directory. Boxes fetch commits, so a checkout is published as
    the commit, without the working tree's changes."""
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    top = _git(root, "rev-parse", "--show-toplevel")
    if top.ok and os.path.realpath(top.stdout.strip()) != os.path.realpath(root):
        raise Fail(
            "publish.invalid",
            f"{root} is inside the git checkout {top.stdout.strip()}: publish its top level (the manifest goes "
            "at the root boxes fetch) and name this directory with --cwd",
        )
    head = _git(root, "rev-parse", "--verify", "HEAD^{commit}")
    if not head.ok:
        raise Fail(
            "publish.invalid", f"{root} is a git checkout with no commit to publish: commit the training source first"
        )
    rev = head.stdout.strip()
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    changed = [line[3:] for line in dirty.stdout.splitlines() if line[3:] not in RUN_FILES and line.strip()]
    if changed:
        notes.append(
            warning(
                f"{len(changed)} uncommitted change(s) in {root} ({', '.join(changed[:5])}"
                + (", ..." if len(changed) > 5 else "")
                + f") are not published: boxes fetch commits, and this publishes {rev[:12]}"
            )
        )
    return rev


def same_head(root: str, rev: str) -> None:
    head = _git(root, "rev-parse", "--verify", "HEAD^{commit}")
    if head.ok and head.stdout.strip() != rev:
        raise Fail(
            "publish.head-moved",
            f"HEAD of {root} moved from {rev[:12]} to {head.stdout.strip()[:12]} during the publish: a manifest "
            "on it would describe a tree that was not built. No manifest was written; publish again",
        )


def commit_and_push(
    root: str, rev: str | None, run_id: str, *, commit: bool, push: bool
) -> tuple[str | None, bool, str | None]:
    """Commit the run files (`commit`), and push them (`push`, which
    commits first), as asked; or say what to run. Returns the commit made,
    whether it was pushed, and what is left to run."""
    names = list(RUN_FILES)
    if rev is None:
        return None, False, None
    message = f"publish run {run_id}"
    # Quoted: the path is the operator's, and may hold what a shell reads.
    git = ["git", "-C", root]
    by_hand = " && ".join(
        shlex.join(argv)
        for argv in (
            [*git, "add", "-f", "--", *names],
            [*git, "commit", "-m", message, "--", *names],
            [*git, "push"],
        )
    )
    if not (commit or push):
        return (
            None,
            False,
            (
                f"commit {' and '.join(names)} alone on top of {rev[:12]} (the commit that was built) and push "
                f"them; boxes pick the run up on their next attempt: {by_hand}"
            ),
        )
    added = _git(root, "add", "-f", "--", *names)
    # Only the run files: the commit's tree is the built tree plus them.
    done = _git(root, "commit", "-q", "-m", message, "--", *names) if added.ok else added
    if not done.ok:
        raise Fail(
            "publish.git-failed",
            "the run files are written but `git commit` failed: "
            f"{human.printable((done.stderr or done.stdout).strip()[-500:], lines=True)}. "
            f"Commit them by hand: {by_hand}",
        )
    made = _git(root, "rev-parse", "HEAD").stdout.strip()
    if not push:
        return (
            made,
            False,
            f"push {made[:12]} ({shlex.join(git + ['push'])}); boxes pick the run up once it is pushed",
        )
    pushed = _git(root, "push", "-q", timeout=PUSH_TIMEOUT_S)
    if not pushed.ok:
        raise Fail(
            "publish.push-failed",
            f"the run files are committed ({made[:12]}) but `git push` failed: "
            f"{human.printable((pushed.stderr or pushed.stdout).strip()[-500:], lines=True)}. Push it: "
            f"{shlex.join(git + ['push'])}",
        )
    return made, True, None
