"""Faults around the decode's DP-rank queries, each with its documented behaviour (docs/decode.md):
retry, stay pending, abort that request with an error, or a clear start-up error. Never a crash, a
hang or a leaked page; the traces still pass every rule."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from checker.linear import check_files
from engine.decode.config import DecodeConfig
from engine.decode.request import DecodeReq
from engine.runs.pd import PDError, run_pd
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from tests.helpers import assert_tokens_match_reference

# the loops' traces refine their models (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("refined")

ROOT = Path(__file__).resolve().parents[3]


def extras(n, start=5000):
    """Decode-only requests: rooms no prefill rank serves, so the bootstrap server never knows them."""
    return [DecodeReq(f"x{i}", start + i, None, [1, 2, 3, 4, 5], 4) for i in range(n)]


def pd(tmp_path, *, inject=(), extra=0, requests=6, mode="overlap", **kw):
    kw.setdefault("dc", DecodeConfig(bootstrap_timeout_s=0.6))
    cfg = EngineConfig(mode=mode, inject=frozenset(inject))
    wc = WorkloadConfig(requests=requests, prompt_len=(16, 64), max_new_tokens=4, seed=7)
    run = {k: kw.pop(k) for k in ("hooks", "server_hook") if k in kw}
    spec = RunSpec(cfg, wc, kw.pop("dc"), dp=2, trace_path=str(tmp_path / "t.jsonl"), **kw)
    s = run_pd(spec, extra_decode_reqs=extras(extra), **run).summary
    assert_tokens_match_reference(s, cfg, wc)
    return s, check_files(s["traces"])


def violated(results):
    return sorted({v.rule.id for r in results for v in r.violations})


def no_leaks(s):
    assert not any(s["decode_leaks"].values()), s["decode_leaks"]
    assert all(not any(p.values()) for p in s["prefill_leaks"]), s["prefill_leaks"]
    assert s["unclaimed_rooms"] == [], s[
        "unclaimed_rooms"
    ]  # aborted rooms' KV was dropped, not kept


def served_ok(s, aborted=()):
    """Everything but `aborted` finished with the reference's tokens."""
    assert set(s["aborted"]) == set(aborted), s["aborted"]
    assert s["finished"] == s["requests"] - len(aborted) and s["mismatches"] == []
    no_leaks(s)


# ---- hooks the tests use: they run on the decode scheduler thread ------------------------------------


def abort_one_of_several_prefetched(sched):
    for p in sched.prealloc._queries.values():
        if len(p.rooms) >= 2 and not getattr(sched, "_hooked", False):
            sched._hooked = True
            sched.abort(sched.by_room[p.rooms[0]], "client went away")


def abort_everything_prefetched(sched):
    if (
        sched.prealloc._queries
        and not getattr(sched, "_hooked", False)
        and all(r.rid.startswith("x") for r in sched.prealloc.pending)
    ):
        sched._hooked = True
        for r in list(sched.prealloc.pending):
            sched.abort(r, "client went away")


def release_then_resume(sched):
    at = getattr(sched, "_released_at", 0)
    if not at and sched.prealloc._queries:
        sched._released_at = sched.iter
        sched.release_memory_occupation()
    elif at and sched.iter == at + 5:
        sched.resume_memory_occupation()


# ---- the faults ---------------------------------------------------------------------------------------


def test_slow_bootstrap_server_only_makes_queries_slower(tmp_path):
    s, results = pd(tmp_path, bootstrap_latency_ms=25)
    served_ok(s)
    assert (
        s["resolve"]["errors"] == 0 and s["resolve"]["mean_wait_ms"] >= 12
    )  # 25 ms per query, less any lead
    assert not violated(results)


@pytest.mark.parametrize("status", [503, 500])
def test_failing_bootstrap_answers_are_retried(tmp_path, status):
    s, results = pd(
        tmp_path,
        server_hook=lambda srv: srv.set_faults(failure_rate=0.6, failure_status=status, seed=3),
        dc=DecodeConfig(query_retries=0),
    )
    served_ok(s)
    assert s["resolve"]["errors"] > 0  # some consumption points failed: their rooms stayed pending
    assert not violated(results)


def test_timed_out_queries_are_retried_until_the_server_recovers(tmp_path):
    servers = []

    def recover(sched):
        # once a query has timed out (not at a fixed iteration: on a loaded machine the prefill ranks
        # may publish so late that decode asks nothing in its first iterations)
        if any(x["error"] for x in sched.prealloc.resolves):
            servers[0].set_faults(latency_s=0.0)

    s, results = pd(
        tmp_path,
        server_hook=lambda srv: (
            servers.append(srv),
            srv.set_faults(latency_s=0.3, latency_scope="query_dp_ranks"),
        ),
        hooks={"iter": recover},
        dc=DecodeConfig(query_timeout_s=0.05, query_retries=0),
    )
    served_ok(s)
    assert s["resolve"]["errors"] > 0
    assert not violated(results)


