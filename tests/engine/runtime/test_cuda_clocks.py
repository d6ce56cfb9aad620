"""Happens-before clocks through CUDA events (engine/runtime/device.py CudaEvent, engine/sync/hb.py relay), on a
CPU machine: torch.cuda's stream and event replaced by stand-ins that complete at once, so what is
tested is which host threads' clocks a completed event carries."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from engine.runtime import device
from engine.sync import hb


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
    hb.enable(True)
    yield
    hb.enable(False)


def _on_thread(name: str, fn):
    """Run `fn` on a fresh thread (a clock of its own, component `name`); its clock after."""
    out = {}

    def body():
        hb.tick(name)
        out["result"] = fn()
        out["clock"] = hb.snapshot()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["result"], out["clock"]


def test_a_completed_event_orders_the_observer_after_every_launch_before_its_record(cuda):
    s = device.CudaStream("fwd", "cuda:0")
    t = device.CudaStream("copy", "cuda:0")
    early, _ = _on_thread("early", s.record_event)  # recorded before A launched anything
    _on_thread("A", lambda: s.launch(lambda: None))
    e1, _ = _on_thread("C", s.record_event)
    e2, _ = _on_thread("D", lambda: (t.wait_event(e1), t.record_event())[1])
    _, seen = _on_thread("E", e2.query)
    assert {"A", "C", "D", "E"} <= set(seen)  # A's launch, C's record, D's wait and record
    _, before = _on_thread("F", early.synchronize)
    assert "A" not in before and "early" in before  # an earlier record is not after A's launch


def test_without_clocks_the_events_carry_nothing(cuda):
    hb.enable(False)
    s = device.CudaStream("fwd", "cuda:0")
    _on_thread("A", lambda: s.launch(lambda: None))
    ev, _ = _on_thread("C", s.record_event)
    _, seen = _on_thread("E", ev.synchronize)
    assert set(seen) == {"E"}
