"""The four prefill event loops of the seed, one readable function each.

Notation of the seed: A(N) admit/build batch N, F(N) host-side run_batch(N), P(N) result
processing, S(N) deferred sampling.
  normal   A(N) → F(N) → P(N)                                     (no overlap)
  overlap  A(N) → F(N) → P(N-1) → S(N)                            (CPU–GPU overlap)
  thread   A(N) → submit(N) → collect(N) → P(N-1) → S(N)          (forward on a worker, no new overlap)
  ahead    A(N+1) → collect(N) → S(N) → submit(N+1) → P(N)        (admission overlaps forward N)
"""
from __future__ import annotations

from .. import inject
from .scheduler import PrefillScheduler
from .worker import ForwardWorker


def _loop_top(s: PrefillScheduler):
    s.retire_ascache_writes()
    s.ingest_requests()
    return None if s.stopping else s.get_next_batch()


def event_loop_normal(s: PrefillScheduler) -> None:
    while not s.finished_all:
        batch = _loop_top(s)
        if batch:
            result = s.run_batch(batch, sample_inline=True)
            s.apply_war_barrier(batch, result)
            s.process_batch_result(batch, result)
        s.process_inflight_queue()
        if not batch:
            s.idle_wait()


def event_loop_overlap(s: PrefillScheduler) -> None:
    last = None  # (batch copy, result) of the previous iteration
    while not s.finished_all or last:
        batch = _loop_top(s)
        result = None
        if batch:
            result = s.run_batch(batch)
            s.apply_war_barrier(batch, result)
            cur = (batch.copy(), result)
        if last:
            s.process_batch_result(*last)
        s.process_inflight_queue()
        if batch:
            s.launch_batch_sample_if_needed(result)
        last = cur if batch else None
        if not batch and not last:
            s.idle_wait()


def event_loop_thread(s: PrefillScheduler) -> None:
    """AHEAD off: the forward runs on the worker, collected right after submit (validation mode)."""
    worker = ForwardWorker(s)
    last = None
    try:
        while not s.finished_all or last:
            batch = _loop_top(s)
            if batch:
                worker.submit(s.snapshot(batch), early_send_prefix=True)
                result, copy = worker.collect()
            if last:
                s.process_batch_result(*last)
            s.process_inflight_queue()
            if batch:
                s.launch_batch_sample_if_needed(result)
            last = (copy, result) if batch else None
            if not batch and not last:
                s.idle_wait()
    finally:
        worker.shutdown()


def event_loop_ahead(s: PrefillScheduler) -> None:
    """AHEAD on: build N+1 while forward N runs; collect N, sample N, submit N+1, then process N."""
    worker = ForwardWorker(s)
    inflight = None  # snapshot of the batch whose forward is on the worker
    late_sample = inject.on("sample-before-collect")  # MUTANT: sampling overlaps the next forward
    two_forwards = inject.on("two-forwards")            # MUTANT: submit N+1 before collecting N
    try:
        while not s.finished_all or inflight:
            batch = _loop_top(s)
            previous = None
            if inflight is not None and not two_forwards:
                previous = worker.collect()
                if not late_sample:
                    s.launch_batch_sample_if_needed(previous[0])
            if batch:
                snapshot = s.snapshot(batch)
                s.stage(snapshot)
                send_on_worker = inject.on("prefix-send-on-worker")  # MUTANT when True
                if not send_on_worker:
                    for req in snapshot.reqs:
                        s.maybe_send_cached_prefix(snapshot, req)
                worker.submit(snapshot, early_send_prefix=send_on_worker)
            if inflight is not None and two_forwards:
                previous = worker.collect()
            if previous is not None and (late_sample or two_forwards):
                s.launch_batch_sample_if_needed(previous[0])
            if previous is not None:
                s.process_batch_result(previous[1], previous[0])
            s.process_inflight_queue()
            inflight = snapshot if batch else None
            if not batch and not inflight:
                s.idle_wait()
    finally:
        worker.shutdown()


LOOPS = {"normal": event_loop_normal, "overlap": event_loop_overlap, "thread": event_loop_thread,
         "ahead": event_loop_ahead}
