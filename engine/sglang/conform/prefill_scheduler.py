"""SGLang's real prefill Scheduler on CPU (0.5.14 to 0.5.23: prefill_releases.py finds out what
each release has), around the fakes of prefill_fakes.py.

The Scheduler is made with `Scheduler.__new__` (as SGLang's own unit tests do) and given SGLang's
real components where they run on a CPU: the published server configuration, the req_to_token pool,
the paged KV allocator and pool, the radix cache, the schedule policy, the metadata buffers and
index allocator, the bootstrap queue's code, the future map, the batch result processor, the output
streamer, the invariant checker. build_scheduler makes it in the order Scheduler.__init__ does, one
step per part. SGLang's configuration is process-wide: one scenario runs at a time, under
SCENARIO_LOCK.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist

from engine.sglang import load
from engine.sglang import prefill as prefill_hooks
from engine.sglang.conform.prefill_fakes import (
    Arrival,
    CallLog,
    FakeDeviceModule,
    FakeModelWorker,
    FakeSocket,
    FakeStream,
    Schedule,
)
from engine.sglang.conform.prefill_releases import (
    RANK_ARGS,
    Config,
    construct,
    init_steps,
    parallel_state,
    tree_cache,
)

_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "eos_token_id": 2,
    "bos_token_id": 1,
}

SCENARIO_LOCK = threading.Lock()  # one scenario at a time: SGLang's configuration is process-wide
_sgl = None


def sglang():
    """SGLang's modules with the adapter's hooks installed (once per process)."""
    global _sgl
    if _sgl is None:
        _sgl = load()
    if not prefill_hooks.is_installed(_sgl):
        prefill_hooks.install(_sgl)
    return _sgl


@dataclasses.dataclass
class Workload:
    mode: str  # "normal" or "overlap"
    arrivals: list[Arrival]
    page_size: int = 4
    chunk: int = 16  # chunked_prefill_size
    max_prefill_tokens: int = 64
    max_running: int = 4
    kv_tokens: int = 512
    fine_barrier: bool = True  # the forward publishes its shared reads (else: coarse barrier)
    delay_sample: bool = True  # SGLANG_ENABLE_DELAY_SAMPLE (off by default in SGLang)
    continuous_polling: bool = False  # SGLANG_ENABLE_DISAGG_PREFILL_CONTINUOUS_INPUT_POLLING
    early_send_prefix: bool = True  # SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX (default)
    radix_cache: bool = True
    max_iterations: int = 400

    def switches(self) -> dict[str, bool]:
        """SGLang's environment switch for each setting the workload depends on -> its value. The
        sampling switch matters to the overlap loop only (the normal loop samples in the forward)."""
        out = {name: getattr(self, field) for field, name in SWITCHES.items()}
        if self.mode != "overlap":
            del out[SWITCHES["delay_sample"]]
        return out


# Workload setting -> SGLang's environment switch for it. A release without the switch behaves as
# with it off: it has no such feature (continuous polling from 0.5.22, the early cached-prefix send
# from 0.5.15, deferred sampling of a grammar-free batch from 0.5.18).
SWITCHES = {
    "continuous_polling": "SGLANG_ENABLE_DISAGG_PREFILL_CONTINUOUS_INPUT_POLLING",
    "early_send_prefix": "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX",
    "delay_sample": "SGLANG_ENABLE_DELAY_SAMPLE",
}


def missing_switches(workload: Workload) -> list[str]:
    """The switches the workload turns on that this release lacks (it cannot run the workload)."""
    from sglang.srt.environ import envs  # lazy: SGLang is optional

    return [n for n, on in workload.switches().items() if on and getattr(envs, n, None) is None]


_model_dir: list[str] = []


def _model_path() -> str:
    """A model directory holding only config.json: the scheduler reads the model's configuration
    (vocabulary, heads, context length), never its weights."""
    if not _model_dir:
        directory = tempfile.mkdtemp(prefix="pdo-sglang-model-")
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(_MODEL, f)
        _model_dir.append(directory)
    return _model_dir[0]


def _process_groups() -> None:
    """SGLang's process groups for a world of one rank (TP = PP = DP = 1), on gloo over an in-memory
    store: SGLang's own init_distributed_environment / initialize_model_parallel build the groups
    the scheduler's polls and broadcasts reduce over."""
    from sglang.srt.distributed import parallel_state as ps  # lazy: SGLang is optional

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if getattr(ps, "_WORLD", None) is None:
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if getattr(ps, "_TP", None) is None:
        ps.initialize_model_parallel()


