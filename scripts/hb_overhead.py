"""Wall time of the engine with tracing off, tracing on, and tracing on with the happens-before
clocks (`pdo run --hb`), in interleaved rounds (the arms rotate who goes first, so drift of a shared
machine hits all alike); prints the medians and the median per-round ratios.

    PYTHONPATH=. .venv/bin/python scripts/hb_overhead.py --rounds 20 --mode ahead --requests 120
    PYTHONPATH=. .venv/bin/python scripts/hb_overhead.py --emit --rounds 6   # one declared event
"""

from __future__ import annotations

import argparse
import statistics

from engine.bench.trace_overhead import emit_cost_ns
from engine.runs.prefill_run import run_prefill
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from engine.sync import hb
from engine.trace.tracer import NullTracer, Tracer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--mode", default="ahead")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--emit", action="store_true", help="the cost of one declared event instead")
    a = ap.parse_args()
    if a.emit:
        ns: dict = {False: [], True: []}
        for r in range(a.rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):
                hb.enable(on)
                ns[on].append(emit_cost_ns(50_000)["declared_ns"])
        hb.enable(False)
        for on in (False, True):
            print(f"{'with' if on else 'without'} clocks: {statistics.median(ns[on]):.0f} ns/event")
        return
    cfg = EngineConfig(mode=a.mode)
    wc = WorkloadConfig(requests=a.requests, seed=0)
    arms = ("off", "trace", "trace+hb")
    wall: dict = {k: [] for k in arms}
    ratio_hb, ratio_all = [], []
    for r in range(a.rounds + 1):  # round 0 warms up
        row = {}
        for k in arms[r % 3 :] + arms[: r % 3]:
            tr = NullTracer() if k == "off" else Tracer(clocks=k == "trace+hb")
            row[k] = run_prefill(RunSpec(cfg, wc, verify=False), tracer=tr).summary["wall_s"]
        if r == 0:
            continue
        for k in arms:
            wall[k].append(row[k])
        ratio_hb.append(row["trace+hb"] / row["trace"])
        ratio_all.append(row["trace+hb"] / row["off"])
    for k in arms:
        print(f"{k:9s} median wall {statistics.median(wall[k]) * 1e3:8.1f} ms")
    print(
        f"trace+hb / trace: median ratio {statistics.median(ratio_hb):.4f} over {a.rounds} rounds"
    )
    print(f"trace+hb / off:   median ratio {statistics.median(ratio_all):.4f}")


if __name__ == "__main__":
    main()
