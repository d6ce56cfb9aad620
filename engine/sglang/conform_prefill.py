"""Conformance scenarios for SGLang 0.5.23's PD prefill loops, run on CPU with the adapter's hooks.

Each scenario builds a real `Scheduler` with `Scheduler.__new__` (as SGLang's own unit tests do),
gives it SGLang's real components where they run on a CPU — the published server configuration,
the req_to_token pool, the paged KV allocator and pool, the radix cache, the schedule policy, the
metadata buffers and index allocator, the bootstrap queue's code, the future map, the batch result
processor, the output streamer, the invariant checker — and drives the real
`event_loop_normal_disagg_prefill` or `event_loop_overlap_disagg_prefill` until the work is done and
`gracefully_exit` ends the loop. Admission (`get_next_disagg_prefill_batch_to_run`, the PrefillAdder,
`ScheduleBatch.init_new` / `prepare_for_extend`, the slot and page allocation), `run_batch`, the WAR
barrier, deferred sampling, `process_batch_result_disagg_prefill`, `send_kv_chunk` and the inflight
queue are SGLang's own code. What is faked, and why, is listed on each fake below; in short, what
touches a GPU or the network: the model forward, the device streams and events, the KV sender's
transfer, the request intake from the tokenizer's socket, and the sockets the output and metrics
would go to.

    scenarios()    [(name, run(trace_dir, fuzz_schedule=None) -> {"trace", "functions", ...})]

`fuzz_schedule` (an int seed, or None for the fixed schedule) decides what the fakes decide in a real
run: after how many polls a request's bootstrap handshake and its KV transfer complete, and after how
many queries a result's device-to-host copy is done. The loops run on one thread, so those are the
only choices a schedule has.

    mutants()      the same, with SGLang's loop rewritten (engine/sglang/mutate.py); each names the
                   rules that must report it
    DIVERGENCES    per scenario, the rules its trace fails, each with why (SGLang 0.5.23 against the
                   spec, not a hazard in SGLang)
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import tempfile
import threading
from array import array
from types import SimpleNamespace

import torch

from . import hooks, load, mutate
from . import prefill as prefill_hooks
from .sink import TraceSink

_MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
          "rms_norm_eps": 1e-5, "torch_dtype": "float32", "eos_token_id": 2, "bos_token_id": 1}

_lock = threading.Lock()   # one scenario at a time: SGLang's configuration is process-wide
_sgl = None


def sglang():
    """SGLang's modules with the adapter's hooks installed (once per process)."""
    global _sgl
    if _sgl is None:
        _sgl = load()
    if not prefill_hooks.is_installed(_sgl):
        prefill_hooks.install(_sgl)
    return _sgl


# ---- the call log ---------------------------------------------------------------------------------
class CallLog:
    """The calls SGLang makes into the fakes, in order: a run with hooks and one without must make the
    same calls (the hooks only observe)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, *call) -> None:
        self.calls.append(call)


@dataclasses.dataclass
class Schedule:
    """What the fakes decide: polls until a request's bootstrap handshake is done and until its KV
    transfer concludes, queries until a result's device-to-host copy is done."""
    seed: int | None = None

    def __post_init__(self):
        self._rng = random.Random(self.seed) if self.seed is not None else None

    def transfer_polls(self) -> int:
        return 1 if self._rng is None else self._rng.randint(0, 3)

    def bootstrap_polls(self) -> int:
        return 0 if self._rng is None else self._rng.randint(0, 2)

    def copy_queries(self) -> int:
        return 1 if self._rng is None else self._rng.randint(0, 2)


# ---- the device ------------------------------------------------------------------------------------
class FakeEvent:
    """A device event. Faked: CUDA events need a GPU, and torch.cpu.Event is always complete, so a
    result whose device-to-host copy is still running could not be shown. `query` answers False for
    the first `pending` queries (the copy is still in flight), then True; `synchronize` completes it."""

    def __init__(self, log: CallLog, name: str, pending: int = 0):
        self.log, self.name, self.pending = log, name, pending

    def record(self, stream=None):
        self.log("event.record", self.name)

    def query(self) -> bool:
        done = self.pending <= 0
        self.pending -= 1
        self.log("event.query", self.name, done)
        return done

    def synchronize(self):
        self.pending = 0
        self.log("event.synchronize", self.name)

    def wait(self, stream=None):
        self.log("event.wait", self.name)


class FakeStream:
    """A device stream. Faked: the schedule, forward and copy streams are CUDA streams in a real run;
    the fake records the ordering calls SGLang makes on them (wait_event is the fine WAR barrier,
    wait_stream the coarse one and the forward's wait for the schedule stream)."""

    def __init__(self, log: CallLog, name: str):
        self.log, self.name = log, name

    def wait_event(self, event):
        self.log("stream.wait_event", self.name, getattr(event, "name", None))

    def wait_stream(self, other):
        self.log("stream.wait_stream", self.name, getattr(other, "name", None))

    def record_event(self, event=None):
        self.log("stream.record_event", self.name)
        return event or FakeEvent(self.log, f"{self.name}.recorded")

    def synchronize(self):
        self.log("stream.synchronize", self.name)


