"""The reference the engine is judged against: the whole prompt in one forward, no chunking, no
prefix cache, contiguous KV, the model's eager forward (op by op; the engine's default is the scripted
one, so the comparison also checks one against the other). Returns (first token, K, V), K and V as
[layers, tokens, kv_heads, head_dim]."""

from __future__ import annotations

import torch

from engine import sync
from engine.runtime.attention import ExtendMeta, TorchAttention
from engine.runtime.config import EngineConfig
from engine.runtime.memory import KVPool, ReqToTokenPool
from engine.runtime.model import shared_model


def reference_prefill(cfg: EngineConfig, prompt: list[int], logit_bias=None):
    mc = cfg.model_config
    model = shared_model(cfg, device="cpu")
    n, ps = len(prompt), cfg.page_size
    pool = KVPool(
        -(-n // ps) + 1, ps, mc.layers, mc.kv_heads, mc.head_dim, model.embed.dtype, "cpu"
    )
    slots = ReqToTokenPool(1, mc.max_context, "cpu")
    loc = torch.arange(ps, ps + n, dtype=torch.int32)
    slots.table[0, :n] = loc
    meta = ExtendMeta(
        slots.table,
        torch.tensor([0]),
        torch.tensor([0]),
        torch.tensor([n]),
        torch.tensor([0]),
        n,
        loc,
        host_slots=[0],
        host_prefix=[0],
        host_extend=[n],
    )
    with sync.off_schedule():  # the judge is not a part of the run a fuzz schedule steps
        logits = model.forward(
            torch.tensor(prompt, dtype=torch.int32),
            torch.arange(n, dtype=torch.int32),
            loc,
            pool,
            TorchAttention(),
            meta,
            torch.tensor([n - 1]),
            impl="eager",
        )
    bias = torch.zeros(mc.vocab_size)
    for tok, b in (logit_bias or {}).items():
        bias[tok] = b
    return int(torch.argmax(logits[0] + bias)), pool.k[:, loc.long()], pool.v[:, loc.long()]
