"""Bootstrap server and client over real HTTP on 127.0.0.1: injected faults, retries, concurrency,
the CLI, and fuzzed request bodies."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.bootstrap import client as bootstrap_client
from engine.bootstrap.client import BootstrapQueryError, BootstrapUnavailable
from engine.bootstrap.server import BootstrapServer
from engine.cli import main as pdo
from tests.engine.bootstrap.fixtures import REPO, T, free_port, rank

# ---- fault injection --------------------------------------------------------


def timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - t0


def test_latency_on_every_request():
    with BootstrapServer(latency_s=0.2) as s:
        ok, dt = timed(bootstrap_client.health, s.url)
        assert ok and 0.2 <= dt < 1.5
        _, dt = timed(bootstrap_client.query_prefill_dp_ranks, s.url, [1])
        assert 0.2 <= dt < 1.5


def test_latency_on_query_only_and_changed_at_run_time(server):
    server.set_faults(latency_s=0.2, latency_scope="query_dp_ranks")
    _, dt = timed(bootstrap_client.health, server.url)
    assert dt < 0.15
    _, dt = timed(bootstrap_client.query_prefill_dp_ranks, server.url, [1])
    assert dt >= 0.2
    # Same change through the admin endpoint, from another process's point of view.
    assert bootstrap_client.set_faults(server.url, latency_s=0.0)["latency_s"] == 0.0
    _, dt = timed(bootstrap_client.query_prefill_dp_ranks, server.url, [1])
    assert dt < 0.15


def test_admin_endpoint_rejects_bad_faults(server):
    for body in ({"failure_rate": 2}, {"failure_status": 404}, {"bogus": 1}, {"seed": "x"}):
        r = requests.post(f"{server.url}/_faults", json=body, timeout=T)
        assert r.status_code == 400, body
    assert requests.get(f"{server.url}/_faults", timeout=T).json()["failure_rate"] == 0.0
    with pytest.raises(ValueError):
        server.set_faults(failure_rate=-0.1)


@pytest.mark.parametrize("failure_status", [500, 503])
def test_failure_rate_one_exhausts_retries(failure_status):
    with BootstrapServer(failure_rate=1.0, failure_status=failure_status, test_routes=True) as s:
        bootstrap_client.register_dp_rank(s.url, 1, 0)  # only query_dp_ranks is failed
        with pytest.raises(BootstrapQueryError) as e:
            bootstrap_client.query_prefill_dp_ranks(s.url, [1], retries=3, backoff_s=0.01)
        err = e.value
        assert err.attempts == 4 and err.status == failure_status and not err.unavailable
        assert s.url in str(err) and "4 attempt" in str(err) and "\n" not in str(err)
        assert s.counters["query_dp_ranks"] == 4
        assert s.counters["query_dp_ranks_injected_failures"] == 4
        assert bootstrap_client.get_stats(s.url)["counters"]["query_dp_ranks"] == 4
        s.set_faults(failure_rate=0.0)
        assert bootstrap_client.query_prefill_dp_ranks(s.url, [1]) == {1: 0}


def test_partial_failures_are_retried_and_seeded():
    def outcomes(seed):
        with BootstrapServer(failure_rate=0.5, seed=seed) as s:
            seq = []
            for _ in range(20):
                try:
                    bootstrap_client.query_prefill_dp_ranks(s.url, [1], retries=0)
                    seq.append(True)
                except BootstrapQueryError:
                    seq.append(False)
            # With retries, a 50% failure rate is nearly always ridden out.
            assert (
                bootstrap_client.query_prefill_dp_ranks(
                    s.url, [1], retries=20, backoff_s=0.001, max_backoff_s=0.001
                )
                == {}
            )
            return seq

    a, b = outcomes(7), outcomes(7)
    assert a == b and 0 < sum(a) < 20


def test_client_timeout_is_retried_then_reported_unavailable():
    with BootstrapServer(latency_s=0.5, latency_scope="query_dp_ranks") as s:
        with pytest.raises(BootstrapQueryError) as e:
            bootstrap_client.query_prefill_dp_ranks(
                s.url, [1], timeout_s=0.1, retries=1, backoff_s=0.01
            )
        assert e.value.unavailable and e.value.attempts == 2 and e.value.status is None
        assert isinstance(e.value.__cause__, BootstrapUnavailable)


# ---- server down, concurrency ---------------------------------------------


def test_server_down_fails_fast():
    url = f"127.0.0.1:{free_port()}"  # SGLang-style bare host:port
    t0 = time.monotonic()
    for call in (
        lambda: bootstrap_client.get_prefill_info(url, timeout=0.5),
        lambda: bootstrap_client.get_prefill_rank_info(url, dp_rank=0, tp_rank=0, timeout=0.5),
        lambda: bootstrap_client.register_dp_rank(url, 1, 0, timeout=0.5),
        lambda: bootstrap_client.register_prefill_rank(
            url, rank(), timeout=0.5, retries=1, backoff_s=0.01
        ),
    ):
        with pytest.raises(BootstrapUnavailable) as e:
            call()
        assert f"http://{url}/" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(BootstrapQueryError) as e:
        bootstrap_client.query_prefill_dp_ranks(url, [1], timeout_s=0.5, retries=2, backoff_s=0.01)
    assert e.value.unavailable and e.value.attempts == 3
    assert not bootstrap_client.health(url, timeout=0.5)
    assert time.monotonic() - t0 < 3


def test_concurrent_queries_from_8_threads():
    with BootstrapServer(latency_s=0.1, latency_scope="query_dp_ranks") as s:
        bootstrap_client.register_prefill_rank(s.url, rank(dp_size=4))
        for dp in range(1, 4):
            bootstrap_client.register_prefill_rank(s.url, rank(dp_rank=dp, dp_size=4))
        for room in range(64):
            bootstrap_client.register_dp_rank(s.url, room, room % 4)
        barrier = threading.Barrier(8)

        def worker(i):
            barrier.wait()
            sessions = {id(bootstrap_client.session())}
            results = []
            for _ in range(3):
                rooms = [i * 8 + k for k in range(8)] + [1000 + i]  # 1000+ are unknown
                results.append(bootstrap_client.query_prefill_dp_ranks(s.url, rooms))
                sessions.add(id(bootstrap_client.session()))
            return results, sessions

        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(worker, range(8)))
        elapsed = time.monotonic() - t0
        for i, (results, sessions) in enumerate(outs):
            assert len(sessions) == 1  # one session per thread, reused
            for got in results:
                assert got == {r: r % 4 for r in range(i * 8, i * 8 + 8)}
        assert s.counters["query_dp_ranks"] == 24
        assert elapsed < 0.1 * 24 / 2  # the injected delay overlaps across requests


# ---- CLI / serve_forever ----------------------------------------------------


def test_main_rejects_bad_flags_without_blocking(capsys):
    assert pdo(["bootstrap", "--port", "0", "--failure-rate", "2"]) == 2
    assert "--failure-rate" in capsys.readouterr().err  # its domain, [0, 1]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_serve_forever_in_subprocess(sig, code):
    """A signal stops the server; its exit status says which (README, "Exit codes")."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "bootstrap",
            "--test-routes",
            "--port",
            "0",
            "--latency-ms",
            "50",
            "--latency-scope",
            "query_dp_ranks",
            "--failure-rate",
            "0",
            "--seed",
            "3",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines: queue.Queue[str] = queue.Queue()
        # A reader thread keeps the wait bounded even if the server never prints.
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
        try:
            line = lines.get(timeout=15)
        except queue.Empty:
            pytest.fail("server printed nothing within 15 s")
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line
        url = match.group(1)
        assert bootstrap_client.health(url, timeout=2)
        assert bootstrap_client.set_faults(url, failure_rate=0.0)["latency_s"] == 0.05
        _, dt = timed(bootstrap_client.query_prefill_dp_ranks, url, [1], timeout_s=2)
        assert dt >= 0.05
        proc.send_signal(sig)
        assert proc.wait(timeout=5) == code
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        proc.stdout.close()
        proc.stderr.close()


