"""Scatter the new tokens' K and V rows into the paged pools: k_pool[loc] = k, v_pool[loc] = v.

Why a kernel and not ``index_copy_``: the copy is purely bandwidth-bound and tiny at decode time
(one row per request per layer), so launch overhead dominates; one Triton launch writes K and V
together where ``index_copy_`` needs two launches (plus an int64 cast of ``loc`` when it is int32).
``python -m triton_kernels.bench`` times both on the GPU. When compiled kernels cannot run (CPU
tensors without the interpreter) the wrapper falls back to ``index_copy_``.
"""

import torch
import triton
import triton.language as tl

from triton_kernels.checks import _check_metadata
from triton_kernels.runtime import _can_launch, _check_values


@triton.jit
def _write_kv_kernel(
    KPool,
    VPool,
    Loc,
    K,
    V,
    stride_kpt,
    stride_kph,
    stride_vpt,
    stride_vph,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: its H_kv x D row is contiguous in the pool, a single coalesced write.
    token = tl.program_id(0).to(tl.int64)
    dst = tl.load(Loc + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    # Same dtype on both sides (checked on the host), so this is a bit copy, exact even for bf16.
    tl.store(
        KPool + dst * stride_kpt + offs_h[:, None] * stride_kph + offs_d[None, :], k, mask=mask
    )
    tl.store(
        VPool + dst * stride_vpt + offs_h[:, None] * stride_vph + offs_d[None, :], v, mask=mask
    )


def write_kv(k_pool, v_pool, loc, k, v) -> None:
    """k_pool[loc] = k; v_pool[loc] = v for loc int32/int64 [T], k/v [T, H_kv, D]."""
    name = "write_kv"
    for key, t in (("k_pool", k_pool), ("v_pool", v_pool), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: {key} must be a 3-D tensor")
    _check_metadata(name, k_pool.device, loc=loc)
    num_tokens = loc.numel()
    row = tuple(k_pool.shape[1:])
    if v_pool.shape != k_pool.shape or k.shape != (num_tokens, *row) or v.shape != k.shape:
        raise ValueError(
            f"{name}: k/v {tuple(k.shape)}/{tuple(v.shape)} must be [{num_tokens}, {row[0]}, {row[1]}] "
            f"to fit pools {tuple(k_pool.shape)}/{tuple(v_pool.shape)}"
        )
    if not (k.dtype == v.dtype == k_pool.dtype == v_pool.dtype):
        raise ValueError(f"{name}: k, v and the pools must share one dtype")
    if any(t.device != k_pool.device for t in (v_pool, k, v)):
        raise ValueError(f"{name}: all tensors must be on {k_pool.device}")
    if k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError(f"{name}: pools need a contiguous head_dim")
    if num_tokens == 0:
        return
    if _check_values(k_pool.device):
        lo, hi = int(loc.min()), int(loc.max())
        if lo < 0 or hi >= k_pool.shape[0]:
            raise ValueError(
                f"{name}: loc values in [{lo}, {hi}] outside the pool [0, {k_pool.shape[0]})"
            )

    if not _can_launch(_write_kv_kernel, k_pool.device):
        index = loc.long()
        k_pool.index_copy_(0, index, k)
        v_pool.index_copy_(0, index, v)
        return
    k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (k, v))
    num_heads, head_dim = row
    _write_kv_kernel[(num_tokens,)](
        k_pool,
        v_pool,
        loc,
        k,
        v,
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