# ---- the scheduler, step by step -------------------------------------------------------------
def build_scheduler(workload: Workload, log: CallLog, schedule: Schedule):
    """A real Scheduler, made as Scheduler.__new__ and initialised by SGLang's own init_* methods
    where they run without a GPU, a model or a network; the rest (the pools, the bootstrap queue
    with SGLang's fake transfer backend) is built here from SGLang's classes."""
    sgl = sglang()
    server_args = _publish_server_args(workload)
    _process_groups()
    scheduler_cls = sgl.scheduler.Scheduler
    sched = scheduler_cls.__new__(scheduler_cls)
    schedule_args = Config("schedule", server_args)
    _plain_settings(sched, server_args, schedule_args)
    init_steps(
        sched,
        "init_model_config",
        "init_tokenizer",
        "init_moe_gemm_config",
        "init_metrics_collector",
    )
    _metrics_collector(sched)
    worker = _model_worker(sched, workload, log)
    _limits(sched, workload, schedule_args)
    _groups(sched)
    # Streams (faked: CUDA streams); in a real run the loop runs inside the schedule stream's
    # context.
    sched.schedule_stream = FakeStream(log, "schedule")
    sched.forward_stream = FakeStream(log, "forward")
    kv_pool = _pools_and_cache(sched, workload, schedule_args)
    _outputs(sched, log)
    _ngram_embedding(sched, worker)
    init_steps(sched, "init_hisparse_coordinator", "init_diffusion_llm", "init_metrics_reporter")
    _metrics_reporter(sched)
    reporter = getattr(sched, "metrics_reporter", None)  # from 0.5.21
    sched.scheduler_stage_metrics = getattr(reporter, "scheduler_stage_metrics", None)
    init_steps(
        sched,
        "init_schedule_policy",
        "init_profiler",
        "init_running_status",
        "init_chunked_prefill",
        "maybe_init_dynamic_chunk_sizer",
    )
    _disaggregation(sched, workload, server_args, kv_pool)
    sched.init_overlap()
    _device(sched, log, schedule)
    _remaininginit_steps(sched)
    return sched


def _publish_server_args(workload: Workload):
    """The server configuration of the workload, published as SGLang's launcher publishes it."""
    # lazy: SGLang is optional
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=_model_path(),
        device="cpu",
        disaggregation_mode="prefill",
        page_size=workload.page_size,
        chunked_prefill_size=workload.chunk,
        max_prefill_tokens=workload.max_prefill_tokens,
        max_running_requests=workload.max_running,
        max_total_tokens=workload.kv_tokens,
        context_length=256,
        tp_size=1,
        disable_cuda_graph=True,
        attention_backend="torch_native",
        skip_tokenizer_init=True,
        disable_radix_cache=not workload.radix_cache,
        disable_overlap_schedule=workload.mode != "overlap",
    )
    if hasattr(rc, "SpawnRanks"):  # 0.5.21 on: the ranks are published with the configuration
        rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
    elif hasattr(rc, "publish"):  # 0.5.17 on
        rc.publish(server_args, role="scheduler")
    elif hasattr(
        rc.get_context(), "set_server_args"
    ):  # the server arguments alone (0.5.15, 0.5.16)
        rc.get_context().set_server_args(server_args)
    else:  # the legacy process-wide server arguments (0.5.14)
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(server_args)
    return server_args


