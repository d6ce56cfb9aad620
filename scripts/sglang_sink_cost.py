"""Cost per event of the SGLang adapter's trace sink on the scheduler thread (engine/sglang/sink.py):
the events its prefill hooks log for one request and one batch (alloc, admit with rids and chunks,
fwd_begin with a digest, stage, fwd_end, kv_send, release), logged through `TraceSink.emit` as the
hooks do, into a sink that has begun (its file open), in a tight loop on CPU. Run it from the tree
to measure (the sink is the one PYTHONPATH imports); prints ns per event, median of the rounds.

    PYTHONPATH=. .venv/bin/python scripts/sglang_sink_cost.py [--rounds 7] [--batches 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from engine.sglang import sink as trace_sink


class _Req:
    def __init__(self, rid: str):
        self.rid = rid


def one_round(batches: int) -> float:
    trace_sink.COMPLETIONS_OBSERVED[0] = True
    path = os.path.join(tempfile.mkdtemp(prefix="pdo-sink-cost-"), "t.jsonl")
    sink = trace_sink.TraceSink(path)
    sink.begin("prefill", "normal", 16)
    emit, obj = sink.emit, sink.obj
    n = 0
    t0 = time.perf_counter_ns()
    for b in range(batches):
        req = _Req(f"r{b}")
        rid = req.rid
        emit("alloc", rid=rid, obj=obj(req), slot=b % 64)
        emit("admit", batch=b, rids=[rid], chunks={rid: [0, 128]})
        emit("fwd_begin", batch=b, digest="0123456789abcdef")
        emit("stage", batch=b)
        emit("fwd_end", batch=b)
        emit("kv_send", rid=rid, obj=obj(req), tokens=128, pages=8)
        emit("release", rid=rid, obj=obj(req), slot=b % 64)
        n += 7
    elapsed = time.perf_counter_ns() - t0
    sink.close()
    return elapsed / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=2000)
    a = ap.parse_args()
    one_round(200)  # warm-up
    ns = [one_round(a.batches) for _ in range(a.rounds)]
    print(
        f"{trace_sink.__file__}: {statistics.median(ns):.0f} ns per event (median of {a.rounds} "
        f"rounds of {7 * a.batches} events; min {min(ns):.0f}, max {max(ns):.0f})"
    )


if __name__ == "__main__":
    main()
