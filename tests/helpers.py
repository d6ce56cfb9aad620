"""Shared helpers for the engine tests: run a mode, compute the unchunked, uncached reference."""
from __future__ import annotations

import torch

from engine.attention import ExtendMeta, TorchAttention
from engine.config import EngineConfig
from engine.memory import KVPool, ReqToTokenPool
from engine.model import TinyLlama
from engine.run import run_prefill
from engine.workload import WorkloadConfig


def run_mode(mode: str, *, trace_path=None, inject=(), workload=None, **cfg_kw):
    # A small token budget makes admission FIFO-paced (about one request per batch), so the first
    # request of each prefix group is released before its followers are admitted: cache hits
    # do not depend on timing.
    cfg_kw.setdefault("max_batch_tokens", 128)
    cfg = EngineConfig(mode=mode, inject=frozenset(inject), **cfg_kw)
    wc = workload or WorkloadConfig(requests=12, prompt_len=(20, 150), hit=0.6, seed=3)
    return run_prefill(cfg, wc, trace_path=trace_path, keep_scheduler=True), cfg


def reference(cfg: EngineConfig, prompt: list[int], logit_bias=None):
    """Whole prompt in one forward, no chunking, no prefix cache: (first token, K, V) with K, V
    shaped [layers, tokens, kv_heads, head_dim]."""
    mc = cfg.model_config
    model = TinyLlama(mc, seed=cfg.seed, dtype=getattr(torch, cfg.dtype))
    n = len(prompt)
    ps = cfg.page_size
    pool = KVPool(-(-n // ps) + 1, ps, mc.layers, mc.kv_heads, mc.head_dim, model.embed.dtype, "cpu")
    slots = ReqToTokenPool(1, mc.max_context, "cpu")
    loc = torch.arange(ps, ps + n, dtype=torch.int32)
    slots.table[0, :n] = loc
    meta = ExtendMeta(slots.table, torch.tensor([0]), torch.tensor([0]), torch.tensor([n]), torch.tensor([0]), n, loc,
                      host_slots=[0], host_prefix=[0], host_extend=[n])
    logits = model.forward(torch.tensor(prompt, dtype=torch.int32), torch.arange(n, dtype=torch.int32), loc, pool,
                           TorchAttention(), meta, torch.tensor([n - 1]))
    bias = torch.zeros(mc.vocab_size)
    for tok, b in (logit_bias or {}).items():
        bias[tok] = b
    first = int(torch.argmax(logits[0] + bias))
    return first, pool.k[:, loc.long()], pool.v[:, loc.long()]
