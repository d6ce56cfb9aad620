"""`pdo bench trace-overhead`: the engine with tracing on (Tracer, its binary log in a file, as
`pdo run --trace`) against off (NullTracer) in interleaved pairs, the tracing work timed where it
happens inside traced runs, and the cost of one trace event in a tight loop."""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

from engine.bench.knobs import (
    add_engine_knobs,
    apply_switch_interval,
    check_knobs,
    engine_workload,
    progress_of,
)
from engine.bench.progress import Progress
from engine.bench.record import add_json_arguments, machine, now, write_json
from engine.bench.registry import BENCH, BenchCommand
from engine.bench.stats import ci95, geo_ci95, median, quantile_ratio
from engine.bench.what_if import gil_free_device, print_what_if
from engine.runs.spec import RunSpec
from engine.runtime.config import EngineConfig
from engine.sync import hb
from engine.trace.tracer import NullTracer, Tracer
from spec import domains as d
from spec.vocabulary import PREFILL_LOOPS


def emit_cost_ns(n: int = 100_000) -> dict:
    """Cost of logging one typical event (kv_send: four fields), from one thread, in ns: as the
    engine does (a declared event, Tracer.events_for) and through Tracer.emit; and of writing it to
    a file."""
    # A warm-up loop on a tracer thrown away, then the measurement: an unwarmed loop reads high.
    for tr, reps in ((Tracer(), 1000), (Tracer({"role": "prefill"}), n)):
        emit, kv_send = tr.emit, tr.events_for(kv_send=("rid", "obj", "tokens", "pages")).kv_send
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            kv_send("r1", "o1", 16, 1)
        t1 = time.perf_counter_ns()
        for _ in range(reps):
            emit("kv_send", rid="r1", obj="o1", tokens=16, pages=1)
        t2 = time.perf_counter_ns()
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t.jsonl")
        t3 = time.perf_counter_ns()
        tr.write(p)
        t4 = time.perf_counter_ns()
    return {
        "declared_ns": (t1 - t0) / n,
        "emit_ns": (t2 - t1) / n,
        "write_ns": (t4 - t3) / (2 * n),
        "events": 2 * n,
    }


class _Accounting:
    """For one traced run: the time spent inside the tracer (emit, obj, the hand-off edges) and in
    the digests computed only when tracing is on (DigestStamp: stamped, then hashed), summed over all
    threads. Installed by patching for that run only; the pairs that measure wall time use the plain
    Tracer."""

    def __init__(self):
        kinds = ("emit", "obj", "edge", "digest")
        self.ns = dict.fromkeys(kinds, 0)  # thread CPU time: the work itself
        self.elapsed = dict.fromkeys(kinds, 0)  # elapsed inside (also waits for the GIL)
        self.calls = dict.fromkeys(kinds, 0)
        self.local = threading.local()

    def wrap(self, kind, fn):
        ns, elapsed, calls, local = self.ns, self.elapsed, self.calls, self.local
        cpu, clock = time.thread_time_ns, time.perf_counter_ns

        def timed(*a, **kw):
            if getattr(local, "inside", False):  # nested (obj ids inside a digest): counted once
                return fn(*a, **kw)
            local.inside = True
            t, c = clock(), cpu()
            try:
                return fn(*a, **kw)
            finally:
                ns[kind] += cpu() - c
                elapsed[kind] += clock() - t
                calls[kind] += 1
                local.inside = False

        return timed


def _timer_self_cost() -> tuple[float, float]:
    """The timing wrapper's own cost per call in ns (thread CPU, elapsed), to subtract per call."""
    probe = _Accounting()
    noop = probe.wrap("emit", lambda: None)
    for _ in range(20000):
        noop()
    return probe.ns["emit"] / 20000, probe.elapsed["emit"] / 20000


