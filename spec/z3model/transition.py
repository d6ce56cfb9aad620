"""The prefill loops as transition systems over a finite state, read off the bounded loop model.

The bounded model (prefill_loops.py) writes each thread's program one loop iteration at a time
(ITERATIONS[mode], _worker_iteration, _last_iterations). This module runs those same functions on
small universes and keeps, per iteration, the sequence of program slots with each event named by
its class and its batch relative to the iteration's batch N: ("admit", 0), ("process_begin", -1),
("kv_send[-1]", 0) for the KV send of request r(N-1) in batch N. An iteration of batch N looks
alike for every N >= 2 (the canonical workload repeats), so a handful of segments describe the
scheduler's program for every K:

  F (N = 0) -> M1 (N = 1) -> M (N >= 2) ... -> L (the last batch) -> D (the final drain)

with L1 for a last batch N = 1, FL and D1 for K = 1, and a steady and a drained variant of each
segment with N >= 1 (the guards of the bounded model). The worker repeats one segment.

The state (all integers, relative to the scheduler's batch N so that it is finite):
- pc_s, pc_w: the next slot of the scheduler's and of the worker's program;
- w: the worker's batch minus N;
- o[X] for every event class X (queue points and device work included): the next batch of X
  minus N, so "X(n) happened" is n - N < o[X] (each class is emitted in batch order, checked as
  part of the domain);
- dgap: how many more staging writes than forwards the device ran;
- age: min(N, -LO), so that requests before batch 0 are known not to exist.

Moves: the scheduler or the worker runs its next slot when it is enabled (a queue get needs its
put, a put needs room: E:queues); the device runs the next staging write once the forwards of the
barriers before it finished, the next forward once its staging ran (E:streams; see
_device_moves for what the device part assumes). Ending an iteration shifts every relative value
by one.

Kept: program order per thread and its branches (steady / drained), the queue capacities, stream
order, the staging wait and the WAR barrier's wait, the mutants. Dropped: allocs and releases as
events (no-free-in-flight is checked in every state in which the scheduler is inside a window, as
the bounded model lets a release fall in any window), Req objects, slots, digests and page counts
(the properties that read only those are structural: see unbounded.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import z3

from .prefill_loops import EMITTED, ITERATIONS, _last_iterations, _Program, _worker_iteration
from .prefill_universe import ModelUniverse, Workload
from .universe import SCHED, THREAD_MODES

MARKERS = ("iteration_top", "iteration_end")
LO, HI = -2, 2  # the domain of every relative counter (checked: leaving it is a violation)
QUEUES = {"in_get": "in_put", "out_get": "out_put"}


def ite(c, a, b):
    """If-then-else on plain values (a state of the search) or z3 terms (a symbolic state)."""
    if isinstance(c, bool):
        return a if c else b
    return z3.If(c, a, b)


def all_of(xs):
    xs = list(xs)
    if all(isinstance(x, bool) for x in xs):
        return all(xs)
    return z3.And(*xs)


def any_of(xs):
    xs = list(xs)
    if all(isinstance(x, bool) for x in xs):
        return any(xs)
    return z3.Or(*xs)


@dataclass(frozen=True)
class Slot:
    cls: str  # event class, or "open"/"close" for a window's bounds
    off: int = 0  # batch relative to the iteration's batch
    window: str = ""  # iteration_top | iteration_end, for markers

    def label(self, n) -> str:
        if self.cls in ("open", "close"):
            return f"{self.window}{'<' if self.cls == 'open' else '>'}"
        name, _, rid = self.cls.partition("[")
        if rid:
            return f"{name}(r{n + int(rid[:-1])}@{n})"
        return f"{name}({n})"


@dataclass
class Segment:
    name: str
    steady: bool | None  # the variant (None: the segment has no branch)
    slots: list
    succ: list = field(default_factory=list)  # (segment name, shifts to the next batch)
    last: bool = False  # the iteration's batch is the last one
    start: int = 0  # index of its first slot in the scheduler's pc space


def _cls(e, n):
    """An event's class and batch relative to n."""
    key = e.key
    if e.name in MARKERS:
        return Slot("open" if str(key[1]).endswith("<") else "close", 0, e.name)
    if len(key) == 3:  # per-request, per-chunk event (name, rid, batch)
        _, rid, b = key
        return Slot(f"{e.name}[{int(rid[1:]) - b:+d}]", b - n)
    return Slot(e.name, key[1] - n)


def _universe(k, mode):
    u = ModelUniverse(Workload.canonical(k))
    if mode in THREAD_MODES:
        for n in range(k):
            for name in ("in_put", "in_get", "out_put", "out_get"):
                u.hide((name, n), SCHED)
    return u


