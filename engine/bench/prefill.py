"""`pdo bench prefill`: the four prefill loops, interleaved (A B C D A B C D ...), at several
prefix-hit ratios: uncached input tokens/s, TTFT, scheduler and forward busy time and overlap
efficiency per run, their medians per (hit, mode), and the per-round ratios against `thread`.
docs/benchmarks.md ("Prefill overlap") describes every metric."""

from __future__ import annotations

import sys
import time

from engine.bench.knobs import (
    add_engine_knobs,
    apply_switch_interval,
    check_knobs,
    engine_workload,
    floats,
    progress_of,
)
from engine.bench.prefill_chart import format_prefill_table, plot_prefill
from engine.bench.progress import Progress
from engine.bench.record import add_json_arguments, machine, now, write_json
from engine.bench.registry import BENCH, BenchCommand
from engine.bench.stats import ci95, median, pct
from engine.bench.trace_metrics import trace_metrics
from engine.bench.what_if import gil_free_device, print_what_if
from engine.runs.spec import RunSpec
from engine.runtime.config import EngineConfig
from engine.trace.tracer import Tracer
from spec import domains as d
from spec.errors import BadInput
from spec.vocabulary import PREFILL_LOOPS

BASELINE = "thread"
# Host time per layer launch (EngineConfig.launch_cost_us) that `bench prefill` models on the CPU
# device unless told otherwise: it stands in for the share of a real prefill forward that eager
# launches take (docs/benchmarks.md, "Why 1000 µs per layer by default"). The engine's own
# default stays 0.
DEFAULT_LAUNCH_COST_US = 1000.0

QUICK = dict(reps=3, requests=160, hits=(0.0, 0.5, 0.8))
FULL = dict(reps=9, requests=1000, hits=(0.0, 0.5, 0.8))  # 1,000: steady state (docs/benchmarks.md)

_PER_RUN = (
    "uncached_tok_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "sched_busy_ms",
    "admit_ms",
    "process_ms",
    "fwd_busy_ms",
    "collect_wait_ms",
    "hidden_ms",
    "overlap_efficiency",
    "wall_s",
    "batches",
    "uncached_tokens",
    "handoff_ms",
    "serial_ms",
)


def run_one(cfg, wc, *, progress: Progress | None = None, label: str = "") -> dict:
    """One traced run: the engine's summary plus TTFT and the trace metrics."""
    from engine.runs.prefill_run import run_prefill  # lazy: imports torch, slow for every pdo start

    tracer = Tracer()
    if progress is not None and progress.enabled:
        with progress.watch(label, tracer, wc.requests):
            run = run_prefill(RunSpec(cfg, wc, verify=False), tracer=tracer)
    else:
        run = run_prefill(RunSpec(cfg, wc, verify=False), tracer=tracer)
    s = run.summary
    if s["finished"] != s["requests"] or any(s["leaks"].values()):
        raise RuntimeError(
            f"bench run {cfg.mode} hit={wc.hit} did not finish cleanly: "
            f"{s['finished']}/{s['requests']} requests, leaks {s['leaks']}"
        )
    ttft = [
        (r.first_token_s - r.arrival_s) * 1e3 for r in run.requests if r.first_token_s is not None
    ]
    out = {
        "wall_s": s["wall_s"],
        "uncached_tokens": s["uncached_tokens"],
        "cached_tokens": s["cached_tokens"],
        "uncached_tok_per_s": s["uncached_tok_per_s"],
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "events": len(tracer.events),
        "forward": s.get("forward"),
        "device": s.get("device"),
        "attention_backend": s.get("attention_backend"),
    }
    out.update(trace_metrics(tracer.events))
    return out


def _interleaved_runs(modes, hits, reps, requests, engine, workload, progress) -> dict:
    """`reps` rounds of every mode at every hit ratio, nested so: {(hit, mode): [run, ...]}."""
    from engine.runs.spec import WorkloadConfig  # lazy: imports torch, slow for every pdo start

    runs: dict[tuple, list[dict]] = {(h, m): [] for h in hits for m in modes}
    total = reps * len(hits) * len(modes)
    k = 0
    t_start = time.perf_counter()
    for rep in range(reps):
        for h in hits:
            for m in modes:
                k += 1
                cfg = EngineConfig(mode=m, **engine)
                wc = WorkloadConfig(requests=requests, hit=h, **workload)
                r = run_one(cfg, wc, progress=progress, label=f"[{k}/{total}] hit={h} {m}")
                r["rep"] = rep
                runs[(h, m)].append(r)
                progress.line(
                    f"[{k}/{total}] hit={h} {m}: {r['uncached_tok_per_s']:,.0f} uncached "
                    f"tok/s, overlap eff {r['overlap_efficiency']:.2f}, "
                    f"{time.perf_counter() - t_start:.0f} s"
                )
    progress.done()
    return runs


