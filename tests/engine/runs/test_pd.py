"""PD disaggregation end to end: for every prefill mode × decode loop × prefetch on/off, the embedded
run produces exactly the single-process reference's tokens, leaks nothing, and its traces (a decode
trace, one per prefill rank) pass `pdo check` together. `pdo launch` (processes, ZMQ) once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from checker.linear import check_files
from checker.refine import check_model
from checker.refine import text as refine_text
from engine.decode.config import DecodeConfig
from engine.runs.pd import run_pd
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from spec.vocabulary import PREFILL_LOOPS
from tests.helpers import assert_tokens_match_reference

# the loops' traces refine their models (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("refined")

ROOT = Path(__file__).resolve().parents[3]
WORKLOAD = dict(requests=8, prompt_len=(20, 100), hit=0.6, max_new_tokens=6, seed=5)


def assert_clean(s):
    assert s["finished"] == s["requests"] and not s["aborted"], s["aborted"]
    assert s["mismatches"] == [], s["mismatches"]
    assert not any(s["decode_leaks"].values()), s["decode_leaks"]
    assert all(not any(p.values()) for p in s["prefill_leaks"]), s["prefill_leaks"]
    assert s["unclaimed_rooms"] == [] and s["registration_errors"] == []


def assert_traces_pass(paths):
    results = check_files(paths)
    assert {r.header["role"] for r in results} == {"decode", "prefill", "cross"}
    bad = [(r.path, r.header["role"], v.rule.id, v.message) for r in results for v in r.violations]
    assert not bad, bad[:5]


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("loop", ["normal", "overlap"])
@pytest.mark.parametrize("mode", PREFILL_LOOPS)
def test_embedded_pd_matches_reference(tmp_path, mode, loop, prefetch):
    cfg, wc = EngineConfig(mode=mode), WorkloadConfig(**WORKLOAD)
    s = run_pd(
        RunSpec(
            cfg,
            wc,
            DecodeConfig(loop=loop, prefetch=prefetch),
            dp=2,
            trace_path=str(tmp_path / "t.jsonl"),
        )
    ).summary
    assert_clean(s)
    assert_tokens_match_reference(s, cfg, wc)
    assert s["decode_tokens"] == WORKLOAD["requests"] * (WORKLOAD["max_new_tokens"] - 1)
    if not prefetch:  # with prefetch on, which path a room takes depends on timing (tests/engine/runs/test_pd_faults.py
        assert set(s["resolve"]["by_source"]) <= {"sync"}  # forces the prefetched and prefix paths)
    assert_traces_pass(s["traces"])


def test_random_router_three_ranks_long_outputs_and_a_full_decode_batch(tmp_path):
    wc = WorkloadConfig(
        requests=20,
        prompt_len=(8, 200),
        hit=0.5,
        max_new_tokens=12,
        seed=11,
        arrival="poisson",
        rate=400,
    )
    cfg = EngineConfig(mode="ahead", max_batch_tokens=128)
    s = run_pd(
        RunSpec(
            cfg,
            wc,
            DecodeConfig(max_running=4),
            dp=3,
            router="random",
            trace_path=str(tmp_path / "t.jsonl"),
        )
    ).summary
    assert_clean(s)
    assert_tokens_match_reference(s, cfg, wc)
    assert_traces_pass(s["traces"])


def test_pdo_run_pd_cli_and_check(tmp_path):
    trace = tmp_path / "run.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "run",
            "--pd",
            "--dp",
            "2",
            "--mode",
            "thread",
            "--decode-mode",
            "normal",
            "--requests",
            "6",
            "--max-new-tokens",
            "4",
            "--trace",
            str(trace),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["mismatches"] == [] and len(s["traces"]) == 3
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "check", *s["traces"]],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0 and r.stdout.count("PASS") == 4, r.stdout[-2000:]


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--dp", "0"], "argument --dp: expected an integer in [1, 32], got '0'"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer in [1, "),
        (["--bootstrap-latency-ms", "-1"], "argument --bootstrap-latency-ms: expected a finite"),
    ],
)
def test_bad_pd_flags_are_one_line_errors(argv, reason):
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "--pd", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2 and reason in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_pdo_launch_processes_over_zmq_match_reference_and_traces_pass(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "launch",
            "--dp",
            "2",
            "--mode",
            "ahead",
            "--requests",
            "8",
            "--max-new-tokens",
            "6",
            "--trace-dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=170,
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    s = json.loads(r.stdout)
    assert_clean(s)
    assert sorted(Path(p).name for p in s["traces"]) == [
        "decode.jsonl",
        "prefill0.jsonl",
        "prefill1.jsonl",
    ]
    assert_traces_pass(s["traces"])
    # the streamed decode trace carries memory_waits in trace_end (its header went out first), so
    # the decode refinement judges it rather than UNKNOWN
    decode = next(p for p in s["traces"] if p.endswith("decode.jsonl"))
    lines = Path(decode).read_text().splitlines()
    assert "memory_waits" not in json.loads(lines[0])
    assert json.loads(lines[-1])["memory_waits"] == s["decode_memory_waits"]
    check = check_model(decode)
    assert check.ok and check.complete, refine_text(check)


def test_inproc_bootstrap_answers_like_http():
    """The in-process transport (used under the schedule controller) calls the HTTP server's own
    handlers: same status codes, bodies and client-side errors for the same requests."""
    from engine.bootstrap import client as bootstrap_client
    from engine.bootstrap.server import BootstrapServer
    from engine.runs.pd import rank_info

    def session(url):
        out = [
            bootstrap_client.health(url),
            bootstrap_client.get_prefill_info(url),
        ]  # 503 before any rank registered -> None
        for i in range(2):
            bootstrap_client.register_prefill_rank(url, rank_info(i, 2, 4, 100 + i), retries=0)
        bootstrap_client.register_dp_rank(url, 7, 1)
        out += [
            bootstrap_client.get_prefill_info(url),
            bootstrap_client.get_prefill_rank_info(url, dp_rank=1, tp_rank=0),
            bootstrap_client.get_prefill_rank_info(url, dp_rank=5, tp_rank=0),
            bootstrap_client.query_prefill_dp_ranks(url, [7, 8]),
        ]
        for bad in (
            lambda: bootstrap_client.register_dp_rank(url, 9, 3),
            lambda: bootstrap_client.register_prefill_rank(url, {"role": "x"}),
        ):
            with pytest.raises(bootstrap_client.BootstrapError) as e:
                bad()
            out.append((e.value.status, e.value.reason.split(": ", 1)[-1]))
        return out

    http = BootstrapServer(expected_ranks=2).start()
    try:
        over_http = session(http.url)
    finally:
        http.stop()
    inproc = BootstrapServer(expected_ranks=2).start_inproc("parity")
    try:
        assert inproc.url == "inproc://parity"
        in_process = session(inproc.url)
        inproc.set_faults(failure_rate=1.0, seed=1)
        with pytest.raises(bootstrap_client.BootstrapQueryError, match="HTTP 503"):
            bootstrap_client.query_prefill_dp_ranks(inproc.url, [7], retries=0)
        inproc.set_faults(failure_rate=0.0, latency_s=0.2, latency_scope="query_dp_ranks")
        with pytest.raises(bootstrap_client.BootstrapQueryError) as e:
            bootstrap_client.query_prefill_dp_ranks(inproc.url, [7], retries=0, timeout_s=0.05)
        assert e.value.unavailable and "no answer within 0.05 s" in str(e.value)
    finally:
        inproc.stop()
    assert over_http == in_process
    assert in_process[-2][0] == 400 and in_process[-1][0] == 400
    assert not bootstrap_client.health("inproc://parity")  # stopped: unreachable, as a closed port


def test_embedded_pd_over_the_inproc_bootstrap_matches_reference(tmp_path):
    cfg, wc = EngineConfig(mode="ahead"), WorkloadConfig(**WORKLOAD)
    s = run_pd(
        RunSpec(
            cfg, wc, DecodeConfig(), dp=2, trace_path=str(tmp_path / "t.jsonl"), bootstrap="inproc"
        )
    ).summary
    assert_clean(s)
    assert_tokens_match_reference(s, cfg, wc)
    rid = next(iter(s["outputs"]))
    s["outputs"][rid][-1] += 1  # a token past the first one wrong: named by position
    with pytest.raises(AssertionError, match=f"{rid} token {WORKLOAD['max_new_tokens'] - 1}:"):
        assert_tokens_match_reference(s, cfg, wc)
    assert_traces_pass(s["traces"])


def test_timeout_stops_and_closes_every_role(monkeypatch):
    """Past timeout_s the run fails with a PDError, and every loop is asked to stop and joined for a
    bounded time: each prefill rank's streams and transfer thread are closed, not left running."""
    import time

    import engine.runs.pd as pd_mod
    from engine.runs.pd import PDError

    made = []

    class Recorded(pd_mod.PrefillScheduler):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(pd_mod, "PrefillScheduler", Recorded)
    # Arrivals spread over ~2 s: at a 0.3 s timeout every prefill rank still waits for some.
    wc = WorkloadConfig(
        requests=20, prompt_len=(8, 30), max_new_tokens=4, arrival="poisson", rate=10, seed=1
    )
    t0 = time.monotonic()
    with pytest.raises(PDError, match="did not finish within"):
        run_pd(
            RunSpec(
                EngineConfig(mode="ahead"), wc, DecodeConfig(), dp=2, timeout_s=0.3, verify=False
            )
        )
    assert time.monotonic() - t0 < 0.3 + pd_mod.STOP_GRACE_S + 5
    assert len(made) == 2 and all(s.stopping for s in made)
    threads = [
        t
        for s in made
        for t in (
            s.sched_stream._thread,
            s.fwd_stream._thread,
            s.copy_stream._thread,
            s.transfer._thread,
        )
    ]
    assert not [t.name for t in threads if t.is_alive()]
