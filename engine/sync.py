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

import queue
import threading
import time

CONTROLLER = None  # set by checker.fuzz.Controller.install()


class Deadlock(RuntimeError):
    pass


def controlled() -> bool:
    return CONTROLLER is not None


def point(label: str) -> None:
    if CONTROLLER is not None:
        CONTROLLER.point(label)


def block_until(pred, label: str) -> None:
    if CONTROLLER is not None and not pred():
        CONTROLLER.block_until(pred, label)


def q_get(q, label: str):
    """queue.get that parks under control (works for Queue and SimpleQueue)."""
    if CONTROLLER is None:
        return q.get()
    CONTROLLER.point(label) if not q.empty() else CONTROLLER.block_until(lambda: not q.empty(), label)
    return q.get_nowait()


def q_get_timeout(q, timeout: float, label: str):
    if CONTROLLER is None:
        return q.get(timeout=timeout)
    return q_get(q, label)


def q_put(q, item, label: str) -> None:
    if CONTROLLER is None:
        return q.put(item)
    full = getattr(q, "full", lambda: False)
    CONTROLLER.point(label) if not full() else CONTROLLER.block_until(lambda: not full(), label)
    q.put_nowait(item)


def ev_wait(ev: threading.Event, label: str) -> None:
    if CONTROLLER is None:
        ev.wait()
    else:
        block_until(ev.is_set, label)


def now() -> float:
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
