"""The decode lifecycle x fault matrix: each cell puts one request in a lifecycle state, makes the
transfer layer report one failure there, and checks the lifecycle invariants (lifecycle.py) at every
iteration; the trace is judged by the rules (D-request-ends and the others).

What runs is SGLang's own code: the real decode loops (`event_loop_{normal,overlap}_disagg_decode`),
`Scheduler.process_decode_queue`, and in it `DecodePreallocQueue.pop_preallocated` (the resolve, the
handshake poll, the abort sweep, the memory admission, `_pre_alloc` on SGLang's req_to_token pool and
paged KV allocator, `_send_kv_metadata` with SGLang's metadata buffers and slot allocator) and
`DecodeTransferQueue.pop_transferred` (the poll with its metadata gate, the failure and commit
paths); requests enter through `Scheduler._add_request_to_queue`, client aborts through
`Scheduler.abort_request`, the retraction through `Scheduler.pause_generation(mode="retract")` and
`continue_generation`; `Scheduler.is_fully_idle` is the idleness report checked.

Stand-ins, and why: the KV receiver is SGLang's fake backend's receiver with scripted polls
(faults.py: the transport); the DP-rank queries go over HTTP to `pdo bootstrap` on loopback (as in
decode_scenarios.py); the decode forward is not run (no model): a request whose KV arrived decodes
for DECODE_STEPS iterations and finishes, its KV given back by SGLang's `release_kv_cache`; the
outputs and the tokenizer socket are recorders; the prefill's recompute of a re-bootstrapped request
is a recorder (it is a message to the prefill). The scheduler is made with `__new__` and given what
these methods read, as SGLang's unit tests do.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types

from engine.bootstrap import client as bootstrap_client
from engine.sglang import decode as decode_hooks
from engine.sglang import hooks, mutate, sglang_server
from engine.sglang.conform import compat, decode_context, faults, lifecycle
from engine.sglang.conform.decode_scenarios import _kv_manager, _Server
from engine.sglang.conform.faults import Fault, Phase
from engine.sglang.conform.prefill_releases import cpu_kernels
from engine.sglang.conform.reachable import assert_reachable
from engine.sglang.sink import LoopExit, TraceSink

PAGE_SIZE, KV_TOKENS, MAX_RUNNING = 16, 512, 4
DECODE_STEPS = 4  # iterations a request decodes, in the stand-in, before it finishes
MAX_ITERS = 80
CONTEXT = 512  # the model's max_position_embeddings (prefill_scheduler._MODEL)


class _LoopEnd(LoopExit):
    """Leaves a decode loop of a release whose loop does not read gracefully_exit (before 0.5.21)."""


class NotReached(RuntimeError):
    """The cell's request never reached its state: the harness's script is wrong, not SGLang."""


class State(enum.Enum):
    DP_PENDING = "dp-pending"  # in pending_reqs: its prefill DP rank is not known yet
    HANDSHAKE = "handshake"  # receiver initialised, the handshake not done
    PREALLOC_BLOCKED = "prealloc-blocked"  # WaitingForInput, no KV memory for it yet
    TRANSFERRING = "transferring"  # metadata sent, KV arriving
    RETRACTED = "retracted"  # retracted by pause_generation(retract), held for re-bootstrap
    PAUSED = "paused"  # queued while the engine is paused in place


@dataclasses.dataclass
class Plan:
    """The transport's script for one room, and what the oracle reads of it."""

    handshake_polls: int = 0
    transfer_polls: int = 1
    fault_name: str = ""
    arm_next: Fault | None = None  # arm the next receiver made for this room (re-bootstrap)
    req: object = None
    receivers: list = dataclasses.field(default_factory=list)
    pages: list = dataclasses.field(default_factory=list)
    buffers: object = None

    def write_metadata(self, receiver) -> None:
        """The prefill's last write: the request's metadata row (first token, room)."""
        idx = receiver.metadata_index
        self.buffers.output_ids[idx][0] = 7
        self.buffers.bootstrap_room[idx][0] = receiver.room


@dataclasses.dataclass(frozen=True)
class Cell:
    state: State
    fault: Fault | None  # None: the state is passed through, nothing fails

    @property
    def name(self) -> str:
        return f"decode-life/{self.state.value}/{self.fault.value if self.fault else 'none'}"


