"""The forward worker thread of the thread modes: one thread, input and output queues of capacity 1.

`submit(N)` hands a snapshot to the worker; the worker runs `run_batch(N)`, applies the WAR barrier,
makes `batch.copy()` for result processing and puts `Inflight(copy, result)` on the output queue;
`collect()` takes it back on the scheduler thread. A worker exception is re-raised by `collect()`.
"""

from __future__ import annotations

import queue

from engine import sync
from engine.prefill.scheduler import EngineError
from engine.runtime import inject
from engine.runtime.forward_state import Inflight
from spec.vocabulary import FORWARD

_STOP = object()


class WorkerError(EngineError):
    pass


class ForwardWorker:
    def __init__(self, sched):
        self.sched = sched
        cap = 2 if inject.on(sched.cfg.inject, "two-forwards") else 1  # MUTANT: two-forwards
        self.in_q: queue.Queue = queue.Queue(maxsize=cap)
        self.out_q: queue.Queue = queue.Queue(maxsize=cap)
        self.submitted = 0
        self.collected = 0
        self.thread = sync.start_thread(self._loop, FORWARD)

    def _loop(self):
        while True:
            item = sync.q_get(self.in_q, "worker.in_q")
            if item is _STOP:
                return
            batch, early_send_prefix = item
            try:
                result = self.sched.run_batch(batch, early_send_prefix=early_send_prefix)
                self.sched.apply_war_barrier(batch, result)
                if inject.on(
                    self.sched.cfg.inject, "copy-after-handoff"
                ):  # MUTANT: copy-after-handoff
                    sync.q_put(self.out_q, Inflight(batch, result), "worker.out_q")
                    batch.copy()
                    self.sched.log.batch_copy(batch.bid)
                    continue
                copy = batch.copy()
                self.sched.log.batch_copy(batch.bid)
                sync.q_put(self.out_q, Inflight(copy, result), "worker.out_q")
            except BaseException as exc:  # reaches the scheduler thread through collect()
                sync.q_put(self.out_q, exc, "worker.out_q")

    def submit(self, batch, *, early_send_prefix: bool) -> None:
        self.sched.log.submit(batch.bid)
        self.submitted += 1
        sync.q_put(self.in_q, (batch, early_send_prefix), "submit")

    def collect(self) -> Inflight:
        while True:
            try:
                item = sync.q_get_timeout(self.out_q, 0.5, "collect")
                break
            except queue.Empty:
                if not self.thread.is_alive():
                    raise WorkerError("forward worker thread died without a result") from None
        self.collected += 1
        if isinstance(item, BaseException):
            raise WorkerError(f"forward worker failed: {item!r}") from item
        self.sched.log.collect(item.batch.bid)
        return item

    @property
    def in_flight(self) -> int:
        return self.submitted - self.collected

    def shutdown(self) -> None:
        """Drain what was submitted, then stop the thread. A worker that died without a result will
        never answer (collect raises before counting it) and may have left its input unread (a put
        of _STOP would block): stop waiting for it then."""
        while self.in_flight > 0 and not sync.finished(self.thread):
            try:
                self.collect()
            except WorkerError:
                pass
        if sync.finished(self.thread):
            return
        if sync.controlled():  # a dead worker there is a deadlock the controller reports
            sync.q_put(self.in_q, _STOP, "worker.stop")
            return
        while not sync.finished(
            self.thread
        ):  # it may still die with its input full: never block on it
            try:
                self.in_q.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                pass
        self.thread.join(timeout=10)
