"""A tiny Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU. Random weights from a seed.

`forward` takes packed tokens of a batch (prefill chunks or decode steps), writes their K/V into the
paged pool at `out_cache_loc`, attends through the backend, and returns logits for the positions
asked for (`logit_rows`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import sync
from .config import ModelConfig


class TinyLlama:
    def __init__(self, cfg: ModelConfig, *, seed: int, dtype=torch.float32, device="cpu"):
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)

        def w(*shape, scale=None):
            scale = scale if scale is not None else shape[-1] ** -0.5
            return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

        d, hq, hk, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.embed = w(cfg.vocab_size, d, scale=1.0)
        self.layers = [dict(
            attn_norm=torch.ones(d, dtype=dtype, device=device),
            wq=w(hq * hd, d), wk=w(hk * hd, d), wv=w(hk * hd, d), wo=w(d, hq * hd),
            mlp_norm=torch.ones(d, dtype=dtype, device=device),
            w_gate=w(cfg.intermediate, d), w_up=w(cfg.intermediate, d), w_down=w(d, cfg.intermediate),
        ) for _ in range(cfg.layers)]
        self.final_norm = torch.ones(d, dtype=dtype, device=device)
        self.lm_head = w(cfg.vocab_size, d)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.arange(cfg.max_context, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos = ang.cos().to(dtype=dtype, device=device)
        self.sin = ang.sin().to(dtype=dtype, device=device)

    def _rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * w

    def _rope(self, x, positions):
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    def forward(self, input_ids, positions, out_cache_loc, pool, backend, meta, logit_rows, *, decode=False):
        """Reads `positions` and `out_cache_loc` in every layer: a staging write that lands while this
        runs (a missing WAR barrier) corrupts the result, as it would on a GPU."""
        cfg = self.cfg
        x = self.embed[input_ids.long()]
        t = x.shape[0]
        for li, L in enumerate(self.layers):
            sync.point("layer")  # a place where another stream's work may interleave
            h = self._rms(x, L["attn_norm"])
            q = (h @ L["wq"].T).view(t, cfg.heads, cfg.head_dim)
            k = (h @ L["wk"].T).view(t, cfg.kv_heads, cfg.head_dim)
            v = (h @ L["wv"].T).view(t, cfg.kv_heads, cfg.head_dim)
            pos = positions.long()
            q, k = self._rope(q, pos), self._rope(k, pos)
            backend.write_kv(pool.k[li], pool.v[li], out_cache_loc, k, v)
            if decode:
                o = backend.decode(q, pool.k[li], pool.v[li], meta)
            else:
                o = backend.extend(q, k, v, pool.k[li], pool.v[li], meta)
            x = x + o.reshape(t, -1) @ L["wo"].T
            h = self._rms(x, L["mlp_norm"])
            x = x + (F.silu(h @ L["w_gate"].T) * (h @ L["w_up"].T)) @ L["w_down"].T
        x = self._rms(x[logit_rows.long()], self.final_norm)
        return (x @ self.lm_head.T).float()
