"""The content oracle of a prefill run: every output the engine keeps or hands on, judged against the
reference forward of its tokens (engine/oracle/reference_prefill.py: the whole prompt in one forward, no
chunking, no prefix cache).

What is judged, per request:
- the first token, and the KV its receiver assembled (every chunk the sender delivered);
- its AttentionStore entry (the host copy of the prompt's KV, engine/kv/transfer.py);
- every prefix-cache page it matched at admission, as the pool held it at the match
  (engine/prefill/admission.py `_prepare`): the KV a later request reuses instead of computing.

The last two are captured while the run goes by an `OutputProbe`, which the scheduler calls only
when one is installed (`PrefillScheduler.probe`, `AttentionStore.on_entry`): a run without
verification pays nothing. Tolerance: the fuzz harness's (`allclose`, atol 1e-3) in float32, wider
in 16-bit dtypes, where the engine's fused and chunked sums round differently from the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.oracle.reference import intra_op_threads
from engine.oracle.reference_prefill import reference_prefill
from engine.runtime import device_ops

_REF_CACHE: dict = {}
_ATOL = {"float32": 1e-3, "float64": 1e-3}
_ATOL_16BIT = 5e-2


@dataclass(frozen=True)
class Mismatch:
    rid: str
    what: str  # "first token", "received KV", "AttentionStore entry", "prefix page"
    where: str = ""

    def __str__(self) -> str:
        return f"{self.rid} {self.what}" + (f": {self.where}" if self.where else "")


@dataclass
class Verdict:
    requests: int = 0
    store_entries: int = 0
    cached_pages: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def line(self) -> str:
        if self.ok:
            return (
                f"outputs vs reference: identical ({self.requests} requests, "
                f"{self.store_entries} store entries, {self.cached_pages} cached pages checked)"
            )
        more = len(self.mismatches) - 1
        return f"outputs vs reference: MISMATCH {self.mismatches[0]}" + (
            f" (and {more} more)" if more else ""
        )

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "store_entries": self.store_entries,
            "cached_pages": self.cached_pages,
            "mismatches": [str(m) for m in self.mismatches],
            "line": self.line(),
        }


class OutputProbe:
    """What the oracle needs from inside a run: each prefix match's pages and their KV at the
    moment of the match, and each AttentionStore entry's KV as it was written."""

    def __init__(self):
        self.prefix_reads: list[tuple[str, list[int], torch.Tensor, torch.Tensor]] = []
        self.store_kv: dict[str, torch.Tensor] = {}

    def prefix_matched(self, pool, req, pages: list[int], idx) -> None:
        """Called by admission at the match, before anything else can write the pages, with their
        pool token indices: their K and V copied in one call (engine/runtime/device_ops.py: each torch call
        from the scheduler thread can wait for the GIL)."""
        k, v = device_ops.ops()["gather_kv"](pool.k, pool.v, idx.to(pool.k.device))
        self.prefix_reads.append((req.rid, list(pages), k, v))

    def store_entry(self, rid: str, kv) -> None:
        """Called by AttentionStore.retire with the entry's [2, layers, tokens, Hkv, D] copy."""
        self.store_kv[rid] = kv


def reference(cfg, prompt, logit_bias=None):
    """(first token, K, V) of the reference forward, cached per model and prompt (a fuzz campaign
    runs the same prompts many times)."""
    key = (cfg.model, cfg.seed, cfg.dtype, tuple(prompt), tuple(sorted((logit_bias or {}).items())))
    if key not in _REF_CACHE:
        _REF_CACHE[key] = reference_prefill(cfg, list(prompt), logit_bias)
    return _REF_CACHE[key]


def _atol(cfg) -> float:
    return _ATOL.get(cfg.dtype, _ATOL_16BIT)


