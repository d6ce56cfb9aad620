"""What a SIGKILL loses of a trace: `pdo run` killed at random moments, and a prefill rank of
`pdo launch` killed after a random number of KV sends (`--kill prefill0@N`). For each kill: the
events its binary log holds (read back as `pdo check` reads it), the records found torn (cut
mid-write) and the slots taken but never written (a log call the kill interrupted: not logged),
the events dropped after a digest the run never computed, and the verdict of `pdo check`, which
must be INCOMPLETE or FAIL, never a pass. Exit 1 if any check passed or any log did not read.

    PYTHONPATH=. .venv/bin/python scripts/kill_loss.py --kills 100 --launch-kills 20
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from engine.cli import main as pdo
from spec import tracelog

PDO = [sys.executable, "-m", "engine.cli"]


def _read(trace: str) -> dict:
    """The log's counts, and `pdo check`'s exit status and truncation on the trace."""
    with open(trace + tracelog.SUFFIX, "rb") as f:
        r = tracelog.read_log(f.read())
    events = r.finish(final=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = pdo(["check", "--json", trace])
    report = json.loads(out.getvalue())[0]
    d = r.damage
    return {
        "events": len(events),
        "torn": d.torn,
        "holes": d.holes,
        "digest_dropped": d.unresolved,
        "ended": r.end is not None,
        "check": rc,
        "truncated": report.get("truncated"),
    }


def kill_run(i: int, out: str, rng: random.Random, rate: float, requests: int) -> dict:
    trace = os.path.join(out, f"run{i}.jsonl")
    cmd = PDO + ["run", "--trace", trace, "--no-verify", "--arrival", "poisson"]
    cmd += ["--rate", str(rate), "--requests", str(requests), "--workload-seed", str(i)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = trace + tracelog.SUFFIX
    while not os.path.exists(log) and p.poll() is None:  # the run has started its trace
        time.sleep(0.01)
    delay = rng.uniform(0.0, requests / rate)
    time.sleep(delay)
    p.send_signal(signal.SIGKILL)
    p.wait()
    if p.returncode != -signal.SIGKILL:
        return {"kind": "run", "i": i, "skipped": f"ended before the kill ({p.returncode})"}
    if not os.path.exists(log):  # killed after its trace closed (the log made into the lines)
        return {"kind": "run", "i": i, "skipped": "killed after the trace closed"}
    return {"kind": "run", "i": i, "after_s": round(delay, 3), **_read(trace)}


def kill_launch(i: int, out: str, rng: random.Random, requests: int) -> dict:
    d = os.path.join(out, f"launch{i}")
    n = rng.randint(0, requests // 2)  # a rank sends about one chunk per request it serves
    cmd = PDO + ["launch", "--dp", "2", "--requests", str(requests), "--workload-seed", str(i)]
    cmd += ["--kill", f"prefill0@{n}", "--trace-dir", d, "--no-verify", "--timeout-s", "120"]
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    trace = os.path.join(d, "prefill0.jsonl")
    if not os.path.exists(trace + tracelog.SUFFIX):
        return {"kind": "launch", "i": i, "skipped": f"no log of prefill0 (exit {p.returncode})"}
    return {"kind": "launch", "i": i, "after_sends": n, **_read(trace)}


def summary(rows: list[dict], kind: str) -> str:
    done = [r for r in rows if r["kind"] == kind and "skipped" not in r]
    if not done:
        return f"{kind}: no kill landed"
    ev = [r["events"] for r in done]
    checks: dict = {}
    for r in done:
        checks[r["check"]] = checks.get(r["check"], 0) + 1
    return (
        f"{kind}: {len(done)} kills ({sum(r['kind'] == kind for r in rows) - len(done)} skipped): "
        f"events recovered median {statistics.median(ev):.0f} (min {min(ev)}, max {max(ev)}); "
        f"torn records {sum(r['torn'] for r in done)}, slots never written "
        f"{sum(r['holes'] for r in done)}, events dropped after a digest never computed "
        f"{sum(r['digest_dropped'] for r in done)} (in {sum(r['digest_dropped'] > 0 for r in done)}"
        f" kills); ended {sum(r['ended'] for r in done)}; pdo check exit codes {checks}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=100, help="kills of pdo run")
    ap.add_argument("--launch-kills", type=int, default=20, help="kills of a pdo launch rank")
    ap.add_argument("--rate", type=float, default=200.0, help="pdo run: requests per second")
    ap.add_argument("--requests", type=int, default=400, help="pdo run: requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="keep the traces here (default: a temp folder)")
    ap.add_argument("--json-out", default=None, help="write every kill's row here")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="pdo-kill-")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(a.seed)
    rows = []
    for i in range(a.kills):
        rows.append(kill_run(i, out, rng, a.rate, a.requests))
        print(json.dumps(rows[-1]), flush=True)
    for i in range(a.launch_kills):
        rows.append(kill_launch(i, out, rng, 24))
        print(json.dumps(rows[-1]), flush=True)
    print(summary(rows, "run"))
    print(summary(rows, "launch"))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if "skipped" not in r and r["check"] == 0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
