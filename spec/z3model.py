"""The formal model of the prefill loops (and of the decode prefetch), in z3.

Read top-down; the sections are:

1. Encodings. One function per rule template `kind` of spec/rules.toml (and spec/decode_rules.toml)
   turns a rule into z3 obligations over a *universe* of events: each event has a position, a
   thread, an existence flag and its fields. The same functions serve two kinds of universe:
     - symbolic ones (ModelUniverse: K batches of a prefill workload; DecodeUniverse: a few
       iterations of the decode prefetch), everything symbolic — for proofs — and
     - TraceUniverse: the events of one trace, positions tied to `seq` — for checking
       (checker/z3check.py).
   So proofs and the z3 trace checker read the rules through one encoding, and that checker agreeing
   with the fast linear one (tests/test_z3_checker.py) is evidence the proofs are about the same rules.
   New kinds plug in with `register_kind`.
2. The engine model: what each prefill mode's loop code (engine/prefill/loops.py) does, in which
   order, on which thread, and the synchronisation between the threads (capacity-1 queues, stream
   events, the WAR barrier). A model of the code, not of the rules, in named groups ("E:...") so that
   unsat cores say which part of the engine a proof needed. The decode prefetch has its own universe and
   loop model (DecodeUniverse, decode_engine), near the end of section 2.
3. Properties and queries: the seeds' safety claims as formulas over positions and objects, stated
   without the rules; `Model` answers sat/unsat questions on (frame ∧ chosen groups) incrementally;
   `prove`, `mode_table`, `ahead_steady_table` build the answers `pdo spec` prints.
4. Traces as models: the workload of a trace and whether it is a schedule of the loop model.

A schedule is an interleaving: events at distinct positions ("a < b": a happened before b). Symbolic
positions are reals, and only events that some constraint compares are kept apart (see `frame`).
"""
from __future__ import annotations

import bisect
import time
from collections import defaultdict
from dataclasses import dataclass, field

import z3

from . import LOOP_MODES, load_events, load_rules

SCHED, FWD = 0, 1                      # host threads of the model
THREAD_IDS = {"scheduler": SCHED, "forward": FWD}
THREAD_NAMES = {v: k for k, v in THREAD_IDS.items()}
STREAM = 2                             # device work (schedule and forward streams): hidden events
MODES = LOOP_MODES["prefill"]
THREAD_MODES = ("thread", "ahead")


# ---- static-or-symbolic logic --------------------------------------------------------------------
# In a trace most facts (thread, obj, slot) are plain Python values; in the model they are z3 terms.
# These helpers fold Python booleans away so the trace encodings stay small, and build z3 terms
# through the C API directly: the Python API's argument coercion costs 4x more, which is most of
# the time on a long trace.

_CTX = z3.main_ctx()


def _is_z3(x) -> bool:
    return isinstance(x, z3.ExprRef)


def _bool(ast):
    return z3.BoolRef(ast, _CTX)


def _nary(mk, xs):
    return _bool(mk(_CTX.ref(), len(xs), (z3.Ast * len(xs))(*[x.as_ast() for x in xs])))


def conj(*xs):
    out = []
    for x in xs:
        if x is True:
            continue
        if x is False:
            return False
        out.append(x)
    return True if not out else out[0] if len(out) == 1 else _nary(z3.Z3_mk_and, out)


def disj(*xs):
    out = []
    for x in xs:
        if x is False:
            continue
        if x is True:
            return True
        out.append(x)
    return False if not out else out[0] if len(out) == 1 else _nary(z3.Z3_mk_or, out)


def neg(x):
    return (not x) if isinstance(x, bool) else _bool(z3.Z3_mk_not(_CTX.ref(), x.as_ast()))


def implies(a, b):
    if a is False or b is True:
        return True
    if a is True:
        return b
    if b is False:
        return neg(a)
    return _bool(z3.Z3_mk_implies(_CTX.ref(), a.as_ast(), b.as_ast()))


def eq(a, b):
    """Python == on plain values (a bool), z3 == as soon as one side is a term."""
    return a == b


def as_z3(x):
    return z3.BoolVal(x) if isinstance(x, bool) else x


# ---- events and universes ------------------------------------------------------------------------

class Ev:
    """One event of a universe. `f` holds the trace fields (rid, obj, slot, value, digest, ...)."""
    __slots__ = ("name", "batch", "key", "pos", "thread", "exists", "f", "hidden", "seq", "cmp")

    def __init__(self, name, batch, key, pos, thread, exists, f, hidden=False, seq=None, cmp=None):
        self.name, self.batch, self.key, self.pos = name, batch, key, pos
        self.thread, self.exists, self.f, self.hidden, self.seq = thread, exists, f, hidden, seq
        self.cmp = cmp   # model universe: the set of compared pairs, for the frame's distinctness

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
    args = ",".join(f"{k}={f[k]}" for k in ("batch", "rid", "slot", "value", "obj", "digest", "tokens", "pages") if k in f)
    return f"{name}({args})"


def lt(a: Ev, b: Ev):
    if a.cmp is not None:
        a.cmp.add((a, b))
    return _bool(z3.Z3_mk_lt(_CTX.ref(), a.pos.as_ast(), b.pos.as_ast()))


class Universe:
    """Events and the look-ups the encodings use. The base class is the symbolic one: candidate
    sets are everything (positions are unknown); TraceUniverse narrows them by known positions."""
    ordered = False

    def __init__(self):
        self.events: list[Ev] = []     # observable (trace-level) events
        self.hidden: list[Ev] = []     # engine-internal points: queue puts/gets, device work, ...
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
    # candidates than needed is always exact. Symbolic: every candidate. Ordered (a trace): long lists
    # (all events of a name or of a thread) are narrowed by the known positions, where the narrowing
    # only drops obligations the others imply (see each encoding); short per-batch, per-request lists
    # are kept whole so that an unsat core can name the event that came too late.
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
            ev = Ev(e["ev"], b, ("#", e["seq"]), z3.Int(f"p{e['seq']}"), e["thread"], True, f, seq=e["seq"])
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
        """The admit and send events of the prefill trace of DP rank header["dp_rank"], as facts for the
        cross rules (never in `events`: their seqs are another file's)."""
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
                self._remote[e["ev"]].append(Ev(e["ev"], None, ("remote", rank, e["seq"]), None, e["thread"], True, f))

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


# ---- one encoding per rule template kind ---------------------------------------------------------
# Each yields (formula, events) obligations; a rule holds iff all its obligations do. `events` are the
# events whose facts the obligation reads (the trace checker reports them in unsat cores). The
# comment above each function is the semantics, matching checker/linear.py.

def ex(e):
    return e.exists


def th(e):
    return e.thread


def fld(e, name):
    return e.f[name]


# fifo: each listed event at most once per batch, only after an admit of its batch, in batch order.
def enc_fifo(rule, U):
    for name in rule["events"]:
        per_batch = {}
        for e in U.named(name):
            per_batch.setdefault(e.batch, []).append(e)
        for b, es in per_batch.items():
            for e1, e2 in zip(es, es[1:]):
                yield neg(conj(ex(e1), ex(e2))), [e1, e2]
            if name != "admit":
                for e in es:
                    admits = U.among(U.occ("admit", b), hi=e)
                    yield implies(ex(e), disj(*[conj(ex(a), lt(a, e)) for a in admits])), [e, *admits]
        firsts = [per_batch[b][0] for b in sorted(per_batch)]
        pairs = list(zip(firsts, firsts[1:])) if U.ordered else \
            [(x, y) for i, x in enumerate(firsts) for y in firsts[i + 1:]]
        for x, y in pairs:
            yield implies(conj(ex(x), ex(y)), lt(x, y)), [x, y]


# complete: every admitted batch has each listed event.
def enc_complete(rule, U):
    for b in U.admitted():
        for name in rule["events"]:
            yield disj(*[ex(e) for e in U.occ(name, b)]), [U.at("admit", b)]


def _open_until(U, y, x, end_name):
    """The span opened by begin y is closed by an end of y's batch strictly between y and x."""
    ends = U.among(U.occ(end_name, y.batch), lo=y, hi=x)
    return disj(*[conj(ex(e), lt(y, e), lt(e, x)) for e in ends]), ends


# disjoint: no begin while any span [begin(N), end(N)] is open. A span is open at p when the latest
# of its batch's begin/end events before p is a begin; equivalently, between every begin and the next
# begin there is an end of the first one's batch (consecutive pairs suffice when positions are known).
def enc_disjoint(rule, U):
    begin, end = rule["span"]
    for y, x in U.succ_pairs(U.named(begin)):
        closed, ends = _open_until(U, y, x, end)
        yield implies(conj(ex(y), ex(x), lt(y, x)), closed), [y, x, *ends]


# outside: no `ev` while a span is open: after each begin, an end of its batch comes before any ev.
def enc_outside(rule, U):
    begin, end = rule["span"]
    evs = U.named(rule["ev"])
    for y in U.named(begin):
        for x in U.first_after(y, evs):
            closed, ends = _open_until(U, y, x, end)
            yield implies(conj(ex(y), ex(x), lt(y, x)), closed), [y, x, *ends]


# order: for each admitted N (and with `when`, only where when[0] precedes when[1]), consecutive chain
# elements that exist are in increasing order; the first `same_thread_prefix` ones on one thread.
def enc_order(rule, U):
    chain = [(name, off) for name, off in rule["chain"]]
    when = rule.get("when")
    same = len(chain) if rule.get("same_thread") else rule.get("same_thread_prefix", 0)
    for n in U.admitted():
        guard, refs = True, []
        if when:
            (a, ao), (b, bo) = when
            wa, wb = U.at(a, n + ao), U.at(b, n + bo)
            if wa is None or wb is None:
                continue
            guard, refs = conj(ex(wa), ex(wb), lt(wa, wb)), [wa, wb]
        got = [(i, U.at(name, n + off)) for i, (name, off) in enumerate(chain)]
        got = [(i, e) for i, e in got if e is not None]
        for k1 in range(len(got)):
            for k2 in range(k1 + 1, len(got)):
                (i1, e1), (i2, e2) = got[k1], got[k2]
                between = [e for _, e in got[k1 + 1:k2]]
                cond = conj(guard, ex(e1), ex(e2), *[neg(ex(e)) for e in between])
                body = conj(lt(e1, e2), eq(th(e1), th(e2)) if i2 < same else True)
                yield implies(cond, body), [e1, e2, *refs]


# adjacent: on `thread`, the event right after first(N) is then(N).
def enc_adjacent(rule, U):
    T = U.tid(rule["thread"])
    for x in U.named(rule["first"]):
        if U.ordered:
            nxt = U.on_thread_between(T, x, None)[:1] if x.thread == T else []
            cands = [y for y in nxt if y.name == rule["then"] and y.batch == x.batch]
        else:
            cands = U.occ(rule["then"], x.batch)
        alts = []
        for y in cands:
            others = [z for z in U.on_thread_between(T, x, y) if z is not x and z is not y]
            quiet = conj(*[neg(conj(ex(z), eq(th(z), T), lt(x, z), lt(z, y))) for z in others])
            alts.append(conj(ex(y), eq(th(y), T), lt(x, y), quiet))
        yield implies(conj(ex(x), eq(th(x), T)), disj(*alts)), [x, *cands]


# within: every ev(N) lies between after(N) and before(N), on `thread` or on the thread of same_thread_as(N).
def enc_within(rule, U):
    for x in U.named(rule["ev"]):
        b = x.f.get("batch", x.batch)
        lo, hi = U.at(rule["after"], b), U.at(rule["before"], b)
        if lo is None or hi is None:
            yield neg(ex(x)), [x]
            continue
        refs = [x, lo, hi]
        if rule.get("thread"):
            want = U.tid(rule["thread"])
        else:
            ref = U.at(rule["same_thread_as"], b)
            if ref is None:
                yield neg(ex(x)), refs
                continue
            want = th(ref)
            refs.append(ref)
        yield implies(ex(x), conj(ex(lo), ex(hi), lt(lo, x), lt(x, hi), eq(th(x), want))), refs


# thread: listed events run on `thread` (or never on `not_thread`).
def enc_thread(rule, U):
    for name in rule["events"]:
        for e in U.named(name):
            if rule.get("thread") is not None:
                yield implies(ex(e), eq(th(e), U.tid(rule["thread"]))), [e]
            if rule.get("not_thread") is not None:
                yield implies(ex(e), neg(eq(th(e), U.tid(rule["not_thread"])))), [e]


# equal: field of the first a(N) equals field of the first b(N).
def enc_equal(rule, U):
    a, b, name = rule["a"], rule["b"], rule["field"]
    for bt in U.batches_of(a):
        x, y = U.at(a, bt), U.at(b, bt)
        if y is not None:
            yield implies(conj(ex(x), ex(y)), eq(fld(x, name), fld(y, name))), [x, y]


def _running(U, x, evs, inc, strict):
    """Σ ±1 over the inc/dec events on x's object up to x (before x when strict)."""
    terms, refs = [], []
    for y in evs:
        same = eq(fld(y, "obj"), fld(x, "obj"))
        if same is False:
            continue
        if y is x:
            if not strict:
                terms.append(1 if y.name == inc else -1)
            continue
        refs.append(y)
        c = conj(ex(y), same, lt(y, x))
        if c is not False:
            terms.append(z3.If(as_z3(c), 1, 0) * (1 if y.name == inc else -1))
    return (z3.Sum(terms) if terms else z3.IntVal(0)), refs


def _total(U, x, evs, inc):
    terms = []
    for y in evs:
        c = conj(ex(y), eq(fld(y, "obj"), fld(x, "obj")))
        if c is not False:
            terms.append(z3.If(as_z3(c), 1, 0) * (1 if y.name == inc else -1))
    return z3.Sum(terms) if terms else z3.IntVal(0)


