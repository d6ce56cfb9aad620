"""The z3 encodings of the decode rule kinds of receivers and requests (spec/decode_rules.toml,
checker/decode_templates.py), and of the cross-process kinds, one function per kind.

The comment above each function is the kind's semantics, matching checker/decode_templates.py.
"""

from __future__ import annotations

from collections import defaultdict

import z3

from .decode_encodings import answers_of, before_any, group_by, latest_of
from .encoding import ENCODERS
from .logic import as_z3, conj, disj, eq, implies, lt, neg


# init_once: every resolve agrees with the first answer for a room; a receiver_init comes after its
# room was answered, with that rank, and once; a finished request's room was initialised before.
@ENCODERS.register("init_once")
def enc_init_once(rule, universe):
    answered = defaultdict(list)
    for r in universe.named("resolve"):
        for room, rank in answers_of(r).items():
            answered[room].append((r, rank))
    # The published parallel info alone decides a rank (0 with one DP rank, room mod dp_size when
    # the prefill follows the room): such a prefill_info answers every room of its address.
    addr_of = {e.f["room"]: e.f["addr"] for e in universe.named("req_add")}
    for info in universe.named("prefill_info"):
        dp, follow = info.f.get("dp_size"), info.f.get("follow_bootstrap_room")
        if (
            info.f.get("published") is not True
            or not isinstance(dp, int)
            or not (dp == 1 or (follow and dp))
        ):
            continue
        for room, addr in addr_of.items():
            if addr == info.f["addr"] and isinstance(room, int):
                answered[room].append((info, 0 if dp == 1 else room % dp))
    inits = group_by(universe.named("receiver_init"), lambda e: e.f["room"])
    for _room, lst in answered.items():
        for (r1, k1), (r2, k2) in (
            zip(lst, lst[1:])
            if universe.ordered
            else [(p, q) for p in lst for q in lst if p is not q]
        ):
            same = eq(k1, k2)
            if same is not True:
                yield implies(conj(r1.exists, r2.exists, lt(r1, r2)), same), [r1, r2]
    for room, lst in inits.items():
        for x in lst:
            others = [y for y in lst if y is not x]
            ans = answered.get(room, [])
            first_ok = disj(
                *[
                    conj(
                        r.exists,
                        lt(r, x),
                        eq(k, x.f["rank"]),
                        *[neg(conj(r2.exists, lt(r2, r))) for r2, _ in ans if r2 is not r],
                    )
                    for r, k in ans
                ]
            )
            yield (
                implies(x.exists, conj(first_ok, neg(before_any(universe, x, others)))),
                [x, *[r for r, _ in ans], *others],
            )
    for x in universe.named("req_done"):
        cands = inits.get(x.f["room"], [])
        yield implies(x.exists, before_any(universe, x, cands)), [x, *cands]


# init_fifo: no receiver_init while an older request (added earlier) has a known rank and is neither
# initialised nor aborted.
@ENCODERS.register("init_fifo")
def enc_init_fifo(rule, universe):
    adds = universe.named("req_add")
    answered = defaultdict(list)
    for r in universe.named("resolve"):
        for room in answers_of(r):
            answered[room].append(r)
    gone = group_by(
        universe.named("receiver_init") + universe.named("req_abort"), lambda e: e.f["room"]
    )
    first_add = {}
    for a in adds:
        first_add.setdefault(a.f["room"], a)
    for x in universe.named("receiver_init"):
        room = x.f["room"]
        mine = first_add.get(room)
        for o in adds:
            if o.f["room"] == room:
                continue
            older = (
                conj(o.exists, lt(o, x), lt(o, mine))
                if mine is not None
                else conj(o.exists, lt(o, x))
            )
            known = before_any(universe, x, answered.get(o.f["room"], []))
            done = before_any(universe, x, [g for g in gone.get(o.f["room"], []) if g is not x])
            if known is False:
                continue
            yield (
                implies(conj(x.exists, older, known), done),
                [
                    x,
                    o,
                    *([mine] if mine else []),
                    *answered.get(o.f["room"], []),
                    *gone.get(o.f["room"], []),
                ],
            )


# kv_recv: a room's KV comes after its receiver_init, from the rank of the latest one before it.
@ENCODERS.register("kv_recv")
def enc_kv_recv(rule, universe):
    inits = group_by(universe.named("receiver_init"), lambda e: e.f["room"])
    for x in universe.named("kv_recv"):
        lst = inits.get(x.f["room"], [])
        alts = [
            conj(y.exists, lt(y, x), latest_of(universe, y, x, lst), eq(y.f["rank"], x.f["rank"]))
            for y in universe.last_before(x, lst)
        ]
        yield implies(x.exists, disj(*alts)), [x, *lst]