class FakeDeviceModule:
    """`torch.cuda` as the scheduler uses it (`self.device_module`): Event() for the copy-done events,
    stream() contexts. Faked with the streams above; each copy-done event is pending for as many
    queries as the schedule says."""

    def __init__(self, log: CallLog, schedule: Schedule):
        self.log, self.schedule, self.n = log, schedule, 0

    def Event(self):   # noqa: N802 (torch's name)
        self.n += 1
        return FakeEvent(self.log, f"copy_done{self.n}", pending=self.schedule.copy_queries())

    def stream(self, s):
        return _StreamContext(self.log, s)


class _CudaEvents:
    """`torch.cuda.Event`, for the one place the prefill path makes a CUDA event itself:
    maybe_send_cached_prefix_chunk under the overlap loop records one on the forward stream, for the
    transfer to wait on the previous forward's writes. Faked: a CPU build of torch cannot make one.
    Swapped into torch.cuda for the run only (scenarios run one at a time)."""

    def __init__(self, log: CallLog):
        self.log, self.n = log, 0

    def __call__(self, *args, **kwargs):
        self.n += 1
        return FakeEvent(self.log, f"cuda_event{self.n}")


class _StreamContext:
    """`with torch.cuda.stream(s)`: reusable, as the scheduler keeps one per stream."""

    def __init__(self, log: CallLog, stream):
        self.log, self.stream = log, stream

    def __enter__(self):
        self.log("stream.enter", getattr(self.stream, "name", None))
        return self.stream

    def __exit__(self, *exc):
        self.log("stream.exit", getattr(self.stream, "name", None))
        return False


# ---- the model forward ----------------------------------------------------------------------------
class FakeRunner:
    """The model runner as the scheduler reads it. Faked: a real one loads weights and runs on the
    GPU. The scheduler reads the attention backend's tile size, the prefill-aware-SWA flag, and the
    WAR barrier's event (`shared_read_done_event`: set by each forward that publishes its shared-buffer
    reads; None makes SGLang's barrier fall back to the coarse whole-forward wait); the bootstrap
    queue reads the KV capacity and dtype."""

    def __init__(self, kv_tokens: int):
        self.attn_backend = SimpleNamespace(extend_attention_block_m=64)
        self.prefill_aware_swa = False
        self.shared_read_done_event = None
        self.sliding_window_size = None
        self.is_hybrid_swa = False
        self.effective_logical_max_total_num_tokens = kv_tokens
        self.kv_cache_dtype_str = "auto"
        self.ngram_embedding_manager = None   # SGLang's own (disabled), set by build_scheduler


class FakeModelWorker:
    """The TP model worker. Faked: its forward runs the model on the GPU. `forward_batch_generation`
    logs what it is given and returns SGLang's own GenerationBatchResult, sampled as the real worker
    samples: deferred (`delay_sample_func`, launched by `launch_batch_sample_if_needed`) under the
    overlap schedule with SGLANG_ENABLE_DELAY_SAMPLE or a grammar, else inside the forward."""

    def __init__(self, log: CallLog, *, kv_tokens: int, fine_barrier: bool, enable_overlap: bool):
        self.log = log
        self.model_runner = FakeRunner(kv_tokens)
        self.model_config = None   # the scheduler's ModelConfig, set by build_scheduler
        self.fine_barrier = fine_barrier
        self.enable_overlap = enable_overlap
        self.forwards = 0

    @property
    def last_shared_read_runner(self):
        return self.model_runner

    def forward_batch_generation(self, batch, **kwargs):
        from sglang.srt.environ import envs
        from sglang.srt.managers.utils import GenerationBatchResult

        self.forwards += 1
        n = self.forwards
        self.log("forward", [str(r.rid) for r in batch.reqs], list(batch.extend_lens))
        if self.fine_barrier:
            self.model_runner.shared_read_done_event = FakeEvent(self.log, f"shared_read{n}")
        result = GenerationBatchResult(logits_output=None, can_run_cuda_graph=False)
        tokens = torch.tensor([(7 * n + i) % 200 + 3 for i in range(len(batch.reqs))], dtype=torch.int64)
        deferred = self.enable_overlap and (batch.sampling_info.grammars is not None
                                            or envs.SGLANG_ENABLE_DELAY_SAMPLE.get())
        if deferred:
            def sample():
                self.log("sample", n)
                result.next_token_ids = tokens
                return result
            result.delay_sample_func = sample
        else:
            result.next_token_ids = tokens
        return result


# ---- the KV transfer ------------------------------------------------------------------------------
_SENDER: list = []


