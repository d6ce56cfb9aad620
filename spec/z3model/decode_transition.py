"""The decode prefetch loop as a transition system over a finite state, read off the bounded decode
loop model (decode_loops.py).

The bounded model unrolls `_DecodeLoop.iteration` over K iterations, each one defined from what
held at the end of the one before (which rooms arrived, whose rank is known, which are initialised
or aborted, whether the address's parallel info was fetched, which prefetched queries are
outstanding) and the environment's choices for it (arrivals, aborts, whether it polls the prealloc
queue, release and resume of memory). `Step` runs that same method for one iteration on plain
values (or on z3 terms: `confirm`): the state is what the next iteration reads, and an iteration i
>= CANON reads exactly like iteration CANON, since the loop compares the environment's iterations
with i only by <, <= and ==, and a prefetched query only by whether it was submitted before i.
So a query outstanding at the top of iteration i is kept as (address, rooms), and placed at
iteration CANON - 1 when CANON runs (`age` = min(i, CANON)).

Beside the loop's state, each property's monitor, computed from the events the iteration logs
(their causes in decode_loops, in position order), as the bounded formulas read them:
- one-query-per-address: a prefetch_submit while a query of its address is open (submitted, not
  cancelled or resolved since); an open query the loop no longer tracks (the double-prefetch
  mutant overwrites it) stays open for good (`orphan`);
- nothing-after-release: a prefetch_submit or receiver_init between release_memory and
  resume_memory, or a query open at release_memory;
- room-init-server-rank: a room initialised that no resolve ever answered (the rank is then free;
  a resolve's answer is the server's, E:server, and the init takes it, the payload constraints).
A property is violated in a run of K iterations when a state reached after K iterations is
accepting (E:env: every arrived request was served or aborted) and its monitor flags it.

What the bounded model's universe has no event for makes an iteration leave the domain (UNKNOWN):
its `outside` conditions, an event two causes log in one iteration, a synchronous query or resolve
for a room already answered (its event exists once per room set), two outstanding queries of one
address and room set. Dropped: event positions beyond their order, receiver inits of one iteration
in room order (the bounded model puts arrival first; no property reads it), the pool thread's
query_begin (free to run between its submit and its use: no property reads it), the KV and the
request's end (no property reads them).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import z3

from .decode_loops import DecodeUniverse, DecodeWorkload, _DecodeLoop
from .decode_workload import FIRST_SUBMIT
from .logic import conj, disj, neg
from .transition import ite

CANON = FIRST_SUBMIT + 1  # iterations from here on read alike (an earlier query: from CANON - 1)
NEVER = 10**6  # an environment iteration after every one the run has
ONE_QUERY, AFTER_RELEASE, ROOM_RANK = (
    "one-query-per-address",
    "nothing-after-release",
    "room-init-server-rank",
)


@dataclass(frozen=True)
class StepWorkload(DecodeWorkload):
    """The canonical workload over CANON iterations; receiver inits in room order."""

    iterations: int = CANON
    prefetching: bool = True

    def __post_init__(self):
        # the loop asks for these in every iteration: computed once
        n = range(len(self.rooms))
        object.__setattr__(self, "_sets", [DecodeWorkload.room_sets(self, a) for a in n])
        object.__setattr__(self, "_submits", [DecodeWorkload.submit_sets(self, a) for a in n])
        object.__setattr__(self, "_keys", [DecodeWorkload.prefetch_keys(self, a) for a in n])
        object.__setattr__(self, "_qkeys", [[(a, *k) for k in self._keys[a]] for a in n])

    def room_sets(self, a):
        return self._sets[a]

    def submit_sets(self, a):
        return self._submits[a]

    def prefetch_keys(self, a):
        return self._keys[a]

    def query_keys(self, a):
        """The loop's keys of address a's prefetched queries: (a, iteration, rooms)."""
        return self._qkeys[a]

    def init_order(self, arrives, index):
        return index / 1000


class _Marker:
    """An iteration's markers (iter_begin, prefetch_begin, prefetch_end): no property reads them."""

    exists, pos = True, 0