def kv_difference(k, v, k_ref, v_ref, atol: float) -> tuple[str, int] | None:
    """None if K and V ([layers, tokens, ...]) match the reference within atol, else where they
    first differ (tensor, layer, prompt position) and that position (0 for a shape mismatch)."""
    if tuple(k.shape) != tuple(k_ref.shape) or tuple(v.shape) != tuple(v_ref.shape):
        return f"shape {tuple(k.shape)} != reference {tuple(k_ref.shape)}", 0
    for name, got, ref in (("K", k, k_ref), ("V", v, v_ref)):
        got = got.detach().to("cpu", torch.float32)
        ref = ref.to(torch.float32)
        bad = ~torch.isclose(got, ref, atol=atol)
        if bad.any():
            layer, pos = (int(x) for x in bad.nonzero()[0][:2])
            err = float((got - ref).abs().max())
            return f"{name} layer {layer} position {pos} (max error {err:.3g})", pos
    return None


def first_token_and_received_kv(cfg, reqs, receiver) -> list[Mismatch]:
    """Each request's first token, and the KV its receiver assembled, against the reference."""
    out = []
    for req in reqs:
        first, k_ref, v_ref = reference(cfg, req.prompt, req.logit_bias)
        if req.output_token != first:
            out.append(Mismatch(req.rid, "first token", f"{req.output_token} != reference {first}"))
            continue
        room = receiver.rooms.get(req.bootstrap_room)
        if room is None or room["meta"] is None:
            out.append(Mismatch(req.rid, "received KV", "never fully received"))
            continue
        k, v = receiver.kv(req.bootstrap_room)
        diff = kv_difference(k, v, k_ref, v_ref, _atol(cfg))
        if diff:
            out.append(Mismatch(req.rid, "received KV", diff[0]))
    return out


def store_entries(cfg, reqs, probe: OutputProbe) -> list[Mismatch]:
    """Every finished request's AttentionStore entry against the reference KV of its prompt."""
    out = []
    for req in reqs:
        if not req.finished:
            continue
        kv = probe.store_kv.get(req.rid)
        if kv is None:
            out.append(Mismatch(req.rid, "AttentionStore entry", "missing"))
            continue
        _, k_ref, v_ref = reference(cfg, req.prompt, req.logit_bias)
        diff = kv_difference(kv[0], kv[1], k_ref, v_ref, _atol(cfg))
        if diff:
            out.append(Mismatch(req.rid, "AttentionStore entry", diff[0]))
    return out


def prefix_pages(cfg, reqs, probe: OutputProbe) -> list[Mismatch]:
    """Every prefix-cache page a request matched, as read at the match, against the reference KV of
    the positions it stands for in that request's prompt."""
    by_rid = {r.rid: r for r in reqs}
    ps = cfg.page_size
    out = []
    for rid, pages, k, v in probe.prefix_reads:
        req = by_rid[rid]
        _, k_ref, v_ref = reference(cfg, req.prompt, req.logit_bias)
        n = len(pages) * ps
        diff = kv_difference(k, v, k_ref[:, :n], v_ref[:, :n], _atol(cfg))
        if diff:
            text, pos = diff
            page = pages[min(pos // ps, len(pages) - 1)]
            out.append(Mismatch(rid, "prefix page", f"pool page {page}, {text}"))
    return out


def judge(cfg, reqs, receiver, probe: OutputProbe) -> Verdict:
    """Every output of a finished prefill run against the reference."""
    # one intra-op thread: the reference's ops are tiny, and more threads than free cores only
    # oversubscribe them (engine/oracle/reference.py)
    with torch.inference_mode(), intra_op_threads(1):
        # prefix pages first: a page wrong when matched makes what is computed from it wrong too
        # (the suffix's KV, the first token, what the receiver got), so the first one names the cause
        mismatches = prefix_pages(cfg, reqs, probe)
        mismatches += first_token_and_received_kv(cfg, reqs, receiver)
        mismatches += store_entries(cfg, reqs, probe)
    return Verdict(
        requests=len(reqs),
        store_entries=len(probe.store_kv),
        cached_pages=sum(len(p) for _, p, _, _ in probe.prefix_reads),
        mismatches=mismatches,
    )
