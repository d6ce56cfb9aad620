"""Schedule fuzzing: the unmutated engine survives controlled schedules in every mode, prefill alone
and whole PD runs (prefill ranks + bootstrap + decode); every mutant, prefill and decode, is killed
within a small budget; schedules replay exactly; Hypothesis drives workload, faults and schedule.

Budgets are small for CI; PDO_FUZZ_BUDGET=N multiplies them for a longer campaign."""

import argparse
import json
import os
import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checker.fuzz import (
    PCT,
    Case,
    Indices,
    PDCase,
    RandomWalk,
    Replay,
    dfs_schedules,
    draw_pd_case,
    find_bug,
    load_case,
    pd_draws,
    run_case,
    shrink,
)
from checker.fuzz.cli import ALL_MUTANTS, mutant_row, register
from engine import sync
from engine.cli import main
from engine.runs.spec import WorkloadConfig
from engine.runtime.inject import DECODE_MUTANTS, MUTANT_RULES, MUTANTS
from tests.helpers import run_mode

SCALE = int(os.environ.get("PDO_FUZZ_BUDGET", "1"))
MODES = ("normal", "overlap", "thread", "ahead")


def _strip(events):
    return [{k: v for k, v in e.items() if k != "t_ns"} for e in events]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", ["pct", "random"])
def test_unmutated_engine_survives(mode, strategy):
    idx, out = find_bug(
        Case(mode=mode, requests=6, hit=0.8), strategy, schedules=6 * SCALE, seed=11
    )
    assert idx is None, out.failures


@pytest.mark.parametrize("strategy", ["pct", "random"])
def test_unmutated_pd_engine_survives(strategy):
    """Whole PD runs, a case drawn per schedule (loops, DP ranks, aborts, release, bootstrap faults)."""
    idx, out = find_bug(None, strategy, schedules=4 * SCALE, seed=21, draw=pd_draws(21))
    assert idx is None, (out.failures, out.case)


def test_the_registry_covers_prefill_and_decode_mutants():
    assert set(ALL_MUTANTS) == set(MUTANTS) | set(DECODE_MUTANTS) and len(ALL_MUTANTS) == 19


@pytest.mark.parametrize("mutant", sorted(MUTANTS) + sorted(DECODE_MUTANTS))
def test_every_mutant_is_killed(mutant):
    """Fails if any mutant, prefill or decode, survives its CI budget (50 schedules per seed)."""
    row = mutant_row(mutant, strategy="pct", seeds=range(3 * SCALE), budget=50)
    assert row["killed"], row
    assert row["schedules_to_kill"] < 50, row
    if mutant in DECODE_MUTANTS:  # caught by the decode rule named in its description
        assert row["killed_by"] == "rule " + DECODE_MUTANTS[mutant].rsplit("— ", 1)[1], row
    else:  # every kill flags a rule the mutant breaks (a wrong output alone would not show the rule works)
        rules = {f"rule {r}" for r in MUTANT_RULES[mutant]}
        for failures in row["failures"]:
            assert (
                rules & set(failures) if rules else any(not f.startswith("rule ") for f in failures)
            ), row


def test_replay_reproduces_trace_byte_for_byte():
    case = Case(mode="ahead", requests=5, hit=0.8)
    first = run_case(case, PCT(3))
    again = run_case(case, PCT(3))
    replay = run_case(case, Replay(first.schedule))
    assert first.schedule == again.schedule == replay.schedule
    assert _strip(first.trace) == _strip(again.trace) == _strip(replay.trace)
    other = run_case(case, RandomWalk(4))
    assert other.schedule != first.schedule  # the strategy really changes the interleaving


def test_pd_replay_reproduces_traces_byte_for_byte(tmp_path):
    """Same PD case, same seed: same schedule, and every trace file (decode, each prefill rank) the
    same byte for byte except t_ns; replaying the recorded schedule gives them again."""
    case = draw_pd_case(
        random.Random(5), dp=2, unserved=1, aborts=((3, 0),), latency_ms=0.5, failure_rate=0.3
    )

    def files(tag, strategy):
        out = run_case(case, strategy, trace_path=str(tmp_path / f"{tag}.jsonl"))
        texts = []
        for role in ("decode", "prefill0", "prefill1"):
            lines = (tmp_path / f"{tag}.{role}.jsonl").read_text().splitlines()
            texts.append(
                [lines[0]]
                + [
                    json.dumps({k: v for k, v in json.loads(x).items() if k != "t_ns"})
                    for x in lines[1:]
                ]
            )
        return out, texts

    first, a = files("a", PCT(7, steps=1000))
    again, b = files("b", PCT(7, steps=1000))
    replay, c = files("c", Replay(first.schedule))
    assert not first.failed, first.failures
    assert first.schedule == again.schedule == replay.schedule
    assert a == b == c
    assert {n.split("/")[0] for n in first.schedule} >= {"decode", "prefill0", "prefill1"}
    assert any(
        n.startswith("decode/prefetch_") for n in first.schedule
    )  # the bootstrap queries' threads
    assert any(n.endswith("/transfer") for n in first.schedule)  # the KV transfer threads
    other = run_case(case, RandomWalk(8))
    assert other.schedule != first.schedule