CELLS = [Cell(s, f) for s in State for f in (None, *Fault)]


class LifeHarness:
    def __init__(self, sgl, cell: Cell, mode: str):
        self.sgl, self.cell, self.mode = sgl, cell, mode
        self.iteration, self.injected = 0, False
        # pdo's bootstrap server where it speaks this release's wire, else the release's own
        self.server = _Server(sgl, not sglang_server.wire_matches(sgl))
        self.server.publish(2)
        self.plans: dict[int, Plan] = {}
        self.running_left: dict[str, int] = {}
        self.trace_ends: set = set()
        self.resume_at = None

    # ---- the scheduler -----------------------------------------------------------------------
    def _build(self):
        sgl, d = self.sgl, self.sgl.decode
        import torch
        from sglang.srt.disaggregation.utils import (  # lazy: SGLang is optional
            ReqToMetadataIdxAllocator,
            TransferBackend,
        )
        from sglang.srt.distributed import parallel_state
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        ComponentType = compat.lookup("ComponentType")
        make = compat.make
        # what the queues took as arguments before they read the runtime context (0.5.17)
        old_args = dict(gloo_group=parallel_state.get_tp_group().cpu_group, tp_rank=0)

        s = self.sched = sgl.scheduler.Scheduler.__new__(sgl.scheduler.Scheduler)
        s.req_to_token_pool = make(
            d.DecodeReqToTokenPool,
            size=MAX_RUNNING,
            max_context_len=512,
            device="cpu",
            enable_memory_saver=False,
            pre_alloc_size=0,
        )
        kv_pool = make(
            MHATokenToKVPool,
            size=KV_TOKENS,
            page_size=PAGE_SIZE,
            dtype=torch.float32,
            head_num=1,
            head_dim=4,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        s.token_to_kv_pool_allocator = make(
            PagedTokenToKVPoolAllocator,
            size=KV_TOKENS,
            page_size=PAGE_SIZE,
            dtype=torch.float32,
            device="cpu",
            kvcache=kv_pool,
            need_sort=False,
        )
        s.tree_cache = UnifiedRadixCache(
            make(
                CacheInitParams,
                disable=True,
                req_to_token_pool=s.req_to_token_pool,
                token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
                page_size=PAGE_SIZE,
                tree_components=(ComponentType.FULL,),
            )
        )
        s.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(MAX_RUNNING * 2)
        s.disagg_metadata_buffers = make(
            d.MetadataBuffers,
            size=MAX_RUNNING * 2,
            hidden_size=16,
            hidden_states_dtype=torch.float32,
            max_sampling_mask_tokens=getattr(self.server_args, "sampling_mask_max_tokens", 0),
            custom_mem_pool=None,
            output_dsa_topk_indices_dim=0,
            kv_checksum_enabled=False,
        )
        self._plain_settings(s)
        s.spec_algorithm = SpeculativeAlgorithm.from_string(None)
        s.disagg_decode_transfer_queue = make(
            d.DecodeTransferQueue,
            **old_args,
            req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=s.disagg_metadata_buffers,
            scheduler=s,
            tree_cache=s.tree_cache,
        )
        mgr = self.mgr = _kv_manager(sgl.conn)
        mgr.plans, mgr.enable_deferred_decode_kv_release = self.plans, False
        mgr.recomputes = []
        mgr.submit_prefill_recompute = lambda receiver, payload: mgr.recomputes.append(receiver)
        with mutate.swapped(d.DecodePreallocQueue, "_init_kv_manager", lambda queue: mgr):
            s.disagg_decode_prealloc_queue = make(
                d.DecodePreallocQueue,
                **old_args,
                tp_size=1,
                dp_size=1,
                pp_rank=0,
                req_to_token_pool=s.req_to_token_pool,
                token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
                draft_token_to_kv_pool=None,
                req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator,
                metadata_buffers=s.disagg_metadata_buffers,
                scheduler=s,
                transfer_queue=s.disagg_decode_transfer_queue,
                tree_cache=s.tree_cache,
                gpu_id=0,
                bootstrap_port=0,
                max_total_num_tokens=KV_TOKENS,
                num_reserved_decode_tokens=16,
                transfer_backend=TransferBackend.MOONCAKE,
            )
        s.disagg_decode_prealloc_queue._ensure_retry_interval = 0.0
        self.ledger = lifecycle.Ledger(s)
        self.capacity = lifecycle.capacity(s)

    def _plain_settings(self, s) -> None:
        """The flags and stand-ins the decode paths read (features off, as by default)."""
        from sglang.srt.disaggregation.utils import DisaggregationMode  # lazy: optional

        outputs = types.SimpleNamespace(send_output=self._sent)
        s.__dict__.update(
            server_args=self.server_args,  # what the queue reads before 0.5.17 (after: get_disagg())
            gracefully_exit=False,
            _engine_paused=False,
            _pause_started_at=None,
            _pause_intervals=[],
            disaggregation_mode=DisaggregationMode.DECODE,
            running_batch=types.SimpleNamespace(reqs=[], batch_is_full=False),
            waiting_queue=[],
            chunked_req=None,
            last_batch=None,
            cur_batch_for_debug=None,
            cur_batch=None,  # read by is_fully_idle before 0.5.14
            # the scheduler's parallel layout as is_fully_idle reads it before 0.5.17
            ps=types.SimpleNamespace(pp_size=1, tp_size=1, tp_rank=0, dp_size=1, dp_rank=0),
            _sched_idled=False,
            page_size=PAGE_SIZE,
            enable_overlap=self.mode == "overlap",
            enable_priority_scheduling=False,
            abort_on_priority_when_disabled=False,
            enable_hisparse=False,
            enable_lora=False,
            enable_decode_hicache=False,
            enable_hierarchical_cache=False,
            enable_lmcache=False,
            enable_overlap_mlx=False,
            decode_offload_manager=None,
            hisparse_coordinator=None,
            mm_receiver=None,
            dllm_config=None,
            rust_server=None,
            random_seed=0,
            scheduler_stage_metrics=None,
            enable_continuous_input_polling=False,
            tp_worker=types.SimpleNamespace(
                is_hybrid_swa=False, model_runner=types.SimpleNamespace(kv_cache_dtype_str="auto")
            ),
            dllm_manager=types.SimpleNamespace(any_staging_reqs=lambda: False),
            grammar_manager=types.SimpleNamespace(grammar_queue=[], abort_requests=lambda r: None),
            beam_coordinator=types.SimpleNamespace(retire_group=lambda req: None),
            metrics_reporter=types.SimpleNamespace(
                enable_metrics=False,
                last_gen_throughput=0.0,
                current_scheduler_metrics_enabled=False,
            ),
            kv_events_publisher=types.SimpleNamespace(publish_kv_events=lambda: None),
            # the reasoning-token count of the committed first token (no reasoning parser here)
            batch_result_processor=types.SimpleNamespace(
                _maybe_update_reasoning_tokens=lambda *a, **k: None
            ),
            ipc_channels=types.SimpleNamespace(send_to_tokenizer=outputs),
            output_streamer=types.SimpleNamespace(stream_output=self._stream),
            ngram_embedding_manager=types.SimpleNamespace(
                prepare_for_forward=lambda b, chunked_req=None: b
            ),
            **decode_context.intake_state(self._recv, self._ingest),
            _war_barrier_enabled=False,
            get_next_disagg_decode_batch_to_run=self._decode_step,
            is_disable_overlap_for_batch=lambda batch, last_batch=None: False,
            launch_batch_sample_if_needed=lambda result, batch=None: None,  # batch: 0.5.16 on
            on_idle=self._idle,
            _record_scheduler_state_for_paused_engine=lambda: None,
        )
        s.running_batch.is_empty = lambda: not s.running_batch.reqs

    # ---- what leaves the scheduler: the end of a request -------------------------------------
    def _stream(self, reqs, return_logprob=False):
        for req in reqs:
            if req.finished():
                self._ended(req)

    def _sent(self, obj, req=None):
        if req is not None:
            self._ended(req)

    def _ended(self, req) -> None:
        if self.ledger.end(req.rid) and req.rid not in self.trace_ends:
            self.trace_ends.add(req.rid)
            abort = type(req.finished_reason).__name__ == "FINISH_ABORT"
            ev = "req_abort" if abort else "req_done"
            extra = {"reason": str(req.finished_reason.message)} if abort else {"tokens": 1}
            hooks.active().emit(ev, rid=req.rid, room=req.bootstrap_room, **extra)

    # ---- the script --------------------------------------------------------------------------
    TARGET = "r101"

    def _req(self, rid: str, room: int, length: int):
        from array import array  # lazy: SGLang is optional

        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=8, temperature=0.0)
        params.normalize(None)
        return Req(
            rid,
            "",
            array("q", [3 + (room + i) % 200 for i in range(length)]),
            params,
            bootstrap_host=self.server.host,
            bootstrap_port=self.server.port,
            bootstrap_room=room,
            vocab_size=256,
            disagg_mode=DisaggregationMode.DECODE,
        )

    def _arrive(self, rid: str, room: int, length: int, plan: Plan) -> None:
        plan.buffers = self.sched.disagg_metadata_buffers
        self.plans[room] = plan
        req = plan.req = self._req(rid, room, length)
        self.ledger.admitted.add(rid)
        # handle_generate_request refuses a prompt of max_req_input_len tokens or more
        # (min(context, KV) - 1 - 5) before it queues one
        assert_reachable(
            "Scheduler._add_request_to_queue", length < min(CONTEXT, KV_TOKENS) - 6, rid
        )
        self.sched._add_request_to_queue(req)  # SGLang's intake into the prealloc queue

    def _register(self, room: int) -> None:
        bootstrap_client.register_dp_rank(self.server.url, room, room % 2)

    def _script(self) -> None:
        """Arrivals and the other clients' calls of this iteration, per the cell's state."""
        state, n, io = self.cell.state, self.iteration, self.sgl_io
        plan = Plan(
            handshake_polls=4 if state is State.HANDSHAKE else 0,
            transfer_polls=4 if state is State.TRANSFERRING else 1,
            fault_name=self.cell.fault.value if self.cell.fault else "",
        )
        if state is State.PREALLOC_BLOCKED:
            if n == 1:  # a long request that holds most of the KV memory while it decodes
                self._register(100)
                self._arrive("r100", 100, 330, Plan(transfer_polls=1))
            if n == 2:
                self._register(101)
                self._arrive(self.TARGET, 101, 200, plan)
        elif state is State.PAUSED:
            if n == 1:
                self.sched.pause_generation(io.PauseGenerationReqInput(mode="in_place"))
            if n == 2:
                self._register(101)
                self._arrive(self.TARGET, 101, 40, plan)
            if n == 5:
                self.sched.continue_generation(
                    io.ContinueGenerationReqInput(torch_empty_cache=False)
                )
        elif n == 1:
            if state is not State.DP_PENDING:
                self._register(101)
            self._arrive(self.TARGET, 101, 40, plan)
        if state is State.DP_PENDING and n == 5 and self.cell.fault is not Fault.PEER_GONE:
            self._register(101)  # the prefill takes the room late
        if state is State.RETRACTED:
            running = [r.rid for r in self.sched.running_batch.reqs]
            if self.TARGET in running and not self.injected and self.resume_at is None:
                self.sched.pause_generation(io.PauseGenerationReqInput(mode="retract"))
                self.resume_at = n + 2
            if self.resume_at == n:
                self.sched.continue_generation(
                    io.ContinueGenerationReqInput(torch_empty_cache=False)
                )

    def _target_in_state(self) -> bool:
        q, s, t = self.sched.disagg_decode_prealloc_queue, self.sched, self.TARGET
        queued = [d for d in q.queue if d.req.rid == t]
        state = self.cell.state
        if state is State.DP_PENDING:
            return any(d.req.rid == t for d in q.pending_reqs)
        if state is State.HANDSHAKE:
            return any(d.kv_receiver.phase is Phase.BOOTSTRAPPING for d in queued)
        if state is State.PREALLOC_BLOCKED:
            return any(d.waiting_for_input for d in queued)
        if state is State.TRANSFERRING:
            moving = [d for d in s.disagg_decode_transfer_queue.queue if d.req.rid == t]
            return any(d.kv_receiver.phase is Phase.TRANSFERRING for d in moving)
        if state is State.RETRACTED:
            return any(r.rid == t for r in self._held())
        return s._engine_paused and bool(queued)

    def _inject(self) -> None:
        fault, plan = self.cell.fault, self.plans.get(101)
        if fault is None or self.injected or plan is None or not self._target_in_state():
            return
        self.injected = True
        hooks.active().emit(
            "x.fault", rid=self.TARGET, state=self.cell.state.value, fault=fault.value
        )
        if fault is Fault.CLIENT_ABORT:
            self.sched.abort_request(self.sgl_io.AbortReq(rid=self.TARGET))
            return
        if fault is Fault.PEER_GONE:
            self.server.stop()
            self.server_stopped = True
        live = [r for r in plan.receivers if not r.cleared and r.phase is not Phase.DONE]
        if live:
            faults.arm(live[-1], fault)
        else:
            plan.arm_next = fault

    def _ingest(self, *args, **kwargs):
        """ingest_requests (0.5.20 on): the iteration's script; on 0.5.20, whose loops have no
        other iteration marker, then SGLang's own process_input_requests, as ingest_requests runs
        it."""
        recv = self._recv()
        if not self.loop_reads_exit:
            type(self.sched).process_input_requests(self.sched, recv)
        return recv

    def _recv(self, *args, **kwargs):
        """The top of an iteration (before 0.5.20, the loop's recv_requests; SGLang's
        process_input_requests then runs on what it returns). Loops before 0.5.21 never leave on
        their own: the harness leaves them here once the run is over."""
        if not self.loop_reads_exit and (
            self.sched.gracefully_exit or self.iteration >= MAX_ITERS + 5
        ):
            raise _LoopEnd
        self.iteration += 1
        self._check(f"iteration {self.iteration}")
        self._script()
        self._inject()
        return []

    def _held(self) -> list:
        """The requests retracted and held for re-bootstrap (0.5.16 on; before, none are held)."""
        return getattr(self.sched.disagg_decode_prealloc_queue, "held_rebootstrap_reqs", [])

    def _check(self, where: str) -> None:
        held = {r.rid for r in self._held()}
        receivers = [r for p in self.plans.values() for r in p.receivers]
        self.ledger.check(receivers, self.sched.is_fully_idle(), where, exempt=held)

    # ---- the decode forward's stand-in -------------------------------------------------------
    def _decode_step(self, running_batch=None):  # the argument from 0.5.16
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH  # lazy: optional
        from sglang.srt.mem_cache.common import release_kv_cache

        s = self.sched
        for req in s.waiting_queue:
            hooks.active().emit("kv_done", room=req.bootstrap_room, rid=req.rid, first_token=0)
            s.running_batch.reqs.append(req)
            # the long request of prealloc-blocked holds its memory 6 iterations longer
            self.running_left[req.rid] = DECODE_STEPS + (6 if req.rid == "r100" else 0)
        s.waiting_queue.clear()
        for req in list(s.running_batch.reqs):
            self.running_left[req.rid] -= 1
            if self.running_left[req.rid] <= 0:
                req.finished_reason = FINISH_LENGTH(length=1)
                s.running_batch.reqs.remove(req)
                # checkpoint: an argument of later releases
                release_kv_cache(
                    req, s.tree_cache, **compat.accepted(release_kv_cache, {"checkpoint": False})
                )
                self._ended(req)
        if not self.loop_reads_plan:  # before 0.5.16 the loop reads a batch: none is run
            return None
        return types.SimpleNamespace(running_batch=s.running_batch, batch_to_run=None)

    def _idle(self):
        settled = self.iteration >= 6 and not self.ledger.alive() and not self._held()
        if settled or self.iteration >= MAX_ITERS:
            self.sched.gracefully_exit = True

    # ---- the run -----------------------------------------------------------------------------
    def run(self, trace_path: str) -> str:
        from sglang.srt.managers import io_struct  # lazy: SGLang is optional

        self.sgl_io, self.server_stopped = io_struct, False
        decode = self.sgl.decode
        loop = getattr(
            decode.SchedulerDisaggregationDecodeMixin, f"event_loop_{self.mode}_disagg_decode"
        )
        self.loop_reads_exit = decode_hooks.reads_gracefully_exit(self.sgl)
        self.loop_reads_plan = "plan = self.get_next_disagg_decode_batch_to_run" in (
            inspect.getsource(decode_hooks.unwrap(loop))
        )
        real_get_kv_class = decode.get_kv_class
        try:
            with decode_context.published(
                PAGE_SIZE, MAX_RUNNING, KV_TOKENS, context_length=CONTEXT
            ) as server_args:
                self.server_args = server_args
                self._build()
                receiver_class = faults.receiver_class()
                # before 0.5.22 the queue calls the receiver's init itself: the adapter hooks it
                decode_hooks.hook_receiver(receiver_class)
                decode.get_kv_class = lambda backend, kind: receiver_class
                with hooks.tracing(TraceSink(trace_path)), cpu_kernels():
                    try:
                        loop(self.sched)
                    except _LoopEnd:
                        pass
                    except Exception:
                        # SGLang raised: the invariants at that point come first when they fail
                        self._check("SGLang raised")
                        if self.ledger.found:
                            raise lifecycle.Violations(self.ledger.found) from None
                        raise
                self._check("the end")
                if self.cell.fault is not None and not self.injected:
                    raise NotReached(f"{self.cell.name}: the request never reached the state")
                receivers = [r for p in self.plans.values() for r in p.receivers]
                self.ledger.finish(receivers, self.capacity)
        finally:
            decode.get_kv_class = real_get_kv_class
            if not self.server_stopped:
                self.server.stop()
        return trace_path


