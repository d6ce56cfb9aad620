"""The historical bug benchmark (issue 28 part 5): each row is a real bug SGLang shipped, run through
the general scenarios (the decode lifecycle x fault matrix, the prefill scenarios and the prefill
lifecycle cells) on the last buggy and the first fixed release.

    PYTHONPATH=$PWD .venv/bin/python scripts/sglang_bugs.py [ROW ...]

Per release it runs `pdo conform sglang --sglang-version V --scenario decode-life/ --scenario
prefill- --json` once and
prints: bug, PR, buggy -> fixed, flagged before? (the row's cells whose trace broke a rule or an
oracle, or where SGLang raised, beyond what another bug of that release explains), clean after? (on
the fixed release none of them does, and the command exits 0), and what caught it. The row's cells
are those its FINDINGS entries name (driver.py). Exit 0 when every row is flagged before and clean after,
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
sys.path.insert(0, str(REPO))

from engine.sglang.conform import driver  # noqa: E402  (needs no SGLang)


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
    Row("S5", "#31368", "0.5.15.post1", "0.5.16", "early cached-prefix send with no wait event"),
)
SCENARIOS = ("decode-life/", "prefill-")


def run_release(version: str) -> tuple[int, list[dict]]:
    """The exit code and the per-scenario results of the matrix on one release."""
    cmd = [sys.executable, "-m", "engine.cli", "conform", "sglang", "--sglang-version", version]
    cmd += [arg for prefix in SCENARIOS for arg in ("--scenario", prefix)] + ["--json"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    start = done.stdout.find("[")
    if start < 0:
        raise RuntimeError(f"{version}: no results (exit {done.returncode}): {done.stderr[-400:]}")
    return done.returncode, json.loads(done.stdout[start:])


def own(row: Row, finding) -> bool:
    return finding.bug.split()[0] == row.name


def cells(row: Row) -> tuple[str, ...]:
    """The cells the row's bug shows in (driver.FINDINGS, where it is recorded per release)."""
    return tuple(c for f in driver.FINDINGS if own(row, f) for c in f.scenarios)


def flagged(row: Row, version: str, results: list[dict]) -> dict[str, list[str]]:
    """Cell of the row -> what its run broke on `version` (rules, oracles, SGLang raising), less what
    another bug recorded for that release explains (two bugs may show in one cell)."""
    out = {}
    for r in results:
        name = r["scenario"]
        if not any(name.startswith(c) for c in cells(row)):
            continue
        others = [f for f in driver.findings(name, version) if not own(row, f)]
        caught = sorted(set(r["rules"]) - {rule for f in others for rule in f.broken})
        if r["error"] and not any(f.error and f.error in r["error"] for f in others):
            caught.append("raised " + r["error"].split(":")[0])
        if caught:
            out[name] = caught
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
        before = flagged(row, row.buggy, runs[row.buggy][1])
        after = flagged(row, row.fixed, runs[row.fixed][1])
        caught = sorted({c for cs in before.values() for c in cs})
        clean = not after and runs[row.fixed][0] == 0
        cells = f"yes, {len(before)} cells" if before else "no"
        print(
            f"| {row.name}: {row.what} | {row.pr} | {row.buggy} -> {row.fixed} | {cells} | "
            f"{'yes' if clean else 'no: ' + ', '.join(sorted(after))} | {', '.join(caught) or '-'} |"
        )
        ok &= bool(before) and clean
    for version, (code, _) in runs.items():
        scenarios = " ".join(f"--scenario {p}" for p in SCENARIOS)
        print(f"pdo conform sglang --sglang-version {version} {scenarios}: exit {code}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
