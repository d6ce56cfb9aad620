"""The z3 encodings of the prefill rule kinds (spec/rules.toml), one function per kind.

The comment above each function is the kind's semantics, matching checker/linear.py. Each works on a
symbolic universe (every candidate) and on a trace (candidates narrowed by the known positions).
"""

from __future__ import annotations

from collections import defaultdict

import z3

from .encoding import ENCODERS
from .logic import as_z3, conj, disj, eq, implies, is_term, lt, neg


# fifo: each listed event at most once per batch, only after an admit of its batch, in batch order.
@ENCODERS.register("fifo")
def enc_fifo(rule, universe):
    for name in rule["events"]:
        per_batch = {}
        for e in universe.named(name):
            per_batch.setdefault(e.batch, []).append(e)
        for b, es in per_batch.items():
            for e1, e2 in zip(es, es[1:]):
                yield neg(conj(e1.exists, e2.exists)), [e1, e2]
            if name != "admit":
                for e in es:
                    admits = universe.among(universe.occ("admit", b), hi=e)
                    yield (
                        implies(e.exists, disj(*[conj(a.exists, lt(a, e)) for a in admits])),
                        [e, *admits],
                    )
        firsts = [per_batch[b][0] for b in sorted(per_batch)]
        pairs = (
            list(zip(firsts, firsts[1:]))
            if universe.ordered
            else [(x, y) for i, x in enumerate(firsts) for y in firsts[i + 1 :]]
        )
        for x, y in pairs:
            yield implies(conj(x.exists, y.exists), lt(x, y)), [x, y]


# complete: every admitted batch has each listed event.
@ENCODERS.register("complete")
def enc_complete(rule, universe):
    for b in universe.admitted():
        for name in rule["events"]:
            yield disj(*[e.exists for e in universe.occ(name, b)]), [universe.at("admit", b)]


def _open_until(universe, y, x, end_name):
    """The span opened by begin y is closed by an end of y's batch strictly between y and x."""
    ends = universe.among(universe.occ(end_name, y.batch), lo=y, hi=x)
    return disj(*[conj(e.exists, lt(y, e), lt(e, x)) for e in ends]), ends


# disjoint: no begin while any span [begin(N), end(N)] is open. A span is open at p when the latest
# of its batch's begin/end events before p is a begin; equivalently, between every begin and the
# next begin there is an end of the first one's batch (consecutive pairs suffice when positions are
# known).
@ENCODERS.register("disjoint")
def enc_disjoint(rule, universe):
    begin, end = rule["span"]
    for y, x in universe.succ_pairs(universe.named(begin)):
        closed, ends = _open_until(universe, y, x, end)
        yield implies(conj(y.exists, x.exists, lt(y, x)), closed), [y, x, *ends]


# outside: no `ev` while a span is open: after each begin, an end of its batch comes before any ev.
@ENCODERS.register("outside")
def enc_outside(rule, universe):
    begin, end = rule["span"]
    evs = universe.named(rule["ev"])
    for y in universe.named(begin):
        for x in universe.first_after(y, evs):
            closed, ends = _open_until(universe, y, x, end)
            yield implies(conj(y.exists, x.exists, lt(y, x)), closed), [y, x, *ends]


# order: for each admitted N (and with `when`, only where when[0] precedes when[1]), consecutive
# chain elements that exist are in increasing order; the first `same_thread_prefix` ones on one
# thread.
@ENCODERS.register("order")
def enc_order(rule, universe):
    chain = [(name, off) for name, off in rule["chain"]]
    when = rule.get("when")
    same = len(chain) if rule.get("same_thread") else rule.get("same_thread_prefix", 0)
    for n in universe.admitted():
        guard, refs = True, []
        if when:
            (a, ao), (b, bo) = when
            wa, wb = universe.at(a, n + ao), universe.at(b, n + bo)
            if wa is None or wb is None:
                continue
            guard, refs = conj(wa.exists, wb.exists, lt(wa, wb)), [wa, wb]
        got = [(i, universe.at(name, n + off)) for i, (name, off) in enumerate(chain)]
        got = [(i, e) for i, e in got if e is not None]
        for k1 in range(len(got)):
            for k2 in range(k1 + 1, len(got)):
                (_, e1), (i2, e2) = got[k1], got[k2]
                between = [e for _, e in got[k1 + 1 : k2]]
                cond = conj(guard, e1.exists, e2.exists, *[neg(e.exists) for e in between])
                body = conj(lt(e1, e2), eq(e1.thread, e2.thread) if i2 < same else True)
                yield implies(cond, body), [e1, e2, *refs]


