"""Templates that judge a chunk of the trace a kind at a time (`on_kinds`: checker/streaming.py)
against plain statements of their rules, with the trace cut into chunks at random places: a fact
recorded from a later event of the same chunk must never hide an earlier violation, and the
violations come in trace order whatever the cuts."""

from hypothesis import example, given, settings
from hypothesis import strategies as st

from checker import linear
from checker.streaming import Ctx
from checker.trace_io import as_events
from spec import load_events, load_rules

HEADER = {"format": "pdo-trace", "version": 4, "role": "prefill", "mode": "ahead", "page_size": 4}
RULES = {r.id: r for r in load_rules() if r.role == "prefill"}


def run_chunked(events: list, rule_ids: list, cuts: list) -> list:
    """The rules' templates after a check of `events` streamed as chunks cut before each index in
    `cuts` (taken modulo the length), as check_file streams a file."""
    structs = as_events(HEADER, events)
    bounds = sorted({c % (len(structs) + 1) for c in cuts} | {0, len(structs)})
    chunks = [structs[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    ctx = Ctx(HEADER, HEADER["page_size"])
    active = linear._instantiate([RULES[r] for r in rule_ids], ctx, None)
    linear._stream(chunks, active, ctx, linear._batched_events("prefill"))
    for t in active:
        t.finish()
    return active


def check_chunked(events: list, rule_ids: list, cuts: list) -> list:
    """(message, seqs) of each violation of the rules, the trace streamed in chunks (run_chunked)."""
    return [(v.message, v.seqs) for t in run_chunked(events, rule_ids, cuts) for v in t.violations]


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
    (t,) = run_chunked(events, ["P-release-after-delivery"], cuts)
    assert [(v.message, v.seqs) for v in t.violations] == _delivery_reference(events)
    # a judgement per completion, per release, and per distinct send at the end
    sends = {(e["rid"], e.get("start")) for e in events if e["ev"] in ("kv_send", "prefix_send")}
    judged = sum(e["ev"] in ("kv_delivered", "release") for e in events)
    assert t.checks == judged + len(sends)


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


def _chunk_sent_reference(events):
    """P-chunk-sent read literally (each send against every chunk it covers in part), with the
    number of judgements: one per chunk a send covers some remaining token of, one per chunk at
    its request's release (or at the end)."""
    pending, done, started, out = {}, set(), set(), []
    checks = 0

    def unsent(rid, seq):
        nonlocal checks
        for batch, left, admit_seq in pending.pop(rid, ()):
            checks += 1
            if left:
                seqs = [admit_seq] + ([seq] if seq is not None else [])
                what = f"{rid}'s tokens {left[0][0]}..{left[-1][1]} computed by batch {batch}"
                out.append((f"{what} were never sent", seqs))

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
                checks += 1
                wait = e.get("device_wait") is True
                if batch not in done and not (wait and batch in started):
                    how = (
                        "with a device wait before its forward began"
                        if wait
                        else f"before process_begin({batch}), with no device wait"
                    )
                    label = f"{ev}({e['batch']})" if "batch" in e else ev
                    out.append(
                        (
                            f"{label} sends {e['rid']}'s tokens {hit[0][0]}..{hit[-1][1]} "
                            f"of batch {batch} {how}",
                            [seq],
                        )
                    )
                chunk[1] = [
                    p for a, b in left for p in ((a, min(b, lo)), (max(a, hi), b)) if p[0] < p[1]
                ]
    for rid in list(pending):
        unsent(rid, None)
    return out, checks


# Sends of exactly the latest admitted chunk (the usual case, judged in one lookup) among sends of
# any range, overlapping admits, forwards, result processing and releases.
_CHUNK_STEP = st.one_of(
    st.tuples(st.just("admit"), _RIDS, st.integers(0, 4), st.integers(1, 3)),
    st.tuples(st.just("send_latest"), st.booleans()),
    st.tuples(st.just("kv_send"), _RIDS, st.integers(0, 4), st.integers(1, 3), st.booleans()),
    st.tuples(st.sampled_from(["process_begin", "fwd_begin", "release"]), _RIDS),
)


def _chunk_events(steps):
    events, batch, latest = [], -1, None

    def add(kind, **fields):
        events.append({"ev": kind, "seq": len(events) + 1, "t_ns": 0, "thread": "s", **fields})

    def send(rid, lo, hi, wait):
        fields = {"rid": rid, "obj": rid, "tokens": hi - lo, "pages": 1, "start": lo}
        if wait:
            add("prefix_send", batch=max(batch, 0), **fields, device_wait=True)
        else:
            add("kv_send", **fields)

    for step in steps:
        if step[0] == "admit":
            _, rid, lo, n = step
            batch += 1
            latest = (rid, 4 * lo, 4 * (lo + n))
            add("admit", batch=batch, rids=[rid], chunks={rid: [4 * lo, 4 * (lo + n)]})
        elif step[0] == "send_latest":
            if latest is not None:
                send(*latest, step[1])
        elif step[0] == "kv_send":
            _, rid, lo, n, wait = step
            send(rid, 4 * lo, 4 * (lo + n), wait)
        elif step[0] == "release":
            add("release", rid=step[1], obj=step[1], slot=0)
        else:
            fields = {"digest": "0"} if step[0] == "fwd_begin" else {}
            add(step[0], batch=max(batch, 0), **fields)
    return events


@settings(max_examples=500, deadline=None)
@given(st.lists(_CHUNK_STEP, max_size=30), _CUTS)
def test_chunk_sent_and_its_judgements(steps, cuts):
    events = _chunk_events(steps)
    want, checks = _chunk_sent_reference(events)
    (t,) = run_chunked(events, ["P-chunk-sent"], cuts)
    assert [(v.message, v.seqs) for v in t.violations] == want
    assert t.checks == checks


_DUMMY = {"int": 0, "str": "x", "list[str]": [], "list[int]": [], "int|str": "o", "bool": False}


def _filled(kind: str, seq: int, thread: str) -> dict:
    """An event of `kind` with every required field of the vocabulary at a dummy value."""
    fields = load_events()["prefill"][kind].get("fields", {})
    base = {"ev": kind, "seq": seq, "t_ns": 0, "thread": thread}
    return base | {name: _DUMMY[typ] for name, typ in fields.items()}


def _thread_reference(rule, events):
    """The thread rule read literally: each of its events on its thread (or off `not_thread`)."""
    out = []
    for e in (e for e in events if e["ev"] in rule["events"]):
        label = f"{e['ev']}({e['batch']})" if "batch" in e else e["ev"]
        if rule.get("thread") and e["thread"] != rule["thread"]:
            out.append((f"{label} ran on {e['thread']}, expected {rule['thread']}", [e["seq"]]))
        if rule.get("not_thread") and e["thread"] == rule["not_thread"]:
            out.append((f"{label} ran on {e['thread']}, expected another thread", [e["seq"]]))
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["P-scheduler-thread", "P-run-on-worker"]),
    st.lists(
        st.tuples(st.integers(0, 20), st.sampled_from(["scheduler", "scheduler", "worker"])),
        max_size=25,
    ),
    _CUTS,
)
def test_thread_rules_in_chunks(rule_id, steps, cuts):
    rule = RULES[rule_id]
    kinds = list(rule["events"]) + ["stage"]  # and a kind the rule does not judge
    events = [_filled(kinds[k % len(kinds)], i + 1, t) for i, (k, t) in enumerate(steps)]
    (t,) = run_chunked(events, [rule_id], cuts)
    assert [(v.message, v.seqs) for v in t.violations] == _thread_reference(rule, events)
    assert t.checks == sum(e["ev"] in rule["events"] for e in events)