def scripted_sender_class():
    """ScriptedKVSender: SGLang's FakeKVSender (its warmup sender, which create_sender makes on the fake
    transfer backend) with a bootstrap handshake that takes `bootstrap_left` polls and a transfer that
    concludes `transfer_left` polls after the last page was handed over; FakeKVSender's are instant, so
    a request waiting in the bootstrap queue or in the inflight queue could not be shown. Faked: a real
    sender registers with the decode server and moves the KV over RDMA."""
    if _SENDER:
        return _SENDER[0]
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.fake.conn import FakeKVSender

    class ScriptedKVSender(FakeKVSender):
        def poll(self):
            if self.conclude_state is not None:
                state = self.conclude_state
            elif self.bootstrap_left > 0:
                self.bootstrap_left -= 1
                state = KVPoll.Bootstrapping
            elif self.total_pages is None or self.sent_pages < self.total_pages:
                state = KVPoll.WaitingForInput
            elif self.transfer_left > 0:
                self.transfer_left -= 1
                state = KVPoll.Transferring
            else:
                state = self.conclude_state = KVPoll.Success
            self.log("sender.poll", self.rid, int(state))
            return state

        def init(self, num_kv_indices, aux_index=None):
            self.log("sender.init", self.rid, int(num_kv_indices))
            self.total_pages = int(num_kv_indices)
            return super().init(num_kv_indices, aux_index)

        def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
            self.log("sender.send", self.rid, [int(i) for i in kv_indices], num_kv_tokens,
                     state_indices is not None)
            self.sent_pages += len(kv_indices)
            return super().send(kv_indices, state_indices, num_kv_tokens)

        def clear(self):
            self.log("sender.clear", self.rid)

    _SENDER.append(ScriptedKVSender)
    return ScriptedKVSender


def scripted_sender(fake_sender, log: CallLog, rid: str, *, bootstrap_polls: int, transfer_polls: int):
    """The FakeKVSender create_sender made for `rid`, as a ScriptedKVSender (its state carried over)."""
    cls = scripted_sender_class()
    sender = cls.__new__(cls)
    sender.__dict__.update(fake_sender.__dict__)
    sender.rid, sender.log = rid, log
    sender.bootstrap_left, sender.transfer_left = bootstrap_polls, transfer_polls
    sender.total_pages, sender.sent_pages = None, 0
    return sender


# ---- the request intake and the outputs ------------------------------------------------------------
@dataclasses.dataclass
class Arrival:
    rid: str
    length: int          # prompt tokens
    at: int              # intake call (loop iteration) at which the tokenizer's message arrives
    prefix_of: str | None = None   # shares its first `shared` tokens with this earlier request
    shared: int = 0


# The decode server's address in the requests: never contacted (the bootstrap queue runs SGLang's fake
# transfer backend). Not FAKE_BOOTSTRAP_HOST, which marks warmup requests (kept out of the radix cache).
DECODE_HOST = "decode.invalid"


class FakeTokenizerSocket:
    """The request receiver's side of the tokenizer's ZMQ socket. Faked: in a real server the
    TokenizerManager process sends each tokenized request over IPC. `recv_requests` hands the real
    scheduler SGLang's own TokenizedGenerateReqInput messages at the intake calls the workload
    names; the scheduler's real ingest_requests / process_input_requests / handle_generate_request
    turn them into Req objects and queue them in the bootstrap queue."""

    def __init__(self, arrivals: list[Arrival], vocab: int, log: CallLog):
        self.arrivals, self.vocab, self.log = sorted(arrivals, key=lambda a: a.at), vocab, log
        self.calls = 0
        self.prompts: dict[str, list[int]] = {}

    def prompt(self, a: Arrival) -> list[int]:
        rng = random.Random(a.rid)
        ids = [rng.randrange(3, self.vocab) for _ in range(a.length)]
        if a.prefix_of is not None:
            ids[:a.shared] = self.prompts[a.prefix_of][:a.shared]
        self.prompts[a.rid] = ids
        return ids

    def recv_requests(self, local_reqs=None):
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        n, self.calls = self.calls, self.calls + 1
        self.log("tokenizer.poll", n)
        out = list(local_reqs or [])
        for i, a in enumerate(self.arrivals):
            if a.at != n:
                continue
            params = SamplingParams(max_new_tokens=8, temperature=0.0)
            params.normalize(None)
            params.verify(self.vocab)
            out.append(TokenizedGenerateReqInput(
                rid=a.rid, input_text=None, input_ids=array("q", self.prompt(a)), input_embeds=None,
                mm_inputs=None, token_type_ids=None, sampling_params=params, return_logprob=False,
                logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
                bootstrap_host=DECODE_HOST, bootstrap_port=8998, bootstrap_room=1000 + i))
            self.log("tokenizer.recv", a.rid)
        return out

    @property
    def pending(self) -> bool:
        return any(a.at >= self.calls for a in self.arrivals)


class FakeSocket:
    """A ZMQ socket the scheduler sends on (to the detokenizer, to the tokenizer). Faked: the
    receiving processes are not running; what is sent is recorded (finished requests' outputs)."""

    def __init__(self, log: CallLog, name: str):
        self.log, self.name, self.sent = log, name, []

    def send_output(self, obj, *args, **kwargs):
        self.sent.append(obj)
        rids = getattr(obj, "rids", None)
        self.log("socket.send", self.name, type(obj).__name__, list(rids) if rids is not None else None)

    send_pyobj = send_output


