"""The decode side of the model: the events of a few iterations of the decode prefetch, and the loop
code that emits them (the decode engine model).

A workload of two bootstrap addresses (rooms 1, 2, 3 at the first, room 4 at the second) over
`iterations` iterations of the decode loop. The universe holds every event the prefetch and its
consumption can log: per address, iteration (from FIRST_SUBMIT) and room set a prefetched query
(submit, its pool thread's query_begin, a cancel, a resolve that uses it as is or as the prefix of a
larger set); per address and room set a synchronous one (query_begin and resolve on the scheduler:
a set is resolved at most once, its rooms are known after); per room its request's life (added,
receiver init, KV, done, or aborted); one release and one resume of memory.

The loop model (decode_engine) is engine/decode/loops.py's `_loop_top` with
engine/decode/prealloc.py's prefetch and consumption, as a state machine unrolled over the
iterations: the environment chooses when each room arrives, when a still-pending request is aborted
(its client goes away), which iterations poll the prealloc queue (SGLang's polling interval: a
prefetch may be consumed iterations later), and when memory is released and resumed (after the
prefetch, as the after_prefetch hook of tests/engine/runs/test_pd_faults.py); everything else follows from the
code. Scheduler events sit at fixed positions of their iteration (100 i + the step's offset); the
pool thread's query_begin floats after its submit and before the answer is used; a cancel that stopped
the query (Future.cancel() returned True, the cancel's `stopped`) means it never begins, one that
did not (the pool thread had already taken the call) leaves it free to begin after the cancel. The bootstrap server answers room r with rank r % 2, without errors. What the loop
could do that the universe has no events for (or an event it would log twice) is collected in
`universe.outside` and shown unreachable by `pdo spec prove` (outside_universe).
"""

from __future__ import annotations

from collections import defaultdict

import z3

from .. import LOOP_MODES, load_events
from ..vocabulary import PREFETCH, SCHEDULER
from .decode_workload import DECODE_MODEL_MUTANTS, FIRST_SUBMIT, DecodeWorkload  # noqa: F401  (re-exported)
from .logic import as_z3, conj, disj, implies, lt, neg
from .universe import FWD, SCHED, SymbolicUniverse

DECODE_MODES = LOOP_MODES["decode"]
DECODE_THREADS = {SCHEDULER: SCHED, f"{PREFETCH}_0": FWD}


def _prefix_of(p, n):
    return len(p) < len(n) and n[: len(p)] == p