def accounted_run(cfg, wc, clocks: bool = True) -> dict:
    """One traced run with the tracing work timed where it happens, and its share of wall time."""
    # lazy: both import torch, slow for every pdo start
    from engine.runs.prefill_run import run_prefill
    from engine.trace import digest

    self_cpu, self_elapsed = _timer_self_cost()
    acc = _Accounting()
    tr = Tracer(clocks=clocks)
    tr.emit = acc.wrap("emit", tr.emit)
    logger = tr._logger  # the engine's declared events (Tracer.events_for), each logger timed
    tr._logger = lambda ev, names: acc.wrap("emit", logger(ev, names))
    tr.obj = acc.wrap("obj", tr.obj)
    if "hb" in tr.header:  # the happens-before hand-offs (engine/sync/hb.py), timed
        hb.detach(tr.rec.hand_offs)
        tr.rec.hand_offs = hb.HandOffs(*(acc.wrap("edge", f) for f in tr.rec.hand_offs))
        hb.attach(tr.rec.hand_offs)
    stamp, resolve = digest.DigestStamp.__init__, digest.DigestStamp.resolve
    digest.DigestStamp.__init__ = acc.wrap("digest", stamp)  # a stamp taken (calling thread)
    digest.DigestStamp.resolve = acc.wrap("digest", resolve)  # and hashed (by the worker)
    try:
        s = run_prefill(RunSpec(cfg, wc, verify=False), tracer=tr).summary
    finally:
        digest.DigestStamp.__init__, digest.DigestStamp.resolve = stamp, resolve
        hb.detach(tr.rec.hand_offs)
    # The run's work only: reading the events afterwards names objects and returns resolved digests,
    # which is the write's cost (reported per event by emit_cost_ns), not the run's.
    ns, elapsed, calls = dict(acc.ns), dict(acc.elapsed), dict(acc.calls)
    for k, n in calls.items():
        ns[k] = max(0, ns[k] - int(n * self_cpu))
        elapsed[k] = max(0, elapsed[k] - int(n * self_elapsed))
    total = sum(ns.values())
    inside = sum(elapsed.values())
    events = tr.count
    return {
        "wall_s": s["wall_s"],
        "events": events,
        "ns": ns,
        "elapsed_ns": elapsed,
        "calls": calls,
        "tracing_ms": total / 1e6,
        "share_of_wall": total / 1e9 / s["wall_s"],
        "elapsed_share_of_wall": inside / 1e9 / s["wall_s"],
        "ns_per_event": total / max(1, events),
        "timer_self_ns": {"cpu": self_cpu, "elapsed": self_elapsed},
    }


def _on_off_pairs(cfg, wc, reps: int, progress: Progress, clocks: bool = True) -> list[dict]:
    """`reps` pairs of runs with tracing on and off in ABBA order (off on, on off, ...: drift of the
    machine hits both sides alike); per pair each side's wall and CPU time, and the wall ratio.
    `clocks`: the traced side logs the happens-before hand-offs (as `pdo run` does by default)."""
    from engine.runs.prefill_run import run_prefill  # lazy: imports torch, slow for every pdo start

    pairs = []
    # tracing on is what `pdo run --trace` does: the trace streamed to a file during the run
    out = tempfile.mkdtemp(prefix="pdo-trace-overhead-")
    for rep in range(reps):
        row = {}
        order = ("off", "on") if rep % 2 == 0 else ("on", "off")  # alternate who goes first
        for which in order:
            tr = Tracer(clocks=clocks) if which == "on" else NullTracer()
            path = os.path.join(out, "on.jsonl") if which == "on" else None
            c0 = time.process_time()
            s = run_prefill(RunSpec(cfg, wc, trace_path=path, verify=False), tracer=tr).summary
            row[which] = {
                "wall_s": s["wall_s"],
                "cpu_s": time.process_time() - c0,
                "events": tr.count if which == "on" else 0,
            }
        row["ratio"] = row["on"]["wall_s"] / row["off"]["wall_s"]
        pairs.append(row)
        progress.line(f"[{rep + 1}/{reps}] tracing on/off wall ratio {row['ratio']:.3f}")
    progress.done()
    return pairs


def _wall_summary(pairs: list[dict], target_pct: float) -> dict:
    """The pairs' wall-time ratio (geometric mean and t-interval, median and bootstrap interval,
    20th percentiles) and the verdict against the target."""
    ratios = [p["ratio"] for p in pairs]
    geo, geo_lo, geo_hi = geo_ci95(ratios)
    low_q, low_ci = quantile_ratio(
        [p["on"]["wall_s"] for p in pairs], [p["off"]["wall_s"] for p in pairs]
    )
    target = 1 + target_pct / 100
    verdict = "met" if geo_hi <= target else "not met" if geo_lo > target else "not resolved"
    events = median([p["on"]["events"] for p in pairs])
    d_wall = median([p["on"]["wall_s"] - p["off"]["wall_s"] for p in pairs])
    return {
        "wall_ratio_median": median(ratios),
        "wall_ratio_ci95": list(ci95(ratios)),
        "wall_ratio_geomean": geo,
        "wall_ratio_geomean_ci95": [geo_lo, geo_hi],
        "verdict": verdict,
        "wall_ratio_min": min(ratios),
        "wall_ratio_max": max(ratios),
        "wall_q20_ratio": low_q,
        "wall_q20_ratio_ci95": list(low_ci),
        "overhead_pct": (geo - 1) * 100,
        "events_per_run": events,
        "events_per_s_of_run": events / median([p["on"]["wall_s"] for p in pairs]),
        "in_run_ns_per_event": d_wall * 1e9 / events if events else float("nan"),
    }


