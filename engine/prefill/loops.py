"""The four prefill event loops of the design, one readable function each.

Notation of the design: A(N) admit/build batch N, F(N) host-side run_batch(N), P(N) result
processing, S(N) deferred sampling.
  normal   A(N) → F(N) → P(N)                                (no overlap)
  overlap  A(N) → F(N) → P(N-1) → S(N)                       (CPU–GPU overlap)
  thread   A(N) → submit(N) → collect(N) → P(N-1) → S(N)     (forward on a worker, no new overlap)
  ahead    A(N+1) → collect(N) → S(N) → submit(N+1) → P(N)   (admission overlaps forward N)

A launched batch waiting for P travels as `Inflight(batch copy, result)` (engine/runtime/forward_state.py).
"""

from __future__ import annotations

from typing import NamedTuple

from engine.prefill.scheduler import PrefillScheduler
from engine.prefill.worker import ForwardWorker
from engine.runtime import inject
from engine.runtime.forward_state import Inflight


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
    last = None  # Inflight of the previous iteration
    while not s.finished_all or last:
        batch = _loop_top(s)
        result = None
        if batch:
            result = s.run_batch(batch)
            s.apply_war_barrier(batch, result)
            current = Inflight(batch.copy(), result)
        if last:
            s.process_batch_result(*last)
        s.process_inflight_queue()
        if batch:
            s.launch_batch_sample_if_needed(batch, result)
        last = current if batch else None
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
                current = worker.collect()
            if last:
                s.process_batch_result(*last)
            s.process_inflight_queue()
            if batch:
                s.launch_batch_sample_if_needed(*current)
            last = current if batch else None
            if not batch and not last:
                s.idle_wait()
    finally:
        worker.shutdown()


class AheadMutants(NamedTuple):
    """The ahead loop's mutant switches (engine/runtime/inject.py), read once when the loop starts."""

    sample_late: bool  # MUTANT: sample-before-collect — S(N) after submit(N+1), beside F(N+1)
    two_forwards: bool  # MUTANT: two-forwards — submit(N+1) before collect(N)
    send_on_worker: bool  # MUTANT: prefix-send-on-worker — the worker sends the cached prefix

    @classmethod
    def read(cls, active: frozenset) -> AheadMutants:
        return cls(
            inject.on(active, "sample-before-collect"),
            inject.on(active, "two-forwards"),
            inject.on(active, "prefix-send-on-worker"),
        )


def event_loop_ahead(s: PrefillScheduler) -> None:
    """AHEAD on: build N+1 while forward N runs; collect N, sample N, submit N+1, then process N."""
    worker = ForwardWorker(s)
    mutant = AheadMutants.read(s.cfg.inject)
    inflight = None  # snapshot of the batch whose forward is on the worker
    try:
        while not s.finished_all or inflight:
            batch = _loop_top(s)  # A(N+1)
            previous = None
            if inflight is not None and not mutant.two_forwards:
                previous = worker.collect()  # collect(N)
                if not mutant.sample_late:
                    s.launch_batch_sample_if_needed(*previous)  # S(N)
            if batch:
                snapshot = s.snapshot(batch)
                s.stage(snapshot)
                if not mutant.send_on_worker:
                    for req in snapshot.reqs:
                        s.maybe_send_cached_prefix(snapshot, req)
                worker.submit(snapshot, early_send_prefix=mutant.send_on_worker)  # submit(N+1)
            if inflight is not None and mutant.two_forwards:
                previous = worker.collect()
            if previous is not None and (mutant.sample_late or mutant.two_forwards):
                s.launch_batch_sample_if_needed(*previous)
            if previous is not None:
                s.process_batch_result(*previous)  # P(N)
            s.process_inflight_queue()
            inflight = snapshot if batch else None
            if not batch and not inflight:
                s.idle_wait()
    finally:
        worker.shutdown()


LOOPS = {
    "normal": event_loop_normal,
    "overlap": event_loop_overlap,
    "thread": event_loop_thread,
    "ahead": event_loop_ahead,
}
