"""P-chunk-sent and P-release-after-delivery against plain statements of them: random admits
(overlapping chunk ranges included), sends, completions, forwards and releases give the same
violations as references that judge every send against every chunk or completion, with no shortcut."""

from hypothesis import given, settings
from hypothesis import strategies as st

from checker.linear import check_events
from spec import load_rules

RULE = next(r for r in load_rules() if r.id == "P-chunk-sent")
HEADER = {"format": "pdo-trace", "version": 4, "role": "prefill", "mode": "ahead", "page_size": 4}


def label(e):
    return f"{e['ev']}({e['batch']})" if "batch" in e else e["ev"]


def _reference(events):
    """The rule read literally: each send judged against every chunk it covers in part."""
    pending, done, started, out = {}, set(), set(), []

    def unsent(rid, seq):
        for batch, left, admit_seq in pending.pop(rid, ()):
            if left:
                seqs = [admit_seq] + ([seq] if seq is not None else [])
                out.append(
                    (
                        f"{rid}'s tokens {left[0][0]}..{left[-1][1]} computed by batch {batch} "
                        "were never sent",
                        seqs,
                    )
                )

    for e in events:
        ev, seq = e["ev"], e["seq"]
        if ev == "admit":
            for rid, (a, b) in e["chunks"].items():
                pending.setdefault(rid, []).append([e["batch"], [(a, b)], seq])
        elif ev == "process_begin":
            done.add(e["batch"])
        elif ev == "fwd_begin":
            started.add(e["batch"])
        elif ev == "release":
            unsent(e["rid"], seq)
        elif e["rid"] in pending:
            lo, hi = e["start"], e["start"] + e["tokens"]
            for chunk in pending[e["rid"]]:
                batch, left, _ = chunk
                hit = [(max(a, lo), min(b, hi)) for a, b in left if max(a, lo) < min(b, hi)]
                if not hit:
                    continue
                wait = e.get("device_wait") is True
                if batch not in done and not (wait and batch in started):
                    how = (
                        "with a device wait before its forward began"
                        if wait
                        else f"before process_begin({batch}), with no device wait"
                    )
                    out.append(
                        (
                            f"{label(e)} sends {e['rid']}'s tokens {hit[0][0]}..{hit[-1][1]} "
                            f"of batch {batch} {how}",
                            [seq],
                        )
                    )
                chunk[1] = [
                    p for a, b in left for p in ((a, min(b, lo)), (max(a, hi), b)) if p[0] < p[1]
                ]
    for rid in list(pending):
        unsent(rid, None)
    return out


_RIDS = st.sampled_from(["r0", "r1"])
_STEP = st.one_of(
    st.tuples(st.just("admit"), _RIDS, st.integers(0, 6), st.integers(1, 4)),
    st.tuples(st.just("kv_send"), _RIDS, st.integers(0, 6), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("process_begin")),
    st.tuples(st.just("fwd_begin")),
    st.tuples(st.just("release"), _RIDS),
)


def _events(steps):
    """A trace from the drawn steps: admits number their batches, forwards and processing name
    the latest admitted batch (or the next one); fields the other rules need are filled in."""
    events, batch = [], -1
    for step in steps:
        base = {"seq": len(events) + 1, "t_ns": len(events), "thread": "scheduler"}
        kind = step[0]
        if kind == "admit":
            batch += 1
            _, rid, lo, n = step
            e = {"batch": batch, "rids": [rid], "chunks": {rid: [4 * lo, 4 * (lo + n)]}}
        elif kind == "kv_send":
            _, rid, lo, n, wait = step
            e = {"rid": rid, "obj": rid, "tokens": 4 * n, "pages": n, "start": 4 * lo}
            if wait:
                e = {"batch": max(batch, 0), **e, "device_wait": True}
                kind = "prefix_send"
        elif kind == "release":
            e = {"rid": step[1], "obj": step[1], "slot": 0}
        else:
            e = {"batch": max(batch, 0), **({"digest": "0"} if kind == "fwd_begin" else {})}
        events.append({"ev": kind, **base, **e})
    return events


@settings(max_examples=300, deadline=None)
@given(st.lists(_STEP, max_size=30))
def test_chunk_sent_matches_its_plain_statement(steps):
    events = _events(steps)
    got = [(v.message, v.seqs) for v in check_events(HEADER, events, [RULE])]
    assert got == _reference(events)


DELIVERY = next(r for r in load_rules() if r.id == "P-release-after-delivery")


def _delivery_reference(events):
    """P-release-after-delivery read literally: every send of a rid (by start) completed before
    each release of the rid, completed by the end, and no completion without its send."""
    sent, completed, out = {}, set(), []
    for e in events:
        ev, rid, seq = e["ev"], e["rid"], e["seq"]
        if ev == "kv_delivered":
            completed.add((rid, e["start"]))
            if e["start"] not in sent.get(rid, {}):
                out.append(
                    (
                        f"kv_delivered completes a send of {rid} at token {e['start']} "
                        "that was never made",
                        [seq],
                    )
                )
        elif ev == "kv_failed":
            completed.update((rid, s) for s in sent.get(rid, {}))
        elif ev == "release":
            for start, s in sent.get(rid, {}).items():
                if (rid, start) not in completed:
                    out.append(
                        (
                            f"release for {rid} while its send at token {start} was not yet "
                            "delivered (no kv_delivered before it)",
                            [s, seq],
                        )
                    )
        else:
            sent.setdefault(rid, {}).setdefault(e["start"], seq)
    for rid, starts in sent.items():
        for start, s in starts.items():
            if (rid, start) not in completed:
                out.append(
                    (f"{rid}'s send at token {start} was never delivered (kv_delivered)", [s])
                )
    return out


_DELIVERY_STEP = st.tuples(
    st.sampled_from(["kv_send", "kv_delivered", "kv_failed", "release"]), _RIDS, st.integers(0, 2)
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_DELIVERY_STEP, max_size=30))
def test_release_after_delivery_matches_its_plain_statement(steps):
    events = []
    for kind, rid, lo in steps:
        e = {"ev": kind, "seq": len(events) + 1, "t_ns": 0, "thread": "s", "rid": rid, "obj": rid}
        if kind in ("kv_send", "kv_delivered"):
            e |= {"start": 4 * lo, "tokens": 4}
        if kind == "kv_send":
            e["pages"] = 1
        if kind == "release":
            e["slot"] = 0
        events.append(e)
    got = [(v.message, v.seqs) for v in check_events(HEADER, events, [DELIVERY])]
    assert got == _delivery_reference(events)