def _by_obj(U, evs):
    """Trace: group by the static object; model: one group (objects are symbolic)."""
    if not U.ordered:
        return {None: evs}
    groups = defaultdict(list)
    for e in evs:
        groups[e.f["obj"]].append(e)
    return groups


# counter: inc/dec move the counter of their object by one, reported in `value`, never below zero,
# zero at the end; each on an object that `owner` allocated for that rid before it.
def enc_counter(rule, U):
    inc, dec, owner = rule["inc"], rule["dec"], rule["owner"]
    owners = defaultdict(list)
    for a in U.named(owner):
        owners[a.rid].append(a)
    for _, evs in _by_obj(U, U.named(inc) + U.named(dec)).items():
        evs = sorted(evs, key=lambda e: e.seq) if U.ordered else evs
        for x in evs:
            own = U.among(owners.get(x.rid, []), hi=x)
            owned = disj(*[conj(ex(a), lt(a, x), eq(fld(a, "obj"), fld(x, "obj"))) for a in own])
            run, refs = _running(U, x, evs, inc, strict=False)
            body = conj(owned, fld(x, "value") == run, fld(x, "value") >= 0, _total(U, x, evs, inc) == 0)
            yield implies(ex(x), body), [x, *own, *refs]


# lifecycle/pairing: per rid, acquire and release alternate (starting with acquire, ending with
# release), each release on the object and slot of the acquire before it; and an acquired slot is
# not acquired again before its holder's release.
def _pairing(rule, U):
    acq, rel = rule["acquire"], rule["release"]
    per_rid = defaultdict(list)
    for e in U.named(acq) + U.named(rel):
        per_rid[e.rid].append(e)
    if U.ordered:
        for lst in per_rid.values():
            lst.sort(key=lambda e: e.seq)

    def nothing_between(mine, a, b):
        return conj(*[neg(conj(ex(w), lt(a, w), lt(w, b))) for w in U.among(mine, lo=a, hi=b)])

    for y in U.named(acq):
        mine = per_rid[y.rid]
        alts, refs = [], []
        for z in U.first_after(y, mine):
            refs.append(z)
            if z.name == rel:
                alts.append(conj(ex(z), lt(y, z), eq(fld(z, "obj"), fld(y, "obj")), eq(fld(z, "slot"), fld(y, "slot")),
                                 nothing_between(mine, y, z)))
        yield implies(ex(y), disj(*alts)), [y, *refs]
    for x in U.named(rel):
        mine = per_rid[x.rid]
        cands = U.last_before(x, mine)
        alts = [conj(ex(z), lt(z, x), nothing_between(mine, z, x)) for z in cands if z.name == acq]
        yield implies(ex(x), disj(*alts)), [x, *cands]
    slots = defaultdict(list) if U.ordered else {None: U.named(acq)}
    if U.ordered:
        for e in U.named(acq):
            slots[e.f["slot"]].append(e)
    for lst in slots.values():
        for y, x in U.succ_pairs(lst):
            later = U.among([w for w in per_rid[y.rid] if w is not y], lo=y, hi=x)
            freed = disj(*[conj(ex(w), lt(y, w), lt(w, x)) for w in later])
            yield implies(conj(ex(y), ex(x), lt(y, x), eq(fld(y, "slot"), fld(x, "slot"))), freed), [y, x, *later]


# lifecycle/after_done: a release of rid comes after the processing of every batch admitted with rid
# before it, no batch admits rid after it, its object has no middle chunk in flight, and some KV of
# rid was sent before it.
def _after_done(rule, U):
    rel, sent = rule["release"], rule["sent"]
    inc, dec = rule["counter"]
    admits = defaultdict(list)
    for a in U.named("admit"):
        for r in a.f["rids"]:
            admits[r].append(a)
    sends = defaultdict(list)
    for s in U.named(sent):
        sends[s.rid].append(s)
    counted = _by_obj(U, U.named(inc) + U.named(dec))
    for x in U.named(rel):
        for a in admits.get(x.rid, []):
            done = U.among([p for ev in rule["processed"] for p in U.occ(ev, a.batch)], hi=x)
            yield implies(conj(ex(x), ex(a)), conj(lt(a, x), disj(*[conj(ex(p), lt(p, x)) for p in done]))), [x, a, *done]
        evs = counted.get(x.f["obj"] if U.ordered else None, [])
        run, refs = _running(U, x, U.among(evs, hi=x), inc, strict=True)
        yield implies(ex(x), run <= 0), [x, *refs]
        before = U.among(sends.get(x.rid, []), hi=x)
        yield implies(ex(x), disj(*[conj(ex(s), lt(s, x)) for s in before])), [x, *before]


def enc_lifecycle(rule, U):
    return _pairing(rule, U) if rule["check"] == "pairing" else _after_done(rule, U)


