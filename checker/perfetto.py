"""Timelines of a pdo-trace: the spans each thread spent in a step, and their export as Chrome
trace-event JSON (opens in ui.perfetto.dev and chrome://tracing).

The trace has point events only; the spans are derived from them, the same way for the exporter, the
static plot (checker/plot.py) and the benchmark (engine/bench/):

  fwd N       fwd_begin(N) .. fwd_end(N), on the thread that ran run_batch (worker or scheduler); in
              general every `X_begin` / `X_end` pair of one batch on one thread is a span `X`
  process N   process_begin(N) .. process_end(N)
  admit N     from the thread's previous event that is not a release to admit(N): the loop top
              (retire AS writes, ingest) and admission itself (prefix match, slot and page
              allocation, building the batch); it also holds what ran between that previous event
              and the loop top — the KV inflight queue (releasing finished requests: the design's
              steady state puts it with result processing, beside the forward), in overlap/thread
              mode the sample launch — and any idle wait
  collect N   from the thread's previous event to collect(N): waiting for the worker's result
  sample N    sample(N) .. the thread's next event, unless that event is admission's (then 0 long)

Every other event is an instant (KV sends, releases, snapshot, stage, and any event this module does
not know, e.g. the decode side's), so the export holds every event of the trace with its fields.
Flow arrows: submit(N) → fwd N (the batch handed to the worker) and batch_copy(N) → collect(N)
(the result handed back). `pdo check TRACE --perfetto out.json` adds the violations: a marker on
every event a violation names, linked by arrows, and a span per violation on a "pdo check" track.

Timestamps are written in whole microseconds from the first event, so that span boundaries are exact
in every viewer (fractional microseconds are rounded differently by different importers, which can
make adjacent spans overlap by a nanosecond and nest wrongly).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from spec.vocabulary import THREADS

from .trace_io import iter_events

SPAN_KINDS = ("admit", "fwd", "collect", "sample", "process")
POINT_SLICES = ("submit", "batch_copy", "collect")  # zero-length slices that flow arrows bind to
_ADMISSION = ("alloc", "admit")
# instants inside a step (the inflight queue's releases): they end no span
_NOT_A_STEP = ("release",)


@dataclass
class Span:
    thread: str
    kind: str
    batch: int | None
    t0: int  # ns, as in the trace
    t1: int
    args: dict = field(default_factory=dict)

    @property
    def dur(self) -> int:
        return self.t1 - self.t0


class Timeline:
    """Derives spans from a stream of events (feed them in seq order); memory is per-thread state
    only, so a long trace streams. `on_span(span)` and `on_event(e)` are called as they complete."""

    def __init__(self, role: str = "prefill", on_span=None, on_event=None):
        self.role = role
        self.on_span = on_span or (lambda s: None)
        self.on_event = on_event or (lambda e: None)
        self.prev: dict[str, dict] = {}  # thread -> its previous event
        # thread -> time of its previous event that ends a step
        self.step: dict[str, int] = {}
        self.adm_start: dict[str, int] = {}  # thread -> start of the admission being built
        self.open: dict[tuple, dict] = {}  # (thread, name, batch) -> begin event
        self.sample: dict[str, dict] = {}  # thread -> sample event whose span is open
        self.threads: list[str] = []
        self.t_first: int | None = None
        self.t_last: int | None = None
        self.events = 0

    def feed(self, e: dict) -> None:
        self.events += 1
        t, th, ev = e["t_ns"], e["thread"], e["ev"]
        if self.t_first is None:
            self.t_first = t
        self.t_last = t
        prev = self.prev.get(th)
        if prev is None:
            self.threads.append(th)
        prefill = self.role == "prefill"
        # sample N runs until this thread's next event, unless that event is admission's
        s = self.sample.pop(th, None)
        if s is not None:
            end = s["t_ns"] if ev in _ADMISSION else t
            self.on_span(Span(th, "sample", s.get("batch"), s["t_ns"], end))
        if prefill and ev in _ADMISSION:
            if th not in self.adm_start:
                self.adm_start[th] = self.step.get(th, t)
            if ev == "admit":
                self.on_span(
                    Span(
                        th,
                        "admit",
                        e["batch"],
                        self.adm_start.pop(th),
                        t,
                        {"requests": len(e.get("rids", ()))},
                    )
                )
        elif prefill and ev == "collect":
            start = prev["t_ns"] if prev is not None else t
            self.on_span(Span(th, "collect", e["batch"], start, t))
        elif prefill and ev == "sample":
            self.sample[th] = e
        elif ev.endswith("_begin"):
            self.open[(th, ev[:-6], e.get("batch"))] = e
        elif ev.endswith("_end"):
            b = self.open.pop((th, ev[:-4], e.get("batch")), None)
            if b is not None:
                name = ev[:-4]
                self.on_span(Span(th, name, e.get("batch"), b["t_ns"], t))
        self.on_event(e)
        self.prev[th] = e
        if ev not in _NOT_A_STEP:
            self.step[th] = t

    def finish(self) -> None:
        for th, s in list(self.sample.items()):
            self.on_span(Span(th, "sample", s.get("batch"), s["t_ns"], self.prev[th]["t_ns"]))
        self.sample.clear()


def timeline_of(events, role: str = "prefill") -> tuple[Timeline, list[Span], list[dict]]:
    """All spans and events of an in-memory event list (for small traces, plots and tests)."""
    spans: list[Span] = []
    evs: list[dict] = []
    tl = Timeline(role, spans.append, evs.append)
    for e in events:
        tl.feed(e)
    tl.finish()
    return tl, spans, evs


def load(path: str) -> tuple[dict, Timeline, list[Span], list[dict]]:
    header: dict = {}
    it = (e for _, e in iter_events(path, header_out=header))
    first = next(it, None)
    events = [first] if first is not None else []
    tl, spans, evs = timeline_of(_chain(events, it), header.get("role", "prefill"))
    return header, tl, spans, evs


def _chain(first, it):
    yield from first
    yield from it


# ---- Chrome trace-event JSON --------------------------------------------------------------------

_THREAD_ORDER = THREADS
_FLOW_SUBMIT, _FLOW_COPY, _FLOW_VIOLATION = 1, 2, 3


def _flow_id(kind: int, n: int) -> int:
    return n * 4 + kind


def _tid_sort(name: str) -> tuple:
    return (_THREAD_ORDER.index(name) if name in _THREAD_ORDER else len(_THREAD_ORDER), name)


class _Writer:
    def __init__(self, f, t0: int):
        self.f, self.t0, self.first = f, t0, True

    def us(self, t_ns: int) -> int:
        return (t_ns - self.t0) // 1000

    def write(self, obj: dict) -> None:
        self.f.write(("" if self.first else ",\n") + json.dumps(obj, separators=(",", ":")))
        self.first = False


def _scan(path: str) -> tuple[dict, int, list[str]]:
    """The first pass: the header, the first event's time and the threads in order of appearance."""
    header: dict = {}
    t0, threads = None, []
    for _, e in iter_events(path, header_out=header):
        if t0 is None:
            t0 = e["t_ns"]
        if e["thread"] not in threads:
            threads.append(e["thread"])
    return header, t0 or 0, threads