_DIGEST = """
import hashlib, json, random, sys
from checker.fuzz import PCT, draw_pd_case, run_case
out = run_case(draw_pd_case(random.Random(9), dp=2, aborts=((2, 0),)), PCT(9, steps=1000))
blob = json.dumps([out.schedule, [{k: v for k, v in e.items() if k != "t_ns"} for e in out.trace]], sort_keys=True)
print(hashlib.sha1(blob.encode()).hexdigest(), len(out.schedule), out.failures)
"""


def test_pd_schedule_and_trace_are_the_same_in_another_process():
    """A saved PD case replays anywhere: another interpreter with another hash seed gives the same
    schedule and traces (nothing depends on set order, object ids or the wall clock)."""
    env = {**os.environ, "PYTHONHASHSEED": "1"}
    a = subprocess.run(
        [sys.executable, "-c", _DIGEST], capture_output=True, text=True, env=env, timeout=300
    )
    env["PYTHONHASHSEED"] = "2"
    b = subprocess.run(
        [sys.executable, "-c", _DIGEST], capture_output=True, text=True, env=env, timeout=300
    )
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    assert a.stdout == b.stdout and a.stdout.strip().endswith("[]"), (a.stdout, b.stdout)


def test_pd_shrink_keeps_the_rule():
    idx, out = find_bug(
        None, "pct", schedules=10, seed=0, draw=pd_draws(0, inject=("prefetch-before-published",))
    )
    assert idx is not None
    small, sched, small_out = shrink(out.case, out.schedule, out.failures, budget=8)
    assert small_out.failures[0] == out.failures[0] == "rule D-published-first"
    assert small.requests <= out.case.requests


def test_dfs_finds_a_race_on_a_tiny_workload():
    case = Case(mode="ahead", inject=("no-war-barrier",), requests=2, hit=0.0, prompt_len=(8, 16))
    found = [
        out for _, out in dfs_schedules(case, preemption_bound=2, limit=60 * SCALE) if out.failed
    ]
    assert found, "bounded DFS should reach the WAR race"


@settings(max_examples=6 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    mode=st.sampled_from(MODES),
    requests=st.integers(1, 5),
    hit=st.sampled_from([0.0, 0.5, 0.8]),
    page_size=st.sampled_from([1, 4, 8]),
    wseed=st.integers(0, 1000),
    choices=st.lists(st.integers(0, 7), max_size=300),
)
def test_hypothesis_drives_workload_and_schedule(mode, requests, hit, page_size, wseed, choices):
    case = Case(
        mode=mode,
        requests=requests,
        hit=hit,
        page_size=page_size,
        chunk_size=4 * page_size,
        max_batch_tokens=6 * page_size,
        workload_seed=wseed,
    )
    out = run_case(case, Indices(choices))
    assert not out.failed, out.failures


@st.composite
def pd_cases(draw):
    """A whole PD case: workload, loops, DP ranks, decode knobs, client aborts, memory release,
    bootstrap latency and failures."""
    ps = draw(st.sampled_from([1, 4, 8]))
    return PDCase(
        mode=draw(st.sampled_from(MODES)),
        decode_loop=draw(st.sampled_from(["normal", "overlap"])),
        prefetch=draw(st.booleans()),
        dp=draw(st.integers(1, 3)),
        requests=draw(st.integers(1, 5)),
        prompt_len=(8, draw(st.sampled_from([16, 40]))),
        hit=draw(st.sampled_from([0.0, 0.5, 0.8])),
        max_new_tokens=draw(st.integers(1, 4)),
        page_size=ps,
        chunk_size=4 * ps,
        max_batch_tokens=6 * ps,
        workload_seed=draw(st.integers(0, 1000)),
        arrival=draw(st.sampled_from(["burst", "poisson"])),
        polling_interval=draw(st.integers(1, 3)),
        decode_slots=draw(st.sampled_from([1, 2, 64])),
        unserved=draw(st.integers(0, 2)),
        aborts=tuple(draw(st.lists(st.tuples(st.integers(1, 10), st.integers(-1, 3)), max_size=3))),
        release=draw(st.one_of(st.just(()), st.tuples(st.integers(1, 4), st.integers(1, 4)))),
        latency_ms=draw(st.sampled_from([0.0, 0.5, 3.0, 30.0])),
        latency_scope=draw(st.sampled_from(["query_dp_ranks", "all"])),
        failure_rate=draw(st.sampled_from([0.0, 0.3, 0.7])),
        fault_seed=draw(st.integers(0, 100)),
        prefill_delay_ms=draw(st.sampled_from([0.0, 1.0])),
    )


