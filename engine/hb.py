"""Happens-before clocks for the trace: a vector clock per thread, carried by every hand-off.

A trace shows one interleaving. To tell which other interleavings were equally possible (what
`pdo check --predict` searches), each event carries the vector clock of its thread (`vc`,
docs/trace-format.md): its own component counts the thread's trace events, and every hand-off joins
the sender's clock into the receiver's. The hand-offs are the blocking primitives of engine/sync.py
(queue put/get, event set/wait, thread start/join, futures) and the CPU streams' event
record/wait/query in engine/device.py. Event e happened before f exactly when
`e.vc[own(e)] <= f.vc[own(e)]`.

A channel (`send`/`recv`) is the accumulated clock of everything sent through one object. A receiver
joins all of it, also what was sent after the item it took: that only adds orders, so a reordering
predicted from these clocks is one the engine really allows (the analysis can miss some, never
invent one).

Off by default (`pdo run --hb`, or PDO_HB=1): when off every hook is one attribute test.
"""

from __future__ import annotations

import itertools
import os
import threading

ON = os.environ.get("PDO_HB", "").strip().lower() in ("1", "true", "yes", "on")

_local = threading.local()
_by_id: dict[int, dict] = {}  # channels of objects without a __dict__ (SimpleQueue)
_tags = itertools.count(1)
_senders = itertools.count(1)  # a channel's key per thread (an ident can be reused)


def enable(on: bool = True) -> None:
    global ON
    ON = on


def new_tag() -> str:
    """The prefix of one tracer's threads in the clocks: two processes' roles run in one Python
    process (`pdo run --pd`), each with a thread named `scheduler`, and their components must differ.
    The calling thread starts a new run: its clock starts afresh (a process that runs the engine
    many times, a test session or a benchmark, would otherwise copy every earlier run's components
    into each event)."""
    _clock()
    _local.c, _local.dirty = {}, True
    return f"t{next(_tags)}/"


def _clock() -> dict:
    try:
        return _local.c
    except AttributeError:
        c = _local.c = {}
        _local.dirty, _local.sender = True, next(_senders)
        return c


def tick(key: str):
    """Count one trace event of the calling thread (component `key`) and return what its `vc` field
    holds: the whole clock after a join (or at the thread's first event), else only the count, the
    other components being those of the thread's previous event. An int is not a container, so most
    events add nothing for the garbage collector to track (engine/trace.py says why that matters).
    The whole clock also at the thread's first event under `key`: a thread that logs into two
    tracers (the main thread closing each role of `pdo run --pd`) has no previous event in the
    second one's trace."""
    c = _clock()
    n = c[key] = c.get(key, 0) + 1
    if _local.dirty or n == 1:
        _local.dirty = False
        return dict(c)
    return n


def snapshot() -> dict:
    return dict(_clock())


def adopt(clock: dict) -> None:
    """The calling thread starts from `clock` (a thread started by the owner of that clock)."""
    _join(_clock(), clock)
    _local.dirty = True


def _join(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _channel(obj) -> dict:
    try:
        return obj.__dict__.setdefault("_pdo_hb", {})
    except AttributeError:
        return _by_id.setdefault(id(obj), {})


def send(obj) -> None:
    """What the calling thread did so far happens before whatever a `recv` on `obj` does next.

    A channel keeps each sender thread's latest clock (one dict item set, atomic under the GIL):
    a thread's clock only grows, so its latest covers its earlier ones, and no lock is taken (a
    thread blocked on a lock whose holder waits for the GIL can stall a whole switch interval)."""
    if obj is not None:
        c = _clock()
        _channel(obj)[_local.sender] = dict(c)


def relay(src, dst) -> None:
    """Whatever a `recv` on `dst` does next happens after everything sent to `src` so far: a CUDA
    event recorded on a stream (`src`) completes after all that was launched there before."""
    if src is not None and dst is not None:
        _channel(dst).update(_channel(src))


def recv(obj) -> None:
    if obj is None:
        return
    c = _clock()
    for clock in list(_channel(obj).values()):
        if any(c.get(k, 0) < v for k, v in clock.items()):
            _join(c, clock)
            _local.dirty = True


def carried(fn, clock: dict, out):
    """`fn` run on another thread (a pool's): it starts from `clock` and sends its end to `out`."""

    def run(*args, **kwargs):
        adopt(clock)
        try:
            return fn(*args, **kwargs)
        finally:
            send(out)

    return run
