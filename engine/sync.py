"""Schedule points and blocking, controllable.

Uncontrolled (the default), these are thin wrappers over queue/threading/time. Under a controller
(checker/fuzz.py installs one), every managed thread runs only when the controller grants it: at each
schedule point (every trace event, every device task, every layer of a forward) and at every blocking
wait, the running thread parks and the controller's strategy picks which enabled thread goes next.
A blocking wait parks with a predicate, so a blocked thread is never chosen until it can proceed,
and a state where nothing can proceed is reported as a deadlock. Time is virtual under control, so a
schedule replays the same way every time.
"""
from __future__ import annotations

import os
import queue
import random
import threading
import time

CONTROLLER = None  # set by checker.fuzz.Controller.install()

# Uncontrolled jitter (for real GPUs, where serialising threads would hide device concurrency): a
# random delay of up to PDO_JITTER_US microseconds at every schedule point, seeded by PDO_JITTER_SEED.
JITTER_US = float(os.environ.get("PDO_JITTER_US", "0") or 0)
_jitter_rng = random.Random(int(os.environ.get("PDO_JITTER_SEED", "0") or 0))


def set_jitter(us: float, seed: int = 0) -> None:
    global JITTER_US, _jitter_rng
    JITTER_US, _jitter_rng = us, random.Random(seed)


class Deadlock(RuntimeError):
    pass


def controlled() -> bool:
    return CONTROLLER is not None


def point(label: str) -> None:
    if CONTROLLER is not None:
        CONTROLLER.point(label)
    elif JITTER_US:
        time.sleep(_jitter_rng.random() * JITTER_US * 1e-6)


def _managed():
    c = CONTROLLER
    return c if c is not None and c.manages_current() else None


def q_get(q, label: str):
    """queue.get that parks under control (works for Queue and SimpleQueue)."""
    c = _managed()
    if c is not None:
        c.point(label) if not q.empty() else c.block_until(lambda: not q.empty(), label)
        if not c.aborted:
            return q.get_nowait()
    return q.get()


def q_get_timeout(q, timeout: float, label: str):
    if _managed() is None:
        return q.get(timeout=timeout)
    return q_get(q, label)


def q_put(q, item, label: str) -> None:
    c = _managed()
    if c is not None:
        full = getattr(q, "full", lambda: False)
        c.point(label) if not full() else c.block_until(lambda: not full(), label)
        if not c.aborted:
            return q.put_nowait(item)
    q.put(item)


def ev_wait(ev: threading.Event, label: str) -> None:
    c = _managed()
    if c is not None and not ev.is_set():
        c.block_until(ev.is_set, label)
        if not c.aborted:
            return
    ev.wait()


def now() -> float:  # noqa: D103 - virtual under control
    return CONTROLLER.clock if CONTROLLER is not None else time.monotonic()


def sleep(seconds: float) -> None:
    if CONTROLLER is None:
        time.sleep(seconds)
    else:
        CONTROLLER.clock += seconds
        CONTROLLER.point("sleep")


def start_thread(target, name: str) -> threading.Thread:
    """Start a daemon thread; under control it is registered before it runs."""
    if CONTROLLER is None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        return t
    return CONTROLLER.spawn(target, name)