def _page_references(events, ps):
    """P-page-count and P-page-aligned read literally: a send with tokens and pages covers
    ceil(tokens / ps) pages; a send with start and tokens starts on a page boundary, and the one
    before it for the same request (with start and tokens) covers whole pages."""
    count, aligned, previous = [], [], {}
    for e in events:
        tokens, pages, start, rid = e.get("tokens"), e.get("pages"), e.get("start"), e["rid"]
        if tokens is not None and pages is not None and pages != -(-tokens // ps):
            count.append(
                (
                    f"{e['ev']} of {tokens} tokens covers {pages} pages; "
                    f"ceil({tokens}/{ps}) = {-(-tokens // ps)}",
                    [e["seq"]],
                )
            )
        if start is None or tokens is None:
            continue
        if start % ps:
            aligned.append(
                (
                    f"{e['ev']} for {rid} starts at token {start}, not on a page boundary "
                    f"(page_size {ps})",
                    [e["seq"]],
                )
            )
        before = previous.get(rid)
        if before is not None and before["tokens"] % ps:
            aligned.append(
                (
                    f"{before['ev']} for {rid} covers {before['tokens']} tokens, not whole pages "
                    f"(page_size {ps}), and is not the request's last send",
                    [before["seq"], e["seq"]],
                )
            )
        previous[rid] = e
    return count, aligned


_SEND = st.tuples(
    st.sampled_from(["kv_send", "prefix_send"]),
    _RIDS,
    st.one_of(st.none(), st.integers(0, 9)),  # start
    st.integers(1, 9),  # tokens
    st.integers(0, 3),  # pages
    st.booleans(),  # prefix_send: without tokens and pages
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_SEND, max_size=25), _CUTS)
def test_page_rules_in_chunks(steps, cuts):
    events = []
    for kind, rid, start, tokens, pages, bare in steps:
        e = {"ev": kind, "seq": len(events) + 1, "t_ns": 0, "thread": "s", "rid": rid, "obj": rid}
        if kind == "prefix_send":
            e["batch"] = 0
        if not (bare and kind == "prefix_send"):
            e |= {"tokens": tokens, "pages": pages}
        if start is not None:
            e["start"] = start
        events.append(e)
    count, aligned = run_chunked(events, ["P-page-count", "P-page-aligned"], cuts)
    want_count, want_aligned = _page_references(events, HEADER["page_size"])
    assert [(v.message, v.seqs) for v in count.violations] == want_count
    assert [(v.message, v.seqs) for v in aligned.violations] == want_aligned
    assert count.checks == sum("tokens" in e for e in events)
    assert aligned.checks == sum("tokens" in e and "start" in e for e in events)


