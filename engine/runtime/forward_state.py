"""The forward state the prefill and decode schedulers share: three streams, the persistent input
buffers, the logits buffer and the future map, with the steps that touch them — staging a batch's
inputs, the WAR barrier, the deferred sampling launch — and those steps' trace events (`stage`,
`war_barrier`, `sample`).

Streams: staging writes on `schedule`, the model and sampling on `forward`, the device-to-host copy
of the sampled tokens on `copy`. The input buffers are shared by every batch (as CUDA-graph buffers
are): the reason the WAR barrier exists. Sampling writes each request's token into a slot of the
future map, which a later forward may read on the device before the token reaches the host (decode's
overlap loop does).

`Inflight(batch, result)` is a launched batch waiting for result processing, as every loop and the
prefill worker hand it on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.runtime import device_ops
from engine.runtime.device import make_stream, then_log
from spec.vocabulary import declared


@dataclass
class ForwardResult:
    """What run_batch(N) hands on: the forward's completion, then what its sampling adds."""

    bid: int
    bs: int
    bias: torch.Tensor  # the logit bias sampling adds, a row per request
    done_event: object  # forward finished on the device (KV written, logits ready)
    war_event: object  # forward finished reading the shared input buffers
    future_slots: torch.Tensor | None = None  # future-map slots sampling writes (on the device)
    copy_event: object = None  # sampled tokens copied to the host
    host_buf: torch.Tensor | None = None  # filled on the copy stream; read after copy_event
    host_tokens: list | None = None  # prefill: host_buf's tokens, once processed
    refs: list | None = None  # decode: the sampled tokens as future-map references, -(slot + 1)


class Inflight(NamedTuple):
    """A batch whose forward is launched, with its result: what result processing takes."""

    batch: object
    result: ForwardResult