# ---- the scheduler ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Workload:
    mode: str                              # "normal" or "overlap"
    arrivals: list[Arrival]
    page_size: int = 4
    chunk: int = 16                        # chunked_prefill_size
    max_prefill_tokens: int = 64
    max_running: int = 4
    kv_tokens: int = 512
    fine_barrier: bool = True              # the forward publishes its shared reads (else: coarse barrier)
    delay_sample: bool = True              # SGLANG_ENABLE_DELAY_SAMPLE (off by default in SGLang)
    continuous_polling: bool = False       # SGLANG_ENABLE_DISAGG_PREFILL_CONTINUOUS_INPUT_POLLING
    early_send_prefix: bool = True         # SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX (SGLang's default)
    radix_cache: bool = True
    max_iterations: int = 400


def _envs(w: Workload):
    from sglang.srt.environ import envs

    stack = contextlib.ExitStack()
    stack.enter_context(envs.SGLANG_ENABLE_DELAY_SAMPLE.override(w.delay_sample))
    stack.enter_context(envs.SGLANG_ENABLE_DISAGG_PREFILL_CONTINUOUS_INPUT_POLLING.override(w.continuous_polling))
    stack.enter_context(envs.SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX.override(w.early_send_prefix))
    return stack


_model_dir: list[str] = []


def _model_path() -> str:
    """A model directory holding only config.json: the scheduler reads the model's configuration
    (vocabulary, heads, context length), never its weights."""
    if not _model_dir:
        d = tempfile.mkdtemp(prefix="pdo-sglang-model-")
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(_MODEL, f)
        _model_dir.append(d)
    return _model_dir[0]


def _process_groups() -> None:
    """SGLang's process groups for a world of one rank (TP = PP = DP = 1), on gloo over an in-memory
    store: SGLang's own init_distributed_environment / initialize_model_parallel build the groups the
    scheduler's polls and broadcasts reduce over."""
    import torch.distributed as dist
    from sglang.srt.distributed import parallel_state as ps

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if getattr(ps, "_WORLD", None) is None:
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if getattr(ps, "_TP", None) is None:
        ps.initialize_model_parallel()


