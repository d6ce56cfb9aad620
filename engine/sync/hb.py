"""Happens-before hand-offs for the trace, logged as edges; the clocks are built after the run.

A trace shows one interleaving. To tell which other interleavings were equally possible (what
`pdo check --predict` searches), each event carries its thread's vector clock (`vc`,
docs/trace-format.md): its own component counts the thread's trace events, and every hand-off joins
the sender's clock into the receiver's. The hand-offs are the blocking primitives of
engine/sync/__init__.py (queue put/get, event set/wait, thread start/join, futures) and the CPU
streams' event record/wait/query in engine/runtime/device.py.

Nothing of a clock is computed in the run: each hand-off is one EDGE record in the log of every
tracer that records (engine/trace/recorder.py) — SEND on a channel, RECV from it, RELAY from one
channel into another — and the reader replays them in log order (spec/tracelog.py `LogReader`). A channel
is an object's id(): a receiver joins every clock sent through it so far, also what was sent after
the item it took, and an id() reused by a later object joins what the dead one carried: both only
add orders, so a reordering predicted from these clocks is one the engine really allows (the
analysis can miss some, never invent one).

Off by default (`pdo run --hb`, or PDO_HB=1): with the edges, tracing costs about 13.5% of the
run's wall time against 9% without (docs/benchmarks.md), far over the 3% budget; when off every
hook is one attribute test.
"""

from __future__ import annotations

import os
import weakref

from spec.tracelog import RECV, RECV_SEND, RELAY, SEND

ON = os.environ.get("PDO_HB", "").strip().lower() in ("1", "true", "yes", "on")
TAG = "t1/"  # the header's `hb`: the prefix of the events' clock components
_logs: tuple = ()  # weak references to the recorders that log the edges


def enable(on: bool = True) -> None:
    global ON
    ON = on


def attach(rec) -> None:
    """Log the hand-offs into `rec` too (a tracer's recorder, while its trace is open, or until it
    is dropped)."""
    global _logs
    _logs = (*_logs, weakref.ref(rec, _forget))


def _forget(ref) -> None:
    global _logs
    _logs = tuple(r for r in _logs if r is not ref)


def detach(rec) -> None:
    global _logs
    _logs = tuple(r for r in _logs if r() is not None and r() is not rec)


def _log(op: int, a: int, b: int = 0) -> None:
    for r in _logs:
        rec = r()
        if rec is not None:
            rec.edge(op, a, b)


def send(obj) -> None:
    """What the calling thread did so far happens before whatever a `recv` on `obj` does next."""
    if obj is not None:
        _log(SEND, id(obj))


def recv(obj) -> None:
    """Join every clock sent to `obj` so far."""
    if obj is not None:
        _log(RECV, id(obj))


def recv_send(a, b) -> None:
    """`recv(a)`, then `send(b)`, in one record (a queue's get and the room it makes, a put and
    the room it took)."""
    if a is None or b is None:
        recv(a)
        send(b)
    else:
        _log(RECV_SEND, id(a), id(b))


def relay(src, dst) -> None:
    """Whatever a `recv` on `dst` does next happens after everything sent to `src` so far: a CUDA
    event recorded on a stream (`src`) completes after all that was launched there before."""
    if src is not None and dst is not None:
        _log(RELAY, id(src), id(dst))


def snapshot() -> object:
    """The calling thread's clock now, for a thread it starts (`carried`, `adopt`): sent to a
    fresh object, which the starter keeps until the thread has adopted it."""
    s = object()
    send(s)
    return s


def adopt(start) -> None:
    """The calling thread starts from `start` (a thread started by the one that took it)."""
    recv(start)


def carried(fn, start, out):
    """`fn` run on another thread (a pool's): it starts from `start` and sends its end to `out`."""

    def run(*args, **kwargs):
        adopt(start)
        try:
            return fn(*args, **kwargs)
        finally:
            send(out)

    return run