def _slots(prog, n, mode, steady):
    """The slots of a _Program active under the variant `steady`, with EMITTED applied."""
    emitted = EMITTED[mode]
    out = []
    for g, e in prog.slots:
        if g is False:
            continue
        if g is not True and (g is prog.steady) != steady:
            continue
        if emitted is not None and not e.hidden and e.batch is not None and e.name not in emitted:
            continue
        out.append(_cls(e, n))
    return out


def _iteration(mode, k, n, steady, mutants):
    u = _universe(k, mode)
    prog = _Program(u, "scheduler")
    st = z3.Bool(f"steady:{n}") if n else False
    prog.steady = st
    ITERATIONS[mode](prog, u, n, st, z3.Not(st) if n else False, mutants)
    if n:  # the drained guard is a fresh term: tell the variants apart by it not being `steady`
        prog.slots = [
            (g if g is True or g is False or g is st else _Drained, e) for g, e in prog.slots
        ]
    return _slots(prog, n, mode, bool(steady))


_Drained = object()


def _drain(mode, k, mutants):
    u = _universe(k, mode)
    prog = _Program(u, "scheduler")
    prog.steady = None
    _last_iterations(prog, u, mode)
    return _slots(prog, k - 1, mode, False)


def worker_slots(mode, mutants, n=1):
    u = _universe(n + 2, mode)
    prog = _Program(u, "worker")
    prog.steady = None
    _worker_iteration(prog, u, n, mode, mutants)
    return _slots(prog, n, mode, False)


# (segment, universe size K, batch n, successors, last)
SHAPE = [
    ("F", 2, 0, [("M1", True), ("L1", True)], False),
    ("M1", 3, 1, [("M", True), ("L", True)], False),
    ("M", 4, 2, [("M", True), ("L", True)], False),
    ("L1", 2, 1, [("D", False)], True),
    ("L", 3, 2, [("D", False)], True),
    ("FL", 1, 0, [("D1", False)], True),
]


def scheduler_segments(mode, mutants=()) -> list[Segment]:
    """The scheduler's program as segments (steady and drained variants), in pc order."""
    segs = []
    for name, k, n, succ, last in SHAPE:
        for steady in (False, True) if n else (None,):
            segs.append(Segment(name, steady, _iteration(mode, k, n, steady, mutants), succ, last))
    segs.append(Segment("D", None, _drain(mode, 2, mutants), [], True))
    segs.append(Segment("D1", None, _drain(mode, 1, mutants), [], True))
    pc = 0
    for s in segs:
        s.start, pc = pc, pc + len(s.slots)
    return segs


@functools.cache
def request_events(mode, final: bool):
    """For a request r(j): (its sends as (class, batch - j), its holding batches - j), read off a
    universe of 5 batches (r2 generic, r4 the last batch's)."""
    u = ModelUniverse(Workload.canonical(5))
    j = 4 if final else 2
    rid = f"r{j}"
    sends = [
        (f"{e.name}[{j - e.key[2]:+d}]", e.key[2] - j)
        for e in u.named("kv_send") + u.named("prefix_send")
        if e.rid == rid
    ]
    return tuple(sends), tuple(b - j for b in u.workload.holding(rid))