def _per_mode(runs: dict, hits, modes) -> list[dict]:
    """Per (hit, mode): the runs, their medians and, per round, the ratio against the baseline."""
    results = []
    for h in hits:
        base = runs.get((h, BASELINE))
        for m in modes:
            rs = runs[(h, m)]
            entry = {
                "hit": h,
                "mode": m,
                "median": {key: median([r[key] for r in rs]) for key in _PER_RUN},
                "runs": rs,
            }
            if base:
                ratios = [
                    r["uncached_tok_per_s"] / b["uncached_tok_per_s"]
                    for r, b in zip(rs, base, strict=False)
                ]
                lo, hi = ci95(ratios)
                entry["ratio_vs_thread"] = {
                    "median": median(ratios),
                    "ci95": [lo, hi],
                    "min": min(ratios),
                    "max": max(ratios),
                    "per_rep": ratios,
                }
            results.append(entry)
    return results


def _headline(results: list[dict], hits) -> dict:
    """Per hit ratio: ahead / thread with its interval, and ahead's overlap efficiency."""
    headline = {}
    for h in hits:
        for e in results:
            if e["hit"] == h and e["mode"] == "ahead" and "ratio_vs_thread" in e:
                headline[str(h)] = {
                    "ahead_over_thread": e["ratio_vs_thread"]["median"],
                    "ci95": e["ratio_vs_thread"]["ci95"],
                    "ahead_overlap_efficiency": e["median"]["overlap_efficiency"],
                }
    return headline


def _used(runs: dict, key: str) -> str:
    """The values of `key` over all runs, comma-separated ('?' for a run without one)."""
    return ",".join(sorted({str(r.get(key) or "?") for rs in runs.values() for r in rs}))


