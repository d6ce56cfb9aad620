"""Run one benchmark command on several commits side by side, on this machine, interleaved.

    PYTHONPATH=. .venv/bin/python scripts/bench_commits.py --rounds 3 2de26c8 80896c6 HEAD -- \\
        python -m engine.cli bench checker --quick --reps 2 --no-memory

Each commit is checked out into a temporary worktree (`git worktree add --detach`, removed at the
end); the command runs there with that tree first on PYTHONPATH and `python` meaning this
interpreter, so every commit runs with the same packages. The rounds go commit after commit (A B C,
A B C, ...), so that a load that comes and goes on the machine falls on all of them alike. The
figure is the first match of --metric (default: the events/s that `pdo bench checker` prints first)
in the command's output; printed per commit: every round's figure, the median and the spread, and
each commit's median relative to the first commit's, and the ratio to the first commit round by
round (a load that comes and goes moves both runs of a round alike, so the paired ratio drifts
less than the ratio of medians). Several --metric give several figures per run:

    ... --metric '([\\d,]+) events/s \\(' --metric 'alone ([\\d,]+) events/s' -- python -m engine.cli \
        bench checker --trace big.jsonl --reps 2 --no-memory   # whole check, and parsing alone
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", ROOT, *args], check=True, capture_output=True, text=True
    ).stdout.strip()


@contextlib.contextmanager
def worktrees(commits: list[str]):
    """{commit: a temporary worktree of it} (`git worktree add --detach`), removed on the way out."""
    base = tempfile.mkdtemp(prefix="pdo-commits-")
    trees: dict = {}
    try:
        for c in commits:
            trees[c] = os.path.join(base, _git("rev-parse", "--short", c))
            if not os.path.exists(trees[c]):
                _git("worktree", "add", "--detach", trees[c], c)
        yield trees
    finally:
        for t in set(trees.values()):
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", t])
        if os.path.isdir(base) and not os.listdir(base):
            os.rmdir(base)


def _run(tree: str, command: list[str], metrics: list) -> list[float]:
    """The command's figures (one per metric) in the worktree `tree`."""
    command = [sys.executable if c == "python" else c for c in command]
    env = {**os.environ, "PYTHONPATH": tree}
    p = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    out = p.stdout + p.stderr
    found = [m.search(out) for m in metrics]
    if p.returncode != 0 or None in found:
        tail = " | ".join(out.strip().splitlines()[-3:])
        raise SystemExit(f"{tree}: {shlex.join(command)} exited {p.returncode}, no figure: {tail}")
    return [float(m.group(1).replace(",", "")) for m in found]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("commits", nargs="+", help="commits to compare (the first is the reference)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per commit, interleaved")
    ap.add_argument(
        "--metric",
        action="append",
        help="regex whose first group is a figure (its first match in the output); repeatable; "
        "default: the first events/s (pdo bench checker: the whole check)",
    )
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    command = argv[cut + 1 :]  # the benchmark command, after --
    if not command or a.rounds < 1:
        ap.error("give --rounds >= 1 and a command after --")
    metrics = [re.compile(m) for m in (a.metric or [r"([\d,]+(?:\.\d+)?) events/s"])]
    shas = [_git("rev-parse", "--short", c) for c in a.commits]
    figures: dict = {c: [] for c in a.commits}
    with worktrees(a.commits) as trees:
        for r in range(a.rounds):
            for c in a.commits:
                figures[c].append(_run(trees[c], command, metrics))
                got = ", ".join(_fmt(x) for x in figures[c][-1])
                print(f"round {r + 1}/{a.rounds} {c}: {got}", flush=True)
    print(f"\n{shlex.join(command)}; {a.rounds} interleaved rounds on {os.uname().nodename}")
    for k, metric in enumerate(metrics):
        print(f"  {metric.pattern}:")
        ref = statistics.median(f[k] for f in figures[a.commits[0]])
        first = [x[k] for x in figures[a.commits[0]]]
        for c, sha in zip(a.commits, shas):
            f = [x[k] for x in figures[c]]
            med = statistics.median(f)
            print(
                f"  {c:>12s} ({sha}): median {_fmt(med)}  [{_fmt(min(f))} .. {_fmt(max(f))}]  "
                f"{f'x{med / ref:.2f}' if ref else ''}  rounds: {', '.join(_fmt(x) for x in f)}"
            )
            if c != a.commits[0] and all(first):
                paired = [x / y for x, y in zip(f, first, strict=True)]
                print(
                    f"  {'':>12s} paired with {a.commits[0]}, round by round: median "
                    f"x{statistics.median(paired):.2f}  [x{min(paired):.2f} .. x{max(paired):.2f}]"
                )
    return 0


def _fmt(x: float) -> str:
    """A figure as it reads: thousands grouped, a small one (a percentage, a ratio) to 3 digits."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


if __name__ == "__main__":
    sys.exit(main())
