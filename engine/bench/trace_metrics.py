"""Busy times and overlap efficiency of one run, from its trace events, on the spans of
checker/perfetto.py:

  S = admit and process spans on the scheduler thread   (scheduler time that could be hidden)
  W = fwd spans (host-side run_batch), wherever they ran
  scheduler busy = |S|, forward busy = |W|, hidden = |S ∩ W| (time, on the union of each)
  overlap efficiency = |S ∩ W| / min(|S|, |W|)
"""

from __future__ import annotations

from checker.perfetto import timeline_of


def union(intervals) -> list[tuple[int, int]]:
    """The union of (start, end) intervals as a sorted list of disjoint ones; empty ones dropped."""
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> int:
    return sum(b - a for a, b in intervals)


def intersection(xs, ys) -> int:
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


def _serial_ns(events, sched: str) -> int:
    """Serial steps before each submit, summed: from the scheduler's last admit or collect to the
    submit (snapshot, staging, cached-prefix sends in ahead; the sample launch too in ahead, whose
    collect precedes them)."""
    serial, mark = 0, None
    for e in events:
        if e["thread"] != sched:
            continue
        if e["ev"] in ("admit", "collect"):
            mark = e["t_ns"]
        elif e["ev"] == "submit" and mark is not None:
            serial += e["t_ns"] - mark
    return serial


def trace_metrics(events, role: str = "prefill") -> dict:
    """Busy times and overlap efficiency of one run, from its events (dicts, in seq order)."""
    _, spans, _ = timeline_of(events, role)
    sched = next((s.thread for s in spans if s.kind == "admit"), "scheduler")
    on_sched = [s for s in spans if s.thread == sched]
    s_iv = union((s.t0, s.t1) for s in on_sched if s.kind in ("admit", "process"))
    w_iv = union((s.t0, s.t1) for s in spans if s.kind == "fwd")
    admit = sum(s.dur for s in on_sched if s.kind == "admit")
    process = sum(s.dur for s in on_sched if s.kind == "process")
    collect = sum(s.dur for s in spans if s.kind == "collect")
    s_len, w_len = length(s_iv), length(w_iv)
    hidden = intersection(s_iv, w_iv)
    hideable = min(s_len, w_len)
    batches = sum(1 for s in spans if s.kind == "fwd")
    # hand-off latency: submit(N) on the scheduler to fwd_begin(N) on the worker (thread modes)
    submit = {e["batch"]: e["t_ns"] for e in events if e["ev"] == "submit"}
    handoff = [s.t0 - submit[s.batch] for s in spans if s.kind == "fwd" and s.batch in submit]
    return {
        "batches": batches,
        "sched_busy_ms": s_len / 1e6,
        "admit_ms": admit / 1e6,
        "process_ms": process / 1e6,
        "fwd_busy_ms": w_len / 1e6,
        "collect_wait_ms": collect / 1e6,
        "hidden_ms": hidden / 1e6,
        "hideable_ms": hideable / 1e6,
        "overlap_efficiency": hidden / hideable if hideable else 0.0,
        "handoff_ms": sum(handoff) / len(handoff) / 1e6 if handoff else 0.0,
        "serial_ms": _serial_ns(events, sched) / 1e6,
    }
