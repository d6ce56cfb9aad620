"""The z3 encodings of the decode rule kinds of the DP-rank prefetch (spec/decode_rules.toml,
checker/decode_templates.py): its queries to the bootstrap server, one function per kind; and the
look-ups the receiver kinds (receiver_encodings.py) share.

The comment above each function is the kind's semantics, matching checker/decode_templates.py.
"""

from __future__ import annotations

from collections import defaultdict

from .encoding import ENCODERS
from .logic import conj, disj, eq, implies, is_term, lt, neg

# Prefetched DP-rank queries, one per bootstrap address: a prefetch_submit is outstanding until a
# prefetch_cancel or a resolve of its address names its qid. Rooms are pending from req_add until
# receiver_init or req_abort; a room's rank is known from the first resolve that answers it.


def rooms_of(e):
    r = e.f.get("rooms")
    return tuple(r) if isinstance(r, (list, tuple)) else ()


def answers_of(e) -> dict:
    res = e.f.get("result")
    out = {}
    for k, v in res.items() if isinstance(res, dict) else ():
        try:
            out[int(k)] = v
        except (TypeError, ValueError):
            pass
    return out


def group_by(evs, key):
    out = defaultdict(list)
    for e in evs:
        out[key(e)].append(e)
    return out


def latest_of(universe, y, x, same):
    """y is the latest of `same` before x (known statically in a trace)."""
    if universe.ordered:
        return True
    return conj(
        *[neg(conj(z.exists, lt(y, z), lt(z, x))) for z in same if z is not y and z is not x]
    )


def _outstanding(universe, x, subs, closers):
    """A query of this address is outstanding just before x: its latest submit is not yet closed."""
    alts, refs = [], []
    for y in universe.last_before(x, subs):
        mine = [z for z in closers if z.f.get("qid") == y.f["qid"]]
        refs += [y, *mine]
        closed = disj(*[conj(z.exists, lt(y, z), lt(z, x)) for z in mine])
        alts.append(conj(y.exists, lt(y, x), latest_of(universe, y, x, subs), neg(closed)))
    return disj(*alts), refs


def _query_state(universe):
    subs = group_by(universe.named("prefetch_submit"), lambda e: e.f["addr"])
    closers = group_by(
        [
            e
            for e in universe.named("prefetch_cancel") + universe.named("resolve")
            if e.f.get("qid") is not None
        ],
        lambda e: e.f["addr"],
    )
    if universe.ordered:
        for lst in closers.values():
            lst.sort(key=lambda e: e.seq)
    return subs, closers


def before_any(universe, x, cands):
    return disj(*[conj(a.exists, lt(a, x)) for a in cands])


def stopped(cancel):
    """The cancel stopped its query (Future.cancel() returned True): a trace's `stopped` true,
    the model's symbolic field; absent (a trace from before the field) reads as not known to."""
    v = cancel.f.get("stopped")
    return v if is_term(v) else v is True


def began_anyway(universe, x, cancels):
    """A cancel of x's query, before x, that did not stop it: the pool thread had already taken
    the call, so x (its query_begin) may come after the cancel, its answer unused."""
    return disj(*[conj(c.exists, lt(c, x), neg(stopped(c))) for c in cancels])


# one_inflight: no prefetch_submit for an address while one of its queries is outstanding. On a
# symbolic universe, the equivalent pairwise form (on a total order, "the latest earlier submit was
# closed before each submit" holds for every submit iff every earlier submit was closed before each
# later one): the "latest" form makes z3 enumerate orders of the submits.
@ENCODERS.register("one_inflight")
def enc_one_inflight(rule, universe):
    subs, closers = _query_state(universe)
    for a, lst in subs.items():
        if not universe.ordered:
            for y in lst:
                for x in lst:
                    if x is not y:
                        mine = [z for z in closers.get(a, []) if z.f.get("qid") == y.f["qid"]]
                        closed = disj(*[conj(z.exists, lt(y, z), lt(z, x)) for z in mine])
                        yield implies(conj(y.exists, x.exists, lt(y, x)), closed), [x, y, *mine]
            continue
        for x in lst:
            out, refs = _outstanding(
                universe, x, [y for y in lst if y is not x], closers.get(a, [])
            )
            yield implies(x.exists, neg(out)), [x, *refs]


