"""The configuration a decode scheduler reads, published as SGLang's launcher publishes it.

SGLang's components read their settings from the process-wide runtime context (`get_disagg()`,
`get_parallel()`, ...), and some of its real callers (`SchedulerWeightUpdaterManager`, the polls'
all-reduce) need the process groups of the one-rank world. `published()` publishes a decode
server's configuration for the block and puts back what was published before.
"""

from __future__ import annotations

import contextlib

from .prefill_scheduler import _model_path, _process_groups


@contextlib.contextmanager
def published(page_size: int, max_running: int = 8, kv_tokens: int = 4096, **overrides):
    """A decode server's ServerArgs published for the block (TP = PP = DP = 1, CPU)."""
    # lazy: SGLang is optional
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    state = rc.snapshot_context()
    try:
        server_args = ServerArgs(
            model_path=_model_path(),
            device="cpu",
            disaggregation_mode="decode",
            page_size=page_size,
            max_running_requests=max_running,
            max_total_tokens=kv_tokens,
            context_length=256,
            tp_size=1,
            disable_cuda_graph=True,
            attention_backend="torch_native",
            skip_tokenizer_init=True,
            disable_overlap_schedule=True,
            **overrides,
        )
        rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
        _process_groups()
        yield server_args
    finally:
        rc.restore_context(state)
