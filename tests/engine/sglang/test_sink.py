"""The adapter's trace sink writes format version 2: every trace ends with trace_end, whose reason is
how the traced scheduler loop ended (engine/sglang/sink.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from checker.linear import check_file
from engine.sglang.sink import VERSION, TraceSink


def _lines(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.fixture(autouse=True)
def _poll_hook_attached(monkeypatch):
    from engine.sglang import sink as trace_sink

    monkeypatch.setattr(trace_sink, "COMPLETIONS_OBSERVED", [True])


def _run(path, body):
    sink = TraceSink(str(path))
    sink.begin("prefill", "normal", 16)
    try:
        with sink.ends_with_loop():
            body(sink)
    finally:
        sink.close()
    return _lines(path)


def test_a_loop_that_returns_ends_normal(tmp_path):
    lines = _run(tmp_path / "t.jsonl", lambda s: s.emit("x.note"))
    assert lines[0]["version"] == VERSION == 2
    assert lines[-1]["ev"] == "trace_end"
    assert (lines[-1]["reason"], lines[-1]["events"]) == ("normal", 1)
    assert check_file(str(tmp_path / "t.jsonl")).complete


def test_a_loop_that_raises_ends_with_exception(tmp_path):
    def boom(sink):
        sink.emit("x.note")
        raise RuntimeError("scheduler crashed")

    with pytest.raises(RuntimeError):
        _run(tmp_path / "t.jsonl", boom)
    end = _lines(tmp_path / "t.jsonl")[-1]
    assert (end["ev"], end["reason"]) == ("trace_end", "exception")


def test_a_harness_leaving_a_loop_with_no_exit_ends_normal(tmp_path):
    """Before 0.5.21 SGLang's loops never return: the conformance harnesses leave them with
    LoopExit where a later release's loop returns, and the trace is whole (every rule judged)."""
    from engine.sglang.sink import LoopExit

    def leave(sink):
        sink.emit("x.note")
        raise LoopExit

    with pytest.raises(LoopExit):
        _run(tmp_path / "t.jsonl", leave)
    end = _lines(tmp_path / "t.jsonl")[-1]
    assert (end["ev"], end["reason"]) == ("trace_end", "normal")
    assert check_file(str(tmp_path / "t.jsonl")).complete


def test_a_process_that_exits_inside_the_loop_reads_as_truncated(tmp_path):
    path = tmp_path / "t.jsonl"
    sink = TraceSink(str(path))
    sink.begin("prefill", "normal", 16)
    sink.close("exit")  # what atexit runs when the process ends with the loop still running
    sink.close("exit")  # a second close writes nothing more
    lines = _lines(path)
    assert [e["ev"] for e in lines[1:]] == ["trace_end"] and lines[-1]["reason"] == "exit"
    assert not check_file(str(path)).complete


def test_a_prefill_trace_declares_version_1_without_the_poll_hook(tmp_path, monkeypatch):
    """An SGLang whose senders' polls the hooks cannot observe: no kv_delivered, so the trace stays
    version 1 (no trace_end), and P-release-after-delivery does not apply to it."""
    from engine.sglang import sink as trace_sink

    monkeypatch.setattr(trace_sink, "COMPLETIONS_OBSERVED", [False])
    lines = _run(tmp_path / "t.jsonl", lambda s: s.emit("x.note"))
    assert lines[0]["version"] == 1 and lines[-1]["ev"] == "x.note"
    monkeypatch.setattr(trace_sink, "COMPLETIONS_OBSERVED", [True])
    assert _run(tmp_path / "u.jsonl", lambda s: None)[0]["version"] == 2


# ---- the decode iteration marker at intake (releases before 0.5.21) ------------------------------
def _marked(tmp_path, monkeypatch, steps, prefetch_attached):
    """The iterations the adapter marks for a loop making `steps` (each 'prefetch' then 'intake',
    or 'intake' alone, with the engine paused or not), as in SGLang 0.5.13 to 0.5.20."""
    from engine.sglang import decode, hooks

    monkeypatch.setitem(
        hooks.attached, decode._PREFETCH, "attached" if prefetch_attached else "absent"
    )
    monkeypatch.setitem(hooks.attached, "Scheduler.process_input_requests", "attached")
    sched = SimpleNamespace(_engine_paused=False)
    queue = SimpleNamespace(scheduler=sched, pending_reqs=[], _prefill_dp_rank_queries={})
    path = tmp_path / "d.jsonl"
    with hooks.tracing(TraceSink(str(path))) as sink:
        sink.begin("decode", "normal", 16)
        with hooks.inside("decode_loop"):
            for step, paused_at_top, resumed in steps:
                sched._engine_paused = paused_at_top
                if step == "prefetch":
                    decode._prefetch(sink, lambda: None, queue, (), {})
                sched._engine_paused = paused_at_top and not resumed
                decode._intake_marker(sink, lambda: None, sched, (), {})
    return [e["ev"] for e in _lines(path) if e.get("ev") in ("iter_begin", "x.paused_iter")]


def test_every_intake_opens_an_iteration_without_the_prefetch(tmp_path, monkeypatch):
    """Before 0.5.19 each iteration calls process_input_requests once: every call is one iteration
    (not every other one)."""
    steps = [("intake", False, False)] * 4
    assert _marked(tmp_path, monkeypatch, steps, False) == ["iter_begin"] * 4


def test_an_iteration_the_prefetch_did_not_open_began_paused(tmp_path, monkeypatch):
    """0.5.19 and 0.5.20 call the prefetch first unless paused: an iteration opened at intake began
    paused, even when that iteration's intake resumes the engine."""
    steps = [
        ("prefetch", False, False),
        ("intake", True, False),
        ("intake", True, True),  # the resume arrives in this iteration
        ("prefetch", False, False),
    ]
    assert _marked(tmp_path, monkeypatch, steps, True) == [
        "iter_begin",
        "x.paused_iter",
        "x.paused_iter",
        "iter_begin",
    ]