def build_scheduler(w: Workload, log: CallLog, schedule: Schedule):
    """A real Scheduler, made as Scheduler.__new__ and initialised by SGLang's own init_* methods
    where they run without a GPU, a model or a network; the rest (the pools, the bootstrap queue with
    SGLang's fake transfer backend) is built here from SGLang's classes."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import (DisaggregationMode, MetadataBuffers,
                                                  ReqToMetadataIdxAllocator, TransferBackend)
    from sglang.srt.environ import envs
    from sglang.srt.layers.dp_attention import get_dp_tp_group
    from sglang.srt.mem_cache.allocator.page_interleave import page_interleave_shard_size
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import NgramEmbeddingManager
    from sglang.srt.runtime_context import (get_disagg, get_lora, get_memory, get_parallel, get_schedule,
                                            get_serving, get_spec)
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    sgl = sglang()
    server_args = ServerArgs(
        model_path=_model_path(), device="cpu", disaggregation_mode="prefill", page_size=w.page_size,
        chunked_prefill_size=w.chunk, max_prefill_tokens=w.max_prefill_tokens, max_running_requests=w.max_running,
        max_total_tokens=w.kv_tokens, context_length=256, tp_size=1, disable_cuda_graph=True,
        attention_backend="torch_native", skip_tokenizer_init=True, disable_radix_cache=not w.radix_cache,
        disable_overlap_schedule=w.mode != "overlap")
    rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
    _process_groups()

    S = sgl.scheduler.Scheduler
    s = S.__new__(S)
    # The plain settings Scheduler.__init__ reads from the published configuration.
    s.server_args = server_args
    s.is_initializing = True
    s.forward_ct = s.processed_tokens_counter = 0
    s.cur_batch_for_debug = None
    sch = get_schedule()
    s.schedule_policy = sch.schedule_policy
    s.enable_priority_scheduling = sch.enable_priority_scheduling
    s.abort_on_priority_when_disabled = sch.abort_on_priority_when_disabled
    s.schedule_low_priority_values_first = sch.schedule_low_priority_values_first
    s.priority_scheduling_preemption_threshold = sch.priority_scheduling_preemption_threshold
    s.enable_lora = get_lora().enable_lora
    s.enable_lora_overlap_loading = get_lora().enable_lora_overlap_loading
    s.max_loras_per_batch = get_lora().max_loras_per_batch
    s.enable_overlap = not sch.disable_overlap_schedule
    s.enable_overlap_mlx = False
    s.enable_pdmux = get_disagg().enable_pdmux
    s.skip_tokenizer_init = get_serving().skip_tokenizer_init
    s.stream_interval = get_serving().stream_interval
    s.spec_algorithm = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
    s.page_size = sch.page_size
    mem = get_memory()
    s.enable_hierarchical_cache = mem.enable_hierarchical_cache
    s.enable_lmcache = mem.enable_lmcache
    s.enable_session_radix_cache = mem.enable_session_radix_cache
    s.enable_hicache_storage = mem.hicache_storage_backend is not None
    s.enable_unified_cache_external_linker = mem.enable_unified_cache_external_linker
    s.enable_decode_hicache = False
    s.max_recv_per_poll = envs.SGLANG_SCHEDULER_MAX_RECV_PER_POLL.get()
    s.max_new_tokens_limit = envs.SGLANG_MAX_NEW_TOKENS_LIMIT.get()
    s.enable_hisparse = mem.enable_hisparse
    s.attn_dp_enabled = get_parallel().attn_dp_enabled
    s.enable_unified_memory = mem.enable_unified_memory
    s.init_model_config()
    s.init_tokenizer()
    s.init_moe_gemm_config()
    s.init_metrics_collector()

    # The model worker (faked: the forward needs the GPU) and what TpModelWorker.get_worker_info
    # would report for this configuration.
    worker = FakeModelWorker(log, kv_tokens=w.kv_tokens, fine_barrier=w.fine_barrier,
                             enable_overlap=s.enable_overlap)
    s.tp_worker = s.model_worker = worker
    s.maybe_init_draft_worker()   # no speculative decoding: no draft worker
    s.device, s.random_seed = "cpu", 0
    mc = s.model_config
    s.max_total_num_tokens = w.kv_tokens
    s.max_prefill_tokens = sch.max_prefill_tokens
    s.max_running_requests = sch.max_running_requests
    s.max_queued_requests = sch.max_queued_requests
    s.max_req_len = min(mc.context_len - 1, w.kv_tokens - 1)
    s.max_req_input_len = s.max_req_len - 5
    s.min_free_slots_delayer = None
    if not get_parallel().pp_max_micro_batch_size:
        rc.get_context().override("scheduler.pp_max_micro_batch_size_default",
                                  pp_max_micro_batch_size=max(s.max_running_requests // get_parallel().pp_size, 1))
    s.tp_group = get_parallel().tp_group
    s.tp_cpu_group = s.tp_group.cpu_group
    s.attn_tp_group = get_parallel().attn_tp_group
    s.attn_tp_cpu_group = s.attn_tp_group.cpu_group
    s.attn_cp_group = get_parallel().attn_cp_group
    s.attn_cp_cpu_group = s.attn_cp_group.cpu_group
    s.pp_group = get_parallel().pp_group
    s.world_group = get_parallel().world_group
    s.dp_tp_group = get_dp_tp_group()
    s.dp_tp_cpu_group = s.dp_tp_group.cpu_group
    s.pad_input_ids_func = None
    # Streams (faked: CUDA streams); in a real run the loop runs inside the schedule stream's context.
    s.schedule_stream = FakeStream(log, "schedule")
    s.forward_stream = FakeStream(log, "forward")

    # The pools and the cache, SGLang's classes on the CPU (what kv_cache_builder.build_kv_cache builds
    # for this model, without a model runner to size them).
    s.req_to_token_pool = ReqToTokenPool(size=s.max_running_requests, max_context_len=mc.context_len + 4,
                                         device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(size=w.kv_tokens, page_size=w.page_size, dtype=torch.float32,
                          head_num=mc.get_num_kv_heads(1), head_dim=mc.head_dim, layer_num=mc.num_hidden_layers,
                          device="cpu", enable_memory_saver=False)
    s.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(
        size=w.kv_tokens, page_size=w.page_size, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False)
    s.tree_cache = UnifiedRadixCache(CacheInitParams(
        disable=not w.radix_cache, req_to_token_pool=s.req_to_token_pool,
        token_to_kv_pool_allocator=s.token_to_kv_pool_allocator, page_size=w.page_size,
        tree_components=(ComponentType.FULL,), chunked_prefill_size=sch.chunked_prefill_size))
    s.disable_radix_cache = not w.radix_cache
    s.is_hybrid_swa = s.is_hybrid_ssm = False
    s.sliding_window_size = None
    s.full_tokens_per_layer, s.swa_tokens_per_layer = w.kv_tokens, 0
    s.kv_shard_widening = page_interleave_shard_size(s.token_to_kv_pool_allocator)
    s.decode_offload_manager = None
    s.rust_server = None
    s.memory_saver_adapter = TorchMemorySaverAdapter.create(enable=False)
    s.recv_skipper = s.input_blocker = None
    detok, tok = FakeSocket(log, "detokenizer"), FakeSocket(log, "tokenizer")
    s.ipc_channels = SimpleNamespace(send_to_detokenizer=detok, send_to_tokenizer=tok,
                                     send_metrics_from_scheduler=None, recv_from_rpc=None)
    s.recv_from_tokenizer = None
    s.load_snapshot_writer = None
    worker.model_runner.ngram_embedding_manager = NgramEmbeddingManager.from_model(
        model=torch.nn.Module(), model_config=mc, req_to_token_pool=s.req_to_token_pool,
        max_running_requests=s.max_running_requests, device="cpu")
    worker.model_config = mc

    for step in ("init_hisparse_coordinator", "init_diffusion_llm", "init_metrics_reporter"):
        getattr(s, step)()
    s.scheduler_stage_metrics = s.metrics_reporter.scheduler_stage_metrics
    for step in ("init_schedule_policy", "init_profiler", "init_running_status", "init_chunked_prefill",
                 "maybe_init_dynamic_chunk_sizer"):
        getattr(s, step)()

    # Scheduler.init_disaggregation's prefill branch, with the bootstrap queue on SGLang's fake transfer
    # backend (the real one registers with a bootstrap server over the network).
    s.disaggregation_mode = DisaggregationMode.PREFILL
    s.transfer_backend = TransferBackend.FAKE
    s.mm_receiver = s.disagg_decode_prealloc_queue = s.disagg_decode_transfer_queue = None
    size = s.max_running_requests * 2
    s.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(size)
    s.disagg_metadata_buffers = MetadataBuffers(
        size, hidden_size=16, hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=server_args.sampling_mask_max_tokens, custom_mem_pool=None,
        output_dsa_topk_indices_dim=0, kv_checksum_enabled=False)
    s.disagg_prefill_bootstrap_queue = PrefillBootstrapQueue(
        token_to_kv_pool=kv, draft_token_to_kv_pool=None,
        req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator,
        metadata_buffers=s.disagg_metadata_buffers, gpu_id=0,
        bootstrap_port=get_disagg().disaggregation_bootstrap_port, max_total_num_tokens=w.kv_tokens,
        scheduler=s, scheduler_stage_metrics=s.scheduler_stage_metrics, transfer_backend=TransferBackend.FAKE)
    s.disagg_prefill_inflight_queue = []
    s.disagg_prefill_pending_chunk_rids = set()
    s.enable_staging = envs.SGLANG_DISAGG_STAGING_BUFFER.get()

    s.init_overlap()
    # init_overlap took torch's CPU device module; the device's streams and events are the fakes.
    device = FakeDeviceModule(log, schedule)
    s.device_module = device
    s.forward_stream_ctx = device.stream(s.forward_stream)
    s.copy_stream = FakeStream(log, "copy")
    s.copy_stream_ctx = device.stream(s.copy_stream)
    for step in ("maybe_init_ngram_embedding", "init_deterministic_inference_config",
                 "init_dsa_kpool_truncation_align", "init_mamba_truncation_align",
                 "check_truncation_align_fits_chunk", "init_weight_updater", "init_request_dispatcher",
                 "init_lora_drainer", "init_lora_overlap_loader", "init_grammar_manager",
                 "maybe_init_scripted_scheduler_hook", "init_dp_attn_adapter", "init_pool_stats_observer",
                 "init_invariant_checker", "init_load_publisher", "init_load_inquirer", "init_output_streamer",
                 "init_batch_result_processor", "init_kv_events_publisher"):
        getattr(s, step)()
    s.idle_sleeper = None
    s.is_initializing = False
    # Scheduler.run_event_loop's switch: on by default on CUDA, which these scenarios stand for.
    s._war_barrier_enabled = True
    return s


class Stuck(RuntimeError):
    """The loop ran past the workload's iteration bound without finishing its requests."""