_INDEXED = ["admit", "fwd_begin", "process_begin", "process_end"]


def _first_of_each_batch(events: list) -> dict:
    """The batch index read literally: ev -> batch -> (seq, thread) of its first event, in the
    order batches are first met."""
    index: dict = {}
    for e in events:
        index.setdefault(e["ev"], {}).setdefault(e["batch"], (e["seq"], e["thread"]))
    return index


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_INDEXED), st.integers(0, 6), st.sampled_from(["scheduler", "worker"])
        ),
        min_size=1,
        max_size=30,
    ),
    _CUTS,
    st.integers(0, 60),
)
def test_batch_index_in_chunks(steps, cuts, read_at):
    """The batch index built from the kept chunks (Ctx.add) is the first event of each batch, as
    dicts (also when read between chunks, then added to) and as Dense's columns."""
    events = []
    for kind, batch, thread in steps:
        e = _filled(kind, len(events) + 1, thread) | {"batch": batch}
        if kind == "admit":
            e["rids"] = [f"r{len(events)}"]
        events.append(e)
    structs = as_events(HEADER, events)
    bounds = sorted({c % (len(structs) + 1) for c in cuts} | {0, len(structs)})
    chunks = [structs[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    stop = read_at % (len(chunks) + 1)
    ctx = Ctx(HEADER, HEADER["page_size"])
    linear._stream(chunks[:stop], [], ctx, set(_INDEXED))
    ctx.idx  # noqa: B018 - read between chunks: built from the chunks so far, then added to
    linear._stream(chunks[stop:], [], ctx, set(_INDEXED))
    want = _first_of_each_batch(events)
    assert {ev: list(t.items()) for ev, t in ctx.idx.items() if t} == {
        ev: list(t.items()) for ev, t in want.items()
    }
    admits = {e["batch"]: e["rids"] for e in reversed(events) if e["ev"] == "admit"}
    admits = {b: admits[b] for b in want.get("admit", {})}
    assert list(ctx.admits.items()) == list(admits.items())
    fresh = Ctx(HEADER, HEADER["page_size"])  # columns straight from the chunks
    linear._stream(chunks, [], fresh, set(_INDEXED))
    d = fresh.dense()
    if not admits:
        assert d is None
        return
    assert d.admits.tolist() == list(admits)
    for ev in _INDEXED:
        seq, thr = d.col(ev)
        got = {b + d.lo: (int(seq[b]), d.threads[thr[b]]) for b in range(d.n) if seq[b] > 0}
        assert got == want.get(ev, {})


def _after_done_reference(events):
    """P-release-after-done read literally: at each release of a rid, every batch that admitted
    it so far was processed, its Req object has no middle chunk in flight, and some KV of it was
    sent; no rid admitted after a release of it."""
    sent, processed, count, holders, released, admitted, out = set(), set(), {}, {}, {}, {}, []
    for e in events:
        ev, seq = e["ev"], e["seq"]
        if ev == "kv_send":
            sent.add(e["rid"])
        elif ev == "process_end":
            processed.add(e["batch"])
        elif ev in ("chunk_inc", "chunk_dec"):
            count[e["obj"]] = count.get(e["obj"], 0) + (1 if ev == "chunk_inc" else -1)
        elif ev == "admit":
            b = e["batch"]
            admitted.setdefault(b, seq)
            for rid in e["rids"]:
                holders.setdefault(rid, []).append(b)
                if rid in released:
                    what = f"{rid} admitted in batch {b} after it was released"
                    out.append((what, [released[rid], seq]))
        else:
            rid, obj = e["rid"], e["obj"]
            for b in holders.get(rid, []):
                if b not in processed:
                    what = f"{rid} released while batch {b} holding it was not yet processed"
                    out.append((what, [admitted[b], seq]))
            if count.get(obj, 0) > 0:
                out.append((f"{rid} released with {count[obj]} middle chunk(s) in flight", [seq]))
            if rid not in sent:
                out.append((f"{rid} released before any of its KV was sent", [seq]))
            released[rid] = seq
    return out


# Lifetimes (admitted, a middle chunk counted in and out, sent, processed, released; or kept, or
# released before its batch is processed, or with its middle chunk in flight, or admitted again
# after its release) among single steps of every kind: the order of two events in one chunk, or
# across a cut, decides.
_LIFE_STEP = st.one_of(
    st.tuples(
        st.just("life"), _RIDS, st.sampled_from(["whole", "kept", "early", "inflight", "again"])
    ),
    st.tuples(
        st.sampled_from(["admit", "process_end", "kv_send", "chunk_inc", "chunk_dec", "release"]),
        _RIDS,
        st.booleans(),
    ),
)


def _life_events(steps):
    events, batch = [], -1

    def add(kind, **fields):
        events.append({"ev": kind, "seq": len(events) + 1, "t_ns": 0, "thread": "s", **fields})

    for kind, rid, flag in steps:
        req = {"rid": rid, "obj": f"o{rid}"}
        if kind in ("life", "admit"):
            batch += 1
            add("admit", batch=batch, rids=[rid, "r9"] if flag is True else [rid])
        if kind == "life":
            add("chunk_inc", **req, value=1)
            add("kv_send", **req, tokens=4, pages=1)
            if flag != "early":
                add("process_end", batch=batch)
            if flag != "inflight":
                add("chunk_dec", **req, value=0)
            if flag != "kept":
                add("release", **req, slot=0)
            if flag == "early":
                add("process_end", batch=batch)
            if flag == "inflight":
                add("chunk_dec", **req, value=0)
            if flag == "again":
                batch += 1
                add("admit", batch=batch, rids=[rid])
                add("process_end", batch=batch)
        elif kind == "process_end":  # of the latest batch, or of the next (before its admit)
            add(kind, batch=batch + flag)
        elif kind == "kv_send":
            add(kind, **req, tokens=4, pages=1)
        elif kind in ("chunk_inc", "chunk_dec"):
            add(kind, **req, value=0)
        elif kind == "release":
            add(kind, **req, slot=0)
    return events


@settings(max_examples=400, deadline=None)
@given(st.lists(_LIFE_STEP, max_size=25), _CUTS)
# in one chunk: admitted again after a release (its batch processed before), sent after a release
@example(
    [("life", "r0", "kept"), ("process_end", "r0", True), ("release", "r0", 0), ("admit", "r0", 0)],
    [],
)
@example(
    [("admit", "r0", 0), ("process_end", "r0", 0), ("release", "r0", 0), ("kv_send", "r0", 0)], []
)
def test_release_after_done_in_chunks(steps, cuts):
    events = _life_events(steps)
    (t,) = run_chunked(events, ["P-release-after-done"], cuts)
    assert [(v.message, v.seqs) for v in t.violations] == _after_done_reference(events)
    assert t.checks == sum(e["ev"] == "release" for e in events)
