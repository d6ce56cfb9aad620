"""A tiny Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU. Random weights from a seed.

`forward` takes packed tokens of a batch (prefill chunks or decode steps), writes their K/V into the
paged pool at `out_cache_loc`, attends through the backend, and returns logits for the positions
asked for (`logit_rows`).

Two implementations of the same forward:

- `script` (the default with the torch attention backend): each layer's compute — RMSNorm, q/k/v,
  RoPE, the K/V write into the paged pool, the masked packed attention over prefix + new keys, the
  output projection, the SwiGLU MLP — is one TorchScript function (engine/scripted.py), called once
  per layer from Python. TorchScript runs with the GIL released, so on CPU the emulated device
  computes beside the scheduler's Python the way a GPU does, instead of taking the GIL between its
  ~40 small ops per layer.
- `eager`: the same ops one by one in Python, through the attention backend (always used with the
  Triton backend, and as the fallback: `PDO_FORWARD=eager` or EngineConfig.forward="eager").

Both read `positions` and `out_cache_loc` afresh in every layer, with a schedule point
(`sync.point("layer")`) before each: a staging write that lands mid-forward (a missing WAR barrier)
corrupts the result, as it would on a GPU.
"""
from __future__ import annotations

import math
import os
import threading
import warnings
from typing import List, Optional

import torch
import torch.nn.functional as F

from . import sync
from .config import ModelConfig

FORWARD_IMPLS = ("script", "eager")


def default_forward_impl() -> str:
    """`PDO_FORWARD` (script | eager), else script."""
    impl = os.environ.get("PDO_FORWARD", "").strip().lower() or "script"
    if impl not in FORWARD_IMPLS:
        raise ValueError(f"PDO_FORWARD={impl!r}; choose one of {', '.join(FORWARD_IMPLS)}")
    return impl


class TinyLlama:
    def __init__(self, cfg: ModelConfig, *, seed: int, dtype=torch.float32, device="cpu",
                 forward_impl: str | None = None):
        self.cfg = cfg
        self.forward_impl = forward_impl or default_forward_impl()
        if self.forward_impl not in FORWARD_IMPLS:
            raise ValueError(f"unknown forward implementation {self.forward_impl!r}; "
                             f"choose one of {', '.join(FORWARD_IMPLS)}")
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
        # the weights in the order the scripted layer takes them
        self._layer_args = [(L["attn_norm"], L["wq"], L["wk"], L["wv"], L["wo"], L["mlp_norm"], L["w_gate"],
                             L["w_up"], L["w_down"]) for L in self.layers]

    def impl_for(self, backend) -> str:
        """The implementation a forward through `backend` uses: the scripted one needs the torch backend."""
        return "script" if self.forward_impl == "script" and getattr(backend, "name", "") == "torch" else "eager"

    def _rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * w

    def _rope(self, x, positions):
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    def forward(self, input_ids, positions, out_cache_loc, pool, backend, meta, logit_rows, *, decode=False,
                impl: str | None = None):
        """Reads `positions` and `out_cache_loc` in every layer: a staging write that lands while this
        runs (a missing WAR barrier) corrupts the result, as it would on a GPU."""
        if (impl or self.impl_for(backend)) == "script" and getattr(backend, "name", "") == "torch":
            return self._forward_script(input_ids, positions, out_cache_loc, pool, meta, logit_rows, decode)
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

    def _forward_script(self, input_ids, positions, out_cache_loc, pool, meta, logit_rows, decode):
        cfg = self.cfg
        fns = _scripted()
        if decode:   # one query per request, attending to its whole sequence in the pool
            lens, ext = meta.host_seq_lens, [1] * len(meta.host_slots)
        else:        # each request's cached prefix from the pool, then its new tokens
            lens, ext = meta.host_prefix, meta.host_extend
        x = None   # the first layer starts with the embedding lookup (one call less to come back from)
        last = len(self.layers) - 1
        layer = fns["layer"]
        for li, args in enumerate(self._layer_args):
            sync.point("layer")  # a place where another stream's work may interleave
            x = layer(x, input_ids, self.embed, positions, out_cache_loc, self.cos, self.sin, *args, pool.k[li], pool.v[li],
                      meta.req_to_token, meta.host_slots, lens, ext, cfg.heads, cfg.kv_heads, cfg.head_dim,
                      cfg.norm_eps, decode, logit_rows if li == last else None, self.final_norm, self.lm_head)
        return x


# ---- the scripted forward -------------------------------------------------------------------------
# Plain functions, compiled by torch.jit.script on first use (_scripted): the eager path's ops in the
# same order, except attention, which loops over the batch's requests inside the script (what the
# Triton kernels do) instead of one SDPA over the packed batch with a block-diagonal mask: the packed
# form exists to save Python ops per layer, which cost nothing here, and it computes every query
# against every request's keys (at hit 0.8, ~10x the scores, 5x the time of the loop).