class DecodeUniverse(SymbolicUniverse):
    def __init__(self, workload: DecodeWorkload, page_size: int = 16):
        super().__init__(page_size)
        self.workload, self.K = workload, workload.iterations
        self.header = {"role": "decode", "prefetch": True}
        self._vocab = load_events()["decode"]
        for i in range(1, self.K + 1):
            for name in ("iter_begin", "prefetch_begin", "prefetch_end"):
                self._add(name, (name, i), iter=i)
        qids = iter(range(10_000))
        for a, (addr, rooms) in enumerate(workload.rooms):
            self._add("prefill_info", ("prefill_info", a), addr=addr, published=True, error=None)
            self._add_prefetched(a, addr, qids)
            self._add_sync(a, addr, qids)
            self._add_requests(addr, rooms)
        self._add("release_memory", ("release_memory",))
        self._add("resume_memory", ("resume_memory",))

    def _add(self, name, key, **f):
        self._make(name, None, key, f, self._vocab)

    def _add_prefetched(self, a, addr, qids):
        """Per iteration (from FIRST_SUBMIT) and room set a prefetch can ask for: the submit, its
        pool thread's query_begin, a cancel, a resolve using it as is or as the prefix of a larger
        set."""
        for j, asked in self.workload.prefetch_keys(a):
            q = next(qids)
            ask = dict(addr=addr, rooms=list(asked))
            self._add("prefetch_submit", ("prefetch_submit", a, j, asked), qid=q, **ask)
            self._add("query_begin", ("query_begin", a, j, asked), qid=q, source="prefetch", **ask)
            # `stopped`: Future.cancel()'s result (free here, the trace's value against a trace)
            stopped = z3.Bool(f"stopped:{a}:{j}:{asked}")
            self._add(
                "prefetch_cancel",
                ("prefetch_cancel", a, j, asked),
                qid=q,
                reason="any",
                stopped=stopped,
                **ask,
            )
            self._add(
                "resolve",
                ("resolve", a, j, asked),
                qid=q,
                source="prefetched",
                error=None,
                result={str(r): z3.Int(f"answer:{a}:{j}:{asked}:{r}") for r in asked},
                **ask,
            )
            for room_set in self.workload.room_sets(a):
                if _prefix_of(asked, room_set):
                    answers = {str(r): z3.Int(f"answer:{a}:{j}:{asked}+:{r}") for r in room_set}
                    self._add(
                        "resolve",
                        ("resolve", a, j, asked, room_set),
                        qid=q,
                        source="prefix",
                        error=None,
                        addr=addr,
                        rooms=list(room_set),
                        result=answers,
                    )

    def _add_sync(self, a, addr, qids):
        """Per room set a synchronous query: resolved once, its rooms are known after."""
        for tag, room_set in self.workload.sync_keys(a):
            ask = dict(addr=addr, rooms=list(room_set))
            self._add(
                "query_begin",
                ("query_begin", a, tag, room_set),
                qid=next(qids),
                source="sync",
                **ask,
            )
            self._add(
                "resolve",
                ("resolve", a, tag, room_set),
                qid=None,
                source="sync",
                error=None,
                result={str(r): z3.Int(f"answer:{a}:{tag}:{room_set}:{r}") for r in room_set},
                **ask,
            )

    def _add_requests(self, addr, rooms):
        """Per room its request's life: added, receiver init, KV, done, or aborted."""
        for r in rooms:
            rid = f"r{r}"
            self._add("req_add", ("req_add", r), rid=rid, room=r, addr=addr)
            self._add("receiver_init", ("receiver_init", r), room=r, rid=rid)
            self._add("kv_recv", ("kv_recv", r), room=r)
            self._add("kv_done", ("kv_done", r), room=r, rid=rid)
            self._add("req_done", ("req_done", r), rid=rid, room=r)
            self._add("req_abort", ("req_abort", r), rid=rid, room=r, reason="client went away")

    def tid(self, name):
        return DECODE_THREADS[name]


DECODE_ENGINE_GROUPS = {
    "E:loop": "the loop code: iteration top, prefetch (stale cancel, skip, submit), release hook, "
    "intake, aborts, consumption (prefetched, prefix + sync tail, cancel + sync, cancel "
    "when nothing is pending), receiver init in arrival order unless memory is released",
    "E:order": "where the loop logs each step: iteration i's steps at 100 i + the step's offset, "
    "in code order",
    "E:pool": "the pool thread: a query runs after its submit, before its answer is used; a "
    "cancel that stopped it (Future.cancel() returned True) means it never runs, one that did not "
    "(the pool had already taken it) lets it begin before or after the cancel",
    "E:server": "the bootstrap server answers room r with rank r % 2",
    "E:env": "arrivals in room order per address; a pending request may be aborted; every arrived "
    "request is served or aborted within the iterations",
}


def decode_engine(universe: DecodeUniverse) -> dict[str, list]:
    """The decode loop model as named groups of constraints (names start with "E:"); sets
    `universe.ends` (how a prefetched query ends: reason -> conditions) and `universe.outside`."""
    return _DecodeLoop(universe).groups_built()


