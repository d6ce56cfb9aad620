"""engine/sync/hb.py's clocks as the trace writes them (format 4: what changed since the thread's
previous event) and as `pdo check --predict` replays them (checker.predict.Clocks)."""

from __future__ import annotations

import threading

import pytest

from checker.predict import Clocks
from engine.sync import hb


@pytest.fixture
def on():
    hb.enable(True)
    yield
    hb.enable(False)


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


class _Channel:
    pass


def test_a_hand_off_adds_what_it_raised_and_the_replay_gives_whole_clocks(on):
    tag = hb.new_tag()
    q = _Channel()
    a, b = tag + "a", tag + "b"

    def sender():
        hb._start()
        vcs = [hb.tick(a) for _ in range(3)]
        hb.send(q)
        return vcs

    def receiver():
        hb._start()
        first = hb.tick(b)
        hb.recv(q)
        return [first, hb.tick(b), hb.tick(b)]

    sent = _in_thread(sender)
    got = _in_thread(receiver)
    assert sent == [{a: 1}, 2, 3]
    assert got == [{b: 1}, {a: 3, b: 2}, 3]  # the join's delta, then the count alone
    events = [
        {"seq": i, "thread": th, "vc": vc}
        for i, (th, vc) in enumerate([*(("a", v) for v in sent), *(("b", v) for v in got)], 1)
    ]
    clocks = Clocks("t.jsonl", {"hb": tag}, events)
    assert clocks.vcs[-1] == {a: 3, b: 3}
    assert clocks.before(2, 4) and not clocks.before(3, 2)  # a's third before b's second


def test_a_copy_joined_once_is_skipped_and_a_new_one_joined(on):
    tag = hb.new_tag()
    q = _Channel()
    a, b = tag + "a", tag + "b"
    ticks = threading.Event()
    sent = threading.Event()
    out = []

    def sender():
        hb._start()
        hb.tick(a)
        hb.send(q)
        hb.send(q)  # the same copy: nothing changed between the sends
        sent.set()
        ticks.wait()
        hb.tick(a)
        hb.send(q)
        sent.set()

    def receiver():
        hb._start()
        hb.tick(b)
        sent.wait()
        hb.recv(q)
        hb.recv(q)
        out.append(hb.tick(b))  # joined once
        sent.clear()
        ticks.set()
        sent.wait()
        hb.recv(q)
        out.append(hb.tick(b))

    ts = [threading.Thread(target=f) for f in (sender, receiver)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert out == [{a: 1, b: 2}, {a: 2, b: 3}]


def test_a_thread_counting_under_two_tracers_writes_whole_clocks_after_a_join(on):
    t1 = hb.new_tag()
    t2 = hb.new_tag()
    q = _Channel()
    x, y, s = t1 + "main", t2 + "main", t2 + "sched"

    def main():
        hb._start()
        hb.tick(x)
        hb.tick(y)  # now counting under both
        _in_thread(lambda: (hb._start(), hb.tick(s), hb.send(q)))
        hb.recv(q)
        return hb.tick(x), hb.tick(y)

    in_x, in_y = _in_thread(main)
    # each trace's event knows the other trace's scheduler: a delta written into one trace only
    # would leave the other without it
    assert in_x == {x: 2, y: 1, s: 1} and in_y == {x: 2, y: 2, s: 1}


def test_a_join_before_a_second_tracer_reaches_the_first_ones_trace(on):
    """A join while the thread counts under one tracer, then two events under a second tracer:
    the first tracer's next event must still carry the join."""
    t1, t2 = hb.new_tag(), hb.new_tag()
    q = _Channel()
    x, y, w = t1 + "main", t2 + "main", t1 + "w"

    def main():
        hb._start()
        hb.tick(x)
        _in_thread(lambda: (hb._start(), hb.tick(w), hb.send(q)))
        hb.recv(q)  # one key so far: a delta
        hb.tick(y)  # the second tracer's first event: the whole clock
        hb.tick(y)
        return hb.tick(x)

    assert _in_thread(main) == {x: 2, w: 1, y: 2}


def test_a_relay_never_puts_an_older_clock_over_a_newer_one(on):
    """A stream that waits on an event takes the event's clocks; an event recorded on the stream
    after that must still carry the launches made after the first event (engine/runtime/device.py)."""
    tag = hb.new_tag()
    stream, first, second = _Channel(), _Channel(), _Channel()
    a = tag + "a"

    def launcher():
        hb._start()
        hb.tick(a)
        hb.send(stream)
        hb.relay(stream, first)  # an event recorded after the first launch
        hb.tick(a)
        hb.send(stream)  # a second launch

    def waiter():
        hb._start()
        hb.relay(first, stream)  # the stream waits on the first event
        hb.relay(stream, second)  # and an event is recorded on it

    _in_thread(launcher)
    _in_thread(waiter)
    assert _in_thread(lambda: (hb._start(), hb.recv(second), hb.snapshot())[-1]) == {a: 2}
