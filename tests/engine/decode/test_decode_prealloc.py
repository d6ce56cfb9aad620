"""The decode prealloc queue on its own, against a real bootstrap server: what the prefetch submits,
how the consumption point uses it, receiver init order, and the failure paths."""

from __future__ import annotations

import socket
import time
from concurrent.futures import Future

import pytest

from engine.bootstrap import client as bootstrap_client
from engine.bootstrap.server import BootstrapServer
from engine.decode.config import DecodeConfig
from engine.decode.prealloc import DecodePreallocQueue
from engine.decode.request import DecodeReq, ReceiverInit, ReqState
from engine.runs.pd import rank_info
from engine.trace.tracer import Tracer

# the loops' traces refine their models (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("refined")


class FakeSched:
    """Receiver init always succeeds (or finds no memory beyond `capacity`); aborts are recorded."""

    def __init__(self, capacity=None):
        self.inits: list[tuple[int, int]] = []
        self.aborted: dict[str, str] = {}
        self.capacity = capacity
        self.q = None
        self.failed_ranks: set[int] = set()  # prefill ranks known dead (engine/decode/scheduler.py)

    def init_receiver(self, r):
        if self.capacity is not None and len(self.inits) >= self.capacity:
            return ReceiverInit.NO_MEMORY
        self.inits.append((r.room, r.prefill_dp_rank))
        r.state = ReqState.TRANSFER
        return ReceiverInit.OK

    def abort(self, r, reason):
        self.q.remove(r)
        r.state = ReqState.ABORTED
        self.aborted[r.rid] = reason


@pytest.fixture
def server():
    """Two prefill DP ranks registered; room 7 on rank 1, room 8 on rank 0, room 9 on rank 1."""
    with BootstrapServer(expected_ranks=2) as s:
        for i in range(2):
            bootstrap_client.register_prefill_rank(s.url, rank_info(i, 2, 16, 20000 + i))
        for room, rank in ((7, 1), (8, 0), (9, 1)):
            bootstrap_client.register_dp_rank(s.url, room, rank)
        yield s


def make_queue(server_url, capacity=None, **dc):
    tr = Tracer({"role": "decode"})
    sched = FakeSched(capacity)
    q = DecodePreallocQueue(sched, DecodeConfig(**{"info_retry_interval_s": 0.0, **dc}), tr)
    sched.q = q
    addr = server_url.split("://")[1]
    return q, sched, tr, addr


def req(room, addr):
    return DecodeReq(f"r{room}", room, addr, [1, 2, 3], 4)


def evs(tr, ev, **match):
    return [e for e in tr.events if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())]


def publish(q):
    """The first consumption point fetches the prefill parallel info (GET /route)."""
    q._ensure_prefill_info({a: [] for a in {r.addr for r in q.pending}})


def test_prefetch_submits_pending_rooms_then_prefix_tail_is_sync_and_init_is_fifo(server):
    q, sched, tr, addr = make_queue(server.url)
    q.add(req(7, addr))
    publish(q)
    q.prefetch_prefill_dp_rank_queries(1)
    assert [e["rooms"] for e in evs(tr, "prefetch_submit")] == [[7]]
    q.add(req(8, addr))  # arrives after the top of the iteration
    assert q.pop_preallocated() and sched.inits == [(7, 1), (8, 0)]
    (res,) = evs(tr, "resolve")
    assert (
        res["source"] == "prefix" and res["rooms"] == [7, 8] and res["result"] == {"7": 1, "8": 0}
    )
    assert [e["rooms"] for e in evs(tr, "query_begin", source="sync")] == [[8]]  # only the tail
    assert q.pending == [] and q._queries == {}


def test_prefix_tail_query_overlaps_the_future_instead_of_following_it(server):
    """The tail's synchronous query runs while the prefetched one is still on its way: the
    consumption point waits about one round trip, not two in a row."""
    server.set_faults(latency_s=0.3, latency_scope="query_dp_ranks")
    q, sched, tr, addr = make_queue(server.url)
    q.add(req(7, addr))
    publish(q)
    q.prefetch_prefill_dp_rank_queries(1)
    q.add(req(8, addr))
    q.pop_preallocated()
    (res,) = evs(tr, "resolve")
    assert res["source"] == "prefix" and res["error"] is None and sched.inits == [(7, 1), (8, 0)]
    assert res["wait_ns"] < 0.5e9, res["wait_ns"]  # two round trips in series would be >= 0.6 s


