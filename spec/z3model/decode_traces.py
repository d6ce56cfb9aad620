"""Whether a decode trace is a schedule of the decode loop model (spec/z3model/decode_loops.py):
the workload the trace implies, the model key of each event the model describes, and z3 asked to
place the model's events in the trace's order, on its threads.

The model describes the prealloc queue: iteration tops, the prefetch (submit, the pool thread's
query_begin, cancels), the consumption point (prefill_info, synchronous query_begin, resolve),
intake (req_add), receiver init and memory release / resume. Not described, so left out of the
binding (DROPPED): prefetch_skip and query_end (what the prefetch did not do, what a query
answered), the KV and the request's end (kv_recv, kv_done, req_done: the model puts them in the
iteration of receiver init), slots (alloc, release), the decode batches (admit, stage, fwd_begin,
fwd_end, war_barrier, sample, process_begin, process_end), a request aborted after its receiver
init (the transfer and running queues are not modelled), the futures cancelled at shutdown, after
the loop's last iteration, and the attempts to fetch the parallel info before it was published (the
model's prefill publishes it at the iteration of the first published prefill_info).

A cancel's `stopped` (Future.cancel()'s result) is bound to the trace's value: after a cancel that
stopped its query, the query's query_begin is a drift (E:pool); after one that did not, it may come
(the pool thread had taken the call before the cancel); a trace without the field leaves it free.

Against a trace the universe holds exactly the queries the trace logged (each synchronous one
told apart by its iteration, since a partial answer leaves rooms to ask again), the server may
leave out of an answer the rooms it does not know yet, and whatever the loop would log outside
that universe is asserted away (E:emits): the trace lacks it. A trace whose run did what the model
leaves out is not judged (`outside_model` says which): bootstrap errors, a pending request
aborted for another reason than its client going away (timeouts), memory waits with several
addresses, memory released more than once, events on other threads, more iterations x rooms than
MAX_SIZE. When receiver inits waited for memory (header memory_waits), whether a request fits is
the environment's choice, and one that does not stops the pass (FIFO).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import z3

from .decode_workload import DecodeWorkload
from .logic import as_z3, conj
from .solver import Model
from .traces import Refinement, after_cut, explain
from .universe import FWD, SCHED

DROPPED = frozenset(
    {
        "prefetch_skip",
        "query_end",
        "kv_recv",
        "kv_done",
        "req_done",
        "alloc",
        "release",
        "admit",
        "stage",
        "fwd_begin",
        "fwd_end",
        "war_barrier",
        "sample",
        "process_begin",
        "process_end",
    }
)
# model events a trace's events are not bound to (the model's request life after receiver init)
UNBOUND = frozenset({"kv_recv", "kv_done", "req_done"})
TRACE_GROUPS = {
    "E:emits": "the loop logs nothing the trace lacks: no query, cancel or resolve outside the "
    "trace's, each event once"
}
CLIENT_ABORT = "client went away"  # the reason of the aborts the model describes
# iterations x rooms past which z3 is not asked (the state machine grows with both)
MAX_SIZE = 10_000


@dataclass(frozen=True)
class TraceWorkload(DecodeWorkload):
    """The workload of one decode trace: its addresses and rooms (in arrival order), and per
    address the room sets it queried, its prefetched queries (iteration, rooms), its synchronous
    ones (("sync", iteration), rooms) and whether its prefill has one DP rank."""

    sets: tuple = ()
    submits: tuple = ()
    syncs: tuple = ()
    singles: tuple = ()
    arrivals: tuple = ()  # (room, iteration of its req_add)
    release: tuple = ()  # (iteration of release_memory, of resume_memory or iterations + 2)
    polling_interval: int = 1
    info_from: tuple = ()  # per address: the iteration of its published prefill_info
    aborted: tuple = ()  # (room, iteration) of each client abort of a pending request
    prefetching: bool = True
    complete: bool = True  # False for a truncated trace: what its run did after the cut is free
    memory_bound: bool = False  # the run's receiver inits waited for memory: whether one fits is
    # the environment's choice
    exact = True
    partial = True

    def room_sets(self, a):
        return list(self.sets[a])

    def submit_sets(self, a):
        return list(dict.fromkeys(asked for _, asked in self.submits[a]))

    def prefetch_keys(self, a):
        return list(self.submits[a])

    def sync_tag(self, i):
        return ("sync", i)

    def sync_keys(self, a):
        return list(self.syncs[a])

    def single_rank(self, a):
        return self.singles[a]

    def environment(self):
        never = self.iterations + 1
        return {
            "arrives": {r: dict(self.arrivals).get(r, never) for _, rs in self.rooms for r in rs},
            "aborts": {r: dict(self.aborted).get(r, never) for _, rs in self.rooms for r in rs},
            "polls": lambda i: i % self.polling_interval == 0,
            "release_at": self.release[0] if self.release else never,
            "resume_at": self.release[1] if self.release else never + 1,
        }

    def info_available(self, a, i):
        return i >= self.info_from[a]

    def abort_place(self, index, room=None):
        # a client abort: the after_prefetch hook, before intake and before a release's cancels;
        # several in one iteration in the order the trace logged them (the clients' order)
        order = [r for r, _ in self.aborted]
        k = order.index(room) if room in order else index
        return 4.5 + k * 0.4 / (self._rooms() + 1)

    def _rooms(self):
        return sum(len(rs) for _, rs in self.rooms)

    def room_step(self):
        return 4 / (self._rooms() + 1)  # intake within 10..14, aborts within 15..19

    def init_order(self, arrives, index):
        n = self._rooms() + 1  # within 50..69: arrival iteration, then arrival order
        return (arrives * n + index) * 19 / ((self.iterations + 2) * n)


def _seq(e: dict) -> int:
    return e.get("trace_seq", e["seq"])


def outside_model(header: dict, events: list[dict]) -> str | None:
    """Why the decode model cannot judge this trace, or None."""
    inits, releases = set(), 0
    for e in events:
        ev = e["ev"]
        if ev in ("resolve", "query_end") and e.get("error") is not None:
            return f"seq {_seq(e)} {ev}: bootstrap errors and retries are not modelled"
        if ev == "receiver_init":
            inits.add(e["room"])
        if ev == "req_abort" and e["room"] not in inits and e.get("reason") != CLIENT_ABORT:
            return (
                f"seq {_seq(e)} req_abort of a pending request ({e.get('reason')}): the model "
                "aborts pending requests only as a client does, after the prefetch"
            )
        if ev in ("release_memory", "resume_memory"):
            releases += ev == "release_memory"
            if releases > 1:
                return "memory released more than once: the model releases once"
        bound = ev not in DROPPED and e.get("reason") != "shutdown"  # (close() cancels on main)
        if bound and e["thread"] != "scheduler" and not e["thread"].startswith("prefetch"):
            return f"seq {_seq(e)} on thread {e['thread']}: not a thread of the model"
    if header.get("memory_waits") is None:
        return (
            "the trace does not say whether receiver init waited for memory (memory_waits, in "
            "the header or in trace_end)"
        )
    addrs = {e["addr"] for e in events if e["ev"] == "req_add"}
    if header["memory_waits"] and len(addrs) > 1:
        return "receiver init waited for memory with several addresses: FIFO across them"
    return None


def _keys(events: list[dict]):
    """(TraceWorkload fields, the model key of each event, None for one the model does not
    describe)."""
    addrs, rooms, infos = {}, {}, {}
    sets, submits, syncs = {}, {}, {}
    by_qid, inits, keys, it = {}, set(), [], 0
    arrivals, release, info_from, aborted = [], [], {}, []
    for e in events:
        ev = e["ev"]
        a = addrs.setdefault(e["addr"], len(addrs)) if "addr" in e else None
        if a is not None:
            sets.setdefault(a, {})
        rs = tuple(e["rooms"]) if "rooms" in e else None
        if rs is not None:
            sets[a][rs] = None
        key = None
        if ev in ("iter_begin", "prefetch_begin", "prefetch_end"):
            it = e["iter"] if ev == "iter_begin" else it
            key = (ev, e["iter"])
        elif ev == "req_add":
            rooms.setdefault(a, []).append(e["room"])
            arrivals.append((e["room"], it))
            key = (ev, e["room"])
        elif ev == "prefill_info" and e.get("published"):
            infos[a] = e.get("dp_size")
            info_from.setdefault(a, it)
            key = (ev, a)
        elif ev == "prefetch_submit":
            by_qid[e["qid"]] = (a, it, rs)
            submits.setdefault(a, []).append((it, rs))
            key = (ev, a, it, rs)
        elif ev == "prefetch_cancel":
            key = None if e["reason"] == "shutdown" else (ev, *by_qid[e["qid"]])
        elif ev == "query_begin" and e["source"] == "prefetch":
            key = (ev, *by_qid[e["qid"]])
        elif ev == "query_begin":
            syncs.setdefault(a, {})[(("sync", it), rs)] = None
            key = (ev, a, ("sync", it), rs)
        elif ev == "resolve" and e["source"] == "sync":
            key = (ev, a, ("sync", it), rs)
        elif ev == "resolve":
            _, j, asked = by_qid[e["qid"]]
            key = (ev, a, j, asked) if e["source"] == "prefetched" else (ev, a, j, asked, rs)
        elif ev == "receiver_init":
            inits.add(e["room"])
            key = (ev, e["room"])
        elif ev == "req_abort" and e["room"] not in inits:
            aborted.append((e["room"], it))
            key = (ev, e["room"])
        elif ev in ("release_memory", "resume_memory"):
            release.append(it)
            key = (ev,)
        keys.append(None if ev in DROPPED else key)
    order = sorted(addrs, key=addrs.get)
    n = len(order)
    fields = dict(
        iterations=it,
        rooms=tuple((addr, tuple(rooms.get(a, ()))) for a, addr in enumerate(order)),
        sets=tuple(tuple(sets.get(a, {})) for a in range(n)),
        submits=tuple(tuple(submits.get(a, ())) for a in range(n)),
        syncs=tuple(tuple(syncs.get(a, {})) for a in range(n)),
        singles=tuple(infos.get(a) == 1 for a in range(n)),
        arrivals=tuple(arrivals),
        aborted=tuple(aborted),
        info_from=tuple(info_from.get(a, it + 1) for a in range(n)),
        release=tuple(release + [it + 2] * (len(release) == 1)),
    )
    return fields, keys


def decode_refinement(
    header: dict, events: list[dict], timeout_ms: int = 60000, *, prefix: bool = False
) -> Refinement:
    """Is the decode trace (events numbered 1.. in `seq`, their own number in `trace_seq`) a
    schedule of the decode loop model? Each bound event's existence, thread and place after the
    previous bound event sit behind its own literal, as for prefill (traces.refinement). `prefix`:
    the trace is truncated, so it must be a prefix of a schedule: a model event it lacks may come
    after its last bound event."""
    t0 = time.perf_counter()
    why = outside_model(header, events)
    if why:
        return Refinement("unknown", 0.0, reason=why)
    fields, keys = _keys(events)
    fields["polling_interval"] = header.get("polling_interval", 1)
    fields["prefetching"] = header.get("prefetch", True)
    fields["memory_bound"] = bool(header["memory_waits"])
    fields["complete"] = not prefix
    if not fields["iterations"]:
        return Refinement("unknown", 0.0, reason="no loop iteration in the trace")
    size = fields["iterations"] * max(1, sum(len(rs) for _, rs in fields["rooms"]))
    if size > MAX_SIZE:
        return Refinement(
            "unknown", 0.0, reason=f"iterations x rooms = {size} > {MAX_SIZE}: too large for z3"
        )
    bound = [(i, k) for i, k in enumerate(keys, 1) if k is not None]
    seen = {}
    for i, k in bound:
        if k in seen:
            why = f"two trace events map to one model event {k}"
            return Refinement(
                "unsat", time.perf_counter() - t0, ["E:emits"], [seen[k], i], reason=why
            )
        seen[k] = i
    model = Model(
        header.get("mode", "normal"),
        role="decode",
        workload=TraceWorkload(**fields),
        page_size=header.get("page_size", 16),
        timeout_ms=timeout_ms,
        rules=(),  # refinement assumes the engine groups only
    )
    by_key = {e.key: e for e in model.universe.events}
    stray = [i for i, k in bound if k not in by_key]
    if stray:
        first = events[stray[0] - 1]
        why = f"{first['ev']} has no place in the decode loop model"
        return Refinement("unsat", time.perf_counter() - t0, ["E:emits"], stray[:1], reason=why)
    lits, prev = {}, None
    for i, k in bound:
        e = by_key[k]
        thread = SCHED if events[i - 1]["thread"] == "scheduler" else FWD
        bind = [e.exists, e.thread == thread] + ([prev.pos < e.pos] if prev is not None else [])
        stopped = events[i - 1].get("stopped") if e.name == "prefetch_cancel" else None
        if isinstance(stopped, bool):  # absent (a trace from before the field): either may be
            bind.append(e.f["stopped"] == stopped)
        lit = z3.Bool(f"[seq {i}]")
        model.solver.add(z3.Implies(lit, as_z3(conj(*bind))))
        lits[lit], prev = i, e
    for e in model.universe.events:
        if e.key not in seen and e.name not in UNBOUND:
            lit = z3.Bool(f"[absent {e.key}]")
            last = prev.pos if prev is not None else None
            gone = after_cut(e, last) if prefix else z3.Not(as_z3(e.exists))
            model.solver.add(z3.Implies(lit, as_z3(gone)))
            lits[lit] = e.key
    return explain(model, lits, t0)
