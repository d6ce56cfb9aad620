"""A tiny Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU. Random weights from a seed.

`forward` takes packed tokens of a batch (prefill chunks or decode steps), writes their K/V into the
paged pool at `out_cache_loc`, attends through the backend, and returns logits for the positions
asked for (`logit_rows`).

Two implementations of the same forward:

- `script` (the default with the torch attention backend): each layer's compute — RMSNorm, q/k/v,
  RoPE, the K/V write into the paged pool, attention over each request's cached prefix and new
  tokens, the output projection, the SwiGLU MLP — is one TorchScript function (`_layer_s`), and the
  whole forward one more (`_forward_s`, all layers and the copy of the logits into the caller's
  buffer). TorchScript runs with the GIL released, so on CPU the emulated device computes beside the
  scheduler's Python the way a GPU does. Uncontrolled, the whole forward is one call: the stream
  thread takes the GIL back once per forward (taking it back while the scheduler runs Python can
  cost a switch interval). Under a schedule controller or jitter (engine/sync/__init__.py) the layers
  are called one by one from Python, with a schedule point before each.
- `eager`: the same ops one by one in Python, through the attention backend (always used with the
  Triton backend, and as the fallback: `PDO_FORWARD=eager` or EngineConfig.forward="eager").

Both read `positions` and `out_cache_loc` afresh in every layer (the per-layer paths with a schedule
point, `sync.point("layer")`, before each): a staging write that lands mid-forward (a missing WAR
barrier) corrupts the result, as it would on a GPU.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from engine import sync
from engine.runtime.config import EngineConfig, ModelConfig
from engine.runtime.device_ops import lazy_scripts

FORWARD_IMPLS = ("script", "eager")


def default_forward_impl() -> str:
    """`PDO_FORWARD` (script | eager), else script."""
    impl = os.environ.get("PDO_FORWARD", "").strip().lower() or "script"
    if impl not in FORWARD_IMPLS:
        raise ValueError(f"PDO_FORWARD={impl!r}; choose one of {', '.join(FORWARD_IMPLS)}")
    return impl


_MODELS: dict = {}


def shared_model(cfg: EngineConfig, *, device: str | None = None) -> TinyLlama:
    """The model of cfg (preset, seed, dtype, forward) on `device` (default cfg.device), built
    once per process and shared by every role, run and judge: its weights are only read, and
    drawing the large preset's weights anew for every run would cost more than many runs."""
    impl = default_forward_impl() if cfg.forward == "auto" else cfg.forward
    key = (cfg.model, cfg.seed, cfg.dtype, device or cfg.device, impl)
    if key not in _MODELS:
        _MODELS[key] = TinyLlama(
            cfg.model_config,
            seed=cfg.seed,
            dtype=getattr(torch, cfg.dtype),
            device=torch.device(key[3]),
            forward_impl=impl,
        )
    return _MODELS[key]


