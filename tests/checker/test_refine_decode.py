"""Decode traces against the decode loop model (`pdo check --model`, spec/z3model/decode_traces.py):
default PD runs refine it, a decode loop with two calls swapped is named at the step, a decode
mutant the model cannot admit drifts, and what the model leaves out is not judged."""

from __future__ import annotations

import json

import pytest

from checker.fuzz.cases import PDCase
from checker.fuzz.runs import run_case
from checker.fuzz.strategies import make_strategy
from checker.linear import check_file
from checker.refine import check_model, json_report, text
from engine.decode import loops
from engine.decode.config import DecodeConfig
from engine.runs.pd import run_pd
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from tests.refinement import drift

WORKLOAD = dict(requests=6, prompt_len=(16, 64), max_new_tokens=4, seed=7)


def _decode_trace(tmp_path, *, dp=2, inject=(), requests=6, **dc) -> str:
    tmp_path.mkdir(exist_ok=True)
    s = run_pd(
        RunSpec(
            EngineConfig(mode="ahead", inject=frozenset(inject)),
            WorkloadConfig(**{**WORKLOAD, "requests": requests}),
            DecodeConfig(**dc),
            dp=dp,
            trace_path=str(tmp_path / "t.jsonl"),
        )
    ).summary
    assert s["finished"] == s["requests"], s["aborted"]
    return next(p for p in s["traces"] if p.endswith(".decode.jsonl"))


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("dp", [1, 2])
def test_default_pd_decode_traces_refine_the_decode_model(tmp_path, dp, prefetch):
    check = check_model(_decode_trace(tmp_path, dp=dp, prefetch=prefetch))
    assert check.ok, text(check)
    assert "REFINES" in text(check) and json_report(check)["status"] == "sat"


def _intake_before_prefetch(s):
    """The normal decode loop with two calls of its top swapped: intake before the prefetch."""
    while not s.finished_all:
        s.iter_begin()
        s.ingest_requests()
        s.prefetch()
        s.process_decode_queue()
        batch = None if s.stopping else s.get_next_batch()
        if batch:
            result = s.run_batch(batch, sample_inline=True)
            s.apply_war_barrier(batch, result)
            s.process_batch_result(batch, result)
        else:
            s.idle_wait()


def test_a_reordered_decode_loop_is_named_at_the_step(tmp_path, monkeypatch):
    monkeypatch.setitem(loops.LOOPS, "normal", _intake_before_prefetch)
    path = _decode_trace(tmp_path, dp=1, loop="normal")
    check = check_model(path)
    assert check.judged and not check.ok, text(check)
    named = {check.events[s - 1]["ev"] for s in check.answer.seqs}
    assert "E:order" in check.answer.groups, check.answer.groups
    assert named and named <= {"req_add", "prefetch_begin", "prefetch_end"}, named
    assert "DRIFT" in drift(path)  # the suite's own refinement (tests/conftest.py) flags it too


MUTANT_RUNS = {
    # mutant: (the rule that sees it reached, decode config that reaches it)
    # a second query while the first is outstanding (the polling interval leaves it unconsumed;
    # whether a room is still unknown then depends on the run's timing)
    "double-prefetch": ("D-one-query-per-addr", dict(polling_interval=2)),
    # rooms whose rank is known asked again (requests waiting for memory keep them pending)
    "query-every-iteration": ("D-unknown-rooms-only", dict(num_pages=12, requests=10)),
}


@pytest.mark.parametrize("mutant", sorted(MUTANT_RUNS))
def test_a_decode_mutant_the_model_cannot_admit_drifts(tmp_path, mutant):
    rule, dc = MUTANT_RUNS[mutant]
    clean = check_model(_decode_trace(tmp_path / "clean", **dc))
    assert clean.ok, text(clean)
    path = _decode_trace(tmp_path / "bad", inject=(mutant,), **dc)
    if rule not in {v.rule.id for v in check_file(path).violations}:
        pytest.skip(f"{mutant} not reached in this run")
    check = check_model(path)
    assert check.judged and not check.ok, text(check)
    assert "E:loop" in check.answer.groups, text(check)
    assert "prefetch_submit" in {check.events[s - 1]["ev"] for s in check.answer.seqs}


def _write(path, header, events):
    path.write_text("\n".join(json.dumps(x) for x in [header, *events]) + "\n")


def test_what_the_decode_model_leaves_out_is_not_judged(tmp_path):
    """A pending request aborted by a timeout, a trace without memory_waits: UNKNOWN with the
    reason, never DRIFT."""
    header = {"format": "pdo-trace", "version": 2, "role": "decode", "mode": "normal"}
    header["page_size"] = 16
    top = [
        {"seq": 1, "t_ns": 1, "thread": "scheduler", "ev": "iter_begin", "iter": 1},
        {"seq": 2, "t_ns": 2, "thread": "scheduler", "ev": "req_add", "rid": "r0", "room": 7}
        | {"addr": "a:1"},
    ]
    abort = {"seq": 3, "t_ns": 3, "thread": "scheduler", "ev": "req_abort", "rid": "r0"}
    abort["reason"] = "room 7 still unknown to the bootstrap server after 30 s"
    cases = {
        "memory_waits": ({**header}, top),
        "pending request": ({**header, "memory_waits": 0}, top + [abort | {"room": 7}]),
    }
    for i, (why, (h, evs)) in enumerate(cases.items()):
        path = tmp_path / f"{i}.jsonl"
        _write(path, h, evs)
        check = check_model(str(path))
        assert check.answer.status == "unknown" and why in check.answer.reason, text(check)
        assert "UNKNOWN" in text(check) and not check.judged


def test_the_fuzz_judge_judges_the_decode_trace(monkeypatch):
    """The fuzz loop's third judge on a PD case: the decode trace is refined too, and the swapped
    decode loop fails as `model E:...`."""
    case = PDCase(mode="ahead", decode_loop="normal", requests=3, dp=1)
    clean = run_case(case, make_strategy("pct", 0, steps=400), model=True)
    assert not any(f.startswith("model") for f in clean.failures), clean.failures
    monkeypatch.setitem(loops.LOOPS, "normal", _intake_before_prefetch)
    drifted = run_case(case, make_strategy("pct", 0, steps=400), model=True)
    assert any(f.startswith("model E:order") for f in drifted.failures), drifted.failures
