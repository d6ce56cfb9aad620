"""The small device-side tasks of a batch — staging copies, deferred sampling, the device-to-host
copy of the sampled tokens, the KV gathers of the transfer and the AttentionStore — as one
TorchScript call each, on CPU.

On CPU these run on the emulated streams' threads (engine/runtime/device.py). Each torch op called from
Python releases the GIL and takes it back, and taking it back while the scheduler thread runs Python
can cost up to a switch interval: the chain of such hops of one batch (staging → forward → sample →
copy) stretched the device's forward well past its CPU time (docs/benchmarks.md). One call per task
keeps the hops to one per task. Same ops, same order, same results as the eager code they replace,
which CUDA keeps (there the ops only enqueue kernels).
"""

from __future__ import annotations

import threading
import warnings

import torch


def _stage(
    buf_ids: torch.Tensor,
    buf_pos: torch.Tensor,
    buf_loc: torch.Tensor,
    ids: torch.Tensor,
    pos: torch.Tensor,
    loc: torch.Tensor,
    n: int,
) -> None:
    buf_ids[:n].copy_(ids)
    buf_pos[:n].copy_(pos)
    buf_loc[:n].copy_(loc)


def _sample(
    future_map: torch.Tensor,
    slots: torch.Tensor,
    logits_buf: torch.Tensor,
    bias: torch.Tensor,
    bs: int,
) -> None:
    future_map[slots] = torch.argmax(logits_buf[:bs] + bias, dim=-1)


def _to_host(host: torch.Tensor, future_map: torch.Tensor, slots: torch.Tensor) -> None:
    host.copy_(future_map[slots])


def _gather_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor) -> list[torch.Tensor]:
    """K and V of the pool's token indices `idx`, all layers, as new tensors (the KV transfer)."""
    i = idx.long()
    return [k_pool[:, i].clone(), v_pool[:, i].clone()]


def _stage_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """One gather of K and V for several requests' tokens, stacked (the AttentionStore staging)."""
    i = idx.long()
    return torch.stack([k_pool[:, i], v_pool[:, i]])


def lazy_scripts(fns: dict):
    """A function returning `fns` compiled by torch.jit.script, compiled on the first call, once per
    process. (torch.jit.script is deprecated in torch 2.x in favour of torch.compile, whose CPU code
    is Python wrapper code around kernels and does not release the GIL for a whole call; the
    deprecation warnings are silenced here.)"""
    compiled: dict = {}
    lock = threading.Lock()

    def get() -> dict:
        if not compiled:
            with lock:
                if not compiled:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", DeprecationWarning)
                        warnings.simplefilter("ignore", FutureWarning)
                        done = {name: torch.jit.script(f) for name, f in fns.items()}
                    compiled.update(done)  # one call: a reader sees all of them or none
        return compiled

    return get


ops = lazy_scripts(
    {
        "stage": _stage,
        "sample": _sample,
        "to_host": _to_host,
        "gather_kv": _gather_kv,
        "stage_kv": _stage_kv,
    }
)