# ---- fuzz: no input makes our handlers fail with a 5xx ----------------------


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-2, 2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
_field_names = st.sampled_from(
    [
        "role",
        "attn_tp_size",
        "attn_tp_rank",
        "attn_dp_size",
        "attn_dp_rank",
        "pp_size",
        "pp_rank",
        "system_dp_size",
        "system_dp_rank",
        "rank_ip",
        "rank_port",
        "page_size",
        "bootstrap_room",
        "dp_rank",
        "bootstrap_rooms",
        "latency_s",
        "failure_rate",
        "failure_status",
        "seed",
    ]
)
_bodies = (
    _json_values
    | st.dictionaries(_field_names, _json_values, max_size=8)
    | st.builds(
        lambda base, extra: {**base, **extra},
        st.just(rank()),
        st.dictionaries(_field_names, _json_values, max_size=2),
    )
)


@pytest.fixture(scope="module")
def fuzz_server():
    with BootstrapServer(test_routes=True) as s:
        yield s


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    endpoint=st.sampled_from(
        [
            ("PUT", "/route"),
            ("POST", "/register_dp_rank"),
            ("POST", "/query_dp_ranks"),
            ("POST", "/_faults"),
        ]
    ),
    body=_bodies,
)
def test_fuzzed_bodies_never_get_5xx(fuzz_server, endpoint, body):
    method, path = endpoint
    if path == "/_faults" and isinstance(body, dict):
        body = {
            k: v for k, v in body.items() if k not in ("latency_s", "failure_rate")
        }  # keep it fast
    r = requests.request(method, f"{fuzz_server.url}{path}", json=body, timeout=T)
    assert r.status_code in (200, 400, 409), (r.status_code, r.text)
    assert "\n" not in r.text.strip()
    fuzz_server.set_faults(latency_s=0.0, failure_rate=0.0)