# published_first: every query_begin and prefetch_submit to an address after a prefill_info that saw
# it published.
@ENCODERS.register("published_first")
def enc_published_first(rule, universe):
    published = group_by(
        [e for e in universe.named("prefill_info") if e.f.get("published") is True],
        lambda e: e.f["addr"],
    )
    for x in universe.named("query_begin") + universe.named("prefetch_submit"):
        cands = published.get(x.f["addr"], [])
        yield implies(x.exists, before_any(universe, x, cands)), [x, *cands]


# unknown_rooms: a query (unless a cancel of its qid that did not stop it came before it began: the
# pool thread had taken it, its answer is unused) asks for no room that a resolve answered before it.
@ENCODERS.register("unknown_rooms")
def enc_unknown_rooms(rule, universe):
    answered = defaultdict(list)
    for r in universe.named("resolve"):
        for room in answers_of(r):
            answered[room].append(r)
    cancels = group_by(universe.named("prefetch_cancel"), lambda e: e.f["qid"])
    for x in universe.named("query_begin"):
        cancelled = began_anyway(universe, x, cancels.get(x.f["qid"], []))
        known = [r for room in rooms_of(x) for r in answered.get(room, [])]
        yield (
            implies(conj(x.exists, neg(cancelled)), neg(before_any(universe, x, known))),
            [x, *cancels.get(x.f["qid"], []), *known],
        )


def _pending(universe, x, adds, gone):
    """Some room of this address is pending at x: added before x, not initialised or aborted
    since."""
    alts = []
    for a in adds:
        ends = gone.get(a.f["room"], [])
        alts.append(
            conj(a.exists, lt(a, x), neg(disj(*[conj(g.exists, lt(a, g), lt(g, x)) for g in ends])))
        )
    return disj(*alts)


# no_stale: at every prefetch_end, each address with an outstanding query has a pending room.
@ENCODERS.register("no_stale")
def enc_no_stale(rule, universe):
    subs, closers = _query_state(universe)
    adds = group_by(universe.named("req_add"), lambda e: e.f["addr"])
    gone = group_by(
        universe.named("receiver_init") + universe.named("req_abort"), lambda e: e.f["room"]
    )
    for x in universe.named("prefetch_end"):
        for a, lst in subs.items():
            out, refs = _outstanding(universe, x, lst, closers.get(a, []))
            if out is False:
                continue
            yield (
                implies(conj(x.exists, out), _pending(universe, x, adds.get(a, []), gone)),
                [x, *refs],
            )


