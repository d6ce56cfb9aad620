"""Where the tracing overhead goes: the engine untraced, traced in memory (the trace written after
the run), and traced with the trace streamed (the flight recorder), in rotating order within each
round (drift of a shared machine hits all arms alike); the geometric mean of each traced arm's
ratio to the untraced run of its round, with a 95% interval (docs/benchmarks.md).

    PYTHONPATH=. .venv/bin/python scripts/trace_arms.py --rounds 150 [--arms off,mem,stream]
    PYTHONPATH=. .venv/bin/python scripts/trace_arms.py --passes 20   # what streaming costs where

`--passes N`: N streamed runs; the CPU time of the writer thread's passes (engine/trace/writer.py,
the pass at close included) and of the trace sink process (Linux: /proc), as shares of wall time.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

from engine.runs.prefill_run import run_prefill
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from engine.trace import writer as trace_writer
from engine.trace.tracer import NullTracer, Tracer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--arms", default="off,mem,stream")
    ap.add_argument("--mode", default="ahead")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--passes", type=int, default=0, help="profile N streamed runs instead")
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

    if a.passes:
        profile(a.passes, lambda: run("stream"))
        return
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


def profile(n: int, run) -> None:
    spent = [0, 0]  # thread CPU ns of the passes, number of passes
    drain = trace_writer.StreamWriter.drain

    def timed(self, *, force):
        c = time.thread_time_ns()
        try:
            return drain(self, force=force)
        finally:
            spent[0] += time.thread_time_ns() - c
            spent[1] += 1

    trace_writer.StreamWriter.drain = timed
    run()  # starts the sink

    def sink_cpu() -> float:
        f = open(f"/proc/{trace_writer.sink().proc.pid}/stat").read().split()
        return (int(f[13]) + int(f[14])) / os.sysconf("SC_CLK_TCK")

    spent[:] = [0, 0]
    c0 = sink_cpu()
    wall = sum(run() for _ in range(n))
    sink = sink_cpu() - c0
    print(
        f"{n} streamed runs, wall {wall * 1e3:.0f} ms: {spent[1]} writer passes, "
        f"{spent[0] / 1e6:.1f} ms CPU ({spent[0] / 1e9 / wall:.2%} of wall); "
        f"sink {sink * 1e3:.0f} ms CPU ({sink / wall:.2%} of wall)"
    )


if __name__ == "__main__":
    main()
