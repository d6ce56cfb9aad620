"""Float64 torch references for the Triton kernels, same signatures.

They spell the semantics out one request at a time (gather the prefix through the page table,
append the new tokens, mask, softmax) and serve as the CPU fallback when compiled kernels cannot
run. ``out_dtype`` defaults to the dtype of q like the kernels; tests pass torch.float64 to compare
against the unrounded result.
"""

import math

import torch


def _attend(q, keys, values, visible, sm_scale):
    """q [M, H_q, D], keys/values [N, H_kv, D], visible [M, N] bool -> [M, H_q, D] in float64."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.double(), keys) * sm_scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(scores, dim=-1), values)


def _finish(result, out, dtype):
    return result.to(dtype) if out is None else out.copy_(result)


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
    out=None,
    out_dtype=None,
):
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    result = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for slot, prefix, ext, start in zip(
        req_slots.tolist(), prefix_lens.tolist(), extend_lens.tolist(), extend_start_loc.tolist()
    ):
        if ext == 0:
            continue
        tokens = req_to_token[slot, :prefix].long()
        keys = torch.cat([k_pool[tokens], k[start : start + ext]])
        values = torch.cat([v_pool[tokens], v[start : start + ext]])
        query_pos = prefix + torch.arange(ext, device=q.device)
        visible = torch.arange(prefix + ext, device=q.device)[None, :] <= query_pos[:, None]
        result[start : start + ext] = _attend(
            q[start : start + ext], keys, values, visible, sm_scale
        )
    return _finish(result, out, out_dtype or q.dtype)


def decode_attention(
    q,
    k_pool,
    v_pool,
    req_to_token,
    req_slots,
    seq_lens,
    sm_scale: float | None = None,
    num_kv_splits: int | None = None,
    out=None,
    out_dtype=None,
):
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    result = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for i, (slot, length) in enumerate(zip(req_slots.tolist(), seq_lens.tolist())):
        tokens = req_to_token[slot, :length].long()
        visible = torch.ones(1, length, dtype=torch.bool, device=q.device)
        result[i] = _attend(q[i : i + 1], k_pool[tokens], v_pool[tokens], visible, sm_scale)[0]
    return _finish(result, out, out_dtype or q.dtype)


def write_kv(k_pool, v_pool, loc, k, v) -> None:
    loc = loc.long()
    k_pool[loc] = k.to(k_pool.dtype)
    v_pool[loc] = v.to(v_pool.dtype)
