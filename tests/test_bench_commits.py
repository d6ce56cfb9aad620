"""scripts/bench_commits.py runs a command in a worktree per commit, interleaved, and prints each
commit's figures, and its ratio to the first commit round by round; the worktrees are gone
afterwards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worktrees() -> set:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True
    ).stdout
    return set(out.splitlines())


def test_two_commits_side_by_side():
    before = _worktrees()
    # each tree prints its own path's length: the figure differs only if the trees differ
    probe = "import os; print(f'{len(os.getcwd())} events/s, tree {os.getcwd()}')"
    out = subprocess.run(
        [sys.executable, "scripts/bench_commits.py", "--rounds", "2", "HEAD~1", "HEAD", "--"]
        + ["python", "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [x.split(":")[0] for x in lines[:4]] == [
        "round 1/2 HEAD~1",
        "round 1/2 HEAD",
        "round 2/2 HEAD~1",
        "round 2/2 HEAD",
    ]
    assert sum("median" in x and "x1.00" in x for x in lines) >= 1
    # the worktrees' paths have one length, so each round's ratio is 1
    assert any(
        "paired with HEAD~1, round by round: median x1.00  [x1.00 .. x1.00]" in x for x in lines
    )
    assert not _worktrees() - before  # none left behind