def _install_intake(s, w: Workload, socket: FakeTokenizerSocket, log: CallLog, schedule: Schedule) -> None:
    """The loop's ingest_requests, as the instance sees it: SGLang's real Scheduler.ingest_requests
    (the socket above feeds it), then, for each request it queued in the bootstrap queue, the scripted
    sender in place of the FakeKVSender create_sender made (before anything polls it), and the exit:
    `gracefully_exit` once every request arrived and SGLang's is_fully_idle says nothing is left."""
    real = type(s).ingest_requests
    scripted = scripted_sender_class()
    state = {"iterations": 0}

    def ingest_requests(stop_at_pause: bool = False):
        state["iterations"] += 1
        if state["iterations"] > w.max_iterations:
            raise Stuck(f"loop still running after {w.max_iterations} iterations")
        out = real(s, stop_at_pause=stop_at_pause)
        for req in s.disagg_prefill_bootstrap_queue.queue:
            if not isinstance(req.disagg_kv_sender, scripted):
                req.disagg_kv_sender = scripted_sender(
                    req.disagg_kv_sender, log, str(req.rid), bootstrap_polls=schedule.bootstrap_polls(),
                    transfer_polls=schedule.transfer_polls())
        if not socket.pending and not s.disagg_prefill_bootstrap_queue.queue and s.is_fully_idle():
            log("exit")
            s.gracefully_exit = True
        return out

    s.ingest_requests = ingest_requests


LOOPS = {"normal": "event_loop_normal_disagg_prefill", "overlap": "event_loop_overlap_disagg_prefill"}


