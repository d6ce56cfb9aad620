"""The two decode event loops, one readable function each (SGLang's event_loop_normal_disagg_decode
and event_loop_overlap_disagg_decode).

Both start every iteration the same way: the DP-rank prefetch first (PR #35071: one call, at the
top), then intake, then the prealloc/transfer queues, whose resolve step consumes the prefetch.
  normal   A(N) → F(N) with sampling → P(N)
  overlap  A(N) → F(N) → WAR barrier → P(N-1) → S(N)   (batch N+1 reads N's tokens from the future map)
"""

from __future__ import annotations

from engine.decode.scheduler import DecodeScheduler
from engine.runtime.forward_state import Inflight


def _loop_top(s: DecodeScheduler):
    s.iter_begin()
    s.prefetch()
    s.ingest_requests()
    s.process_decode_queue()
    return None if s.stopping else s.get_next_batch()


def event_loop_normal(s: DecodeScheduler) -> None:
    while not s.finished_all:
        batch = _loop_top(s)
        if batch:
            result = s.run_batch(batch, sample_inline=True)
            s.apply_war_barrier(batch, result)
            s.process_batch_result(batch, result)
        else:
            s.idle_wait()


def event_loop_overlap(s: DecodeScheduler) -> None:
    last = None  # Inflight launched by the previous iteration, not yet processed
    while not s.finished_all or last:
        batch = _loop_top(s)
        if batch:
            result = s.run_batch(batch)
            s.apply_war_barrier(batch, result)
        if last:
            s.process_batch_result(*last)
        if batch:
            s.launch_batch_sample_if_needed(batch, result)
        last = Inflight(batch, result) if batch else None
        if not batch and not last:
            s.idle_wait()


LOOPS = {"normal": event_loop_normal, "overlap": event_loop_overlap}