class System:
    """The transition system of one prefill mode (with mutants): its state variables, initial
    states and moves, as z3 terms over named copies of the state."""

    def __init__(self, mode: str, mutants=(), batches: int | None = None):
        self.mode, self.mutants, self.batches = mode, tuple(mutants), batches
        self.segments = scheduler_segments(mode, self.mutants)
        self.worker = worker_slots(mode, self.mutants) if mode in THREAD_MODES else []
        self.cap = 2 if "two-forwards" in self.mutants else 1
        classes = {s.cls for seg in self.segments for s in seg.slots} | {s.cls for s in self.worker}
        classes -= {"open", "close"}
        self.classes = sorted(classes)
        self.sched_slots = [(seg, i, s) for seg in self.segments for i, s in enumerate(seg.slots)]
        self.by_name = {(s.name, s.steady): s for s in self.segments}
        self.names = (
            ["pc_s", "pc_w", "w"]
            + [f"o:{c}" for c in self.classes]
            + ["dgap", "age"]
            + (["n"] if batches else [])
        )

    def state(self, tag: str) -> dict:
        return {v: z3.Int(f"{v}@{tag}") for v in self.names}

    def init(self, s) -> list:
        starts = [self.by_name[("F", None)].start, self.by_name[("FL", None)].start]
        if self.batches:
            starts = [starts[0] if self.batches > 1 else starts[1]]
        out = [z3.Or(*[s["pc_s"] == p for p in starts])]
        out += [s[v] == 0 for v in self.names if v != "pc_s"]
        return out

    def domain(self, s) -> list:
        """Where the relative encoding is exact: every counter within LO..HI (so every event of a
        batch before N + LO happened and none after N + HI), the worker's batch near N."""
        vs = [s[f"o:{c}"] for c in self.classes] + [s["w"]]
        out = [all_of([v >= LO, v <= HI]) for v in vs]
        return out

    def moves_at(self, s):
        """The moves of a concrete state (plain ints): only the slots its pcs point at."""
        out = []
        for seg, i, slot in self._sched_at(s["pc_s"]):
            out += self._sched_moves(s, seg, i, slot)
        if self.worker:
            out.append(self._worker_move(s, s["pc_w"], self.worker[s["pc_w"]]))
        out += self._device_moves(s)
        return [m for m in out if all_of(m[2])]

    def _sched_at(self, pc):
        if not hasattr(self, "_by_pc"):
            self._by_pc = {seg.start + i: (seg, i, slot) for seg, i, slot in self.sched_slots}
        return [self._by_pc[pc]] if pc in self._by_pc else []

    def in_window(self, s):
        """The scheduler is inside a window (a release may fall here)."""
        return any_of(
            s["pc_s"] == seg.start + i for seg, i, slot in self.sched_slots if slot.cls == "close"
        )

    def segment_is_last(self, s):
        return any_of(
            all_of([s["pc_s"] >= seg.start, s["pc_s"] < seg.start + len(seg.slots)])
            for seg in self.segments
            if seg.last
        )

    # ---- moves: (label, thread, guard, updates, event) with event = (class, batch) or None
    def moves(self, s):
        out = []
        for seg, i, slot in self.sched_slots:
            out += self._sched_moves(s, seg, i, slot)
        for i, slot in enumerate(self.worker):
            out.append(self._worker_move(s, i, slot))
        out += self._device_moves(s)
        return out

    def _emit(self, s, slot, b):
        """Guard and updates of emitting `slot` for relative batch b."""
        if slot.cls in ("open", "close"):
            return [], {}
        guard = []
        c = slot.cls
        if c in QUEUES:
            guard.append(b < s[f"o:{QUEUES[c]}"])
        elif c in ("in_put", "out_put"):
            get = "in_get" if c == "in_put" else "out_get"
            guard.append(s[f"o:{get}"] >= b - self.cap + 1)
        return guard, {f"o:{c}": b + 1}

    def _sched_moves(self, s, seg, i, slot):
        p = seg.start + i
        guard, upd = self._emit(s, slot, slot.off)
        ev = None if slot.cls in ("open", "close") else (slot.cls, slot.off)
        base = [s["pc_s"] == p] + guard
        if i + 1 < len(seg.slots):
            return [(f"{seg.name}.{i}", "scheduler", base, {**upd, "pc_s": p + 1}, ev, slot)]
        out = []
        for name, shift in seg.succ:
            for variant in (False, True) if name not in ("D", "D1") else (None,):
                nxt = self.by_name[(name, variant)]
                g = list(base)
                if self.batches:
                    # the next iteration's batch is the last one exactly when it is K - 1
                    g.append((s["n"] + 1 == self.batches - 1) == nxt.last if shift else True)
                u = dict(upd)
                u["pc_s"] = nxt.start
                if shift:
                    u = self._shift(s, u)
                label = f"{seg.name}.{i}->{nxt.name}" + ("+" if shift else "")
                out.append((label, "scheduler", g, u, ev, slot))
        return out

    def _shift(self, s, upd):
        """The scheduler goes on to batch N + 1: every relative value goes down by one."""
        out = {}
        for v in self.names:
            val = upd.get(v, s[v])
            if v.startswith("o:") or (v == "w" and self.worker):
                out[v] = val - 1
            elif v == "n":
                out[v] = val + 1
            elif v == "age":
                out[v] = ite(val < -LO, val + 1, val)
            else:
                out[v] = val
        return out

    def _worker_move(self, s, i, slot):
        b = s["w"] + slot.off
        guard, upd = self._emit(s, slot, b)
        upd = dict(upd)
        if i + 1 < len(self.worker):
            upd["pc_w"] = i + 1
        else:
            upd["pc_w"], upd["w"] = 0, s["w"] + 1
        return (f"W.{i}", "forward", [s["pc_w"] == i] + guard, upd, (slot.cls, b), slot)

    def _device_moves(self, s):
        """The two streams, by the gap between the staging writes and the forwards that ran. The
        WAR barrier makes staging write N wait for the forwards of the barriers enqueued before
        stage(N), which are those of every batch before N when war-host holds: the wait below
        (for forward N - 1) is the least of those, so the device moves over-approximate the
        engine's (the host's enqueue order is dropped as well)."""
        gap = s["dgap"]
        g_stage = [] if "no-war-barrier" in self.mutants else [gap == 0]
        return [
            (
                "dev_stage",
                "device",
                g_stage,
                {"dgap": ite(gap < HI, gap + 1, gap)},
                ("dev_stage", 0),
                None,
            ),
            ("dev_forward", "device", [gap > 0], {"dgap": gap - 1}, ("dev_forward", 0), None),
        ]

    def frame(self, s, s2, upd):
        return [s2[v] == upd.get(v, s[v]) for v in self.names]
