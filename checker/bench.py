"""`pdo bench checker`: throughput and peak memory of the linear checker
(checker.linear.check_file) on a big valid trace, made by repeating one engine trace, each
measurement in a fresh interpreter."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from checker.trace_io import iter_events
from engine.bench.progress import Progress
from engine.bench.record import add_json_arguments, machine, now, write_json
from engine.bench.registry import BENCH, BenchCommand
from engine.runs.spec import RunSpec
from engine.runtime.config import EngineConfig
from spec import domains as d
from spec.errors import BadInput

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _engine_trace(path: str, requests: int, mode: str) -> None:
    from engine.runs.prefill_run import run_prefill  # lazy: imports torch, slow for every pdo start
    from engine.runs.spec import WorkloadConfig

    run_prefill(
        RunSpec(
            EngineConfig(mode=mode),
            WorkloadConfig(requests=requests),
            trace_path=path,
            verify=False,
        )
    )


def _renumbered(e: dict, k: int, span: int, batches: int) -> dict:
    """Event `e` of the base trace in its k-th copy: batches, time, request and object ids shifted
    so that the copy is a new stretch of the same run (seq is set by the caller)."""
    e = dict(e)
    e["t_ns"] += k * span
    if "batch" in e:
        e["batch"] += k * batches
    if k:
        suf = f".{k}"
        if "rid" in e:
            e["rid"] += suf
        if "rids" in e:
            e["rids"] = [r + suf for r in e["rids"]]
        if e.get("chunks"):
            e["chunks"] = {r + suf: c for r, c in e["chunks"].items()}
        if "obj" in e:
            e["obj"] += suf
    return e


def make_big_trace(
    out: str, events: int, *, base: str | None = None, requests: int = 300, mode: str = "ahead"
) -> dict:
    """A valid trace of at least `events` events: one engine trace (`base`, or a fresh run) repeated
    with batches, requests, objects, seq and time renumbered so that every copy is a new stretch of
    the same run. Returns {events, bytes, copies, base_events}."""
    tmp = None
    if base is None:
        tmp = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False)
        tmp.close()
        base = tmp.name
        _engine_trace(base, requests, mode)
    try:
        header: dict = {}
        evs = [e for _, e in iter_events(base, header_out=header)]
    finally:
        if tmp is not None:
            os.unlink(tmp.name)
    if not evs:
        raise BadInput(f"{base}: no events to repeat")
    batches = max((e["batch"] for e in evs if "batch" in e), default=-1) + 1
    span = evs[-1]["t_ns"] - evs[0]["t_ns"] + 1000
    copies = -(-events // len(evs))
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    n = 0
    with open(out, "w") as f:
        f.write(json.dumps(header) + "\n")
        for k in range(copies):
            buf = []
            for e in evs:
                n += 1
                e = _renumbered(e, k, span, batches)
                e["seq"] = n
                buf.append(dumps(e))
            f.write("\n".join(buf) + "\n")
        if header.get("version", 1) >= 2:  # a whole trace: its end counts the events before it
            end = {"seq": n + 1, "t_ns": evs[-1]["t_ns"] + copies * span, "thread": "scheduler"}
            f.write(dumps(end | {"ev": "trace_end", "events": n, "reason": "normal"}) + "\n")
    return {"events": n, "bytes": os.path.getsize(out), "copies": copies, "base_events": len(evs)}


_CHILD = r"""
import json, sys, time, tracemalloc
def vm(key):  # VmHWM / VmRSS of this process in KiB
    # (ru_maxrss would include the parent's, from before exec)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0