def test_prefetch_submit_is_logged_before_the_pool_can_begin_the_query(server):
    """Even a pool thread that starts at once (here: runs the query inside submit) logs its
    query_begin after the scheduler's prefetch_submit."""
    q, sched, tr, addr = make_queue(server.url)

    def run_now(fn, *args):
        fut = Future()
        fut.set_result(fn(*args))
        return fut

    q._executor.submit = run_now
    q.add(req(7, addr))
    publish(q)
    q.prefetch_prefill_dp_rank_queries(1)
    names = [
        e["ev"] for e in tr.events if e["ev"] in ("prefetch_submit", "query_begin", "query_end")
    ]
    assert names == ["prefetch_submit", "query_begin", "query_end"]


def test_equal_rooms_use_the_future_and_nothing_else(server):
    q, sched, tr, addr = make_queue(server.url)
    for room in (7, 8):
        q.add(req(room, addr))
    publish(q)
    server.reset_counters()
    q.prefetch_prefill_dp_rank_queries(1)
    q.pop_preallocated()
    assert server.counters.get("query_dp_ranks") == 1
    (res,) = evs(tr, "resolve")
    assert res["source"] == "prefetched" and res["qid"] == evs(tr, "prefetch_submit")[0]["qid"]
    assert res["lead_ns"] > 0 and sched.inits == [(7, 1), (8, 0)]


def test_changed_rooms_cancel_the_future_and_query_synchronously(server):
    q, sched, tr, addr = make_queue(server.url)
    r7, r8 = req(7, addr), req(8, addr)
    q.add(r7)
    q.add(r8)
    publish(q)
    q.prefetch_prefill_dp_rank_queries(1)
    q.remove(r7)  # aborted between prefetch and resolve
    q.pop_preallocated()
    assert [e["reason"] for e in evs(tr, "prefetch_cancel")] == ["mismatch"]
    (res,) = evs(tr, "resolve")
    assert res["source"] == "sync" and res["rooms"] == [8] and sched.inits == [(8, 0)]


def test_unpublished_prefill_is_skipped_then_queried_once_published():
    with BootstrapServer(expected_ranks=2) as s:
        bootstrap_client.register_prefill_rank(
            s.url, rank_info(0, 2, 16, 20000)
        )  # rank 1 not up yet: 503
        bootstrap_client.register_dp_rank(s.url, 8, 0)
        q, sched, tr, addr = make_queue(s.url)
        q.add(req(8, addr))
        q.pop_preallocated()
        q.prefetch_prefill_dp_rank_queries(1)
        assert evs(tr, "prefill_info")[0]["published"] is False
        assert [e["reason"] for e in evs(tr, "prefetch_skip")] == ["not_published"]
        assert not evs(tr, "query_begin") and q.pending
        bootstrap_client.register_prefill_rank(s.url, rank_info(1, 2, 16, 20001))
        q.pop_preallocated()
        assert evs(tr, "prefill_info")[-1]["published"] is True and sched.inits == [(8, 0)]


def test_a_known_rank_is_not_asked_again_and_a_query_in_flight_is_not_doubled(server):
    q, sched, tr, addr = make_queue(
        server.url, capacity=0
    )  # no memory: resolved requests stay pending
    q.add(req(7, addr))
    publish(q)
    q.prefetch_prefill_dp_rank_queries(1)
    q.prefetch_prefill_dp_rank_queries(2)
    assert [e["reason"] for e in evs(tr, "prefetch_skip")] == ["in_flight"]
    q.pop_preallocated()
    assert q.pending[0].prefill_dp_rank == 1 and sched.inits == []
    q.prefetch_prefill_dp_rank_queries(3)
    assert [e["reason"] for e in evs(tr, "prefetch_skip")][-1] == "all_known"
    assert len(evs(tr, "prefetch_submit")) == 1
    sched.capacity = None
    q.pop_preallocated()
    assert sched.inits == [(7, 1)] and len(evs(tr, "query_begin")) == 1