# release: at release_memory no query is outstanding; between it and the next resume_memory no
# prefetch_submit, query_begin, prefill_info or receiver_init, but a prefetched query_begin after a
# cancel that did not stop it (the pool thread had taken it before the cancel). (Symbolic universes:
# the pairwise form, as for one_inflight.)
@ENCODERS.register("release")
def enc_release(rule, universe):
    subs, closers = _query_state(universe)
    resumes = universe.named("resume_memory")
    releases = universe.named("release_memory")
    for x in releases:
        for a, lst in subs.items():
            if (
                not universe.ordered
            ):  # equivalently: each earlier submit was closed before x, or another followed it
                for y in lst:
                    mine = [z for z in closers.get(a, []) if z.f.get("qid") == y.f["qid"]]
                    closed = disj(*[conj(z.exists, lt(y, z), lt(z, x)) for z in mine])
                    later = disj(*[conj(w.exists, lt(y, w), lt(w, x)) for w in lst if w is not y])
                    yield (
                        implies(conj(x.exists, y.exists, lt(y, x)), disj(closed, later)),
                        [x, y, *mine],
                    )
                continue
            out, refs = _outstanding(universe, x, lst, closers.get(a, []))
            if out is not False:
                yield implies(x.exists, neg(out)), [x, *refs]
    cancels = group_by(universe.named("prefetch_cancel"), lambda e: e.f["qid"])
    asks = (
        universe.named("prefetch_submit")
        + universe.named("receiver_init")
        + universe.named("prefill_info")
        + universe.named("query_begin")
    )
    for x in asks:
        mine = cancels.get(x.f["qid"], []) if x.name == "query_begin" else []
        anyway = began_anyway(universe, x, mine) if x.f.get("source") == "prefetch" else False
        for r in universe.last_before(x, releases):
            resumed = disj(*[conj(m.exists, lt(r, m), lt(m, x)) for m in resumes])
            yield (
                implies(conj(x.exists, r.exists, lt(r, x), neg(anyway)), resumed),
                [x, r, *resumes, *mine],
            )


def _none_between(universe, thread, lo, hi, cands):
    """No candidate other than lo and hi happens on `thread` strictly between them."""
    return [
        neg(conj(z.exists, eq(z.thread, thread), lt(lo, z), lt(z, hi)))
        for z in cands
        if z is not lo and z is not hi
    ]


# prefetch_top: on `thread`, each iter_begin is followed by prefetch_begin of the same iteration, a
# prefetch_begin comes only right after an iter_begin, and no iteration begins inside a prefetch
# call. With the header's prefetch off: no prefetch_begin or prefetch_submit at all.
@ENCODERS.register("prefetch_top")
def enc_prefetch_top(rule, universe):
    thread = universe.tid(rule.get("thread", "scheduler"))
    enabled = getattr(universe, "header", {}).get("prefetch", True)
    if not enabled:
        for x in universe.named("prefetch_begin") + universe.named("prefetch_submit"):
            yield neg(conj(x.exists, eq(x.thread, thread))), [x]
        return
    yield from _iterations_start_with_prefetch(universe, thread)
    yield from _prefetch_only_at_iteration_start(universe, thread)


def _iterations_start_with_prefetch(universe, thread):
    """Each iter_begin is followed by the prefetch_begin of its iteration, and falls inside no
    prefetch call."""
    calls = universe.named("prefetch_begin") + universe.named("prefetch_end")
    if universe.ordered:
        calls = sorted([e for e in calls if e.thread == thread], key=lambda e: e.seq)
    for x in universe.named("iter_begin"):
        nxt = (
            universe.on_thread_between(thread, x, None)[:1]
            if universe.ordered
            else universe.named("prefetch_begin")
        )
        alts = [
            conj(
                y.exists,
                eq(y.thread, thread),
                lt(x, y),
                y.name == "prefetch_begin",
                y.f.get("iter") == x.f["iter"],
                *_none_between(universe, thread, x, y, universe.on_thread_between(thread, x, y)),
            )
            for y in nxt
        ]
        yield implies(conj(x.exists, eq(x.thread, thread)), disj(*alts)), [x, *nxt]
        for y in universe.last_before(x, calls):
            if y.name == "prefetch_begin":
                quiet = (
                    conj(*_none_between(universe, thread, y, x, calls))
                    if not universe.ordered
                    else True
                )
                inside = conj(
                    x.exists, eq(x.thread, thread), y.exists, eq(y.thread, thread), lt(y, x), quiet
                )
                yield implies(inside, False), [x, y]


def _prefetch_only_at_iteration_start(universe, thread):
    """A prefetch_begin comes right after an iter_begin on the thread."""
    for y in universe.named("prefetch_begin"):
        prev = (
            universe.last_before(y, universe.on_thread(thread))
            if universe.ordered
            else universe.named("iter_begin")
        )
        alts = [
            conj(
                z.exists,
                eq(z.thread, thread),
                lt(z, y),
                z.name == "iter_begin",
                *_none_between(universe, thread, z, y, universe.on_thread_between(thread, z, y)),
            )
            for z in prev
        ]
        yield implies(conj(y.exists, eq(y.thread, thread)), disj(*alts)), [y, *prev]


