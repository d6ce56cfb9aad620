"""Attention backends. The model calls `write_kv`, then `extend` (prefill) or `decode`.

Layouts (shared with triton_kernels/): q [T, Hq, D]; k, v [T, Hkv, D] for the batch's new tokens,
packed request after request; pools [pool_tokens, Hkv, D] for one layer; `req_to_token[slot, pos]`
is the pool index of a request's position `pos`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExtendMeta:
    req_to_token: torch.Tensor
    req_slots: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    max_extend_len: int
    out_cache_loc: torch.Tensor
    # host copies: the torch backend loops over requests on the host
    host_slots: list | None = None
    host_prefix: list | None = None
    host_extend: list | None = None


@dataclass
class DecodeMeta:
    req_to_token: torch.Tensor
    req_slots: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    host_slots: list | None = None
    host_seq_lens: list | None = None


class TorchAttention:
    """Reference-quality backend on torch ops (SDPA per request); the default on CPU."""

    name = "torch"

    def write_kv(self, k_pool, v_pool, loc, k, v) -> None:
        k_pool[loc.long()] = k
        v_pool[loc.long()] = v

    def extend(self, q, k, v, k_pool, v_pool, meta: ExtendMeta) -> torch.Tensor:
        """One SDPA call over the whole packed batch: keys are every request's cached prefix (read
        through req_to_token) followed by the batch's new tokens, and a block-diagonal causal mask
        keeps each query to its own request. A handful of ops per layer instead of a dozen per request
        and layer, which matters on CPU where every op costs interpreter (and GIL) time."""
        prefix_idx, mask = _packed_extend(meta, q.device)
        kk = torch.cat([k_pool[prefix_idx], k])
        vv = torch.cat([v_pool[prefix_idx], v])
        return _attend_masked(q, kk, vv, q.shape[1] // k.shape[1], mask)

    def decode(self, q, k_pool, v_pool, meta: DecodeMeta) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k_pool.shape[1]
        for i, (slot, n) in enumerate(zip(meta.host_slots, meta.host_seq_lens)):
            idx = meta.req_to_token[slot, :n].long()
            out[i : i + 1] = _attend(
                q[i : i + 1], k_pool[idx], v_pool[idx], group, causal_offset=n - 1
            )
        return out


def _packed_extend(meta: ExtendMeta, device):
    """Per batch (cached on meta, shared by every layer): pool indices of all prefixes, and the mask
    [T, P + T] of which key each query may see."""
    cached = getattr(meta, "_packed", None)
    if cached is not None:
        return cached
    prefix_parts, q_req, q_pos, p_req = [], [], [], []
    for i, (slot, prefix, ext) in enumerate(
        zip(meta.host_slots, meta.host_prefix, meta.host_extend)
    ):
        prefix_parts.append(meta.req_to_token[slot, :prefix].long())
        p_req += [i] * prefix
        q_req += [i] * ext
        q_pos += range(ext)
    prefix_idx = (
        torch.cat(prefix_parts) if prefix_parts else torch.zeros(0, dtype=torch.long, device=device)
    )
    q_req_t = torch.tensor(q_req, device=device)
    q_pos_t = torch.tensor(q_pos, device=device)
    see_prefix = q_req_t[:, None] == torch.tensor(p_req, device=device, dtype=torch.long)[None, :]
    see_new = (q_req_t[:, None] == q_req_t[None, :]) & (q_pos_t[None, :] <= q_pos_t[:, None])
    meta._packed = (prefix_idx, torch.cat([see_prefix, see_new], dim=1))
    return meta._packed


def _attend_masked(q, k, v, group, mask):
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=1.0 / math.sqrt(q.shape[-1]),
    )
    return o.transpose(0, 1)


def _attend(q, k, v, group, causal_offset):
    """q [m, Hq, D] at positions causal_offset.. ; k, v [n, Hkv, D] at positions 0..n-1."""
    m, n = q.shape[0], k.shape[0]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = torch.arange(n, device=q.device)[None, :] <= (
        torch.arange(m, device=q.device)[:, None] + causal_offset
    )
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=1.0 / math.sqrt(q.shape[-1]),
    )
    return o.transpose(0, 1)


def make_backend(name: str, device: torch.device):
    """`auto` picks torch on CPU and the Triton kernels on CUDA."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from triton_kernels.backend import TritonAttention  # lazy: triton's import is heavy

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
