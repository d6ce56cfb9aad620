"""Where the tracing overhead goes: the engine untraced, and traced in several ways, in rotating
order within each round (drift of a shared machine hits all arms alike); the geometric mean of each
traced arm's ratio to the untraced run of its round (or to the `--base` arm), with a 95% interval
(docs/benchmarks.md).

    PYTHONPATH=. .venv/bin/python scripts/trace_arms.py --rounds 150 [--arms off,mem,stream]
        [--gil-free-device MS]   # at a GPU's pace: the forward a GIL-free wait (engine/bench/what_if.py)

The arms (ARMS): `mem`, the trace kept in memory and written after the run; `stream`, the flight
recorder's log in a file, as `pdo run --trace`; `nohb`, the same without the happens-before
hand-offs; `edges`, the hand-offs alone (every event a schedule point that logs nothing); `floor`,
the least a log call can do (a slot from a counter, the clock, one `struct.pack_into` of four words
into a fixed ring), per event, without the hand-offs: what one record per event costs at best;
`floor-hb`, the floor with one such record per hand-off too.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import mmap
import os
import statistics
import struct
import tempfile
import time
import weakref

from engine.bench.what_if import gil_free_device, print_what_if
from engine.runs.prefill_run import run_prefill
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from engine.sync import hb
from engine.trace.tracer import NullTracer, Tracer


class _EdgesOnly(Tracer):
    """The hand-offs logged, the events not (each still a schedule point)."""

    def _logger(self, ev, names):
        return NullTracer._logger(self, ev, names)


class _Floor(NullTracer):
    """One record per event, as little as a log call can do in Python: no conversion of its values,
    no thread, no hand-offs."""

    _ring = memoryview(mmap.mmap(-1, 4096 * 96))

    def __init__(self):
        super().__init__()
        self._slots = itertools.count().__next__  # one for all the events, as the recorder's

    def _logger(self, ev, names):
        nxt, now, ring, pack = self._slots, time.monotonic_ns, self._ring, _FOUR

        def log(*values):
            i = nxt()
            pack(ring, (i & 4095) * 96, 16, now(), len(values), i)

        return log


class _FloorHandOffs(_Floor):
    """The floor, and one such record per hand-off the hooks log too (engine/sync/hb.py)."""

    def __init__(self):
        super().__init__()
        nxt, ring, pack = self._slots, self._ring, _FOUR

        def edge(obj):
            if obj is not None:
                i = nxt()
                pack(ring, (i & 4095) * 96, 3, id(obj), 1, i)

        def edges(a, b):
            edge(a)
            edge(b)

        self._edges = hb.HandOffs(edge, edge, edges, edges)
        hb.attach(self._edges)
        weakref.finalize(self, hb.detach, self._edges)


_FOUR = struct.Struct("<qqqq").pack_into
# arm -> (its tracer, whether its trace goes to a file)
ARMS = {
    "off": (NullTracer, False),
    "mem": (Tracer, False),
    "stream": (Tracer, True),
    "nohb": (lambda: Tracer(clocks=False), True),
    "edges": (lambda: _EdgesOnly(clocks=True), True),
    "floor": (_Floor, False),
    "floor-hb": (_FloorHandOffs, False),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--arms", default="off,mem,stream")
    ap.add_argument("--mode", default="ahead")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--base", default="off", help="the arm the others are measured against")
    ap.add_argument(
        "--gil-free-device", type=float, metavar="MS", help="the forward a GIL-free wait (what-if)"
    )
    a = ap.parse_args()
    arms = a.arms.split(",")
    if a.base not in arms or not set(arms) <= set(ARMS):
        ap.error(f"--arms: --base ({a.base}) and any of {', '.join(ARMS)}")
    cfg = EngineConfig(mode=a.mode, launch_cost_us=0.0)
    wc = WorkloadConfig(requests=a.requests)
    run_prefill(RunSpec(cfg, WorkloadConfig(requests=20), verify=False))  # warm-up
    path = os.path.join(tempfile.mkdtemp(prefix="pdo-arms-"), "t.jsonl")

    def run(arm: str) -> float:
        make, to_file = ARMS[arm]
        tracer, where = make(), path if to_file else None
        return run_prefill(RunSpec(cfg, wc, trace_path=where, verify=False), tracer=tracer).summary[
            "wall_s"
        ]

    logs: dict = {arm: [] for arm in arms if arm != a.base}
    what_if = (
        gil_free_device(a.gil_free_device, cfg.max_batch_tokens) if a.gil_free_device else None
    )
    with what_if or contextlib.nullcontext():
        _rounds(a, arms, run, logs)
    print_what_if(a.gil_free_device)
    for arm, xs in logs.items():
        mu, se = statistics.mean(xs), statistics.stdev(xs) / math.sqrt(len(xs))
        lo, hi = math.exp(mu - 1.96 * se), math.exp(mu + 1.96 * se)
        print(
            f"{arm}/{a.base}: geometric mean {math.exp(mu):.4f} [{lo:.4f}, {hi:.4f}], {len(xs)} rounds"
        )


def _rounds(a, arms: list[str], run, logs: dict) -> None:
    """The arms in rotating order, round after round: each traced arm's log ratio to the base."""
    for r in range(a.rounds):
        k = r % len(arms)
        wall = {arm: run(arm) for arm in arms[k:] + arms[:k]}
        for arm, xs in logs.items():
            xs.append(math.log(wall[arm] / wall[a.base]))


if __name__ == "__main__":
    main()