def run_workload(w: Workload, trace_path: str | None, fuzz_schedule=None, *, patch=None) -> dict:
    """Run the workload's loop to its exit. With `trace_path`, under the adapter's hooks (one trace
    file); without, the same run with no sink active. `patch` is a context manager entered around the
    loop (a mutation). Returns the trace, the real SGLang functions the hooks saw run, the fakes' call
    log and what the scheduler holds at the end."""
    with _lock:
        sgl = sglang()
        from sglang.srt import runtime_context as rc

        log, schedule = CallLog(), Schedule(fuzz_schedule)
        # The scenario publishes its own configuration; what was published before is put back after
        # (the process groups of the one-rank world stay: building them again is not supported).
        with _envs(w), _restored(rc.snapshot_context(), rc.restore_context):
            s = build_scheduler(w, log, schedule)
            socket = FakeTokenizerSocket(w.arrivals, s.model_config.vocab_size, log)
            s.request_receiver = SimpleNamespace(recv_requests=socket.recv_requests)
            _install_intake(s, w, socket, log, schedule)
            before = dict(hooks.ran)
            with contextlib.ExitStack() as stack:
                stack.enter_context(mutate.swapped(torch.cuda, "Event", _CudaEvents(log)))
                if patch is not None:
                    stack.enter_context(patch)
                if trace_path is not None:
                    stack.enter_context(hooks.tracing(TraceSink(trace_path)))
                getattr(s, LOOPS[w.mode])()   # looked up inside the patch: a mutant is the loop that runs
        ran = sorted(k for k, v in hooks.ran.items() if v > before.get(k, 0))
        outputs = [rid for obj in s.ipc_channels.send_to_detokenizer.sent for rid in getattr(obj, "rids", ())]
        return {"trace": trace_path, "functions": ran, "calls": log.calls, "outputs": outputs,
                "leaks": _leaks(s), "version": sgl.version}


@contextlib.contextmanager
def _restored(state, restore):
    try:
        yield
    finally:
        restore(state)


def _leaks(s) -> dict:
    return {"req_slots_in_use": s.req_to_token_pool.size - s.req_to_token_pool.available_size(),
            "inflight": len(s.disagg_prefill_inflight_queue), "waiting": len(s.waiting_queue),
            "chunked": s.chunked_req is not None}


# ---- the scenarios -------------------------------------------------------------------------------
def _chunked_mix() -> list[Arrival]:
    """A request of 2.5 chunks, one that becomes the chunked request in the batch finishing the first,
    a short one arriving later, and a late one after the first ones left (several batches, two
    chunked requests, every batch shape: a lone middle chunk, a last chunk with a new chunked one)."""
    return [Arrival("r0", 40, 0), Arrival("r1", 10, 0), Arrival("r2", 7, 2), Arrival("r3", 21, 9)]


def _polling_mix() -> list[Arrival]:
    """As _chunked_mix, with r3 arriving while the loop waits on the last batch's copy (with the fixed
    schedule): it is admitted and forwarded before that batch's result is processed."""
    return [Arrival("r0", 40, 0), Arrival("r1", 10, 0), Arrival("r2", 7, 2), Arrival("r3", 21, 7)]


def _shared_prefix() -> list[Arrival]:
    """r1 arrives after r0 finished and shares r0's first 24 tokens: its prefix is matched in the radix
    cache, and SGLang's early send of the cached prefix has pages to send."""
    return [Arrival("r0", 30, 0), Arrival("r1", 34, 14, prefix_of="r0", shared=24), Arrival("r2", 9, 15)]


SCENARIOS: dict[str, tuple[Workload, str]] = {
    "prefill-chunked/normal": (Workload("normal", _chunked_mix()),
                       "the normal loop: run_batch then process_batch_result; middle chunks are sent at the "
                       "next admission"),
    "prefill-prefix-send/normal": (Workload("normal", _shared_prefix()),
                           "the normal loop with a radix hit: run_batch sends the cached prefix early"),
    "prefill-chunked/overlap": (Workload("overlap", _chunked_mix()),
                        "the overlap loop as configured by default but for deferred sampling: fine WAR barrier, "
                        "the early cached-prefix send on, which sends a continuing chunked request's previous "
                        "chunk from run_batch"),
    "prefill-no-early-send/overlap": (Workload("overlap", _chunked_mix(), early_send_prefix=False),
                              "the overlap loop with SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX off: every "
                              "chunk is sent by its own batch's result processing"),
    "prefill-coarse-barrier/overlap": (Workload("overlap", _chunked_mix(), fine_barrier=False),
                               "the overlap loop with the coarse WAR barrier, deferred past result processing"),
    "prefill-polling/overlap": (Workload("overlap", _polling_mix(), continuous_polling=True, fine_barrier=False),
                        "the overlap loop with continuous input polling: a request admitted and forwarded while "
                        "the oldest result's copy is pending, the coarse barrier applied while waiting"),
    "prefill-inline-sample/overlap": (Workload("overlap", _chunked_mix(), delay_sample=False),
                              "the overlap loop as configured by default: tokens sampled inside the forward"),
}
# Not run: a radix hit under the overlap loop. The early cached-prefix send then records a
# torch.cuda.Event on the forward stream (maybe_send_cached_prefix_chunk), which a CPU build of torch
# cannot make; the overlap workloads' prompts share no prefix, so the send returns before it.