# adjacent: on `thread`, the event right after first(N) is then(N).
@ENCODERS.register("adjacent")
def enc_adjacent(rule, universe):
    thread = universe.tid(rule["thread"])
    for x in universe.named(rule["first"]):
        if universe.ordered:
            nxt = universe.on_thread_between(thread, x, None)[:1] if x.thread == thread else []
            cands = [y for y in nxt if y.name == rule["then"] and y.batch == x.batch]
        else:
            cands = universe.occ(rule["then"], x.batch)
        alts = []
        for y in cands:
            others = [
                z for z in universe.on_thread_between(thread, x, y) if z is not x and z is not y
            ]
            quiet = conj(
                *[neg(conj(z.exists, eq(z.thread, thread), lt(x, z), lt(z, y))) for z in others]
            )
            alts.append(conj(y.exists, eq(y.thread, thread), lt(x, y), quiet))
        yield implies(conj(x.exists, eq(x.thread, thread)), disj(*alts)), [x, *cands]


# within: every ev(N) lies between after(N) and before(N), on `thread` or on the thread of
# same_thread_as(N).
@ENCODERS.register("within")
def enc_within(rule, universe):
    for x in universe.named(rule["ev"]):
        b = x.f.get("batch", x.batch)
        lo, hi = universe.at(rule["after"], b), universe.at(rule["before"], b)
        if lo is None or hi is None:
            yield neg(x.exists), [x]
            continue
        refs = [x, lo, hi]
        if rule.get("thread"):
            want = universe.tid(rule["thread"])
        else:
            ref = universe.at(rule["same_thread_as"], b)
            if ref is None:
                yield neg(x.exists), refs
                continue
            want = ref.thread
            refs.append(ref)
        yield (
            implies(x.exists, conj(lo.exists, hi.exists, lt(lo, x), lt(x, hi), eq(x.thread, want))),
            refs,
        )


# thread: listed events run on `thread` (or never on `not_thread`).
@ENCODERS.register("thread")
def enc_thread(rule, universe):
    for name in rule["events"]:
        for e in universe.named(name):
            if rule.get("thread") is not None:
                yield implies(e.exists, eq(e.thread, universe.tid(rule["thread"]))), [e]
            if rule.get("not_thread") is not None:
                yield implies(e.exists, neg(eq(e.thread, universe.tid(rule["not_thread"])))), [e]


# equal: field of the first a(N) equals field of the first b(N).
@ENCODERS.register("equal")
def enc_equal(rule, universe):
    a, b, name = rule["a"], rule["b"], rule["field"]
    for bt in universe.batches_of(a):
        x, y = universe.at(a, bt), universe.at(b, bt)
        if y is not None:
            yield implies(conj(x.exists, y.exists), eq(x.f[name], y.f[name])), [x, y]


def running_count(universe, x, evs, inc, strict):
    """Σ ±1 over the inc/dec events on x's object up to x (before x when strict)."""
    terms, refs = [], []
    for y in evs:
        same = eq(y.f["obj"], x.f["obj"])
        if same is False:
            continue
        if y is x:
            if not strict:
                terms.append(1 if y.name == inc else -1)
            continue
        refs.append(y)
        c = conj(y.exists, same, lt(y, x))
        if c is not False:
            terms.append(z3.If(as_z3(c), 1, 0) * (1 if y.name == inc else -1))
    return (z3.Sum(terms) if terms else z3.IntVal(0)), refs


def _total(universe, x, evs, inc):
    terms = []
    for y in evs:
        c = conj(y.exists, eq(y.f["obj"], x.f["obj"]))
        if c is not False:
            terms.append(z3.If(as_z3(c), 1, 0) * (1 if y.name == inc else -1))
    return z3.Sum(terms) if terms else z3.IntVal(0)


def _by_obj(universe, evs):
    """Trace: group by the static object; model: one group (objects are symbolic)."""
    if not universe.ordered:
        return {None: evs}
    groups = defaultdict(list)
    for e in evs:
        groups[e.f["obj"]].append(e)
    return groups


# counter: inc/dec move the counter of their object by one, reported in `value`, never below zero,
# zero at the end; each on an object that `owner` allocated for that rid before it.
@ENCODERS.register("counter")
def enc_counter(rule, universe):
    inc, dec, owner = rule["inc"], rule["dec"], rule["owner"]
    owners = defaultdict(list)
    for a in universe.named(owner):
        owners[a.rid].append(a)
    for _, evs in _by_obj(universe, universe.named(inc) + universe.named(dec)).items():
        evs = sorted(evs, key=lambda e: e.seq) if universe.ordered else evs
        for x in evs:
            own = universe.among(owners.get(x.rid, []), hi=x)
            owned = disj(*[conj(a.exists, lt(a, x), eq(a.f["obj"], x.f["obj"])) for a in own])
            run, refs = running_count(universe, x, evs, inc, strict=False)
            body = conj(
                owned, x.f["value"] == run, x.f["value"] >= 0, _total(universe, x, evs, inc) == 0
            )
            yield implies(x.exists, body), [x, *own, *refs]


