"""Traces as universes and as models: the encoding of one concrete trace (TraceUniverse, read by the
z3 trace checker, checker/z3check.py), the workload of a prefill trace, and whether a trace is a
schedule of the loop model.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import z3

from .logic import conj
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

    def add_remote(self, header: dict, events) -> None:
        """The admit and send events of the prefill trace of DP rank header["dp_rank"], as facts for
        the cross rules (never in `events`: their seqs are another file's)."""
        rank = header["dp_rank"]
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
