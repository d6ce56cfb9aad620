"""The engine against its own model (`pdo check --model`): every engine trace is a schedule of the
loop model of its mode, and a loop whose code drifts from the model is named at the step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from checker.fuzz.cases import Case
from checker.fuzz.runs import run_case
from checker.fuzz.strategies import make_strategy
from checker.refine import check_model
from engine.prefill import loops
from tests.helpers import run_mode
from tests.refinement import drift

MODES = ("normal", "overlap", "thread", "ahead")


@pytest.mark.parametrize("mode", MODES)
def test_engine_traces_refine_the_loop_model(mode, tmp_path):
    path = tmp_path / f"{mode}.jsonl"
    run_mode(mode, trace_path=str(path))
    check = check_model(str(path))
    assert check.ok, (check.answer.groups, check.answer.seqs, check.answer.reason)


def test_pd_traces_refine_the_loop_models(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "--pd", "--dp", "2", "--mode", "ahead"]
        + ["--requests", "4", "--trace", str(tmp_path / "pd.jsonl"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    traces = json.loads(out.stdout)["traces"]
    checks = [check_model(p) for p in traces]
    prefill = [c for c in checks if c.header["role"] == "prefill"]
    assert len(prefill) == 2 and all(c.ok for c in prefill)
    assert [c.ok for c in checks if c.header["role"] == "decode"] == [True]


def _war_barrier_after_processing(s):
    """The normal loop with two calls swapped: result processing before the WAR barrier."""
    while not s.finished_all:
        batch = loops._loop_top(s)
        if batch:
            result = s.run_batch(batch, sample_inline=True)
            s.process_batch_result(batch, result)
            s.apply_war_barrier(batch, result)
        s.process_inflight_queue()
        if not batch:
            s.idle_wait()


def test_a_reordered_loop_is_named_at_the_step(tmp_path, monkeypatch):
    monkeypatch.setitem(loops.LOOPS, "normal", _war_barrier_after_processing)
    path = tmp_path / "drift.jsonl"
    run_mode("normal", trace_path=str(path))
    check = check_model(str(path))
    assert check.judged and not check.ok
    named = {(check.events[s - 1]["ev"]) for s in check.answer.seqs}
    assert "E:program-order" in check.answer.groups
    assert "war_barrier" in named and named & {"process_begin", "process_end", "kv_send"}, named
    # the fixture `refined` (tests/conftest.py) of the loop tests flags this one too
    assert "DRIFT" in drift(str(path))


def test_pdo_check_model_exit_codes_and_json(tmp_path):
    good = tmp_path / "good.jsonl"
    run_mode("ahead", trace_path=str(good), inject=())
    bad = tmp_path / "bad.jsonl"
    run_mode("ahead", trace_path=str(bad), inject=("two-forwards",))

    def pdo(*args):
        argv = [sys.executable, "-m", "engine.cli", "check", "--model", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300)

    ok = pdo(str(good))
    assert ok.returncode == 0 and "REFINES" in ok.stdout, ok.stdout + ok.stderr
    drift = pdo("--json", str(bad))
    assert drift.returncode == 1
    (report,) = json.loads(drift.stdout)
    assert report["model"]["status"] == "unsat" and report["model"]["events"]


def test_the_fuzz_judge_flags_a_drifted_loop(monkeypatch):
    """Refinement is the fuzz loop's third judge: the swapped normal loop fails as `model ...`."""
    case = Case(mode="normal", requests=3)
    clean = run_case(case, make_strategy("pct", 0, steps=400), model=True)
    assert not any(f.startswith("model") for f in clean.failures), clean.failures
    monkeypatch.setitem(loops.LOOPS, "normal", _war_barrier_after_processing)
    drifted = run_case(case, make_strategy("pct", 0, steps=400), model=True)
    assert any(f.startswith("model E:program-order") for f in drifted.failures), drifted.failures


def test_a_trace_without_batches_is_not_judged(tmp_path):
    """A prefill rank that admitted nothing has nothing for the model to place: not judged, no
    error."""
    path = tmp_path / "idle.jsonl"
    header = {
        "format": "pdo-trace",
        "version": 1,
        "role": "prefill",
        "mode": "ahead",
        "page_size": 4,
    }
    event = {"seq": 1, "t_ns": 1, "thread": "scheduler", "ev": "alloc", "rid": "r0", "obj": "o1"}
    path.write_text(json.dumps(header) + "\n" + json.dumps({**event, "slot": 0}) + "\n")
    check = check_model(str(path))
    assert check.answer.status == "unknown" and not check.judged


def test_an_event_on_a_thread_the_model_lacks_is_not_judged(tmp_path):
    """A trace from another emitter, a loop event on a thread the loop model has no place for: not
    judged, with the event named, never an internal error."""
    path = tmp_path / "t.jsonl"
    run_mode("normal", trace_path=str(path))
    lines = path.read_text().splitlines()
    n = next(i for i, x in enumerate(lines) if '"ev":"fwd_begin"' in x)
    lines[n] = lines[n].replace('"thread":"scheduler"', '"thread":"worker-7"')
    assert "worker-7" in lines[n]
    path.write_text("\n".join(lines) + "\n")
    check = check_model(str(path))
    assert check.answer.status == "unknown" and not check.judged
    assert "fwd_begin on thread worker-7" in check.answer.reason