# lifecycle/pairing: per rid, acquire and release alternate (starting with acquire, ending with
# release), each release on the object and slot of the acquire before it; and an acquired slot is
# not acquired again before its holder's release.
def _pairing(rule, universe):
    acq, rel = rule["acquire"], rule["release"]
    per_rid = defaultdict(list)
    for e in universe.named(acq) + universe.named(rel):
        per_rid[e.rid].append(e)
    if universe.ordered:
        for lst in per_rid.values():
            lst.sort(key=lambda e: e.seq)

    def nothing_between(mine, a, b):
        return conj(
            *[neg(conj(w.exists, lt(a, w), lt(w, b))) for w in universe.among(mine, lo=a, hi=b)]
        )

    for y in universe.named(acq):
        mine = per_rid[y.rid]
        alts, refs = [], []
        for z in universe.first_after(y, mine):
            refs.append(z)
            if z.name == rel:
                alts.append(
                    conj(
                        z.exists,
                        lt(y, z),
                        eq(z.f["obj"], y.f["obj"]),
                        eq(z.f["slot"], y.f["slot"]),
                        nothing_between(mine, y, z),
                    )
                )
        yield implies(y.exists, disj(*alts)), [y, *refs]
    for x in universe.named(rel):
        mine = per_rid[x.rid]
        cands = universe.last_before(x, mine)
        alts = [
            conj(z.exists, lt(z, x), nothing_between(mine, z, x)) for z in cands if z.name == acq
        ]
        yield implies(x.exists, disj(*alts)), [x, *cands]
    slots = defaultdict(list) if universe.ordered else {None: universe.named(acq)}
    if universe.ordered:
        for e in universe.named(acq):
            slots[e.f["slot"]].append(e)
    for lst in slots.values():
        for y, x in universe.succ_pairs(lst):
            later = universe.among([w for w in per_rid[y.rid] if w is not y], lo=y, hi=x)
            freed = disj(*[conj(w.exists, lt(y, w), lt(w, x)) for w in later])
            yield (
                implies(conj(y.exists, x.exists, lt(y, x), eq(y.f["slot"], x.f["slot"])), freed),
                [y, x, *later],
            )


# lifecycle/after_done: a release of rid comes after the processing of every batch admitted with rid
# before it, no batch admits rid after it, its object has no middle chunk in flight, and some KV of
# rid was sent before it.
def _after_done(rule, universe):
    rel, sent = rule["release"], rule["sent"]
    inc, dec = rule["counter"]
    admits = defaultdict(list)
    for a in universe.named("admit"):
        for r in a.f["rids"]:
            admits[r].append(a)
    sends = defaultdict(list)
    for s in universe.named(sent):
        sends[s.rid].append(s)
    counted = _by_obj(universe, universe.named(inc) + universe.named(dec))
    for x in universe.named(rel):
        for a in admits.get(x.rid, []):
            done = universe.among(
                [p for ev in rule["processed"] for p in universe.occ(ev, a.batch)], hi=x
            )
            yield (
                implies(
                    conj(x.exists, a.exists),
                    conj(lt(a, x), disj(*[conj(p.exists, lt(p, x)) for p in done])),
                ),
                [x, a, *done],
            )
        evs = counted.get(x.f["obj"] if universe.ordered else None, [])
        run, refs = running_count(universe, x, universe.among(evs, hi=x), inc, strict=True)
        yield implies(x.exists, run <= 0), [x, *refs]
        before = universe.among(sends.get(x.rid, []), hi=x)
        yield implies(x.exists, disj(*[conj(s.exists, lt(s, x)) for s in before])), [x, *before]


@ENCODERS.register("lifecycle")
def enc_lifecycle(rule, universe):
    return _pairing(rule, universe) if rule["check"] == "pairing" else _after_done(rule, universe)