# state -> the SGLang entry point that puts a request in it, where not every release has one
NEEDS = {State.RETRACTED: "DecodePreallocQueue.hold_rebootstrap"}  # re-bootstrap: 0.5.16 on


def missing(sgl, cell: Cell) -> list[str]:
    """The entry points the cell needs that this release lacks."""
    need = NEEDS.get(cell.state)
    owner, _, method = (need or "").partition(".")
    return [need] if need and not hasattr(getattr(sgl.decode, owner), method) else []


def inapplicable(sgl) -> dict[str, list[str]]:
    """Cell -> the entry points it needs that this release lacks (it is not run there)."""
    return {cell.name: m for cell in CELLS if (m := missing(sgl, cell))}


def scenarios(sgl) -> list[tuple[str, object]]:
    """(name, run(trace_path, fuzz_seed=None)) for each cell this release can run, under both decode
    loops."""
    out = []
    for cell in CELLS:
        if missing(sgl, cell):
            continue
        for mode in ("normal", "overlap"):
            out.append((f"{cell.name}/{mode}", _runner(sgl, cell, mode)))
    return out


def _runner(sgl, cell, mode):
    def run(trace_path: str, fuzz_seed: int | None = None) -> str:
        # one fixed schedule per cell: the state it reaches is scripted, so a seed is ignored
        return LifeHarness(sgl, cell, mode).run(trace_path)

    return run


