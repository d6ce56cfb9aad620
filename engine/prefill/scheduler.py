"""The prefill scheduler: admission, run_batch, the WAR barrier, deferred sampling, result processing
and the KV inflight queue. The four event loops that call these live in loops.py.

Every ordering point emits a trace event (docs/trace-format.md); names follow SGLang's so the code
can be read beside `disaggregation/prefill.py` and `managers/scheduler.py`.
"""

from __future__ import annotations

import time

import torch

from engine import sync
from engine.errors import EngineError
from engine.kv.transfer import AttentionStore, KVReceiverStore, KVSender, TransferEngine
from engine.prefill.admission import Admission
from engine.runtime import inject
from engine.runtime.attention import ExtendMeta, make_backend
from engine.runtime.config import EngineConfig
from engine.runtime.device import then_log
from engine.runtime.forward_state import ForwardResult, ForwardState
from engine.runtime.memory import KVPool, PrefixCache, ReqToTokenPool
from engine.runtime.model import shared_model
from engine.runtime.request import Req, SamplingBatchInfo, ScheduleBatch, snapshot_for_forward
from engine.trace.digest import DigestStamp
from engine.trace.tracer import NullTracer
from spec.vocabulary import declared

# The prefill events, declared from spec/events.toml and logged positionally in its order
# (engine/trace/tracer.py); stage, war_barrier, sample and staged are the forward state's. A prefix send
# has no device_wait: this engine's transfer reads the pages once the host has seen the forward end.
EVENTS = declared(
    "prefill",
    *("admit", "alloc", "chunk_inc", "snapshot", "submit", "fwd_begin", "fwd_end", "fwd_done"),
    *("batch_copy", "collect", "prefix_send", "process_begin", "chunk_dec", "kv_send"),
    *("process_end", "release", "kv_delivered", "store_copied", "store_entry"),
    without={"prefix_send": ("device_wait",)},
)