# req_end: each req_done/req_abort follows the request's req_add, is its only end, and a req_done
# follows its kv_done; every request added ends.
@ENCODERS.register("req_end")
def enc_req_end(rule, universe):
    adds = group_by(universe.named("req_add"), lambda e: e.f["rid"])
    kv = group_by(universe.named("kv_done"), lambda e: e.f["rid"])
    ends = universe.named("req_done") + universe.named("req_abort")
    if universe.ordered:
        ends.sort(key=lambda e: e.seq)
    by_rid = group_by(ends, lambda e: e.f["rid"])
    for x in ends:
        rid = x.f["rid"]
        others = [y for y in by_rid[rid] if y is not x]
        body = conj(
            before_any(universe, x, adds.get(rid, [])),
            neg(before_any(universe, x, others)),
            before_any(universe, x, kv.get(rid, [])) if x.name == "req_done" else True,
        )
        yield (
            implies(x.exists, body),
            [x, *adds.get(rid, []), *others, *(kv.get(rid, []) if x.name == "req_done" else [])],
        )
    for rid, lst in adds.items():
        for a in lst:
            yield implies(a.exists, disj(*[y.exists for y in by_rid.get(rid, [])])), [a]


# ---- the cross-process kinds: a decode trace against the prefill traces of its DP ranks
# The prefill side enters as facts (`universe.remote(name)`: its admit and send events, each with
# the `dp_rank` of its trace); cross rules compare no positions across processes.


def _failed_ranks(universe) -> set:
    """Prefill ranks the decode trace records as failed (`req_abort` `failed_rank`): their traces
    may be missing or short, so their requests are not judged against them."""
    return {
        a.f["failed_rank"]
        for a in universe.named("req_abort")
        if isinstance(a.f.get("failed_rank"), int)
    }


# cross_rank: a receiver_init's rank is the one prefill rank whose trace admitted the request; a
# request no prefill trace admitted is an error only when every DP rank's trace is there, none was
# stopped before its run's end (linear: CrossRank), and its rank did not fail.
@ENCODERS.register("cross_rank")
def enc_cross_rank(rule, universe):
    served = defaultdict(set)
    for a in universe.remote("admit"):
        for rid in a.f["rids"]:
            served[rid].add(a.f["dp_rank"])
    local = {
        i.f["addr"]
        for i in universe.named("prefill_info")
        if i.f.get("published") is True
        and isinstance(i.f.get("dp_size"), int)
        and (i.f["dp_size"] == 1 or i.f.get("follow_bootstrap_room"))
    }
    addr_of = {a.f["room"]: a.f["addr"] for a in universe.named("req_add")}
    failed = _failed_ranks(universe)
    for x in universe.named("receiver_init"):
        ranks = served.get(x.f["rid"])
        if not ranks:
            # a rank the parallel info decided is no route the server answered (linear: CrossRank)
            if (
                universe.dp_complete
                and not universe.dp_stopped
                and addr_of.get(x.f["room"]) not in local
                and not (isinstance(x.f["rank"], int) and x.f["rank"] in failed)
            ):
                yield neg(x.exists), [x]
            continue
        yield (
            implies(x.exists, conj(len(ranks) == 1, disj(*[eq(x.f["rank"], r) for r in ranks]))),
            [x],
        )


# cross_pages: at a req_done, the tokens and pages of its room's kv_recv events so far equal what
# the prefill rank of the room's latest receiver_init sent for that request (kv_send and
# prefix_send); skipped when that rank's trace is not there.
@ENCODERS.register("cross_pages")
def enc_cross_pages(rule, universe):
    sent = defaultdict(lambda: [0, 0])
    for s in universe.remote("kv_send") + universe.remote("prefix_send"):
        if "pages" in s.f:
            t = sent[(s.f["dp_rank"], s.f["rid"])]
            t[0] += s.f.get("tokens", 0)
            t[1] += s.f["pages"]
    inits = group_by(universe.named("receiver_init"), lambda e: e.f["room"])
    kvs = group_by(universe.named("kv_recv"), lambda e: e.f["room"])
    ranks = sorted(set(universe.dp_ranks) - _failed_ranks(universe))
    for x in universe.named("req_done"):
        room = x.f["room"]
        lst, got = inits.get(room, []), kvs.get(room, [])
        if universe.ordered:
            got = [k for k in got if k.seq < x.seq]
        tok = (
            z3.Sum([z3.If(as_z3(conj(k.exists, lt(k, x))), k.f["tokens"], 0) for k in got])
            if got
            else z3.IntVal(0)
        )
        pag = (
            z3.Sum([z3.If(as_z3(conj(k.exists, lt(k, x))), k.f["pages"], 0) for k in got])
            if got
            else z3.IntVal(0)
        )
        for y in universe.last_before(x, lst) if universe.ordered else lst:
            rid, rank = y.f["rid"], y.f["rank"]
            seen = disj(*[eq(rank, r) for r in ranks])
            if seen is False:
                continue
            want = [(eq(rank, r), sent.get((r, rid), [0, 0])) for r in ranks]
            same = conj(*[implies(c, conj(tok == t, pag == p)) for c, (t, p) in want])
            yield (
                implies(
                    conj(x.exists, y.exists, lt(y, x), latest_of(universe, y, x, lst), seen), same
                ),
                [x, y, *got],
            )
