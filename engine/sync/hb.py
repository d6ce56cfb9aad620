"""Happens-before hand-offs for the trace, logged as edges; the clocks are built after the run.

A trace shows one interleaving. To tell which other interleavings were equally possible (what
`pdo check --predict` searches), each event carries its thread's vector clock (`vc`,
docs/trace-format.md): its own component counts the thread's trace events, and every hand-off joins
the sender's clock into the receiver's. The hand-offs are the blocking primitives of
engine/sync/__init__.py (queue put/get, event set/wait, thread start/join, futures) and the CPU
streams' event record/wait/query in engine/runtime/device.py.

Nothing of a clock is computed in the run: each hand-off is one EDGE record in the log of every
tracer that records (engine/trace/recorder.py), and the reader replays them in log order
(spec/tracelog.py `LogReader`). A channel is an object's id(): a receiver joins every clock sent
through it so far, also what was sent after the item it took, and an id() reused by a later object
joins what the dead one carried: both only add orders, so a reordering predicted from these clocks
is one the engine really allows (the analysis can miss some, never invent one).

On by default (`pdo run --no-hb`, or PDO_HB=0, leaves them out). The hooks test `ON`, true only
while a recorder logs the edges, then make one call: the recorder's (`HandOffs`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

ENABLED = os.environ.get("PDO_HB", "").strip().lower() not in ("0", "false", "no", "off")
ON = False  # ENABLED, and a recorder attached: the hooks log edges
TAG = "t1/"  # the header's `hb`: the prefix of the events' clock components


class HandOffs(NamedTuple):
    """A recorder's log calls of the hand-offs, on the objects that carry them (None: none), which
    the hooks call as this module's functions. send(obj): what the calling thread did so far
    happens before whatever a `recv` on `obj` does next; recv(obj): join every clock sent to `obj`
    so far; recv_send(a, b): both (a queue's get and the room it makes); relay(src, dst): a `recv`
    on `dst` happens after everything sent to `src` so far (a CUDA event recorded on stream
    `src` completes after all launched there before)."""

    send: Callable[[object], None]
    recv: Callable[[object], None]
    recv_send: Callable[[object, object], None]
    relay: Callable[[object, object], None]


_sinks: tuple = ()  # the attached recorders' HandOffs
_none = HandOffs(*[lambda *_: None] * 4)  # no recorder attached
_all = HandOffs(*(lambda *x, k=k: [s[k](*x) for s in _sinks] for k in range(4)))  # several traces
# what the hooks call: the one recorder's log calls, _all's or _none's (rebound by _set)
send, recv, recv_send, relay = _none


def enable(on: bool = True) -> None:
    """Whether tracers made from now on log the hand-offs (those attached stay as they are)."""
    global ENABLED
    ENABLED = on


def attach(log: HandOffs) -> None:
    """Log the hand-offs through `log` too (a recorder's, while its trace is open, or until the
    recorder is dropped: engine/trace/tracer.py detaches it then)."""
    _set((*_sinks, log))


def detach(log: HandOffs) -> None:
    _set(tuple(s for s in _sinks if s is not log))


def _set(sinks: tuple) -> None:
    global _sinks, ON, send, recv, recv_send, relay
    _sinks, ON = sinks, bool(sinks)
    send, recv, recv_send, relay = sinks[0] if len(sinks) == 1 else _all if sinks else _none


def snapshot() -> object:
    """The calling thread's clock now, for a thread it starts (`carried`): sent to a fresh object,
    which the starter keeps until the thread has received it."""
    s = object()
    send(s)
    return s


def carried(fn, start, out):
    """`fn` run on another thread (a pool's): it starts from `start` (a `snapshot` of the thread
    that started it) and sends its end to `out`."""

    def run(*args, **kwargs):
        recv(start)
        try:
            return fn(*args, **kwargs)
        finally:
            send(out)

    return run