def _rms_s(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_s(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[:, :, 0::2], x[:, :, 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def _attend_s(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
              req_to_token: torch.Tensor, slots: List[int], lens: List[int], extend: List[int],
              scale: float, decode: bool) -> torch.Tensor:
    """Per request i: extend — keys are its `lens[i]` cached tokens (from the pool, through
    req_to_token) then its `extend[i]` new ones, causal; decode — its query sees its whole sequence
    of `lens[i]` tokens, read back from the pool (the new token's K/V included). Grouped-query
    attention as one bmm per request: the `group` query heads of a KV head are stacked as rows."""
    t, hq, d = q.shape
    hk = k.shape[1]
    group = hq // hk
    dev = q.device
    p_max, e_max = max(lens), max(extend)
    # every request's pool indices in one gather (row i, first lens[i] entries used)
    rows = req_to_token[torch.tensor(slots, dtype=torch.long, device=dev), :p_max].long()
    # one causal mask for all: request i's mask [e, p + e] is the window at column p_max - p
    # (key j hidden from query r iff j > r + p)
    tri = torch.arange(p_max + e_max, device=dev)[None, :] > (torch.arange(e_max, device=dev)[:, None] + p_max)
    outs: List[torch.Tensor] = []
    qs = 0
    for i in range(len(slots)):
        p, e = lens[i], extend[i]
        idx = rows[i, :p]
        if decode:
            kk, vv = k_pool[idx], v_pool[idx]
        else:
            kk, vv = torch.cat([k_pool[idx], k[qs:qs + e]]), torch.cat([v_pool[idx], v[qs:qs + e]])
        n = kk.shape[0]
        qg = q[qs:qs + e].view(e, hk, group, d).permute(1, 2, 0, 3).reshape(hk, group * e, d)
        s = torch.bmm(qg, kk.permute(1, 2, 0)) * scale                      # [hk, group * e, n]
        if not decode and e > 1:
            s = s.view(hk, group, e, n).masked_fill(tri[:e, p_max - p:p_max + e], float("-inf")).view(hk, group * e, n)
        o = torch.bmm(torch.softmax(s, dim=-1), vv.permute(1, 0, 2))         # [hk, group * e, d]
        outs.append(o.view(hk, group, e, d).permute(2, 0, 1, 3).reshape(e, hq, d))
        qs += e
    return torch.cat(outs)


def _layer_s(x_in: Optional[torch.Tensor], input_ids: torch.Tensor, embed: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor, cos_t: torch.Tensor,
             sin_t: torch.Tensor, attn_norm: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
             wo: torch.Tensor, mlp_norm: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
             w_down: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, req_to_token: torch.Tensor,
             slots: List[int], lens: List[int], extend: List[int], heads: int, kv_heads: int, head_dim: int,
             eps: float, decode: bool, logit_rows: Optional[torch.Tensor], final_norm: torch.Tensor,
             lm_head: torch.Tensor) -> torch.Tensor:
    """One decoder layer: of the embeddings of `input_ids` (the first layer, `x_in` None) or of
    `x_in`; with `logit_rows`, also the final norm and the LM head (the last layer)."""
    x = embed[input_ids.long()] if x_in is None else x_in
    t = x.shape[0]
    h = _rms_s(x, attn_norm, eps)
    q = (h @ wq.T).view(t, heads, head_dim)
    k = (h @ wk.T).view(t, kv_heads, head_dim)
    v = (h @ wv.T).view(t, kv_heads, head_dim)
    pos = positions.long()                 # read in every layer (see forward)
    cos, sin = cos_t[pos][:, None, :], sin_t[pos][:, None, :]
    q, k = _rope_s(q, cos, sin), _rope_s(k, cos, sin)
    loc = out_cache_loc.long()             # likewise
    k_pool[loc] = k
    v_pool[loc] = v
    o = _attend_s(q, k, v, k_pool, v_pool, req_to_token, slots, lens, extend, 1.0 / math.sqrt(head_dim), decode)
    x = x + o.reshape(t, -1) @ wo.T
    h = _rms_s(x, mlp_norm, eps)
    x = x + (F.silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T
    if logit_rows is not None:
        x = _rms_s(x[logit_rows.long()], final_norm, eps)
        x = (x @ lm_head.T).float()
    return x


_SCRIPTED: dict | None = None
_SCRIPT_LOCK = threading.Lock()


def _scripted() -> dict:
    """The TorchScript functions, compiled once per process (torch.jit.script is deprecated in torch
    2.x in favour of torch.compile, which does not release the GIL around a call: the warning is
    silenced here, once)."""
    global _SCRIPTED
    if _SCRIPTED is None:
        with _SCRIPT_LOCK:
            if _SCRIPTED is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    warnings.simplefilter("ignore", FutureWarning)
                    _SCRIPTED = {"layer": torch.jit.script(_layer_s)}
    return _SCRIPTED
