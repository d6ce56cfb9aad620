"""Universes: the events a formula speaks about, each with a position, a thread, an existence flag
and its fields, and the look-ups the encodings use.

A schedule is an interleaving: events at distinct positions ("a < b": a happened before b). Symbolic
positions are reals, and only events that some constraint compares are kept apart (see `frame`).
"""

from __future__ import annotations

from collections import defaultdict

import z3

from ..vocabulary import FORWARD, PREFILL_LOOPS, SCHEDULER, THREAD_LOOPS
from .logic import conj, implies

SCHED, FWD = 0, 1  # host threads of the model
THREAD_IDS = {SCHEDULER: SCHED, FORWARD: FWD}
THREAD_NAMES = {v: k for k, v in THREAD_IDS.items()}
STREAM = 2  # device work (schedule and forward streams): hidden events
MODES, THREAD_MODES = PREFILL_LOOPS, THREAD_LOOPS  # spec/vocabulary.py's, under the model's names


class Ev:
    """One event of a universe. `f` holds the trace fields (rid, obj, slot, value, digest, ...)."""

    __slots__ = ("name", "batch", "key", "pos", "thread", "exists", "f", "hidden", "seq", "cmp")

    def __init__(self, name, batch, key, pos, thread, exists, f, hidden=False, seq=None, cmp=None):
        self.name, self.batch, self.key, self.pos = name, batch, key, pos
        self.thread, self.exists, self.f, self.hidden, self.seq = thread, exists, f, hidden, seq
        self.cmp = cmp  # model universe: the set of compared pairs, for the frame's distinctness

    @property
    def rid(self):
        return self.f.get("rid")

    def label(self) -> str:
        if self.seq is not None:
            return f"#{self.seq} {_brief(self.name, self.f)}"
        return key_label(self.key)

    def __repr__(self):
        return self.label()


def key_label(key) -> str:
    name, *rest = key
    if not rest:
        return name
    if len(rest) == 1:
        return f"{name}({rest[0]})"
    if len(rest) == 2:
        return f"{name}({rest[0]}@{rest[1]})"
    return f"{name}({'@'.join(''.join(str(x).split()) for x in rest)})"


def _brief(name, f) -> str:
    args = ",".join(
        f"{k}={f[k]}"
        for k in ("batch", "rid", "slot", "value", "obj", "digest", "tokens", "pages")
        if k in f
    )
    return f"{name}({args})"


class Universe:
    """Events and the look-ups the encodings use. The base class is the symbolic one: candidate
    sets are everything (positions are unknown); TraceUniverse narrows them by known positions."""

    ordered = False

    def __init__(self):
        self.events: list[Ev] = []  # observable (trace-level) events
        self.hidden: list[Ev] = []  # engine-internal points: queue puts/gets, device work, ...
        self._by_name = defaultdict(list)
        self._by_nb = defaultdict(list)

    def add(self, e: Ev) -> Ev:
        if e.hidden:
            self.hidden.append(e)
            return e
        self.events.append(e)
        self._by_name[e.name].append(e)
        if e.batch is not None:
            self._by_nb[(e.name, e.batch)].append(e)
        return e

    def named(self, name) -> list[Ev]:
        return self._by_name.get(name, [])

    # The prefill side of a cross check (TraceUniverse.add_remote): facts, not positions.
    dp_ranks: frozenset = frozenset()
    dp_complete = False
    dp_stopped = False  # a prefill rank's trace_end says it was stopped before its run's end

    def remote(self, name) -> list[Ev]:
        return getattr(self, "_remote", {}).get(name, [])

    def occ(self, name, b) -> list[Ev]:
        return self._by_nb.get((name, b), [])

    def at(self, name, b):
        """The event `name` of batch b the rules speak about: the first occurrence."""
        lst = self._by_nb.get((name, b))
        return lst[0] if lst else None

    def batches_of(self, name) -> list[int]:
        return sorted({e.batch for e in self.named(name) if e.batch is not None})

    def admitted(self) -> list[int]:
        return self.batches_of("admit")

    def tid(self, name):
        return THREAD_IDS[name]

    # Candidate sets. Every formula guards itself with position comparisons, so passing more
    # candidates than needed is always exact. Symbolic: every candidate. Ordered (a trace): long
    # lists (all events of a name or of a thread) are narrowed by the known positions, where the
    # narrowing only drops obligations the others imply (see each encoding); short per-batch,
    # per-request lists are kept whole so that an unsat core can name the event that came too late.
    def among(self, evs, lo=None, hi=None):
        return [e for e in evs if e is not lo and e is not hi]

    def succ_pairs(self, evs):
        return [(a, b) for a in evs for b in evs if a is not b]

    def first_after(self, y, evs):
        return [e for e in evs if e is not y]

    def last_before(self, x, evs):
        return [e for e in evs if e is not x]

    def on_thread_between(self, thread, lo, hi):
        return [e for e in self.events if e is not lo and e is not hi]


class SymbolicUniverse(Universe):
    """Events with symbolic position, thread, existence and fields, made by key."""

    def __init__(self, page_size: int = 16):
        super().__init__()
        self.page_size = page_size
        self.by_key: dict = {}
        self.compared: set = set()  # (a, b) for every a < b some constraint states

    def _make(self, name, batch, key, f, vocab, always=False, extra=()):
        lab = key_label(key)
        for fname in list(vocab[name]["fields"]) + list(extra):
            if fname not in f and fname not in ("batch", "rid", "rids"):
                f[fname] = z3.Int(f"{fname}:{lab}")
        e = Ev(
            name,
            batch,
            key,
            z3.Real(f"t:{lab}"),
            z3.Int(f"thread:{lab}"),
            True if always else z3.Bool(f"emitted:{lab}"),
            f,
            cmp=self.compared,
        )
        self.by_key[key] = self.add(e)
        return e

    def hide(self, key, thread) -> Ev:
        """An engine-internal point (queue put/get, device work, ...): not in traces, not in
        rules."""
        lab = key_label(key)
        e = Ev(
            key[0], None, key, z3.Real(f"t:{lab}"), thread, True, {}, hidden=True, cmp=self.compared
        )
        self.by_key[key] = self.add(e)
        return e

    def get(self, key):
        return self.by_key.get(key)


def frame(universe: SymbolicUniverse, done: set | None = None) -> list:
    """What every schedule is: an interleaving of two host threads. Only events that some constraint
    compares must be at distinct positions: two tied events that nothing compares can be put in
    either order without changing the truth of any atom, so every model is an interleaving after
    breaking such ties (Model.schedule does, by key); a Distinct over every position would make
    satisfiable queries far slower."""
    out = [z3.Or(e.thread == SCHED, e.thread == FWD) for e in universe.events]
    return out + distinct_compared(universe, done)


def distinct_compared(universe: SymbolicUniverse, done: set | None = None) -> list:
    """a != b for the compared pairs not in `done` (which it updates)."""
    done = set() if done is None else done
    new = []
    for a, b in list(universe.compared):
        k = (id(a), id(b)) if id(a) < id(b) else (id(b), id(a))
        if a is b or k in done:
            continue
        done.add(k)
        la, lb = key_label(a.key), key_label(b.key)
        new.append((la, lb, a, b) if la < lb else (lb, la, b, a))
    # In the order of the events' keys, not of the set (object ids): the same constraints in the
    # same order in every process, so that unsat cores, and the minimal sets read from them, do not
    # vary.
    new.sort(key=lambda x: (x[0], x[1]))
    return [implies(conj(a.exists, b.exists), a.pos != b.pos) for _, _, a, b in new]
