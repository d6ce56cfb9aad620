"""Requests and batches: `Req`, `SamplingBatchInfo`, `ScheduleBatch`.

The snapshot rules of the seed live here: `ScheduleBatch.copy()` is shallow (rebinding a live field
leaves the copy's references intact), `SamplingBatchInfo.copy_for_forward()` isolates sampling state
from in-place filtering and is idempotent, and `Req` objects are always shared by identity.
"""
from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field

import torch

from . import inject


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
    pages: list[int] = field(default_factory=list)   # pool pages, position order (cached prefix first)
    prefix_nodes: list = field(default_factory=list)  # locked prefix-cache nodes
    prefix_len: int = 0          # tokens reused from the prefix cache
    filled: int = 0              # tokens already admitted (next chunk starts here)
    inflight_middle_chunks: int = 0
    start_send_idx: int = 0      # first position whose KV has not been sent yet
    prefix_sent: bool = False
    sender: object = None
    output_token: int | None = None
    first_token_s: float | None = None
    finished: bool = False
    released: bool = False       # slot and pages returned to the pools
    as_event: object = None      # completion of the AttentionStore staging gather
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
    logit_bias: torch.Tensor        # [bs, vocab]
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

    def copy_for_forward(self) -> "SamplingBatchInfo":
        """A copy for the forward: own tensors, no penalizer. Safe to call twice (once before submit,
        once inside run_batch): folding the penalizer state happens only on the first call."""
        if self.is_forward_copy and not inject.on("non-idempotent-copy-for-forward"):
            bias = self.logit_bias.clone()
            _inherit_fingerprint(bias, self.logit_bias)  # a clone has the same bytes: no second hash
            return SamplingBatchInfo(bias, None, True)
        folded = self.logit_bias + (self.penalizer.accumulated if self.penalizer is not None else 0)
        if inject.on("non-idempotent-copy-for-forward") and self.is_forward_copy:
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

    def digest(self, sampling: "SamplingBatchInfo | None" = None, name=id) -> str:
        """Fingerprint of everything the forward reads (with the sampling state it will use): CRC-32
        of the batch's metadata and of each tensor's bytes (hashed in place through a numpy view: no
        copy on CPU; a device tensor is copied to the host first). The checker only compares digests
        for equality, so a checksum that any change of the bytes alters is enough, and the cheapest
        one at hand (zlib's CRC-32: ~7 µs for 16 KiB of logit bias here, SHA-1 ~12 µs).

        The forward's digest of a batch usually finds it as the snapshot left it: when every field is
        the same object as at the last digest, the lists hold the same values, the requests are the
        same objects in the same slots and no torch write touched a tensor (`_version`), the last
        result is reused (a comparison, not a re-hash)."""
        reqs = self.reqs
        bias_fp = _fingerprint((sampling or self.sampling_info).logit_bias)  # [bs, vocab]: cached
        key, tensors = self._stamp(name, with_bias=False)
        key += (bias_fp,)   # the bias by content: the forward's sampling copy is another tensor
        memo = self.__dict__.get("_digest_memo")   # (key, tensors, digest); holding the tensors keeps their ids theirs
        if memo is not None and memo[0] == key and all(a is b for a, b in zip(memo[1], tensors)):
            return memo[2]
        h = zlib.crc32(repr((self.bid, [r.rid for r in reqs], [name(r) for r in reqs], [r.slot for r in reqs],
                             self.starts, self.extends, self.last_chunk)).encode())
        for t in tensors:
            h = _crc(_host_view(t), h)
        d = f"{zlib.crc32(bias_fp, h):08x}"
        self._digest_memo = (key, tensors, d)
        return d

    def _stamp(self, name, *, with_bias: bool = True) -> tuple[tuple, tuple]:
        """What `digest` covers, by reference: (the values, the requests by identity and the tensors'
        version counters; the tensors). Without the logit bias for the digest's own memo, which
        compares the bias by content instead."""
        reqs = self.reqs
        tensors = (self.input_ids, self.positions, self.out_cache_loc)
        if with_bias:
            tensors += (self.sampling_info.logit_bias,)
        return ((name, self.bid, tuple(reqs), tuple(r.slot for r in reqs), tuple(self.starts), tuple(self.extends),
                 tuple(self.last_chunk), tuple(t._version for t in tensors)), tensors)   # Req: == is identity