_NORMAL_SEND = (
    "event_loop_normal_disagg_prefill sends a middle chunk's KV in process_prefill_chunk, called by "
    "get_next_disagg_prefill_batch_to_run at the top of the next iteration (`In non-overlap-mode, KV is "
    "sent in process_prefill_chunk`), after P(N) ended and before A(N+1) is formed; only the last chunk "
    "is sent inside process_batch_result_disagg_prefill. Not a hazard: P(N) already waited for forward "
    "N (next_token_ids.tolist() synchronizes the stream it ran on), so the chunk's KV is complete when "
    "it is sent. The rule places every send inside result processing; for the normal loop it would "
    "need to allow [process_begin(N), admit(N+1)].")
_EARLY_SEND = (
    "under the overlap loop run_batch(N+1) sends, as SGLang's early send of the cached prefix "
    "(maybe_send_cached_prefix_chunk, SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX, on by default), the "
    "KV a continuing chunked request computed in batch N: its prefix_len already covers chunk N while "
    "start_send_idx does not, since P(N) runs after F(N+1). P(N) then finds nothing left to send "
    "(start_send_idx == tmp_end_idx, zero pages, should_send_kv_chunk says no), so batch N's span has no "
    "kv_send for it (the trace has prefix_send(batch=N+1, start=<chunk N's start>)). The send is issued "
    "before forward N is known to be complete; SGLang records a CUDA event on the forward stream and "
    "hands it to the sender (_early_send_wait_event), which the Mooncake and Mori transfer workers "
    "synchronize on before reading the KV. NIXL's add_transfer_request takes that wait_event and drops "
    "it (nixl/conn.py, add_transfer_request: TransferKVChunk has no wait_event), so on NIXL the read "
    "can race forward N's writes: a real hazard there unless something else orders it (with the coarse "
    "barrier the schedule stream has waited for forward N, and kv_to_page_indices' device-to-host copy "
    "on that stream syncs the host behind it; with the fine barrier it has not). With Mooncake / Mori "
    "the rule is too strict: a chunk's KV may be handed over before its batch's processing when the "
    "transfer waits on the forward's completion event.")
# The rules a scenario's trace breaks where SGLang 0.5.23 is safe by means the rules cannot see (docs/
# sglang.md, "Open divergences"): none now. Three divergences found here were the spec's, and the rules
# changed: the normal loop applies no WAR barrier (P-complete-barrier names only the overlap modes);
# the overlap loop samples inside the forward unless SGLANG_ENABLE_DELAY_SAMPLE or a grammar defers it
# (P-complete-sample is not applied to sampling = "inline"); and a middle chunk's KV is sent at the next
# admission (normal, _NORMAL_SEND) or from run_batch(N+1) with a device wait (overlap, _EARLY_SEND),
# which P-chunk-sent judges by token ranges in place of the two per-batch send rules.
DIVERGENCES: dict[str, dict[str, str]] = {}


def _scenario(name: str):
    w, what = SCENARIOS[name]

    def run(trace_dir: str, fuzz_schedule=None) -> dict:
        path = os.path.join(trace_dir, f"sglang-{name.replace('/', '_')}.jsonl")
        out = run_workload(w, path, fuzz_schedule)
        out["name"] = name
        return out

    run.__name__ = "scenario_" + name.replace('-', '_').replace('/', '_')
    run.__doc__ = what
    return run


def scenarios() -> list:
    """[(name, run(trace_dir, fuzz_schedule=None) -> {"trace", "functions", ...})]"""
    return [(name, _scenario(name)) for name in SCENARIOS]


# ---- mutants of SGLang's real loop ----------------------------------------------------------------
def _sample_before_process():
    """event_loop_overlap_disagg_prefill with `self.launch_batch_sample_if_needed(batch_result, batch)`
    moved before `if self.last_batch:` (result processing of the previous batch): batch N is sampled
    before P(N-1) ran, which SGLang's own comment forbids (sampling depends on the previous batch's
    result, e.g. its grammar state)."""
    mixin = sglang().prefill.SchedulerDisaggregationPrefillMixin
    return mutate.mutation(mixin, "event_loop_overlap_disagg_prefill", mutate.MoveStatement(
        "self.launch_batch_sample_if_needed(batch_result, batch)", "if self.last_batch:"))


# name -> (the scenario it mutates, the patch, the rules that must report it)
MUTANTS = {"prefill-sample-before-process": ("prefill-no-early-send/overlap", _sample_before_process,
                                             {"P-overlap-process-prev"})}


def mutants() -> list:
    """[(name, run(trace_dir, fuzz_schedule=None) -> {"trace", "functions", "expect", ...})]: each runs
    its scenario's workload with SGLang's loop rewritten; `expect` names the rules that must fail."""
    out = []
    for name, (base, patch, expect) in MUTANTS.items():
        def run(trace_dir: str, fuzz_schedule=None, _base=base, _patch=patch, _expect=expect, _name=name) -> dict:
            w, _ = SCENARIOS[_base]
            path = os.path.join(trace_dir, f"sglang-mutant-{_name}.jsonl")
            with _lock:
                sglang()
                patch_cm = _patch()
            res = run_workload(w, path, fuzz_schedule, patch=patch_cm)
            res.update(name=_name, expect=sorted(_expect))
            return res
        run.__doc__ = patch.__doc__
        out.append((name, run))
    return out
