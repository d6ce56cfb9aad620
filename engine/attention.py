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
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        start = 0
        for slot, prefix, ext in zip(meta.host_slots, meta.host_prefix, meta.host_extend):
            idx = meta.req_to_token[slot, :prefix].long()
            kk = torch.cat([k_pool[idx], k[start:start + ext]])
            vv = torch.cat([v_pool[idx], v[start:start + ext]])
            out[start:start + ext] = _attend(q[start:start + ext], kk, vv, group, causal_offset=prefix)
            start += ext
        return out

    def decode(self, q, k_pool, v_pool, meta: DecodeMeta) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k_pool.shape[1]
        for i, (slot, n) in enumerate(zip(meta.host_slots, meta.host_seq_lens)):
            idx = meta.req_to_token[slot, :n].long()
            out[i:i + 1] = _attend(q[i:i + 1], k_pool[idx], v_pool[idx], group, causal_offset=n - 1)
        return out


def _attend(q, k, v, group, causal_offset):
    """q [m, Hq, D] at positions causal_offset.. ; k, v [n, Hkv, D] at positions 0..n-1."""
    m, n = q.shape[0], k.shape[0]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = torch.arange(n, device=q.device)[None, :] <= (torch.arange(m, device=q.device)[:, None] + causal_offset)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]))
    return o.transpose(0, 1)


def make_backend(name: str, device: torch.device):
    """`auto` picks torch on CPU and the Triton kernels on CUDA."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from triton_kernels.backend import TritonAttention
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