class _DecodeLoop:
    """decode_engine's state machine: what holds at each iteration, as z3 terms defined one
    iteration after the other."""

    def __init__(self, universe: DecodeUniverse):
        self.universe, self.workload, self.K = universe, universe.workload, universe.K
        self.groups = defaultdict(list)
        self.loop = self.groups["E:loop"]
        universe.ends = defaultdict(list)
        universe.outside = []  # shown unreachable (outside_universe)
        self.rooms = self.workload.all_rooms()
        self.room_index = {r: n for n, (_, r) in enumerate(self.rooms)}
        K, rooms = self.K, self.rooms
        self.arrives = {r: z3.Int(f"arrives:r{r}") for _, r in rooms}  # K+1: never
        self.aborts = {r: z3.Int(f"aborts:r{r}") for _, r in rooms}  # if still pending
        self.polls = {i: z3.Bool(f"polls:{i}") for i in range(1, K + 1)}
        self.release_at, self.resume_at = z3.Int("release_at"), z3.Int("resume_at")
        fixed = self.workload.environment()
        if fixed:  # a trace's: the environment's choices are the trace's, folded at build time
            self.arrives, self.aborts = dict(fixed["arrives"]), dict(fixed["aborts"])
            self.polls = {i: fixed["polls"](i) for i in range(1, K + 1)}
            self.release_at, self.resume_at = fixed["release_at"], fixed["resume_at"]
        env = self.groups["E:env"]
        env += [
            z3.And(1 <= v, v <= K + 1)
            for v in list(self.arrives.values()) + list(self.aborts.values())
        ]
        rel, res = self.release_at, self.resume_at
        env += [1 <= rel, rel <= K + 1, rel < res, res <= K + 2]
        for _, rs in self.workload.rooms:
            env += [self.arrives[x] <= self.arrives[y] for x, y in zip(rs, rs[1:])]
        self.known = {(r, 0): False for _, r in rooms}
        self.gone = {(r, 0): False for _, r in rooms}  # initialised or aborted
        self.info = {(a, 0): False for a in range(len(self.workload.rooms))}
        self.out = {}  # (key, i): outstanding at the top of iteration i
        self.key_set = {a: set(self.keys(a)) for a in range(len(self.workload.rooms))}
        self.step = self.workload.room_step()
        self.causes = defaultdict(list)  # event key -> [(exists-in-this-iteration, position)]

    def define(self, name, expr):
        if self.workload.exact and isinstance(expr, bool):
            return expr
        v = z3.Bool(name)
        self.loop.append(v == as_z3(expr))
        return v

    def keys(self, a):
        """The prefetched queries of address a: (a, iteration, room set)."""
        return [(a, j, asked) for j, asked in self.workload.prefetch_keys(a)]

    def event(self, *key):
        return self.universe.get(key)

    def groups_built(self) -> dict[str, list]:
        outside, last = self.universe.outside, 0
        for i in range(1, self.K + 1):
            last = len(outside)
            self.iteration(i)
        if not self.workload.complete:  # a truncated trace: its last iteration, cut, may go on to
            del outside[last:]  # log what the trace lacks (judged on what it logged)
        K = self.K
        self.bind_events()
        self.pool_thread()
        self.payloads()
        # The environment: every request that arrives is served within the iterations.
        self.groups["E:env"] += [
            implies(self.arrives[r] <= K, self.gone[(r, K)])
            for _, r in self.rooms
            if self.workload.complete
        ]
        if self.workload.exact:
            self.groups["E:emits"] = [neg(x) for x in self.universe.outside]
        return dict(self.groups)

    def iteration(self, i):
        base = 100 * i
        on = self.workload.prefetching  # off: the loop never calls the prefetch
        for n, name in enumerate(("iter_begin", "prefetch_begin")):
            e = self.event(name, i)
            self.loop.append(e.exists if on or n == 0 else neg(e.exists))
            self.groups["E:order"].append(e.pos == base + n)
        self.loop.append(
            self.event("prefetch_end", i).exists
            if on
            else neg(self.event("prefetch_end", i).exists)
        )
        self.groups["E:order"].append(self.event("prefetch_end", i).pos == base + 4)
        rel, res, arrives, gone = self.release_at, self.resume_at, self.arrives, self.gone
        self.causes[("release_memory",)].append((rel == i, base + 6))
        self.causes[("resume_memory",)].append((res == i, base + 7))
        released_at_prefetch = conj(rel < i, i <= res)
        released_at_consume = conj(rel <= i, i < res)
        pending_at_prefetch = {
            r: conj(arrives[r] < i, neg(gone[(r, i - 1)])) for _, r in self.rooms
        }
        abort = {
            r: self.define(
                f"abort:r{r}:{i}", conj(self.aborts[r] == i, arrives[r] <= i, neg(gone[(r, i - 1)]))
            )
            for _, r in self.rooms
        }
        pending = {
            r: conj(arrives[r] <= i, neg(gone[(r, i - 1)]), neg(abort[r])) for _, r in self.rooms
        }
        live = {}
        for a, (_, rs) in enumerate(self.workload.rooms):
            self.prefetch(i, a, rs, pending_at_prefetch, released_at_prefetch, live)
        # intake; then a pending request may be aborted (its client went away)
        for _, r in self.rooms:
            self.causes[("req_add", r)].append(
                (arrives[r] == i, base + 10 + self.room_index[r] * self.step)
            )
            self.causes[("req_abort", r)].append(
                (abort[r], base + self.workload.abort_place(self.room_index[r], r))
            )
        # consumption point (when this iteration polls the prealloc queue, unless memory is
        # released: then nothing is resolved, not even synchronously, until resume)
        consumes = conj(self.polls[i], neg(released_at_consume))
        any_pending = disj(*[pending[r] for _, r in self.rooms])
        empty = conj(consumes, neg(any_pending))
        for a, (_, rs) in enumerate(self.workload.rooms):
            self.consume(i, a, rs, consumes, any_pending, empty, pending, live)
        self.receive(i, released_at_consume, pending, abort)

    def prefetch(self, i, a, rs, pending, released, live):
        """Address a's prefetch: cancel a stale query, then submit one query; the after_prefetch
        hook (release_memory) cancels every outstanding one."""
        base, ends, outside = 100 * i, self.universe.ends, self.universe.outside
        stale = neg(disj(*[pending[r] for r in rs]))
        after = {}
        for k in self.keys(a):
            if k[1] < i:
                outstanding = self.out[(k, i)]
                self.causes[("prefetch_cancel", *k)].append(
                    (conj(outstanding, stale), base + 2 + a / 10)
                )
                ends["cancelled as stale"].append(conj(outstanding, stale))
                after[k] = conj(outstanding, neg(stale))
        unknown = {r: conj(pending[r], neg(self.known[(r, i - 1)])) for r in rs}
        mutants = self.workload.mutants
        in_flight = disj(*after.values())
        can = conj(
            self.workload.prefetching,
            not self.workload.single_rank(a),
            neg(released),
            True if "double-prefetch" in mutants else neg(in_flight),
            self.info[(a, i - 1)],
            disj(*unknown.values()),
        )

        def asks_exactly(asked):
            return [unknown[r] if r in asked else neg(unknown[r]) for r in rs]

        outside.append(
            conj(can, *[neg(conj(*asks_exactly(asked))) for asked in self.workload.room_sets(a)])
        )
        for asked in self.workload.room_sets(a):
            sub = self.define(f"submit:{a}:{i}:{asked}", conj(can, *asks_exactly(asked)))
            if (a, i, asked) not in self.key_set[a]:
                outside.append(sub)  # not in the universe: the loop cannot (outside_universe)
                continue
            self.causes[("prefetch_submit", a, i, asked)].append((sub, base + 3 + a / 10))
            if "double-prefetch" in mutants:  # the new future replaces the old, never closed
                after = {k: conj(v, neg(sub)) for k, v in after.items()}
            after[(a, i, asked)] = sub
        rel = self.release_at
        kept = "no-cancel-on-release" in mutants  # the release hook leaves the futures running
        for k, outstanding in after.items():
            cancel = False if kept else conj(outstanding, rel == i)
            self.causes[("prefetch_cancel", *k)].append((cancel, base + 5 + a / 10))
            ends["cancelled at release_memory"].append(cancel)
            live[k] = self.define(f"live:{k}:{i}", conj(outstanding, neg(cancel)))

    def consume(self, i, a, rs, consumes, any_pending, empty, pending, live):
        """Address a at the consumption point: use a live prefetched answer as is or as the prefix
        of the rooms now needed (with a sync query for the tail), else cancel it and query
        synchronously; cancel it when nothing is pending."""
        base, ends, causes = 100 * i, self.universe.ends, self.causes
        for k in self.keys(a):
            if k in live:
                causes[("prefetch_cancel", *k)].append((conj(live[k], empty), base + 20 + a / 10))
                ends["cancelled with nothing pending"].append(conj(live[k], empty))
        act = self.define(
            f"act:{a}:{i}",
            conj(
                consumes,
                any_pending,
                disj(*[pending[r] for r in rs]),
                self.workload.info_available(a, i),
            ),
        )
        causes[("prefill_info", a)].append(
            (conj(act, neg(self.info[(a, i - 1)])), base + 30 + 10 * a)
        )
        self.info[(a, i)] = self.define(f"info:{a}:{i}", disj(self.info[(a, i - 1)], act))
        need = {r: conj(act, pending[r], neg(self.known[(r, i - 1)])) for r in rs}
        if self.workload.single_rank(a):  # rank 0 for every pending room, no query
            for r in rs:
                self.known[(r, i)] = self.define(
                    f"known:r{r}:{i}", disj(self.known[(r, i - 1)], need[r])
                )
            # a query submitted before the parallel info said one rank (the
            # prefetch-before-published mutant) is neither used nor cancelled here: it stays
            # outstanding, as in engine/decode/prealloc.py, until a cancel ends it
            for k in self.keys(a):
                if k in live:
                    self.out[(k, i + 1)] = self.define(
                        f"out:{k}:{i + 1}", conj(live[k], neg(empty))
                    )
            return
        tag = self.workload.sync_tag(i)
        has = disj(*need.values())
        asks_for = {
            room_set: conj(has, *[need[r] if r in room_set else neg(need[r]) for r in rs])
            for room_set in self.workload.room_sets(a)
        }
        self.universe.outside.append(conj(has, *[neg(x) for x in asks_for.values()]))
        usable = []
        for k in self.keys(a):
            if k not in live:
                continue
            asked = k[2]
            pre = conj(live[k], asks_for[asked])
            causes[("resolve", *k)].append((pre, base + 33 + 10 * a))
            ends["used as is"].append(pre)
            usable.append(pre)
            extended = False
            for room_set in self.workload.room_sets(a):
                if _prefix_of(asked, room_set):
                    use = conj(live[k], asks_for[room_set])
                    causes[("resolve", *k, room_set)].append((use, base + 33 + 10 * a))
                    ends["used as a prefix with a sync tail"].append(use)
                    tail = room_set[len(asked) :]
                    causes[("query_begin", a, tag, tail)].append((use, base + 32 + 10 * a))
                    usable.append(use)
                    extended = disj(extended, asks_for[room_set])
            mismatch = conj(live[k], has, neg(asks_for[asked]), neg(extended))
            causes[("prefetch_cancel", *k)].append((mismatch, base + 31 + 10 * a))
            ends["cancelled on a room mismatch (sync query instead)"].append(mismatch)
            self.out[(k, i + 1)] = self.define(
                f"out:{k}:{i + 1}", conj(live[k], neg(empty), neg(has))
            )
        for room_set in self.workload.room_sets(a):
            sync = conj(asks_for[room_set], neg(disj(*usable)))
            causes[("query_begin", a, tag, room_set)].append((sync, base + 32 + 10 * a))
            causes[("resolve", a, tag, room_set)].append((sync, base + 33 + 10 * a))
        for r in rs:
            # a partial answer: the server leaves out the rooms it does not know yet
            answered = z3.Bool(f"answered:r{r}:{i}") if self.workload.partial else True
            self.known[(r, i)] = self.define(
                f"known:r{r}:{i}", disj(self.known[(r, i - 1)], conj(need[r], answered))
            )

    def receive(self, i, released, pending, abort):
        """Receiver init in arrival order, unless memory is released; then the KV arrives. With a
        memory bound, a request that does not fit stops the pass (FIFO)."""
        base, memory, stop = 100 * i, self.workload.memory_bound, False
        # against a trace the KV and the request's end are not bound (decode_traces.UNBOUND)
        steps = (("receiver_init", 50),) if self.workload.exact else self.AFTER_INIT
        for _, r in self.rooms:
            now = conj(self.polls[i], neg(released), pending[r], self.known[(r, i)])
            if memory:
                fits = z3.Bool(f"fits:r{r}:{i}")
                now, stop = conj(now, fits, neg(stop)), disj(stop, conj(now, neg(fits)))
            order = self.workload.init_order(self.arrives[r], self.room_index[r])
            for name, off in steps:
                self.causes[(name, r)].append((now, base + off + order))
            self.gone[(r, i)] = self.define(
                f"gone:r{r}:{i}", disj(self.gone[(r, i - 1)], abort[r], now)
            )

    AFTER_INIT = (
        ("receiver_init", 50),
        ("kv_recv", 70),
        ("kv_done", 70.0001),
        ("req_done", 70.0002),
    )

    def bind_events(self):
        """Every event exists iff one of its causes holds (at most one does), at that cause's
        position; scheduler events on the scheduler thread."""
        universe = self.universe
        for e in universe.events:
            if (
                e.name in ("iter_begin", "prefetch_begin", "prefetch_end")
                or e.key[:1] == ("query_begin",)
                and e.f["source"] == "prefetch"
            ):
                continue
            causes = self.causes.get(e.key, [])
            self.loop.append(e.exists == as_z3(disj(*[c for c, _ in causes])))
            self.groups["E:order"] += [implies(c, e.pos == p) for c, p in causes if c is not False]
            if not self.workload.exact:  # (against a trace: two causes cannot both hold its place)
                universe.outside += [
                    conj(c1, c2) for n1, (c1, _) in enumerate(causes) for c2, _ in causes[n1 + 1 :]
                ]  # logged twice
        if self.workload.exact:  # what the loop would log outside the universe: not in the trace
            known = {e.key for e in universe.events}
            universe.outside += [
                c
                for key, cs in self.causes.items()
                if key not in known
                for c, p in cs
                if self.workload.complete or p < 100 * self.K
            ]
        for e in universe.events:
            pool = e.name == "query_begin" and e.f["source"] == "prefetch"
            self.loop.append(e.thread == (FWD if pool else SCHED))

    def pool_thread(self):
        """The query of a submit runs after it; a resolve using it waits for it. A cancel stops it
        only before the pool thread took it: then (Future.cancel() True, `stopped`) it never
        begins; a cancel that did not stop it says nothing of where its query_begin falls, which
        the pool thread logs after taking the call, so possibly after the cancel."""
        pool = self.groups["E:pool"]
        event = self.event
        for a in range(len(self.workload.rooms)):
            for k in self.keys(a):
                qb, sub = event("query_begin", *k), event("prefetch_submit", *k)
                cancel = event("prefetch_cancel", *k)
                users = [event("resolve", *k)] + [
                    event("resolve", *k, room_set)
                    for room_set in self.workload.room_sets(a)
                    if _prefix_of(k[2], room_set)
                ]
                pool += [
                    implies(qb.exists, conj(sub.exists, lt(sub, qb))),
                    implies(conj(cancel.exists, cancel.f["stopped"]), neg(qb.exists)),
                ]
                pool += [implies(u.exists, conj(qb.exists, lt(qb, u))) for u in users]

    def payloads(self):
        """What the receiver and the KV carry: the rank the resolve answered; one 16-token page.
        The server's answers."""
        universe = self.universe
        for _, r in self.rooms:
            init, kv = self.event("receiver_init", r), self.event("kv_recv", r)
            answers = [x for x in universe.named("resolve") if str(r) in x.f["result"]]
            self.loop += [
                implies(x.exists, init.f["rank"] == x.f["result"][str(r)]) for x in answers
            ]
            self.loop += [
                kv.f["rank"] == init.f["rank"],
                kv.f["tokens"] == 16,
                kv.f["pages"] == -(-16 // universe.page_size),
                kv.f["start"] == 0,
            ]
        for x in universe.named("resolve"):
            self.groups["E:server"] += [
                v == self.workload.server_rank(int(room)) for room, v in x.f["result"].items()
            ]
