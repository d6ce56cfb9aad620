"""SGLang 0.5.23's real decode code under the adapter: every scenario meets its expectation, the
real-code mutants are flagged, and the hooks change nothing SGLang does."""

from __future__ import annotations

import json
import types

import pytest

sglang_adapter = pytest.importorskip("engine.sglang")
try:
    sglang_adapter.check_version()
except sglang_adapter.SGLangUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)

from engine.sglang import decode, hooks, prefill  # noqa: E402
from engine.sglang.conform import decode_context, decode_scenarios, driver, mutants  # noqa: E402

# Unreachable in 0.5.23's loop order, so no scenario can show them (docs/sglang.md, "Mutants"): the
# consumption point pops the prefetched entry of every address that still has pending requests, and
# a request leaves the pending list only there, so no entry outlives its address's requests; and the
# pending list holds only rooms whose rank is unknown. SGLang's only caller of the memory release
# asserts an idle scheduler, whose prealloc queue (holding every pending request) is empty, so no
# query is in flight to cancel.
UNREACHABLE = {"no-stale-cancel", "query-every-iteration", "no-cancel-on-release"}
# the mutants of the lifecycle matrix: tests/engine/sglang/test_lifecycle_matrix.py
SCRIPTED_MUTANTS = sorted(
    name
    for name, m in mutants.DECODE_MUTANTS.items()
    if all(s.split("/")[0] in decode_scenarios.SCRIPTS for s in m.scenarios)
)


@pytest.fixture(scope="module")
def sgl():
    return driver.session()


@pytest.fixture(scope="module")
def scenario_runs(sgl):
    return dict(decode_scenarios.scenarios(sgl))


def test_every_scenario_runs_in_both_loops(scenario_runs):
    names = set(scenario_runs)
    for base in decode_scenarios.SCRIPTS:
        assert {f"{base}/normal", f"{base}/overlap"} <= names


@pytest.mark.parametrize("name", list(decode_scenarios.SCRIPTS))
def test_scenario_meets_its_expectation(sgl, scenario_runs, tmp_path, name):
    for mode in ("normal", "overlap"):
        result = driver.run_scenario(
            sgl, f"{name}/{mode}", scenario_runs[f"{name}/{mode}"], str(tmp_path)
        )
        assert result["error"] is None
        assert driver.met(result), result
        assert (
            "sglang.srt.disaggregation.decode.DecodePreallocQueue.prefetch_prefill_dp_rank_queries"
            in result["sglang_functions"]
        )
        assert (
            f"sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.event_loop_{mode}_disagg_decode"
            in result["sglang_functions"]
        )


def test_release_waits_for_sglangs_idleness_assertion(sgl, scenario_runs, tmp_path):
    """Finding 1 retracted: the release goes through SGLang's own caller, after every pending
    request ended (the client waits for the idle server the caller asserts)."""
    result = driver.run_scenario(
        sgl,
        "decode-release-pending/normal",
        scenario_runs["decode-release-pending/normal"],
        str(tmp_path),
    )
    assert result["outcome"] == "conforms" and not driver.findings(result["scenario"], sgl.version)
    events = [json.loads(line) for line in open(result["trace"])][1:]
    kinds = [e["ev"] for e in events]
    assert kinds.count("req_done") == 2 and kinds.count("release_memory") == 1
    last_done = max(i for i, k in enumerate(kinds) if k == "req_done")
    assert kinds.index("release_memory") > last_done


def test_sglang_refuses_release_with_a_request_pending(sgl):
    """Why finding 1 is retracted: with a request waiting for its DP rank (in `pending_reqs`, and
    so in `queue`), SGLang's is_fully_idle says busy and its weight updater's release asserts."""
    from sglang.srt.managers import io_struct

    harness = decode_scenarios.Harness(sgl, decode_scenarios.Script({}), "normal")
    try:
        with decode_context.published(decode_scenarios.PAGE_SIZE):
            decode_req = types.SimpleNamespace(req=harness._req("r1", 1, harness.servers[0]))
            harness.queue.queue.append(decode_req)
            harness.queue.pending_reqs.append(decode_req)
            assert not harness.sched.is_fully_idle()
            with pytest.raises(AssertionError, match="only when server is idle"):
                harness._weight_updater().release_memory_occupation(
                    io_struct.ReleaseMemoryOccupationReqInput(tags=["kv_cache"])
                )
            harness.queue.queue.clear()
            harness.queue.pending_reqs.clear()
            assert harness.sched.is_fully_idle()
    finally:
        for server in harness.servers:
            server.stop()


def test_a_direct_call_no_caller_could_make_is_an_error(sgl, scenario_runs, tmp_path):
    """An abort of a request no longer queued: SGLang's abort path could not abort it there."""
    script = decode_scenarios.Script(
        {
            1: decode_scenarios.Step(arrive=[("r100", 100, 0)], register=[(100, 0)]),
            6: decode_scenarios.Step(abort=["r100"]),
        }
    )
    result = driver.run_scenario(
        sgl,
        "decode-late-abort/normal",
        decode_scenarios._runner(sgl, script, "normal"),
        str(tmp_path),
    )
    assert result["outcome"] == "error" and "Unreachable" in result["error"]


