"""The historical bug benchmark (issue 28 part 5): each row is a real bug SGLang shipped, run through
the general decode lifecycle x fault matrix on the last buggy and the first fixed release.

    PYTHONPATH=$PWD .venv/bin/python scripts/sglang_bugs.py [ROW ...]

Per release it runs `pdo conform sglang --sglang-version V --scenario decode-life/ --json` once and
prints: bug, PR, buggy -> fixed, flagged before? (the cells whose trace broke a rule or an oracle, or
where SGLang raised), clean after? (every cell meets its expectation and none broke anything beyond
the open divergences), and what caught it. Exit 0 when every row is flagged before and clean after,
1 otherwise (a miss), 2 on bad input.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    pr: str
    buggy: str
    fixed: str
    what: str


ROWS = (
    Row("S1", "#28022", "0.5.13.post1", "0.5.14", "aborted / Failed request dropped uncleared"),
    Row("S2", "#29834", "0.5.15.post1", "0.5.16", "aborted request left in pending_reqs"),
    Row("C1", "#37483", "0.5.19", "0.5.20", "handshake poll skipped, failure only in state"),
)
SCENARIOS = "decode-life/"


def run_release(version: str) -> tuple[int, list[dict]]:
    """The exit code and the per-scenario results of the matrix on one release."""
    cmd = [sys.executable, "-m", "engine.cli", "conform", "sglang", "--sglang-version", version]
    cmd += ["--scenario", SCENARIOS, "--json"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    start = done.stdout.find("[")
    if start < 0:
        raise RuntimeError(f"{version}: no results (exit {done.returncode}): {done.stderr[-400:]}")
    return done.returncode, json.loads(done.stdout[start:])


def flagged(results: list[dict]) -> dict[str, list[str]]:
    """Scenario -> what its run broke (rules, oracles, SGLang raising), open divergences left out."""
    out = {}
    for r in results:
        if r["outcome"] in ("conforms", "open-divergence"):
            continue
        caught = sorted(r["rules"])
        if r["error"]:
            caught.append("raised " + r["error"].split(":")[0])
        out[r["scenario"]] = caught
    return out


def main(argv: list[str]) -> int:
    rows = [r for r in ROWS if not argv or r.name in argv]
    if argv and len(rows) != len(argv):
        print(
            f"sglang_bugs: unknown row in {argv} (rows: {[r.name for r in ROWS]})", file=sys.stderr
        )
        return 2
    runs = {v: run_release(v) for v in sorted({v for r in rows for v in (r.buggy, r.fixed)})}
    print("| bug | PR | buggy -> fixed | flagged before? | clean after? | caught by |")
    print("|---|---|---|---|---|---|")
    ok = True
    for row in rows:
        before, after = flagged(runs[row.buggy][1]), flagged(runs[row.fixed][1])
        caught = sorted({c for cs in before.values() for c in cs})
        clean = not after and runs[row.fixed][0] == 0
        cells = f"yes, {len(before)} cells" if before else "no"
        print(
            f"| {row.name}: {row.what} | {row.pr} | {row.buggy} -> {row.fixed} | {cells} | "
            f"{'yes' if clean else 'no: ' + ', '.join(sorted(after))} | {', '.join(caught) or '-'} |"
        )
        ok &= bool(before) and clean
    for version, (code, results) in runs.items():
        print(f"pdo conform sglang --sglang-version {version} --scenario {SCENARIOS}: exit {code}")
        for name, caught in sorted(flagged(results).items()):
            print(f"  {name}: {', '.join(caught)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
