"""Happens-before clocks through CUDA events (engine/runtime/device.py CudaEvent, engine/sync/hb.py relay), on a
CPU machine: torch.cuda's stream and event replaced by stand-ins that complete at once, so what is
tested is which host threads' events a completed event orders its observer after, in the clocks
the trace's reader builds from the hand-offs logged."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from checker.predict import Clocks
from engine.runtime import device
from engine.sync import hb
from engine.trace.tracer import Tracer


class _Stream:
    def __init__(self, device=None):
        self.device = device

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, ev) -> None:
        assert isinstance(ev, _Event), "the stream is given the torch event, not the wrapper"


class _Event:
    def record(self, stream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(device))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(hb, "ENABLED", True)
    tr = Tracer({"role": "prefill"})
    tr.obj(tr)  # the log starts now: the hand-offs go into it
    yield tr
    hb.detach(tr.rec.hand_offs)


def _on_thread(tr: Tracer, name: str, fn):
    """Run `fn` on a fresh thread named `name`, an event before and after it; the threads its
    last event happened after (the components of its clock, as the trace's reader builds it)."""
    out = {}

    def body():
        tr.emit("x")
        out["result"] = fn()
        tr.emit("x")

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join()
    events = tr.events
    clock = Clocks("t.jsonl", tr.header, events).vcs[-1]
    return out["result"], {k.removeprefix(tr.header["hb"]) for k in clock}


def test_a_completed_event_orders_the_observer_after_every_launch_before_its_record(cuda):
    tr = cuda
    s = device.CudaStream("fwd", "cuda:0")
    t = device.CudaStream("copy", "cuda:0")
    early, _ = _on_thread(tr, "early", s.record_event)  # recorded before A launched anything
    _on_thread(tr, "A", lambda: s.launch(lambda: None))
    e1, _ = _on_thread(tr, "C", s.record_event)
    e2, _ = _on_thread(tr, "D", lambda: (t.wait_event(e1), t.record_event())[1])
    _, seen = _on_thread(tr, "E", e2.query)
    assert {"A", "C", "D", "E"} <= seen  # A's launch, C's record, D's wait and record
    _, before = _on_thread(tr, "F", early.synchronize)
    assert "A" not in before and "early" in before  # an earlier record is not after A's launch


def test_without_clocks_the_events_carry_nothing(cuda):
    tr = cuda
    hb.detach(tr.rec.hand_offs)  # as a trace made with PDO_HB=0: no hand-off logged
    s = device.CudaStream("fwd", "cuda:0")
    _on_thread(tr, "A", lambda: s.launch(lambda: None))
    ev, _ = _on_thread(tr, "C", s.record_event)
    _, seen = _on_thread(tr, "E", ev.synchronize)
    assert seen == {"E"}
