"""Decode attention over a paged KV cache: split-KV flash-decoding.

Each request has one query token that attends to positions 0..seq_len-1 of its context, read from the
pools through ``req_to_token`` (the current token's K/V were written to the pool beforehand). Decode
is bound by reading the KV cache, and a batch of a few long requests has too few (request, head)
pairs to occupy every SM, so stage 1 also splits each context into ``num_kv_splits`` chunks and
writes a partial output plus its log-sum-exp per chunk; stage 2 merges the chunks. All query heads
of a GQA group share one program, so each K/V row is read from HBM once per group.
"""

import math

import torch
import triton
import triton.language as tl

from triton_kernels import reference
from triton_kernels.checks import _check_attention_inputs, _check_metadata, _check_paged_reads
from triton_kernels.runtime import _can_launch, _check_values, _is_interpreted

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    Q,
    KPool,
    VPool,
    ReqToToken,
    ReqSlots,
    SeqLens,
    PartOut,
    PartLse,
    qk_scale,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kpt,
    stride_kph,
    stride_vpt,
    stride_vph,
    stride_r2t,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + req).to(tl.int32)
    slot = tl.load(ReqSlots + req).to(tl.int64)
    # Whole tiles per split, so only a split's last tile is partial.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    head_valid = offs_h < GROUP  # BLOCK_H pads the group up to a tensor-core tile
    d_valid = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(
        Q + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST:  # the interpreter computes bf16 arithmetic wrongly
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    token_row = ReqToToken + slot * stride_r2t
    k_pool = KPool + kv_head * stride_kph
    v_pool = VPool + kv_head * stride_vph
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_valid = cols < hi
        tok = tl.load(token_row + cols, mask=col_valid, other=0).to(tl.int64)
        kv_mask = col_valid[:, None] & d_valid[None, :]
        k = tl.load(k_pool + tok[:, None] * stride_kpt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_pool + tok[:, None] * stride_vpt + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(col_valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (short context) reports lse = -inf so stage 2 gives it zero weight.
    has_keys = l_i > 0
    lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    tl.store(
        PartOut
        + req * stride_pob
        + heads[:, None] * stride_poh
        + split * stride_pos
        + offs_d[None, :],
        out,
        mask=head_valid[:, None] & d_valid[None, :],
    )
    tl.store(PartLse + req * stride_plb + heads * stride_plh + split, lse, mask=head_valid)


@triton.jit
def _decode_reduce_kernel(
    PartOut,
    PartLse,
    Out,
    num_splits,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < num_splits
    d_valid = offs_d < HEAD_DIM
    lse = tl.load(
        PartLse + req * stride_plb + head * stride_plh + offs_s, mask=s_valid, other=float("-inf")
    )
    parts = tl.load(
        PartOut
        + req * stride_pob
        + head * stride_poh
        + offs_s[:, None] * stride_pos
        + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(
        lse_max == float("-inf"), 0.0, lse_max
    )  # no keys at all: output zeros, not NaN
    weight = tl.math.exp2(lse - lse_max)
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        Out + req * stride_ob + head * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=d_valid,
    )


def _cuda_configs():
    shapes = [(64, 4, 3), (32, 4, 4), (64, 4, 2), (64, 8, 3), (128, 8, 2)]
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in shapes]


_decode_split_kernel_tuned = (
    triton.autotune(configs=_cuda_configs(), key=["HEAD_DIM", "BLOCK_H"])(_decode_split_kernel)
    if not _is_interpreted(_decode_split_kernel)
    else None
)

_INTERPRET_BLOCK_N = 16
_MAX_SPLITS = 64
_sm_count: dict = {}


def choose_num_kv_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Enough (request, kv head, split) programs for ~4 per SM, but splits of at least 256 keys."""
    if device.type == "cuda":
        if device not in _sm_count:
            _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
        programs_wanted, min_split = 4 * _sm_count[device], 256
    else:  # interpreter: a few splits so the merge path is exercised, on tiny tiles
        programs_wanted, min_split = 8, 4 * _INTERPRET_BLOCK_N
    by_occupancy = triton.cdiv(programs_wanted, max(1, batch * num_kv_heads))
    by_length = triton.cdiv(max(1, max_seq_len), min_split)
    return max(1, min(_MAX_SPLITS, by_occupancy, by_length))


def _check_decode_inputs(
    q, k_pool, v_pool, req_to_token, req_slots, seq_lens, num_kv_splits, out
) -> None:
    name = "decode_attention"
    for key, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: {key} must be a 3-D tensor")
    batch = q.shape[0]
    _check_attention_inputs(
        name, q, k_pool, v_pool, req_to_token, out, {"k_pool": k_pool, "v_pool": v_pool}
    )
    _check_metadata(name, q.device, req_slots=req_slots, seq_lens=seq_lens)
    if req_slots.numel() != batch or seq_lens.numel() != batch:
        raise ValueError(f"{name}: req_slots/seq_lens must have one entry per query ({batch})")
    if num_kv_splits is not None and not 1 <= int(num_kv_splits) <= 256:
        raise ValueError(f"{name}: num_kv_splits must be in [1, 256], got {num_kv_splits}")
    if _check_values(q.device) and batch:
        if int(seq_lens.min()) < 1:
            raise ValueError(
                f"{name}: seq_lens {seq_lens.tolist()} must be >= 1 "
                "(the current token is in the pool)"
            )
        _check_paged_reads(name, req_to_token, req_slots, seq_lens, k_pool.shape[0])


def decode_attention(
    q,
    k_pool,
    v_pool,
    req_to_token,
    req_slots,
    seq_lens,
    sm_scale: float | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request over its paged context. q [B, H_q, D] -> [B, H_q, D].

    ``num_kv_splits`` None picks one from the batch size and longest context (a device->host sync;
    callers running many layers per step should pick once with choose_num_kv_splits). ``out``
    (optional, q's shape and dtype) receives the result in place of a fresh tensor.
    """
    _check_decode_inputs(q, k_pool, v_pool, req_to_token, req_slots, seq_lens, num_kv_splits, out)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    kernel = _decode_split_kernel
    if not _can_launch(kernel, q.device):
        result = reference.decode_attention(
            q, k_pool, v_pool, req_to_token, req_slots, seq_lens, sm_scale
        )
        return result if out is None else out.copy_(result)

    q = q if q.stride(2) == 1 else q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(batch, num_kv_heads, int(seq_lens.max()), q.device)
    num_kv_splits = int(num_kv_splits)
    interpreted = _is_interpreted(kernel)
    group = num_q_heads // num_kv_heads
    block_d = triton.next_power_of_2(max(head_dim, 16))
    part_out = torch.empty(
        (batch, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(
        (batch, num_q_heads, num_kv_splits), dtype=torch.float32, device=q.device
    )

    args = (
        q,
        k_pool,
        v_pool,
        req_to_token,
        req_slots,
        seq_lens,
        part_out,
        part_lse,
        sm_scale * LOG2E,
        num_kv_splits,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        req_to_token.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
    )
    meta = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        # tl.dot needs >= 16 rows when compiled; the padded heads are masked and cost no HBM traffic.
        BLOCK_H=triton.next_power_of_2(group)
        if interpreted
        else max(16, triton.next_power_of_2(group)),
        UPCAST=interpreted or q.dtype == torch.float32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    grid = (batch, num_kv_heads, num_kv_splits)
    if interpreted:
        kernel[grid](*args, **meta, BLOCK_N=_INTERPRET_BLOCK_N)
    else:
        _decode_split_kernel_tuned[grid](*args, **meta)
    _decode_reduce_kernel[(batch, num_q_heads)](
        part_out,
        part_lse,
        out,
        num_kv_splits,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
    )
    return out