def _flow_flags(pos: int, n: int) -> dict:
    """Flow ends of the `pos`-th of the `n` markers of one violation: out from the first, in to
    the last, both between."""
    if pos == 0:
        return {"flow_out": True}
    if pos == n - 1:
        return {"flow_in": True}
    return {"flow_in": True, "flow_out": True}


class _Exporter:
    """Writes one trace as trace-event objects: the track metadata, a slice per span, an instant
    (or a zero-length slice that flow arrows bind to) per event, and the violations: a marker on
    every event a violation names and a span per violation on the "pdo check" track."""

    def __init__(self, w: _Writer, role: str, tids: dict, violations: list, counts: dict):
        self.w, self.role, self.tids, self.vlist, self.counts = w, role, tids, violations, counts
        self.check_tid = len(tids) + 1
        self.marked: dict[int, list[tuple[int, int]]] = {}  # seq -> [(violation index, position)]
        for i, (_, _, _, seqs) in enumerate(violations):
            for pos, s in enumerate(sorted(set(seqs))):
                self.marked.setdefault(s, []).append((i, pos))
        # violation index -> [(t_ns, event name)] of its marked events
        self.vseen: dict[int, list[tuple[int, str]]] = {i: [] for i in range(len(violations))}

    def metadata(self, header: dict) -> None:
        w = self.w
        mode = f" mode={header['mode']}" if header.get("mode") else ""
        w.write(
            {
                "ph": "M",
                "pid": 1,
                "name": "process_name",
                "args": {"name": f"pdo {self.role}" + mode},
            }
        )
        tracks = list(self.tids.items()) + ([("pdo check", self.check_tid)] if self.vlist else [])
        for name, tid in tracks:
            w.write(
                {"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}}
            )
            w.write(
                {
                    "ph": "M",
                    "pid": 1,
                    "tid": tid,
                    "name": "thread_sort_index",
                    "args": {"sort_index": tid},
                }
            )

    def on_span(self, s: Span) -> None:
        ts, te = self.w.us(s.t0), self.w.us(s.t1)
        obj = {
            "ph": "X",
            "pid": 1,
            "tid": self.tids[s.thread],
            "ts": ts,
            "dur": te - ts,
            "cat": s.kind,
            "name": f"{s.kind} {s.batch}" if s.batch is not None else s.kind,
            "args": {"batch": s.batch, "dur_us": round(s.dur / 1000, 3), **s.args},
        }
        if s.kind == "fwd" and s.batch is not None:
            obj.update(bind_id=_flow_id(_FLOW_SUBMIT, s.batch), flow_in=True)
            self.counts["flows"] += 1
        self.w.write(obj)
        self.counts["spans"] += 1

    def on_event(self, e: dict) -> None:
        ev, b = e["ev"], e.get("batch")
        tid, ts = self.tids[e["thread"]], self.w.us(e["t_ns"])
        args = {k: v for k, v in e.items() if k not in ("t_ns", "thread", "ev")}
        name = f"{ev} {b}" if b is not None else (f"{ev} {e['rid']}" if "rid" in e else ev)
        if self.role == "prefill" and ev in POINT_SLICES and b is not None:
            obj = {
                "ph": "X",
                "pid": 1,
                "tid": tid,
                "ts": ts,
                "dur": 0,
                "cat": "step",
                "name": name,
                "args": args,
            }
            if ev == "submit":
                obj.update(bind_id=_flow_id(_FLOW_SUBMIT, b), flow_out=True)
            elif ev == "batch_copy":
                obj.update(bind_id=_flow_id(_FLOW_COPY, b), flow_out=True)
            else:
                obj.update(bind_id=_flow_id(_FLOW_COPY, b), flow_in=True)
            self.w.write(obj)
        else:
            if ev in ("kv_send", "prefix_send"):
                cat = "kv"
            else:
                cat = "step" if self.role == "prefill" else self.role
            self.w.write(
                {
                    "ph": "i",
                    "s": "t",
                    "pid": 1,
                    "tid": tid,
                    "ts": ts,
                    "cat": cat,
                    "name": name,
                    "args": args,
                }
            )
            self.counts["instants"] += 1
        for i, pos in self.marked.get(e["seq"], ()):
            self._mark(i, pos, tid, ts, name)
            self.vseen[i].append((e["t_ns"], name))

    def _mark(self, i: int, pos: int, tid: int, ts: int, name: str) -> None:
        """The marker of violation i on one of its events, linked to its other markers by arrows."""
        rule_id, _, message, seqs = self.vlist[i]
        n = len(set(seqs))
        mark = {
            "ph": "X",
            "pid": 1,
            "tid": tid,
            "ts": ts,
            "dur": 0,
            "cat": "violation",
            "name": f"VIOLATION {rule_id}",
            "args": {"rule": rule_id, "message": message, "event": name},
        }
        if n > 1:
            mark["bind_id"] = _flow_id(_FLOW_VIOLATION, i)
            mark.update(_flow_flags(pos, n))
        self.w.write(mark)

    def violation_track(self) -> None:
        """A span per violation on the "pdo check" track, from its first marked event to its
        last."""
        for i, (rule_id, statement, message, seqs) in enumerate(self.vlist):
            seen = self.vseen[i]
            if not seen:
                continue
            ts, te = self.w.us(min(t for t, _ in seen)), self.w.us(max(t for t, _ in seen))
            self.w.write(
                {
                    "ph": "X",
                    "pid": 1,
                    "tid": self.check_tid,
                    "ts": ts,
                    "dur": te - ts,
                    "cat": "violation",
                    "name": rule_id,
                    "args": {
                        "statement": statement,
                        "message": message,
                        "seqs": list(seqs),
                        "events": [n for _, n in seen],
                    },
                }
            )
            self.w.write(
                {
                    "ph": "i",
                    "s": "g",
                    "pid": 1,
                    "tid": self.check_tid,
                    "ts": ts,
                    "cat": "violation",
                    "name": f"VIOLATION {rule_id}: {message}",
                }
            )


def export(path: str, out: str, *, violations=None) -> dict:
    """Write `path` as Chrome trace-event JSON to `out`. `violations`: [(rule_id, statement,
    message, seqs)] to highlight. Two streaming passes over the trace (the first finds t0 and the
    threads); returns counts of what was written."""
    header, t0, threads = _scan(path)
    role = header.get("role", "prefill")
    tids = {name: i + 1 for i, name in enumerate(sorted(threads, key=_tid_sort))}
    vlist = list(violations or [])
    counts = {"spans": 0, "instants": 0, "flows": 0, "violations": len(vlist), "threads": len(tids)}
    with open(out, "w") as f:
        other = {
            k: header.get(k)
            for k in ("role", "mode", "model", "page_size", "seed", "host", "inject")
            if k in header
        }
        f.write(
            '{"displayTimeUnit":"ms","otherData":'
            + json.dumps({"source": path, **other})
            + ',"traceEvents":[\n'
        )
        exporter = _Exporter(_Writer(f, t0), role, tids, vlist, counts)
        exporter.metadata(header)
        timeline = Timeline(role, exporter.on_span, exporter.on_event)
        for _, e in iter_events(path):
            timeline.feed(e)
        timeline.finish()
        exporter.violation_track()
        f.write("\n]}\n")
    return counts


def violations_of(result) -> list[tuple]:
    """checker.linear.Result → the list `export(violations=...)` takes."""
    return [(v.rule.id, v.rule.statement, v.message, list(v.seqs)) for v in result.violations]
