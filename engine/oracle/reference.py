"""Single-process, non-disaggregated greedy generation: the ground truth for `pdo run --pd` and
`pdo launch`.

One request at a time, no batching, no chunking, no prefix cache, no overlap: the whole prompt in
one extend forward, then one decode step per further token. Greedy means argmax of the logits plus
the request's logit bias, the rule both prefill and decode sample with. The model runs its eager
forward (op by op), the engines their default (scripted, engine/runtime/model.py).
"""

from __future__ import annotations

import contextlib

import torch

from engine import sync
from engine.runtime.attention import DecodeMeta, ExtendMeta, TorchAttention
from engine.runtime.config import EngineConfig
from engine.runtime.memory import KVPool
from engine.runtime.model import TinyLlama, shared_model


def reference_generate(
    cfg: EngineConfig, requests, *, model: TinyLlama | None = None
) -> dict[str, list[int]]:
    """{rid: the max_new_tokens greedy tokens} for requests with .rid, .prompt, .max_new_tokens, .logit_bias."""
    mc = cfg.model_config
    dtype = getattr(torch, cfg.dtype)
    dev = torch.device(cfg.device)
    model = model or shared_model(cfg)
    backend = TorchAttention()
    out = {}
    # off the schedule: the reference is the judge, not a part of the run a fuzz schedule steps
    with torch.inference_mode(), intra_op_threads(1), sync.off_schedule():
        for r in requests:
            out[r.rid] = _generate(model, backend, mc, r, dtype, dev)
    return out


@contextlib.contextmanager
def intra_op_threads(n: int):
    """Tiny ops gain nothing from intra-op parallelism; with several roles on threads of one process
    it only oversubscribes the cores. Restored on exit (a process-wide knob)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _generate(model, backend, mc, r, dtype, dev) -> list[int]:
    n = len(r.prompt) + r.max_new_tokens
    pool = KVPool(2, n, mc.layers, mc.kv_heads, mc.head_dim, dtype, dev)  # page 1 holds everything
    table = torch.arange(n, 2 * n, dtype=torch.int32, device=dev)[None, :]
    bias = torch.zeros(mc.vocab_size, dtype=torch.float32, device=dev)
    for tok, b in (r.logit_bias or {}).items():
        bias[tok] = b
    L = len(r.prompt)
    slot = torch.zeros(1, dtype=torch.int32, device=dev)
    meta = ExtendMeta(
        req_to_token=table,
        req_slots=slot,
        prefix_lens=torch.zeros(1, dtype=torch.int32, device=dev),
        extend_lens=torch.tensor([L], dtype=torch.int32, device=dev),
        extend_start_loc=slot,
        max_extend_len=L,
        out_cache_loc=table[0, :L],
        host_slots=[0],
        host_prefix=[0],
        host_extend=[L],
    )
    logits = model.forward(
        torch.tensor(r.prompt, dtype=torch.int32, device=dev),
        torch.arange(L, dtype=torch.int32, device=dev),
        table[0, :L],
        pool,
        backend,
        meta,
        torch.tensor([L - 1], device=dev),
        impl="eager",
    )
    tokens = [int(torch.argmax(logits[0] + bias))]
    for pos in range(L, L + r.max_new_tokens - 1):
        loc = table[0, pos : pos + 1]
        meta = DecodeMeta(
            req_to_token=table,
            req_slots=slot,
            seq_lens=torch.tensor([pos + 1], device=dev),
            out_cache_loc=loc,
            host_slots=[0],
            host_seq_lens=[pos + 1],
        )
        logits = model.forward(
            torch.tensor([tokens[-1]], dtype=torch.int64, device=dev),
            torch.tensor([pos], dtype=torch.int32, device=dev),
            loc,
            pool,
            backend,
            meta,
            torch.zeros(1, dtype=torch.int64, device=dev),
            decode=True,
            impl="eager",
        )
        tokens.append(int(torch.argmax(logits[0] + bias)))
    return tokens
