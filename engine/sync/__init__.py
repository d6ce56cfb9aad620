"""Schedule points and blocking, controllable.

Uncontrolled (the default), these are thin wrappers over queue/threading/time. Under a controller
(checker/fuzz/ installs one), every managed thread runs only when the controller grants it: at each
schedule point (every trace event, every device task, every layer of a forward) and at every blocking
wait, the running thread parks and the controller's strategy picks which enabled thread goes next.
A blocking wait parks with a predicate, so a blocked thread is never chosen until it can proceed,
and a state where nothing can proceed is reported as a deadlock. Time is virtual under control, so a
schedule replays the same way every time.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import random
import threading
import time
import types
from concurrent.futures import Future, ThreadPoolExecutor

from engine.errors import EngineError
from engine.sync import hb

CONTROLLER = None  # set by checker.fuzz.Controller.install()

# Uncontrolled jitter (for real GPUs, where serialising threads would hide device concurrency): a
# random delay of up to PDO_JITTER_US microseconds at every schedule point, seeded by PDO_JITTER_SEED.
JITTER_US = float(os.environ.get("PDO_JITTER_US", "0") or 0)
_jitter_rng = random.Random(int(os.environ.get("PDO_JITTER_SEED", "0") or 0))


def set_jitter(us: float, seed: int = 0) -> None:
    global JITTER_US, _jitter_rng
    JITTER_US, _jitter_rng = us, random.Random(seed)


class Deadlock(EngineError):
    """Every thread under the schedule controller waits on another: the run can never finish."""


def controlled() -> bool:
    return CONTROLLER is not None


_off = threading.local()


@contextlib.contextmanager
def off_schedule():
    """The calling thread's schedule points do nothing inside: for work that is not part of the
    system under test (an oracle's reference forward), whose points would otherwise be steps of the
    schedule, and so differ between a run that computes a reference and one that finds it cached."""
    before = getattr(_off, "on", False)
    _off.on = True
    try:
        yield
    finally:
        _off.on = before


def points_active() -> bool:
    """Whether a schedule point can do anything (a controller, or jitter): when not, code may skip
    the points between steps (the scripted forward runs all its layers in one call)."""
    if getattr(_off, "on", False):
        return False
    return CONTROLLER is not None or bool(JITTER_US)


def point(label: str) -> None:
    if getattr(_off, "on", False):
        return
    if CONTROLLER is not None:
        CONTROLLER.point(label)
    elif JITTER_US:
        time.sleep(_jitter_rng.random() * JITTER_US * 1e-6)


def _managed():
    c = CONTROLLER
    return c if c is not None and c.manages_current() else None


def owner():
    """The controller that manages the calling thread, or None: what scopes per-run state (the
    in-process bootstrap server) to one controlled run."""
    return _managed()


def q_get(q, label: str):
    """queue.get that parks under control (works for Queue and SimpleQueue)."""
    item = _q_get(q, label)
    if hb.ON:  # the item's put happened before; this get makes room for a later put
        hb.recv_send(q, getattr(q, "not_full", None))
    return item


def _q_get(q, label: str):
    c = _managed()
    if c is not None:
        c.point(label) if not q.empty() else c.block_until(lambda: not q.empty(), label)
        if not c.aborted:
            return q.get_nowait()
    return q.get()


def q_get_timeout(q, timeout: float, label: str):
    if _managed() is None:
        item = q.get(timeout=timeout)
        if hb.ON:
            hb.recv_send(q, getattr(q, "not_full", None))
        return item
    return q_get(q, label)


def q_put(q, item, label: str) -> None:
    if hb.ON:
        hb.recv_send(getattr(q, "not_full", None), q)
    c = _managed()
    if c is not None:
        full = getattr(q, "full", lambda: False)
        c.point(label) if not full() else c.block_until(lambda: not full(), label)
        if not c.aborted:
            return q.put_nowait(item)
    q.put(item)


class Inbox:
    """A queue with one consumer thread (a CPU stream's, the transfer thread's). A put's hand-off
    is a send; a get's receive is logged only if something was sent since the consumer's last
    one: a receive joins every send before it, so one after puts already joined adds no order,
    and most gets come in runs after a run of puts. Each send is numbered (atomically: several
    threads put) after it is logged, so a number the consumer has seen was logged before its last
    receive."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._numbers = itertools.count(1).__next__
        self._sent = self._seen = 0  # the last send's number; the last one received

    def put(self, item) -> None:
        if hb.ON:
            hb.send(self)
            self._sent = self._numbers()
        self._q.put(item)

    def get(self, label: str):
        item = _q_get(self._q, label)
        if hb.ON:
            sent = self._sent
            if sent != self._seen:
                self._seen = sent
                hb.recv(self)
        return item


def ev_wait(ev: threading.Event, label: str) -> None:
    c = _managed()
    if c is not None and not ev.is_set():
        c.block_until(ev.is_set, label)
        if not c.aborted:
            if hb.ON:
                hb.recv(ev)
            return
    ev.wait()
    if hb.ON:
        hb.recv(ev)


def ev_set(ev: threading.Event) -> None:
    """Event.set whose waiters (ev_wait) happen after what the setter did."""
    if hb.ON:
        hb.send(ev)
    ev.set()


def now() -> float:  # noqa: D103 - virtual under control
    return CONTROLLER.clock if CONTROLLER is not None else time.monotonic()


def sleep(seconds: float) -> None:
    """Under control: virtual time. The thread parks until `seconds` from now; it runs again only
    when no awake thread can, the sleeper with the earliest wake-up first (the clock jumps to it)."""
    c = _managed()
    if c is None:
        time.sleep(seconds)
    else:
        c.sleep(seconds)


def uniform(a: float, b: float) -> float:
    """Random jitter (retry backoff); under control the midpoint, so a schedule replays exactly."""
    return (a + b) / 2 if CONTROLLER is not None else random.uniform(a, b)


def start_thread(target, name: str, *, group: str | None = None) -> threading.Thread:
    """Start a daemon thread; under control it is registered before it runs. `group` (default: the
    parent's) prefixes its name in the schedule (`decode/stream:forward`), never in the trace."""
    end = None
    if hb.ON:  # the child starts after what its parent did; a join waits for the child's end
        end = types.SimpleNamespace()
        target = hb.carried(target, hb.snapshot(), end)
    t = _start_thread(target, name, group)
    if end is not None:
        t.pdo_hb_end = end
    return t


def _start_thread(target, name: str, group: str | None) -> threading.Thread:
    if CONTROLLER is None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        return t
    return CONTROLLER.spawn(target, name, group=group)


@contextlib.contextmanager
def group(name: str):
    """Threads started by the current thread inside this block belong to schedule group `name`."""
    c = _managed()
    if c is None:
        yield
        return
    prev = c.group_of_current()
    c.set_group(name)
    try:
        yield
    finally:
        c.set_group(prev)


def join(t: threading.Thread, label: str, timeout: float | None = None) -> None:
    """Thread.join that parks under control until the thread has finished."""
    c = _managed()
    key = getattr(t, "pdo_key", None)
    if c is not None and key is not None:
        c.block_until(lambda: c.exited(key), label)
        if not c.aborted:
            if hb.ON:
                hb.recv(getattr(t, "pdo_hb_end", None))
            return
    t.join(timeout)
    if hb.ON and not t.is_alive():
        hb.recv(getattr(t, "pdo_hb_end", None))


def finished(t: threading.Thread) -> bool:
    """The thread's target has returned (under control: as the controller saw it)."""
    c = CONTROLLER
    key = getattr(t, "pdo_key", None)
    return (c is not None and key is not None and c.exited(key)) or not t.is_alive()


def quiesce(label: str) -> None:
    """Under control: park until every other managed thread has exited (nothing left to run after)."""
    c = _managed()
    if c is not None:
        c.block_until(c.alone_pred(), label)


def result(fut, label: str):
    """Future.result that parks under control until the future is done."""
    c = _managed()
    if c is not None and not fut.done():
        c.block_until(fut.done, label)
    try:
        return fut.result()
    finally:
        if hb.ON:
            hb.recv(getattr(fut, "pdo_hb_end", None))


class Executor:
    """A small ThreadPoolExecutor whose workers are managed threads (under a controller): `submit`
    returns a concurrent.futures.Future; a worker takes the queued call at a schedule point, and a
    future cancelled while queued never runs."""

    def __init__(self, workers: int, prefix: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._n = workers
        self._threads = [start_thread(self._run, f"{prefix}_{i}") for i in range(workers)]

    def _run(self):
        while True:
            item = q_get(self._q, "executor.idle")
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)

    def submit(self, fn, *args):
        fut = Future()
        if hb.ON:
            fut.pdo_hb_end = types.SimpleNamespace()
            fn = hb.carried(fn, hb.snapshot(), fut.pdo_hb_end)
        self._q.put((fut, fn, args))
        return fut

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        if cancel_futures:
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in range(self._n):
            self._q.put(None)


def executor(workers: int, prefix: str):
    """A thread pool: concurrent.futures' uncontrolled, managed workers under a controller."""
    if CONTROLLER is None:
        pool = _HbPool if hb.ON else ThreadPoolExecutor
        return pool(max_workers=workers, thread_name_prefix=prefix)
    return Executor(workers, prefix)


class _HbPool(ThreadPoolExecutor):
    """concurrent.futures' pool whose calls start from the submitter's clock (engine/sync/hb.py)."""

    def submit(self, fn, /, *args, **kwargs):
        end = types.SimpleNamespace()
        fut = super().submit(hb.carried(fn, hb.snapshot(), end), *args, **kwargs)
        fut.pdo_hb_end = end
        return fut