def test_test_routes_off_by_default():
    """`pdo bootstrap` without --test-routes: no client can change the faults or read counters."""
    with BootstrapServer() as s:
        assert (
            requests.post(f"{s.url}/_faults", json={"failure_rate": 1}, timeout=T).status_code
            == 404
        )
        assert requests.get(f"{s.url}/_stats", timeout=T).status_code == 404
        assert requests.get(f"{s.url}/_faults", timeout=T).status_code == 404
        assert s.faults.failure_rate == 0.0
        assert bootstrap_client.query_prefill_dp_ranks(s.url, [1]) == {}


def test_test_routes_on_answer_loopback():
    with BootstrapServer(test_routes=True) as s:
        r = requests.post(f"{s.url}/_faults", json={"failure_rate": 0.5}, timeout=T)
        assert r.status_code == 200 and s.faults.failure_rate == 0.5
        assert requests.get(f"{s.url}/_stats", timeout=T).status_code == 200


def test_test_routes_refuse_a_non_loopback_client(monkeypatch):
    """The predicate that decides, on fake peers; then the server refuses with 403 when it says no."""
    from engine.bootstrap import server as bootstrap

    allowed = bootstrap.admin_client_allowed
    assert allowed("127.0.0.1") and allowed("::1") and allowed("127.8.9.1")
    assert not allowed("10.0.0.7") and not allowed("192.168.1.2") and not allowed("2001:db8::1")
    assert not allowed(None) and not allowed("") and not allowed("not-an-address")
    assert allowed("10.0.0.7", from_anywhere=True)
    with BootstrapServer(test_routes=True) as s:
        monkeypatch.setattr(bootstrap, "admin_client_allowed", lambda peer, anywhere=False: False)
        r = requests.post(f"{s.url}/_faults", json={"failure_rate": 1}, timeout=T)
        assert r.status_code == 403 and s.faults.failure_rate == 0.0
        assert requests.get(f"{s.url}/_stats", timeout=T).status_code == 403
