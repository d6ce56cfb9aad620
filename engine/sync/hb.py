"""Happens-before clocks for the trace: a vector clock per thread, carried by every hand-off.

A trace shows one interleaving. To tell which other interleavings were equally possible (what
`pdo check --predict` searches), each event carries its thread's vector clock (`vc`,
docs/trace-format.md): its own component counts the thread's trace events, and every hand-off joins
the sender's clock into the receiver's. The hand-offs are the blocking primitives of engine/sync/__init__.py
(queue put/get, event set/wait, thread start/join, futures) and the CPU streams' event
record/wait/query in engine/runtime/device.py. Event e happened before f exactly when
`e.vc[own(e)] <= f.vc[own(e)]`.

An event's `vc` holds what changed since the thread's previous event: its own count alone (an int)
or, after a join, the components the join raised with that count; the whole clock at the thread's
first event under a tracer. A reader rebuilds each whole clock by replaying them per thread.

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
_has_dict: dict[type, bool] = {}  # whether a class's instances keep their channel in __dict__
_tags = itertools.count(1)
_senders = itertools.count(1)  # a channel's key per thread (an ident can be reused)
_SEEN_MAX = 4096  # sent copies a thread remembers having joined; past it, it forgets them all


def enable(on: bool = True) -> None:
    global ON
    ON = on


def new_tag() -> str:
    """The prefix of one tracer's threads in the clocks: two processes' roles run in one Python
    process (`pdo run --pd`), each with a thread named `scheduler`, and their components must differ.
    The calling thread starts a new run: its clock starts afresh (a process that runs the engine
    many times, a test session or a benchmark, would otherwise copy every earlier run's components
    into each event)."""
    _start()
    return f"t{next(_tags)}/"


def _start() -> dict:
    """The calling thread's state, afresh: its clock `c`; `delta`, the components raised since its
    last event; `keys`, the components it counts events under, and `stale`, those whose next event
    writes the whole clock; `snap`, the copy of `c` that sends share until `c` changes; `seen`, the
    sent copies it has joined (kept alive, so an id() is never another copy's)."""
    c = _local.c = {}
    _local.delta, _local.keys, _local.stale = {}, set(), set()
    _local.snap, _local.seen = None, {}
    if not hasattr(_local, "sender"):
        _local.sender = next(_senders)
    return c


def _clock() -> dict:
    try:
        return _local.c
    except AttributeError:
        return _start()


def tick(key: str):
    """Count one trace event of the calling thread (component `key`) and return what its `vc` field
    holds: the count alone (an int: not a container, so most events add nothing for the garbage
    collector to track, engine/trace/tracer.py says why that matters), the components a join raised since
    the thread's previous event with the count, or the whole clock at the thread's first event under
    `key` (a thread that logs into two tracers, the main thread closing each role of
    `pdo run --pd`, has no previous event in the second one's trace)."""
    c = _clock()
    n = c[key] = c.get(key, 0) + 1
    _local.snap = None
    if n == 1 or key in _local.stale:
        keys, stale = _local.keys, _local.stale
        keys.add(key)
        stale.discard(key)
        if _local.delta and len(keys) > 1:  # a join this clock covers is owed to the other keys'
            stale.update(keys - {key})  # traces too: they write their whole clocks next
        _local.delta = {}
        return dict(c)
    delta = _local.delta
    if delta:
        _local.delta = {}
        delta[key] = n
        return delta
    return n


def snapshot() -> dict:
    return dict(_clock())


def _raise(into: dict, other: dict, noted: dict | None = None) -> bool:
    """Raise each component of `into` to `other`'s (also into `noted`); whether any rose."""
    changed = False
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v
            if noted is not None:
                noted[k] = v
            changed = True
    return changed


def _join(other: dict) -> None:
    """Raise the calling thread's clock to `other`, noting what changed for its next event. A thread
    counting events under several components writes its whole clock next under each: one delta
    cannot reach the traces of all of them."""
    if _raise(_clock(), other, _local.delta):
        _local.snap = None
        if len(_local.keys) > 1:
            _local.stale.update(_local.keys)


def adopt(clock: dict) -> None:
    """The calling thread starts from `clock` (a thread started by the owner of that clock)."""
    _join(clock)


def _channel(obj) -> dict:
    cls = obj.__class__
    has = _has_dict.get(cls)
    if has is None:
        has = _has_dict[cls] = hasattr(obj, "__dict__")
    if has:
        return obj.__dict__.setdefault("_pdo_hb", {})
    return _by_id.setdefault(id(obj), {})


def send(obj) -> None:
    """What the calling thread did so far happens before whatever a `recv` on `obj` does next.

    A channel keeps each sender thread's latest clock (one dict item set, atomic under the GIL):
    a thread's clock only grows, so its latest covers its earlier ones, and no lock is taken (a
    thread blocked on a lock whose holder waits for the GIL can stall a whole switch interval).
    The copy sent is made once per change of the thread's clock: sends between two of its events
    share it, and a receiver that has joined that very copy skips it (`recv`)."""
    if obj is not None:
        try:
            snap = _local.snap
        except AttributeError:  # the thread's first hand-off
            _start()
            snap = None
        if snap is None:
            snap = _local.snap = dict(_local.c)
        _channel(obj)[_local.sender] = snap


_relay_lock = threading.Lock()


def relay(src, dst) -> None:
    """Whatever a `recv` on `dst` does next happens after everything sent to `src` so far: a CUDA
    event recorded on a stream (`src`) completes after all that was launched there before.

    What is relayed is kept under its own keys, `("relay", sender)`, merged with what was relayed
    before, never put over a sender's own entry: a relayed clock may be older than the one the
    sender has sent since (a stream that waits on an event takes the event's clocks). The merges
    take a lock of their own, which no send waits for."""
    if src is None or dst is None:
        return
    into = _channel(dst)
    with _relay_lock:
        for k, clock in tuple(_channel(src).items()):
            key = k if k.__class__ is tuple else ("relay", k)
            old = into.get(key)
            if old is None:
                into[key] = clock
            elif old is not clock:
                merged = dict(old)
                if _raise(merged, clock):
                    into[key] = merged


def recv(obj) -> None:
    """Join every clock sent to `obj` that the calling thread has not joined yet."""
    if obj is None:
        return
    _clock()
    seen = _local.seen
    for clock in tuple(_channel(obj).values()):
        if seen.get(id(clock)) is not clock:
            if len(seen) >= _SEEN_MAX:
                seen.clear()
            seen[id(clock)] = clock
            _join(clock)


def carried(fn, clock: dict, out):
    """`fn` run on another thread (a pool's): it starts from `clock` and sends its end to `out`."""

    def run(*args, **kwargs):
        adopt(clock)
        try:
            return fn(*args, **kwargs)
        finally:
            send(out)

    return run