# prefetch_match: a resolve from a prefetched answer (source prefetched or prefix) uses the latest
# query submitted under its qid, for its own address, not cancelled before it, asked for exactly its
# rooms (prefetched) or for a proper prefix of them (prefix: unless it failed, the tail was asked by
# exactly one sync query since the address's previous resolve). A sync resolve comes when no
# prefetched query of its address is outstanding, after exactly one sync query for its rooms since
# that previous resolve.
def _sync_window(universe, x, resolves, syncs, want):
    """Exactly one sync query_begin of x's address since its previous resolve, and it asks for
    `want`."""
    others = [r for r in resolves if r is not x]
    prev = universe.last_before(x, others) if universe.ordered else others
    lo = prev[0].seq if universe.ordered and prev else -1
    cands = [q for q in syncs if lo < q.seq < x.seq] if universe.ordered else syncs
    inwin = [
        conj(q.exists, lt(q, x), *[neg(conj(r.exists, lt(q, r), lt(r, x))) for r in prev])
        for q in cands
    ]
    one = conj(
        disj(*inwin),
        *[
            neg(conj(inwin[i], inwin[j]))
            for i in range(len(cands))
            for j in range(i + 1, len(cands))
        ],
    )
    asks = conj(*[implies(w, rooms_of(q) == tuple(want)) for q, w in zip(cands, inwin)])
    return conj(one, asks), [*cands, *prev]


@ENCODERS.register("prefetch_match")
def enc_prefetch_match(rule, universe):
    subs, closers = _query_state(universe)
    by_qid = group_by(universe.named("prefetch_submit"), lambda e: e.f["qid"])
    cancels = group_by(universe.named("prefetch_cancel"), lambda e: e.f["qid"])
    resolves = group_by(universe.named("resolve"), lambda e: e.f["addr"])
    syncs = group_by(
        [e for e in universe.named("query_begin") if e.f.get("source") == "sync"],
        lambda e: e.f["addr"],
    )
    for x in universe.named("resolve"):
        addr, rooms, src, qid = x.f["addr"], rooms_of(x), x.f.get("source"), x.f.get("qid")
        if src in ("prefetched", "prefix"):
            mine = by_qid.get(qid, []) if qid is not None else []
            alts, refs = [], []
            for y in universe.last_before(x, mine) if universe.ordered else mine:
                asked = rooms_of(y)
                fits = (
                    asked == rooms
                    if src == "prefetched"
                    else 0 < len(asked) < len(rooms) and rooms[: len(asked)] == asked
                )
                tail, trefs = True, []
                if fits and src == "prefix" and x.f.get("error") is None:
                    tail, trefs = _sync_window(
                        universe,
                        x,
                        resolves.get(addr, []),
                        syncs.get(addr, []),
                        rooms[len(asked) :],
                    )
                refs += [y, *trefs]
                alts.append(
                    conj(
                        y.exists,
                        lt(y, x),
                        latest_of(universe, y, x, mine),
                        y.f["addr"] == addr,
                        fits,
                        tail,
                    )
                )
            gone = cancels.get(qid, []) if qid is not None else []
            yield (
                implies(x.exists, conj(disj(*alts), neg(before_any(universe, x, gone)))),
                [x, *refs, *gone],
            )
        elif src == "sync":
            out, refs = _outstanding(universe, x, subs.get(addr, []), closers.get(addr, []))
            one, trefs = _sync_window(
                universe, x, resolves.get(addr, []), syncs.get(addr, []), rooms
            )
            yield implies(x.exists, conj(neg(out), one)), [x, *refs, *trefs]
        else:
            yield neg(x.exists), [x]


