"""Whether two commits' `pdo check` answer alike, byte for byte, on the same damaged traces.

    PYTHONPATH=. .venv/bin/python scripts/compare_verdicts.py 802fcb6 HEAD --cases 3000 \\
        --trace big.jsonl   # more seed traces (one of several chunks finds line numbers deep in)

For a change meant to make the checker faster and nothing else. The cases are made once, by this
tree: the seed traces (the canonical traces of the four prefill modes, tests/trace_fixtures.py, and
every --trace) as they are, then --cases mutants of them (checker/fuzz/trace_mutate.py, each drawn
from --seed and its number). Each commit checks every case in a worktree of its own, in one
process; its exit code, stdout and stderr (the cases' folder named D) are compared with the first
commit's. Exits 1 if any differs, listing the first few."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_commits import worktrees

ROOT = Path(__file__).resolve().parent.parent
_MODES = ("normal", "overlap", "thread", "ahead")  # the canonical traces among the seeds
# Run in each commit's tree: `pdo check` of every case, its answers as JSON on stdout.
_CHILD = r"""
import contextlib, io, json, os, sys
from engine.cli import main
folder, answers = sys.argv[1], []
for name in sorted(os.listdir(folder), key=lambda n: int(n.split(".")[0])):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["check", os.path.join(folder, name)])
    answers.append([rc, out.getvalue().replace(folder, "D"), err.getvalue().replace(folder, "D")])
print(json.dumps(answers))
"""


def make_cases(folder: Path, traces: list[str], cases: int, seed: int) -> list[str]:
    """The seed traces, then `cases` mutants of them, as numbered files; what each one is."""
    sys.path.insert(0, str(ROOT))
    from checker.fuzz.trace_mutate import mutate
    from tests.trace_fixtures import canonical, write

    tmp = Path(tempfile.mkdtemp(dir=folder.parent))
    seeds = [Path(write(tmp / f"{m}.jsonl", m, canonical(m))).read_bytes() for m in _MODES]
    seeds += [Path(t).read_bytes() for t in traces]
    what = [f"seed {m}" for m in _MODES] + [f"seed {t}" for t in traces]
    made = list(seeds)
    for k in range(cases):
        rng = random.Random(f"{seed}:{k}")
        base = rng.randrange(len(seeds))
        data, names = mutate(seeds[base], rng)
        made.append(data)
        what.append(f"case {k}: seed {base}, {'+'.join(names)}")
    for n, data in enumerate(made):
        (folder / f"{n}.jsonl").write_bytes(data)
    return what


def answers(tree: str, folder: Path) -> list:
    """Every case's [exit code, stdout, stderr] as the commit in `tree` answers."""
    env = {**os.environ, "PYTHONPATH": tree}
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder)], cwd=tree, env=env, capture_output=True
    )
    if p.returncode != 0:
        raise SystemExit(f"{tree}: the checks did not run: {p.stderr.decode()[-500:]}")
    return json.loads(p.stdout)


def differences(first: list, other: list, what: list[str]) -> list[str]:
    """One line for each case answered otherwise, in case order."""
    return [
        f"{w}: exit {a[0]} -> {b[0]}" + ("" if a[1:] == b[1:] else "; output differs")
        for w, a, b in zip(what, first, other, strict=True)
        if a != b
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("commits", nargs=2, help="the reference commit, then the one compared")
    ap.add_argument("--cases", type=int, default=1000, help="mutants of the seed traces")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trace", action="append", default=[], help="another seed trace")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, worktrees(a.commits) as trees:
        folder = Path(d) / "cases"
        folder.mkdir()
        what = make_cases(folder, a.trace, a.cases, a.seed)
        ref, other = (answers(trees[c], folder) for c in a.commits)
    diff = differences(ref, other, what)
    codes = {rc: sum(x[0] == rc for x in ref) for rc in sorted({x[0] for x in ref})}
    print(
        f"{len(what)} traces ({len(what) - a.cases} seeds, {a.cases} mutants), exit codes at "
        f"{a.commits[0]}: {codes}; answered otherwise at {a.commits[1]}: {len(diff)}"
    )
    for line in diff[:20]:
        print(f"  {line}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
