"""P-chunk-sent and P-chunk-counter with the trace cut into chunks at random places: the chunks a
template may skip (`idle`), and the allocations a chunk makes before or after the counter's
changes, give the violations of the unchunked check and of a literal reading of the rule."""

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.checker.test_chunked_templates import _CUTS, _RIDS, check_chunked

# canonical("ahead") has three admits (batches 0, 1, 2); what is dropped, and the batch whose
# chunk it leaves unjudged or judged early: the send of c's chunk of batch 2, the send of a's chunk
# of batch 1, and process_begin(1), before which the sends of batch 1 then come
_DROPS = {"kv_send c": ("kv_send", "c", 2), "kv_send a": ("kv_send", "a", 1)}


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3), st.sampled_from([None, "kv_send c", "kv_send a", "process_begin"]), _CUTS)
def test_chunk_sent_skips_only_chunks_with_nothing_to_judge(plain, drop, cuts):
    """P-chunk-sent passes over a chunk with no chunk held and no admit with `chunks` (a trace
    without them), keeping only the batches done and started. Here the first `plain` admits carry
    no chunks and one event is dropped: a violation is found exactly when the batch it concerns
    has chunks, and every cut of the trace gives the violations of the unchunked check."""
    from tests.trace_fixtures import canonical, find

    events = canonical("ahead")
    for e in [e for e in events if e["ev"] == "admit"][:plain]:
        del e["chunks"]
    if drop == "process_begin":
        i, batch = find(events, "process_begin", batch=1), 1
    elif drop is not None:
        ev, rid, batch = _DROPS[drop]
        i = find(events, ev, rid=rid, nth=-1)
    if drop is not None:
        events = events[:i] + events[i + 1 :]
    events = [dict(e, seq=k, t_ns=k) for k, e in enumerate(events, 1)]
    whole = check_chunked(events, ["P-chunk-sent"], [])
    assert bool(whole) == (drop is not None and batch >= plain)
    assert check_chunked(events, ["P-chunk-sent"], cuts) == whole


def _counter_reference(events):
    """P-chunk-counter read literally: each change of a request's counter is on an object
    allocated for that request before it, reports the previous value plus or minus one, never
    below zero; every counter ends at zero."""
    allocated, value, out = set(), {}, []
    for e in events:
        ev, rid, obj, seq = e["ev"], e["rid"], e["obj"], e["seq"]
        if ev == "alloc":
            allocated.add((rid, obj))
            continue
        if (rid, obj) not in allocated:
            out.append(
                (
                    f"{ev} for {rid} on object {obj}, which is not the Req object allocated for {rid}",
                    [seq],
                )
            )
        want = value.get(obj, (0,))[0] + (1 if ev == "chunk_inc" else -1)
        if e["value"] != want:
            out.append(
                (f"{ev} for {rid} reports {e['value']}, expected {want} on object {obj}", [seq])
            )
        if e["value"] < 0:
            out.append((f"{ev} for {rid} drove the counter below zero ({e['value']})", [seq]))
        value[obj] = (e["value"], seq, rid)
    for obj, (v, seq, rid) in value.items():
        if v != 0:
            out.append(
                (f"inflight_middle_chunks of {rid} (object {obj}) ends at {v}, not 0", [seq])
            )
    return out


_COUNTER_STEP = st.tuples(
    st.sampled_from(["alloc", "chunk_inc", "chunk_dec"]),
    _RIDS,
    st.sampled_from(["", "x"]),
    st.integers(-1, 2),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_COUNTER_STEP, max_size=25), _CUTS)
# a change before its request's allocation, in the chunk that allocates it
@example([("chunk_inc", "r0", "", 1), ("alloc", "r0", "", 0), ("chunk_dec", "r0", "", 0)], [])
# an allocation of a request allocated in an earlier chunk, as another object
@example([("alloc", "r0", "", 0), ("alloc", "r0", "x", 0), ("chunk_inc", "r0", "x", 1)], [1])
# ... and the two allocations merged into one table (checker/recent.py) by the misses before
@example(
    [("alloc", "r0", "", 0), ("alloc", "r0", "x", 0)]
    + [("chunk_inc", "r1", "", 1), ("chunk_inc", "r1", "", 2), ("chunk_inc", "r0", "x", 1)],
    [1, 2],
)
def test_chunk_counter_in_chunks(steps, cuts):
    events = [
        {"ev": ev, "seq": i, "t_ns": 0, "thread": "s", "rid": rid, "obj": f"o{rid}{o}"}
        | ({"slot": 0} if ev == "alloc" else {"value": v})
        for i, (ev, rid, o, v) in enumerate(steps, 1)
    ]
    got = check_chunked(events, ["P-chunk-counter"], cuts)
    assert got == _counter_reference(events)