class ForwardState:
    """Streams, shared buffers and future map of one scheduler (see the module docstring).

    `role`: the trace role whose events it logs (prefill, decode). `tokens`: input buffer length (tokens in a batch); `requests`: logit rows (requests in a
    batch); the future map holds four batches' tokens. `pinned_inputs`: a batch's inputs are pinned
    host tensors (prefill pins them on a GPU), so staging copies them on the schedule stream
    asynchronously; otherwise the calling thread moves them to the device first, and the stream
    copies them from there. `script_ops`: on CPU, staging and sampling run as one TorchScript call
    each on the streams' threads (engine/runtime/device_ops.py), else as eager torch ops.
    `on_sampled(batch, result, slots)`: called once a sampling launch is queued, with its future-map
    slots on the host."""

    def __init__(
        self,
        device: torch.device,
        tracer,
        role: str,
        *,
        tokens: int,
        requests: int,
        vocab: int,
        ids_dtype: torch.dtype,
        pinned_inputs: bool,
        script_ops: bool,
        on_sampled: Callable | None = None,
        device_events: bool = False,
    ):
        self.device = device
        kinds = ("stage", "war_barrier", "sample", *(("staged",) if device_events else ()))
        self.log = tracer.events_for(**declared(role, *kinds))
        self.sched_stream = make_stream("schedule", device)
        self.fwd_stream = make_stream("forward", device)
        self.copy_stream = make_stream("copy", device)
        self.buf_ids = torch.zeros(tokens, dtype=ids_dtype, device=device)
        self.buf_pos = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.buf_loc = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.logits_buf = torch.zeros((requests, vocab), dtype=torch.float32, device=device)
        self.future_map = torch.zeros(4 * requests, dtype=torch.int64, device=device)
        self._future_next = 0
        self._views: dict[tuple[int, int], tuple] = {}  # (tokens, requests) -> buffer views
        self._pinned_inputs = pinned_inputs
        self._script = script_ops and device.type == "cpu"
        self._on_sampled = on_sampled
        # `staged` where the schedule stream's order can be seen from the host (the WAR barrier's
        # device half, rule P-war-device)
        self._log_staged = device_events and self.sched_stream.host_ordered

    def views(self, tokens: int, requests: int) -> tuple:
        """The first `tokens` of the three input buffers and the first `requests` logit rows. Every
        torch call from Python lets the GIL go, and the launching thread may then wait for the
        scheduler to hand it back before it can launch: the views are made once per shape."""
        views = self._views.get((tokens, requests))
        if views is None:
            views = self._views[(tokens, requests)] = (
                self.buf_ids[:tokens],
                self.buf_pos[:tokens],
                self.buf_loc[:tokens],
                self.logits_buf[:requests],
            )
        return views

    def stage(self, batch, n: int) -> None:
        """Write the batch's `n` inputs into the shared buffers, on the schedule stream. The stream
        waits for the previous forward's reads (WAR barrier) because it is in order after that
        wait."""
        self.log.stage(batch.bid)
        ids, pos, loc = batch.input_ids, batch.positions, batch.out_cache_loc
        if self._script:
            stage = device_ops.ops()["stage"]

            def write():  # one call on the schedule stream's thread (engine/runtime/device_ops.py)
                stage(self.buf_ids, self.buf_pos, self.buf_loc, ids, pos, loc, n)
        elif self._pinned_inputs:

            def write():  # host-to-device copies enqueued on the schedule stream (async on CUDA)
                self.buf_ids[:n].copy_(ids, non_blocking=True)
                self.buf_pos[:n].copy_(pos, non_blocking=True)
                self.buf_loc[:n].copy_(loc, non_blocking=True)
        else:
            ids, pos, loc = (t.to(self.device, non_blocking=True) for t in (ids, pos, loc))

            def write():
                self.buf_ids[:n].copy_(ids)
                self.buf_pos[:n].copy_(pos)
                self.buf_loc[:n].copy_(loc)

        if self._log_staged:
            write = then_log(write, self.log.staged, batch.bid)
        self.sched_stream.launch(write)
        batch.stage_event = self.sched_stream.record_event()

    def war_barrier(self, batch, result: ForwardResult, *, wait: bool = True) -> None:
        """Later writes to the shared buffers (on the schedule stream) wait for forward N's reads.
        Logged once the wait is queued: the event means "the barrier is in place", so a stage logged
        after it really is behind the wait. `wait=False` leaves the wait out (a mutant's)."""
        if wait:
            self.sched_stream.wait_event(result.war_event)
        self.log.war_barrier(batch.bid)

    def launch_batch_sample(self, batch, result: ForwardResult) -> None:
        """Deferred sampling (`launch_sample`), logged once launched: rules order it before the next
        submit/forward, so the whole launch must precede them (it cannot start before the collect
        that hands it `result`)."""
        self.launch_sample(batch, result)
        self.log.sample(batch.bid)

    def launch_sample(self, batch, result: ForwardResult) -> None:
        """Sampling of `result`'s forward on the forward stream (shared with the forward: logits
        buffer, future map), hence only while no forward is being launched, into the next slots of
        the future map; then those slots' device-to-host copy on the copy stream."""
        bs, cap = result.bs, self.future_map.shape[0]
        start = self._future_next
        self._future_next = (start + bs) % cap
        host_slots = torch.arange(start, start + bs) % cap
        slots, bias = host_slots.to(self.device), result.bias
        # pinned on a GPU: the copy is then asynchronous (into pageable memory it would block the
        # launching thread until the forward and the sampling are done)
        host = torch.empty(bs, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        if self._script:  # one call per task on the streams' threads (engine/runtime/device_ops.py)
            ops = device_ops.ops()
            sample_op, to_host_op, future_map, logits = (
                ops["sample"],
                ops["to_host"],
                self.future_map,
                self.logits_buf,
            )

            def sample():
                sample_op(future_map, slots, logits, bias, bs)

            def to_host():  # read after copy_event (result processing)
                to_host_op(host, future_map, slots)
        else:

            def sample():
                self.future_map[slots] = torch.argmax(self.logits_buf[:bs] + bias, dim=-1)

            def to_host():  # device-to-host on the copy stream; read after copy_event
                host.copy_(self.future_map[slots], non_blocking=True)

        self.fwd_stream.launch(sample)
        self.copy_stream.wait_event(self.fwd_stream.record_event())
        self.copy_stream.launch(to_host)
        result.host_buf = host
        result.future_slots = slots
        result.copy_event = self.copy_stream.record_event()
        if self._on_sampled is not None:
            self._on_sampled(batch, result, host_slots)

    def check(self) -> None:
        """Re-raise here a failure of a task on any of the streams."""
        for stream in (self.fwd_stream, self.copy_stream, self.sched_stream):
            stream.check()

    def close(self) -> None:
        for stream in (self.sched_stream, self.fwd_stream, self.copy_stream):
            stream.close()
