"""Unbounded proofs of the prefill safety properties over the transition systems of
transition.py: for every number of batches K at once.

Each property of properties.py becomes a monitor: a condition on a move (the event it emits, read
against the counters before it) or on a state, true exactly when the bounded formula's atom about
that event fails. The state of transition.py is finite (relative to the scheduler's batch), so the
prover computes the reachable states breadth first from the initial ones: that set is closed under
every move (the strongest inductive invariant) and a property holds for every K when no move from
it is bad. A bad move found is a counterexample, the shortest one (breadth first), printed as a
schedule. Leaving the domain of the relative encoding (a counter drifting further than LO..HI from
the scheduler's batch, an event out of batch order) makes every verdict of the mode UNKNOWN, so a
PROVED also shows the encoding exact on every reachable state. `confirm` gives z3's second opinion
on a search: the same moves built as z3 terms, R ∧ T ⟹ R' and no bad move from R.

dec-on-real-request reads only values the engine model fixes per event, independently of K
(E:req-identity): it is reported PROVED as structural. snapshot-isolation is checked as its
ordering half (snapshot(N) is taken before run_batch(N) begins), which with the per-batch digest
equality of E:snapshot implies it. war-device is proved from the device streams assuming
war-host (see transition._device_moves): it is PROVED only where war-host is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import z3

from ..vocabulary import PREFILL_LOOPS
from .properties import PROPERTIES
from .transition import LO, Slot, System, all_of, any_of, request_events

STRUCTURAL = {
    "dec-on-real-request": "E:req-identity: every event of a request carries its object "
    "(per-event equalities, independent of K)"
}


def _o(s, c):
    return s.get(f"o:{c}")


def _open_forward(s):
    return _o(s, "fwd_end") < _o(s, "fwd_begin")


def _not(x):
    return (not x) if isinstance(x, bool) else z3.Not(x)


def move_monitors(prop_id, s, ev):
    """The bad condition of emitting ev = (class, relative batch) in state s, for a property."""
    cls, b = ev
    if prop_id == "one-forward" and cls == "fwd_begin":
        return _open_forward(s)
    if prop_id == "sample-idle" and cls == "sample":
        return _open_forward(s)
    if prop_id == "process-after-forward" and cls == "process_begin":
        return any_of([b >= _o(s, "fwd_end"), b >= _o(s, "war_barrier")])
    if prop_id == "war-host" and cls == "stage":
        return _o(s, "war_barrier") < b
    if prop_id == "war-device" and cls == "dev_stage":
        return s["dgap"] >= 1  # a staging write with the forward before it still to run
    if prop_id == "snapshot-isolation" and cls == "fwd_begin":
        return b >= _o(s, "snapshot")
    if prop_id == "live-batch-stable" and cls == "admit":
        return all_of([_o(s, "fwd_end") < _o(s, "fwd_begin"), _o(s, "fwd_end") < b])
    return None


def state_monitor(system, prop_id, s):
    """no-free-in-flight: inside a window, every request whose last chunk was processed has all
    its chunks processed and all its sends done (else a release there frees it in flight)."""
    if prop_id != "no-free-in-flight":
        return None
    bad = []
    for final in (False, True):
        sends, holding = request_events(system.mode, final)
        for j in range(LO, 1):
            if final and j != 0:
                continue
            exists = s["age"] >= -j
            ok = [j + h < _o(s, "process_end") for h in holding]
            ok += [j + off < _o(s, c) for c, off in sends if _o(s, c) is not None]
            last = j + max(holding) < _o(s, "process_end")
            is_final = system.segment_is_last(s) if j == 0 else False
            which = is_final if final else _not(is_final)
            bad.append(all_of([exists, which, last, _not(all_of(ok))]))
    return all_of([system.in_window(s), any_of(bad)])


@dataclass
class Result:
    prop: str
    mode: str
    status: str  # PROVED | REFUTED | UNKNOWN
    k: int | None = None  # REFUTED: moves in the counterexample
    seconds: float = 0.0
    how: str = ""  # the invariant ("reachable set, N states"), "structural", or why UNKNOWN
    trace: list = field(default_factory=list)  # REFUTED: (thread, label) per move

    def as_dict(self):
        return {
            "property": self.prop,
            "mode": self.mode,
            "verdict": self.status,
            "k": self.k,
            "how": self.how,
            "seconds": round(self.seconds, 3),
            "counterexample": [{"thread": t, "event": e} for t, e in self.trace],
        }


def timeline_lines(trace, width=34, lanes=("scheduler", "forward", "device")) -> list[str]:
    """A counterexample as one column per lane (by default scheduler | forward | device, as the
    bounded prover prints), a step per line."""
    lines = ["      " + " | ".join(f"{x:<{width}}" for x in lanes).rstrip()]
    for i, (thread, label) in enumerate(trace, 1):
        cells = [""] * len(lanes)
        cells[lanes.index(thread)] = label
        lines.append(f"{i:>4}  " + " | ".join(f"{c:<{width}}" for c in cells).rstrip())
    return lines


def reach(system, prop_ids, limit=200000):
    """Every reachable state of the system, breadth first, and for each property the first bad
    move found (so the shortest counterexample). Returns (states, parents, bad)."""
    names = system.names
    init = {v: 0 for v in names}
    starts = [system.by_name[("F", None)].start, system.by_name[("FL", None)].start]
    if system.batches:
        starts = [starts[0] if system.batches > 1 else starts[1]]
    frontier, parent, bad = [], {}, {}
    for p in starts:
        s = tuple({**init, "pc_s": p}[v] for v in names)
        parent[s] = None
        frontier.append(s)
    while frontier:
        nxt = []
        for key in frontier:
            s = dict(zip(names, key))
            for mv in system.moves_at(s):
                label, thread, _, upd, ev, _ = mv
                s2 = {v: upd.get(v, s[v]) for v in names}
                why = _bad_move(system, s, s2, ev, prop_ids)
                for pid in why:
                    bad.setdefault(pid, (key, mv))
                if not all(system.domain(s2)):
                    bad.setdefault("domain", (key, mv))
                    continue
                k2 = tuple(s2[v] for v in names)
                if k2 not in parent:
                    parent[k2] = (key, mv)
                    nxt.append(k2)
            if len(parent) > limit:
                return parent, bad, False
        frontier = nxt
    return parent, bad, True


def _bad_move(system, s, s2, ev, prop_ids):
    out = []
    if ev is not None and ev[1] < s.get(f"o:{ev[0]}", ev[1]):
        out.append("domain")
    for pid in prop_ids:
        m = move_monitors(pid, s, ev) if ev is not None else None
        if m or state_monitor(system, pid, s2):
            out.append(pid)
    return out


def _path(parent, key, mv):
    out = [mv]
    while parent[key] is not None:
        key, mv = parent[key]
        out.append(mv)
    return out[::-1]


def schedule(system, moves) -> list:
    """(thread, event) per move of a path, batches absolute (markers left out)."""
    out, n, device = [], 0, {"dev_stage": 0, "dev_forward": 0}
    for label, thread, _, _, ev, _ in moves:
        if ev is not None and thread == "device":
            out.append((thread, Slot(ev[0]).label(device[ev[0]])))
            device[ev[0]] += 1
        elif ev is not None:
            out.append((thread, Slot(ev[0]).label(n + ev[1])))
        if label.endswith("+"):
            n += 1
    return out


def prove_mode(mode, props=None, mutants=(), batches=None) -> list[Result]:
    """Every applicable property of `mode` (or those in `props`), for every K (or K = batches)."""
    system = System(mode, mutants, batches)
    ids = [p.id for p in PROPERTIES if p.applies(mode) and (not props or p.id in props)]
    t0 = time.perf_counter()
    parent, bad, complete = reach(system, [i for i in ids if i not in STRUCTURAL])
    spent = time.perf_counter() - t0
    out = []
    for pid in ids:
        if pid in STRUCTURAL:
            out.append(Result(pid, mode, "PROVED", None, 0.0, "structural: " + STRUCTURAL[pid]))
        elif not complete or "domain" in bad:
            why = "state limit reached" if not complete else "left the relative encoding's domain"
            out.append(Result(pid, mode, "UNKNOWN", None, spent, why))
        elif pid in bad:
            moves = _path(parent, *bad[pid])
            trace = schedule(system, moves)
            out.append(Result(pid, mode, "REFUTED", len(trace), spent, "reachable", trace))
        else:
            out.append(
                Result(pid, mode, "PROVED", None, spent, f"reachable set, {len(parent)} states")
            )
    by_id = {r.prop: r for r in out}
    wd, wh = by_id.get("war-device"), by_id.get("war-host")
    if wd is not None and wd.status == "PROVED" and (wh is None or wh.status != "PROVED"):
        wd.status, wd.how = "UNKNOWN", "assumes war-host, which is not proved"
    return out


MODES_ALL = PREFILL_LOOPS


def prove_all(modes=MODES_ALL, props=None, mutants=(), batches=None) -> list[Result]:
    out = []
    for mode in modes:
        out += prove_mode(mode, props, mutants if mode == "ahead" else (), batches)
    return out


TABLE = Path(__file__).resolve().parent.parent / "unbounded_table.json"


def confirm(system, states, prop_ids, timeout_ms=120000) -> dict:
    """z3's second opinion on a search: with `states` as R, is R ∧ T ⟹ R' valid (R inductive;
    the initial states are in it by construction), and is no bad move possible from R, for each
    property? The moves are built symbolically here, from the same step definitions the search
    ran on plain ints. Returns {"inductive": z3 result, property id: z3 result} ("unsat" = yes)."""
    s, s2 = system.state("a"), system.state("b")

    def member(st):
        return z3.Or(*[z3.And(*[st[v] == x for v, x in zip(system.names, key)]) for key in states])

    moves = system.moves(s)
    taken = [z3.And(*g, *system.frame(s, s2, u)) for _, _, g, u, _, _ in moves]
    sv = z3.Solver()
    sv.set(timeout=timeout_ms)
    sv.add(member(s), z3.Or(*taken))
    out = {"inductive": _check(sv, [z3.Not(member(s2))])}
    for pid in prop_ids:
        bad = [
            z3.And(t, m)
            for t, (_, _, _, _, ev, _) in zip(taken, moves)
            if ev is not None and (m := move_monitors(pid, s, ev)) is not None
        ]
        sm = state_monitor(system, pid, s2)
        out[pid] = _check(sv, bad + ([sm] if sm is not None else []))
    return out


def _check(sv, disjuncts) -> str:
    if not disjuncts:
        return "unsat"
    sv.push()
    sv.add(z3.Or(*disjuncts))
    r = str(sv.check())
    sv.pop()
    return r
