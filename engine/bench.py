"""`pdo bench`: measurements of the engine and of its instruments.

  pdo bench prefill         the four prefill loops, interleaved, at several prefix-hit ratios: uncached
                            input tokens/s, TTFT, scheduler and forward busy time, overlap efficiency
  pdo bench trace-overhead  the engine with tracing on vs off, and the cost of one trace event
  pdo bench checker         throughput and peak memory of the linear checker on a big valid trace

Every metric and how it is computed is described in docs/benchmarks.md ("Prefill overlap"). The
trace-derived metrics use the spans of checker/perfetto.py:

  S = admit and process spans on the scheduler thread   (scheduler time that could be hidden)
  W = fwd spans (host-side run_batch), wherever they ran
  scheduler busy = |S|, forward busy = |W|, hidden = |S ∩ W| (time, on the union of each)
  overlap efficiency = |S ∩ W| / min(|S|, |W|)

`bench` is a parser with sub-commands. Another benchmark adds itself with one line: its module in
BENCH_PLUGINS (its `register(bench_subparsers)` adds the sub-command), or, from a top-level plugin,
`bench_subparsers(sub).add_parser("decode", ...)`.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

from .config import MODES

BASELINE = "thread"
# Host time per layer launch (EngineConfig.launch_cost_us) that `bench prefill` models unless told
# otherwise: 2 layers x 1 ms = 2 ms per batch, about a fifth of the emulated forward of a full batch —
# the share eager launches take of a real prefill forward (tens of layers, ~20 launches each). The
# engine's own default stays 0. docs/benchmarks.md shows the results for 0 to 5000.
DEFAULT_LAUNCH_COST_US = 1000.0

# Modules adding `pdo bench <name>`: each defines `register(bench_subparsers)` (e.g. "engine.decode.bench").
BENCH_PLUGINS: list[str] = []


# ---- small helpers -------------------------------------------------------------------------------

def _pct(xs, q: float) -> float:
    """Percentile by linear interpolation (q in 0..100); nan for no data."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _median(xs) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def _ci95(xs, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of xs (seeded, so reruns print the same interval)."""
    import random

    xs = [x for x in xs if x == x]
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def _union(intervals) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> int:
    return sum(b - a for a, b in intervals)


def _intersection(xs, ys) -> int:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = total = 0
    while i < len(xs) and j < len(ys):
        a, b = xs[i]
        c, d = ys[j]
        lo, hi = max(a, c), min(b, d)
        if hi > lo:
            total += hi - lo
        if b < d:
            i += 1
        else:
            j += 1
    return total


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpus": os.cpu_count(), "cpu": cpu, "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "host": platform.node(),
            "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def _now() -> str:
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


# ---- trace metrics -------------------------------------------------------------------------------

def trace_metrics(events, role: str = "prefill") -> dict:
    """Busy times and overlap efficiency of one run, from its events (dicts, in seq order)."""
    from checker.perfetto import timeline_of

    _, spans, _ = timeline_of(events, role)
    sched = next((s.thread for s in spans if s.kind == "admit"), "scheduler")
    s_iv = _union((s.t0, s.t1) for s in spans if s.thread == sched and s.kind in ("admit", "process"))
    w_iv = _union((s.t0, s.t1) for s in spans if s.kind == "fwd")
    admit = sum(s.dur for s in spans if s.thread == sched and s.kind == "admit")
    process = sum(s.dur for s in spans if s.thread == sched and s.kind == "process")
    collect = sum(s.dur for s in spans if s.kind == "collect")
    s_len, w_len = _length(s_iv), _length(w_iv)
    hidden = _intersection(s_iv, w_iv)
    hideable = min(s_len, w_len)
    batches = sum(1 for s in spans if s.kind == "fwd")
    # hand-off latency: submit(N) on the scheduler to fwd_begin(N) on the worker (thread modes)
    submit = {e["batch"]: e["t_ns"] for e in events if e["ev"] == "submit"}
    # serial steps before a submit: since the scheduler's last admit or collect (snapshot, staging,
    # cached-prefix sends in ahead; sample launch too in ahead, whose collect precedes them)
    serial, mark = 0, None
    for e in events:
        if e["thread"] != sched:
            continue
        if e["ev"] in ("admit", "collect"):
            mark = e["t_ns"]
        elif e["ev"] == "submit" and mark is not None:
            serial += e["t_ns"] - mark
    handoff = [s.t0 - submit[s.batch] for s in spans if s.kind == "fwd" and s.batch in submit]
    return {
        "batches": batches,
        "sched_busy_ms": s_len / 1e6, "admit_ms": admit / 1e6, "process_ms": process / 1e6,
        "fwd_busy_ms": w_len / 1e6, "collect_wait_ms": collect / 1e6,
        "hidden_ms": hidden / 1e6, "hideable_ms": hideable / 1e6,
        "overlap_efficiency": hidden / hideable if hideable else 0.0,
        "handoff_ms": sum(handoff) / len(handoff) / 1e6 if handoff else 0.0,
        "serial_ms": serial / 1e6,
    }


# ---- progress ------------------------------------------------------------------------------------