def _plain_settings(sched, server_args, schedule_args) -> None:
    """The plain settings Scheduler.__init__ reads from the published configuration (before 0.5.21,
    some from the server arguments, of the same name: Config reads either)."""
    # lazy: SGLang is optional
    from sglang.srt.environ import envs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    lora, disagg, serving, mem = (
        Config(g, server_args) for g in ("lora", "disagg", "serving", "memory")
    )
    sched.server_args = server_args
    sched.is_initializing = True
    sched.forward_ct = sched.processed_tokens_counter = 0
    sched.cur_batch_for_debug = None
    sched.schedule_policy = schedule_args.schedule_policy
    sched.enable_priority_scheduling = schedule_args.enable_priority_scheduling
    sched.abort_on_priority_when_disabled = schedule_args.abort_on_priority_when_disabled
    sched.schedule_low_priority_values_first = schedule_args.schedule_low_priority_values_first
    sched.priority_scheduling_preemption_threshold = (
        schedule_args.priority_scheduling_preemption_threshold
    )
    # a feature switch a release does not have is a feature it does not have: off
    sched.enable_lora = lora.enable_lora
    sched.enable_lora_overlap_loading = getattr(lora, "enable_lora_overlap_loading", False)
    sched.max_loras_per_batch = lora.max_loras_per_batch
    sched.enable_overlap = not schedule_args.disable_overlap_schedule
    sched.enable_overlap_mlx = False
    sched.enable_pdmux = getattr(disagg, "enable_pdmux", False)
    sched.skip_tokenizer_init = serving.skip_tokenizer_init
    sched.stream_interval = serving.stream_interval
    sched.spec_algorithm = SpeculativeAlgorithm.from_string(
        Config("spec", server_args).speculative_algorithm
    )
    sched.page_size = schedule_args.page_size
    sched.enable_hierarchical_cache = mem.enable_hierarchical_cache
    sched.enable_lmcache = getattr(mem, "enable_lmcache", False)
    sched.enable_session_radix_cache = getattr(mem, "enable_session_radix_cache", False)
    sched.enable_hicache_storage = mem.hicache_storage_backend is not None
    sched.enable_unified_cache_external_linker = getattr(
        mem, "enable_unified_cache_external_linker", False
    )
    sched.enable_decode_hicache = False
    sched.max_recv_per_poll = envs.SGLANG_SCHEDULER_MAX_RECV_PER_POLL.get()
    limit = getattr(envs, "SGLANG_MAX_NEW_TOKENS_LIMIT", None)  # 0.5.16 on; before, no limit
    sched.max_new_tokens_limit = limit.get() if limit is not None else None
    sched.enable_hisparse = getattr(mem, "enable_hisparse", False)
    sched.hisparse_coordinator = None  # (init_hisparse_coordinator sets it where a release has it)
    # 0.5.23's name for it; enable_dp_attention before (a one-rank world has no DP attention)
    sched.attn_dp_enabled = sched.enable_dp_attention = False
    sched.enable_unified_memory = getattr(mem, "enable_unified_memory", False)
    parallel_state(sched)


def _metrics_collector(sched) -> None:
    """SGLang's metrics collector where Scheduler.__init__ makes it inline (0.5.14; later releases
    have init_metrics_collector)."""
    if hasattr(sched, "metrics_collector") or hasattr(sched, "init_metrics_collector"):
        return
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector

    context = construct(
        SchedulerMetricsCollector.init_new,
        server_args=sched.server_args,
        ps=getattr(sched, "ps", None),
        enable_priority_scheduling=sched.enable_priority_scheduling,
        enable_lora=sched.enable_lora,
        enable_hierarchical_cache=sched.enable_hierarchical_cache,
        **RANK_ARGS,
    )
    sched.metrics_collector_context = context
    sched.metrics_collector = context.collector


def _metrics_reporter(sched) -> None:
    """The metrics reporter where Scheduler.__init__ makes it inline (0.5.14)."""
    from sglang.srt.managers import scheduler  # lazy: SGLang is optional

    cls = getattr(scheduler, "SchedulerMetricsReporter", None)
    if hasattr(sched, "metrics_reporter") or cls is None or hasattr(sched, "init_metrics_reporter"):
        return
    sched.metrics_reporter = construct(
        cls,
        scheduler=sched,
        metrics_collector_context=sched.metrics_collector_context,
        metrics_collector=sched.metrics_collector,
        **RANK_ARGS,
    )


def _model_worker(sched, workload: Workload, log: CallLog) -> FakeModelWorker:
    """The model worker (faked: the forward needs the GPU) and what TpModelWorker.get_worker_info
    would report for this configuration."""
    worker = FakeModelWorker(
        log,
        kv_tokens=workload.kv_tokens,
        fine_barrier=workload.fine_barrier,
        enable_overlap=sched.enable_overlap,
    )
    sched.tp_worker = sched.model_worker = worker
    sched.maybe_init_draft_worker()  # no speculative decoding: no draft worker
    sched.device, sched.random_seed = "cpu", 0
    return worker


