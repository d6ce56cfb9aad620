"""What differs in SGLang's prefill Scheduler from release to release, found out rather than named:
the helpers prefill_scheduler.py builds the Scheduler with on every release the harness covers
(docs/sglang.md, "Prefill across releases").

    construct(cls, ...)     a constructor or factory with the keyword arguments it accepts
    init_steps(sched, ...)  SGLang's own init_* steps, each where the release has it
    Config(group, args)     a setting from the published configuration, or the server argument
    parallel_state(sched)   Scheduler.ps where the release keeps one (0.5.17 to 0.5.20)
    tree_cache(sched, ...)  the tree cache the release's own factory makes
    cpu_kernels()           the allocator's kernel launch on the CPU where it launches Triton
"""

from __future__ import annotations

import contextlib
import inspect

from engine.sglang.conform import compat


class Config:
    """One group of the published configuration (runtime_context.get_<group>()), falling back to
    the server argument of the same name where this release's group lacks the field, or the
    release has no published configuration (before 0.5.17)."""

    def __init__(self, group: str, server_args):
        from sglang.srt import runtime_context as rc  # lazy: SGLang is optional

        getter = getattr(rc, f"get_{group}", None)
        self._group, self._args = (getter() if getter else None), server_args

    def __getattr__(self, name: str):
        try:
            return getattr(self._group, name)
        except AttributeError:
            return getattr(self._args, name)


def parallel_state(sched) -> None:
    """Scheduler.ps, the ranks and sizes of the one-rank world, where this release keeps them in a
    ParallelState (0.5.17 to 0.5.20; later releases read the published configuration)."""
    from sglang.srt.managers import scheduler  # lazy: SGLang is optional

    cls = getattr(scheduler, "ParallelState", None)
    if cls is None:
        return
    ranks = ("tp", "pp", "dp", "attn_tp", "attn_cp", "attn_dcp", "attn_dp", "moe_ep", "moe_dp")
    values = {f"{r}_rank": 0 for r in ranks} | {f"{r}_size": 1 for r in ranks}
    sched.ps = construct(cls, gpu_id=0, dcp_size=1, **values)


def tree_cache(sched, params, *, disabled: bool, chunk: int | None):
    """The tree cache this release's own factory (mem_cache.registry.create_tree_cache, which
    kv_cache_builder calls) makes for a plain one-rank model: RadixCache up to 0.5.18 and
    UnifiedRadixCache from 0.5.19 when enabled; disabled, ChunkCache up to 0.5.21 and a disabled
    UnifiedRadixCache from 0.5.22."""
    from sglang.srt.mem_cache import registry  # lazy: SGLang is optional

    context = construct(
        registry.TreeCacheBuildContext,
        server_args=sched.server_args,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        full_tokens_per_layer=None,
        is_dsa=False,
        enable_hierarchical_cache=False,
        disable_radix_cache=disabled,
        effective_chunked_prefill_size=chunk,  # read by the factory up to 0.5.21
        tp_worker=sched.tp_worker,
        model_config=sched.model_config,
        tp_size=1,
        tp_rank=0,
        tp_group=sched.tp_group,
    )
    return registry.create_tree_cache(context)


class _NaiveExtendLaunch:
    """`alloc_extend_kernel[grid](...)` run as the same release's torch-native alloc_extend_naive.
    Before 0.5.22 the paged allocator launches its Triton kernel unconditionally, which needs a GPU;
    the release's own alloc_extend_naive computes the same out_indices on the CPU (0.5.22 on picks
    it there itself)."""

    def __init__(self, naive):
        self.naive = naive

    def __getitem__(self, grid):
        def launch(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
            self.naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, "cpu")

        return launch


def cpu_kernels() -> contextlib.ExitStack:
    """For the run: the allocator's kernel launch on the CPU where this release launches Triton
    without asking the platform (nothing where it asks)."""
    from sglang.srt.mem_cache.allocator import paged  # lazy: SGLang is optional

    from engine.sglang import mutate
    from engine.sglang.decode import unwrap

    stack = contextlib.ExitStack()
    source = inspect.getsource(unwrap(paged.PagedTokenToKVPoolAllocator.alloc_extend))
    if "use_triton_kernels" not in source and hasattr(paged, "alloc_extend_naive"):
        naive = _NaiveExtendLaunch(paged.alloc_extend_naive)
        stack.enter_context(mutate.swapped(paged, "alloc_extend_kernel", naive))
    return stack


def construct(cls, *args, **kwargs):
    """cls(*args, **kwargs) (a class or a factory) with only the keyword arguments this release's
    version of it accepts:
    the callers pass what every release they cover reads, and a release adds, renames and drops
    parameters. A required parameter none of them names still fails, in cls's own words."""
    return cls(*args, **compat.accepted(cls, kwargs))


def init_steps(sched, *steps: str) -> None:
    """SGLang's own init_* steps, in this order, each where this release's Scheduler has it (a
    release adds, splits and drops steps; the state a missing step would set is not read by a
    release without it)."""
    for step in steps:
        method = getattr(sched, step, None)
        if method is not None:
            args = RANK_ARGS | {"server_args": sched.server_args}
            params = inspect.signature(method).parameters
            method(**{k: v for k, v in args.items() if k in params})


# What Scheduler.__init__ is given for the one rank of the world, and hands to those init_* steps that
# take it (before 0.5.21: the ranks, and the server arguments to some).
RANK_ARGS = dict(
    gpu_id=0, tp_rank=0, moe_ep_rank=0, pp_rank=0, attn_cp_rank=0, moe_dp_rank=0, dp_rank=None
)
