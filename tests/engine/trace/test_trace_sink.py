"""The trace sink (engine/trace/sink.py): the helper process that writes a streamed trace's lines
writes what the whole-trace writer writes, refuses an object outside `obj`, outlives the engine's
death, and keeps out of the engine's way."""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

from engine.trace import writer as trace_writer
from engine.trace.tracer import Tracer

ROOT = Path(__file__).resolve().parents[3]


class Colour(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class Name(str):
    pass


Pair = namedtuple("Pair", "a b")


class Req:
    pass


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()[1:-1]]


def test_streamed_values_are_written_as_the_whole_trace_writer_writes_them(tmp_path):
    """Subclasses, enums, tuples and object identities: the streamed file and `write` agree."""
    tr = Tracer({"role": "prefill"})
    tr.stream(str(tmp_path / "s.jsonl"))
    log = tr.events_for(admit=("rid", "obj", "pages", "level", "colour"))
    a, b = Req(), Req()
    log.admit(Name("r1"), a, Pair(1, 2), Level.HIGH, Colour.RED)
    log.admit("r2", b, (3,), 1, None)
    tr.emit("submit", obj=a, batch=0, extra={"k": [1, 2]})
    tr.close()
    tr.write(str(tmp_path / "w.jsonl"))
    streamed, whole = _events(tmp_path / "s.jsonl"), _events(tmp_path / "w.jsonl")
    assert streamed == whole
    assert streamed[0] | {"rid": "r1", "obj": "o1", "pages": [1, 2], "level": 3} == streamed[0]
    assert streamed[0]["colour"] == "red" and streamed[1]["obj"] == "o2"
    assert streamed[2]["obj"] == "o1" and streamed[2]["extra"] == {"k": [1, 2]}


def test_passes_that_share_a_memo_and_start_new_ones_write_the_whole_trace(tmp_path, monkeypatch):
    """A stream's passes share one pickler's memo (a kind, a thread, an identity reduced once), and
    a new memo starts every MEMO_EVENTS events: what a later pass names by memo index, the sink
    still writes in full, across both kinds of frames."""
    monkeypatch.setattr(trace_writer, "MEMO_EVENTS", 3)
    frames = []
    send = trace_writer._Sink.send
    monkeypatch.setattr(
        trace_writer._Sink, "send", lambda s, op, *a: (frames.append(op), send(s, op, *a))[1]
    )
    tr = Tracer({"role": "prefill"})
    tr.stream(str(tmp_path / "s.jsonl"))
    log = tr.events_for(admit=("rid", "obj", "pages"))
    reqs = [Req(), Req()]
    for i in range(8):  # one pass per event: later passes meet the same kind, thread and objects
        log.admit(f"r{i % 2}", reqs[i % 2], i)
        tr.emit("submit", obj=reqs[0], batch=i)
        tr.flush()
    tr.close()
    tr.write(str(tmp_path / "w.jsonl"))
    streamed, whole = _events(tmp_path / "s.jsonl"), _events(tmp_path / "w.jsonl")
    assert streamed == whole and len(streamed) == 16
    assert [e["obj"] for e in streamed[:4]] == ["o1", "o1", "o2", "o1"]
    from engine.trace import sink as trace_sink

    events = [op for op in frames if op in (trace_sink.EVENTS, trace_sink.EVENTS_NEW)]
    assert events.count(trace_sink.EVENTS_NEW) >= 4 and events.count(trace_sink.EVENTS) >= 4
    assert events[0] == trace_sink.EVENTS_NEW


def test_an_object_outside_obj_is_an_internal_error_naming_the_event(tmp_path):
    tr = Tracer({"role": "prefill"})
    tr.stream(str(tmp_path / "t.jsonl"))
    log = tr.events_for(stage=("batch",))
    log.stage(0)
    log.stage(Req())  # an engine bug: an object logged where a value belongs
    with pytest.raises(trace_writer.SinkError, match=r"internal error: .*event 2 \(stage\)"):
        tr.close()


def test_the_sink_writes_everything_it_received_after_the_engine_is_killed(tmp_path):
    """SIGKILL of the engine: the sink, in its own session, reads to the end of its input."""
    path = tmp_path / "k.jsonl"
    code = f"""
import os, signal
from engine.trace.tracer import Tracer
tr = Tracer({{"role": "prefill"}})
tr.stream({str(path)!r})
log = tr.events_for(stage=("batch",))
for b in range(5000):
    log.stage(b)
tr._writer.drain(force=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    end = time.monotonic() + 30
    while path.read_bytes().count(b"\n") < 5001 and time.monotonic() < end:
        time.sleep(0.05)
    events = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    assert [e["seq"] for e in events] == list(range(1, 5001)) and events[-1]["batch"] == 4999


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="scheduling policies are Linux's")
def test_the_sink_runs_on_idle_time_and_ignores_the_terminals_signals(tmp_path):
    tr = Tracer({"role": "prefill"})
    tr.stream(str(tmp_path / "t.jsonl"))
    sink = tr._writer.sink
    tr.events_for(stage=("batch",)).stage(0)
    tr.flush()  # the sink has set itself up and written the event
    assert os.sched_getscheduler(sink.proc.pid) == os.SCHED_IDLE
    assert os.getsid(sink.proc.pid) != os.getsid(0)  # a Ctrl-C to the engine's group misses it
    os.kill(sink.proc.pid, signal.SIGINT)
    os.kill(sink.proc.pid, signal.SIGTERM)
    tr.close()
    assert [e["ev"] for e in _events(tmp_path / "t.jsonl")] == ["stage"]


def test_a_dead_sink_is_an_internal_error_and_the_next_trace_gets_a_new_one(tmp_path):
    tr = Tracer({"role": "prefill"})
    tr.stream(str(tmp_path / "a.jsonl"))
    tr.events_for(stage=("batch",)).stage(0)
    sink = tr._writer.sink
    sink.proc.kill()
    sink.proc.wait(10)
    with pytest.raises(trace_writer.SinkError, match="internal error: the trace sink"):
        tr.close()
    again = Tracer({"role": "prefill"})
    again.stream(str(tmp_path / "b.jsonl"))
    again.events_for(stage=("batch",)).stage(1)
    again.close()
    assert again._writer.sink is not sink and _events(tmp_path / "b.jsonl")[0]["batch"] == 1
