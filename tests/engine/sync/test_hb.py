"""Happens-before, as the recorder logs it (engine/sync/hb.py: hand-off edges) and as the reader builds
the clocks from them after the run (spec/tracelog.py, format 4: what changed since the thread's
previous event), replayed by `pdo check --predict` (checker.predict.Clocks)."""

from __future__ import annotations

import threading

import pytest

from checker.predict import Clocks
from engine import sync
from engine.runtime.device import CpuStream
from engine.sync import hb
from engine.trace.tracer import Tracer


@pytest.fixture
def tr(monkeypatch):
    monkeypatch.setattr(hb, "ENABLED", True)  # the default, whatever PDO_HB says
    t = Tracer({"role": "prefill"})
    t.obj(t)  # the log, and its hand-offs, start now
    yield t
    hb.detach(t.rec.hand_offs)


def _in_thread(name: str, fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), name=name)
    t.start()
    t.join()
    return out[0] if out else None


class _Channel:
    pass


def _vcs(tr: Tracer, thread: str) -> list:
    return [e["vc"] for e in tr.events if e["thread"] == thread]


def test_a_hand_off_adds_what_it_raised_and_the_replay_gives_whole_clocks(tr):
    q = _Channel()
    tag = tr.header["hb"]
    a, b = tag + "a", tag + "b"

    def sender():
        for _ in range(3):
            tr.emit("x")
        hb.send(q)

    def receiver():
        tr.emit("x")
        hb.recv(q)
        tr.emit("x")
        tr.emit("x")

    _in_thread("a", sender)
    _in_thread("b", receiver)
    assert _vcs(tr, "a") == [{a: 1}, 2, 3]
    assert _vcs(tr, "b") == [{b: 1}, {a: 3, b: 2}, 3]  # the join's delta, then the count alone
    clocks = Clocks("t.jsonl", tr.header, tr.events)
    assert clocks.vcs[-1] == {a: 3, b: 3}
    assert clocks.before(2, 4) and not clocks.before(3, 2)  # a's third before b's second


def test_a_receiver_joins_what_was_sent_before_it_received_and_nothing_later(tr):
    q, r = _Channel(), _Channel()
    tag = tr.header["hb"]
    a, b = tag + "a", tag + "b"
    sent, joined = threading.Event(), threading.Event()

    def sender():
        tr.emit("x")
        hb.send(q)
        sent.set()
        joined.wait()
        tr.emit("x")  # after the receiver's join: not ordered before its events
        hb.send(r)

    def receiver():
        sent.wait()
        hb.recv(q)
        tr.emit("x")
        joined.set()

    ts = [threading.Thread(target=f, name=n) for f, n in ((sender, "a"), (receiver, "b"))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert _vcs(tr, "b") == [{a: 1, b: 1}]
    clocks = Clocks("t.jsonl", tr.header, tr.events)
    first_a, second_a, only_b = 0, 2, 1
    assert [e["thread"] for e in tr.events] == ["a", "b", "a"]
    assert clocks.before(first_a, only_b) and not clocks.before(only_b, second_a)
    assert not clocks.before(second_a, only_b)


def test_a_relay_never_puts_an_older_clock_over_a_newer_one(tr):
    """A stream that waits on an event takes the event's clocks; an event recorded on the stream
    after that must still carry the launches made after the first event (engine/runtime/device.py)."""
    stream, first, second = _Channel(), _Channel(), _Channel()
    a = tr.header["hb"] + "a"

    def launcher():
        tr.emit("x")
        hb.send(stream)
        hb.relay(stream, first)  # an event recorded after the first launch
        tr.emit("x")
        hb.send(stream)  # a second launch

    def waiter():
        hb.relay(first, stream)  # the stream waits on the first event
        hb.relay(stream, second)  # and an event is recorded on it

    _in_thread("a", launcher)
    _in_thread("w", waiter)
    _in_thread("c", lambda: (hb.recv(second), tr.emit("x")))
    assert _vcs(tr, "c")[0][a] == 2


def test_a_thread_started_from_a_snapshot_starts_after_it(tr):
    """sync's threads and pools start from their starter's clock (hb.carried)."""
    a = tr.header["hb"] + "a"
    done = _Channel()

    def starter():
        tr.emit("x")
        t = threading.Thread(target=hb.carried(lambda: tr.emit("y"), hb.snapshot(), done), name="c")
        t.start()
        t.join()

    _in_thread("a", starter)
    assert _vcs(tr, "c") == [{a: 1, tr.header["hb"] + "c": 1}]


def test_each_open_trace_logs_the_hand_offs_and_a_closed_one_no_more(tmp_path, monkeypatch):
    monkeypatch.setattr(hb, "ENABLED", True)
    one, two = Tracer({"role": "prefill"}), Tracer({"role": "decode"})
    q = _Channel()
    for t in (one, two):
        t.stream(str(tmp_path / f"{t.header['role']}.jsonl"))
    _in_thread("w", lambda: (two.emit("x"), hb.send(q)))
    _in_thread("m", lambda: (hb.recv(q), one.emit("x"), two.emit("x")))
    w = two.header["hb"] + "w"
    assert [e["vc"].get(w) for e in two.events if e["thread"] == "m"] == [1]
    two.close()
    n1, n2 = one.rec._peek(), two.rec._peek()
    hb.send(q)
    assert (one.rec._peek(), two.rec._peek()) == (n1 + 1, n2)
    one.close()


class _Counted:
    """The hand-offs the hooks make, counted by kind (a recorder attached beside them)."""

    def __init__(self):
        self.n = {"send": 0, "recv": 0}

        def count(kind):
            return lambda obj: self.n.__setitem__(kind, self.n[kind] + (obj is not None))

        self.log = hb.HandOffs(count("send"), count("recv"), *hb._none[2:])


@pytest.fixture
def counted(tr):
    c = _Counted()
    hb.attach(c.log)
    yield c
    hb.detach(c.log)


def test_an_inbox_receives_only_what_was_sent_since_its_last_receive(tr, counted):
    """Three puts, then three gets: one receive joins all three sends, and the consumer's events
    are after every put's; a later put is received again."""
    box = sync.Inbox()
    a, b = tr.header["hb"] + "a", tr.header["hb"] + "b"
    first, more = threading.Event(), threading.Event()

    def consumer():
        for _ in range(3):
            box.get("test")
            tr.emit("y")
        first.set()
        more.wait()
        box.get("test")
        tr.emit("y")

    t = threading.Thread(target=consumer, name="b")

    def producer():
        for _ in range(3):
            tr.emit("x")
            box.put(1)
        t.start()
        first.wait()

    _in_thread("a", producer)
    assert counted.n == {"send": 3, "recv": 1}
    _in_thread("a2", lambda: (tr.emit("x"), box.put(1), more.set()))
    t.join()
    assert counted.n == {"send": 4, "recv": 2}
    a2 = tr.header["hb"] + "a2"
    assert _vcs(tr, "b") == [{a: 3, b: 1}, 2, 3, {a2: 1, b: 4}]


def test_a_cpu_event_is_received_once_per_thread(tr, counted):
    """A completed event's one send (the stream's set) is received by the first query or wait of
    each thread; a later one would join nothing new and is not logged."""
    stream = CpuStream("s")
    try:
        started = counted.n["recv"]  # the stream thread's start
        event = stream.record_event()
        event.synchronize()
        for _ in range(3):
            assert event.query()
        event.synchronize()
        assert counted.n["recv"] - started == 2  # the stream's get of the event, this thread's
        _in_thread("other", lambda: (event.query(), event.query()))
        assert counted.n["recv"] - started == 3
    finally:
        stream.close()
