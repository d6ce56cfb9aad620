"""The adapter's trace sink writes format version 2: every trace ends with trace_end, whose reason is
how the traced scheduler loop ended (engine/sglang/sink.py)."""

from __future__ import annotations

import json

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


def test_a_process_that_exits_inside_the_loop_reads_as_truncated(tmp_path):
    path = tmp_path / "t.jsonl"
    sink = TraceSink(str(path))
    sink.begin("prefill", "normal", 16)
    sink._at_exit()  # what atexit runs when the process ends with the loop still running
    sink._at_exit()  # a second close writes nothing more
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
