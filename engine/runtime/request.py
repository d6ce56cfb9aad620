"""Requests and batches: `Req`, `SamplingBatchInfo`, `ScheduleBatch`.

The snapshot rules of the design live here: `ScheduleBatch.copy()` is shallow (rebinding a live
field leaves the copy's references intact), `SamplingBatchInfo.copy_for_forward()` isolates sampling
state from in-place filtering and is idempotent, and `Req` objects are always shared by identity.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from engine.runtime import inject


@dataclass(eq=False)  # identity semantics: two Req objects are never "equal"
class Req:
    rid: str
    prompt: list[int]
    bootstrap_room: int
    arrival_s: float = 0.0
    max_new_tokens: int = 1
    logit_bias: dict[int, float] | None = None
    # lifecycle state, mutated by the scheduler on the real object only
    slot: int | None = None
    pages: list[int] = field(
        default_factory=list
    )  # pool pages, position order (cached prefix first)
    prefix_nodes: list = field(default_factory=list)  # locked prefix-cache nodes
    prefix_len: int = 0  # tokens reused from the prefix cache
    filled: int = 0  # tokens already admitted (next chunk starts here)
    inflight_middle_chunks: int = 0
    start_send_idx: int = 0  # first position whose KV has not been sent yet
    prefix_sent: bool = False
    sender: object = None
    output_token: int | None = None
    first_token_s: float | None = None
    finished: bool = False
    released: bool = False  # slot and pages returned to the pools
    as_event: object = None  # completion of the AttentionStore staging gather
    error: str | None = None

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.filled


class Penalizer:
    """Stands in for SGLang's penalizer orchestrator: state the forward copy must not carry."""

    def __init__(self, bias: torch.Tensor):
        self.accumulated = torch.zeros_like(bias)


@dataclass
class SamplingBatchInfo:
    logit_bias: torch.Tensor  # [bs, vocab]
    penalizer: Penalizer | None
    is_forward_copy: bool = False

    @classmethod
    def build(cls, reqs, vocab: int, device) -> "SamplingBatchInfo":
        bias = torch.zeros((len(reqs), vocab), dtype=torch.float32)
        for i, r in enumerate(reqs):
            for tok, b in (r.logit_bias or {}).items():
                bias[i, tok] = b
        bias = bias.to(device)
        return cls(bias, Penalizer(bias))

    def filter_(self, keep: list[int]) -> None:
        """In place, as SGLang's filter_batch: rebinds this object's fields."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.logit_bias.device)
        self.logit_bias = self.logit_bias[idx]
        if self.penalizer is not None:
            self.penalizer.accumulated = self.penalizer.accumulated[idx]

    def copy_for_forward(self, mutants: frozenset = frozenset()) -> "SamplingBatchInfo":
        """A copy for the forward: own tensors, no penalizer. Safe to call twice (once before submit,
        once inside run_batch): folding the penalizer state happens only on the first call.
        `mutants`: the run's (engine/runtime/inject.py)."""
        twice = inject.on(mutants, "non-idempotent-copy-for-forward")
        if self.is_forward_copy and not twice:
            return SamplingBatchInfo(self.logit_bias.clone(), None, True)
        folded = self.logit_bias + (self.penalizer.accumulated if self.penalizer is not None else 0)
        if twice and self.is_forward_copy:
            # MUTANT: the forward copy's bias is applied again on the second call.
            folded = self.logit_bias * 2
        return SamplingBatchInfo(folded.clone(), None, True)


@dataclass
class ScheduleBatch:
    bid: int
    reqs: list[Req]
    # per request of this batch: the chunk [start, start+extend) of its prompt
    starts: list[int]
    extends: list[int]
    last_chunk: list[bool]
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    sampling_info: SamplingBatchInfo
    spec_info: object = None
    stage_event: object = None
    # A snapshot's digest stamp (engine/trace/digest.py DigestStamp), while it is unresolved: the
    # forward's stamp is compared with it, and resolving it clears this (the two hold each other).
    digest_stamp: object = field(default=None, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.extends))

    def filter(self, keep: list[int]) -> None:
        """Mutates in place, as admission does to the previous batch: fields are rebound."""
        self.reqs = [self.reqs[i] for i in keep]
        self.starts = [self.starts[i] for i in keep]
        self.extends = [self.extends[i] for i in keep]
        self.last_chunk = [self.last_chunk[i] for i in keep]
        self.sampling_info.filter_(keep)
        if self.spec_info is not None:
            self.spec_info.filter_(keep)

    def copy(self) -> "ScheduleBatch":
        """Shallow: the Req objects stay the real ones."""
        return copy.copy(self)


def snapshot_for_forward(batch: ScheduleBatch, mutants: frozenset = frozenset()) -> ScheduleBatch:
    """The design's `_snapshot_batch_for_forward`: shallow batch copy, forward copy of the sampling
    info, shallow spec_info; Req objects kept by identity (never deep-copied). `mutants`: the run's
    (engine/runtime/inject.py)."""
    if inject.on(mutants, "live-batch"):
        return batch  # MUTANT: the worker reads the live batch
    snap = copy.copy(batch)
    snap.sampling_info = batch.sampling_info.copy_for_forward(mutants)
    if batch.spec_info is not None:
        snap.spec_info = copy.copy(batch.spec_info)
    if inject.on(mutants, "deepcopy-chunked-req"):
        # MUTANT: chunked requests are deep-copied, so result processing mutates a copy.
        snap.reqs = [
            copy.copy(r) if not last else r for r, last in zip(batch.reqs, batch.last_chunk)
        ]
    return snap