from checker.linear import check_file
from checker.trace_io import iter_chunks
from spec import domains as d
path, mode = sys.argv[1], sys.argv[2]
out = {"rss_before_kib": vm("VmHWM")}
if mode == "parse":
    import gc; gc.disable()  # as check_file reads: its structs, the collector off
    t = time.perf_counter(); n = sum(map(len, iter_chunks(path, structs=True)))
    dt = time.perf_counter() - t
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
    """One measurement (`check`, `parse` or `tracemalloc`) in a fresh interpreter."""
    pythonpath = _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, path, mode],
        capture_output=True,
        text=True,
        cwd=_ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )
    if p.returncode != 0:
        why = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode
        raise RuntimeError(f"checker child failed: {why}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _measure(path: str, reps: int, memory: bool, progress: Progress):
    """`reps` full checks and parses of `path`, then one check under tracemalloc if `memory`."""
    checks, parses = [], []
    for i in range(reps):
        progress.line(f"[{i + 1}/{reps}] check_file ...")
        checks.append(_child(path, "check"))
        progress.line(f"[{i + 1}/{reps}] parse only ...")
        parses.append(_child(path, "parse"))
    return checks, parses, (_child(path, "tracemalloc") if memory else None)


def bench_checker(
    *,
    events: int = 1_000_000,
    trace: str | None = None,
    keep: str | None = None,
    reps: int = 1,
    memory: bool = True,
    progress: Progress | None = None,
) -> dict:
    """checker.linear.check_file on a big valid trace (made with make_big_trace unless `trace` is
    given), each measurement in a fresh interpreter: events/s of the full check, of parsing alone,
    and peak memory (RSS growth over the interpreter's start, and the tracemalloc peak)."""
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
        checks, parses, tm = _measure(path, reps, memory, progress)
    finally:
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)
    progress.done()
    best = min(checks, key=lambda c: c["seconds"])
    bestp = min(parses, key=lambda c: c["seconds"])
    n = best["events"]
    return {
        "benchmark": "checker",
        "date": now(),
        "machine": machine(),
        "trace": trace or (keep or "(temporary)"),
        "made": made,
        "events": n,
        "bytes": size,
        "ok": best["ok"],
        "reps": reps,
        "seconds": best["seconds"],
        "events_per_s": n / best["seconds"],
        "events_per_s_all": [c["events"] / c["seconds"] for c in checks],
        "parse_seconds": bestp["seconds"],
        "parse_events_per_s": bestp["events"] / bestp["seconds"],
        "rules_share": 1 - bestp["seconds"] / best["seconds"],
        "rss_peak_mib": best["rss_peak_kib"] / 1024,
        "rss_growth_mib": (best["rss_peak_kib"] - best["rss_before_kib"]) / 1024,
        "tracemalloc_peak_mib": tm["tracemalloc_peak_bytes"] / 2**20 if tm else None,
        "target_events_per_s": 200_000,
    }


def format_checker(r: dict) -> str:
    tracemalloc = (
        f", tracemalloc peak {r['tracemalloc_peak_mib']:.1f} MiB"
        if r["tracemalloc_peak_mib"] is not None
        else ""
    )
    return "\n".join(
        [
            f"checker.linear.check_file on {r['events']:,} events ({r['bytes'] / 2**20:.0f} MiB), "
            f"result {'PASS' if r['ok'] else 'FAIL'}:",
            f"  {r['events_per_s']:,.0f} events/s ({r['seconds']:.2f} s; target "
            f"{r['target_events_per_s']:,}); parsing + validation alone "
            f"{r['parse_events_per_s']:,.0f} events/s (rules take {r['rules_share'] * 100:.0f}% of the "
            f"time)",
            f"  memory: peak RSS {r['rss_peak_mib']:.0f} MiB (+{r['rss_growth_mib']:.0f} MiB over the "
            f"interpreter with the checker imported)" + tracemalloc,
        ]
    )


def cmd_checker(a) -> int:
    events = a.events or (200_000 if a.quick else 1_000_000)
    res = bench_checker(
        events=events,
        trace=a.trace,
        keep=a.keep,
        reps=a.reps or 1,
        memory=not a.no_memory,
        progress=Progress(True if a.progress else None),
    )
    if not a.json:
        print(format_checker(res))
    write_json(a, res)
    return 0


def add_checker_arguments(c) -> None:
    c.add_argument("--quick", action="store_true", help="200,000 events instead of 1,000,000")
    c.add_argument(
        "--events", type=d.integer(1, 100_000_000), default=None, help="size of the generated trace"
    )
    c.add_argument(
        "--trace",
        type=d.path(),
        metavar="FILE",
        help="measure this trace instead of generating one",
    )
    c.add_argument(
        "--keep", type=d.path(), metavar="FILE", help="write the generated trace here and keep it"
    )
    c.add_argument(
        "--reps", type=d.integer(1, 1000), default=None, help="measurements (best is reported)"
    )
    c.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    add_json_arguments(c)
    c.add_argument("--progress", action="store_true")


BENCH.register("checker")(
    BenchCommand(
        help="linear checker throughput and peak memory on a big valid trace",
        add_arguments=add_checker_arguments,
        run=cmd_checker,
    )
)