def _limits(sched, workload: Workload, schedule_args) -> None:
    """The token and request limits, from the workload and the published configuration."""
    # lazy: SGLang is optional
    from sglang.srt import runtime_context as rc
    from sglang.srt.runtime_context import get_parallel

    model_config = sched.model_config
    sched.max_total_num_tokens = workload.kv_tokens
    sched.max_prefill_tokens = schedule_args.max_prefill_tokens
    sched.max_running_requests = schedule_args.max_running_requests
    sched.max_queued_requests = schedule_args.max_queued_requests
    sched.max_req_len = min(model_config.context_len - 1, workload.kv_tokens - 1)
    sched.max_req_input_len = sched.max_req_len - 5
    sched.min_free_slots_delayer = None
    if not Config("parallel", sched.server_args).pp_max_micro_batch_size:
        micro_batch = max(sched.max_running_requests // get_parallel().pp_size, 1)
        # on the context from 0.5.17; on the server arguments before
        ctx = rc.get_context()
        owner = ctx if hasattr(ctx, "override") else sched.server_args
        if hasattr(owner, "override"):
            owner.override(
                "scheduler.pp_max_micro_batch_size_default", pp_max_micro_batch_size=micro_batch
            )
        else:  # before 0.5.16 the scheduler sets the server argument itself
            owner.pp_max_micro_batch_size = micro_batch


def _groups(sched) -> None:
    """The process groups of the one-rank world (_process_groups built them)."""
    # lazy: SGLang is optional
    from sglang.srt.layers import dp_attention
    from sglang.srt.runtime_context import get_parallel

    sched.tp_group = get_parallel().tp_group
    sched.tp_cpu_group = sched.tp_group.cpu_group
    sched.attn_tp_group = get_parallel().attn_tp_group
    sched.attn_tp_cpu_group = sched.attn_tp_group.cpu_group
    sched.attn_cp_group = get_parallel().attn_cp_group
    sched.attn_cp_cpu_group = sched.attn_cp_group.cpu_group
    sched.pp_group = get_parallel().pp_group
    sched.world_group = get_parallel().world_group
    get_dp_tp_group = getattr(dp_attention, "get_dp_tp_group", None)
    # before it, Scheduler.__init__ takes the TP group where DP attention is off
    sched.dp_tp_group = get_dp_tp_group() if get_dp_tp_group else sched.tp_group
    sched.dp_tp_cpu_group = sched.dp_tp_group.cpu_group
    sched.pad_input_ids_func = None


def _pools_and_cache(sched, workload: Workload, schedule_args):
    """The pools and the cache, SGLang's classes on the CPU (what kv_cache_builder.build_kv_cache
    builds for this model, without a model runner to size them). Returns the KV pool."""
    # lazy: SGLang is optional
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    model_config = sched.model_config
    sched.req_to_token_pool = ReqToTokenPool(
        size=sched.max_running_requests,
        max_context_len=model_config.context_len + 4,
        device="cpu",
        enable_memory_saver=False,
    )
    kv_pool = MHATokenToKVPool(
        size=workload.kv_tokens,
        page_size=workload.page_size,
        dtype=torch.float32,
        head_num=model_config.get_num_kv_heads(1),
        head_dim=model_config.head_dim,
        layer_num=model_config.num_hidden_layers,
        device="cpu",
        enable_memory_saver=False,
    )
    sched.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(
        size=workload.kv_tokens,
        page_size=workload.page_size,
        dtype=torch.float32,
        device="cpu",
        kvcache=kv_pool,
        need_sort=False,
    )
    params = construct(
        CacheInitParams,
        disable=not workload.radix_cache,
        req_to_token_pool=sched.req_to_token_pool,
        token_to_kv_pool_allocator=sched.token_to_kv_pool_allocator,
        page_size=workload.page_size,
        chunked_prefill_size=schedule_args.chunked_prefill_size,
    )
    sched.tree_cache = tree_cache(
        sched, params, disabled=not workload.radix_cache, chunk=schedule_args.chunked_prefill_size
    )
    sched.disable_radix_cache = not workload.radix_cache
    sched.is_hybrid_swa = sched.is_hybrid_ssm = False
    sched.sliding_window_size = None
    sched.full_tokens_per_layer, sched.swa_tokens_per_layer = workload.kv_tokens, 0
    try:  # page interleaving arrives in 0.5.20; a release without it does not read the widening
        from sglang.srt.mem_cache.allocator.page_interleave import page_interleave_shard_size
    except ModuleNotFoundError:
        pass
    else:
        sched.kv_shard_widening = page_interleave_shard_size(sched.token_to_kv_pool_allocator)
    sched.decode_offload_manager = None
    sched.rust_server = None
    sched.memory_saver_adapter = TorchMemorySaverAdapter.create(enable=False)
    sched.recv_skipper = sched.input_blocker = None
    return kv_pool


def _outputs(sched, log: CallLog) -> None:
    """Where the scheduler sends: the detokenizer and tokenizer sockets (faked, recording)."""
    detok, tok = FakeSocket(log, "detokenizer"), FakeSocket(log, "tokenizer")
    sched.ipc_channels = SimpleNamespace(
        send_to_detokenizer=detok,
        send_to_tokenizer=tok,
        send_metrics_from_scheduler=None,
        recv_from_rpc=None,
    )
    sched.recv_from_tokenizer = None
    sched.load_snapshot_writer = None


def _ngram_embedding(sched, worker: FakeModelWorker) -> None:
    """SGLang's own (disabled) n-gram embedding manager on the fake runner, and the worker's model
    configuration."""
    model_config = sched.model_config
    worker.model_config = model_config
    try:  # lazy: SGLang is optional
        from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import (
            NgramEmbeddingManager,
        )
    except ModuleNotFoundError:  # before 0.5.16 the scheduler keeps it (maybe_init_ngram_embedding)
        return
    worker.model_runner.ngram_embedding_manager = construct(
        NgramEmbeddingManager.from_model,
        server_args=sched.server_args,  # read there before 0.5.19
        model=torch.nn.Module(),
        model_config=model_config,
        req_to_token_pool=sched.req_to_token_pool,
        max_running_requests=sched.max_running_requests,
        device="cpu",
    )


def _disaggregation(sched, workload: Workload, server_args, kv_pool) -> None:
    """Scheduler.init_disaggregation's prefill branch, with the bootstrap queue on SGLang's fake
    transfer backend (the real one registers with a bootstrap server over the network)."""
    # lazy: SGLang is optional
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        MetadataBuffers,
        ReqToMetadataIdxAllocator,
        TransferBackend,
    )
    from sglang.srt.environ import envs

    sched.disaggregation_mode = DisaggregationMode.PREFILL
    sched.transfer_backend = TransferBackend.FAKE
    sched.mm_receiver = sched.disagg_decode_prealloc_queue = sched.disagg_decode_transfer_queue = (
        None
    )
    size = sched.max_running_requests * 2
    sched.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(size)
    sched.disagg_metadata_buffers = construct(
        MetadataBuffers,
        size,
        hidden_size=16,
        hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=getattr(server_args, "sampling_mask_max_tokens", None),
        custom_mem_pool=None,
        output_dsa_topk_indices_dim=0,
        kv_checksum_enabled=False,
    )
    sched.disagg_prefill_bootstrap_queue = construct(
        PrefillBootstrapQueue,
        token_to_kv_pool=kv_pool,
        draft_token_to_kv_pool=None,
        req_to_metadata_buffer_idx_allocator=sched.req_to_metadata_buffer_idx_allocator,
        metadata_buffers=sched.disagg_metadata_buffers,
        gpu_id=0,
        bootstrap_port=Config("disagg", server_args).disaggregation_bootstrap_port,
        max_total_num_tokens=workload.kv_tokens,
        scheduler=sched,
        scheduler_stage_metrics=sched.scheduler_stage_metrics,
        transfer_backend=TransferBackend.FAKE,
        # what releases before 0.5.21 read of the one-rank world
        gloo_group=sched.attn_tp_cpu_group,
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
    )
    sched.disagg_prefill_inflight_queue = []
    sched.disagg_prefill_pending_chunk_rids = set()
    sched.enable_staging = envs.SGLANG_DISAGG_STAGING_BUFFER.get()