class Step(_DecodeLoop):
    """One iteration of the decode loop model from a state, on plain values or z3 terms."""

    def __init__(self, prefetching=True, mutants=(), rooms=None, iterations=CANON):
        more = {"rooms": rooms} if rooms else {}
        workload = StepWorkload(iterations, prefetching=prefetching, mutants=tuple(mutants), **more)
        super().__init__(DecodeUniverse(workload))
        self.addrs = range(len(self.workload.rooms))
        self.classes = [(a, asked) for a in self.addrs for asked in self.workload.submit_sets(a)]
        self.room_ids = [r for _, r in self.rooms]
        self.names = (
            [
                f"{x}:r{r}"
                for x in ("arrived", "known", "gone", "answered", "inited")
                for r in self.room_ids
            ]
            + [f"info:{a}" for a in self.addrs]
            + [f"out:{a}:{asked}" for a, asked in self.classes]
            + [f"orphan:{a}" for a in self.addrs]
            + [f"bad:{ONE_QUERY}", f"bad:{AFTER_RELEASE}", "mem", "age"]
        )

    def keys(self, a):
        return self.workload.query_keys(a)

    def event(self, *key):
        if key[0] in ("iter_begin", "prefetch_begin", "prefetch_end"):
            return _Marker
        return super().event(*key)

    def define(self, name, expr):
        return expr if isinstance(expr, bool) else super().define(name, expr)

    def initial(self) -> dict:
        return {v: (1 if v == "age" else 0 if v == "mem" else False) for v in self.names}

    def accepting(self, s):
        """E:env at the end of a run: every request that arrived was served or aborted."""
        return conj(*[disj(neg(s[f"arrived:r{r}"]), s[f"gone:r{r}"]) for r in self.room_ids])

    def violated(self, s, pid):
        if pid == ROOM_RANK:
            return disj(*[conj(s[f"inited:r{r}"], neg(s[f"answered:r{r}"])) for r in self.room_ids])
        return s[f"bad:{pid}"]

    def choices(self, s) -> list[dict]:
        """The environment's choices for the next iteration of a plain state."""
        out = [{}]
        for _, rs in self.workload.rooms:
            waiting = [r for r in rs if not s[f"arrived:r{r}"]]
            out = [
                {**c, **{f"arrive:r{r}": r in waiting[:n] for r in waiting}}
                for c in out
                for n in range(len(waiting) + 1)
            ]
        full = []
        for c in out:
            may = [
                r
                for r in self.room_ids
                if (s[f"arrived:r{r}"] or c.get(f"arrive:r{r}")) and not s[f"gone:r{r}"]
            ]
            for mask in range(1 << len(may)):
                aborts = {f"abort:r{r}": bool(mask >> n & 1) for n, r in enumerate(may)}
                for poll in (False, True):
                    for mem in (False, True) if s["mem"] < 2 else (False,):
                        full.append(
                            {
                                **dict.fromkeys(self.env_names(), False),
                                **c,
                                **aborts,
                                "poll": poll,
                                "release": mem and s["mem"] == 0,
                                "resume": mem and s["mem"] == 1,
                            }
                        )
        return full

    def env_ok(self, s, e) -> list:
        """The environment's constraints (E:env) on symbolic choices."""
        out = []
        for _, rs in self.workload.rooms:
            for x, y in zip(rs, rs[1:]):
                out.append(
                    z3.Implies(e[f"arrive:r{y}"], z3.Or(s[f"arrived:r{x}"], e[f"arrive:r{x}"]))
                )
        for r in self.room_ids:
            out.append(z3.Implies(e[f"arrive:r{r}"], z3.Not(s[f"arrived:r{r}"])))
            out.append(z3.Implies(e[f"abort:r{r}"], z3.Or(s[f"arrived:r{r}"], e[f"arrive:r{r}"])))
        out += [z3.Implies(e["release"], s["mem"] == 0), z3.Implies(e["resume"], s["mem"] == 1)]
        return out

    def env_names(self):
        return [f"{x}:r{r}" for x in ("arrive", "abort") for r in self.room_ids] + [
            "poll",
            "release",
            "resume",
        ]

    # ---- one iteration
    def run(self, s, e, at=None):
        """(next state, events, domain): events as (key, condition, position) in position order;
        domain: the conditions under which the iteration leaves the encoding's domain. `at`: run
        it as iteration `at` >= CANON instead (on a universe of that many iterations: a test)."""
        i = at or s["age"]
        if not isinstance(i, int):
            raise TypeError("the iteration's age must be a plain int (one step per age)")
        self._reset(s, e, i)
        self.iteration(i)
        domain = list(self.universe.outside)
        events = []
        for key, causes in self.causes.items():
            live = [(c, p) for c, p in causes if c is not False]
            if len(live) > 1:  # logged twice
                domain += [
                    conj(c1, c2) for n, (c1, _) in enumerate(live) for c2, _ in live[n + 1 :]
                ]
            events += [(key, c, p) for c, p in live]
        events.sort(key=lambda x: x[2])
        s2 = self._loop_state(s, e, i, domain)
        self._monitors(s, s2, events, i, domain)
        return s2, events, domain

    def _reset(self, s, e, i):
        self.groups = defaultdict(list)
        self.loop = self.groups["E:loop"]
        self.universe.ends, self.universe.outside = defaultdict(list), []
        self.causes = defaultdict(list)
        self.out, self.known, self.gone, self.info = {}, {}, {}, {}
        rooms = self.room_ids
        self.arrives = {
            r: ite(s[f"arrived:r{r}"], 0, ite(e[f"arrive:r{r}"], i, NEVER)) for r in rooms
        }
        self.aborts = {r: ite(e[f"abort:r{r}"], i, -1) for r in rooms}
        self.polls = {i: e["poll"]}
        mem = s["mem"]
        self.release_at = ite(mem == 0, ite(e["release"], i, NEVER), ite(mem == 1, 0, -2))
        self.resume_at = ite(mem == 0, NEVER + 1, ite(mem == 1, ite(e["resume"], i, NEVER), -1))
        for r in rooms:
            self.known[(r, i - 1)] = s[f"known:r{r}"]
            self.gone[(r, i - 1)] = s[f"gone:r{r}"]
        for a in self.addrs:
            self.info[(a, i - 1)] = s[f"info:{a}"]
            for k in self.keys(a):
                if k[1] < i:
                    self.out[(k, i)] = s[f"out:{a}:{k[2]}"] if k[1] == i - 1 else False

    def _loop_state(self, s, e, i, domain):
        s2 = dict(s)
        for r in self.room_ids:
            s2[f"arrived:r{r}"] = disj(s[f"arrived:r{r}"], e[f"arrive:r{r}"])
            s2[f"known:r{r}"] = self.known[(r, i)]
            s2[f"gone:r{r}"] = self.gone[(r, i)]
        for a in self.addrs:
            s2[f"info:{a}"] = self.info[(a, i)]
        for a, asked in self.classes:
            held = [self.out.get(((a, j, asked), i + 1), False) for j in range(1, i + 1)]
            s2[f"out:{a}:{asked}"] = disj(*held)
            domain += [conj(x, y) for n, x in enumerate(held) for y in held[n + 1 :]]
        mem = s["mem"]
        s2["mem"] = ite(mem == 0, ite(e["release"], 1, 0), ite(mem == 1, ite(e["resume"], 2, 1), 2))
        s2["age"] = min(i + 1, CANON)
        return s2

    def _monitors(self, s, s2, events, i, domain):
        """The properties' monitors over the iteration's events, in order."""
        keys = [k for a in self.addrs for k in self.keys(a)]
        open_ = {k: self.out.get((k, i), False) for k in keys}
        orphan = {a: s[f"orphan:{a}"] for a in self.addrs}
        answered = {r: s[f"answered:r{r}"] for r in self.room_ids}
        inited = {r: s[f"inited:r{r}"] for r in self.room_ids}
        bad1, bad2 = s[f"bad:{ONE_QUERY}"], s[f"bad:{AFTER_RELEASE}"]
        released = s["mem"] == 1

        def any_open(addrs):
            return disj(*[open_[k] for k in keys if k[0] in addrs], *[orphan[a] for a in addrs])

        for key, c, _ in events:
            name = key[0]
            query = key[1:4] if len(key) >= 4 and isinstance(key[2], int) else None
            if name == "prefetch_submit":
                bad1 = disj(bad1, conj(c, any_open([key[1]])))
                bad2 = disj(bad2, conj(c, released))
                open_[query] = disj(open_[query], c)
            elif name == "receiver_init":
                bad2 = disj(bad2, conj(c, released))
                inited[key[1]] = disj(inited[key[1]], c)
            elif name == "release_memory":
                bad2 = disj(bad2, conj(c, any_open(list(self.addrs))))
                released = disj(released, c)
            elif name == "resume_memory":
                released = conj(released, neg(c))
            if name in ("prefetch_cancel", "resolve") and query is not None:
                open_[query] = conj(open_[query], neg(c))
            if name in ("query_begin", "resolve") and key[2] == self.workload.sync_tag(i):
                domain += [conj(c, answered[r]) for r in key[3]]  # its event exists once
            if name == "resolve":
                for r in self.universe.get(key).f["result"]:
                    answered[int(r)] = disj(answered[int(r)], c)
        for a in self.addrs:
            dropped = [
                conj(open_[k], neg(self.out.get((k, i + 1), False))) for k in keys if k[0] == a
            ]
            s2[f"orphan:{a}"] = disj(orphan[a], *dropped)
            # the loop tracks only open queries
            domain += [
                conj(self.out.get((k, i + 1), False), neg(open_[k])) for k in keys if k[0] == a
            ]
        for r in self.room_ids:
            s2[f"answered:r{r}"], s2[f"inited:r{r}"] = answered[r], inited[r]
        s2[f"bad:{ONE_QUERY}"], s2[f"bad:{AFTER_RELEASE}"] = bad1, bad2