@settings(max_examples=5 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=pd_cases(), choices=st.lists(st.integers(0, 7), max_size=600))
def test_hypothesis_drives_the_whole_pd_case(case, choices):
    out = run_case(case, Indices(choices))
    assert not out.failed, out.failures


def test_uncontrolled_jitter_keeps_the_engine_correct():
    """The cheap mode for GPUs: random delays at schedule points, no controller."""
    sync.set_jitter(300, seed=5)
    try:
        run, _ = run_mode(
            "ahead", workload=WorkloadConfig(requests=8, prompt_len=(20, 90), hit=0.8, seed=4)
        )
    finally:
        sync.set_jitter(0)
    assert (
        run.error is None
        and run.summary["finished"] == 8
        and not any(run.summary["leaks"].values())
    )


def test_pdo_fuzz_cli_lists_decode_mutants_and_fuzzes_pd(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def run(*argv):
        a = parser.parse_args(["fuzz", *argv])
        return a.fn(a), capsys.readouterr()

    rc, out = run("--list-mutants")
    assert (
        rc == 0
        and len(out.out.splitlines()) == 19
        and "no-stale-cancel" in out.out
        and "decode" in out.out
    )
    rc, out = run("--pd", "--schedules", "2", "--seed", "3", "--out", str(tmp_path))
    assert rc == 0 and "PD cases" in out.out and "no violation" in out.out, out
    with pytest.raises(SystemExit) as exit_:  # refused as it is parsed: --inject's domain
        run("--inject", "no-such-mutant")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--inject" in err and "'no-such-mutant'" in err


@pytest.mark.parametrize("mutant", ["two-forwards", "prefetch-before-published"])
def test_pdo_fuzz_replay_reproduces_a_saved_failing_case(tmp_path, capsys, mutant):
    """`pdo fuzz` saves the failing case (and its shrunk form); `pdo fuzz --replay FILE` reproduces the
    same failures, in the same order, and exits 1; without the mutant the same case passes."""
    out = tmp_path / "out"
    assert (
        main(
            [
                "fuzz",
                "--inject",
                mutant,
                "--schedules",
                "20",
                "--seed",
                "0",
                "--requests",
                "3",
                "--out",
                str(out),
            ]
        )
        == 1
    )
    capsys.readouterr()
    files = sorted(out.glob("*.case.json")) + sorted(out.glob("*.shrunk.json"))
    assert len(files) == 2, files
    for f in files:
        saved = json.loads(f.read_text())
        assert saved["case"]["inject"] == [mutant] and saved["failures"], saved["failures"]
        trace = tmp_path / f"{f.stem}.jsonl"
        assert main(["fuzz", "--replay", str(f), "--trace", str(trace)]) == 1
        text = capsys.readouterr().out
        assert text.startswith(f"replayed {f}: ")
        assert [
            ln.strip()[len("FAIL ") :] for ln in text.splitlines() if ln.strip().startswith("FAIL ")
        ] == saved["failures"]
        traces = (
            [str(trace)]
            if saved["case"].get("kind") != "pd"
            else [str(p) for p in sorted(tmp_path.glob(f"{f.stem}.*.jsonl"))]
        )
        assert (
            traces and main(["check", *traces]) == 1
        )  # the replayed trace shows the violation too
        capsys.readouterr()
    clean = json.loads(files[1].read_text())
    clean["case"]["inject"] = []
    path = tmp_path / "clean.json"
    path.write_text(json.dumps(clean))
    # the replay is strict: without the mutant the threads may differ at some step (diverged, no
    # verdict); run past that step non-preemptively, the case passes
    rc = main(["fuzz", "--replay", str(path)])
    text = capsys.readouterr().out
    assert (rc, "no failure" in text) == (0, True) or (rc, "DIVERGED" in text) == (3, True), text
    case, schedule, _ = load_case(str(path))
    assert not run_case(case, Replay(schedule, strict=False)).failures