class PrefillScheduler:
    def __init__(
        self,
        cfg: EngineConfig,
        requests: list[Req],
        *,
        tracer=None,
        receiver=None,
        model=None,
        on_ingest=None,
        probe=None,
    ):
        self.cfg = cfg
        self.tr = tracer or NullTracer()
        self.log = self.tr.events_for(**EVENTS)
        self._build_model_and_memory(model)
        # Streams, shared input buffers, future map (engine/runtime/forward_state.py). A batch's inputs are
        # pinned on a GPU (_build_batch).
        self.fwd_state = ForwardState(
            self.device,
            self.tr,
            "prefill",
            tokens=cfg.max_batch_tokens,
            requests=cfg.max_batch_reqs,
            vocab=self.mc.vocab_size,
            ids_dtype=torch.int32,
            pinned_inputs=True,
            script_ops=True,
            device_events=True,
        )
        self.sched_stream = self.fwd_state.sched_stream
        self.fwd_stream = self.fwd_state.fwd_stream
        self.copy_stream = self.fwd_state.copy_stream
        self.receiver = receiver or KVReceiverStore()
        self.transfer = TransferEngine(
            self.pool, self.receiver, device=self.device, mutants=cfg.inject
        )
        self.astore = AttentionStore(self.pool, self.copy_stream, cfg.inject)
        self._hook_completions()
        # An engine/oracle/judge.py OutputProbe when outputs are verified: admission reports each prefix
        # match to it, the AttentionStore each entry.
        self.probe = probe
        if probe is not None:
            self.astore.on_entry = probe.store_entry
        # PD: called for each request at intake, where a DP rank registers the room it serves with the
        # bootstrap server (SGLang does it when the request's KV sender is created).
        self.on_ingest = on_ingest

        self.arrivals = sorted(requests, key=lambda r: r.arrival_s)
        self.total = len(requests)
        self.inflight: list[Req] = []
        self.done: list[Req] = []
        self.stopping = False
        self.t0 = sync.now()
        self.stats = dict(batches=0, tokens=0, uncached_tokens=0, cached_tokens=0)
        self.admission = Admission(
            cfg,
            self.device,
            self.pool,
            self.req_to_token,
            self.cache,
            self.log,
            self.stats,
            self._release,
            probe,
        )
        self.waiting = self.admission.waiting  # the queue intake appends to

    def _hook_completions(self) -> None:
        """The transfer thread and the AttentionStore log their completions. The hooks hold the
        loggers only, not the scheduler (a cycle through it would keep a finished run alive until a
        full collection), and close() drops them."""
        log = self.log

        def copied(rids):
            for rid in rids:
                log.store_copied(rid)

        self.transfer.on_delivered = lambda req, start, tokens: log.kv_delivered(
            req.rid, req, start, tokens
        )
        self.astore.on_copied = copied
        self.astore.on_retired = log.store_entry

    def _build_model_and_memory(self, model) -> None:
        cfg = self.cfg
        self.device = torch.device(cfg.device)
        mc = cfg.model_config
        self.mc = mc
        dtype = getattr(torch, cfg.dtype)
        self.model = model or shared_model(cfg)
        self.backend = make_backend(cfg.attention_backend, self.device)
        self.pool = KVPool(
            cfg.num_pages, cfg.page_size, mc.layers, mc.kv_heads, mc.head_dim, dtype, self.device
        )
        self.req_to_token = ReqToTokenPool(cfg.max_slots, mc.max_context, self.device)
        self.cache = PrefixCache(self.pool)

    # ---- loop-top steps ------------------------------------------------------------------------
    def get_next_batch(self) -> ScheduleBatch | None:
        return self.admission.get_next_batch()

    def memory_stats(self) -> dict:
        return self.admission.memory_stats()

    def retire_ascache_writes(self) -> None:
        self.astore.retire()

    def ingest_requests(self) -> None:
        now = sync.now() - self.t0
        while self.arrivals and self.arrivals[0].arrival_s <= now:
            req = self.arrivals.pop(0)
            req.sender = KVSender(self.transfer, req.bootstrap_room, self.cfg.page_size)
            if self.on_ingest is not None:
                self.on_ingest(req)
            self.waiting.append(req)

    @property
    def finished_all(self) -> bool:
        return self.stopping or len(self.done) == self.total

    def stop(self) -> None:
        """Ask the loop to end (a PD run past its timeout): it admits nothing more, finishes the
        batch in flight and returns, so that close() does not race with it."""
        self.stopping = True

    def idle_wait(self) -> None:
        """Nothing to run: sleep until the next arrival or a short poll interval. With nothing left
        that could make progress (no arrival, no transfer in flight) unfinished requests are stuck:
        fail loudly instead of spinning forever."""
        progress = (len(self.done), self.admission.next_bid, len(self.arrivals))
        stalled, self._idle_mark = progress == getattr(self, "_idle_mark", None), progress
        if stalled and not self.arrivals and not self.inflight and not self.finished_all:
            stuck = [r.rid for r in self.waiting] + [r.rid for r in self.arrivals]
            held = [r.rid for r in (self.admission.chunked_req,) if r is not None]
            raise EngineError(
                f"stuck: {self.total - len(self.done)} request(s) can never finish "
                f"(waiting: {stuck or '-'}, chunked: {held or '-'}; e.g. a middle-chunk count that "
                f"never returned to zero, or memory that was never freed)"
            )
        delay = 0.0005
        if self.arrivals and not self.inflight:
            delay = max(0.0, min(0.01, self.arrivals[0].arrival_s - (sync.now() - self.t0)))
        sync.sleep(delay)

    # ---- the forward ---------------------------------------------------------------------------
    def stage(self, batch: ScheduleBatch) -> None:
        """Write the batch's inputs into the shared buffers, on the schedule stream, in order after
        the WAR barrier's wait for the previous forward's reads (engine/runtime/forward_state.py)."""
        self.fwd_state.stage(batch, batch.num_tokens)

    def snapshot(self, batch: ScheduleBatch) -> ScheduleBatch:
        """Thread modes: isolate what the worker reads from the next admission's mutations."""
        snap = snapshot_for_forward(batch, self.cfg.inject)
        if self.tr.enabled:
            # hashed later, by the worker (DigestStamp): not on this thread's critical path
            snap.digest_stamp = stamp = DigestStamp(snap, self.tr.obj)
            self.log.snapshot(snap.bid, stamp)
        return snap

    def run_batch(
        self, batch: ScheduleBatch, *, early_send_prefix: bool = True, sample_inline: bool = False
    ) -> ForwardResult:
        """Host-side run_batch(N): returns once the forward is launched, not when it has finished."""
        sampling = batch.sampling_info.copy_for_forward(
            self.cfg.inject
        )  # second call in thread modes: idempotent
        tracing = self.tr.enabled
        if tracing:
            fwd_stamp = self._stamp_forward(batch, sampling)
        if early_send_prefix:
            for req in batch.reqs:
                self.maybe_send_cached_prefix(batch, req)
        if batch.stage_event is None:
            self.stage(batch)
        done = self._launch_forward(batch)
        result = ForwardResult(
            batch.bid, len(batch.reqs), sampling.logit_bias, done_event=done, war_event=done
        )
        if inject.on(self.cfg.inject, "send-before-forward-done"):
            # MUTANT: chunk KV sent without waiting for the forward
            for i, req in enumerate(batch.reqs):
                if not batch.last_chunk[i]:
                    self._send(req, batch.starts[i] + batch.extends[i], None, last=False)
        if sample_inline:
            self.fwd_state.launch_sample(batch, result)
        if tracing:
            self.log.fwd_end(batch.bid)
            self._resolve_stamps(batch, fwd_stamp)
        return result

    def _stamp_forward(self, batch: ScheduleBatch, sampling: SamplingBatchInfo) -> DigestStamp:
        """What this forward reads, stamped now and resolved once it is launched (_resolve_stamps),
        with the snapshot's: while the batch is still the snapshot's, only the two logit biases are
        read."""
        stamp = DigestStamp(
            batch, self.tr.obj, sampling, marker="changed-in-launch", same_as=batch.digest_stamp
        )
        self.log.fwd_begin(batch.bid, stamp)
        return stamp

    def _resolve_stamps(self, batch: ScheduleBatch, fwd_stamp: DigestStamp) -> None:
        """The tracer's own work, after run_batch's end (not in the forward's span), before the
        scheduler can have the batch back: a change while run_batch read it shows here."""
        fwd_stamp.resolve()
        snap_stamp = batch.digest_stamp
        if snap_stamp is not None:  # not resolved with the forward's (they differed at fwd_begin):
            snap_stamp.resolve()  # now, so that it keeps nothing of the batch alive

    def _launch_forward(self, batch: ScheduleBatch):
        """The forward on the forward stream, after the batch's staging; returns its done event."""
        n, bs, ext = batch.num_tokens, len(batch.reqs), batch.extends
        start_loc = [0]
        for e in ext[:-1]:
            start_loc.append(start_loc[-1] + e)
        slots = [r.slot for r in batch.reqs]
        # Every torch call from Python lets the GIL go, and this thread may then wait for the
        # scheduler to hand it back before it can launch: the per-request metadata is one tensor
        # (rows as views), and the buffer views are made once per shape (ForwardState.views).
        req_slots, prefix_lens, extend_lens, extend_start_loc, logit_rows = torch.tensor(
            [slots, batch.starts, ext, start_loc, [s + e - 1 for s, e in zip(start_loc, ext)]],
            dtype=torch.int32,
            device=self.device,
        ).unbind()
        ids, pos, loc, out = self.fwd_state.views(n, bs)
        meta = ExtendMeta(
            req_to_token=self.req_to_token.table,
            req_slots=req_slots,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            extend_start_loc=extend_start_loc,
            max_extend_len=max(ext),
            out_cache_loc=loc,
            host_slots=slots,
            host_prefix=list(batch.starts),
            host_extend=list(ext),
        )
        self.fwd_stream.wait_event(batch.stage_event)

        def forward():
            self.model.forward(ids, pos, loc, self.pool, self.backend, meta, logit_rows, out=out)

        if self.fwd_stream.host_ordered:  # where its reads end: the WAR barrier's device half
            forward = then_log(forward, self.log.fwd_done, batch.bid)
        self.fwd_stream.launch(forward)
        if self.cfg.launch_cost_us:
            # Modelled as driver time (GIL released): the part of a launch Python threads can
            # overlap.
            for _ in range(self.mc.layers):
                time.sleep(self.cfg.launch_cost_us * 1e-6)
        return self.fwd_stream.record_event()

    def apply_war_barrier(self, batch: ScheduleBatch, result: ForwardResult) -> None:
        """Later writes to the shared buffers wait for forward N's reads
        (ForwardState.war_barrier)."""
        self.fwd_state.war_barrier(
            batch, result, wait=not inject.on(self.cfg.inject, "no-war-barrier")
        )

    def maybe_send_cached_prefix(self, batch: ScheduleBatch, req: Req) -> None:
        """The cached prefix's KV goes to decode before the suffix forward (it is already computed)."""
        if req.prefix_sent:
            return
        req.prefix_sent = True
        end = req.prefix_len
        req.sender.send(
            req,
            end,
            None,
            last=False,
            announce=lambda tokens, pages: self.log.prefix_send(
                batch.bid, req.rid, req, tokens, pages, end - tokens
            ),
        )

    # ---- deferred sampling ---------------------------------------------------------------------
    def launch_batch_sample_if_needed(self, batch: ScheduleBatch, result: ForwardResult) -> None:
        """Deferred sampling on the forward stream, hence only while no forward is being launched;
        logged once launched (ForwardState.launch_batch_sample)."""
        self.fwd_state.launch_batch_sample(batch, result)

    # ---- result processing ---------------------------------------------------------------------
    def process_batch_result(self, batch: ScheduleBatch, result: ForwardResult) -> None:
        self.log.process_begin(batch.bid)
        result.copy_event.synchronize()
        result.host_tokens = result.host_buf.tolist()
        self.fwd_state.check()
        if self.transfer.error is not None:
            raise EngineError(f"KV transfer failed: {self.transfer.error!r}")
        finished = []
        now = sync.now() - self.t0
        for i, req in enumerate(batch.reqs):
            end = batch.starts[i] + batch.extends[i]
            if req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                self.log.chunk_dec(req.rid, req, req.inflight_middle_chunks)
                if not inject.on(self.cfg.inject, "send-before-forward-done"):
                    self._send(req, end, result.done_event, last=False)
            else:
                req.output_token = result.host_tokens[i]
                req.first_token_s = now
                self._send(
                    req,
                    len(req.prompt),
                    result.done_event,
                    last=True,
                    meta={
                        "first_token": req.output_token,
                        "prompt_len": len(req.prompt),
                        "rid": req.rid,
                    },
                )
                finished.append(req)
        # The design's cross-request batched staging: one gather for every request whose prefill is
        # complete, before the AttentionStore write consumes the staging buffer.
        self.astore.stage([r for r in finished if r.inflight_middle_chunks <= 0], result.done_event)
        self.inflight.extend(finished)
        self.stats["uncached_tokens"] += batch.num_tokens
        self.log.process_end(batch.bid)

    def _send(self, req: Req, end: int, ready, *, last: bool, meta=None) -> None:
        req.sender.send(
            req,
            end,
            ready,
            last=last,
            meta=meta,
            announce=lambda tokens, pages: self.log.kv_send(
                req.rid, req, tokens, pages, end - tokens
            ),
        )

    def process_inflight_queue(self) -> None:
        """Release requests whose KV transfer and AttentionStore staging have completed."""
        still = []
        for req in self.inflight:
            # MUTANT: released once the last chunk is handed to the sender, not once delivered
            sent = (
                req.sender.sent_last
                if inject.on(self.cfg.inject, "release-before-delivery")
                else req.sender.poll()
            )
            if sent and (req.as_event is None or req.as_event.query()):
                if not req.released:
                    self._release(req)
                req.finished = True
                self.done.append(req)
            else:
                still.append(req)
        self.inflight = still

    def _release(self, req: Req, *, early: bool = False) -> None:
        self.log.release(req.rid, req, req.slot)
        self.req_to_token.free(req.slot)
        req.released = True
        if not early:
            req.slot = None
        n_full = len(req.prompt) // self.cfg.page_size
        rejected = self.cache.insert(req.prompt, req.pages[:n_full])
        self.pool.free(rejected + req.pages[n_full:])
        self.cache.unlock(req.prefix_nodes)
        req.prefix_nodes = []

    # ---- shutdown and accounting ---------------------------------------------------------------
    def close(self) -> None:
        self.astore.drain()
        self.fwd_state.close()
        self.transfer.close()
        # the trace keeps each Req (its `obj`), a Req its sender and so the transfer engine: the
        # loggers the hooks hold would close a cycle back to the tracer
        self.transfer.on_delivered = self.astore.on_copied = self.astore.on_retired = None
        self.admission.release = None  # its bound _release closes a cycle through this scheduler

    def leak_report(self) -> dict:
        """What is still held at the end; all zeros after a clean run."""
        return {
            "slots_in_use": self.req_to_token.num_slots - self.req_to_token.available,
            "pages_unaccounted": (self.pool.num_pages - 1)
            - self.pool.available
            - self.cache.cached_pages,
            "locked_cache_pages": self.cache.locked_pages,
            "inflight": len(self.inflight),
        }
