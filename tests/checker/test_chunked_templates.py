"""Templates that judge a chunk of the trace a kind at a time (`on_kinds`: checker/streaming.py)
against plain statements of their rules, with the trace cut into chunks at random places: a fact
recorded from a later event of the same chunk must never hide an earlier violation, and the
violations come in trace order whatever the cuts."""

from hypothesis import given, settings
from hypothesis import strategies as st

from checker import linear
from checker.streaming import Ctx
from checker.trace_io import as_events
from spec import load_rules

HEADER = {"format": "pdo-trace", "version": 4, "role": "prefill", "mode": "ahead", "page_size": 4}
RULES = {r.id: r for r in load_rules() if r.role == "prefill"}


def check_chunked(events: list, rule_ids: list, cuts: list) -> list:
    """(message, seqs) of each violation of the rules on `events` streamed as chunks cut before
    each index in `cuts` (taken modulo the length), as check_file streams a file."""
    structs = as_events(HEADER, events)
    bounds = sorted({c % (len(structs) + 1) for c in cuts} | {0, len(structs)})
    chunks = [structs[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    ctx = Ctx(HEADER, HEADER["page_size"])
    active = linear._instantiate([RULES[r] for r in rule_ids], ctx, None)
    linear._stream(chunks, active, ctx, linear._batched_events("prefill"))
    for t in active:
        t.finish()
    return [(v.message, v.seqs) for t in active for v in t.violations]


_CUTS = st.lists(st.integers(0, 60), max_size=6)
_RIDS = st.sampled_from(["r0", "r1", "r2"])


def _delivery_reference(events):
    """P-release-after-delivery read literally: a send is known by its rid and start (a send
    without an int start by its rid alone: any completion of the rid closes it); every send of a
    rid completed before each release of the rid, and by the end; no completion without an earlier
    send; a kv_failed completes every send of its rid logged before it."""
    sent, completed, any_done, out = {}, set(), set(), []

    def open_(rid, start):
        return rid not in any_done if start is None else (rid, start) not in completed

    def at(start):
        return f" at token {start}" if start is not None else ""

    for e in events:
        ev, rid, seq = e["ev"], e["rid"], e["seq"]
        if ev == "kv_delivered":
            start = e["start"]
            got = sent.get(rid, {})
            if start not in got and None not in got:
                out.append(
                    (
                        f"kv_delivered completes a send of {rid} at token {start} "
                        "that was never made",
                        [seq],
                    )
                )
            completed.add((rid, start))
            any_done.add(rid)
        elif ev == "kv_failed":
            any_done.add(rid)
            completed.update((rid, s) for s in sent.get(rid, {}))
        elif ev == "release":
            for start, s in sent.get(rid, {}).items():
                if open_(rid, start):
                    out.append(
                        (
                            f"release for {rid} while its send{at(start)} was not yet "
                            "delivered (no kv_delivered before it)",
                            [s, seq],
                        )
                    )
        else:
            start = e.get("start")
            sent.setdefault(rid, {}).setdefault(start if type(start) is int else None, seq)
    for rid, starts in sent.items():
        for start, s in starts.items():
            if open_(rid, start):
                out.append((f"{rid}'s send{at(start)} was never delivered (kv_delivered)", [s]))
    return out


# Mostly well-formed sequences (each send delivered, then released), with the odd step of every
# kind thrown in, so that chunks judged whole and chunks walked event by event both occur.
_DELIVERY_STEP = st.one_of(
    st.tuples(st.just("transfer"), _RIDS, st.integers(0, 2), st.booleans()),
    st.tuples(
        st.sampled_from(["kv_send", "prefix_send", "kv_delivered", "kv_failed", "release"]),
        _RIDS,
        st.integers(0, 2),
        st.booleans(),
    ),
    st.tuples(st.just("kv_send_nostart"), _RIDS, st.integers(0, 2), st.booleans()),
)


def _delivery_events(steps):
    events = []

    def add(kind, rid, **fields):
        base = {"seq": len(events) + 1, "t_ns": 0, "thread": "s", "rid": rid, "obj": rid}
        events.append({"ev": kind, **base, **fields})

    for kind, rid, lo, flag in steps:
        if kind == "transfer":  # a send, its delivery, and maybe the release
            add("kv_send", rid, tokens=4, pages=1, start=4 * lo)
            add("kv_delivered", rid, start=4 * lo, tokens=4)
            if flag:
                add("release", rid, slot=0)
        elif kind == "kv_send":
            add(kind, rid, tokens=4, pages=1, start=4 * lo)
        elif kind == "kv_send_nostart":
            add("kv_send", rid, tokens=4, pages=1)
        elif kind == "prefix_send":
            add(kind, rid, batch=0, tokens=4, pages=1, start=4 * lo)
        elif kind == "kv_delivered":
            add(kind, rid, start=4 * lo, tokens=4)
        elif kind == "release":
            add(kind, rid, slot=0)
        else:
            add(kind, rid)
    return events


@settings(max_examples=400, deadline=None)
@given(st.lists(_DELIVERY_STEP, max_size=25), _CUTS)
def test_release_after_delivery_in_chunks(steps, cuts):
    events = _delivery_events(steps)
    got = check_chunked(events, ["P-release-after-delivery"], cuts)
    assert got == _delivery_reference(events)


def _store_reference(events):
    """P-store-after-copy read literally: some store_copied of the rid before each store_entry."""
    copied, out = set(), []
    for e in events:
        if e["ev"] == "store_copied":
            copied.add(e["rid"])
        elif e["rid"] not in copied:
            out.append(
                (f"store_entry for {e['rid']} before any store_copied of {e['rid']}", [e["seq"]])
            )
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["store_copied", "store_entry"]), _RIDS), max_size=25), _CUTS
)
def test_store_after_copy_in_chunks(steps, cuts):
    events = [
        {"ev": kind, "seq": i + 1, "t_ns": 0, "thread": "s", "rid": rid}
        for i, (kind, rid) in enumerate(steps)
    ]
    assert check_chunked(events, ["P-store-after-copy"], cuts) == _store_reference(events)