def test_fifo_a_request_without_memory_holds_back_younger_ones(server):
    q, sched, tr, addr = make_queue(server.url, capacity=1)
    for room in (7, 8, 9):
        q.add(req(room, addr))
    q.pop_preallocated()
    assert sched.inits == [(7, 1)] and [r.room for r in q.pending] == [8, 9]
    sched.capacity = 3
    q.pop_preallocated()
    assert sched.inits == [(7, 1), (8, 0), (9, 1)]


def test_stale_future_is_cancelled_by_the_next_prefetch(server):
    q, sched, tr, addr = make_queue(server.url)
    r7 = req(7, addr)
    q.add(r7)
    publish(q)
    q.prefetch_prefill_dp_rank_queries(1)
    q.remove(r7)
    q.prefetch_prefill_dp_rank_queries(2)
    assert [e["reason"] for e in evs(tr, "prefetch_cancel")] == ["stale"] and q._queries == {}


def test_release_memory_cancels_every_future_and_initialises_nothing_until_resume(server):
    q, sched, tr, addr = make_queue(server.url)
    q.add(req(7, addr))
    publish(q)
    q.prefetch_prefill_dp_rank_queries(1)
    q.release_memory_occupation()
    assert [e["reason"] for e in evs(tr, "prefetch_cancel")] == ["release"] and q._queries == {}
    q.prefetch_prefill_dp_rank_queries(2)
    assert evs(tr, "prefetch_skip")[-1]["reason"] == "released"
    q.pop_preallocated()
    assert sched.inits == [] and q.pending
    q.resume_memory_occupation()
    q.pop_preallocated()
    assert sched.inits == [(7, 1)]


def test_no_query_at_all_while_memory_is_released(server):
    """Released: neither the prefetch nor the consumption point asks anything (D-release-cancels: no
    query until resume), and the bootstrap timeout does not abort rooms nobody asked about."""
    q, sched, tr, addr = make_queue(server.url, bootstrap_timeout_s=0.05)
    q.release_memory_occupation()
    q.add(req(7, addr))
    server.reset_counters()
    q.prefetch_prefill_dp_rank_queries(1)
    time.sleep(0.1)
    q.pop_preallocated()
    assert not evs(tr, "query_begin") and not evs(tr, "resolve") and not evs(tr, "prefill_info")
    assert (
        server.counters.get("query_dp_ranks", 0) == 0 and server.counters.get("route_get", 0) == 0
    )
    assert q.pending and not sched.aborted and sched.inits == []
    q.resume_memory_occupation()
    q.pop_preallocated()
    assert sched.inits == [(7, 1)] and not sched.aborted


def test_failed_queries_keep_rooms_pending_then_the_budget_aborts_them(server):
    server.set_faults(failure_rate=1.0, failure_status=500)
    q, sched, tr, addr = make_queue(server.url, query_retries=0, query_failure_budget=3)
    q.add(req(7, addr))
    for _ in range(2):
        q.pop_preallocated()
        assert q.pending and not sched.aborted
    q.pop_preallocated()
    assert "failed 3 times in a row" in sched.aborted["r7"] and "HTTP 500" in sched.aborted["r7"]
    assert all(e["error"] for e in evs(tr, "resolve"))


def test_unknown_room_stays_pending_until_registered_or_times_out(server):
    q, sched, tr, addr = make_queue(server.url, bootstrap_timeout_s=0.2)
    q.add(req(40, addr))
    q.pop_preallocated()
    assert q.pending and evs(tr, "resolve")[0]["result"] == {}
    bootstrap_client.register_dp_rank(server.url, 40, 0)
    q.pop_preallocated()
    assert sched.inits == [(40, 0)]
    r41 = req(41, addr)
    r41.t_add -= 1.0  # waited past the timeout
    q.pending.append(r41)
    q.pop_preallocated()
    assert "still unknown to the bootstrap server" in sched.aborted["r41"]


def test_unreachable_bootstrap_aborts_after_the_info_retries():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    q, sched, tr, addr = make_queue(f"http://127.0.0.1:{port}", info_max_retries=3)
    q.add(req(7, addr))
    for _ in range(3):
        q.pop_preallocated()
    assert "could not fetch prefill parallel info" in sched.aborted["r7"]
    assert not evs(tr, "query_begin") and all(
        e["published"] is False for e in evs(tr, "prefill_info")
    )