# The rules a cell's trace breaks where SGLang 0.5.23 is right and the trace vocabulary cannot say
# why (docs/sglang.md, "The lifecycle x fault matrix"). A request retracted by
# pause_generation(mode="retract") is re-bootstrapped by continue_generation: the same rid and room
# are added again, with a new receiver, and the prefill recomputes its KV under the new weights. The
# trace has no event for that second life of the room, so D-init-once sees the room initialised
# twice and D-unknown-rooms-only sees its rank asked again (the prefill may answer another rank for
# the recompute, so asking is right), and D-consume-answer sees a room resolved that its own
# bookkeeping had already settled. With the peer gone, the second query never answers, so only the
# second ask is seen.
_REBOOTSTRAP = {
    "D-init-once": "a re-bootstrapped room is initialised again, with a new receiver",
    "D-unknown-rooms-only": "a re-bootstrapped room's rank is asked again",
    "D-consume-answer": "a re-bootstrapped room is pending again after its first resolve",
}
_ASKED_AGAIN = ("D-unknown-rooms-only", "D-consume-answer")
DIVERGENCES: dict[str, dict[str, str]] = {
    f"{cell.name}/{mode}": (
        {k: _REBOOTSTRAP[k] for k in _ASKED_AGAIN}
        if cell.fault is Fault.PEER_GONE
        else dict(_REBOOTSTRAP)
    )
    for cell in CELLS
    if cell.state is State.RETRACTED
    for mode in ("normal", "overlap")
}