# page_count: pages == ceil(tokens / page_size) where an event carries both.
@ENCODERS.register("page_count")
def enc_page_count(rule, universe):
    ps = universe.page_size
    for name in rule["events"]:
        for e in universe.named(name):
            if "tokens" in e.f and "pages" in e.f:
                t, p = e.f["tokens"], e.f["pages"]
                ok = (
                    (p == -(-t // ps))
                    if not (is_term(t) or is_term(p))
                    else z3.And(p * ps >= t, (p - 1) * ps < t)
                )
                yield implies(e.exists, ok), [e]


# each_in_span: for every batch N and every rid its admit lists, some ev for rid falls strictly
# between a begin(N) and a later end(N), on the begin's thread.
# page_aligned: a send with `start` starts on a page boundary; one followed by another send for the
# same request covers whole pages.
@ENCODERS.register("page_aligned")
def enc_page_aligned(rule, universe):
    ps = universe.page_size
    sends = [
        e
        for name in rule["events"]
        for e in universe.named(name)
        if isinstance(e.f.get("start"), int) and "tokens" in e.f
    ]
    for x in sends:
        yield implies(x.exists, x.f["start"] % ps == 0), [x]
        for y in sends:
            if y is not x and y.rid == x.rid:
                whole = x.f["tokens"] % ps == 0
                yield implies(conj(x.exists, y.exists, lt(x, y)), whole), [x, y]


@ENCODERS.register("each_in_span")
def enc_each_in_span(rule, universe):
    begin, end = rule["span"]
    per_rid = defaultdict(list)
    for e in universe.named(rule["ev"]):
        per_rid[e.rid].append(e)
    for a in universe.named("admit"):
        for y in universe.occ(begin, a.batch):
            for z in universe.occ(end, a.batch):
                for rid in a.f["rids"]:
                    inside = universe.among(per_rid.get(rid, []), lo=y, hi=z)
                    yield (
                        implies(
                            conj(a.exists, y.exists, z.exists, lt(y, z)),
                            disj(
                                *[
                                    conj(e.exists, eq(e.thread, y.thread), lt(y, e), lt(e, z))
                                    for e in inside
                                ]
                            ),
                        ),
                        [a, y, z, *inside],
                    )


# chunk_sent: where admits carry `chunks`, each send overlapping a batch's chunk of a request comes
# after that batch's `done` event (or, with device_wait, its `started` event) and before the
# request's release; the sends that exist cover the chunk (linear: ChunkSent).
@ENCODERS.register("chunk_sent")
def enc_chunk_sent(rule, universe):
    sends = [
        s
        for name in rule["sends"]
        for s in universe.named(name)
        if isinstance(s.f.get("start"), int) and isinstance(s.f.get("tokens"), int)
    ]
    releases = universe.named(rule["release"])
    for a in universe.named("admit"):
        chunks = a.f.get("chunks")
        if not isinstance(chunks, dict):
            continue
        done, started = universe.occ(rule["done"], a.batch), universe.occ(rule["started"], a.batch)
        for rid, rng in chunks.items():
            if not (isinstance(rng, list) and len(rng) == 2 and rng[0] < rng[1]):
                continue
            lo, hi = rng
            over = [
                s
                for s in sends
                if s.rid == rid and s.f["start"] < hi and s.f["start"] + s.f["tokens"] > lo
            ]
            for s in over:
                waits = started if s.f.get("device_wait") is True else []
                ok = disj(*[conj(d.exists, lt(d, s)) for d in done + waits])
                yield implies(conj(a.exists, s.exists), ok), [a, s, *done, *waits]
                for r in (r for r in releases if r.rid == rid):
                    yield implies(conj(s.exists, r.exists), lt(s, r)), [s, r]
            covered, at = True, lo
            for s in sorted(over, key=lambda s: s.f["start"]):
                if s.f["start"] > at:
                    covered = False
                    break
                at = max(at, s.f["start"] + s.f["tokens"])
            if not covered or at < hi:
                yield neg(a.exists), [a, *over]


# in_span: every ev for rid falls in a span whose begin is the latest begin/end on its thread before
# it, of a batch whose latest admit before it lists rid.
@ENCODERS.register("in_span")
def enc_in_span(rule, universe):
    begin, end = rule["span"]
    spans = universe.named(begin) + universe.named(end)
    if universe.ordered:
        per_thread = defaultdict(list)
        for e in spans:
            per_thread[e.thread].append(e)
        for lst in per_thread.values():
            lst.sort(key=lambda e: e.seq)
    for x in universe.named(rule["ev"]):
        cands = (
            universe.last_before(x, per_thread.get(x.thread, []))
            if universe.ordered
            else universe.named(begin)
        )
        alts, refs = [], list(cands)
        for y in cands:
            if y.name != begin:
                continue
            quiet = conj(
                *[
                    neg(conj(z.exists, eq(z.thread, x.thread), lt(y, z), lt(z, x)))
                    for z in (universe.among(spans, lo=y, hi=x) if not universe.ordered else [])
                ]
            )
            adm = universe.last_before(x, universe.occ("admit", y.batch))  # the admit in force at x
            member = disj(
                *[
                    conj(
                        a.exists,
                        lt(a, x),
                        x.rid in a.f["rids"],
                        *[neg(conj(a2.exists, lt(a, a2), lt(a2, x))) for a2 in adm if a2 is not a],
                    )
                    for a in adm
                ]
            )
            refs += adm
            alts.append(conj(y.exists, eq(y.thread, x.thread), lt(y, x), quiet, member))
        yield implies(x.exists, disj(*alts)), [x, *refs]