# page_count: pages == ceil(tokens / page_size) where an event carries both.
def enc_page_count(rule, U):
    ps = U.page_size
    for name in rule["events"]:
        for e in U.named(name):
            if "tokens" in e.f and "pages" in e.f:
                t, p = e.f["tokens"], e.f["pages"]
                ok = (p == -(-t // ps)) if not (_is_z3(t) or _is_z3(p)) else z3.And(p * ps >= t, (p - 1) * ps < t)
                yield implies(ex(e), ok), [e]


# each_in_span: for every batch N and every rid its admit lists, some ev for rid falls strictly between
# a begin(N) and a later end(N), on the begin's thread.
def enc_each_in_span(rule, U):
    begin, end = rule["span"]
    per_rid = defaultdict(list)
    for e in U.named(rule["ev"]):
        per_rid[e.rid].append(e)
    for a in U.named("admit"):
        for y in U.occ(begin, a.batch):
            for z in U.occ(end, a.batch):
                for rid in a.f["rids"]:
                    inside = U.among(per_rid.get(rid, []), lo=y, hi=z)
                    yield implies(conj(ex(a), ex(y), ex(z), lt(y, z)),
                                  disj(*[conj(ex(e), eq(th(e), th(y)), lt(y, e), lt(e, z)) for e in inside])), \
                        [a, y, z, *inside]


# chunk_sent: where admits carry `chunks`, each send overlapping a batch's chunk of a request comes
# after that batch's `done` event (or, with device_wait, its `started` event) and before the request's
# release; the sends that exist cover the chunk (linear: ChunkSent).
def enc_chunk_sent(rule, U):
    sends = [s for name in rule["sends"] for s in U.named(name)
             if isinstance(s.f.get("start"), int) and isinstance(s.f.get("tokens"), int)]
    releases = U.named(rule["release"])
    for a in U.named("admit"):
        chunks = a.f.get("chunks")
        if not isinstance(chunks, dict):
            continue
        done, started = U.occ(rule["done"], a.batch), U.occ(rule["started"], a.batch)
        for rid, rng in chunks.items():
            if not (isinstance(rng, list) and len(rng) == 2 and rng[0] < rng[1]):
                continue
            lo, hi = rng
            over = [s for s in sends if s.rid == rid and s.f["start"] < hi and s.f["start"] + s.f["tokens"] > lo]
            for s in over:
                waits = started if s.f.get("device_wait") is True else []
                ok = disj(*[conj(ex(d), lt(d, s)) for d in done + waits])
                yield implies(conj(ex(a), ex(s)), ok), [a, s, *done, *waits]
                for r in (r for r in releases if r.rid == rid):
                    yield implies(conj(ex(s), ex(r)), lt(s, r)), [s, r]
            covered, at = True, lo
            for s in sorted(over, key=lambda s: s.f["start"]):
                if s.f["start"] > at:
                    covered = False
                    break
                at = max(at, s.f["start"] + s.f["tokens"])
            if not covered or at < hi:
                yield neg(ex(a)), [a, *over]


# in_span: every ev for rid falls in a span whose begin is the latest begin/end on its thread before
# it, of a batch whose latest admit before it lists rid.
def enc_in_span(rule, U):
    begin, end = rule["span"]
    spans = U.named(begin) + U.named(end)
    if U.ordered:
        per_thread = defaultdict(list)
        for e in spans:
            per_thread[e.thread].append(e)
        for lst in per_thread.values():
            lst.sort(key=lambda e: e.seq)
    for x in U.named(rule["ev"]):
        cands = U.last_before(x, per_thread.get(x.thread, [])) if U.ordered else U.named(begin)
        alts, refs = [], list(cands)
        for y in cands:
            if y.name != begin:
                continue
            quiet = conj(*[neg(conj(ex(z), eq(th(z), th(x)), lt(y, z), lt(z, x)))
                           for z in (U.among(spans, lo=y, hi=x) if not U.ordered else [])])
            adm = U.last_before(x, U.occ("admit", y.batch))   # the admit in force at x
            member = disj(*[conj(ex(a), lt(a, x), x.rid in a.f["rids"],
                                 *[neg(conj(ex(a2), lt(a, a2), lt(a2, x))) for a2 in adm if a2 is not a])
                            for a in adm])
            refs += adm
            alts.append(conj(ex(y), eq(th(y), th(x)), lt(y, x), quiet, member))
        yield implies(ex(x), disj(*alts)), [x, *refs]


ENCODERS = {"fifo": enc_fifo, "complete": enc_complete, "disjoint": enc_disjoint, "order": enc_order,
            "adjacent": enc_adjacent, "outside": enc_outside, "within": enc_within, "thread": enc_thread,
            "equal": enc_equal, "counter": enc_counter, "lifecycle": enc_lifecycle,
            "page_count": enc_page_count, "in_span": enc_in_span, "each_in_span": enc_each_in_span,
            "chunk_sent": enc_chunk_sent}


# ---- the decode kinds of spec/decode_rules.toml (checker/decode_templates.py) ---------------------
# Prefetched DP-rank queries, one per bootstrap address: a prefetch_submit is outstanding until a
# prefetch_cancel or a resolve of its address names its qid. Rooms are pending from req_add until
# receiver_init or req_abort; a room's rank is known from the first resolve that answers it.

def _rooms_of(e):
    r = e.f.get("rooms")
    return tuple(r) if isinstance(r, (list, tuple)) else ()


def _answers(e) -> dict:
    res = e.f.get("result")
    out = {}
    for k, v in (res.items() if isinstance(res, dict) else ()):
        try:
            out[int(k)] = v
        except (TypeError, ValueError):
            pass
    return out


def _by(evs, key):
    out = defaultdict(list)
    for e in evs:
        out[key(e)].append(e)
    return out


def _latest(U, y, x, same):
    """y is the latest of `same` before x (known statically in a trace)."""
    if U.ordered:
        return True
    return conj(*[neg(conj(ex(z), lt(y, z), lt(z, x))) for z in same if z is not y and z is not x])


def _outstanding(U, x, subs, closers):
    """A query of this address is outstanding just before x: its latest submit is not yet closed."""
    alts, refs = [], []
    for y in U.last_before(x, subs):
        mine = [z for z in closers if z.f.get("qid") == y.f["qid"]]
        refs += [y, *mine]
        closed = disj(*[conj(ex(z), lt(y, z), lt(z, x)) for z in mine])
        alts.append(conj(ex(y), lt(y, x), _latest(U, y, x, subs), neg(closed)))
    return disj(*alts), refs


def _query_state(U):
    subs = _by(U.named("prefetch_submit"), lambda e: e.f["addr"])
    closers = _by([e for e in U.named("prefetch_cancel") + U.named("resolve") if e.f.get("qid") is not None],
                  lambda e: e.f["addr"])
    if U.ordered:
        for lst in closers.values():
            lst.sort(key=lambda e: e.seq)
    return subs, closers


def _before_any(U, x, cands):
    return disj(*[conj(ex(a), lt(a, x)) for a in cands])


# one_inflight: no prefetch_submit for an address while one of its queries is outstanding. On a symbolic
# universe, the equivalent pairwise form (on a total order, "the latest earlier submit was closed before
# each submit" holds for every submit iff every earlier submit was closed before each later one): the
# "latest" form makes z3 enumerate orders of the submits.
def enc_one_inflight(rule, U):
    subs, closers = _query_state(U)
    for a, lst in subs.items():
        if not U.ordered:
            for y in lst:
                for x in lst:
                    if x is not y:
                        mine = [z for z in closers.get(a, []) if z.f.get("qid") == y.f["qid"]]
                        closed = disj(*[conj(ex(z), lt(y, z), lt(z, x)) for z in mine])
                        yield implies(conj(ex(y), ex(x), lt(y, x)), closed), [x, y, *mine]
            continue
        for x in lst:
            out, refs = _outstanding(U, x, [y for y in lst if y is not x], closers.get(a, []))
            yield implies(ex(x), neg(out)), [x, *refs]


# published_first: every query_begin and prefetch_submit to an address after a prefill_info that saw
# it published.
def enc_published_first(rule, U):
    published = _by([e for e in U.named("prefill_info") if e.f.get("published") is True], lambda e: e.f["addr"])
    for x in U.named("query_begin") + U.named("prefetch_submit"):
        cands = published.get(x.f["addr"], [])
        yield implies(ex(x), _before_any(U, x, cands)), [x, *cands]


# unknown_rooms: a query (unless its qid was cancelled before it began) asks for no room that a
# resolve answered before it.
def enc_unknown_rooms(rule, U):
    answered = defaultdict(list)
    for r in U.named("resolve"):
        for room in _answers(r):
            answered[room].append(r)
    cancels = _by(U.named("prefetch_cancel"), lambda e: e.f["qid"])
    for x in U.named("query_begin"):
        cancelled = _before_any(U, x, cancels.get(x.f["qid"], []))
        known = [r for room in _rooms_of(x) for r in answered.get(room, [])]
        yield implies(conj(ex(x), neg(cancelled)), neg(_before_any(U, x, known))), \
            [x, *cancels.get(x.f["qid"], []), *known]


def _pending(U, x, adds, gone):
    """Some room of this address is pending at x: added before x, not initialised or aborted since."""
    alts = []
    for a in adds:
        ends = gone.get(a.f["room"], [])
        alts.append(conj(ex(a), lt(a, x), neg(disj(*[conj(ex(g), lt(a, g), lt(g, x)) for g in ends]))))
    return disj(*alts)


# no_stale: at every prefetch_end, each address with an outstanding query has a pending room.
def enc_no_stale(rule, U):
    subs, closers = _query_state(U)
    adds = _by(U.named("req_add"), lambda e: e.f["addr"])
    gone = _by(U.named("receiver_init") + U.named("req_abort"), lambda e: e.f["room"])
    for x in U.named("prefetch_end"):
        for a, lst in subs.items():
            out, refs = _outstanding(U, x, lst, closers.get(a, []))
            if out is False:
                continue
            yield implies(conj(ex(x), out), _pending(U, x, adds.get(a, []), gone)), [x, *refs]


# release: at release_memory no query is outstanding; between it and the next resume_memory no
# prefetch_submit, sync query_begin, prefill_info or receiver_init. (Symbolic universes: the pairwise
# form, as for one_inflight.)
def enc_release(rule, U):
    subs, closers = _query_state(U)
    resumes = U.named("resume_memory")
    releases = U.named("release_memory")
    for x in releases:
        for a, lst in subs.items():
            if not U.ordered:   # equivalently: each earlier submit was closed before x, or another followed it
                for y in lst:
                    mine = [z for z in closers.get(a, []) if z.f.get("qid") == y.f["qid"]]
                    closed = disj(*[conj(ex(z), lt(y, z), lt(z, x)) for z in mine])
                    later = disj(*[conj(ex(w), lt(y, w), lt(w, x)) for w in lst if w is not y])
                    yield implies(conj(ex(x), ex(y), lt(y, x)), disj(closed, later)), [x, y, *mine]
                continue
            out, refs = _outstanding(U, x, lst, closers.get(a, []))
            if out is not False:
                yield implies(ex(x), neg(out)), [x, *refs]
    asks = U.named("prefetch_submit") + U.named("receiver_init") + U.named("prefill_info") + \
        [q for q in U.named("query_begin") if q.f.get("source") == "sync"]
    for x in asks:
        for r in U.last_before(x, releases):
            resumed = disj(*[conj(ex(m), lt(r, m), lt(m, x)) for m in resumes])
            yield implies(conj(ex(x), ex(r), lt(r, x)), resumed), [x, r, *resumes]


# init_once: every resolve agrees with the first answer for a room; a receiver_init comes after its
# room was answered, with that rank, and once; a finished request's room was initialised before.
def enc_init_once(rule, U):
    answered = defaultdict(list)
    for r in U.named("resolve"):
        for room, rank in _answers(r).items():
            answered[room].append((r, rank))
    # The published parallel info alone decides a rank (0 with one DP rank, room mod dp_size when the
    # prefill follows the room): such a prefill_info answers every room of its address.
    addr_of = {e.f["room"]: e.f["addr"] for e in U.named("req_add")}
    for info in U.named("prefill_info"):
        dp, follow = info.f.get("dp_size"), info.f.get("follow_bootstrap_room")
        if info.f.get("published") is not True or not isinstance(dp, int) or not (dp == 1 or (follow and dp)):
            continue
        for room, addr in addr_of.items():
            if addr == info.f["addr"] and isinstance(room, int):
                answered[room].append((info, 0 if dp == 1 else room % dp))
    inits = _by(U.named("receiver_init"), lambda e: e.f["room"])
    for room, lst in answered.items():
        for (r1, k1), (r2, k2) in zip(lst, lst[1:]) if U.ordered else \
                [(p, q) for p in lst for q in lst if p is not q]:
            same = eq(k1, k2)
            if same is not True:
                yield implies(conj(ex(r1), ex(r2), lt(r1, r2)), same), [r1, r2]
    for room, lst in inits.items():
        for x in lst:
            others = [y for y in lst if y is not x]
            ans = answered.get(room, [])
            first_ok = disj(*[conj(ex(r), lt(r, x), eq(k, x.f["rank"]),
                                   *[neg(conj(ex(r2), lt(r2, r))) for r2, _ in ans if r2 is not r]) for r, k in ans])
            yield implies(ex(x), conj(first_ok, neg(_before_any(U, x, others)))), [x, *[r for r, _ in ans], *others]
    for x in U.named("req_done"):
        cands = inits.get(x.f["room"], [])
        yield implies(ex(x), _before_any(U, x, cands)), [x, *cands]


# init_fifo: no receiver_init while an older request (added earlier) has a known rank and is neither
# initialised nor aborted.
def enc_init_fifo(rule, U):
    adds = U.named("req_add")
    answered = defaultdict(list)
    for r in U.named("resolve"):
        for room in _answers(r):
            answered[room].append(r)
    gone = _by(U.named("receiver_init") + U.named("req_abort"), lambda e: e.f["room"])
    first_add = {}
    for a in adds:
        first_add.setdefault(a.f["room"], a)
    for x in U.named("receiver_init"):
        room = x.f["room"]
        mine = first_add.get(room)
        for o in adds:
            if o.f["room"] == room:
                continue
            older = conj(ex(o), lt(o, x), lt(o, mine)) if mine is not None else conj(ex(o), lt(o, x))
            known = _before_any(U, x, answered.get(o.f["room"], []))
            done = _before_any(U, x, [g for g in gone.get(o.f["room"], []) if g is not x])
            if known is False:
                continue
            yield implies(conj(ex(x), older, known), done), \
                [x, o, *([mine] if mine else []), *answered.get(o.f["room"], []), *gone.get(o.f["room"], [])]


# kv_recv: a room's KV comes after its receiver_init, from the rank of the latest one before it.
def enc_kv_recv(rule, U):
    inits = _by(U.named("receiver_init"), lambda e: e.f["room"])
    for x in U.named("kv_recv"):
        lst = inits.get(x.f["room"], [])
        alts = [conj(ex(y), lt(y, x), _latest(U, y, x, lst), eq(y.f["rank"], x.f["rank"])) for y in U.last_before(x, lst)]
        yield implies(ex(x), disj(*alts)), [x, *lst]


# req_end: each req_done/req_abort follows the request's req_add, is its only end, and a req_done
# follows its kv_done; every request added ends.
def enc_req_end(rule, U):
    adds = _by(U.named("req_add"), lambda e: e.f["rid"])
    kv = _by(U.named("kv_done"), lambda e: e.f["rid"])
    ends = U.named("req_done") + U.named("req_abort")
    if U.ordered:
        ends.sort(key=lambda e: e.seq)
    by_rid = _by(ends, lambda e: e.f["rid"])
    for x in ends:
        rid = x.f["rid"]
        others = [y for y in by_rid[rid] if y is not x]
        body = conj(_before_any(U, x, adds.get(rid, [])), neg(_before_any(U, x, others)),
                    _before_any(U, x, kv.get(rid, [])) if x.name == "req_done" else True)
        yield implies(ex(x), body), [x, *adds.get(rid, []), *others, *(kv.get(rid, []) if x.name == "req_done" else [])]
    for rid, lst in adds.items():
        for a in lst:
            yield implies(ex(a), disj(*[ex(y) for y in by_rid.get(rid, [])])), [a]


# prefetch_top: on `thread`, each iter_begin is followed by prefetch_begin of the same iteration, a
# prefetch_begin comes only right after an iter_begin, and no iteration begins inside a prefetch call.
# With the header's prefetch off: no prefetch_begin or prefetch_submit at all.
def enc_prefetch_top(rule, U):
    T = U.tid(rule.get("thread", "scheduler"))
    enabled = getattr(U, "header", {}).get("prefetch", True)
    if not enabled:
        for x in U.named("prefetch_begin") + U.named("prefetch_submit"):
            yield neg(conj(ex(x), eq(th(x), T))), [x]
        return
    calls = U.named("prefetch_begin") + U.named("prefetch_end")
    if U.ordered:
        calls = sorted([e for e in calls if e.thread == T], key=lambda e: e.seq)
    for x in U.named("iter_begin"):
        nxt = U.on_thread_between(T, x, None)[:1] if U.ordered else U.named("prefetch_begin")
        alts = [conj(ex(y), eq(th(y), T), lt(x, y), y.name == "prefetch_begin", y.f.get("iter") == x.f["iter"],
                     *[neg(conj(ex(z), eq(th(z), T), lt(x, z), lt(z, y))) for z in U.on_thread_between(T, x, y)
                       if z is not x and z is not y]) for y in nxt]
        yield implies(conj(ex(x), eq(th(x), T)), disj(*alts)), [x, *nxt]
        for y in U.last_before(x, calls):
            if y.name == "prefetch_begin":
                quiet = conj(*[neg(conj(ex(z), eq(th(z), T), lt(y, z), lt(z, x))) for z in calls if z is not y]) \
                    if not U.ordered else True
                yield implies(conj(ex(x), eq(th(x), T), ex(y), eq(th(y), T), lt(y, x), quiet), False), [x, y]
    for y in U.named("prefetch_begin"):
        prev = U.last_before(y, U.on_thread(T)) if U.ordered else U.named("iter_begin")
        alts = [conj(ex(z), eq(th(z), T), lt(z, y), z.name == "iter_begin",
                     *[neg(conj(ex(w), eq(th(w), T), lt(z, w), lt(w, y))) for w in U.on_thread_between(T, z, y)
                       if w is not z and w is not y]) for z in prev]
        yield implies(conj(ex(y), eq(th(y), T)), disj(*alts)), [y, *prev]


# prefetch_match: a resolve from a prefetched answer (source prefetched or prefix) uses the latest query
# submitted under its qid, for its own address, not cancelled before it, asked for exactly its rooms
# (prefetched) or for a proper prefix of them (prefix: unless it failed, the tail was asked by exactly one
# sync query since the address's previous resolve). A sync resolve comes when no prefetched query of its
# address is outstanding, after exactly one sync query for its rooms since that previous resolve.
def _sync_window(U, x, resolves, syncs, want):
    """Exactly one sync query_begin of x's address since its previous resolve, and it asks for `want`."""
    others = [r for r in resolves if r is not x]
    prev = U.last_before(x, others) if U.ordered else others
    lo = prev[0].seq if U.ordered and prev else -1
    cands = [q for q in syncs if lo < q.seq < x.seq] if U.ordered else syncs
    inwin = [conj(ex(q), lt(q, x), *[neg(conj(ex(r), lt(q, r), lt(r, x))) for r in prev]) for q in cands]
    one = conj(disj(*inwin), *[neg(conj(inwin[i], inwin[j])) for i in range(len(cands)) for j in range(i + 1, len(cands))])
    asks = conj(*[implies(w, _rooms_of(q) == tuple(want)) for q, w in zip(cands, inwin)])
    return conj(one, asks), [*cands, *prev]


def enc_prefetch_match(rule, U):
    subs, closers = _query_state(U)
    by_qid = _by(U.named("prefetch_submit"), lambda e: e.f["qid"])
    cancels = _by(U.named("prefetch_cancel"), lambda e: e.f["qid"])
    resolves = _by(U.named("resolve"), lambda e: e.f["addr"])
    syncs = _by([e for e in U.named("query_begin") if e.f.get("source") == "sync"], lambda e: e.f["addr"])
    for x in U.named("resolve"):
        addr, rooms, src, qid = x.f["addr"], _rooms_of(x), x.f.get("source"), x.f.get("qid")
        if src in ("prefetched", "prefix"):
            mine = by_qid.get(qid, []) if qid is not None else []
            alts, refs = [], []
            for y in (U.last_before(x, mine) if U.ordered else mine):
                asked = _rooms_of(y)
                fits = asked == rooms if src == "prefetched" else 0 < len(asked) < len(rooms) and rooms[:len(asked)] == asked
                tail, trefs = True, []
                if fits and src == "prefix" and x.f.get("error") is None:
                    tail, trefs = _sync_window(U, x, resolves.get(addr, []), syncs.get(addr, []), rooms[len(asked):])
                refs += [y, *trefs]
                alts.append(conj(ex(y), lt(y, x), _latest(U, y, x, mine), y.f["addr"] == addr, fits, tail))
            gone = cancels.get(qid, []) if qid is not None else []
            yield implies(ex(x), conj(disj(*alts), neg(_before_any(U, x, gone)))), [x, *refs, *gone]
        elif src == "sync":
            out, refs = _outstanding(U, x, subs.get(addr, []), closers.get(addr, []))
            one, trefs = _sync_window(U, x, resolves.get(addr, []), syncs.get(addr, []), rooms)
            yield implies(ex(x), conj(neg(out), one)), [x, *refs, *trefs]
        else:
            yield neg(ex(x)), [x]


# ---- the cross-process kinds: a decode trace against the prefill traces of its DP ranks ---------------
# The prefill side enters as facts (`U.remote(name)`: its admit and send events, each with the
# `dp_rank` of its trace); cross rules compare no positions across processes.

# cross_rank: a receiver_init's rank is the one prefill rank whose trace admitted the request; a request
# no prefill trace admitted is an error only when every DP rank's trace is there.
def enc_cross_rank(rule, U):
    served = defaultdict(set)
    for a in U.remote("admit"):
        for rid in a.f["rids"]:
            served[rid].add(a.f["dp_rank"])
    local = {i.f["addr"] for i in U.named("prefill_info") if i.f.get("published") is True
             and isinstance(i.f.get("dp_size"), int) and (i.f["dp_size"] == 1 or i.f.get("follow_bootstrap_room"))}
    addr_of = {a.f["room"]: a.f["addr"] for a in U.named("req_add")}
    for x in U.named("receiver_init"):
        ranks = served.get(x.f["rid"])
        if not ranks:
            # a rank the parallel info decided is no route the server answered (linear: CrossRank)
            if U.dp_complete and addr_of.get(x.f["room"]) not in local:
                yield neg(ex(x)), [x]
            continue
        yield implies(ex(x), conj(len(ranks) == 1, disj(*[eq(x.f["rank"], r) for r in ranks]))), [x]


# cross_pages: at a req_done, the tokens and pages of its room's kv_recv events so far equal what the
# prefill rank of the room's latest receiver_init sent for that request (kv_send and prefix_send);
# skipped when that rank's trace is not there.
def enc_cross_pages(rule, U):
    sent = defaultdict(lambda: [0, 0])
    for s in U.remote("kv_send") + U.remote("prefix_send"):
        if "pages" in s.f:
            t = sent[(s.f["dp_rank"], s.f["rid"])]
            t[0] += s.f.get("tokens", 0)
            t[1] += s.f["pages"]
    inits = _by(U.named("receiver_init"), lambda e: e.f["room"])
    kvs = _by(U.named("kv_recv"), lambda e: e.f["room"])
    for x in U.named("req_done"):
        room = x.f["room"]
        lst, got = inits.get(room, []), kvs.get(room, [])
        if U.ordered:
            got = [k for k in got if k.seq < x.seq]
        tok = z3.Sum([z3.If(as_z3(conj(ex(k), lt(k, x))), k.f["tokens"], 0) for k in got]) if got else z3.IntVal(0)
        pag = z3.Sum([z3.If(as_z3(conj(ex(k), lt(k, x))), k.f["pages"], 0) for k in got]) if got else z3.IntVal(0)
        for y in (U.last_before(x, lst) if U.ordered else lst):
            rid, rank = y.f["rid"], y.f["rank"]
            seen = disj(*[eq(rank, r) for r in sorted(U.dp_ranks)])
            if seen is False:
                continue
            want = [(eq(rank, r), sent.get((r, rid), [0, 0])) for r in sorted(U.dp_ranks)]
            same = conj(*[implies(c, conj(tok == t, pag == p)) for c, (t, p) in want])
            yield implies(conj(ex(x), ex(y), lt(y, x), _latest(U, y, x, lst), seen), same), [x, y, *got]




ENCODERS.update({"one_inflight": enc_one_inflight, "published_first": enc_published_first,
                 "unknown_rooms": enc_unknown_rooms, "no_stale": enc_no_stale, "release": enc_release,
                 "init_once": enc_init_once, "init_fifo": enc_init_fifo, "kv_recv": enc_kv_recv,
                 "req_end": enc_req_end, "prefetch_top": enc_prefetch_top})


def register_kind(kind: str, encoder) -> None:
    """For new template kinds (the decode rules): `encoder(rule, universe)` yields (formula, events)."""
    ENCODERS[kind] = encoder


for _kind, _enc in (("prefetch_match", enc_prefetch_match), ("cross_rank", enc_cross_rank),
                    ("cross_pages", enc_cross_pages)):
    register_kind(_kind, _enc)


def obligations(rule, U, counts: dict | None = None):
    """The rule's obligations in U, trivially true ones left out (`counts[rule.id]` gets how many
    there were in all); None if its kind has no encoding."""
    enc = ENCODERS.get(rule.kind)
    if enc is None:
        return None
    every = list(enc(rule, U))
    if counts is not None:
        counts[rule.id] = len(every)
    return [(f, evs) for f, evs in every if f is not True]


def rule_formula(rule, U):
    obs = obligations(rule, U)
    return None if obs is None else conj(*[f for f, _ in obs])


# ---- the model universe: K batches of a workload, everything symbolic ------------------------------

@dataclass(frozen=True)
class Chunk:
    rid: str
    middle: bool = False   # not the request's last chunk: inflight_middle_chunks goes up at admission
    prefix: bool = False   # the request's first chunk, with a cached prefix whose KV is sent early


@dataclass(frozen=True)
class Workload:
    """Which request chunks each batch holds, in batch order (continuing chunk first, as SGLang)."""
    batches: tuple

    @staticmethod
    def canonical(k: int) -> "Workload":
        """Batch n holds the last chunk of r(n-1) and the first chunk of r(n), which has a cached
        prefix and is itself continued in batch n+1: every batch has a chunked request in flight
        across it, the case of the seed's middle-chunk and cached-prefix hazards."""
        out = []
        for n in range(k):
            chunks = [Chunk(f"r{n - 1}")] if n else []
            chunks.append(Chunk(f"r{n}", middle=n < k - 1, prefix=True))
            out.append(tuple(chunks))
        return Workload(tuple(out))

    @property
    def K(self) -> int:
        return len(self.batches)

    def requests(self) -> list[str]:
        seen = []
        for chunks in self.batches:
            seen += [c.rid for c in chunks if c.rid not in seen]
        return seen

    def holding(self, rid) -> list[int]:
        return [n for n, chunks in enumerate(self.batches) if any(c.rid == rid for c in chunks)]

    def new_in(self, n) -> list[str]:
        return [c.rid for c in self.batches[n] if self.holding(c.rid)[0] == n]


def _vocab():
    return load_events()["prefill"]


def batch_event_names() -> list[str]:
    """Events that belong to a batch and not to a request, from spec/events.toml."""
    return [ev for ev, spec in _vocab().items() if "batch" in spec["fields"] and "rid" not in spec["fields"]]


class SymbolicUniverse(Universe):
    """Events with symbolic position, thread, existence and fields, made by key."""

    def __init__(self, page_size: int = 16):
        super().__init__()
        self.page_size = page_size
        self.by_key: dict = {}
        self.compared: set = set()   # (a, b) for every a < b some constraint states

    def _mk(self, name, batch, key, f, vocab, always=False, extra=()):
        lab = key_label(key)
        for fname in list(vocab[name]["fields"]) + list(extra):
            if fname not in f and fname not in ("batch", "rid", "rids"):
                f[fname] = z3.Int(f"{fname}:{lab}")
        e = Ev(name, batch, key, z3.Real(f"t:{lab}"), z3.Int(f"thread:{lab}"),
               True if always else z3.Bool(f"emitted:{lab}"), f, cmp=self.compared)
        self.by_key[key] = self.add(e)
        return e

    def hide(self, key, thread) -> Ev:
        """An engine-internal point (queue put/get, device work, ...): not in traces, not in rules."""
        lab = key_label(key)
        e = Ev(key[0], None, key, z3.Real(f"t:{lab}"), thread, True, {}, hidden=True, cmp=self.compared)
        self.by_key[key] = self.add(e)
        return e

    def get(self, key):
        return self.by_key.get(key)


class ModelUniverse(SymbolicUniverse):
    """Every event a mode could emit for the workload, each with symbolic position, thread,
    existence and fields (objects, slots, counter values, digests, token and page counts)."""

    def __init__(self, workload: Workload, page_size: int = 16):
        super().__init__(page_size)
        self.W, self.K = workload, workload.K
        vocab = _vocab()
        for n, chunks in enumerate(workload.batches):
            for name in batch_event_names():
                f = {"rids": tuple(c.rid for c in chunks)} if name == "admit" else {}
                self._mk(name, n, (name, n), f, vocab, always=name == "admit")
        for rid in workload.requests():
            self._mk("alloc", None, ("alloc", rid), {"rid": rid}, vocab)
            self._mk("release", None, ("release", rid), {"rid": rid}, vocab)
        for n, chunks in enumerate(workload.batches):
            for c in chunks:
                if c.prefix:
                    self._mk("prefix_send", None, ("prefix_send", c.rid, n), {"rid": c.rid, "batch": n}, vocab,
                             extra=("tokens", "pages"))
                if c.middle:
                    self._mk("chunk_inc", None, ("chunk_inc", c.rid, n), {"rid": c.rid}, vocab)
                    self._mk("chunk_dec", None, ("chunk_dec", c.rid, n), {"rid": c.rid}, vocab)
                self._mk("kv_send", None, ("kv_send", c.rid, n), {"rid": c.rid}, vocab)
        for n in range(self.K):  # device work: the staging write and the forward's reads of the buffers
            for name in ("dev_stage", "dev_forward"):
                self.hide((name, n), STREAM)

    def b(self, name, n) -> Ev:
        return self.by_key[(name, n)]

    def r(self, name, rid, n=None) -> Ev:
        return self.by_key[(name, rid) if n is None else (name, rid, n)]


def frame(U: SymbolicUniverse, done: set | None = None) -> list:
    """What every schedule is: an interleaving of two host threads. Only events that some constraint
    compares must be at distinct positions: two tied events that nothing compares can be put in
    either order without changing the truth of any atom, so every model is an interleaving after
    breaking such ties (Model.schedule does, by key). A Distinct over every position instead makes
    satisfiable queries 10-50x slower."""
    out = [z3.Or(e.thread == SCHED, e.thread == FWD) for e in U.events]
    return out + distinct_compared(U, done)


def distinct_compared(U: SymbolicUniverse, done: set | None = None) -> list:
    """a != b for the compared pairs not in `done` (which it updates)."""
    done = set() if done is None else done
    new = []
    for a, b in list(U.compared):
        k = (id(a), id(b)) if id(a) < id(b) else (id(b), id(a))
        if a is b or k in done:
            continue
        done.add(k)
        la, lb = key_label(a.key), key_label(b.key)
        new.append((la, lb, a, b) if la < lb else (lb, la, b, a))
    # In the order of the events' keys, not of the set (object ids): the same constraints in the same
    # order in every process, so that unsat cores, and the minimal sets read from them, do not vary.
    new.sort(key=lambda x: (x[0], x[1]))
    return [implies(conj(ex(a), ex(b)), a.pos != b.pos) for _, _, a, b in new]


# ---- the engine model: the loop code of each mode --------------------------------------------------
# Written from engine/prefill/loops.py, scheduler.py and worker.py. One loop iteration either admits
# batch n in the same iteration that finishes n-1 (`cont[n]`, the steady state) or, when no batch
# was ready, after an iteration that only drains n-1 (`not cont[n]`). Idle iterations add no other
# event than allocs and releases, so those float in windows between two hidden points of the
# scheduler's program: every iteration begins with a top window (get_next_batch takes slots, and may
# run out of pages so the request waits; idle iterations before it also release) and has an end
# window (process_inflight_queue releases). An alloc falls in a top window before its request's
# first admit; a release in any window after its last chunk's processing.

class _Program:
    """A thread's program order: events in order, each under a guard (the loop branch that emits it).
    The same event may sit in two places under complementary guards."""

    def __init__(self, U, name):
        self.U, self.name, self.slots, self.windows, self.tops = U, name, [], [], []

    def add(self, guard, *events):
        self.slots += [(guard, e) for e in events]

    def _window(self, name, guard):
        i = sum(1 for _, e in self.slots if e.name == name) // 2
        w = (guard, self.U.hide((name, f"{i}<"), SCHED), self.U.hide((name, f"{i}>"), SCHED))
        self.add(guard, w[1], w[2])
        return w

    def top(self, guard):
        """The top of an iteration: loop top and get_next_batch up to its admit."""
        self.tops.append(self._window("iteration_top", guard))

    def window(self, guard):
        """process_inflight_queue."""
        self.windows.append(self._window("iteration_end", guard))

    def order(self, floating=()) -> list:
        """Each active slot comes after the previous active one: for each slot and each earlier slot
        that may be the previous active one (back to the last unconditional slot), a difference
        constraint guarded by both being active and the slots between being inactive. Floating events
        (allocs, releases) sit in windows, so never inside any other pair of neighbouring slots: an
        implied lemma, which spares z3 a case split over every window (see engine_model)."""
        out = []
        opens = {w[1] for w in self.windows + self.tops}
        active = [(g, e) for g, e in self.slots if g is not False]
        for j, (gj, ej) in enumerate(active):
            for i in range(j - 1, -1, -1):
                gi, ei = active[i]
                between = [g for g, _ in active[i + 1:j]]
                if any(g is True or g is gj for g in between):
                    break           # a slot between is active whenever j is: nothing earlier is next to j
                if any(g is gi for g in between):
                    continue        # active with i: i is never right before j, an earlier slot may be
                self.U.compared.add((ei, ej))
                guard = conj(gi, gj, *[neg(g) for g in between])
                out.append(implies(guard, ei.pos < ej.pos))
                if ei not in opens:
                    out += [implies(guard, neg(conj(lt(ei, z), lt(z, ej)))) for z in floating]
                if gi is True:
                    break
        return out


EMITTED = {  # batch events each loop emits (normal samples inline, without a `sample` event)
    "normal": {"admit", "stage", "fwd_begin", "fwd_end", "war_barrier", "process_begin", "process_end"},
    "overlap": {"admit", "stage", "fwd_begin", "fwd_end", "war_barrier", "sample", "process_begin", "process_end"},
    "thread": None, "ahead": None,  # all of them
}
WORKER_EVENTS = {"thread": {"fwd_begin", "prefix_send", "stage", "fwd_end", "war_barrier", "batch_copy"},
                 "ahead": {"fwd_begin", "fwd_end", "war_barrier", "batch_copy"}}
ENGINE_MUTANTS = {  # engine/inject.py mutants the loop model knows (ahead mode)
    "two-forwards": "input queue of capacity 2; collect(N) after submit(N+1)",
    "sample-before-collect": "sample(N) after submit(N+1)",
    "prefix-send-on-worker": "the worker sends the cached prefix inside run_batch",
    "no-war-barrier": "the WAR barrier does not make the schedule stream wait",
}


def _groups(U, n):
    W, b, r = U.W, U.b, U.r
    admit = [b("admit", n)] + [r("chunk_inc", c.rid, n) for c in W.batches[n] if c.middle]
    prefix = [r("prefix_send", c.rid, n) for c in W.batches[n] if c.prefix]
    process = [b("process_begin", n)]
    for c in W.batches[n]:
        process += ([r("chunk_dec", c.rid, n)] if c.middle else []) + [r("kv_send", c.rid, n)]
    process.append(b("process_end", n))
    return admit, prefix, process


def _loop_programs(U, mode, cont, mutants):
    """The scheduler's (and the worker's) program for `mode`, as in engine/prefill/loops.py."""
    K, b, h = U.K, U.b, U.get
    s = _Program(U, "scheduler")
    w = _Program(U, "worker") if mode in THREAD_MODES else None
    on_worker = "prefix-send-on-worker" in mutants
    for n in range(K):
        admit, prefix, _ = _groups(U, n)
        prev = _groups(U, n - 1)[2] if n else []
        c = cont[n] if n else False     # n admitted in the iteration that finishes n-1
        d = neg(c) if n else False      # n-1 drained by an iteration that admitted nothing
        run_batch = [b("fwd_begin", n), *prefix, b("stage", n), b("fwd_end", n), b("war_barrier", n)]
        if mode == "normal":
            s.top(True)
            s.add(True, *admit, *run_batch, *_groups(U, n)[2])
            s.window(True)
        elif mode in ("overlap", "thread"):
            if n:
                s.top(d)
                s.add(d, *prev)
                s.window(d)
            s.top(True)
            if mode == "overlap":
                s.add(True, *admit, *run_batch)
            else:
                s.add(True, *admit, b("snapshot", n), b("submit", n), h(("in_put", n)), h(("out_get", n)), b("collect", n))
            if n:
                s.add(c, *prev)
            s.window(True)
            s.add(True, b("sample", n))
        else:  # ahead
            two, late = "two-forwards" in mutants, "sample-before-collect" in mutants
            collect_prev = [h(("out_get", n - 1)), b("collect", n - 1)] if n else []
            sample_prev = [b("sample", n - 1)] if n else []
            if n:
                s.top(d)
                s.add(d, *collect_prev, *sample_prev, *prev)
                s.window(d)
            s.top(True)
            s.add(True, *admit)
            if not two:
                s.add(c, *collect_prev, *([] if late else sample_prev))
            s.add(True, b("snapshot", n), b("stage", n), *([] if on_worker else prefix), b("submit", n), h(("in_put", n)))
            if two:
                s.add(c, *collect_prev, *sample_prev)
            elif late:
                s.add(c, *sample_prev)
            s.add(c, *prev)
            s.window(True)
        if w is not None:
            inside = [*prefix, b("stage", n)] if mode == "thread" else (prefix if on_worker else [])
            w.add(True, h(("in_get", n)), b("fwd_begin", n), *inside, b("fwd_end", n), b("war_barrier", n),
                  b("batch_copy", n), h(("out_put", n)))
    last = _groups(U, K - 1)[2]
    if mode in ("overlap", "thread"):     # the final drain: the last batch is still processed
        s.top(True)
        s.add(True, *last)
        s.window(True)
    elif mode == "ahead":
        s.top(True)
        s.add(True, h(("out_get", K - 1)), b("collect", K - 1), b("sample", K - 1), *last)
        s.window(True)
    s.top(True)                           # idle iterations until every request is released
    return s, w


def engine_model(U: ModelUniverse, mode: str, mutants=(), lemmas: bool = False) -> dict[str, list]:
    """The engine of `mode` as named groups of constraints (names start with "E:"). `lemmas` adds the
    implied program-order lemma for floating events: 10x faster proofs of an `adjacent` rule, 2x
    slower ones elsewhere, so Model asks for it only when such a rule is in play."""
    unknown = set(mutants) - set(ENGINE_MUTANTS)
    if unknown:
        raise ValueError(f"the loop model does not know mutant(s) {', '.join(sorted(unknown))}")
    K, W, b, r = U.K, U.W, U.b, U.r
    if mode in THREAD_MODES:
        for n in range(K):
            for name, t in (("in_put", SCHED), ("in_get", FWD), ("out_put", FWD), ("out_get", SCHED)):
                U.hide((name, n), t)
    cont = [None] + [z3.Bool(f"steady:{n}") for n in range(1, K)]
    sched, worker = _loop_programs(U, mode, cont, mutants)
    g: dict[str, list] = defaultdict(list)

    emitted = EMITTED[mode]
    for e in U.events:
        if e.batch is not None and emitted is not None:
            g["E:emits"].append(e.exists == (e.name in emitted))
        elif e.exists is not True:
            g["E:emits"].append(e.exists)
    on_worker = WORKER_EVENTS.get(mode, set()) | ({"prefix_send"} if "prefix-send-on-worker" in mutants else set())
    for e in U.events:
        g["E:threads"].append(e.thread == (FWD if e.name in on_worker else SCHED))

    floating = [r(name, rid) for rid in W.requests() for name in ("alloc", "release")] if lemmas else []
    g["E:program-order"] += sched.order(floating) + (worker.order() if worker else [])
    def inside(e, windows):
        return disj(*[conj(gd, lt(lo, e), lt(e, hi)) for gd, lo, hi in windows])

    for rid in W.requests():
        rel, alloc, first = r("release", rid), r("alloc", rid), W.holding(rid)[0]
        g["E:program-order"] += [lt(b("process_end", W.holding(rid)[-1]), rel), inside(rel, sched.windows + sched.tops),
                                 lt(alloc, b("admit", first)), inside(alloc, sched.tops)]

    if mode in THREAD_MODES:   # queue.Queue(maxsize=cap): a get takes a put item; a put waits for room
        cap = 2 if "two-forwards" in mutants else 1
        for n in range(K):
            g["E:queues"] += [lt(U.get(("in_put", n)), U.get(("in_get", n))),
                              lt(U.get(("out_put", n)), U.get(("out_get", n)))]
            if n + cap < K:
                g["E:queues"] += [lt(U.get(("in_get", n)), U.get(("in_put", n + cap))),
                                  lt(U.get(("out_get", n)), U.get(("out_put", n + cap)))]

    # Streams: device work runs after it is enqueued, in enqueue order per stream; the forward waits
    # for its staging (stage_event); the WAR barrier makes later schedule-stream work wait for the
    # forward's reads (sched_stream.wait_event(war_event)).
    for n in range(K):
        ds, df = U.get(("dev_stage", n)), U.get(("dev_forward", n))
        g["E:streams"] += [lt(b("stage", n), ds), lt(b("fwd_begin", n), df), lt(ds, df)]
        for m in range(K):
            if m != n:
                ds_m, df_m = U.get(("dev_stage", m)), U.get(("dev_forward", m))
                g["E:streams"] += [implies(lt(b("stage", n), b("stage", m)), lt(ds, ds_m)),
                                   implies(lt(b("fwd_begin", n), b("fwd_begin", m)), lt(df, df_m))]
                if "no-war-barrier" not in mutants:
                    g["E:streams"].append(implies(lt(b("war_barrier", n), b("stage", m)), lt(df, ds_m)))

    # Req objects are shared by identity; the counter is the object's field as the code moves it.
    for i, rid in enumerate(W.requests()):
        mine = [e for e in U.events if e.rid == rid]
        g["E:req-identity"] += [fld(e, "obj") == 100 + i for e in mine]
        steps = [e for e in mine if e.name in ("chunk_inc", "chunk_dec")]
        for x in steps:
            run, _ = _running(U, x, steps, "chunk_inc", strict=False)
            g["E:req-identity"].append(fld(x, "value") == run)
    reqs = W.requests()
    for rid in reqs:           # req_to_token slots: a free slot at alloc, the same one at release
        a, rel = r("alloc", rid), r("release", rid)
        g["E:allocator"] += [fld(a, "slot") >= 0, fld(rel, "slot") == fld(a, "slot")]
    for i, x in enumerate(reqs):
        for y in reqs[i + 1:]:
            ax, rx, ay, ry = r("alloc", x), r("release", x), r("alloc", y), r("release", y)
            g["E:allocator"].append(implies(fld(ax, "slot") == fld(ay, "slot"), disj(lt(rx, ay), lt(ry, ax))))
    if mode in THREAD_MODES:   # the worker's run_batch reads the snapshot it was handed
        g["E:snapshot"] += [fld(b("fwd_begin", n), "digest") == fld(b("snapshot", n), "digest") for n in range(K)]
    ps = U.page_size           # the sender ships ceil(tokens / page_size) pages
    for e in U.named("kv_send") + U.named("prefix_send"):
        t, p = fld(e, "tokens"), fld(e, "pages")
        g["E:sender"] += [t >= 1, p * ps >= t, (p - 1) * ps < t]
    return dict(g)


ENGINE_GROUPS = {
    "E:emits": "which events the loop emits",
    "E:threads": "which thread runs each event",
    "E:program-order": "program order of each thread's loop code; allocs at iteration tops, releases at iteration ends",
    "E:queues": "capacity-1 hand-off queues between scheduler and worker",
    "E:streams": "stream order, the forward's wait on staging, the WAR barrier's wait",
    "E:req-identity": "Req objects kept by identity; the counter as the code moves it",
    "E:allocator": "req_to_token slots: free at alloc, the same at release",
    "E:snapshot": "the worker's run_batch reads the snapshot it was handed",
    "E:sender": "the sender ships ceil(tokens / page_size) pages",
}


# ---- the decode prefetch: events of a few iterations, and the loop code that emits them ---------------
# A workload of two bootstrap addresses (rooms 1, 2, 3 at the first, room 4 at the second) over
# `iterations` iterations of the decode loop. The universe holds every event the prefetch and its
# consumption can log: per address, iteration (from FIRST_SUBMIT) and room set a prefetched query
# (submit, its pool thread's query_begin, a cancel, a resolve that uses it as is or as the prefix of a
# larger set); per address and room set a synchronous one (query_begin and resolve on the scheduler:
# a set is resolved at most once, its rooms are known after); per room its request's life (added,
# receiver init, KV, done, or aborted); one release and one resume of memory.
#
# The loop model (decode_engine) is engine/decode/loops.py's `_loop_top` with
# engine/decode/prealloc.py's prefetch and consumption, as a state machine unrolled over the
# iterations: the environment chooses when each room arrives, when a still-pending request is aborted
# (its client goes away), which iterations poll the prealloc queue (SGLang's polling interval: a
# prefetch may be consumed iterations later), and when memory is released and resumed (after the
# prefetch, as the after_prefetch hook of tests/test_pd_faults.py); everything else follows from the
# code. Scheduler events sit at fixed positions of their iteration (100 i + the step's offset); the
# pool thread's query_begin floats after its submit, before the answer is used, and before a cancel
# that stopped it. The bootstrap server answers room r with rank r % 2, without errors. What the loop
# could do that the universe has no events for (or an event it would log twice) is collected in
# `U.outside` and shown unreachable by `pdo spec prove` (outside_universe).

DECODE_THREADS = {"scheduler": SCHED, "prefetch_0": FWD}
# The first iteration whose prefetch can submit: it needs the address's parallel info, which the
# consumption point fetches when a room of the address is pending, and a room still unknown, but that
# consumption resolved every room then pending: a room arriving later (intake of iteration 2 at the
# earliest) is first seen by the prefetch of the iteration after (3). Queries of earlier iterations
# are left out of the universe (outside_universe: the loop model cannot submit them).
FIRST_SUBMIT = 3


@dataclass(frozen=True)
class DecodeWorkload:
    iterations: int
    rooms: tuple = (("127.0.0.1:8998", (1, 2, 3)), ("127.0.0.1:8999", (4,)))

    def server_rank(self, room: int) -> int:
        return room % 2

    def room_sets(self, a: int) -> list[tuple]:
        """Every nonempty subset of the address's rooms, in arrival order."""
        rooms = self.rooms[a][1]
        return [tuple(r for n, r in enumerate(rooms) if mask >> n & 1) for mask in range(1, 1 << len(rooms))]

    def submit_sets(self, a: int) -> list[tuple]:
        """The room sets a prefetch can ask for: without the address's first room, which the consumption
        that fetches the address's parallel info resolves (or which was aborted before it)."""
        return [S for S in self.room_sets(a) if self.rooms[a][1][0] not in S]

    def all_rooms(self) -> list[tuple]:
        return [(a, r) for a, (_, rooms) in enumerate(self.rooms) for r in rooms]


def _prefix_of(p, n):
    return len(p) < len(n) and n[:len(p)] == p


class DecodeUniverse(SymbolicUniverse):
    def __init__(self, W: DecodeWorkload, page_size: int = 16):
        super().__init__(page_size)
        self.W, self.K, self.header = W, W.iterations, {"role": "decode", "prefetch": True}
        vocab = load_events()["decode"]
        mk = lambda name, key, **f: self._mk(name, None, key, f, vocab)   # noqa: E731
        K = W.iterations
        for i in range(1, K + 1):
            for name in ("iter_begin", "prefetch_begin", "prefetch_end"):
                mk(name, (name, i), iter=i)
        qids = iter(range(10_000))
        for a, (addr, rooms) in enumerate(W.rooms):
            mk("prefill_info", ("prefill_info", a), addr=addr, published=True, error=None)
            for j in range(FIRST_SUBMIT, K + 1):
                for S in W.submit_sets(a):
                    q = next(qids)
                    ask = dict(addr=addr, rooms=list(S))
                    mk("prefetch_submit", ("prefetch_submit", a, j, S), qid=q, **ask)
                    mk("query_begin", ("query_begin", a, j, S), qid=q, source="prefetch", **ask)
                    mk("prefetch_cancel", ("prefetch_cancel", a, j, S), qid=q, reason="any", **ask)
                    mk("resolve", ("resolve", a, j, S), qid=q, source="prefetched", error=None,
                       result={str(r): z3.Int(f"answer:{a}:{j}:{S}:{r}") for r in S}, **ask)
                    for N in W.room_sets(a):
                        if _prefix_of(S, N):
                            mk("resolve", ("resolve", a, j, S, N), qid=q, source="prefix", error=None, addr=addr,
                               rooms=list(N), result={str(r): z3.Int(f"answer:{a}:{j}:{S}+:{r}") for r in N})
            for N in W.room_sets(a):     # a room set is resolved once: its rooms are known after
                ask = dict(addr=addr, rooms=list(N))
                mk("query_begin", ("query_begin", a, "sync", N), qid=next(qids), source="sync", **ask)
                mk("resolve", ("resolve", a, "sync", N), qid=None, source="sync", error=None,
                   result={str(r): z3.Int(f"answer:{a}:sync:{N}:{r}") for r in N}, **ask)
            for r in rooms:
                rid = f"r{r}"
                mk("req_add", ("req_add", r), rid=rid, room=r, addr=addr)
                mk("receiver_init", ("receiver_init", r), room=r, rid=rid)
                mk("kv_recv", ("kv_recv", r), room=r)
                mk("kv_done", ("kv_done", r), room=r, rid=rid)
                mk("req_done", ("req_done", r), rid=rid, room=r)
                mk("req_abort", ("req_abort", r), rid=rid, room=r, reason="client went away")
        mk("release_memory", ("release_memory",))
        mk("resume_memory", ("resume_memory",))

    def tid(self, name):
        return DECODE_THREADS[name]


DECODE_ENGINE_GROUPS = {
    "E:loop": "the loop code: iteration top, prefetch (stale cancel, skip, submit), release hook, intake, aborts, "
              "consumption (prefetched, prefix + sync tail, cancel + sync, cancel when nothing is pending), "
              "receiver init in arrival order unless memory is released",
    "E:order": "where the loop logs each step: iteration i's steps at 100 i + the step's offset, in code order",
    "E:pool": "the pool thread: a query runs after its submit, before its answer is used, never after a cancel stopped it",
    "E:server": "the bootstrap server answers room r with rank r % 2",
    "E:env": "arrivals in room order per address; a pending request may be aborted; every arrived request is "
             "served or aborted within the iterations",
}


def decode_engine(U: DecodeUniverse) -> dict[str, list]:
    W, K, get = U.W, U.K, U.get
    g = defaultdict(list)
    L = g["E:loop"]
    U.ends = defaultdict(list)   # how a prefetched query ends: reason -> conditions
    U.outside = []   # loop behaviour the universe has no events for: shown unreachable (outside_universe)
    rooms = W.all_rooms()
    idx = {r: n for n, (_, r) in enumerate(rooms)}
    arr = {r: z3.Int(f"arrives:r{r}") for _, r in rooms}           # K+1: never
    ab = {r: z3.Int(f"aborts:r{r}") for _, r in rooms}             # the client goes away (if still pending)
    polls = {i: z3.Bool(f"polls:{i}") for i in range(1, K + 1)}
    rel, res = z3.Int("release_at"), z3.Int("resume_at")
    g["E:env"] += [z3.And(1 <= v, v <= K + 1) for v in list(arr.values()) + list(ab.values())]
    g["E:env"] += [1 <= rel, rel <= K + 1, rel < res, res <= K + 2]
    for _, rs in W.rooms:
        g["E:env"] += [arr[x] <= arr[y] for x, y in zip(rs, rs[1:])]

    def var(name):
        return z3.Bool(name)

    def define(name, expr):
        v = var(name)
        L.append(v == as_z3(expr))
        return v

    known = {(r, 0): False for _, r in rooms}
    gone = {(r, 0): False for _, r in rooms}   # initialised or aborted
    info = {(a, 0): False for a in range(len(W.rooms))}
    out = {}                                  # (key, i): outstanding at the top of iteration i
    causes = defaultdict(list)                # event key -> [(exists-in-this-iteration, position)]
    keys = lambda a: [(a, j, S) for j in range(FIRST_SUBMIT, K + 1) for S in W.submit_sets(a)]   # noqa: E731
    ev = lambda *k: get(k)                    # noqa: E731

    for i in range(1, K + 1):
        base = 100 * i
        for n, name in enumerate(("iter_begin", "prefetch_begin")):
            L.append(ev(name, i).exists)
            g["E:order"].append(ev(name, i).pos == base + n)
        L.append(ev("prefetch_end", i).exists)
        g["E:order"].append(ev("prefetch_end", i).pos == base + 4)
        rel_pf = conj(rel < i, i <= res)      # released when the prefetch runs
        rel_c = conj(rel <= i, i < res)       # released at the consumption point
        pend_pf = {r: conj(arr[r] < i, neg(gone[(r, i - 1)])) for _, r in rooms}
        abort = {r: define(f"abort:r{r}:{i}", conj(ab[r] == i, arr[r] <= i, neg(gone[(r, i - 1)]))) for _, r in rooms}
        pend_c = {r: conj(arr[r] <= i, neg(gone[(r, i - 1)]), neg(abort[r])) for _, r in rooms}
        live = {}
        for a, (_, rs) in enumerate(W.rooms):
            # prefetch: cancel stale queries, then submit one query per address
            stale = neg(disj(*[pend_pf[r] for r in rs]))
            after = {}
            for k in keys(a):
                if k[1] < i:
                    o = out[(k, i)]
                    causes[("prefetch_cancel", *k)].append((conj(o, stale), base + 2 + a / 10))
                    U.ends["cancelled as stale"].append(conj(o, stale))
                    after[k] = conj(o, neg(stale))
            unk = {r: conj(pend_pf[r], neg(known[(r, i - 1)])) for r in rs}
            can = conj(neg(rel_pf), neg(disj(*after.values())), info[(a, i - 1)], disj(*unk.values()))
            U.outside.append(conj(can, *[neg(conj(*[unk[r] if r in S else neg(unk[r]) for r in rs]))
                                         for S in W.room_sets(a)]))
            for S in W.room_sets(a):
                sub = define(f"submit:{a}:{i}:{S}", conj(can, *[unk[r] if r in S else neg(unk[r]) for r in rs]))
                if i < FIRST_SUBMIT or S not in W.submit_sets(a):   # not in the universe: the loop
                    U.outside.append(sub)                           # cannot (outside_universe)
                    continue
                causes[("prefetch_submit", a, i, S)].append((sub, base + 3 + a / 10))
                after[(a, i, S)] = sub
            # the after_prefetch hook: release_memory cancels every outstanding query
            for k, o in after.items():
                causes[("prefetch_cancel", *k)].append((conj(o, rel == i), base + 5 + a / 10))
                U.ends["cancelled at release_memory"].append(conj(o, rel == i))
                live[k] = define(f"live:{k}:{i}", conj(o, rel != i))
        # intake; then a pending request may be aborted (its client went away)
        for _, r in rooms:
            causes[("req_add", r)].append((arr[r] == i, base + 10 + idx[r] / 10))
            causes[("req_abort", r)].append((abort[r], base + 15 + idx[r] / 10))
        # consumption point (when this iteration polls the prealloc queue, unless memory is released:
        # then nothing is resolved, not even synchronously, until resume)
        cp = conj(polls[i], neg(rel_c))
        anyp = disj(*[pend_c[r] for _, r in rooms])
        empty = conj(cp, neg(anyp))
        for a, (_, rs) in enumerate(W.rooms):
            for k in keys(a):
                if k in live:
                    causes[("prefetch_cancel", *k)].append((conj(live[k], empty), base + 20 + a / 10))
                    U.ends["cancelled with nothing pending"].append(conj(live[k], empty))
            act = define(f"act:{a}:{i}", conj(cp, anyp, disj(*[pend_c[r] for r in rs])))
            causes[("prefill_info", a)].append((conj(act, neg(info[(a, i - 1)])), base + 30 + 10 * a))
            info[(a, i)] = define(f"info:{a}:{i}", disj(info[(a, i - 1)], act))
            need = {r: conj(act, pend_c[r], neg(known[(r, i - 1)])) for r in rs}
            has = disj(*need.values())
            nset = {N: conj(has, *[need[r] if r in N else neg(need[r]) for r in rs]) for N in W.room_sets(a)}
            U.outside.append(conj(has, *[neg(x) for x in nset.values()]))
            usable = []
            for k in keys(a):
                if k not in live:
                    continue
                P = k[2]
                pre = conj(live[k], nset[P])
                causes[("resolve", *k)].append((pre, base + 33 + 10 * a))
                U.ends["used as is"].append(pre)
                usable.append(pre)
                ext = False
                for N in W.room_sets(a):
                    if _prefix_of(P, N):
                        use = conj(live[k], nset[N])
                        causes[("resolve", *k, N)].append((use, base + 33 + 10 * a))
                        U.ends["used as a prefix with a sync tail"].append(use)
                        causes[("query_begin", a, "sync", N[len(P):])].append((use, base + 32 + 10 * a))
                        usable.append(use)
                        ext = disj(ext, nset[N])
                mismatch = conj(live[k], has, neg(nset[P]), neg(ext))
                causes[("prefetch_cancel", *k)].append((mismatch, base + 31 + 10 * a))
                U.ends["cancelled on a room mismatch (sync query instead)"].append(mismatch)
                out[(k, i + 1)] = define(f"out:{k}:{i + 1}", conj(live[k], neg(empty), neg(has)))
            for N in W.room_sets(a):
                sync = conj(nset[N], neg(disj(*usable)))
                causes[("query_begin", a, "sync", N)].append((sync, base + 32 + 10 * a))
                causes[("resolve", a, "sync", N)].append((sync, base + 33 + 10 * a))
            for r in rs:
                known[(r, i)] = define(f"known:r{r}:{i}", disj(known[(r, i - 1)], need[r]))
        # receiver init in arrival order, unless memory is released; then the KV arrives
        for _, r in rooms:
            now = conj(polls[i], neg(rel_c), pend_c[r], known[(r, i)])
            order = (10 * z3.ToReal(arr[r]) + idx[r]) / 1000
            for name, off in (("receiver_init", 50), ("kv_recv", 70), ("kv_done", 70.0001), ("req_done", 70.0002)):
                causes[(name, r)].append((now, base + off + order))
            gone[(r, i)] = define(f"gone:r{r}:{i}", disj(gone[(r, i - 1)], abort[r], now))
    causes[("release_memory",)] = [(rel == i, 100 * i + 6) for i in range(1, K + 1)]
    causes[("resume_memory",)] = [(res == i, 100 * i + 7) for i in range(1, K + 1)]

    # Every event: it exists iff one of its causes holds (at most one does), at that cause's position;
    # scheduler events on the scheduler thread.
    for e in U.events:
        if e.name in ("iter_begin", "prefetch_begin", "prefetch_end") or e.key[:1] == ("query_begin",) and e.f["source"] == "prefetch":
            continue
        cs = causes.get(e.key, [])
        L.append(e.exists == as_z3(disj(*[c for c, _ in cs])))
        g["E:order"] += [implies(c, e.pos == p) for c, p in cs]
        U.outside += [conj(c1, c2) for n1, (c1, _) in enumerate(cs) for c2, _ in cs[n1 + 1:]]   # logged twice
    for e in U.events:
        pool = e.name == "query_begin" and e.f["source"] == "prefetch"
        L.append(e.thread == (FWD if pool else SCHED))
    # The pool thread: the query of a submit runs after it; a resolve using it waits for it; a cancel
    # stops it only before it began.
    P = g["E:pool"]
    for a in range(len(W.rooms)):
        for k in keys(a):
            qb, sub, c = ev("query_begin", *k), ev("prefetch_submit", *k), ev("prefetch_cancel", *k)
            users = [ev("resolve", *k)] + [ev("resolve", *k, N) for N in W.room_sets(a) if _prefix_of(k[2], N)]
            P += [implies(ex(qb), conj(ex(sub), lt(sub, qb))), implies(ex(c), implies(ex(qb), lt(qb, c)))]
            P += [implies(ex(u), conj(ex(qb), lt(qb, u))) for u in users]
    # What the receiver and the KV carry: the rank the resolve answered; one 16-token page.
    for _, r in rooms:
        init, kv = ev("receiver_init", r), ev("kv_recv", r)
        answers = [x for x in U.named("resolve") if str(r) in x.f["result"]]
        L += [implies(ex(x), init.f["rank"] == x.f["result"][str(r)]) for x in answers]
        L += [kv.f["rank"] == init.f["rank"], kv.f["tokens"] == 16, kv.f["pages"] == -(-16 // U.page_size),
              kv.f["start"] == 0]
    for x in U.named("resolve"):
        g["E:server"] += [v == W.server_rank(int(room)) for room, v in x.f["result"].items()]
    # The environment: every request that arrives is served within the iterations.
    g["E:env"] += [implies(arr[r] <= K, gone[(r, K)]) for _, r in rooms]
    return dict(g)


def _closed_between(U, y, x):
    """The prefetched query y was cancelled or used (resolved) after y and before x."""
    closers = [z for z in U.named("prefetch_cancel") + U.named("resolve")
               if z.f.get("qid") == y.f["qid"] and z.f["addr"] == y.f["addr"]]
    return disj(*[conj(ex(z), lt(y, z), lt(z, x)) for z in closers])


def p_room_rank(U):
    return conj(*[implies(ex(e), fld(e, "rank") == U.W.server_rank(e.f["room"])) for e in U.named("receiver_init")])


def p_one_query(U):
    subs = U.named("prefetch_submit")
    return conj(*[implies(conj(ex(y), ex(x), lt(y, x)), _closed_between(U, y, x))
                  for y in subs for x in subs if x is not y and x.f["addr"] == y.f["addr"]])


def p_nothing_after_release(U):
    rel, res = U.get(("release_memory",)), U.get(("resume_memory",))
    out = [implies(conj(ex(rel), ex(e), lt(rel, e)), conj(ex(res), lt(rel, res), lt(res, e)))
           for e in U.named("prefetch_submit") + U.named("receiver_init")]
    out += [implies(conj(ex(rel), ex(y), lt(y, rel)), _closed_between(U, y, rel)) for y in U.named("prefetch_submit")]
    return conj(*out)


DECODE_MODES = LOOP_MODES["decode"]


# ---- properties: the seed's safety claims, stated without the rules ---------------------------------

@dataclass(frozen=True)
class Property:
    id: str
    statement: str
    modes: tuple
    seed: str
    formula: object = field(compare=False, repr=False)   # (ModelUniverse) -> z3 formula

    def applies(self, mode) -> bool:
        return mode in self.modes


def _span_closed(U, n, later):
    """run_batch(n) has returned before `later`: fwd_end(n) lies after fwd_begin(n) and before it."""
    fb, fe = U.b("fwd_begin", n), U.b("fwd_end", n)
    return implies(conj(ex(fb), ex(later), lt(fb, later)), conj(ex(fe), lt(fb, fe), lt(fe, later)))


def _each(U):
    """The batches of a model universe."""
    return range(U.K)


def p_one_forward(U):
    return conj(*[_span_closed(U, n, U.b("fwd_begin", m)) for n in _each(U) for m in _each(U) if m != n])


def p_sample_idle(U):
    return conj(*[_span_closed(U, n, U.b("sample", m)) for n in _each(U) for m in _each(U)])


def p_process_after_forward(U):
    b = U.b
    return conj(*[implies(ex(b("process_begin", n)), conj(ex(b("fwd_end", n)), ex(b("war_barrier", n)),
                                                          lt(b("fwd_end", n), b("process_begin", n)),
                                                          lt(b("war_barrier", n), b("process_begin", n))))
                  for n in _each(U)])


def p_war_host(U):
    b = U.b
    return conj(*[implies(ex(b("stage", m)), conj(ex(b("war_barrier", n)), lt(b("war_barrier", n), b("stage", m))))
                  for n in _each(U) for m in _each(U) if m > n])


def p_war_device(U):
    return conj(*[lt(U.get(("dev_forward", n)), U.get(("dev_stage", m)))
                  for n in _each(U) for m in _each(U) if m > n])


def p_snapshot(U):
    b = U.b
    return conj(*[implies(ex(b("fwd_begin", n)), conj(ex(b("snapshot", n)),
                                                      fld(b("fwd_begin", n), "digest") == fld(b("snapshot", n), "digest")))
                  for n in _each(U)])


def p_live_batch(U):
    return conj(*[_span_closed(U, n, U.b("admit", m)) for n in _each(U) for m in _each(U) if m > n])


def p_dec_real(U):
    out = []
    for e in U.named("chunk_dec"):
        a = U.r("alloc", e.rid)
        out.append(implies(ex(e), conj(ex(a), fld(e, "obj") == fld(a, "obj"))))
    return conj(*out)


def p_no_free_in_flight(U):
    out = []
    for rid in U.W.requests():
        rel = U.r("release", rid)
        done = [conj(ex(U.b("process_end", n)), lt(U.b("process_end", n), rel)) for n in U.W.holding(rid)]
        sent = [implies(ex(s), lt(s, rel)) for s in U.named("kv_send") + U.named("prefix_send") if s.rid == rid]
        out.append(implies(ex(rel), conj(*done, *sent)))
    return conj(*out)


ALL = MODES
PROPERTIES = [
    Property("one-forward", "Never two forwards at once: run_batch(N) has returned before any other run_batch begins.",
             ALL, "一个 forward worker, 不会同时运行两个 run_batch() (digest: never two run_batch() at once)", p_one_forward),
    Property("sample-idle", "Sampling is never concurrent with a forward: no sample launch inside a run_batch.",
             ("overlap", "thread", "ahead"), "Sampling 要在 worker 空闲时执行 (digest: sampling runs while the worker is idle)",
             p_sample_idle),
    Property("process-after-forward", "Result processing of N starts only after forward N returned and its WAR barrier.",
             ALL, "后续结果处理在需要时等待结果就绪 (digest: later result processing waits for results)",
             p_process_after_forward),
    Property("war-host", "No later batch's shared-buffer write (stage) is enqueued before forward N's WAR barrier.",
             ALL, "WAR barrier 让后续共享缓冲区写入等待此前 forward 的共享读取 (digest: the WAR barrier)", p_war_host),
    Property("war-device", "On the device, every later batch's staging write runs after forward N read the shared buffers.",
             ALL, "WAR barrier 让后续共享缓冲区写入等待此前 forward 的共享读取 (digest: the WAR barrier)", p_war_device),
    Property("snapshot-isolation", "The forward reads exactly the snapshot: run_batch(N) reads what snapshot(N) took.",
             THREAD_MODES, "_snapshot_batch_for_forward() (digest: why not hand the live batch to the thread)",
             p_snapshot),
    Property("live-batch-stable", "Without a snapshot, no later admission (which filters the live batch) runs inside run_batch(N).",
             ("normal", "overlap"), "下一轮 admission 会 filter 或重新绑定 batch 字段 (digest: the next admission filters or rebinds batch fields)",
             p_live_batch),
    Property("dec-on-real-request", "Every middle-chunk decrement lands on the real request (the object allocated for it).",
             ALL, "processing 必须对同一个对象递减 (digest: processing must decrement the same object)", p_dec_real),
    Property("no-free-in-flight", "No slot or page is freed while a chunk of the request or a KV send of it is in flight.",
             ALL, "无法释放 req_to_token slot 和 KV; no req_to_token leak (digest: slot and KV freed only when done)",
             p_no_free_in_flight),
]


DECODE_PROPERTIES = [
    Property("room-init-server-rank", "Every room's receiver is initialised (once) with the rank the bootstrap server gave it.",
             DECODE_MODES, "不改变消费点权威结果 (digest §2: without changing the authoritative result)", p_room_rank),
    Property("one-query-per-address", "At most one prefetched query per bootstrap address is in flight: a second is "
             "submitted only after the first was used or cancelled.", DECODE_MODES,
             "该地址已有在途查询，保持 FIFO，不重复提交 (digest §2 item 2)", p_one_query),
    Property("nothing-after-release", "After release_memory and until resume_memory: no query is outstanding, "
             "none is submitted, no receiver is initialised.", DECODE_MODES,
             "_cancel_prefill_dp_rank_queries() 在 release_memory_occupation() 中调用 (digest §2 item 4)",
             p_nothing_after_release),
]


def properties(role: str) -> list:
    return DECODE_PROPERTIES if role == "decode" else PROPERTIES


def prefetch_used(U):
    """Some resolve uses a prefetched answer: the overlap the prefetch is for."""
    return disj(*[ex(r) for r in U.named("resolve") if r.f["qid"] is not None])


def outside_universe(M):
    """(engine groups, formula): the loop model, without the positions, does something the universe has
    no events for or logs an event twice."""
    return [g for g in M.engine_ids if g != "E:order"], disj(*M.U.outside)


def prefetch_used_later(U):
    """Some resolve uses the answer of a query submitted in an earlier iteration (the prealloc queue
    was not polled in between)."""
    return disj(*[conj(ex(r), lt(U.get(("iter_begin", r.key[2] + 1)), r)) for r in U.named("resolve")
                  if r.f["qid"] is not None and r.key[2] < U.K])


def admission_overlap(U):
    """Some admission of N+1 falls inside run_batch(N): the overlap AHEAD is for."""
    b = U.b
    return disj(*[conj(ex(b("fwd_begin", n)), ex(b("fwd_end", n)), lt(b("fwd_begin", n), b("admit", n + 1)),
                       lt(b("admit", n + 1), b("fwd_end", n))) for n in range(U.K - 1)])


def steady(U, mode):
    """No drains: each batch is admitted in the iteration that finishes the previous one."""
    b = U.b
    if mode == "normal":
        return True
    late = "collect" if mode == "ahead" else "process_begin"
    return conj(*[lt(b("admit", n), b(late, n - 1)) for n in range(1, U.K)])


# ---- queries ------------------------------------------------------------------------------------

def position(model, e: Ev):
    """The (real-valued) position of e in a z3 model, as a Fraction."""
    from fractions import Fraction
    v = model.eval(e.pos, model_completion=True)
    return Fraction(v.numerator_as_long(), v.denominator_as_long()) if z3.is_rational_value(v) else Fraction(v.as_long())


@dataclass
class Answer:
    status: str                 # "sat" | "unsat" | "unknown"
    seconds: float
    model: object = None        # a z3 model when sat: a witness or counterexample schedule
    core: list = None           # group names when unsat
    reason: str = ""


class Model:
    """One mode with K batches: frame, engine groups and rules in one incremental solver, each group
    behind a literal so every query chooses what it assumes and cores name what a proof used."""

    def __init__(self, mode: str, k: int = 4, *, workload: Workload | None = None, drop=(), mutants=(),
                 timeout_ms: int = 60000, rlimit: int = 0, rules=None, page_size: int = 16, role: str = "prefill"):
        t0 = time.perf_counter()
        if mode not in (DECODE_MODES if role == "decode" else MODES):
            raise ValueError(f"unknown {role} mode {mode!r}")
        self.mode, self.mutants, self.role = mode, tuple(mutants), role
        if role == "decode":
            self.U = DecodeUniverse(DecodeWorkload(k), page_size)
        else:
            self.U = ModelUniverse(workload or Workload.canonical(k), page_size)
        self.K = self.U.K
        all_rules = [r for r in (rules or load_rules()) if r.role == role and r.applies(mode)]
        unknown = set(drop) - {r.id for r in all_rules}
        if unknown:
            raise ValueError(f"no rule {', '.join(sorted(unknown))} applies to mode {mode}")
        self.rules = [r for r in all_rules if r.id not in drop]
        self.not_encoded = [r.id for r in self.rules if r.kind not in ENCODERS]
        engine = decode_engine(self.U) if role == "decode" else \
            engine_model(self.U, mode, mutants, lemmas=any(r.kind == "adjacent" for r in self.rules))
        self.groups = {r.id: rule_formula(r, self.U) for r in self.rules if r.kind in ENCODERS}
        self.rule_ids = list(self.groups)
        self.groups.update({n: conj(*c) for n, c in engine.items()})
        self.engine_ids = list(engine)
        self.solver = z3.Solver()
        self.solver.set(timeout=timeout_ms)
        if rlimit:   # a deterministic budget (z3 resource units), for tests of the UNKNOWN path
            self.solver.set(rlimit=rlimit)
        self._distinct = set()   # compared pairs whose distinctness is asserted
        self.solver.add(*frame(self.U, self._distinct))
        self.lit, self._by_lit, self._extra = {}, {}, {}
        for name, f in self.groups.items():
            lit = z3.Bool(f"[{name}]")
            self.solver.add(z3.Implies(lit, as_z3(f)))
            self.lit[name], self._by_lit[str(lit)] = lit, name
        self.build_seconds = time.perf_counter() - t0

    def _assume(self, f):
        f = as_z3(f)
        lit = self._extra.get(f.get_id())
        if lit is None:
            lit = self._extra[f.get_id()] = z3.Bool(f"[q{len(self._extra)}]")
            self.solver.add(z3.Implies(lit, f), *distinct_compared(self.U, self._distinct))
        return lit

    def check(self, use, extra=True) -> Answer:
        lits = [self.lit[n] for n in use] + ([] if extra is True else [self._assume(extra)])
        t0 = time.perf_counter()
        r = self.solver.check(*lits)
        if r == z3.sat:
            return Answer("sat", time.perf_counter() - t0, model=self.solver.model())
        dt = time.perf_counter() - t0
        if r == z3.unsat:
            core = [self._by_lit[str(c)] for c in self.solver.unsat_core() if str(c) in self._by_lit]
            return Answer("unsat", dt, core=core)
        return Answer("unknown", dt, reason=self.solver.reason_unknown())

    def minimal(self, use, extra=True):
        """A minimal subset of `use` with (subset ∧ extra) unsat: deletion from the unsat core, engine
        groups tried first so that rules are kept where they suffice. None when not unsat."""
        a = self.check(use, extra)
        if a.status != "unsat":
            return None, a
        keep = [n for n in use if n in a.core]
        spent = a.seconds
        for n in sorted(keep, key=lambda x: (not x.startswith("E:"), x)):
            if n not in keep:
                continue
            trial = [x for x in keep if x != n]
            b = self.check(trial, extra)
            spent += b.seconds
            if b.status == "unsat":
                keep = [x for x in trial if x in b.core]
        return keep, Answer("unsat", spent, core=keep)

    # -- reading a schedule out of a z3 model
    def schedule(self, model, hidden=False) -> list[Ev]:
        evs = [e for e in self.U.events if z3.is_true(model.eval(as_z3(e.exists), model_completion=True))]
        if hidden:
            evs += self.U.hidden
        return sorted(evs, key=lambda e: (position(model, e), str(e.key)))

    def thread_name(self, t: int) -> str:
        names = {v: k for k, v in (DECODE_THREADS if self.role == "decode" else THREAD_IDS).items()}
        return names.get(t, "device")

    def thread_of(self, model, e) -> int:
        t = e.thread if isinstance(e.thread, int) else model.eval(e.thread, model_completion=True).as_long()
        return t

    def to_trace(self, model) -> tuple[dict, list[dict]]:
        """The schedule of a z3 model as a pdo-trace (header, events): objects, digests, slots,
        counter values and token counts read from the model. Used to test witnesses with the linear
        checker."""
        header = {"format": "pdo-trace", "version": 1, "role": self.role, "mode": self.mode,
                  "page_size": self.U.page_size, "source": "spec.z3model"}
        if self.role == "decode":
            header["prefetch"] = True
        val = lambda v: model.eval(v, model_completion=True).as_long() if _is_z3(v) else v   # noqa: E731
        out = []
        for i, e in enumerate(self.schedule(model), 1):
            d = {"seq": i, "t_ns": i * 1000, "thread": self.thread_name(self.thread_of(model, e)), "ev": e.name}
            for k, v in e.f.items():
                if _is_z3(v):
                    v = val(v)
                    v = f"o{v}" if k == "obj" else f"d{v}" if k == "digest" else v
                elif isinstance(v, dict):
                    v = {r: val(x) for r, x in v.items()}
                d[k] = list(v) if isinstance(v, tuple) else v
            if e.batch is not None:
                d["batch"] = e.batch
            out.append(d)
        return header, out


# ---- the answers: proofs, the mode table, the AHEAD steady state ------------------------------------

@dataclass
class Query:
    what: str
    answer: Answer

    @property
    def status(self):
        return self.answer.status


@dataclass
class Proof:
    prop: Property
    mode: str
    status: str                 # PROVED | REFUTED | UNKNOWN
    basis: str                  # "rules" (rules alone) | "engine+rules" | "engine" (engine alone)
    core: list                  # a minimal set of rules (and engine groups) that proves it
    engine: str                 # the engine model alone: PROVED | REFUTED | UNKNOWN
    seconds: float
    counterexample: object = None   # a z3 model of the negation (REFUTED)
    note: str = ""


def prove(M: Model, prop: Property, *, basis: str = "auto") -> Proof:
    """PROVED from the rules alone when they suffice, else from engine ∧ rules (basis "auto"); the
    core is minimal: drop any member and z3 finds a counterexample."""
    bad = neg(prop.formula(M.U))
    spent = 0.0
    eng = M.check(M.engine_ids, bad)
    spent += eng.seconds
    engine_status = {"unsat": "PROVED", "sat": "REFUTED"}.get(eng.status, "UNKNOWN")
    tries = {"auto": [("rules", M.rule_ids), ("engine+rules", M.rule_ids + M.engine_ids)],
             "rules": [("rules", M.rule_ids)], "engine": [("engine", M.engine_ids)]}[basis]
    last = None
    for name, use in tries:
        core, a = M.minimal(use, bad)
        spent += a.seconds
        if a.status == "unsat":
            return Proof(prop, M.mode, "PROVED", name, core, engine_status, spent)
        last = (name, a)
    name, a = last
    if a.status == "sat":
        return Proof(prop, M.mode, "REFUTED", name, [], engine_status, spent, counterexample=a.model)
    return Proof(prop, M.mode, "UNKNOWN", name, [], engine_status, spent,
                 note=f"solver gave up ({a.reason}) after {a.seconds:.1f} s")


def vacuity(M: Model) -> list[Query]:
    """The rules admit a schedule; so do engine ∧ rules; and whether admission of N+1 can fall
    inside run_batch(N) (intended in ahead, impossible elsewhere)."""
    return [Query("the rules admit a schedule", M.check(M.rule_ids)),
            Query("engine ∧ rules admit a schedule", M.check(M.rule_ids + M.engine_ids)),
            Query("admit(N+1) inside run_batch(N) (engine ∧ rules)",
                  M.check(M.rule_ids + M.engine_ids, admission_overlap(M.U)))]


def conformance(M: Model) -> list[Query]:
    """The engine model satisfies each rule: engine ∧ ¬rule is unsat."""
    return [Query(rid, M.check(M.engine_ids, neg(M.groups[rid]))) for rid in M.rule_ids]


# The four-mode table of the seed: which steps the "result-processing order" column names, per mode.
# Each step is (label, [(event, batch offset from N)]); the order between them is what z3 computes.
ORDER_STEPS = {
    "normal": [("run(N)", [("fwd_begin", 0)]), ("process(N)", [("process_begin", 0)])],
    "overlap": [("run(N)", [("fwd_begin", 0)]), ("process(N-1)", [("process_begin", -1)]), ("sample(N)", [("sample", 0)])],
    "thread": [("run(N)", [("fwd_begin", 0)]), ("process(N-1)", [("process_begin", -1)]), ("sample(N)", [("sample", 0)])],
    "ahead": [("build(N)", [("admit", 0)]), ("collect/sample(N-1)", [("collect", -1), ("sample", -1)]),
              ("submit(N)", [("submit", 0)]), ("process(N-1)", [("process_begin", -1)])],
}
OLD_PIPELINE = "keeps the old pipeline order"


def _forced(M, use, cond, a: Ev, b: Ev) -> Query:
    """a precedes b in every schedule (with cond): the opposite order is unsat."""
    return Query(f"{key_label(a.key)} < {key_label(b.key)}", M.check(use, conj(cond, ex(a), ex(b), lt(b, a))))


def mode_row(M: Model, basis: str, n: int = 1) -> tuple[dict, list[Query]]:
    """One row of the seed's table for M.mode, every cell a z3 query on `basis` ("rules" or "engine")."""
    use = M.rule_ids if basis == "rules" else M.engine_ids
    U, qs = M.U, []
    fb = U.b("fwd_begin", n)
    on_s = Query("run_batch on the scheduler thread", M.check(use, conj(ex(fb), th(fb) == SCHED)))
    on_w = Query("run_batch on another thread", M.check(use, conj(ex(fb), th(fb) != SCHED)))
    ov = Query("admit(N+1) inside run_batch(N)", M.check(use, admission_overlap(U)))
    qs += [on_s, on_w, ov]
    where = "scheduler" if (on_s.status, on_w.status) == ("sat", "unsat") else \
        "worker" if (on_s.status, on_w.status) == ("unsat", "sat") else "unknown"
    steps = [(label, [U.b(ev, n + off) for ev, off in evs]) for label, evs in ORDER_STEPS[M.mode]]
    cond = steady(U, M.mode)
    arrows = []
    for (_, a), (_, b) in zip(steps, steps[1:]):
        q = _forced(M, use, cond, a[-1], b[0])
        qs.append(q)
        arrows.append(" → " if q.status == "unsat" else " ? ")
    for _, evs in steps:   # a compound step ("collect/sample") must be ordered inside too
        for a, b in zip(evs, evs[1:]):
            q = _forced(M, use, cond, a, b)
            qs.append(q)
            if q.status != "unsat":
                arrows.append(" ? ")
    text = steps[0][0] + "".join(arr + label for arr, (label, _) in zip(arrows, steps[1:]))
    row = {"run_batch_on": where, "admission_overlaps_unreturned_run_batch":
           {"sat": True, "unsat": False}.get(ov.status), "processing_order": text}
    return row, qs


def mode_table(k: int = 3, log=None) -> tuple[dict, dict]:
    """The seed's four-mode table computed twice, from the rules alone and from the engine model
    alone. Returns ({"modes": {...}} from the rules, {mode: [disagreements]})."""
    modes, differ = {}, {}
    for mode in MODES:
        M = Model(mode, k)
        row, qs = mode_row(M, "rules")
        erow, eqs = mode_row(M, "engine")
        if log:
            for basis, qq in (("rules", qs), ("engine", eqs)):
                for q in qq:
                    log(f"  {mode:8s} {basis:6s} {q.what:44s} {_verdict(q.answer):8s} {q.answer.seconds:7.3f} s")
        differ[mode] = [k for k in row if row[k] != erow[k]]
        modes[mode] = row
    if modes["thread"]["processing_order"] == modes["overlap"]["processing_order"]:
        modes["thread"]["processing_order"] = f"{OLD_PIPELINE}: {modes['thread']['processing_order']}"
    return {"modes": modes}, differ


def _verdict(a: Answer) -> str:
    return {"sat": "witness", "unsat": "UNSAT"}.get(a.status, "UNKNOWN")


# The AHEAD steady state (seed, steps 1-7) for N = 1: the scenario in which the worker is busy with
# run_batch(N) while the scheduler processes N-1 and builds N+1, and busy with run_batch(N+1) while it
# processes N and builds N+2. z3 finds a schedule of engine ∧ rules with it; the table is read off it.
def ahead_scenario(U, n=1):
    b = U.b
    built = lambda m: _groups(U, m)[0][-1]   # noqa: E731 - the last event of building batch m
    return conj(steady(U, "ahead"),
                lt(b("fwd_begin", n), b("process_begin", n - 1)), lt(built(n + 1), b("fwd_end", n)),
                lt(b("fwd_begin", n + 1), b("process_begin", n)), lt(built(n + 2), b("fwd_end", n + 1)))


PHASES = [  # scheduler events that start a step of the table, and how the step is called
    ("process_begin", "process_batch_result({b}), KV inflight"),
    ("admit", "build batch {b}"),
    ("collect", "collect({b}), waiting for the worker if needed"),
    ("sample", "sample({b}); snapshot and staging for {next}; early-send cached prefix"),
    ("submit", "submit({b})"),
]


def _rel(m, n):
    return "N" if m == n else f"N{m - n:+d}"


def ahead_steady_table(k: int = 4, n: int = 1):
    """Rows (step, scheduler, forward worker) read from a z3 model of the AHEAD scenario."""
    M = Model("ahead", max(k, n + 3))
    a = M.check(M.rule_ids + M.engine_ids, ahead_scenario(M.U, n))
    if a.status != "sat":
        return [], a
    model = a.model
    evs = M.schedule(model)
    pos = {e.key: i for i, e in enumerate(evs)}   # ranks: "the next event" is +1
    start, stop = pos[("process_begin", n - 1)], pos[("fwd_end", n + 1)]
    phases = dict((ev, text) for ev, text in PHASES)
    rows, cur = [], None
    for e in evs:
        if not start <= pos[e.key] < stop or M.thread_of(model, e) != SCHED:
            continue
        if e.name in phases:
            m = e.batch
            kind = "build" if e.name == "admit" else e.name
            if cur is None or (kind, m) != cur[:2]:
                cur = (kind, m, pos[e.key])
                rows.append([cur, phases[e.name].format(b=_rel(m, n), next=_rel(m + 1, n))])
    # A step runs from its first scheduler event to the next step's; `collect` is entered as soon as
    # the previous step's work is done (its wait for the worker is part of it).
    sched = sorted(pos[e.key] for e in evs if M.thread_of(model, e) == SCHED)
    ends = [max(p for p in sched if r[0][2] <= p < (rows[i + 1][0][2] if i + 1 < len(rows) else stop))
            for i, r in enumerate(rows)]
    out, before = [], None
    for i, (cur, text) in enumerate(rows):
        lo = ends[i - 1] + 1 if cur[0] == "collect" and i else cur[2]
        hi = rows[i + 1][0][2] if i + 1 < len(rows) else stop
        if i + 1 < len(rows) and rows[i + 1][0][0] == "collect":
            hi = ends[i] + 1
        state = _worker_state(model, pos, lo, hi, n, M.K)
        out.append((i + 1, text, ("still " + state) if state == before and state.startswith("run_batch") else state))
        before = state
    return out, a


def _worker_state(model, pos, lo, hi, n, k):
    """What the forward worker does while the scheduler runs the step [lo, hi)."""
    for m in range(k):
        fb, fe = pos[("fwd_begin", m)], pos[("fwd_end", m)]
        if lo <= fb < hi:
            return f"starts run_batch({_rel(m, n)})"
        if lo <= fe < hi or lo <= pos[("batch_copy", m)] < hi:
            return "returns result and batch copy, then idle"
        if fb < lo and fe >= hi:
            return f"run_batch({_rel(m, n)})"
    return "idle"


def timeline(M: Model, model, *, hidden=False, width=34) -> list[str]:
    """A schedule as two lanes, scheduler | forward (and device work when `hidden`)."""
    lanes = [M.thread_name(SCHED), M.thread_name(FWD)] + (["device"] if hidden else [])
    lines = ["      " + " | ".join(f"{x:<{width}}" for x in lanes).rstrip()]
    for i, e in enumerate(M.schedule(model, hidden=hidden), 1):
        if e.name in ("iteration_end", "iteration_top"):
            continue
        t = M.thread_of(model, e)
        col = {SCHED: 0, FWD: 1}.get(t, 2)
        cells = [""] * len(lanes)
        cells[col] = _show(e, model)
        lines.append(f"{i:>4}  " + " | ".join(f"{c:<{width}}" for c in cells).rstrip())
    return lines


def _show(e: Ev, model) -> str:
    extra = []
    for k in ("obj", "slot", "value", "digest"):
        v = e.f.get(k)
        if _is_z3(v) and e.name in ("alloc", "release", "chunk_inc", "chunk_dec", "snapshot", "fwd_begin"):
            v = model.eval(v, model_completion=True).as_long()
            extra.append(f"{k}={'o' if k == 'obj' else 'd' if k == 'digest' else ''}{v}")
    return key_label(e.key) + (f" [{' '.join(extra)}]" if extra else "")


# ---- traces as models ------------------------------------------------------------------------------

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
    return Workload(tuple(tuple(Chunk(r, (r, b) in middle, (r, b) in prefix) for r in rids[b])
                          for b in range(len(rids))))


def _trace_keys(events: list[dict]) -> list:
    """The model key of each trace event (kv_send and chunk_dec by the processing span they are in)."""
    keys, inc_batch, span = [], None, None
    for e in events:
        ev = e["ev"]
        if ev == "admit":
            inc_batch = e["batch"]      # its chunk_inc events follow it directly on the scheduler
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
    exist are bound to the trace; z3 looks for the hidden points (queues, device, iteration ends)."""
    M = Model(mode, workload=workload_of(events), page_size=header.get("page_size", 16), timeout_ms=timeout_ms)
    by_key = {k: i for i, k in enumerate(_trace_keys(events), 1)}
    bind = []
    for e in M.U.events:
        seq = by_key.get(e.key)
        bind.append(e.exists == (seq is not None) if e.exists is not True else (seq is not None))
        if seq is not None:
            tid = THREAD_IDS[events[seq - 1]["thread"]]
            bind += [e.pos == seq * 1000, e.thread == tid]
    if len(by_key) != len(events):
        return Answer("unsat", 0.0, reason="two trace events map to one model event")
    return M.check(M.engine_ids, conj(*bind))
