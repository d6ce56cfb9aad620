"""Where the tracing overhead goes: the engine untraced, traced in memory (the trace written after
the run), and traced with the trace streamed (the flight recorder's log in a file), in rotating
order within each round (drift of a shared machine hits all arms alike); the geometric mean of each
traced arm's ratio to the untraced run of its round, with a 95% interval (docs/benchmarks.md).

    PYTHONPATH=. .venv/bin/python scripts/trace_arms.py --rounds 150 [--arms off,mem,stream]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile

from engine.runs.prefill_run import run_prefill
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from engine.trace.tracer import NullTracer, Tracer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--arms", default="off,mem,stream")
    ap.add_argument("--mode", default="ahead")
    ap.add_argument("--requests", type=int, default=200)
    a = ap.parse_args()
    arms = a.arms.split(",")
    cfg = EngineConfig(mode=a.mode, launch_cost_us=0.0)
    wc = WorkloadConfig(requests=a.requests)
    run_prefill(RunSpec(cfg, WorkloadConfig(requests=20), verify=False))  # warm-up
    path = os.path.join(tempfile.mkdtemp(prefix="pdo-arms-"), "t.jsonl")

    def run(arm: str) -> float:
        tracer = NullTracer() if arm == "off" else Tracer()
        where = path if arm == "stream" else None
        return run_prefill(RunSpec(cfg, wc, trace_path=where, verify=False), tracer=tracer).summary[
            "wall_s"
        ]

    logs: dict = {arm: [] for arm in arms if arm != "off"}
    for r in range(a.rounds):
        k = r % len(arms)
        wall = {arm: run(arm) for arm in arms[k:] + arms[:k]}
        for arm, xs in logs.items():
            xs.append(math.log(wall[arm] / wall["off"]))
    for arm, xs in logs.items():
        mu, se = statistics.mean(xs), statistics.stdev(xs) / math.sqrt(len(xs))
        lo, hi = math.exp(mu - 1.96 * se), math.exp(mu + 1.96 * se)
        print(
            f"{arm}/off: geometric mean {math.exp(mu):.4f} [{lo:.4f}, {hi:.4f}], {len(xs)} rounds"
        )


if __name__ == "__main__":
    main()