def _device(sched, log: CallLog, schedule: Schedule) -> None:
    """init_overlap took torch's CPU device module; the device's streams and events are the
    fakes."""
    device = FakeDeviceModule(log, schedule)
    sched.device_module = device
    sched.forward_stream_ctx = device.stream(sched.forward_stream)
    sched.copy_stream = FakeStream(log, "copy")
    sched.copy_stream_ctx = device.stream(sched.copy_stream)


def _remaininginit_steps(sched) -> None:
    """SGLang's init_* steps after the device, then the flags the end of Scheduler.__init__ sets."""
    init_steps(
        sched,
        "maybe_init_ngram_embedding",
        "init_deterministic_inference_config",
        "init_dsa_kpool_truncation_align",
        "init_mamba_truncation_align",
        "check_truncation_align_fits_chunk",
        "init_weight_updater",
        "init_request_dispatcher",
        "init_lora_drainer",
        "init_lora_overlap_loader",
        "init_grammar_manager",
        "maybe_init_scripted_scheduler_hook",
        "init_dp_attn_adapter",
        "init_pool_stats_observer",
        "init_invariant_checker",
        "init_load_publisher",
        "init_load_inquirer",
        "init_output_streamer",
        "init_batch_result_processor",
        "init_kv_events_publisher",
        "init_internal_state",  # 0.5.22 only
    )
    sched.idle_sleeper = None
    sched.is_initializing = False
    # Scheduler.run_event_loop's switch: on by default on CUDA, which these scenarios stand for.
    sched._war_barrier_enabled = True