def test_persistent_failure_aborts_the_requests_with_an_error_and_nothing_hangs(tmp_path):
    s, results = pd(
        tmp_path,
        server_hook=lambda srv: srv.set_faults(failure_rate=1.0, failure_status=500),
        dc=DecodeConfig(query_retries=0, query_failure_budget=4),
        requests=4,
    )
    assert s["finished"] == 0 and len(s["aborted"]) == 4
    assert all("failed 4 times in a row" in e and "HTTP 500" in e for e in s["aborted"].values())
    no_leaks(s)  # their rank never known: every prefill rank dropped the rooms, none kept their KV
    assert not violated(results)


def test_bootstrap_down_at_start_is_a_clear_startup_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(PDError, match="not reachable"):
        run_pd(
            RunSpec(
                EngineConfig(),
                WorkloadConfig(requests=2),
                DecodeConfig(),
                bootstrap_url=f"http://127.0.0.1:{port}",
            )
        )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "run",
            "--pd",
            "--bootstrap-url",
            f"http://127.0.0.1:{port}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert (
        r.returncode == 2
        and "not reachable" in r.stderr
        and len(r.stderr.strip().splitlines()) == 1
    )


def test_prefill_not_published_yet_keeps_requests_pending(tmp_path):
    s, results = pd(tmp_path, prefill_delay_s=0.3)
    served_ok(s)
    assert not violated(results)
    ev = [e for e in _events(s["traces"][0]) if e["ev"] in ("prefill_info", "prefetch_skip")]
    assert any(e["ev"] == "prefill_info" and e["published"] is False for e in ev)
    assert any(e["ev"] == "prefetch_skip" and e["reason"] == "not_published" for e in ev)


def test_request_aborted_between_prefetch_and_resolve(tmp_path):
    s, results = pd(tmp_path, extra=2, hooks={"after_prefetch": abort_one_of_several_prefetched})
    gone = [rid for rid, e in s["aborted"].items() if e == "client went away"]
    assert len(gone) == 1
    served_ok(s, aborted=set(gone) | {"x0", "x1"})
    assert not violated(results)
    assert any(
        e["ev"] == "prefetch_cancel" and e["reason"] == "mismatch" for e in _events(s["traces"][0])
    )


def test_every_pending_request_aborted_after_prefetch_leaves_no_stale_future(tmp_path):
    s, results = pd(tmp_path, extra=2, hooks={"after_prefetch": abort_everything_prefetched})
    assert {rid for rid, e in s["aborted"].items() if e == "client went away"} == {"x0", "x1"}
    served_ok(s, aborted={"x0", "x1"})
    assert not violated(results)
    assert any(
        e["ev"] == "prefetch_cancel" and e["reason"] in ("empty", "stale")
        for e in _events(s["traces"][0])
    )


def test_room_the_server_never_learns_is_aborted_after_the_bootstrap_timeout(tmp_path):
    s, results = pd(tmp_path, extra=1)
    served_ok(s, aborted={"x0"})
    assert "room 5000 still unknown to the bootstrap server after 0.6 s" in s["aborted"]["x0"]
    assert not violated(results)


def test_requests_aborted_while_pending_leave_no_kv_on_the_prefill_side(tmp_path):
    """Regression: a request aborted in the prealloc queue after its rank was resolved (here: prompt +
    max_new_tokens exceeds max_context, found at receiver init) must drop its room on that rank, or
    the rank's KV server keeps the room's chunks for good."""
    s = run_pd(
        RunSpec(
            EngineConfig(),
            WorkloadConfig(requests=4, prompt_len=(30, 40), max_new_tokens=1000, seed=7),
            DecodeConfig(),
            dp=2,
            trace_path=str(tmp_path / "t.jsonl"),
        )
    ).summary
    assert len(s["aborted"]) == 4 and all("exceeds max_context" in e for e in s["aborted"].values())
    no_leaks(s)
    assert not violated(check_files(s["traces"]))


def test_release_and_resume_memory_mid_run(tmp_path):
    s, results = pd(tmp_path, extra=1, hooks={"after_prefetch": release_then_resume})
    served_ok(s, aborted={"x0"})
    assert not violated(results)
    evs = [e["ev"] for e in _events(s["traces"][0])]
    assert "release_memory" in evs and "resume_memory" in evs


def _events(path):
    from checker.trace_io import iter_events

    return [e for _, e in iter_events(path)]


def test_launch_whose_bootstrap_cannot_start_is_a_clear_startup_error(tmp_path):
    """A bootstrap child that exits before it listens is a one-line start-up error naming its last
    line. (A latency outside its domain, which used to make the child refuse, is now refused by
    `pdo launch`'s own parser, before any child starts.)"""
    from engine.cli.launch import _read_url
    from engine.runs.child_process import spawn
    from spec.errors import BadInput

    code = "import sys; print('bootstrap: error: port in use', file=sys.stderr); sys.exit(2)"
    child = spawn("bootstrap", [sys.executable, "-c", code], tmp_path, dict(os.environ))
    with pytest.raises(BadInput, match="bootstrap server did not start: bootstrap: error: port"):
        _read_url(child, timeout_s=30.0)
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "launch", "--bootstrap-latency-ms", "99999999"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 2 and "--bootstrap-latency-ms" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
