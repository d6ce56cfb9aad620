"""Staleness of a streamed trace: how far the file's last event trails the clock, sampled every
7 ms while a `pdo run --requests 3000` logs events (what a SIGKILL can lose). CLOCK_MONOTONIC is
shared by the processes. Usage: PYTHONPATH=. .venv/bin/python scripts/trace_lag.py [pdo run flags]"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

path = os.path.join(tempfile.mkdtemp(prefix="pdo-lag-"), "lag.jsonl")
if os.path.exists(path):
    os.remove(path)
p = subprocess.Popen(
    [
        sys.executable,
        "-m",
        "engine.cli",
        "run",
        "--trace",
        path,
        "--no-verify",
        "--requests",
        "3000",
    ]
    + sys.argv[1:],
    env={**os.environ, "PYTHONPATH": "."},
    stdout=subprocess.DEVNULL,
)
lags = []
while p.poll() is None:
    time.sleep(0.007)
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            n = f.tell()
            f.seek(max(0, n - 4096))
            tail = f.read().split(b"\n")
    except FileNotFoundError:
        continue
    now = time.monotonic_ns()
    for line in reversed(tail[:-1]):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if "t_ns" in e and e.get("ev") != "trace_end":
            lags.append((now - e["t_ns"]) / 1e6)
        break
lags = [x for x in lags if x < 5000]
lags.sort()
print(
    f"samples {len(lags)}: median {statistics.median(lags):.1f} ms, p90 {lags[int(0.9 * len(lags))]:.1f} ms, p99 {lags[int(0.99 * len(lags))]:.1f} ms, max {lags[-1]:.1f} ms",
    sys.argv[1:],
)