class TinyLlama:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        seed: int,
        dtype=torch.float32,
        device="cpu",
        forward_impl: str | None = None,
    ):
        self.cfg = cfg
        self.forward_impl = forward_impl or default_forward_impl()
        if self.forward_impl not in FORWARD_IMPLS:
            raise ValueError(
                f"unknown forward implementation {self.forward_impl!r}; "
                f"choose one of {', '.join(FORWARD_IMPLS)}"
            )
        g = torch.Generator().manual_seed(seed)

        def w(*shape, scale=None):
            scale = scale if scale is not None else shape[-1] ** -0.5
            return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

        d, hq, hk, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.embed = w(cfg.vocab_size, d, scale=1.0)
        self.layers = [
            dict(
                attn_norm=torch.ones(d, dtype=dtype, device=device),
                wq=w(hq * hd, d),
                wk=w(hk * hd, d),
                wv=w(hk * hd, d),
                wo=w(d, hq * hd),
                mlp_norm=torch.ones(d, dtype=dtype, device=device),
                w_gate=w(cfg.intermediate, d),
                w_up=w(cfg.intermediate, d),
                w_down=w(d, cfg.intermediate),
            )
            for _ in range(cfg.layers)
        ]
        self.final_norm = torch.ones(d, dtype=dtype, device=device)
        self.lm_head = w(cfg.vocab_size, d)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.arange(cfg.max_context, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos = ang.cos().to(dtype=dtype, device=device)
        self.sin = ang.sin().to(dtype=dtype, device=device)
        # the weights in the order the scripted layer takes them
        self._layer_args = [
            (
                L["attn_norm"],
                L["wq"],
                L["wk"],
                L["wv"],
                L["wo"],
                L["mlp_norm"],
                L["w_gate"],
                L["w_up"],
                L["w_down"],
            )
            for L in self.layers
        ]
        self._weights = [
            w for args in self._layer_args for w in args
        ]  # the same, flat (whole-forward call)

    def impl_for(self, backend) -> str:
        """The implementation a forward through `backend` uses: the scripted one needs the torch backend."""
        return (
            "script"
            if self.forward_impl == "script" and getattr(backend, "name", "") == "torch"
            else "eager"
        )

    def _rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * w

    def _rope(self, x, positions):
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    def forward(
        self,
        input_ids,
        positions,
        out_cache_loc,
        pool,
        backend,
        meta,
        logit_rows,
        *,
        decode=False,
        impl: str | None = None,
        out=None,
    ):
        """Reads `positions` and `out_cache_loc` in every layer: a staging write that lands while this
        runs (a missing WAR barrier) corrupts the result, as it would on a GPU. With `out`, the logits
        are also copied into it (the caller's persistent logits buffer)."""
        if (impl or self.impl_for(backend)) == "script" and getattr(backend, "name", "") == "torch":
            return self._forward_script(
                input_ids, positions, out_cache_loc, pool, meta, logit_rows, decode, out
            )
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
        logits = (x @ self.lm_head.T).float()
        if out is not None:
            out.copy_(logits)
        return logits

    def _forward_script(
        self, input_ids, positions, out_cache_loc, pool, meta, logit_rows, decode, out=None
    ):
        cfg = self.cfg
        fns = _scripted()
        if decode:  # one query per request, attending to its whole sequence in the pool
            lens, ext = meta.host_seq_lens, [1] * len(meta.host_slots)
        else:  # each request's cached prefix from the pool, then its new tokens
            lens, ext = meta.host_prefix, meta.host_extend
        if not sync.points_active():
            # Nothing can act between two layers (no controller, no jitter): the whole forward in one
            # call, so the stream thread takes the GIL back once per forward instead of once per layer.
            # (Taking it back costs up to a switch interval while the scheduler runs Python.) Each layer
            # still reads positions and out_cache_loc afresh.
            return fns["forward"](
                input_ids,
                self.embed,
                positions,
                out_cache_loc,
                self.cos,
                self.sin,
                self._weights,
                pool.k,
                pool.v,
                meta.req_to_token,
                meta.host_slots,
                lens,
                ext,
                cfg.heads,
                cfg.kv_heads,
                cfg.head_dim,
                cfg.norm_eps,
                decode,
                logit_rows,
                self.final_norm,
                self.lm_head,
                out,
            )
        layout = fns["layout"](meta.req_to_token, meta.host_slots, lens, ext, decode)
        x = None  # the first layer starts with the embedding lookup (one call less to come back from)
        last = len(self.layers) - 1
        layer = fns["layer"]
        for li, args in enumerate(self._layer_args):
            sync.point("layer")  # a place where another stream's work may interleave
            x = layer(
                x,
                input_ids,
                self.embed,
                positions,
                out_cache_loc,
                self.cos,
                self.sin,
                *args,
                pool.k[li],
                pool.v[li],
                *layout,
                cfg.heads,
                cfg.kv_heads,
                cfg.head_dim,
                cfg.norm_eps,
                logit_rows if li == last else None,
                self.final_norm,
                self.lm_head,
            )
        if out is not None:
            out.copy_(x)
        return x


# ---- the scripted forward -------------------------------------------------------------------------
# Plain functions, compiled by torch.jit.script on first use (_scripted): the eager path's ops in the
# same order, except attention: the batch's requests padded side by side and one fused SDPA call per
# layer, keys read back from the pool (_layout_s, _attend_s). On this CPU that is 1.3-2.4x faster than
# a loop over the requests (a dozen small ops each) at 3-16 requests, though it computes the padding.


def _rms_s(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_s(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[:, :, 0::2], x[:, :, 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def _layout_s(
    req_to_token: torch.Tensor, slots: list[int], lens: list[int], extend: list[int], decode: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's requests side by side, padded, for one attention call per layer (computed once per
    forward): rows [B, L] (each request's pool indices: extend — its `lens[i]` cached tokens then its
    `extend[i]` new ones; decode — its whole sequence of `lens[i]` tokens, the new one last), qi
    [B, E] (the packed query row of each padded query; T, past the end, for padding), keep (the
    padded rows that are real queries, in packed order), allow [B, 1, E, L] (key visible: causal
    within the request, nothing past its end)."""
    dev = req_to_token.device
    b = len(extend)
    e_max = max(extend)
    n_max = max(lens) if decode else max([p + e for p, e in zip(lens, extend)])
    ext = torch.tensor(extend, dtype=torch.long, device=dev)
    pre = torch.tensor(lens, dtype=torch.long, device=dev)
    rows = req_to_token[torch.tensor(slots, dtype=torch.long, device=dev), :n_max].long()
    j = torch.arange(n_max, device=dev)
    # padding keys point at token 0 (page 0 is never handed out): masked, but SDPA would turn a
    # non-finite value left in another request's page into NaN even so
    rows = torch.where(j[None, :] < (pre if decode else pre + ext)[:, None], rows, 0)
    r = torch.arange(e_max, device=dev)
    valid = r[None, :] < ext[:, None]
    start = torch.cumsum(ext, 0) - ext
    qi = torch.where(
        valid,
        start[:, None] + r[None, :],
        torch.full([b, e_max], int(ext.sum()), dtype=torch.long, device=dev),
    )
    keep = valid.flatten().nonzero().flatten()
    if decode:
        allow = (j[None, None, :] < pre[:, None, None]).expand(b, e_max, n_max)
    else:  # query r of request i sees keys 0 .. p_i + r (a padded query row repeats the last real one)
        allow = (
            j[None, None, :]
            <= (pre[:, None] + torch.minimum(r[None, :], ext[:, None] - 1))[:, :, None]
        )
    return rows, qi, keep, allow[:, None]


def _attend_s(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rows: torch.Tensor,
    qi: torch.Tensor,
    keep: torch.Tensor,
    allow: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of the packed queries q [T, Hq, D] over each request's keys, read back from the pool
    (the batch's own K/V already written there): the requests padded side by side (_layout_s), one
    SDPA call (a fused kernel on CPU, grouped-query heads shared), then unpadded."""
    t, hq, d = q.shape
    kk = k_pool[rows].transpose(1, 2)  # [B, Hkv, L, D]
    vv = v_pool[rows].transpose(1, 2)
    qp = torch.cat([q, q.new_zeros(1, hq, d)])[qi].transpose(1, 2)  # [B, Hq, E, D]
    o = F.scaled_dot_product_attention(qp, kk, vv, attn_mask=allow, scale=scale, enable_gqa=True)
    b, e = qi.shape
    return o.transpose(1, 2).reshape(b * e, hq, d)[keep]


def _layer_s(
    x_in: torch.Tensor | None,
    input_ids: torch.Tensor,
    embed: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    cos_t: torch.Tensor,
    sin_t: torch.Tensor,
    attn_norm: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    wo: torch.Tensor,
    mlp_norm: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rows: torch.Tensor,
    qi: torch.Tensor,
    keep: torch.Tensor,
    allow: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    logit_rows: torch.Tensor | None,
    final_norm: torch.Tensor,
    lm_head: torch.Tensor,
) -> torch.Tensor:
    """One decoder layer: of the embeddings of `input_ids` (the first layer, `x_in` None) or of
    `x_in`; with `logit_rows`, also the final norm and the LM head (the last layer)."""
    x = embed[input_ids.long()] if x_in is None else x_in
    t = x.shape[0]
    h = _rms_s(x, attn_norm, eps)
    q = (h @ wq.T).view(t, heads, head_dim)
    k = (h @ wk.T).view(t, kv_heads, head_dim)
    v = (h @ wv.T).view(t, kv_heads, head_dim)
    pos = positions.long()  # read in every layer (see forward)
    cos, sin = cos_t[pos][:, None, :], sin_t[pos][:, None, :]
    q, k = _rope_s(q, cos, sin), _rope_s(k, cos, sin)
    loc = out_cache_loc.long()  # likewise
    k_pool[loc] = k
    v_pool[loc] = v
    o = _attend_s(q, k_pool, v_pool, rows, qi, keep, allow, 1.0 / math.sqrt(head_dim))
    x = x + o.reshape(t, -1) @ wo.T
    h = _rms_s(x, mlp_norm, eps)
    x = x + (F.silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T
    if logit_rows is not None:
        x = _rms_s(x[logit_rows.long()], final_norm, eps)
        x = (x @ lm_head.T).float()
    return x


def _forward_s(
    input_ids: torch.Tensor,
    embed: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    cos_t: torch.Tensor,
    sin_t: torch.Tensor,
    weights: list[torch.Tensor],
    k_pools: torch.Tensor,
    v_pools: torch.Tensor,
    req_to_token: torch.Tensor,
    slots: list[int],
    lens: list[int],
    extend: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    decode: bool,
    logit_rows: torch.Tensor,
    final_norm: torch.Tensor,
    lm_head: torch.Tensor,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Every layer (`weights`: each layer's nine tensors in _layer_s's order), then the logits, copied
    into `out` when given: one call, so the GIL is released for the whole forward. `k_pools`/`v_pools`
    are the pool's [layers, tokens, Hkv, D] tensors."""
    n = len(weights) // 9
    rows, qi, keep, allow = _layout_s(req_to_token, slots, lens, extend, decode)
    x: torch.Tensor | None = None
    for li in range(n):
        w = weights[9 * li : 9 * li + 9]
        x = _layer_s(
            x,
            input_ids,
            embed,
            positions,
            out_cache_loc,
            cos_t,
            sin_t,
            w[0],
            w[1],
            w[2],
            w[3],
            w[4],
            w[5],
            w[6],
            w[7],
            w[8],
            k_pools[li],
            v_pools[li],
            rows,
            qi,
            keep,
            allow,
            heads,
            kv_heads,
            head_dim,
            eps,
            logit_rows if li == n - 1 else None,
            final_norm,
            lm_head,
        )
    assert x is not None
    if out is not None:
        out.copy_(x)
    return x


_scripted = lazy_scripts({"layer": _layer_s, "forward": _forward_s, "layout": _layout_s})