@pytest.mark.parametrize("name", SCRIPTED_MUTANTS)
def test_real_code_mutant(sgl, scenario_runs, tmp_path, name):
    mutant = mutants.DECODE_MUTANTS[name]
    outcomes = [
        driver.run_scenario(sgl, s, scenario_runs[s], str(tmp_path), mutant)["outcome"]
        for s in mutant.scenarios
    ]
    if name in UNREACHABLE:
        assert outcomes == ["missed"] * len(outcomes)  # if this fails, a scenario can show it now
    else:
        assert "flagged" in outcomes


def test_prefetch_mode_queries_over_the_wire(sgl, scenario_runs, tmp_path):
    result = driver.run_scenario(
        sgl, "decode-arrivals/overlap", scenario_runs["decode-arrivals/overlap"], str(tmp_path)
    )
    events = [json.loads(line) for line in open(result["trace"])][1:]
    sources = {e["source"] for e in events if e["ev"] == "resolve"}
    assert {"sync", "prefetched", "prefix"} <= sources
    pool = {e["thread"] for e in events if e["ev"] == "query_begin" and e["source"] == "prefetch"}
    assert pool and "scheduler" not in pool


def _observed_run(sgl, script, mode, path):
    """What SGLang did, seen from outside the adapter: the order in which receivers were initialised,
    their ranks, and the requests the bootstrap server received per endpoint. Not the iteration of each
    init: a prefetched query races with the prefill registering its room during intake (the real
    race the prefetch has), so whether it answers one iteration earlier depends on thread timing."""
    harness = decode_scenarios.Harness(sgl, script, mode)
    server = harness.servers[0]._impl
    harness.run(str(path))
    ranks = {d.req.rid: d.kv_receiver.rank for d in harness.queue.pending_reqs}
    order = [rid for rid, _ in sorted(harness.initialised.items(), key=lambda kv: (kv[1], kv[0]))]
    counts = dict(server.counters)
    counts.pop("query_dp_ranks")  # the same race: an early answer can save the next query
    return order, ranks, counts


def test_hooks_change_nothing_sglang_does(sgl, tmp_path):
    script = decode_scenarios.SCRIPTS["decode-arrivals"]
    with_hooks = _observed_run(sgl, script, "normal", tmp_path / "on.jsonl")
    assert hooks.is_installed()
    hooks.uninstall()
    try:
        without = _observed_run(sgl, script, "normal", tmp_path / "off.jsonl")
    finally:
        decode.install(sgl)
        prefill.install(sgl)
    assert with_hooks[0] and with_hooks == without
    assert not (tmp_path / "off.jsonl").exists()


def test_cancels_record_what_future_cancel_returned(sgl, tmp_path):
    """The adapter logs each cancel of a prefetched future after SGLang's real Future.cancel(), with
    its result (`stopped`): a query the pool thread has taken runs on (False), a queued one never
    runs (True). No scenario cancels any more (SGLang releases only at an idle scheduler, where no
    query is in flight), so two futures of a real pool are registered as the proxy registers them."""
    import concurrent.futures
    import threading

    from engine.sglang import decode as decode_hooks
    from engine.sglang.sink import TraceSink

    started, gate = threading.Event(), threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    running = pool.submit(lambda: (started.set(), gate.wait(10)))
    queued = pool.submit(lambda: None)
    assert started.wait(10)
    for qid, future in ((900, running), (901, queued)):
        decode_hooks._futures[id(future)] = {
            "future": future, "addr": "127.0.0.1:1", "rooms": [qid], "qid": qid,
            "t_submit": 0, "t_end": None,
        }  # fmt: skip
    path = tmp_path / "cancels.jsonl"
    sink = TraceSink(str(path))
    sink.begin("decode", "normal", 16)
    try:
        with hooks.tracing(sink):
            assert running.cancel() is False and queued.cancel() is True
    finally:
        gate.set()
        pool.shutdown()
    events = [json.loads(line) for line in open(path)][1:]
    cancels = [(e["qid"], e["stopped"]) for e in events if e["ev"] == "prefetch_cancel"]
    assert cancels == [(900, False), (901, True)]


def test_predict_reads_fuzzed_traces_and_needs_their_edges(sgl, tmp_path):
    """The adapter logs the prefetch executor's hand-offs (a query's submit before it runs, its end
    before its result is taken): on schedules where the queries run on the pool's threads,
    `pdo check --predict` reads every trace and predicts nothing against SGLang's real code.
    Without those edges the same schedules' clocks leave a query's end unordered with its
    consumption, and the analysis predicts violations no run can show."""
    from checker import predict

    name = "decode-arrivals/overlap"

    def predicted(folder):
        out, run = [], dict(decode_scenarios.scenarios(sgl))[name]
        for seed in (None, 0, 1, 2):  # the real pool, then three fuzzed schedules
            r = driver.run_scenario(sgl, name, run, str(folder), fuzz_seed=seed)
            assert r["error"] is None and driver.met(r), (r["outcome"], r["rules"])
            out.append(predict.predict_file(r["trace"]))
        return out

    with_edges = predicted(tmp_path)
    assert all(r.header.get("hb") for r in with_edges)
    assert any(r.candidates for r in with_edges)  # the pool's events are concurrent with some
    assert all(r.ok for r in with_edges), [p.message for r in with_edges for p in r.predictions]
    no_edges = types.SimpleNamespace(snapshot=object, send=lambda _: None, recv=lambda _: None)
    (tmp_path / "cut").mkdir()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(decode, "hb", no_edges)
        assert any(not r.ok for r in predicted(tmp_path / "cut"))