class Progress:
    """Progress of long runs on stderr: only when stderr is a TTY, or when forced (--progress).
    Within a run, a monitor thread reads the run's trace events every `period` seconds (requests
    released = done; KV-send tokens = uncached tokens prefilled) — nothing is added to the engine."""

    def __init__(self, enabled: bool | None = None, period: float = 0.5, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.enabled = self.tty if enabled is None else enabled
        self.period = period if self.tty else max(period, 2.0)
        self._stop = None

    def line(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\r\033[K" if self.tty else "") + text + ("" if self.tty else "\n"))
            self.stream.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def watch(self, label: str, tracer, total: int):
        """Context manager: report `label: done/total requests, tok/s` while the run goes on."""
        return _Watch(self, label, tracer, total)


class _Watch:
    def __init__(self, prog: Progress, label: str, tracer, total: int):
        self.p, self.label, self.tracer, self.total = prog, label, tracer, total
        self.stop = threading.Event()
        self.thread = None

    def __enter__(self):
        if self.p.enabled and getattr(self.tracer, "enabled", False):
            self.thread = threading.Thread(target=self._run, name="bench-progress", daemon=True)
            self.thread.start()
        return self

    def _run(self):
        t0 = time.perf_counter()
        seen = released = tokens = 0
        while not self.stop.wait(self.p.period):
            new = self.tracer.names_and_fields(seen)   # not `events`: that would hash pending digests
            seen += len(new)
            for ev, fields in new:
                if ev == "release":
                    released += 1
                elif ev == "kv_send":
                    tokens += fields.get("tokens", 0)
            dt = time.perf_counter() - t0
            self.p.line(f"{self.label}: {released}/{self.total} requests, {tokens / dt:,.0f} uncached tok/s")

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


# ---- what-if: a device that does not hold the GIL -------------------------------------------------

class gil_free_device:
    """What-if, for `bench prefill --gil-free-device MS`: the model's forward becomes a wait of MS ms
    per `max_batch_tokens` tokens (scaled by the batch's tokens) that releases the GIL, returning zero
    logits and writing no KV. On CPU the emulated device is a Python thread: between torch ops its
    forward holds the GIL, so it competes with the scheduler work that admit-ahead moves beside
    run_batch. A GPU does not; this isolates the loops' own effect. Outputs are not meaningful."""

    def __init__(self, ms_per_full_batch: float, full_batch_tokens: int):
        self.ms, self.full = ms_per_full_batch, full_batch_tokens
        self.orig = None

    def __enter__(self):
        import torch

        from .model import TinyLlama

        ms, full = self.ms, self.full
        self.orig = TinyLlama.forward

        def forward(model, input_ids, positions, out_cache_loc, pool, backend, meta, logit_rows, *, decode=False,
                    impl=None, out=None):
            time.sleep(ms * 1e-3 * input_ids.shape[0] / full)
            logits = torch.zeros((logit_rows.shape[0], model.cfg.vocab_size), device=input_ids.device)
            if out is not None:
                out.copy_(logits)
            return logits

        TinyLlama.forward = forward
        return self

    def __exit__(self, *exc):
        from .model import TinyLlama

        TinyLlama.forward = self.orig


# ---- pdo bench prefill ---------------------------------------------------------------------------

QUICK = dict(reps=3, requests=160, hits=(0.0, 0.5, 0.8))
FULL = dict(reps=9, requests=1000, hits=(0.0, 0.5, 0.8))   # 1,000: steady state (docs/benchmarks.md)


def run_one(cfg, wc, *, progress: Progress | None = None, label: str = "") -> dict:
    """One traced run: the engine's summary plus TTFT and the trace metrics."""
    from .run import run_prefill, shared_model
    from .trace import Tracer

    tracer = Tracer()
    if progress is not None and progress.enabled:
        with progress.watch(label, tracer, wc.requests):
            s = run_prefill(cfg, wc, tracer=tracer, keep_scheduler=True, model=shared_model(cfg))
    else:
        s = run_prefill(cfg, wc, tracer=tracer, keep_scheduler=True, model=shared_model(cfg))
    if s["_error"] is not None:
        raise s["_error"]
    if s["finished"] != s["requests"] or any(s["leaks"].values()):
        raise RuntimeError(f"bench run {cfg.mode} hit={wc.hit} did not finish cleanly: "
                           f"{s['finished']}/{s['requests']} requests, leaks {s['leaks']}")
    ttft = [(r.first_token_s - r.arrival_s) * 1e3 for r in s["_requests"] if r.first_token_s is not None]
    out = {
        "wall_s": s["wall_s"], "uncached_tokens": s["uncached_tokens"], "cached_tokens": s["cached_tokens"],
        "uncached_tok_per_s": s["uncached_tok_per_s"], "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
        "events": len(tracer.events), "forward": s.get("forward"), "device": s.get("device"),
        "attention_backend": s.get("attention_backend"),
    }
    out.update(trace_metrics(tracer.events))
    return out


_PER_RUN = ("uncached_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "sched_busy_ms", "admit_ms", "process_ms",
            "fwd_busy_ms", "collect_wait_ms", "hidden_ms", "overlap_efficiency", "wall_s", "batches",
            "uncached_tokens", "handoff_ms", "serial_ms")


def bench_prefill(*, modes=MODES, hits=(0.0, 0.5, 0.8), reps: int = 3, requests: int = 160,
                  engine: dict | None = None, workload: dict | None = None, progress: Progress | None = None,
                  warmup: bool = True, gil_free_device_ms: float | None = None) -> dict:
    """All `modes` interleaved (A B C D A B C D ...) at each hit ratio, `reps` times. Returns the
    per-run numbers, their medians per (hit, mode) and the per-rep ratios against `thread`."""
    from .config import EngineConfig
    from .workload import WorkloadConfig

    engine = dict(engine or {})
    workload = dict(workload or {})
    progress = progress or Progress(False)
    modes = list(modes)
    if gil_free_device_ms:
        with gil_free_device(gil_free_device_ms, EngineConfig(**engine).max_batch_tokens):
            res = bench_prefill(modes=modes, hits=hits, reps=reps, requests=requests, engine=engine,
                                workload=workload, progress=progress, warmup=warmup)
        res["gil_free_device_ms"] = gil_free_device_ms
        return res
    runs: dict[tuple, list[dict]] = {(h, m): [] for h in hits for m in modes}
    if warmup:  # first-run costs (imports, allocator, thread start-up) out of the measurement
        for m in modes:
            run_one(EngineConfig(mode=m, **engine), WorkloadConfig(requests=max(8, requests // 10), hit=hits[-1],
                                                                    **workload))
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
                progress.line(f"[{k}/{total}] hit={h} {m}: {r['uncached_tok_per_s']:,.0f} uncached tok/s, "
                              f"overlap eff {r['overlap_efficiency']:.2f}, {time.perf_counter() - t_start:.0f} s")
    progress.done()
    results = []
    for h in hits:
        base = runs.get((h, BASELINE))
        for m in modes:
            rs = runs[(h, m)]
            med = {key: _median([r[key] for r in rs]) for key in _PER_RUN}
            entry = {"hit": h, "mode": m, "median": med, "runs": rs}
            if base:
                ratios = [r["uncached_tok_per_s"] / b["uncached_tok_per_s"] for r, b in zip(rs, base)]
                lo, hi = _ci95(ratios)
                entry["ratio_vs_thread"] = {"median": _median(ratios), "ci95": [lo, hi], "min": min(ratios),
                                            "max": max(ratios), "per_rep": ratios}
            results.append(entry)
    headline = {}
    for h in hits:
        for e in results:
            if e["hit"] == h and e["mode"] == "ahead" and "ratio_vs_thread" in e:
                headline[str(h)] = {"ahead_over_thread": e["ratio_vs_thread"]["median"],
                                    "ci95": e["ratio_vs_thread"]["ci95"],
                                    "ahead_overlap_efficiency": e["median"]["overlap_efficiency"]}
    def used(key):
        return ",".join(sorted({str(r.get(key) or "?") for rs in runs.values() for r in rs}))
    return {"benchmark": "prefill", "date": _now(), "machine": machine(), "modes": modes, "hits": list(hits),
            "forward": used("forward"), "device": used("device"), "attention_backend": used("attention_backend"),
            "reps": reps, "requests": requests, "engine": engine, "workload": workload,
            "results": results, "headline": headline}


def format_prefill_table(res: dict) -> str:
    head = (f"{'hit':>4} {'mode':8} {'tok/s':>8} {'vs thread':>18} {'TTFT p50':>9} {'p99':>8} "
            f"{'sched busy':>10} {'fwd busy':>9} {'hidden':>8} {'overlap eff':>11}")
    units = (f"{'':>4} {'':8} {'uncached':>8} {'median [95% CI]':>18} {'ms':>9} {'ms':>8} "
             f"{'ms':>10} {'ms':>9} {'ms':>8} {'':>11}")
    lines = [head, units]
    for e in res["results"]:
        m = e["median"]
        r = e.get("ratio_vs_thread")
        ratio = f"{r['median']:.3f} [{r['ci95'][0]:.2f},{r['ci95'][1]:.2f}]" if r else "-"
        lines.append(f"{e['hit']:>4} {e['mode']:8} {m['uncached_tok_per_s']:8.0f} {ratio:>18} "
                     f"{m['ttft_p50_ms']:9.1f} {m['ttft_p99_ms']:8.1f} {m['sched_busy_ms']:10.1f} "
                     f"{m['fwd_busy_ms']:9.1f} {m['hidden_ms']:8.1f} {m['overlap_efficiency']:11.2f}")
    return "\n".join(lines)


def plot_prefill(res: dict, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hits, modes = res["hits"], res["modes"]
    colors = {"normal": "#9e9e9e", "overlap": "#64b5f6", "thread": "#ffb74d", "ahead": "#43a047"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=110)
    width = 0.8 / len(modes)
    by = {(e["hit"], e["mode"]): e for e in res["results"]}
    for i, m in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(hits))]
        rat = [by[(h, m)].get("ratio_vs_thread", {}).get("median", float("nan")) for h in hits]
        ci = [by[(h, m)].get("ratio_vs_thread", {}).get("ci95", [r, r]) for h, r in zip(hits, rat)]
        lo = [r - c[0] for r, c in zip(rat, ci)]
        hi = [c[1] - r for r, c in zip(rat, ci)]
        ax1.bar(xs, rat, width, yerr=[lo, hi], capsize=2, color=colors.get(m), label=m, error_kw={"lw": 0.8})
        eff = [by[(h, m)]["median"]["overlap_efficiency"] for h in hits]
        ax2.bar(xs, eff, width, color=colors.get(m), label=m)
    ax1.axhline(1.0, color="k", lw=0.6)
    seed = ax1.axhline(1.07, color="k", lw=0.7, ls=":", label="seed: ahead +7% (left)")
    goal = ax2.axhline(0.9, color="k", lw=0.7, ls="--", label="goal: efficiency 0.9 (right)")
    lows = [e.get("ratio_vs_thread", {}).get("ci95", [1.0, 1.0])[0] for e in res["results"]]
    highs = [e.get("ratio_vs_thread", {}).get("ci95", [1.0, 1.0])[1] for e in res["results"]]
    ax1.set_ylim(min(0.8, min(lows) - 0.05), max(1.2, max(highs) + 0.05))
    for ax, title in ((ax1, "uncached input tokens/s vs thread (95% CI)"), (ax2, "overlap efficiency")):
        ax.set_xticks(range(len(hits)))
        ax.set_xticklabels([f"hit {h}" for h in hits])
        ax.set_title(title, fontsize=10)
        ax.tick_params(labelsize=8)
    ax2.set_ylim(0, 1.05)
    handles, labels = ax1.get_legend_handles_labels()   # below both panels: inside, it hid bars
    handles = [h for h in handles if h is not seed] + [seed, goal]
    fig.legend(handles, [h.get_label() for h in handles], loc="lower center", ncol=len(handles), fontsize=7.5,
               frameon=False)
    eng = res.get("engine", {})
    knobs = ", ".join(f"{k}={v:g}" for k, v in eng.items() if k.endswith("_us") and v)
    whatif = (f"WHAT-IF: GIL-free device, {res['gil_free_device_ms']:g} ms per full batch"
              if res.get("gil_free_device_ms") else "")
    fwd = f"forward {res['forward']}" if res.get("forward") and not res.get("gil_free_device_ms") else ""
    sub = "; ".join(x for x in (f"model {eng.get('model', 'tiny')}", fwd, knobs, whatif) if x)
    gpu = res["machine"].get("gpu")
    where = gpu if gpu and "cuda" in str(res.get("device", "")) else f"{res['machine']['cpus']} CPUs"
    fig.suptitle(f"pdo bench prefill: {res['reps']} rounds x {res['requests']} requests, "
                 f"{where}, attention {res.get('attention_backend', '?')}\n{sub}", fontsize=8.5)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out)
    plt.close(fig)


# ---- pdo bench trace-overhead --------------------------------------------------------------------

def emit_cost_ns(n: int = 100_000) -> dict:
    """Cost of logging one typical event (kv_send: four fields), from one thread, in ns: as the engine
    does (a declared event, Tracer.events_for) and through Tracer.emit; and of writing it to a file."""
    import tempfile

    from .trace import Tracer

    # A warm-up on a tracer thrown away, then the measurement: unwarmed, the first loop read 1.1-1.3 µs
    # in two of five runs (0.45 warm).
    for tr, reps in ((Tracer(), 1000), (Tracer({"role": "prefill"}), n)):
        emit, kv_send = tr.emit, tr.events_for(kv_send=("rid", "obj", "tokens", "pages")).kv_send
        t0 = time.perf_counter_ns()
        for i in range(reps):
            kv_send("r1", "o1", 16, 1)
        t1 = time.perf_counter_ns()
        for i in range(reps):
            emit("kv_send", rid="r1", obj="o1", tokens=16, pages=1)
        t2 = time.perf_counter_ns()
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t.jsonl")
        t3 = time.perf_counter_ns()
        tr.write(p)
        t4 = time.perf_counter_ns()
    return {"declared_ns": (t1 - t0) / n, "emit_ns": (t2 - t1) / n, "write_ns": (t4 - t3) / (2 * n), "events": 2 * n}


class _Accounting:
    """For one traced run: the time spent inside the tracer (emit, obj) and in the digests computed
    only when tracing is on (DigestStamp: stamped, then hashed), summed over all threads. Installed by patching
    for that run only; the pairs that measure wall time use the plain Tracer."""

    def __init__(self):
        self.ns = {"emit": 0, "obj": 0, "digest": 0}       # thread CPU time: the work itself
        self.elapsed = {"emit": 0, "obj": 0, "digest": 0}  # elapsed inside (also waits for the GIL)
        self.calls = {"emit": 0, "obj": 0, "digest": 0}
        self.local = threading.local()

    def wrap(self, kind, fn):
        ns, elapsed, calls, local = self.ns, self.elapsed, self.calls, self.local
        cpu, clock = time.thread_time_ns, time.perf_counter_ns

        def timed(*a, **kw):
            if getattr(local, "inside", False):   # nested (obj ids inside a digest): counted by the outer one
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


def accounted_run(cfg, wc) -> dict:
    """One traced run with the tracing work timed where it happens; returns its share of wall time."""
    from . import request
    from .run import run_prefill, shared_model
    from .trace import Tracer

    probe = _Accounting()          # the timing wrapper's own cost, subtracted below
    noop = probe.wrap("emit", lambda: None)
    for _ in range(20000):
        noop()
    self_cpu, self_elapsed = probe.ns["emit"] / 20000, probe.elapsed["emit"] / 20000
    acc = _Accounting()
    tr = Tracer()
    tr.emit = acc.wrap("emit", tr.emit)
    logger = tr._logger   # the engine's declared events (Tracer.events_for), each logger timed
    tr._logger = lambda kind: acc.wrap("emit", logger(kind))
    tr.obj = acc.wrap("obj", tr.obj)
    stamp, resolve = request.DigestStamp.__init__, request.DigestStamp.resolve
    request.DigestStamp.__init__ = acc.wrap("digest", stamp)         # a stamp taken (on the calling thread)
    request.DigestStamp.resolve = acc.wrap("digest", resolve)        # and hashed (by the worker)
    try:
        s = run_prefill(cfg, wc, tracer=tr, model=shared_model(cfg))
    finally:
        request.DigestStamp.__init__, request.DigestStamp.resolve = stamp, resolve
    # The run's work only: reading the events afterwards names objects and returns resolved digests,
    # which is the write's cost (reported per event by emit_cost_ns), not the run's.
    ns, elapsed, calls = dict(acc.ns), dict(acc.elapsed), dict(acc.calls)
    for k, n in calls.items():
        ns[k] = max(0, ns[k] - int(n * self_cpu))
        elapsed[k] = max(0, elapsed[k] - int(n * self_elapsed))
    total = sum(ns.values())
    inside = sum(elapsed.values())
    events = tr.count
    return {"wall_s": s["wall_s"], "events": events, "ns": ns, "elapsed_ns": elapsed,
            "calls": calls, "tracing_ms": total / 1e6, "share_of_wall": total / 1e9 / s["wall_s"],
            "elapsed_share_of_wall": inside / 1e9 / s["wall_s"], "ns_per_event": total / max(1, events),
            "timer_self_ns": {"cpu": self_cpu, "elapsed": self_elapsed}}


def _geo_ci95(ratios) -> tuple[float, float, float]:
    """Geometric mean of ratios with a 95% t-interval (on the logs): (mean, lo, hi)."""
    import math

    logs = [math.log(r) for r in ratios if r > 0]
    n = len(logs)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    m = statistics.fmean(logs)
    if n < 2:
        return math.exp(m), math.exp(m), math.exp(m)
    # two-sided 97.5% quantile of Student's t (n-1 degrees of freedom); 1.96 beyond the table
    t = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
         15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04, 40: 2.02, 60: 2.00, 120: 1.98}
    df = n - 1
    q = next((v for k, v in sorted(t.items()) if k >= df), 1.96)
    half = q * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def _quantile_ratio(on, off, q: float = 20.0, n: int = 2000, seed: int = 0):
    """Ratio of the q-th percentiles of the on and off wall times, with a 95% bootstrap interval
    (pairs resampled together). Interference from other jobs only adds time, so the faster runs of
    each side are the least disturbed: this estimates the overhead on a quiet machine."""
    import random

    est = _pct(on, q) / _pct(off, q)
    rng = random.Random(seed)
    idx = range(len(on))
    boots = []
    for _ in range(n):
        pick = rng.choices(idx, k=len(on))
        boots.append(_pct([on[i] for i in pick], q) / _pct([off[i] for i in pick], q))
    boots.sort()
    return est, (boots[int(0.025 * n)], boots[int(0.975 * n) - 1])


def bench_trace_overhead(*, mode: str = "ahead", reps: int = 5, requests: int = 200, engine: dict | None = None,
                         workload: dict | None = None, progress: Progress | None = None,
                         target_pct: float = 3.0, gil_free_device_ms: float | None = None) -> dict:
    """Interleaved runs with tracing on (Tracer, in memory, as `pdo run --trace` before the write)
    and off (NullTracer), in ABBA order (off on, on off, off on, ...: drift of the machine hits both
    sides alike): wall-time ratio per pair, its median (bootstrap CI) and geometric mean (t-interval),
    a verdict against the target, and the per-event cost."""
    from .config import EngineConfig
    from .run import run_prefill, shared_model
    from .trace import NullTracer, Tracer
    from .workload import WorkloadConfig

    engine = dict(engine or {})
    workload = dict(workload or {})
    progress = progress or Progress(False)
    if gil_free_device_ms:   # as bench_prefill's what-if
        with gil_free_device(gil_free_device_ms, EngineConfig(**engine).max_batch_tokens):
            res = bench_trace_overhead(mode=mode, reps=reps, requests=requests, engine=engine, workload=workload,
                                       progress=progress, target_pct=target_pct)
        res["gil_free_device_ms"] = gil_free_device_ms
        return res
    cfg = EngineConfig(mode=mode, **engine)
    wc = WorkloadConfig(requests=requests, **workload)
    forward = run_prefill(cfg, WorkloadConfig(requests=max(8, requests // 10), **workload),
                          model=shared_model(cfg))["forward"]  # warm-up
    pairs = []
    for rep in range(reps):
        row = {}
        order = ("off", "on") if rep % 2 == 0 else ("on", "off")   # alternate who goes first
        for which in order:
            tr = Tracer() if which == "on" else NullTracer()
            c0 = time.process_time()
            s = run_prefill(cfg, wc, tracer=tr, model=shared_model(cfg))
            row[which] = {"wall_s": s["wall_s"], "cpu_s": time.process_time() - c0,
                          "events": tr.count if which == "on" else 0}
        row["ratio"] = row["on"]["wall_s"] / row["off"]["wall_s"]
        pairs.append(row)
        progress.line(f"[{rep + 1}/{reps}] tracing on/off wall ratio {row['ratio']:.3f}")
    progress.done()
    ratios = [p["ratio"] for p in pairs]
    geo, geo_lo, geo_hi = _geo_ci95(ratios)
    low_q, low_ci = _quantile_ratio([p["on"]["wall_s"] for p in pairs], [p["off"]["wall_s"] for p in pairs])
    target = 1 + target_pct / 100
    verdict = ("met" if geo_hi <= target else "not met" if geo_lo > target else "not resolved")
    events = _median([p["on"]["events"] for p in pairs])
    d_wall = _median([p["on"]["wall_s"] - p["off"]["wall_s"] for p in pairs])
    micro = emit_cost_ns()
    acc = [accounted_run(cfg, wc) for _ in range(3)]
    cpu_ratios = [p["on"]["cpu_s"] / p["off"]["cpu_s"] for p in pairs]
    cgeo, clo, chi = _geo_ci95(cpu_ratios)
    return {
        "benchmark": "trace-overhead", "date": _now(), "machine": machine(), "mode": mode, "reps": reps,
        "requests": requests, "engine": engine, "workload": workload, "forward": forward, "pairs": pairs,
        "wall_ratio_median": _median(ratios), "wall_ratio_ci95": list(_ci95(ratios)),
        "wall_ratio_geomean": geo, "wall_ratio_geomean_ci95": [geo_lo, geo_hi], "verdict": verdict,
        "wall_ratio_min": min(ratios), "wall_ratio_max": max(ratios),
        "wall_q20_ratio": low_q, "wall_q20_ratio_ci95": list(low_ci),
        "overhead_pct": (geo - 1) * 100, "events_per_run": events,
        "events_per_s_of_run": events / _median([p["on"]["wall_s"] for p in pairs]),
        "in_run_ns_per_event": d_wall * 1e9 / events if events else float("nan"),
        "emit_ns": micro["emit_ns"], "declared_ns": micro["declared_ns"], "write_ns": micro["write_ns"], "target_pct": target_pct,
        "accounted": acc, "accounted_pct": _median([a["share_of_wall"] for a in acc]) * 100,
        "accounted_elapsed_pct": _median([a["elapsed_share_of_wall"] for a in acc]) * 100,
        "accounted_ns_per_event": _median([a["ns_per_event"] for a in acc]),
        "accounted_ns_by_kind": {k: _median([a["ns"][k] / max(1, a["calls"][k]) for a in acc]) for k in acc[0]["ns"]},
        "accounted_calls": {k: _median([a["calls"][k] for a in acc]) for k in acc[0]["calls"]},
        "cpu_ratio_median": _median(cpu_ratios), "cpu_ratio_geomean": cgeo, "cpu_ratio_geomean_ci95": [clo, chi],
    }


def format_trace_overhead(r: dict) -> str:
    kinds = r.get("accounted_ns_by_kind", {})
    calls = r.get("accounted_calls", {})
    per_kind = ", ".join(f"{k} {kinds[k] / 1e3:.1f} µs x {calls.get(k, 0):.0f}" for k in kinds)
    return "\n".join([
        f"tracing overhead, mode={r['mode']}, forward="
        f"{'a GIL-free wait (what-if)' if r.get('gil_free_device_ms') else r.get('forward', '?')}, {r['reps']} interleaved on/off pairs "
        f"(ABBA) of {r['requests']} requests:",
        f"  wall time on/off: geometric mean {r['wall_ratio_geomean']:.4f} (95% CI {r['wall_ratio_geomean_ci95'][0]:.3f}.."
        f"{r['wall_ratio_geomean_ci95'][1]:.3f}) -> overhead {r['overhead_pct']:+.2f}%; target <= {r['target_pct']:.0f}%: "
        f"{r['verdict'].upper()}",
        f"  wall time on/off: median {r['wall_ratio_median']:.4f} (95% CI {r['wall_ratio_ci95'][0]:.3f}.."
        f"{r['wall_ratio_ci95'][1]:.3f}), range {r['wall_ratio_min']:.3f}..{r['wall_ratio_max']:.3f}",
        f"  least-disturbed runs: 20th percentile on / 20th percentile off {r['wall_q20_ratio']:.4f} (95% CI "
        f"{r['wall_q20_ratio_ci95'][0]:.3f}..{r['wall_q20_ratio_ci95'][1]:.3f})",
        f"  process CPU time on/off: geometric mean {r['cpu_ratio_geomean']:.4f} (95% CI "
        f"{r['cpu_ratio_geomean_ci95'][0]:.3f}..{r['cpu_ratio_geomean_ci95'][1]:.3f})",
        f"  tracing work inside traced runs (emit, obj ids, digests; all threads, thread CPU time; an upper "
        f"bound: the timer's clock reads cost more in a run than alone, which is what is subtracted): "
        f"{r['accounted_pct']:.2f}% of wall time, {r['accounted_ns_per_event']:.0f} ns per event "
        f"(elapsed inside, incl. waits for the GIL: {r['accounted_elapsed_pct']:.2f}%)"
        + (f"; per call: {per_kind}" if per_kind else ""),
        f"  events per run {r['events_per_run']:.0f} ({r['events_per_s_of_run']:,.0f} events/s of run time)",
        f"  per event: a declared event {r.get('declared_ns', float('nan')):.0f} ns (as the engine logs), "
        f"Tracer.emit {r['emit_ns']:.0f} ns "
        f"(single thread, tight loop); "
        f"write to file {r['write_ns']:.0f} ns; in-run wall difference / events {r['in_run_ns_per_event']:.0f} ns",
    ])


# ---- pdo bench checker ---------------------------------------------------------------------------

def make_big_trace(out: str, events: int, *, base: str | None = None, requests: int = 300,
                   mode: str = "ahead") -> dict:
    """A valid trace of at least `events` events: one engine trace (`base`, or a fresh run) repeated
    with batches, requests, objects, seq and time renumbered so that every copy is a new stretch of
    the same run. Returns {events, bytes, copies, base_events}."""
    import tempfile

    from checker.trace_io import iter_events

    tmp = None
    if base is None:
        from .config import EngineConfig
        from .run import run_prefill
        from .workload import WorkloadConfig

        tmp = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False)
        tmp.close()
        base = tmp.name
        run_prefill(EngineConfig(mode=mode), WorkloadConfig(requests=requests), trace_path=base)
    try:
        header: dict = {}
        evs = [e for _, e in iter_events(base, header_out=header)]
    finally:
        if tmp is not None:
            os.unlink(tmp.name)
    if not evs:
        raise ValueError(f"{base}: no events to repeat")
    nb = max((e["batch"] for e in evs if "batch" in e), default=-1) + 1
    span = evs[-1]["t_ns"] - evs[0]["t_ns"] + 1000
    copies = -(-events // len(evs))
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    n = 0
    with open(out, "w") as f:
        f.write(json.dumps(header) + "\n")
        for k in range(copies):
            suf = f".{k}" if k else ""
            buf = []
            for e in evs:
                e = dict(e)
                n += 1
                e["seq"] = n
                e["t_ns"] += k * span
                if "batch" in e:
                    e["batch"] += k * nb
                if k:
                    if "rid" in e:
                        e["rid"] += suf
                    if "rids" in e:
                        e["rids"] = [r + suf for r in e["rids"]]
                    if e.get("chunks"):
                        e["chunks"] = {r + suf: c for r, c in e["chunks"].items()}
                    if "obj" in e:
                        e["obj"] += suf
                buf.append(dumps(e))
            f.write("\n".join(buf) + "\n")
    return {"events": n, "bytes": os.path.getsize(out), "copies": copies, "base_events": len(evs)}


_CHILD = r"""
import json, sys, time, tracemalloc
def vm(key):  # VmHWM / VmRSS of this process in KiB (ru_maxrss would include the parent's, from before exec)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0
from checker.linear import check_file
from checker.trace_io import iter_events
path, mode = sys.argv[1], sys.argv[2]
out = {"rss_before_kib": vm("VmHWM")}
if mode == "parse":
    t = time.perf_counter(); n = sum(1 for _ in iter_events(path)); dt = time.perf_counter() - t
    out.update(events=n, seconds=dt)
elif mode == "tracemalloc":
    tracemalloc.start(); r = check_file(path); out.update(events=r.events, ok=r.ok)
    out["tracemalloc_peak_bytes"] = tracemalloc.get_traced_memory()[1]
else:
    t = time.perf_counter(); r = check_file(path); dt = time.perf_counter() - t
    out.update(events=r.events, seconds=dt, ok=r.ok, violations=len(r.violations))
out["rss_peak_kib"] = vm("VmHWM")
print(json.dumps(out))
"""


def _child(path: str, mode: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", _CHILD, path, mode], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")})
    if p.returncode != 0:
        raise RuntimeError(f"checker child failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def bench_checker(*, events: int = 1_000_000, trace: str | None = None, keep: str | None = None,
                  reps: int = 1, memory: bool = True, progress: Progress | None = None) -> dict:
    """checker.linear.check_file on a big valid trace (made with make_big_trace unless `trace` is
    given), each measurement in a fresh interpreter: events/s of the full check, of parsing alone,
    and peak memory (RSS growth over the interpreter's start, and the tracemalloc peak)."""
    import tempfile

    progress = progress or Progress(False)
    made = None
    d = None
    if trace is None:
        if keep:
            path = keep
        else:
            d = tempfile.mkdtemp(prefix="pdo-bench-")
            path = os.path.join(d, "big.jsonl")
        progress.line(f"writing a valid trace of >= {events:,} events to {path} ...")
        made = make_big_trace(path, events)
    else:
        path = trace
    try:
        size = os.path.getsize(path)
        checks, parses = [], []
        for i in range(reps):
            progress.line(f"[{i + 1}/{reps}] check_file ...")
            checks.append(_child(path, "check"))
            progress.line(f"[{i + 1}/{reps}] parse only ...")
            parses.append(_child(path, "parse"))
        tm = _child(path, "tracemalloc") if memory else None
    finally:
        if d is not None:
            import shutil
            shutil.rmtree(d, ignore_errors=True)
    progress.done()
    best = min(checks, key=lambda c: c["seconds"])
    bestp = min(parses, key=lambda c: c["seconds"])
    n = best["events"]
    res = {
        "benchmark": "checker", "date": _now(), "machine": machine(), "trace": trace or (keep or "(temporary)"),
        "made": made, "events": n, "bytes": size, "ok": best["ok"], "reps": reps,
        "seconds": best["seconds"], "events_per_s": n / best["seconds"],
        "events_per_s_all": [c["events"] / c["seconds"] for c in checks],
        "parse_seconds": bestp["seconds"], "parse_events_per_s": bestp["events"] / bestp["seconds"],
        "rules_share": 1 - bestp["seconds"] / best["seconds"],
        "rss_peak_mib": best["rss_peak_kib"] / 1024, "rss_growth_mib": (best["rss_peak_kib"] - best["rss_before_kib"]) / 1024,
        "tracemalloc_peak_mib": tm["tracemalloc_peak_bytes"] / 2**20 if tm else None,
        "target_events_per_s": 200_000,
    }
    return res


def format_checker(r: dict) -> str:
    return "\n".join([
        f"checker.linear.check_file on {r['events']:,} events ({r['bytes'] / 2**20:.0f} MiB), "
        f"result {'PASS' if r['ok'] else 'FAIL'}:",
        f"  {r['events_per_s']:,.0f} events/s ({r['seconds']:.2f} s; target {r['target_events_per_s']:,}); "
        f"parsing + validation alone {r['parse_events_per_s']:,.0f} events/s "
        f"(rules take {r['rules_share'] * 100:.0f}% of the time)",
        f"  memory: peak RSS {r['rss_peak_mib']:.0f} MiB (+{r['rss_growth_mib']:.0f} MiB over the interpreter with the "
        f"checker imported)"
        + (f", tracemalloc peak {r['tracemalloc_peak_mib']:.1f} MiB" if r["tracemalloc_peak_mib"] is not None else ""),
    ])


# ---- CLI -----------------------------------------------------------------------------------------

def _floats(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {s!r}") from None


def _add_engine_knobs(p) -> None:
    g = p.add_argument_group("engine and workload")
    g.add_argument("--model", choices=["tiny", "large"], default="tiny")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="auto: torch on cpu, the Triton kernels on cuda")
    g.add_argument("--num-pages", type=int, default=512, help="KV pool pages (of --page-size tokens)")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--max-batch-reqs", type=int, default=16)
    g.add_argument("--admission-cost-us", type=float, default=0.0,
                   help="extra host work per admitted request (a heavier scheduler)")
    g.add_argument("--launch-cost-us", type=float, default=None,
                   help="host time per layer launch inside run_batch (eager launch overhead); "
                        "default: 0 for trace-overhead, 1000 for prefill on cpu, 0 on cuda (see docs/benchmarks.md)")
    g.add_argument("--max-batch-tokens", type=int, default=256)
    g.add_argument("--chunk-size", type=int, default=128)
    g.add_argument("--prompt-len", default="24:160", help="MIN:MAX prompt tokens")
    g.add_argument("--groups", type=int, default=3)
    g.add_argument("--switch-interval-us", type=float, default=None,
                   help="sys.setswitchinterval for the whole benchmark (default: Python's, 5000)")


def _engine_workload(a, default_launch: float) -> tuple[dict, dict]:
    import torch

    lo, _, hi = a.prompt_len.partition(":")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch ({torch.__version__}) sees no CUDA device")
    dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    # The emulated launch cost stands in for eager launches on the CPU device; a GPU has real ones.
    if a.launch_cost_us is not None:
        launch = a.launch_cost_us
    else:
        launch = 0.0 if device.startswith("cuda") else default_launch
    engine = {"model": a.model, "admission_cost_us": a.admission_cost_us, "launch_cost_us": launch,
              "max_batch_tokens": a.max_batch_tokens, "chunk_size": a.chunk_size, "device": device,
              "dtype": dtype, "attention_backend": a.attention_backend, "num_pages": a.num_pages,
              "page_size": a.page_size, "max_batch_reqs": a.max_batch_reqs}
    workload = {"prompt_len": (int(lo), int(hi or lo)), "groups": a.groups}
    return engine, workload


def _progress(a) -> Progress:
    return Progress(True if a.progress else None)


def _switch(a):
    if a.switch_interval_us:
        sys.setswitchinterval(a.switch_interval_us * 1e-6)
    return sys.getswitchinterval() * 1e6


def _print_what_if(ms: float | None) -> None:
    if ms:
        print(f"WHAT-IF: the model's forward is a GIL-free wait of {ms:g} ms per full batch (no real compute, no "
              "host CPU taken, as a GPU's); these are not the engine's own numbers")


def _write_json(path: str | None, res: dict) -> None:
    if not path:
        return
    text = json.dumps(res, indent=1, default=str)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def cmd_prefill(a) -> int:
    if a.requests is not None and a.requests < 1:
        raise ValueError("--requests must be >= 1")
    base = QUICK if a.quick else FULL
    reps = a.reps or base["reps"]
    requests = a.requests or base["requests"]
    hits = _floats(a.hits) if a.hits else base["hits"]
    modes = [m.strip() for m in a.modes.split(",")] if a.modes else list(MODES)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
    engine, workload = _engine_workload(a, DEFAULT_LAUNCH_COST_US)
    switch = _switch(a)
    res = bench_prefill(modes=modes, hits=hits, reps=reps, requests=requests, engine=engine, workload=workload,
                        progress=_progress(a), gil_free_device_ms=a.gil_free_device)
    res["switch_interval_us"] = switch
    res["command"] = "pdo " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("pdo") else None
    if a.json != "-":
        _print_what_if(a.gil_free_device)
        gpu = res["machine"].get("gpu")
        print(f"device: {res.get('device')}{f' ({gpu})' if gpu and 'cuda' in res.get('device', '') else ''}, "
              f"attention: {res.get('attention_backend')}, model: {res['engine'].get('model')}, "
              f"dtype: {res['engine'].get('dtype')}")
        print(f"forward: {res.get('forward')} (script: one TorchScript call per layer, GIL released; eager: op by op; "
              "PDO_FORWARD=eager|script)")
        print(format_prefill_table(res))
        for h, v in res["headline"].items():
            print(f"hit {h}: ahead / thread = {v['ahead_over_thread']:.3f} (95% CI {v['ci95'][0]:.3f}.."
                  f"{v['ci95'][1]:.3f}), ahead overlap efficiency {v['ahead_overlap_efficiency']:.2f}")
    _write_json(a.json, res)
    if a.png:
        plot_prefill(res, a.png)
        if a.json != "-":
            print(f"chart: {a.png}")
    return 0


def cmd_trace_overhead(a) -> int:
    engine, workload = _engine_workload(a, 0.0)
    _switch(a)
    reps = a.reps or (6 if a.quick else 400)
    requests = a.requests or (120 if a.quick else 200)
    res = bench_trace_overhead(mode=a.mode, reps=reps, requests=requests, engine=engine, workload=workload,
                               progress=_progress(a), gil_free_device_ms=a.gil_free_device)
    if a.json != "-":
        _print_what_if(a.gil_free_device)
        print(format_trace_overhead(res))
    _write_json(a.json, res)
    return 0


def cmd_checker(a) -> int:
    events = a.events or (200_000 if a.quick else 1_000_000)
    res = bench_checker(events=events, trace=a.trace, keep=a.keep, reps=a.reps or 1, memory=not a.no_memory,
                        progress=_progress(a))
    if a.json != "-":
        print(format_checker(res))
    _write_json(a.json, res)
    return 0


def register(sub) -> None:
    import importlib

    p = sub.add_parser("bench", help="benchmarks: prefill loops, tracing overhead, checker throughput")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="{prefill,trace-overhead,checker,...}")

    q = bsub.add_parser("prefill", help="the four prefill loops, interleaved, at prefix hit 0.0/0.5/0.8")
    q.add_argument("--quick", action="store_true", help="a small version (under two minutes on two cores)")
    q.add_argument("--reps", type=int, default=None, help="rounds of A B C D per hit (default 9; quick 3)")
    q.add_argument("--requests", type=int, default=None, help="requests per run (default 1000, steady state; quick 160)")
    q.add_argument("--hits", default=None, help="prefix-hit ratios, comma-separated (default 0,0.5,0.8)")
    q.add_argument("--modes", default=None, help="loop modes, comma-separated (default all four)")
    _add_engine_knobs(q)
    q.add_argument("--gil-free-device", type=float, metavar="MS", default=None,
                   help="what-if: replace the model's forward by a GIL-free wait of MS ms per full batch "
                        "(as a GPU's); not the engine's own numbers")
    q.add_argument("--json", metavar="FILE", help="write the results as JSON ('-': stdout, no table)")
    q.add_argument("--png", metavar="FILE", help="write a chart (ratios vs thread, overlap efficiency)")
    q.add_argument("--progress", action="store_true", help="progress on stderr even when it is not a TTY")
    q.set_defaults(fn=cmd_prefill)

    t = bsub.add_parser("trace-overhead", help="engine wall time with tracing on vs off; ns per event")
    t.add_argument("--quick", action="store_true")
    t.add_argument("--mode", choices=list(MODES), default="ahead")
    t.add_argument("--reps", type=int, default=None, help="on/off pairs (default 400, ~4 min here: fewer rarely resolve a ~1%% overhead against 3%%; quick 6)")
    t.add_argument("--requests", type=int, default=None, help="requests per run (default 200; quick 120)")
    _add_engine_knobs(t)
    t.add_argument("--gil-free-device", type=float, metavar="MS", default=None,
                   help="what-if, as for prefill: the forward a GIL-free wait of MS ms per full batch")
    t.add_argument("--json", metavar="FILE")
    t.add_argument("--progress", action="store_true")
    t.set_defaults(fn=cmd_trace_overhead)

    c = bsub.add_parser("checker", help="linear checker throughput and peak memory on a big valid trace")
    c.add_argument("--quick", action="store_true", help="200,000 events instead of 1,000,000")
    c.add_argument("--events", type=int, default=None, help="size of the generated trace")
    c.add_argument("--trace", metavar="FILE", help="measure this trace instead of generating one")
    c.add_argument("--keep", metavar="FILE", help="write the generated trace here and keep it")
    c.add_argument("--reps", type=int, default=None, help="measurements (best is reported)")
    c.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    c.add_argument("--json", metavar="FILE")
    c.add_argument("--progress", action="store_true")
    c.set_defaults(fn=cmd_checker)

    p._pdo_bench_subparsers = bsub
    for mod in BENCH_PLUGINS:
        importlib.import_module(mod).register(bsub)


def bench_subparsers(sub):
    """For a plugin registered at the top level (engine/cli.py PLUGINS, after engine.bench): the
    sub-parsers of `pdo bench`, so that `pdo bench decode` is one line:
        bench_subparsers(sub).add_parser("decode", help=...)"""
    return sub.choices["bench"]._pdo_bench_subparsers