# consume_answer: at each resolve carrying `pending` and `covered` (what the consumption point held
# as it began): a room is in `pending` exactly when a req_add of it for the address came before and
# no receiver_init or req_abort of it since; no resolved room was answered with a rank by an earlier
# resolve, and each is in `pending`; `covered` is the rooms of the address's latest prefetch_submit
# when no resolve of the address and no cancel of it (but for a mismatch) came between, () when no
# submit is so open; the answer used is the one _answer prescribes for the rooms and `covered`, from
# the open query (its qid) when not sync. (Symbolic universes: resolve carries neither field, and
# the rule judges traces only.)
def _list_field(e, key):
    v = e.f.get(key)
    return tuple(v) if isinstance(v, (list, tuple)) else None


def _answer(rooms, covered) -> str:
    if covered and tuple(rooms[: len(covered)]) == tuple(covered):
        return "prefetched" if len(covered) == len(rooms) else "prefix"
    return "sync"


@ENCODERS.register("consume_answer")
def enc_consume_answer(rule, universe):
    adds = group_by(universe.named("req_add"), lambda e: e.f["addr"])
    gone = group_by(
        universe.named("receiver_init") + universe.named("req_abort"), lambda e: e.f["room"]
    )
    subs = group_by(universe.named("prefetch_submit"), lambda e: e.f["addr"])
    resolves = group_by(universe.named("resolve"), lambda e: e.f["addr"])
    closing = group_by(
        [c for c in universe.named("prefetch_cancel") if c.f.get("reason") != "mismatch"],
        lambda e: e.f["qid"],
    )
    answered = defaultdict(list)  # room -> resolves answering it with a rank
    for r in universe.named("resolve"):
        for room, rank in answers_of(r).items():
            if isinstance(rank, int):
                answered[room].append(r)
    for x in universe.named("resolve"):
        pending, covered = _list_field(x, "pending"), _list_field(x, "covered")
        if pending is None or covered is None:
            continue
        addr, rooms = x.f["addr"], rooms_of(x)
        # the pending rooms: no add of a room outside `pending` is held at x (a room added twice is
        # pending when either add is held, as the linear checker's set has it)
        for a in adds.get(addr, []):
            if a.f["room"] not in pending:
                yield (
                    implies(x.exists, neg(_pending(universe, x, [a], gone))),
                    [x, a, *gone.get(a.f["room"], [])],
                )
        for room in pending:
            mine = [a for a in adds.get(addr, []) if a.f["room"] == room]
            yield implies(x.exists, _pending(universe, x, mine, gone)), [x, *mine]
        # the rooms resolved: pending, rank unknown
        for room in rooms:
            earlier = [r for r in answered.get(room, []) if r is not x]
            yield (
                implies(x.exists, conj(room in pending, neg(before_any(universe, x, earlier)))),
                [x, *earlier],
            )
        # the query found, and the answer used
        others = [r for r in resolves.get(addr, []) if r is not x]
        opens, refs = [], []
        for y in universe.last_before(x, subs.get(addr, [])):
            closers = others + closing.get(y.f["qid"], [])
            is_open = conj(
                y.exists,
                lt(y, x),
                latest_of(universe, y, x, subs.get(addr, [])),
                neg(disj(*[conj(z.exists, lt(y, z), lt(z, x)) for z in closers])),
            )
            want = _answer(rooms, rooms_of(y))
            fits = rooms_of(y) == covered and x.f.get("source") == want
            if want != "sync":
                fits = fits and x.f.get("qid") == y.f["qid"]
            opens.append(is_open)
            refs += [y, *closers]
            yield implies(conj(x.exists, is_open), fits), [x, y, *closers]
        none_open = neg(disj(*opens))
        yield (
            implies(conj(x.exists, none_open), covered == () and x.f.get("source") == "sync"),
            [x, *refs],
        )
