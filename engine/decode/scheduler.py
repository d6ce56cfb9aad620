"""The decode scheduler: intake, the prealloc and transfer queues, decode batches on the decode
attention path, deferred sampling through the future map, and the WAR barrier. The two event loops
that call these live in loops.py.

A request's KV arrives from the prefill DP rank the bootstrap server named and is written into this
instance's own paged pool (pages rounded up, as on the prefill side). Its first token comes with the
last chunk; every further token is one decode step. In the overlap loop batch N+1 is built before
batch N's tokens reach the host, so its inputs are references into the future map that the forward
resolves on the device stream, after sample(N) (SGLang's overlap scheduler does the same).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import torch

from engine import sync
from engine.decode.config import DecodeConfig
from engine.decode.prealloc import DecodePreallocQueue
from engine.decode.request import DecodeReq, ReceiverInit, ReqState, now
from engine.kv.transport import KVTransportError
from engine.runtime.attention import DecodeMeta, make_backend
from engine.runtime.config import EngineConfig
from engine.runtime.forward_state import ForwardResult, ForwardState
from engine.runtime.memory import KVPool, ReqToTokenPool, pages_for
from engine.runtime.model import shared_model
from engine.trace.tracer import NullTracer
from spec.vocabulary import declared


@dataclass
class DecodeBatch:
    bid: int
    reqs: list
    input_ids: torch.Tensor  # int64: token ids, or -(slot+1) for a future-map entry
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: list
    bias: torch.Tensor
    stage_event: object = None


EVENTS = declared(
    "decode",
    *("iter_begin", "alloc", "receiver_init", "kv_recv", "kv_done", "release", "req_done"),
    *("req_abort", "admit", "fwd_begin", "fwd_end", "process_begin", "process_end"),
    without={"req_abort": ("failed_rank",)},
)


class DecodeScheduler:
    def __init__(
        self,
        cfg: EngineConfig,
        dc: DecodeConfig,
        requests: list[DecodeReq],
        *,
        client,
        tracer=None,
        model=None,
        hooks=None,
    ):
        self.cfg, self.dc = cfg, dc
        self.tr = tracer or NullTracer()
        # The decode events, declared from spec/events.toml and logged positionally in its order
        # (engine/trace/tracer.py); stage, war_barrier and sample are the forward state's. An abort
        # that names a failed rank goes through emit (_abort).
        self.log = self.tr.events_for(**EVENTS)
        self.client = client
        self.hooks = hooks or {}
        self.device = torch.device(cfg.device)
        mc = self.mc = cfg.model_config
        dtype = getattr(torch, cfg.dtype)
        self.model = model or shared_model(cfg)
        self.backend = make_backend(cfg.attention_backend, self.device)
        self.ps = cfg.page_size
        self.pool = KVPool(
            dc.num_pages, self.ps, mc.layers, mc.kv_heads, mc.head_dim, dtype, self.device
        )
        self.req_to_token = ReqToTokenPool(dc.max_slots, mc.max_context, self.device)
        bs = self.bs = dc.max_running
        # Streams, shared input buffers, future map (engine/runtime/forward_state.py): a decode step's
        # inputs are one token per request, int64 for their future-map references.
        self.fwd_state = ForwardState(
            self.device,
            self.tr,
            "decode",
            tokens=bs,
            requests=bs,
            vocab=mc.vocab_size,
            ids_dtype=torch.int64,
            pinned_inputs=False,
            script_ops=False,
            on_sampled=self._refer_to_sampled,
        )
        fs = self.fwd_state
        self.sched_stream, self.fwd_stream, self.copy_stream = (
            fs.sched_stream,
            fs.fwd_stream,
            fs.copy_stream,
        )
        self.prealloc = DecodePreallocQueue(self, dc, self.tr, cfg.inject)

        self.arrivals = sorted(requests, key=lambda r: r.arrival_s)
        self.by_room = {r.room: r for r in requests}
        self.total = len(requests)
        self.transfer: list[DecodeReq] = []
        self.waiting: list[DecodeReq] = []
        self.running: list[DecodeReq] = []
        self.done: list[DecodeReq] = []
        self.aborted: list[DecodeReq] = []
        self.iter = 0
        # prefill ranks the transport reported failed, with why, and the requests each failure aborted
        self.failed_ranks: dict[int, str] = {}
        self.failed_aborts: dict[int, int] = {}
        self.stopping = False
        self._poll = 0
        self._next_bid = 0
        self.t0 = sync.now()
        # memory_waits: receiver inits that found no free slot or too few pages (the request waits)
        self.stats = dict(
            batches=0, decode_tokens=0, discarded_chunks=0, kv_pages=0, memory_waits=0
        )

    # ---- loop-top steps ------------------------------------------------------------------------
    def iter_begin(self) -> None:
        self.iter += 1
        self.log.iter_begin(self.iter)
        hook = self.hooks.get("iter")
        if hook:
            hook(self)

    def prefetch(self) -> None:
        if self.dc.prefetch:
            self.prealloc.prefetch_prefill_dp_rank_queries(self.iter)
        hook = self.hooks.get("after_prefetch")
        if hook:
            hook(self)

    def ingest_requests(self) -> None:
        if self.dc.recv_wait_us:
            sync.sleep(self.dc.recv_wait_us * 1e-6)
        t = sync.now() - self.t0
        while self.arrivals and self.arrivals[0].arrival_s <= t:
            self.prealloc.add(self.arrivals.pop(0))

    def process_decode_queue(self) -> None:
        """SGLang polls the prealloc and transfer queues every `polling_interval` iterations."""
        self._poll = (self._poll + 1) % self.dc.polling_interval
        if self._poll:
            return
        self.transfer.extend(self.prealloc.pop_preallocated())
        self.pop_transferred()

    @property
    def finished_all(self) -> bool:
        return self.stopping or len(self.done) + len(self.aborted) == self.total

    def stop(self) -> None:
        """Ask the loop to end (a PD run past its timeout): no new batch; the one in flight is
        processed, then the loop returns, so that close() does not race with it."""
        self.stopping = True

    def idle_wait(self) -> None:
        sync.sleep(0.0005)

    # ---- receivers and KV ------------------------------------------------------------------------
    def init_receiver(self, r: DecodeReq) -> ReceiverInit:
        """Preallocate the request's slot and pages, then pull its KV from the rank that holds it."""
        n_pages = pages_for(r.kv_need, self.ps)
        if r.kv_need > self.mc.max_context:
            self.abort(
                r,
                f"prompt + max_new_tokens = {r.kv_need} exceeds max_context {self.mc.max_context}",
            )
            return ReceiverInit.FAILED
        if self.req_to_token.available == 0 or self.pool.available < n_pages:
            self.stats["memory_waits"] += 1
            return ReceiverInit.NO_MEMORY
        r.slot = self.req_to_token.alloc()
        r.pages = self.pool.alloc(n_pages)
        n = n_pages * self.ps
        self.req_to_token.table[r.slot, :n] = self.pool.token_indices(r.pages, 0, n).to(self.device)
        self.log.alloc(r.rid, r, r.slot)
        self.log.receiver_init(r.room, r.prefill_dp_rank, r.rid)
        r.state, r.t_init = ReqState.TRANSFER, now()
        if r.prefill_dp_rank in self.failed_ranks:  # the routing stops at a dead rank
            r.state = ReqState.PENDING
            self._abort_failed(r, r.prefill_dp_rank)
            return ReceiverInit.FAILED
        try:
            self.client.pull(r.prefill_dp_rank, r.room)
        except KVTransportError as exc:
            r.state = ReqState.PENDING  # still queued: abort takes it out and frees its memory
            self.abort(r, str(exc))
            return ReceiverInit.FAILED
        return ReceiverInit.OK

    def reap_failed_ranks(self) -> None:
        """A prefill rank the transport reports failed (heartbeat lost, or the in-process rank
        killed): abort its requests whose KV has not all arrived, pending or in transfer, as SGLang
        aborts a receiver in KVPoll.Failed; their slots and pages are freed. Requests whose KV is
        complete are local now and go on decoding."""
        failed = getattr(self.client, "failed_ranks", dict)()
        for rank, why in failed.items():
            if rank in self.failed_ranks:
                continue
            self.failed_ranks[rank] = why
            self.failed_aborts.setdefault(rank, 0)
            pending = [r for r in self.prealloc.pending if r.prefill_dp_rank == rank]
            for r in [r for r in self.transfer if r.prefill_dp_rank == rank] + pending:
                self._abort_failed(r, rank)

    def _abort_failed(self, r: DecodeReq, rank: int) -> None:
        self.failed_aborts[rank] = self.failed_aborts.get(rank, 0) + 1
        self.abort(r, f"prefill rank {rank} failed: {self.failed_ranks[rank]}", failed_rank=rank)

    def pop_transferred(self) -> None:
        self.reap_failed_ranks()
        while True:
            try:
                rank, chunk = self.client.inbox.get_nowait()
            except queue.Empty:
                break
            r = self.by_room.get(chunk.room)
            if r is None or r.state is not ReqState.TRANSFER:
                self.stats["discarded_chunks"] += 1  # the request was aborted meanwhile
                continue
            problem = self._check_chunk(r, rank, chunk)
            if problem:
                self.abort(r, problem)
                continue
            self._write_kv(r, chunk)
        t = now()
        for r in list(self.transfer):
            if r.meta is not None and r.kv_tokens == r.prompt_len:
                self._transfer_done(r)
            elif t - r.t_init > self.dc.kv_timeout_s:
                self.abort(
                    r,
                    f"KV of room {r.room} incomplete after {self.dc.kv_timeout_s:g} s "
                    f"({r.kv_tokens}/{r.prompt_len} tokens from rank {r.prefill_dp_rank})",
                )

    def _check_chunk(self, r: DecodeReq, rank: int, chunk) -> str | None:
        tokens = chunk.k.shape[1]
        if rank != r.prefill_dp_rank:
            return f"room {r.room}: KV from rank {rank}, receiver initialised for rank {r.prefill_dp_rank}"
        if (
            chunk.start % self.ps
            or chunk.pages != pages_for(tokens, self.ps)
            or chunk.start + tokens > r.prompt_len
        ):
            return (
                f"room {r.room}: malformed KV chunk (start {chunk.start}, {tokens} tokens, {chunk.pages} pages, "
                f"page size {self.ps}, prompt {r.prompt_len})"
            )
        if chunk.last and (
            chunk.meta.get("rid") != r.rid or chunk.meta.get("prompt_len") != r.prompt_len
        ):
            return f"room {r.room}: metadata {chunk.meta} does not match request {r.rid}"
        return None

    def _write_kv(self, r: DecodeReq, chunk) -> None:
        """Into this instance's pool, on the schedule stream: the forward that first reads these pages
        waits for a later staging event on the same stream."""
        tokens = chunk.k.shape[1]
        idx = self.pool.token_indices(r.pages, chunk.start, chunk.start + tokens)
        k, v, dev, dtype = chunk.k, chunk.v, self.device, self.pool.k.dtype
        if (
            dev.type == "cuda"
        ):  # pinned: asynchronous copies (from pageable memory the launching thread
            # would wait for the barrier); chunks from the in-process transfer already are (no copy then)
            idx, k, v = idx.pin_memory(), k.pin_memory(), v.pin_memory()

        def write():
            i = idx.to(dev, non_blocking=True).long()
            self.pool.k[:, i] = k.to(dev, dtype, non_blocking=True)
            self.pool.v[:, i] = v.to(dev, dtype, non_blocking=True)

        self.sched_stream.launch(write)
        r.kv_tokens += tokens
        r.kv_pages += chunk.pages
        self.stats["kv_pages"] += chunk.pages
        if chunk.last:
            r.meta = dict(chunk.meta)
        self.log.kv_recv(r.room, r.prefill_dp_rank, chunk.start, tokens, chunk.pages)

    def _transfer_done(self, r: DecodeReq) -> None:
        self.transfer.remove(r)
        first = int(r.meta["first_token"])
        r.output, r.n_gen, r.last_ref, r.seq_len = [first], 1, first, r.prompt_len
        self.log.kv_done(r.room, r.rid, first)
        if r.n_gen >= r.max_new_tokens:
            self._finish(r)
        else:
            r.state = ReqState.WAITING
            self.waiting.append(r)

    # ---- ends of a request -------------------------------------------------------------------------
    def _free(self, r: DecodeReq) -> None:
        if r.slot is not None:
            self.log.release(r.rid, r, r.slot)
            self.req_to_token.free(r.slot)
            self.pool.free(r.pages)
            r.slot, r.pages = None, []

    def _finish(self, r: DecodeReq) -> None:
        self._free(r)
        if r in self.running:
            self.running.remove(r)
        r.state = ReqState.DONE
        self.done.append(r)
        self.log.req_done(r.rid, r.room, len(r.output))

    def abort(self, r: DecodeReq, reason: str, failed_rank: int | None = None) -> None:
        """Abort from any state. A request inside an unprocessed decode batch is finished when that
        batch has been processed (its pages are still being read)."""
        if r.state.over:
            return
        if r.state is ReqState.RUNNING and r.inflight > 0:
            r.abort_requested = r.abort_requested or reason
            return
        if r.state is ReqState.PENDING:
            self.prealloc.remove(r)
            if failed_rank is None:
                self._drop_unpulled(r)
        elif r.state is ReqState.TRANSFER:
            self.transfer.remove(r)
            if failed_rank is None:  # a dead rank has nothing to drop
                self.client.drop(r.prefill_dp_rank, r.room)
        elif r.state is ReqState.WAITING:
            self.waiting.remove(r)
        elif r.state is ReqState.RUNNING:
            self.running.remove(r)
        elif r.state is ReqState.NEW:
            self.arrivals.remove(r)
        self._free(r)
        r.state, r.error = ReqState.ABORTED, reason
        self.aborted.append(r)
        if failed_rank is None:
            self.log.req_abort(r.rid, r.room, reason)
        else:  # the optional field names the failed rank (the cross-process rules exempt it)
            self.tr.emit(
                "req_abort", rid=r.rid, room=r.room, reason=reason, failed_rank=failed_rank
            )

    def _drop_unpulled(self, r: DecodeReq) -> None:
        """A prefill rank keeps a room's KV until decode pulls or drops it: a request aborted before
        its pull must drop it, or it stays there for good. Rank still unknown: every rank of that
        prefill drops the room (only one has it); nothing to do before its parallel info is known."""
        if r.prefill_dp_rank is not None:
            ranks = [r.prefill_dp_rank]
        else:
            ranks = range(self.prealloc.prefill_info_table.get(r.addr, {}).get("dp_size") or 0)
        for rank in ranks:
            self.client.drop(rank, r.room)

    # ---- decode batches ----------------------------------------------------------------------------
    def get_next_batch(self) -> DecodeBatch | None:
        for r in [r for r in self.running if r.abort_requested and r.inflight == 0]:
            self.abort(r, r.abort_requested)
        while self.waiting and len(self.running) < self.bs:
            r = self.waiting.pop(0)
            r.state = ReqState.RUNNING
            self.running.append(r)
        reqs = [r for r in self.running if r.n_gen < r.max_new_tokens and not r.abort_requested]
        if not reqs:
            return None
        bid = self._next_bid
        self._next_bid += 1
        ids = torch.tensor([r.last_ref for r in reqs], dtype=torch.int64)
        pos = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32)
        loc = torch.stack([self.req_to_token.table[r.slot, r.seq_len] for r in reqs]).to("cpu")
        bias = torch.zeros((len(reqs), self.mc.vocab_size), dtype=torch.float32)
        for i, r in enumerate(reqs):
            for tok, b in (r.logit_bias or {}).items():
                bias[i, tok] = b
        for r in reqs:
            r.seq_len += 1
            r.n_gen += 1
            r.inflight += 1
        batch = DecodeBatch(
            bid, reqs, ids, pos, loc, [r.seq_len for r in reqs], bias.to(self.device)
        )
        self.log.admit(bid, [r.rid for r in reqs])
        self.stats["batches"] += 1
        return batch

    def stage(self, batch: DecodeBatch) -> None:
        """Inputs into the shared buffers on the schedule stream, which is in order after the WAR
        barrier's wait for the previous forward (engine/runtime/forward_state.py)."""
        self.fwd_state.stage(batch, len(batch.reqs))

    def run_batch(self, batch: DecodeBatch, *, sample_inline: bool = False) -> ForwardResult:
        self.log.fwd_begin(batch.bid)
        self.stage(batch)
        bs, dev, state = len(batch.reqs), self.device, self.fwd_state
        slots = [r.slot for r in batch.reqs]
        meta = DecodeMeta(
            req_to_token=self.req_to_token.table,
            req_slots=torch.tensor(slots, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=dev),
            out_cache_loc=state.buf_loc[:bs],
            host_slots=slots,
            host_seq_lens=list(batch.seq_lens),
        )
        rows = torch.arange(bs, device=dev)
        self.fwd_stream.wait_event(batch.stage_event)

        def forward():
            ids = state.buf_ids[:bs]
            # Inputs sampled by the previous step are still on the device: resolve them here, on the
            # forward stream, after that step's sampling.
            ids = torch.where(ids < 0, state.future_map[(-ids - 1).clamp(min=0)], ids)
            logits = self.model.forward(
                ids,
                state.buf_pos[:bs],
                state.buf_loc[:bs],
                self.pool,
                self.backend,
                meta,
                rows,
                decode=True,
            )
            state.logits_buf[:bs].copy_(logits)

        self.fwd_stream.launch(forward)
        done = self.fwd_stream.record_event()
        result = ForwardResult(batch.bid, bs, batch.bias, done_event=done, war_event=done)
        if sample_inline:
            state.launch_sample(batch, result)
        self.log.fwd_end(batch.bid)
        return result

    def apply_war_barrier(self, batch: DecodeBatch, result: ForwardResult) -> None:
        """Later writes to the shared buffers wait for forward N's reads
        (ForwardState.war_barrier)."""
        self.fwd_state.war_barrier(batch, result)

    def launch_batch_sample_if_needed(self, batch: DecodeBatch, result: ForwardResult) -> None:
        """Deferred sampling, logged once launched: the whole launch precedes F(N+1)
        (ForwardState.launch_batch_sample)."""
        self.fwd_state.launch_batch_sample(batch, result)

    def _refer_to_sampled(self, batch: DecodeBatch, result: ForwardResult, slots) -> None:
        """The batch's requests go on from their sampled tokens, still on the device: the next
        batch's inputs are references -(slot + 1) into the future map."""
        result.refs = [-(int(s) + 1) for s in slots]
        for r, ref in zip(batch.reqs, result.refs):
            r.last_ref = ref

    def process_batch_result(self, batch: DecodeBatch, result: ForwardResult) -> None:
        self.log.process_begin(batch.bid)
        result.copy_event.synchronize()
        self.fwd_state.check()
        for r, tok, ref in zip(batch.reqs, result.host_buf.tolist(), result.refs):
            r.inflight -= 1
            r.output.append(int(tok))
            self.stats["decode_tokens"] += 1
            if r.last_ref == ref:
                r.last_ref = int(
                    tok
                )  # the future-map slot will be reused: keep the value on the host
            if r.abort_requested and r.inflight == 0:
                self.abort(r, r.abort_requested)
            elif len(r.output) >= r.max_new_tokens:
                self._finish(r)
        self.log.process_end(batch.bid)

    # ---- memory occupation, shutdown, accounting ---------------------------------------------------
    def release_memory_occupation(self) -> None:
        self.prealloc.release_memory_occupation()

    def resume_memory_occupation(self) -> None:
        self.prealloc.resume_memory_occupation()

    def close(self) -> None:
        self.prealloc.close()
        self.fwd_state.close()

    def leak_report(self) -> dict:
        return {
            "slots_in_use": self.req_to_token.num_slots - self.req_to_token.available,
            "pages_unaccounted": (self.pool.num_pages - 1) - self.pool.available,
            "pending": len(self.prealloc.pending),
            "queries_in_flight": len(self.prealloc._queries),
            "unfinished": self.total - len(self.done) - len(self.aborted),
        }