def _accounted_summary(acc: list[dict]) -> dict:
    """Medians over the accounted runs: tracing's share of wall time, per event, per call kind."""
    return {
        "accounted": acc,
        "accounted_pct": median([a["share_of_wall"] for a in acc]) * 100,
        "accounted_elapsed_pct": median([a["elapsed_share_of_wall"] for a in acc]) * 100,
        "accounted_ns_per_event": median([a["ns_per_event"] for a in acc]),
        "accounted_ns_by_kind": {
            k: median([a["ns"][k] / max(1, a["calls"][k]) for a in acc]) for k in acc[0]["ns"]
        },
        "accounted_calls": {k: median([a["calls"][k] for a in acc]) for k in acc[0]["calls"]},
    }


def bench_trace_overhead(
    *,
    mode: str = "ahead",
    reps: int = 5,
    requests: int = 200,
    engine: dict | None = None,
    workload: dict | None = None,
    progress: Progress | None = None,
    target_pct: float = 3.0,
    gil_free_device_ms: float | None = None,
    clocks: bool = True,
) -> dict:
    """Interleaved runs with tracing on and off in ABBA order: wall-time ratio per pair, its median
    (bootstrap CI) and geometric mean (t-interval), a verdict against the target, the tracing work
    timed inside three more traced runs, and the per-event cost."""
    # lazy: both import torch, slow for every pdo start
    from engine.runs.prefill_run import run_prefill
    from engine.runs.spec import WorkloadConfig

    engine = dict(engine or {})
    workload = dict(workload or {})
    progress = progress or Progress(False)
    if gil_free_device_ms:  # as bench_prefill's what-if
        with gil_free_device(gil_free_device_ms, EngineConfig(**engine).max_batch_tokens):
            res = bench_trace_overhead(
                mode=mode,
                reps=reps,
                requests=requests,
                engine=engine,
                workload=workload,
                progress=progress,
                target_pct=target_pct,
                clocks=clocks,
            )
        res["gil_free_device_ms"] = gil_free_device_ms
        return res
    cfg = EngineConfig(mode=mode, **engine)
    wc = WorkloadConfig(requests=requests, **workload)
    forward = run_prefill(
        RunSpec(cfg, WorkloadConfig(requests=max(8, requests // 10), **workload), verify=False)
    ).summary["forward"]  # warm-up
    pairs = _on_off_pairs(cfg, wc, reps, progress, clocks)
    wall = _wall_summary(pairs, target_pct)
    micro = emit_cost_ns()
    acc = [accounted_run(cfg, wc, clocks) for _ in range(3)]
    cpu_ratios = [p["on"]["cpu_s"] / p["off"]["cpu_s"] for p in pairs]
    cgeo, clo, chi = geo_ci95(cpu_ratios)
    return {
        "benchmark": "trace-overhead",
        "date": now(),
        "machine": machine(),
        "mode": mode,
        "reps": reps,
        "requests": requests,
        "clocks": clocks,
        "engine": engine,
        "workload": workload,
        "forward": forward,
        "pairs": pairs,
        **wall,
        "emit_ns": micro["emit_ns"],
        "declared_ns": micro["declared_ns"],
        "write_ns": micro["write_ns"],
        "target_pct": target_pct,
        **_accounted_summary(acc),
        "cpu_ratio_median": median(cpu_ratios),
        "cpu_ratio_geomean": cgeo,
        "cpu_ratio_geomean_ci95": [clo, chi],
    }


def format_trace_overhead(r: dict) -> str:
    kinds = r.get("accounted_ns_by_kind", {})
    calls = r.get("accounted_calls", {})
    per_kind = ", ".join(f"{k} {kinds[k] / 1e3:.1f} µs x {calls.get(k, 0):.0f}" for k in kinds)
    forward = "a GIL-free wait (what-if)" if r.get("gil_free_device_ms") else r.get("forward", "?")
    geo_lo, geo_hi = r["wall_ratio_geomean_ci95"]
    return "\n".join(
        [
            f"tracing overhead{' with happens-before clocks' if r.get('clocks') else ''}, "
            f"mode={r['mode']}, forward={forward}, {r['reps']} interleaved on/off "
            f"pairs (ABBA) of {r['requests']} requests:",
            f"  wall time on/off: geometric mean {r['wall_ratio_geomean']:.4f} (95% CI {geo_lo:.3f}.."
            f"{geo_hi:.3f}) -> overhead {r['overhead_pct']:+.2f}%; target <= {r['target_pct']:.0f}%: "
            f"{r['verdict'].upper()}",
            f"  wall time on/off: median {r['wall_ratio_median']:.4f} (95% CI "
            f"{r['wall_ratio_ci95'][0]:.3f}..{r['wall_ratio_ci95'][1]:.3f}), range "
            f"{r['wall_ratio_min']:.3f}..{r['wall_ratio_max']:.3f}",
            f"  least-disturbed runs: 20th percentile on / 20th percentile off "
            f"{r['wall_q20_ratio']:.4f} (95% CI {r['wall_q20_ratio_ci95'][0]:.3f}.."
            f"{r['wall_q20_ratio_ci95'][1]:.3f})",
            f"  process CPU time on/off: geometric mean {r['cpu_ratio_geomean']:.4f} (95% CI "
            f"{r['cpu_ratio_geomean_ci95'][0]:.3f}..{r['cpu_ratio_geomean_ci95'][1]:.3f})",
            f"  tracing work inside traced runs (emit, obj ids, digests; all threads, thread CPU time; "
            f"an upper bound: the timer's clock reads cost more in a run than alone, which is what is "
            f"subtracted): {r['accounted_pct']:.2f}% of wall time, "
            f"{r['accounted_ns_per_event']:.0f} ns per event (elapsed inside, incl. waits for the GIL: "
            f"{r['accounted_elapsed_pct']:.2f}%)" + (f"; per call: {per_kind}" if per_kind else ""),
            f"  events per run {r['events_per_run']:.0f} ({r['events_per_s_of_run']:,.0f} events/s of "
            f"run time)",
            f"  per event: a declared event {r.get('declared_ns', float('nan')):.0f} ns (as the engine "
            f"logs), Tracer.emit {r['emit_ns']:.0f} ns (single thread, tight loop); write to file "
            f"{r['write_ns']:.0f} ns; in-run wall difference / events "
            f"{r['in_run_ns_per_event']:.0f} ns",
        ]
    )


def cmd_trace_overhead(a) -> int:
    engine, workload = engine_workload(a, 0.0)
    apply_switch_interval(a)
    reps = a.reps or (6 if a.quick else 400)
    requests = a.requests or (120 if a.quick else 200)
    res = bench_trace_overhead(
        mode=a.mode,
        reps=reps,
        requests=requests,
        engine=engine,
        workload=workload,
        progress=progress_of(a),
        gil_free_device_ms=a.gil_free_device,
        clocks=a.hb,
    )
    if not a.json:
        print_what_if(a.gil_free_device)
        print(format_trace_overhead(res))
    write_json(a, res)
    return 0


def add_trace_overhead_arguments(t) -> None:
    t.add_argument("--quick", action="store_true")
    t.add_argument("--mode", choices=PREFILL_LOOPS, default="ahead")
    t.add_argument(
        "--reps",
        type=d.integer(1, 100_000),
        default=None,
        help="on/off pairs (default 400, ~4 min here: fewer rarely resolve a ~1%% "
        "overhead against 3%%; quick 6)",
    )
    t.add_argument(
        "--requests",
        type=d.integer(1, 100_000),
        default=None,
        help="requests per run (default 200; quick 120)",
    )
    add_engine_knobs(t)
    t.add_argument(
        "--gil-free-device",
        type=d.number(0, 10_000),
        metavar="MS",
        default=None,
        help="what-if, as for prefill: the forward a GIL-free wait of MS ms per full batch",
    )
    t.add_argument(
        "--hb",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the traced side with the happens-before hand-offs (default: on, as pdo run)",
    )
    add_json_arguments(t)
    t.add_argument("--progress", action="store_true")
    t.set_defaults(validate=lambda a, _argv: check_knobs(a))


BENCH.register("trace-overhead")(
    BenchCommand(
        help="engine wall time with tracing on vs off; ns per event",
        add_arguments=add_trace_overhead_arguments,
        run=cmd_trace_overhead,
    )
)