def bench_prefill(
    *,
    modes=PREFILL_LOOPS,
    hits=(0.0, 0.5, 0.8),
    reps: int = 3,
    requests: int = 160,
    engine: dict | None = None,
    workload: dict | None = None,
    progress: Progress | None = None,
    warmup: bool = True,
    gil_free_device_ms: float | None = None,
) -> dict:
    """All `modes` interleaved (A B C D A B C D ...) at each hit ratio, `reps` times. Returns the
    per-run numbers, their medians per (hit, mode) and the per-rep ratios against `thread`."""
    from engine.runs.spec import WorkloadConfig  # lazy: imports torch, slow for every pdo start

    engine = dict(engine or {})
    workload = dict(workload or {})
    progress = progress or Progress(False)
    modes = list(modes)
    if gil_free_device_ms:
        with gil_free_device(gil_free_device_ms, EngineConfig(**engine).max_batch_tokens):
            res = bench_prefill(
                modes=modes,
                hits=hits,
                reps=reps,
                requests=requests,
                engine=engine,
                workload=workload,
                progress=progress,
                warmup=warmup,
            )
        res["gil_free_device_ms"] = gil_free_device_ms
        return res
    if warmup:  # first-run costs (imports, allocator, thread start-up) out of the measurement
        for m in modes:
            run_one(
                EngineConfig(mode=m, **engine),
                WorkloadConfig(requests=max(8, requests // 10), hit=hits[-1], **workload),
            )
    runs = _interleaved_runs(modes, hits, reps, requests, engine, workload, progress)
    results = _per_mode(runs, hits, modes)
    return {
        "benchmark": "prefill",
        "date": now(),
        "machine": machine(),
        "modes": modes,
        "hits": list(hits),
        "forward": _used(runs, "forward"),
        "device": _used(runs, "device"),
        "attention_backend": _used(runs, "attention_backend"),
        "reps": reps,
        "requests": requests,
        "engine": engine,
        "workload": workload,
        "results": results,
        "headline": _headline(results, hits),
    }


def _print_prefill(res: dict, gil_free_device_ms: float | None) -> None:
    print_what_if(gil_free_device_ms)
    gpu = res["machine"].get("gpu")
    on_gpu = f" ({gpu})" if gpu and "cuda" in res.get("device", "") else ""
    print(
        f"device: {res.get('device')}{on_gpu}, "
        f"attention: {res.get('attention_backend')}, model: {res['engine'].get('model')}, "
        f"dtype: {res['engine'].get('dtype')}"
    )
    print(
        f"forward: {res.get('forward')} (script: one TorchScript call per layer, GIL released; "
        "eager: op by op; PDO_FORWARD=eager|script)"
    )
    print(format_prefill_table(res))
    for h, v in res["headline"].items():
        print(
            f"hit {h}: ahead / thread = {v['ahead_over_thread']:.3f} (95% CI {v['ci95'][0]:.3f}.."
            f"{v['ci95'][1]:.3f}), ahead overlap efficiency {v['ahead_overlap_efficiency']:.2f}"
        )


def cmd_prefill(a) -> int:
    if a.requests is not None and a.requests < 1:
        raise BadInput("--requests must be >= 1")
    base = QUICK if a.quick else FULL
    reps = a.reps or base["reps"]
    requests = a.requests or base["requests"]
    hits = floats(a.hits) if a.hits else base["hits"]
    modes = [m.strip() for m in a.modes.split(",")] if a.modes else list(PREFILL_LOOPS)
    bad = [m for m in modes if m not in PREFILL_LOOPS]
    if bad:
        raise BadInput(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(PREFILL_LOOPS)}")
    engine, workload = engine_workload(a, DEFAULT_LAUNCH_COST_US)
    switch = apply_switch_interval(a)
    res = bench_prefill(
        modes=modes,
        hits=hits,
        reps=reps,
        requests=requests,
        engine=engine,
        workload=workload,
        progress=progress_of(a),
        gil_free_device_ms=a.gil_free_device,
    )
    res["switch_interval_us"] = switch
    from_pdo = sys.argv and sys.argv[0].endswith("pdo")
    res["command"] = "pdo " + " ".join(sys.argv[1:]) if from_pdo else None
    if not a.json:
        _print_prefill(res, a.gil_free_device)
    write_json(a, res)
    if a.png:
        plot_prefill(res, a.png)
        if not a.json:
            print(f"chart: {a.png}")
    return 0


def add_prefill_arguments(q) -> None:
    q.add_argument(
        "--quick", action="store_true", help="a small version (under two minutes on two cores)"
    )
    q.add_argument(
        "--reps",
        type=d.integer(1, 100_000),
        default=None,
        help="rounds of A B C D per hit (default 9; quick 3)",
    )
    q.add_argument(
        "--requests",
        type=d.integer(1, 100_000),
        default=None,
        help="requests per run (default 1000, steady state; quick 160)",
    )
    q.add_argument(
        "--hits",
        type=d.listed(d.ratio()),
        default=None,
        help="prefix-hit ratios, comma-separated (default 0,0.5,0.8)",
    )
    q.add_argument(
        "--modes",
        type=d.listed(d.one_of(PREFILL_LOOPS, "a loop mode")),
        default=None,
        help="loop modes, comma-separated (default all four)",
    )
    add_engine_knobs(q)
    q.add_argument(
        "--gil-free-device",
        type=d.number(0, 10_000),
        metavar="MS",
        default=None,
        help="what-if: replace the model's forward by a GIL-free wait of MS ms per full "
        "batch (as a GPU's); not the engine's own numbers",
    )
    add_json_arguments(q)
    q.add_argument(
        "--png",
        type=d.path(".png", ".svg", ".pdf"),
        metavar="FILE",
        help="write a chart (ratios vs thread, overlap efficiency)",
    )
    q.add_argument(
        "--progress", action="store_true", help="progress on stderr even when it is not a TTY"
    )
    q.set_defaults(validate=lambda a, _argv: check_knobs(a))


BENCH.register("prefill")(
    BenchCommand(
        help="the four prefill loops, interleaved, at prefix hit 0.0/0.5/0.8",
        add_arguments=add_prefill_arguments,
        run=cmd_prefill,
    )
)
