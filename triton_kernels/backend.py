"""The engine's attention-backend interface on top of the Triton kernels.

Duck-typed on purpose: ``meta`` is any object with the ExtendMeta / DecodeMeta attributes, so this
package does not depend on ``engine/``. Inputs may be [tokens, heads, head_dim] or flattened
[tokens, heads * head_dim]; the output has the shape q came in with.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from triton_kernels import interpreting
from triton_kernels.decode_attention import choose_num_kv_splits, decode_attention
from triton_kernels.extend_attention import extend_attention
from triton_kernels.kv_write import write_kv

# Launches that share state go one at a time. On a GPU: Triton's autotuner keeps the arguments of
# the call it is tuning on the shared kernel object, so two threads tuning at once (two prefill
# ranks of `pdo run --pd --dp 2` in one process) break each other. Under the interpreter: it patches
# `triton.language` for the duration of a launch and keeps the program id in one global, so a
# prefill and a decode forward interpreting at once crash, or worse, compute with each other's grid.
_ONE_LAUNCH = threading.Lock()


def _one_at_a_time(t: torch.Tensor):
    return _ONE_LAUNCH if t.is_cuda or interpreting() else contextlib.nullcontext()


def _heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    return t.view(t.shape[0], -1, head_dim) if t.dim() == 2 else t


class TritonAttention:
    name = "triton"

    def __init__(self, sm_scale: float | None = None, num_kv_splits: int | None = None):
        self.sm_scale = sm_scale  # None: 1/sqrt(head_dim)
        self.num_kv_splits = num_kv_splits  # None: chosen per batch
        # The same DecodeMeta serves every layer of a step: size the split once, not once per layer.
        # Any split count gives the same result, so a stale choice could only cost speed.
        self._splits_for: tuple[object, int] | None = None

    def write_kv(self, k_pool, v_pool, loc, k, v) -> None:
        head_dim = k_pool.shape[-1]
        with _one_at_a_time(k):
            write_kv(k_pool, v_pool, loc, _heads(k, head_dim), _heads(v, head_dim))

    def extend(self, q, k, v, k_pool, v_pool, meta) -> torch.Tensor:
        head_dim = k_pool.shape[-1]
        with _one_at_a_time(q):
            out = extend_attention(
                _heads(q, head_dim),
                _heads(k, head_dim),
                _heads(v, head_dim),
                k_pool,
                v_pool,
                meta.req_to_token,
                meta.req_slots,
                meta.prefix_lens,
                meta.extend_lens,
                meta.extend_start_loc,
                int(meta.max_extend_len),
                sm_scale=self.sm_scale,
            )
        return out.view(q.shape)

    def decode(self, q, k_pool, v_pool, meta) -> torch.Tensor:
        head_dim = k_pool.shape[-1]
        splits = self._num_kv_splits(meta, k_pool)
        with _one_at_a_time(q):
            out = decode_attention(
                _heads(q, head_dim),
                k_pool,
                v_pool,
                meta.req_to_token,
                meta.req_slots,
                meta.seq_lens,
                sm_scale=self.sm_scale,
                num_kv_splits=splits,
            )
        return out.view(q.shape)

    def _num_kv_splits(self, meta, k_pool) -> int:
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        cached = self._splits_for
        if cached is not None and cached[0] is meta:
            return cached[1]
        host_lens = getattr(meta, "host_seq_lens", None)  # the engine's host copy spares the sync
        lens = host_lens if host_lens is not None else meta.seq_lens.tolist()
        splits = choose_num_kv_splits(
            len(lens), k_pool.shape[1], max(lens, default=1), k_pool.device
        )
        self._splits_for = (meta, splits)
        return splits
