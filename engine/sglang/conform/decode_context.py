"""The configuration a decode scheduler reads, published as SGLang's launcher publishes it.

SGLang's components read their settings from the process-wide runtime context (`get_disagg()`,
`get_parallel()`, ...), and some of its real callers (`SchedulerWeightUpdaterManager`, the polls'
all-reduce) need the process groups of the one-rank world. `published()` publishes a decode
server's configuration for the block and puts back what was published before;
`idle_scheduler_state` and `weight_updater` are what a decode scheduler without a batch needs for
SGLang's idleness report and its memory-release caller.
"""

from __future__ import annotations

import contextlib
import types

from engine.sglang.conform import compat
from engine.sglang.conform.prefill_scheduler import _model_path, _process_groups


@contextlib.contextmanager
def published(
    page_size: int,
    max_running: int = 8,
    kv_tokens: int = 4096,
    context_length: int = 256,
    **overrides,
):
    """A decode server's ServerArgs (TP = PP = DP = 1, CPU), published for the block where the
    release publishes (0.5.17 on; before, the queue reads the scheduler's own server_args, which the
    harness sets from what the block gets), with the process groups of a one-rank world."""
    # lazy: SGLang is optional
    from sglang.srt.server_args import ServerArgs

    from engine.sglang import load

    server_args = ServerArgs(
        model_path=_model_path(),
        device="cpu",
        disaggregation_mode="decode",
        page_size=page_size,
        max_running_requests=max_running,
        max_total_tokens=kv_tokens,
        context_length=context_length,
        tp_size=1,
        disable_cuda_graph=True,
        attention_backend="torch_native",
        skip_tokenizer_init=True,
        disable_overlap_schedule=True,
        **overrides,
    )
    rc = load().runtime_context
    if rc is None or not hasattr(rc, "publish"):
        from sglang.srt import server_args as args_module  # lazy: SGLang is optional

        # the legacy global: a module variable up to 0.5.14, the runtime context's slot after
        holder, slot = args_module, "_global_server_args"
        if not hasattr(args_module, slot):
            from sglang.srt.runtime_context import get_context  # lazy: SGLang is optional

            holder, slot = get_context(), "_server_args"
        before = getattr(holder, slot)
        args_module.set_global_server_args_for_scheduler(server_args)
        _process_groups()
        try:
            yield server_args
        finally:
            setattr(holder, slot, before)
        return
    # 0.5.17 and 0.5.18 keep no snapshot: their publish is last-publish-wins, and every run
    # publishes its own configuration
    state = rc.snapshot_context() if hasattr(rc, "snapshot_context") else None
    try:
        # the spawn ranks are an argument from 0.5.21; before, a one-rank world is the default
        ranks = {"ranks": rc.SpawnRanks(world_rank=0)} if hasattr(rc, "SpawnRanks") else {}
        rc.publish(server_args, role="scheduler", **ranks)
        _process_groups()
        yield server_args
    finally:
        if state is not None:
            rc.restore_context(state)


def idle_scheduler_state(sgl, queue) -> dict:
    """What SGLang's real Scheduler.is_fully_idle, pause_generation and continue_generation read, for
    a decode scheduler with no batch around the prealloc `queue`: the queues SGLang keeps (the
    transfer queue is SGLang's own class, empty until a harness fills it) and the flags of the
    features the scenarios leave off."""
    d = sgl.decode
    transfer = d.DecodeTransferQueue.__new__(d.DecodeTransferQueue)
    transfer.queue, transfer._deferred_releases = [], []
    queue.held_rebootstrap_reqs = []
    return dict(
        running_batch=types.SimpleNamespace(reqs=[], is_empty=lambda: True),
        dllm_manager=types.SimpleNamespace(any_staging_reqs=lambda: False),
        waiting_queue=[],
        grammar_manager=types.SimpleNamespace(grammar_queue=[]),
        disaggregation_mode=sgl.decode_utils.DisaggregationMode.DECODE,
        disagg_decode_transfer_queue=transfer,
        decode_offload_manager=None,
        enable_hisparse=False,
        enable_hierarchical_cache=False,
        enable_lmcache=False,
        _pause_started_at=None,
        _pause_intervals=[],
        # what is_fully_idle reads on some releases: the batch in flight (up to 0.5.13) and the
        # scheduler's parallel layout (its PP check)
        cur_batch=None,
        ps=types.SimpleNamespace(pp_size=1, tp_size=1, tp_rank=0, dp_size=1, dp_rank=0),
    )


def weight_updater(sched):
    """SGLang's SchedulerWeightUpdaterManager, the only caller of the queues' memory release, made
    as Scheduler.init_weight_updater makes it (inside `published()`: it reads the TP group). Its
    cache flush is a stand-in for scenarios without pools: it answers what the real flush_cache
    checks first, SGLang's is_fully_idle."""
    # lazy: SGLang is optional
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    def flush_cache(empty_cache: bool = True) -> bool:
        # ignore_waiting: an argument from 0.5.21
        paused = {"ignore_waiting": sched._engine_paused}
        return sched.is_fully_idle(**compat.accepted(sched.is_fully_idle, paused))

    from sglang.srt.distributed import parallel_state  # lazy: SGLang is optional

    # the TP group's CPU group is an argument up to 0.5.21, read from get_parallel() after
    return compat.make(
        SchedulerWeightUpdaterManager,
        tp_cpu_group=parallel_state.get_tp_group().cpu_group,
        tp_worker=None,
        draft_worker=None,
        memory_saver_adapter=TorchMemorySaverAdapter.create(enable=False),
        flush_cache=flush_cache,
        is_fully_idle=sched.is_fully_idle,
        scheduler=sched,
    )


def intake_state(recv, ingest) -> dict:
    """The scheduler's intake as every release's loops call it: `ingest` as ingest_requests (0.5.20
    on), else `recv` as the loop's own request_receiver.recv_requests, followed by SGLang's real
    process_input_requests, which also reads these (features the scenarios leave off)."""
    return dict(
        ingest_requests=ingest,
        request_receiver=types.SimpleNamespace(recv_requests=recv),
        session_controller=types.SimpleNamespace(maybe_reap=lambda now: None),
        flush_wrapper=types.SimpleNamespace(check_pending=lambda: None),
        external_corpus_manager=None,
        return_health_check_ipcs=[],
    )