class DigestStamp:
    """A batch's digest, taken now and computed later. What `ScheduleBatch.digest` covers is recorded
    by reference — the tensors with their version counters, the lists' values, the requests by
    identity: a few µs — and hashed when first asked for (`trace_value`): by the forward worker at
    fwd_begin (off the scheduler thread), else when the trace is read. Under the digest cache's
    assumption (every write to these tensors is a torch write, which bumps `_version`), hashing later
    what has not changed since gives the digest of the moment of the stamp. If anything changed
    before or while it is hashed, that moment is gone, and the value is a marker that equals no
    digest (`changed:<batch>`): what a rule comparing it with the forward's digest has to see. This
    is stricter than comparing bytes: a write undone before the forward, or a rebinding to equal
    bytes, also reads as a change (a correct engine does neither to a snapshot)."""

    __slots__ = ("batch", "name", "key", "refs", "value")

    def __init__(self, batch: ScheduleBatch, name=id):
        self.batch, self.name = batch, name
        self.key, self.refs = batch._stamp(name)
        self.value: str | None = None

    def trace_value(self) -> str:
        batch = self.batch
        if batch is None:   # resolved (by another thread, maybe)
            return self.value

        def unchanged() -> bool:
            key, refs = batch._stamp(self.name)
            return key == self.key and all(a is b for a, b in zip(refs, self.refs))

        # checked before and after hashing: a change landing while the digest reads the batch shows
        value = batch.digest(name=self.name) if unchanged() else None
        if value is None or not unchanged():
            value = f"changed:{batch.bid}"
        self.value = value
        self.batch = self.refs = None   # resolved: keep nothing of the batch alive
        batch.__dict__.pop("_digest_stamp", None)
        return value


def _fingerprint(t: torch.Tensor) -> bytes:
    """CRC-32 of the tensor's bytes, remembered on the tensor with its version counter: the batch's
    snapshot and its forward read the same input tensors, so the forward's digest reuses the
    snapshot's checksums unless a torch write (which bumps `_version`, shared by views) touched
    them. A rebound field is another tensor and is hashed afresh — what the snapshot rule needs."""
    hit = getattr(t, "_pdo_fp", None)
    if hit is not None and hit[0] == t._version:
        return hit[1]
    fp = _crc(_host_view(t)).to_bytes(4, "little")
    t._pdo_fp = (t._version, fp)
    return fp


def _crc(arr, c: int = 0) -> int:
    if arr.nbytes <= _HASH_SLICE:
        return zlib.crc32(arr, c)
    buf = memoryview(arr).cast("B")
    for i in range(0, len(buf), _HASH_SLICE):  # slices that keep the GIL (see _HASH_SLICE)
        c = zlib.crc32(buf[i:i + _HASH_SLICE], c)
    return c


def _inherit_fingerprint(clone: torch.Tensor, src: torch.Tensor) -> None:
    hit = getattr(src, "_pdo_fp", None)
    if hit is not None and hit[0] == src._version:
        clone._pdo_fp = (clone._version, hit[1])


# zlib releases the GIL while it checksums more than 5 KiB. In the engine that is a trap: the digest
# runs on the scheduler (snapshot) and on the worker (fwd_begin) while other threads run Python, and
# a thread that lets the GIL go for a few µs may wait a whole switch interval (5 ms) to get it back.
# Slices of 4 KiB keep it; a 16 KiB bias costs ~3 µs more than in one call.
_HASH_SLICE = 4096


def _host_view(t: torch.Tensor):
    """The tensor's bytes as a numpy array, without a copy when it is a contiguous CPU tensor."""
    if not t.is_cpu:
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.detach().numpy() if t.requires_grad else t.numpy()


def snapshot_for_forward(batch: ScheduleBatch) -> ScheduleBatch:
    """The seed's `_snapshot_batch_for_forward`: shallow batch copy, forward copy of the sampling
    info, shallow spec_info; Req objects kept by identity (never deep-copied)."""
    if inject.on("live-batch"):
        return batch  # MUTANT: the worker reads the live batch
    snap = copy.copy(batch)
    snap.sampling_info = batch.sampling_info.copy_for_forward()
    if batch.spec_info is not None:
        snap.spec_info = copy.copy(batch.spec_info)
    if inject.on("deepcopy-chunked-req"):
        # MUTANT: chunked requests are deep-copied, so result processing mutates a copy.
        snap.reqs = [copy.copy(r) if not last else r for r, last in zip(batch.reqs, batch.last_chunk)]
    return snap
