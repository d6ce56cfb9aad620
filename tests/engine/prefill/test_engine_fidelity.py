"""Trace events are logged where the action they stand for has taken effect, so a trace that passes
the rules describes what the engine did: the WAR barrier once the stream's wait is queued, deferred
sampling once it is launched (the rules order both before later events)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.decode.scheduler import DecodeScheduler
from engine.prefill.scheduler import PrefillScheduler
from engine.runtime.config import EngineConfig
from engine.runtime.forward_state import ForwardState

# the loops' traces refine their models (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("refined")


class Declared:
    """Stands in for Tracer.events_for's loggers: any event, its name recorded."""

    def __init__(self, log: list):
        self._log = log

    def __getattr__(self, ev):
        return lambda *values: self._log.append(ev)


def recorder():
    """A forward state whose stream and sampling launch record what they do, in one log with its
    events, for a scheduler stand-in that has only that state."""
    log = []
    state = ForwardState.__new__(ForwardState)
    state.log = Declared(log)
    state.sched_stream = SimpleNamespace(wait_event=lambda event: log.append("wait queued"))
    state.launch_sample = lambda *a: log.append("launched")
    return log, SimpleNamespace(fwd_state=state, cfg=EngineConfig())


@pytest.mark.parametrize("cls", [PrefillScheduler, DecodeScheduler])
def test_war_barrier_is_logged_after_the_wait_is_queued(cls):
    log, owner = recorder()
    cls.apply_war_barrier(owner, SimpleNamespace(bid=0), SimpleNamespace(war_event=1, done_event=1))
    assert log == ["wait queued", "war_barrier"]


def test_sample_is_logged_after_it_was_launched():
    log, owner = recorder()
    batch, result = SimpleNamespace(bid=0), SimpleNamespace(bid=0)
    PrefillScheduler.launch_batch_sample_if_needed(owner, batch, result)
    DecodeScheduler.launch_batch_sample_if_needed(owner, batch, result)
    assert log == ["launched", "sample", "launched", "sample"]
