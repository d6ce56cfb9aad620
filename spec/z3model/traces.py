"""Traces as universes and as models: the encoding of one concrete trace (TraceUniverse, read by the
z3 trace checker, checker/z3check.py), the workload of a prefill trace, and whether a trace is a
schedule of the loop model.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from dataclasses import dataclass, field

import z3

from .logic import as_z3, conj
from .prefill_universe import Chunk, Workload
from .solver import Answer, Model
from .universe import THREAD_IDS, Ev, Universe


class TraceUniverse(Universe):
    """The events of one trace; `pos` is a z3 Int per event, tied to its seq by a tracked fact."""

    ordered = True

    def __init__(self, header: dict, events: list[dict]):
        super().__init__()
        self.header = header
        self.page_size = header.get("page_size", 1)
        for e in events:
            f = {k: v for k, v in e.items() if k not in ("seq", "t_ns", "thread", "ev")}
            b = e.get("batch") if e["ev"] != "prefix_send" else None
            ev = Ev(
                e["ev"],
                b,
                ("#", e["seq"]),
                z3.Int(f"p{e['seq']}"),
                e["thread"],
                True,
                f,
                seq=e["seq"],
            )
            if e["ev"] == "prefix_send":
                ev.f["batch"] = e.get("batch")
            self.add(ev)
        self._threads = defaultdict(list)
        for ev in self.events:
            self._threads[ev.thread].append(ev)
        self._thread_seqs = {t: [e.seq for e in lst] for t, lst in self._threads.items()}
        self._seq_cache = {}

    def tid(self, name):
        return name

    def add_remote(self, header: dict, events, *, stopped: bool = False) -> None:
        """The admit and send events of the prefill trace of DP rank header["dp_rank"], as facts for
        the cross rules (never in `events`: their seqs are another file's). `stopped`: its
        trace_end says the rank was stopped before its run's end (checker.cross_templates)."""
        rank = header["dp_rank"]
        self.dp_stopped = self.dp_stopped or stopped
        self.dp_ranks = frozenset(self.dp_ranks | {rank})
        self._dp_size = header.get("dp_size", getattr(self, "_dp_size", None))
        self.dp_complete = self._dp_size is not None and self.dp_ranks >= set(range(self._dp_size))
        if not hasattr(self, "_remote"):
            self._remote = defaultdict(list)
        for e in events:
            if e["ev"] in ("admit", "kv_send", "prefix_send"):
                f = {k: v for k, v in e.items() if k not in ("seq", "t_ns", "thread", "ev")}
                f["dp_rank"] = rank
                self._remote[e["ev"]].append(
                    Ev(e["ev"], None, ("remote", rank, e["seq"]), None, e["thread"], True, f)
                )

    def _seqs(self, evs):
        """Seqs of a seq-sorted list (every list the encodings pass is in trace order)."""
        got = self._seq_cache.get(id(evs))
        if got is None or got[0] is not evs or len(got[1]) != len(evs):
            got = self._seq_cache[id(evs)] = (evs, [e.seq for e in evs])
        return got[1]

    def succ_pairs(self, evs):
        evs = sorted(evs, key=lambda e: e.seq)
        return list(zip(evs, evs[1:]))

    def first_after(self, y, evs):
        i = bisect.bisect_right(self._seqs(evs), y.seq)
        return [evs[i]] if i < len(evs) else []

    def last_before(self, x, evs):
        i = bisect.bisect_left(self._seqs(evs), x.seq)
        return [evs[i - 1]] if i > 0 else []

    def on_thread_between(self, thread, lo, hi):
        lst, seqs = self._threads.get(thread, []), self._thread_seqs.get(thread, [])
        i = bisect.bisect_right(seqs, lo.seq)
        j = bisect.bisect_left(seqs, hi.seq) if hi is not None else len(lst)
        return lst[i:j]

    def on_thread(self, thread):
        return self._threads.get(thread, [])


def workload_of(events: list[dict]) -> Workload:
    """The batches of a prefill trace: rids from each admit, middle chunks from the chunk_inc events
    right after it on the scheduler, prefix chunks from prefix_send."""
    rids, middle, prefix, cur = {}, set(), set(), None
    for e in events:
        if e["ev"] == "admit":
            cur = e["batch"]
            rids[cur] = list(e["rids"])
        elif e["ev"] == "chunk_inc" and cur is not None:
            middle.add((e["rid"], cur))
        elif e["ev"] == "prefix_send":
            prefix.add((e["rid"], e["batch"]))
        elif e["thread"] == "scheduler" and e["ev"] != "chunk_inc":
            cur = None
    return Workload(
        tuple(
            tuple(Chunk(r, (r, b) in middle, (r, b) in prefix) for r in rids[b])
            for b in range(len(rids))
        )
    )


def _trace_keys(events: list[dict]) -> list:
    """The model key of each trace event (kv_send and chunk_dec by the processing span they are
    in)."""
    keys, inc_batch, span = [], None, None
    for e in events:
        ev = e["ev"]
        if ev == "admit":
            inc_batch = e["batch"]  # its chunk_inc events follow it directly on the scheduler
        elif e["thread"] == "scheduler" and ev != "chunk_inc":
            inc_batch = None
        if ev == "process_begin":
            span = e["batch"]
        if "rid" not in e:
            keys.append((ev, e["batch"]))
        elif ev in ("alloc", "release"):
            keys.append((ev, e["rid"]))
        elif ev == "prefix_send":
            keys.append((ev, e["rid"], e["batch"]))
        elif ev == "chunk_inc":
            keys.append((ev, e["rid"], inc_batch))
        else:
            keys.append((ev, e["rid"], span))
        if ev == "process_end":
            span = None
    return keys


def fits_engine(mode: str, header: dict, events: list[dict], timeout_ms: int = 60000) -> Answer:
    """Is the trace a schedule of the loop model of `mode`? Positions, threads and which events
    exist are bound to the trace; z3 looks for the hidden points (queues, device, iteration
    ends)."""
    model = Model(
        mode,
        workload=workload_of(events),
        page_size=header.get("page_size", 16),
        timeout_ms=timeout_ms,
    )
    by_key = {k: i for i, k in enumerate(_trace_keys(events), 1)}
    bind = []
    for e in model.universe.events:
        seq = by_key.get(e.key)
        bind.append(e.exists == (seq is not None) if e.exists is not True else (seq is not None))
        if seq is not None:
            tid = THREAD_IDS[events[seq - 1]["thread"]]
            bind += [e.pos == seq * 1000, e.thread == tid]
    if len(by_key) != len(events):
        return Answer("unsat", 0.0, reason="two trace events map to one model event")
    return model.check(model.engine_ids, conj(*bind))


def _needed_groups(model, bindings) -> list[str]:
    """The engine groups the conflict needs, by deletion in the model's fixed group order over the
    whole trace: each answer is the solver's verdict, not its choice of core, so the groups a drift
    is reported with are the same in every process (an unsat core depends on what else the z3
    context has seen)."""
    names = list(model.engine_ids)
    for name in list(names):
        trial = [model.lit[n] for n in names if n != name]
        if model.solver.check(*trial, *bindings) == z3.unsat:
            names.remove(name)
    return names


MAX_SHRINK = 60  # event bindings in an unsat core small enough to shrink one by one
SHRINK_BUDGET_S = 3.0  # the whole deletion pass; what is left unshrunk is still a conflict
SHRINK_QUERY_MS = 500  # one deletion query (an unknown keeps the binding)


@dataclass
class Refinement:
    """Whether a trace is a schedule of the loop model, and when not, what breaks: the engine
    groups (E:...) and the trace events whose places the model cannot give them together."""

    status: str  # "sat" (the model admits the trace) | "unsat" | "unknown"
    seconds: float
    groups: list = field(default_factory=list)
    seqs: list = field(default_factory=list)
    missing: list = field(default_factory=list)  # model events the trace lacks, by model key
    reason: str = ""


def after_cut(e, after) -> object:
    """What a truncated trace says of a model event it lacks: it does not happen, or it happens
    after the trace's last event (`after`: that event's position, or None before the first)."""
    if after is None:
        return True
    gone = z3.Not(as_z3(e.exists)) if e.exists is not True else False
    return z3.Or(gone, e.pos > after)


def refinement(
    mode: str, header: dict, events: list[dict], timeout_ms: int = 60000, *, prefix: bool = False
) -> Refinement:
    """fits_engine with each trace event's binding behind its own literal, so that an unsat core
    names the events (and engine groups) that the loop model cannot reconcile; the core's events
    are then shrunk by deletion while the budget lasts. `prefix`: the trace is truncated (its run
    did not reach its end), so it must be a prefix of a schedule: a model event it lacks may come
    after its last event."""
    t0 = time.perf_counter()
    if not any(e["ev"] == "admit" for e in events):
        # a rank that admitted nothing (no requests routed to it, or a run cut short): the loop
        # model has no batch to place its events in
        status = "sat" if not events else "unknown"
        return Refinement(
            status, 0.0, reason="no admitted batch: nothing for the loop model to place"
        )
    model = Model(
        mode,
        workload=workload_of(events),
        page_size=header.get("page_size", 16),
        timeout_ms=timeout_ms,
    )
    keys = _trace_keys(events)
    by_key = {k: i for i, k in enumerate(keys, 1)}
    if len(by_key) != len(events):
        dup = next(k for k in keys if keys.count(k) > 1)
        return Refinement("unsat", 0.0, reason=f"two trace events map to one model event {dup}")
    known = {e.key for e in model.universe.events}
    stray = [i for i, k in enumerate(keys, 1) if k not in known]
    if stray:
        first = events[stray[0] - 1]
        why = f"{first['ev']} has no place in the loop model of {mode}"
        return Refinement("unsat", time.perf_counter() - t0, ["E:emits"], stray[:1], reason=why)
    other = next((e for e in events if e["thread"] not in THREAD_IDS), None)
    if other is not None:  # as the decode side (decode_traces.outside_model): not judged
        where = (
            f"seq {other.get('trace_seq', other['seq'])} {other['ev']} on thread {other['thread']}"
        )
        return Refinement("unknown", 0.0, reason=f"{where}: not a thread of the loop model")
    lits = {}
    for e in model.universe.events:
        seq = by_key.get(e.key)
        present = seq is not None
        bind = [e.exists == present if e.exists is not True else present]
        if prefix and not present:
            bind = [after_cut(e, len(events) * 1000)]
        if present:
            bind += [e.pos == seq * 1000, e.thread == THREAD_IDS[events[seq - 1]["thread"]]]
        lit = z3.Bool(f"[seq {seq}]" if present else f"[absent {e.key}]")
        model.solver.add(z3.Implies(lit, as_z3(conj(*bind))))
        lits[lit] = seq if present else e.key
    return explain(model, lits, t0)


def explain(model, lits: dict, t0: float) -> Refinement:
    """The verdict on a model whose trace bindings sit behind `lits` (literal -> the trace seq it
    binds, or the key of a model event it binds absent): sat, or the engine groups and the trace
    events of the conflict, shrunk by deletion while the budget lasts."""
    engine = [model.lit[n] for n in model.engine_ids]
    result = model.solver.check(*engine, *lits)
    if result == z3.sat:
        return Refinement("sat", time.perf_counter() - t0)
    if result != z3.unsat:
        return Refinement("unknown", time.perf_counter() - t0, reason=model.solver.reason_unknown())
    # every group that deletion keeps is in every core of what is left (without it, the rest is
    # sat): the core only narrows the trace bindings
    groups = _needed_groups(model, list(lits))
    engine = [model.lit[n] for n in groups]
    if model.solver.check(*engine, *lits) != z3.unsat:
        return Refinement("unknown", time.perf_counter() - t0, reason="the conflict did not recur")
    core = {str(c) for c in model.solver.unsat_core()}
    kept = [lit for lit in lits if str(lit) in core]
    if len(kept) <= MAX_SHRINK:  # deletion: drop each binding the conflict does not need
        deadline = time.perf_counter() + SHRINK_BUDGET_S
        model.solver.set(timeout=SHRINK_QUERY_MS)
        for lit in list(kept):
            if time.perf_counter() > deadline:
                break
            trial = [x for x in kept if x is not lit]
            if model.solver.check(*engine, *trial) == z3.unsat:
                kept = trial
    seqs = sorted(lits[lit] for lit in kept if isinstance(lits[lit], int))
    missing = [lits[lit] for lit in kept if not isinstance(lits[lit], int)]
    return Refinement("unsat", time.perf_counter() - t0, groups, seqs, missing)
