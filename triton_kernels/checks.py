"""Input checks shared by the kernels' host wrappers: shapes, dtypes, devices and the paged reads.

Each raises ValueError naming the wrapper (`name`), so a bad call fails on the host with a reason
instead of reading outside a pool inside a kernel.
"""

import torch


def _check_attention_inputs(name: str, q, k_pool, v_pool, req_to_token, out, same: dict) -> None:
    """Checks shared by the attention wrappers: pool shapes against q's head_dim and head count,
    dtypes (`same` must share q's), devices, contiguous head_dim, req_to_token, and `out`."""
    head_dim, num_q_heads, num_kv_heads = q.shape[-1], q.shape[1], k_pool.shape[1]
    if k_pool.shape != v_pool.shape or k_pool.shape[2] != head_dim:
        raise ValueError(
            f"{name}: pool shapes {tuple(k_pool.shape)}/{tuple(v_pool.shape)} "
            f"do not match head_dim {head_dim}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"{name}: {num_q_heads} query heads not a multiple of {num_kv_heads} kv heads"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: unsupported dtype {q.dtype}")
    if any(t.dtype != q.dtype for t in same.values()):
        raise ValueError(f"{name}: q, {', '.join(same)} must share one dtype")
    if any(t.device != q.device for t in (*same.values(), req_to_token)):
        raise ValueError(f"{name}: all tensors must be on {q.device}")
    if k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError(f"{name}: pools need a contiguous head_dim")
    if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: req_to_token must be a 2-D int32/int64 tensor")
    if out is not None and (
        out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1
    ):
        raise ValueError(
            f"{name}: out must match q's shape, dtype and device, with a contiguous head_dim"
        )


def _check_metadata(name: str, device: torch.device, **tensors) -> None:
    """Per-request metadata must be 1-D int32/int64 tensors on the kernels' device."""
    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise ValueError(f"{name}: {key} must be a 1-D tensor")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: {key} must be int32 or int64, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name}: {key} is on {t.device}, expected {device}")


def _check_paged_reads(name, req_to_token, req_slots, lens, num_pool_tokens) -> None:
    """ValueError unless positions 0..lens[i]-1 of row req_slots[i] all map into the pool."""
    if req_slots.numel() == 0:
        return
    num_slots, max_context = req_to_token.shape
    slots, lens = req_slots.long(), lens.long()
    if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
        raise ValueError(
            f"{name}: req_slots {slots.tolist()} outside req_to_token rows [0, {num_slots})"
        )
    if int(lens.min()) < 0 or int(lens.max()) > max_context:
        raise ValueError(
            f"{name}: context lengths {lens.tolist()} outside [0, {max_context}] "
            "(req_to_token width)"
        )
    width = int(lens.max())
    if width == 0:
        return
    rows = req_to_token[slots, :width].long()
    used = torch.arange(width, device=rows.device)[None, :] < lens[:, None]
    bad = used & ((rows < 0) | (rows >= num_pool_tokens))
    if bool(bad.any()):
        i, pos = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{name}: request {i} (slot {int(slots[i])}) position {pos} maps to token index "
            f"{int(rows[i, pos])}, outside the KV pool [0, {num_pool_tokens})"
        )
