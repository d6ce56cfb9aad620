"""The decode and cross-process rules on hand-written traces: a canonical decode trace passes; for every
decode rule, one small edit of it fails with that rule's id. Cross rules: a decode trace against the
prefill traces of its two DP ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from checker.decode_templates import check_cross
from checker.linear import check_file
from spec import load_rules

ROOT = Path(__file__).resolve().parents[2]
S, P = "scheduler", "prefetch_0"
A = "127.0.0.1:8998"


def base():
    """Three requests: r1 and r3 resolved synchronously in iteration 1 (rank 0) and initialised in
    arrival order; r2 unknown at first, then answered by the prefetch of iteration 3 (rank 1)."""
    return [
        (S, "iter_begin", dict(iter=1)),
        (S, "prefetch_begin", dict(iter=1)),
        (S, "prefetch_end", dict(iter=1)),
        (S, "req_add", dict(rid="r1", room=1, addr=A)),
        (S, "req_add", dict(rid="r3", room=3, addr=A)),
        (S, "prefill_info", dict(addr=A, published=True, error=None)),
        (S, "query_begin", dict(addr=A, rooms=[1, 3], qid=0, source="sync")),
        (S, "query_end", dict(addr=A, rooms=[1, 3], qid=0, result={"1": 0, "3": 0}, error=None)),
        (
            S,
            "resolve",
            dict(
                addr=A,
                rooms=[1, 3],
                source="sync",
                qid=None,
                wait_ns=900000,
                lead_ns=0,
                result={"1": 0, "3": 0},
                error=None,
                pending=[1, 3],
                covered=[],
            ),
        ),
        (S, "alloc", dict(rid="r1", obj="o1", slot=0)),
        (S, "receiver_init", dict(room=1, rank=0, rid="r1")),
        (S, "alloc", dict(rid="r3", obj="o3", slot=1)),
        (S, "receiver_init", dict(room=3, rank=0, rid="r3")),
        (S, "iter_begin", dict(iter=2)),
        (S, "prefetch_begin", dict(iter=2)),
        (S, "prefetch_end", dict(iter=2)),
        (S, "req_add", dict(rid="r2", room=2, addr=A)),
        (S, "query_begin", dict(addr=A, rooms=[2], qid=1, source="sync")),
        (S, "query_end", dict(addr=A, rooms=[2], qid=1, result={}, error=None)),
        (
            S,
            "resolve",
            dict(
                addr=A,
                rooms=[2],
                source="sync",
                qid=None,
                wait_ns=800000,
                lead_ns=0,
                result={},
                error=None,
                pending=[2],
                covered=[],
            ),
        ),
        (S, "kv_recv", dict(room=1, rank=0, start=0, tokens=20, pages=2)),
        (S, "kv_recv", dict(room=3, rank=0, start=0, tokens=16, pages=1)),
        (S, "kv_done", dict(room=1, rid="r1", first_token=5)),
        (S, "kv_done", dict(room=3, rid="r3", first_token=6)),
        (S, "release", dict(rid="r3", obj="o3", slot=1)),
        (S, "req_done", dict(rid="r3", room=3, tokens=1)),
        (S, "admit", dict(batch=0, rids=["r1"])),
        (S, "fwd_begin", dict(batch=0)),
        (S, "stage", dict(batch=0)),
        (S, "fwd_end", dict(batch=0)),
        (S, "war_barrier", dict(batch=0)),
        (S, "sample", dict(batch=0)),
        (S, "iter_begin", dict(iter=3)),
        (S, "prefetch_begin", dict(iter=3)),
        (S, "prefetch_submit", dict(addr=A, rooms=[2], qid=2)),
        (S, "prefetch_end", dict(iter=3)),
        (P, "query_begin", dict(addr=A, rooms=[2], qid=2, source="prefetch")),
        (P, "query_end", dict(addr=A, rooms=[2], qid=2, result={"2": 1}, error=None)),
        (
            S,
            "resolve",
            dict(
                addr=A,
                rooms=[2],
                source="prefetched",
                qid=2,
                wait_ns=1000,
                lead_ns=2000000,
                result={"2": 1},
                error=None,
                pending=[2],
                covered=[2],
            ),
        ),
        (S, "alloc", dict(rid="r2", obj="o2", slot=1)),
        (S, "receiver_init", dict(room=2, rank=1, rid="r2")),
        (S, "kv_recv", dict(room=2, rank=1, start=0, tokens=17, pages=2)),
        (S, "kv_done", dict(room=2, rid="r2", first_token=7)),
        (S, "release", dict(rid="r2", obj="o2", slot=1)),
        (S, "req_done", dict(rid="r2", room=2, tokens=1)),
        (S, "admit", dict(batch=1, rids=["r1"])),
        (S, "fwd_begin", dict(batch=1)),
        (S, "stage", dict(batch=1)),
        (S, "fwd_end", dict(batch=1)),
        (S, "war_barrier", dict(batch=1)),
        (S, "process_begin", dict(batch=0)),
        (S, "process_end", dict(batch=0)),
        (S, "sample", dict(batch=1)),
        (S, "iter_begin", dict(iter=4)),
        (S, "prefetch_begin", dict(iter=4)),
        (S, "prefetch_end", dict(iter=4)),
        (S, "process_begin", dict(batch=1)),
        (S, "release", dict(rid="r1", obj="o1", slot=0)),
        (S, "req_done", dict(rid="r1", room=1, tokens=3)),
        (S, "process_end", dict(batch=1)),
        (S, "release_memory", {}),
        (S, "resume_memory", {}),
    ]


def write(path, events, **header):
    head = {
        "format": "pdo-trace",
        "version": 1,
        "role": "decode",
        "mode": "overlap",
        "page_size": 16,
        "prefetch": True,
        **header,
    }
    with open(path, "w") as f:
        f.write(json.dumps(head) + "\n")
        for i, (thread, ev, fields) in enumerate(events, 1):
            f.write(
                json.dumps({"seq": i, "t_ns": 1000 * i, "thread": thread, "ev": ev, **fields})
                + "\n"
            )
    return str(path)


def find(events, ev, **match):
    for i, (_, e, f) in enumerate(events):
        if e == ev and all(f.get(k) == v for k, v in match.items()):
            return i
    raise KeyError((ev, match))


def move(events, src, dst_after):
    """Move event `src` (ev, match) to just after event `dst_after`."""
    item = events.pop(find(events, *src[:1], **src[1]))
    events.insert(find(events, *dst_after[:1], **dst_after[1]) + 1, item)
    return events


def edit(events, ev, match, **changes):
    i = find(events, ev, **match)
    t, e, f = events[i]
    events[i] = (t, e, {**f, **changes})
    return events


def drop(events, ev, **match):
    events.pop(find(events, ev, **match))
    return events


def ids(path):
    return sorted({v.rule.id for v in check_file(path).violations})


def test_canonical_decode_trace_passes_every_decode_rule(tmp_path):
    r = check_file(write(tmp_path / "d.jsonl", base()))
    assert r.ok, [(v.rule.id, v.message) for v in r.violations]
    decode_ids = {x.id for x in load_rules() if x.role == "decode"}
    assert {rule.id for rule, _ in r.rules} == decode_ids and all(n > 0 for _, n in r.rules)


def insert_after(events, anchor, *items):
    i = find(events, anchor[0], **anchor[1]) + 1
    events[i:i] = list(items)
    return events


def _stale(e):
    insert_after(
        e, ("prefetch_begin", dict(iter=4)), (S, "prefetch_submit", dict(addr=A, rooms=[9], qid=7))
    )
    return insert_after(
        e,
        ("process_end", dict(batch=1)),
        (S, "prefetch_cancel", dict(addr=A, rooms=[9], qid=7, reason="stale")),
    )


def _bare(events):
    """The resolves without `pending` and `covered` (a trace that does not log them, as the reference
    engine's): D-consume-answer, which would report the query edits below too, does not judge them."""
    return [
        (t, ev, {k: v for k, v in f.items() if ev != "resolve" or k not in ("pending", "covered")})
        for t, ev, f in events
    ]


VIOLATIONS = {
    "D-prefetch-top": lambda e: drop(drop(e, "prefetch_begin", iter=2), "prefetch_end", iter=2),
    "D-one-query-per-addr": lambda e: insert_after(
        insert_after(
            _bare(e),
            ("prefetch_submit", dict(qid=2)),
            (S, "prefetch_submit", dict(addr=A, rooms=[2], qid=9)),
        ),
        ("resolve", dict(qid=2)),
        (S, "prefetch_cancel", dict(addr=A, rooms=[2], qid=9, reason="mismatch")),
    ),
    "D-published-first": lambda e: move(e, ("prefill_info", {}), ("query_begin", dict(qid=0))),
    "D-unknown-rooms-only": lambda e: edit(e, "query_begin", dict(qid=2), rooms=[1, 2]),
    "D-prefetch-match": lambda e: edit(_bare(e), "prefetch_submit", dict(qid=2), rooms=[2, 3]),
    "D-consume-answer": lambda e: edit(e, "resolve", dict(qid=2), pending=[2, 3]),
    "D-no-stale": _stale,
    "D-release-cancels": lambda e: move(
        e, ("release_memory", {}), ("prefetch_submit", dict(qid=2))
    ),
    "D-init-once": lambda e: insert_after(
        e, ("receiver_init", dict(room=2)), (S, "receiver_init", dict(room=2, rank=1, rid="r2"))
    ),
    "D-init-fifo": lambda e: move(
        move(e, ("alloc", dict(rid="r1")), ("receiver_init", dict(room=3))),
        ("receiver_init", dict(room=1)),
        ("alloc", dict(rid="r1")),
    ),
    "D-kv-after-init": lambda e: edit(e, "kv_recv", dict(room=2), rank=0),
    "D-page-count": lambda e: edit(e, "kv_recv", dict(room=1), pages=1),
    "D-slot-release": lambda e: drop(e, "release", rid="r1"),
    "D-request-ends": lambda e: drop(e, "req_done", rid="r2"),
    "D-fifo": lambda e: insert_after(e, ("stage", dict(batch=0)), (S, "stage", dict(batch=0))),
    "D-complete": lambda e: drop(e, "war_barrier", batch=1),
    "D-complete-sample": lambda e: drop(e, "sample", batch=1),
    "D-war-before-next-stage": lambda e: move(
        e, ("war_barrier", dict(batch=0)), ("stage", dict(batch=1))
    ),
    "D-process-after-forward": lambda e: move(
        move(e, ("process_begin", dict(batch=0)), ("fwd_end", dict(batch=0))),
        ("process_end", dict(batch=0)),
        ("process_begin", dict(batch=0)),
    ),
    "D-sample-before-next-forward": lambda e: move(
        e, ("sample", dict(batch=0)), ("fwd_end", dict(batch=1))
    ),
    "D-sample-idle": lambda e: move(e, ("sample", dict(batch=1)), ("fwd_begin", dict(batch=1))),
    "D-scheduler-thread": lambda e: [
        (("transfer" if ev == "kv_recv" else t), ev, f) for t, ev, f in e
    ],
}


def test_every_decode_rule_has_a_violating_trace():
    assert set(VIOLATIONS) == {r.id for r in load_rules() if r.role == "decode"}


@pytest.mark.parametrize("rule_id", sorted(VIOLATIONS))
def test_violating_trace_fails_with_the_rule_id(tmp_path, rule_id):
    got = ids(write(tmp_path / "d.jsonl", VIOLATIONS[rule_id](base())))
    assert rule_id in got, got
    if rule_id != "D-sample-idle":  # sampling inside a forward also runs ahead of P(N-1)
        assert got == [rule_id]


def test_prefetch_off_trace_must_not_call_the_prefetch(tmp_path):
    assert ids(write(tmp_path / "d.jsonl", base(), prefetch=False)) == ["D-prefetch-top"]


# ---- cross-process ----------------------------------------------------------------------------------


def prefill_trace(path, rank, admitted, sent, end: str | None = None):
    """A prefill rank's trace; with `end`, version 2 ending with a trace_end of that reason."""
    head = {
        "format": "pdo-trace",
        "version": 1 if end is None else 2,
        "role": "prefill",
        "mode": "normal",
        "page_size": 16,
        "dp_rank": rank,
        "dp_size": 2,
    }
    lines = [dict(thread=S, ev="admit", batch=0, rids=admitted)]
    lines += [
        dict(thread=S, ev="kv_send", rid=rid, obj="o", tokens=t, pages=-(-t // 16))
        for rid, t in sent
    ]
    with open(path, "w") as f:
        f.write(json.dumps(head) + "\n")
        for i, e in enumerate(lines, 1):
            f.write(json.dumps({"seq": i, "t_ns": i, **e}) + "\n")
        if end is not None:
            n = len(lines)
            last = dict(seq=n + 1, t_ns=n + 1, thread=S, ev="trace_end", events=n, reason=end)
            f.write(json.dumps(last) + "\n")
    return str(path)


def cross(tmp_path, p0, p1):
    d = write(tmp_path / "d.jsonl", base())
    paths = [
        d,
        prefill_trace(tmp_path / "p0.jsonl", 0, *p0),
        prefill_trace(tmp_path / "p1.jsonl", 1, *p1),
    ]
    (r,) = check_cross(paths, load_rules())
    return r, paths


GOOD = ((["r1", "r3"], [("r1", 20), ("r3", 16)]), (["r2"], [("r2", 17)]))


def test_cross_rules_pass_when_decode_and_prefill_agree(tmp_path):
    r, _ = cross(tmp_path, *GOOD)
    assert r.ok and {rule.id for rule, _ in r.rules} == {"X-rank-served", "X-kv-pages"}
    assert all(n > 0 for _, n in r.rules)


def test_cross_rank_served_fails_when_another_rank_admitted_the_request(tmp_path):
    r, _ = cross(tmp_path, (["r1", "r3", "r2"], [("r1", 20), ("r3", 16), ("r2", 17)]), ([], []))
    assert {v.rule.id for v in r.violations} >= {"X-rank-served"}


@pytest.mark.parametrize("end, broken", [("signal", False), ("normal", True)])
def test_cross_rank_served_leaves_a_room_to_a_rank_stopped_before_its_end(tmp_path, end, broken):
    """r2's rank 1 admitted nothing: a fault when its trace ended normally, not judged when a
    signal stopped it first (the room registered, its request still queued), in both checkers."""
    from checker.z3check import check_cross as z3_cross

    paths = [
        write(tmp_path / "d.jsonl", base()),
        prefill_trace(tmp_path / "p0.jsonl", 0, *GOOD[0], end=end),
        prefill_trace(tmp_path / "p1.jsonl", 1, [], [], end=end),
    ]
    (linear,) = check_cross(paths, load_rules())
    (z3,) = z3_cross(paths)
    assert ("X-rank-served" in {v.rule.id for v in linear.violations}) == broken
    assert ("X-rank-served" in z3.cores) == broken


def test_cross_kv_pages_fails_when_decode_got_less_than_prefill_sent(tmp_path):
    r, _ = cross(tmp_path, GOOD[0], (["r2"], [("r2", 16)]))
    assert {v.rule.id for v in r.violations} == {"X-kv-pages"}


def test_pdo_check_takes_several_files_and_checks_them_together(tmp_path):
    _, paths = cross(tmp_path, GOOD[0], (["r2"], [("r2", 33)]))
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "check", "--json", *paths],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    reports = json.loads(out.stdout)
    cross_report = [x for x in reports if x["header"]["role"] == "cross"]
    assert out.returncode == 1 and len(cross_report) == 1
    assert {v["rule"] for v in cross_report[0]["violations"]} == {"X-kv-pages"}


# ---- a cancel that did not stop its query (issue 33) ----------------------------------------------
def _z3_ids(path):
    from checker import z3check

    res = z3check.check_file(path)
    assert res.status in ("pass", "fail"), res.status
    return sorted(res.violated)


def _lost_race(stopped, released: bool):
    """Iteration 3's prefetched query 2 (room 2) cancelled, with Future.cancel()'s result `stopped`
    (None: the field absent), then room 2 asked and answered synchronously, and only then the pool
    thread's query_begin of query 2 (it asks a room now known). `released`: the cancel is
    release_memory's, and the query begins while memory is released (resumed after)."""
    ev = base()
    k = find(ev, "query_begin", qid=2)
    qb, qe = ev[k], ev[k + 1]
    del ev[k : find(ev, "resolve", source="prefetched") + 1]
    cancel = dict(addr=A, rooms=[2], qid=2, reason="release" if released else "mismatch")
    if stopped is not None:
        cancel["stopped"] = stopped
    sync = [
        (S, "query_begin", dict(addr=A, rooms=[2], qid=3, source="sync")),
        (S, "query_end", dict(addr=A, rooms=[2], qid=3, result={"2": 1}, error=None)),
        (
            S,
            "resolve",
            dict(
                addr=A,
                rooms=[2],
                source="sync",
                qid=None,
                wait_ns=1000,
                lead_ns=0,
                result={"2": 1},
                error=None,
            ),
        ),
    ]
    if released:
        steps = [(S, "prefetch_cancel", cancel), (S, "release_memory", {}), qb, qe]
        steps += [(S, "resume_memory", {}), *sync]
        ev = ev[:-2]  # memory is released once, here
    else:
        steps = [(S, "prefetch_cancel", cancel), *sync, qb, qe]
    i = find(ev, "prefetch_end", iter=3) + 1
    ev[i:i] = steps
    return ev


@pytest.mark.parametrize("released", [False, True], ids=["mismatch", "release"])
@pytest.mark.parametrize("stopped", [False, None], ids=["not-stopped", "field-absent"])
def test_a_query_its_cancel_did_not_stop_may_begin_after_it(tmp_path, stopped, released):
    """Future.cancel() returns False for a query the pool thread has taken: it begins after the
    cancel (asking a room answered since, or while memory is released), unused. No rule fails, in
    either checker; a trace without `stopped` reads as not known to have stopped it."""
    path = write(tmp_path / "d.jsonl", _lost_race(stopped, released))
    assert ids(path) == [] and _z3_ids(path) == []


@pytest.mark.parametrize(
    "released, rule",
    [(False, "D-unknown-rooms-only"), (True, "D-release-cancels")],
    ids=["mismatch", "release"],
)
def test_a_query_after_a_cancel_that_stopped_it_is_checked_as_any_query(tmp_path, released, rule):
    """A cancel that stopped its query (stopped true) means it never runs: if it begins anyway it
    is a query like any other, which asks a room already known, or asks while memory is released.
    (Before `stopped`, every cancelled query was excepted from both rules.)"""
    path = write(tmp_path / "d.jsonl", _lost_race(True, released))
    assert ids(path) == [rule] and _z3_ids(path) == [rule]
