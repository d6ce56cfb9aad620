"""Schedule fuzzing: the unmutated engine survives controlled schedules in every mode; every mutant
is killed within a small budget; schedules replay exactly; Hypothesis drives workload and schedule.

Budgets are small for CI; PDO_FUZZ_BUDGET=N multiplies them for a longer campaign."""
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checker.fuzz import PCT, Case, Indices, RandomWalk, Replay, dfs_schedules, find_bug, run_case
from checker.fuzz_cli import mutant_row
from engine.inject import MUTANTS

SCALE = int(os.environ.get("PDO_FUZZ_BUDGET", "1"))
MODES = ("normal", "overlap", "thread", "ahead")


def _strip(events):
    return [{k: v for k, v in e.items() if k != "t_ns"} for e in events]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", ["pct", "random"])
def test_unmutated_engine_survives(mode, strategy):
    idx, out = find_bug(Case(mode=mode, requests=6, hit=0.8), strategy, schedules=6 * SCALE, seed=11)
    assert idx is None, out.failures


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_every_mutant_is_killed(mutant):
    row = mutant_row(mutant, strategy="pct", seeds=range(3 * SCALE), budget=50)
    assert row["killed"], row
    assert row["schedules_to_kill"] < 50, row


def test_replay_reproduces_trace_byte_for_byte():
    case = Case(mode="ahead", requests=5, hit=0.8)
    first = run_case(case, PCT(3))
    again = run_case(case, PCT(3))
    replay = run_case(case, Replay(first.schedule))
    assert first.schedule == again.schedule == replay.schedule
    assert _strip(first.trace) == _strip(again.trace) == _strip(replay.trace)
    other = run_case(case, RandomWalk(4))
    assert other.schedule != first.schedule  # the strategy really changes the interleaving


def test_dfs_finds_a_race_on_a_tiny_workload():
    case = Case(mode="ahead", inject=("no-war-barrier",), requests=2, hit=0.0, prompt_len=(8, 16))
    found = [out for _, out in dfs_schedules(case, preemption_bound=2, limit=60 * SCALE) if out.failed]
    assert found, "bounded DFS should reach the WAR race"


@settings(max_examples=6 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(mode=st.sampled_from(MODES), requests=st.integers(1, 5), hit=st.sampled_from([0.0, 0.5, 0.8]),
       page_size=st.sampled_from([1, 4, 8]), wseed=st.integers(0, 1000),
       choices=st.lists(st.integers(0, 7), max_size=300))
def test_hypothesis_drives_workload_and_schedule(mode, requests, hit, page_size, wseed, choices):
    case = Case(mode=mode, requests=requests, hit=hit, page_size=page_size, chunk_size=4 * page_size,
                max_batch_tokens=6 * page_size, workload_seed=wseed)
    out = run_case(case, Indices(choices))
    assert not out.failed, out.failures


def test_uncontrolled_jitter_keeps_the_engine_correct():
    """The cheap mode for GPUs: random delays at schedule points, no controller."""
    from engine import sync
    from tests.helpers import run_mode
    from engine.workload import WorkloadConfig

    sync.set_jitter(300, seed=5)
    try:
        summary, _ = run_mode("ahead", workload=WorkloadConfig(requests=8, prompt_len=(20, 90), hit=0.8, seed=4))
    finally:
        sync.set_jitter(0)
    assert summary["_error"] is None and summary["finished"] == 8 and not any(summary["leaks"].values())
