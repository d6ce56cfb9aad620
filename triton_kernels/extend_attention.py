"""Extend (prefill) attention over a paged KV cache.

A batch packs the new ("extend") tokens of several requests along dim 0. Each request's queries see
(a) its whole cached prefix, gathered from the paged pool through ``req_to_token`` with no mask, and
(b) its own new tokens, passed packed in ``k``/``v`` rather than re-read from the pool, causally.
Splitting the two sources keeps the hot causal part on contiguous memory and lets prefix-cache hits
(part a) cost one gather per token instead of a recompute.

One program owns BLOCK_M queries of one request and one query head; it streams the keys in BLOCK_N
tiles with an online softmax in fp32 in the exp2 domain (log2(e) folded into the scale), so the
attention matrix is never materialised. Full tiles run without masks; only the last prefix tile and
the diagonal tiles of the causal part carry a key mask, and tiles above the diagonal are never visited.
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
def _softmax_step(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    qk_scale,
    visible,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold one key tile into the running (acc, max, sum) of the online softmax."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # m_i starts finite, so a row with no visible key in this tile gets p == 0 and alpha == 1.
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    KPool,
    VPool,
    Out,
    ReqToToken,
    ReqSlots,
    PrefixLens,
    ExtendLens,
    ExtendStart,
    qk_scale,
    len_bucket,  # len_bucket: an autotune key only (short extends may prefer other tiles)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kpt,
    stride_kph,
    stride_vpt,
    stride_vph,
    stride_ot,
    stride_oh,
    stride_r2t,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Heads vary fastest so the query heads of one GQA group run together and share K/V in L2;
    # query tiles go in reverse so the longest (most-diagonal) tiles start first.
    head = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    req = tl.program_id(2)
    ext_len = tl.load(ExtendLens + req).to(tl.int32)
    if start_m >= ext_len:
        return
    slot = tl.load(ReqSlots + req).to(tl.int64)
    prefix_len = tl.load(PrefixLens + req).to(tl.int32)
    ext_start = tl.load(ExtendStart + req).to(tl.int64)
    kv_head = head // GROUP

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # Padding head_dim lanes (BLOCK_D > HEAD_DIM) load as zeros and so add nothing to q.k or the output.
    # Where BLOCK_D == HEAD_DIM this mask is provably all-true and does not block vectorised loads.
    d_mask = offs_d[None, :] < HEAD_DIM
    row_valid = offs_m < ext_len
    q = tl.load(
        Q + (ext_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_mask,
        other=0.0,
    )
    if UPCAST:  # the interpreter computes bf16 arithmetic wrongly; fp32 inputs stay fp32
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # (a) cached prefix through the page table: every key visible, only the tail tile is partial.
    token_row = ReqToToken + slot * stride_r2t
    k_pool = KPool + kv_head * stride_kph + offs_d[None, :]
    v_pool = VPool + kv_head * stride_vph + offs_d[None, :]
    full_end = prefix_len // BLOCK_N * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        tok = tl.load(token_row + start_n + offs_n).to(tl.int64)[:, None]
        k = tl.load(k_pool + tok * stride_kpt, mask=d_mask, other=0.0)
        v = tl.load(v_pool + tok * stride_vpt, mask=d_mask, other=0.0)
        acc, m_i, l_i = _softmax_step(
            acc, m_i, l_i, q, k, v, qk_scale, None, False, UPCAST, DOT_PRECISION
        )
    if full_end < prefix_len:
        cols = full_end + offs_n
        col_valid = cols < prefix_len
        tok = tl.load(token_row + cols, mask=col_valid, other=0).to(tl.int64)[:, None]
        kv_mask = col_valid[:, None] & d_mask
        k = tl.load(k_pool + tok * stride_kpt, mask=kv_mask, other=0.0)
        v = tl.load(v_pool + tok * stride_vpt, mask=kv_mask, other=0.0)
        acc, m_i, l_i = _softmax_step(
            acc, m_i, l_i, q, k, v, qk_scale, col_valid[None, :], True, UPCAST, DOT_PRECISION
        )

    # (b) the request's own new tokens, causal. Tiles left of the diagonal block are fully visible
    # (all their keys precede every query here and lie inside the request: start_m < ext_len).
    k_new = K + (ext_start + offs_n)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
    v_new = V + (ext_start + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
    for start_n in range(0, start_m, BLOCK_N):
        k = tl.load(k_new + start_n * stride_kt, mask=d_mask, other=0.0)
        v = tl.load(v_new + start_n * stride_vt, mask=d_mask, other=0.0)
        acc, m_i, l_i = _softmax_step(
            acc, m_i, l_i, q, k, v, qk_scale, None, False, UPCAST, DOT_PRECISION
        )
    diag_end = tl.minimum(start_m + BLOCK_M, ext_len)
    for start_n in range(start_m, diag_end, BLOCK_N):
        cols = start_n + offs_n
        col_valid = cols < ext_len
        kv_mask = col_valid[:, None] & d_mask
        k = tl.load(k_new + start_n * stride_kt, mask=kv_mask, other=0.0)
        v = tl.load(v_new + start_n * stride_vt, mask=kv_mask, other=0.0)
        visible = (cols[None, :] <= offs_m[:, None]) & col_valid[None, :]
        acc, m_i, l_i = _softmax_step(
            acc, m_i, l_i, q, k, v, qk_scale, visible, True, UPCAST, DOT_PRECISION
        )

    out = acc / l_i[:, None]
    out_ptrs = Out + (ext_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(
        out_ptrs,
        out.to(Out.dtype.element_ty),
        mask=row_valid[:, None] & (offs_d[None, :] < HEAD_DIM),
    )


def _cuda_configs():
    # Hopper-sized tiles; BLOCK_M must be a multiple of BLOCK_N (unmasked left-of-diagonal loop).
    # Configs that exceed shared memory for large head dims are pruned by the autotuner itself.
    shapes = [
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (128, 64, 4, 3),
        (128, 32, 4, 4),
        (64, 64, 4, 3),
        (64, 32, 4, 3),
    ]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in shapes
    ]


# Tuned per head dim, group size, dtypes and a coarse length bucket (short extends prefer small tiles).
_extend_kernel_tuned = (
    triton.autotune(configs=_cuda_configs(), key=["HEAD_DIM", "GROUP", "len_bucket"])(
        _extend_kernel
    )
    if not _is_interpreted(_extend_kernel)
    else None
)

# The interpreter pays per op rather than per element: fewer, larger tiles are faster. BLOCK_M > BLOCK_N
# as on the GPU, so the diagonal block spans several key tiles there too (rows fully masked in a tile).
_INTERPRET_BLOCK_M, _INTERPRET_BLOCK_N = 32, 16


def _check_extend_inputs(
    q,
    k,
    v,
    k_pool,
    v_pool,
    req_to_token,
    req_slots,
    prefix_lens,
    extend_lens,
    extend_start_loc,
    max_extend_len,
    out,
) -> None:
    name = "extend_attention"
    for key, t in (("q", q), ("k", k), ("v", v), ("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: {key} must be a 3-D tensor [tokens, heads, head_dim]")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"{name}: k/v shapes {tuple(k.shape)}/{tuple(v.shape)} do not match "
            f"[{num_tokens}, {num_kv_heads}, {head_dim}] from q and k_pool"
        )
    _check_attention_inputs(
        name,
        q,
        k_pool,
        v_pool,
        req_to_token,
        out,
        {"k": k, "v": v, "k_pool": k_pool, "v_pool": v_pool},
    )
    _check_metadata(
        name,
        q.device,
        req_slots=req_slots,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        extend_start_loc=extend_start_loc,
    )
    batch = req_slots.numel()
    if not (prefix_lens.numel() == extend_lens.numel() == extend_start_loc.numel() == batch):
        raise ValueError(f"{name}: per-request metadata lengths differ")
    max_extend_len = int(max_extend_len)
    if _check_values(q.device) and batch:
        lens, starts = extend_lens.long(), extend_start_loc.long()
        if int(lens.min()) < 0 or int(lens.max()) > max_extend_len:
            raise ValueError(
                f"{name}: extend_lens {lens.tolist()} outside [0, max_extend_len={max_extend_len}]"
            )
        if int(starts.min()) < 0 or int((starts + lens).max()) > num_tokens:
            raise ValueError(
                f"{name}: extend ranges (start {starts.tolist()}, "
                f"len {lens.tolist()}) exceed {num_tokens} tokens"
            )
        if int((prefix_lens.long() + lens).max()) > req_to_token.shape[1]:
            raise ValueError(
                f"{name}: prefix + extend exceeds req_to_token width {req_to_token.shape[1]}"
            )
        _check_paged_reads(name, req_to_token, req_slots, prefix_lens, k_pool.shape[0])


def extend_attention(
    q,
    k,
    v,
    k_pool,
    v_pool,
    req_to_token,
    req_slots,
    prefix_lens,
    extend_lens,
    extend_start_loc,
    max_extend_len: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed extend tokens over (paged prefix + causal self). Returns [T, H_q, D].

    ``max_extend_len`` must be >= every extend length: it sizes the grid (a device->host sync avoided).
    ``out`` (optional, q's shape and dtype) receives the result in place of a fresh tensor.
    """
    _check_extend_inputs(
        q,
        k,
        v,
        k_pool,
        v_pool,
        req_to_token,
        req_slots,
        prefix_lens,
        extend_lens,
        extend_start_loc,
        max_extend_len,
        out,
    )
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    batch = req_slots.numel()
    max_extend_len = int(max_extend_len)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    kernel = _extend_kernel
    if not _can_launch(kernel, q.device):
        result = reference.extend_attention(
            q,
            k,
            v,
            k_pool,
            v_pool,
            req_to_token,
            req_slots,
            prefix_lens,
            extend_lens,
            extend_start_loc,
            max_extend_len,
            sm_scale,
        )
        return result if out is None else out.copy_(result)

    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0 or num_tokens == 0 or max_extend_len == 0:
        return out
    interpreted = _is_interpreted(kernel)
    args = (
        q,
        k,
        v,
        k_pool,
        v_pool,
        out,
        req_to_token,
        req_slots,
        prefix_lens,
        extend_lens,
        extend_start_loc,
        sm_scale * LOG2E,
        0 if max_extend_len <= 256 else 1,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
    )
    meta = dict(
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(max(head_dim, 16)),
        UPCAST=interpreted or q.dtype == torch.float32,
        # fp32 inputs would silently drop to tf32 on tensor cores; keep them at full precision.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    if interpreted:
        grid = (num_q_heads, triton.cdiv(max_extend_len, _INTERPRET_BLOCK_M), batch)
        kernel[grid](*args, **meta, BLOCK_M=_INTERPRET_BLOCK_M, BLOCK_N=_INTERPRET_BLOCK_N)
    else:
        grid = lambda cfg: (num_q_heads, triton.cdiv(max_extend_len, cfg["BLOCK_M"]), batch)  # noqa: E731
        _extend_kernel_tuned[grid](*args, **meta)
    return out
