"""Digests of what a prefill forward reads, for the trace's `snapshot` and `fwd_begin` events.

A digest fingerprints a batch with the sampling state its forward uses: XXH3-64 of the batch's
metadata (requests named by identity) and of each input tensor's bytes. The checker only compares
digests for equality, so a fast non-cryptographic hash is enough. `DigestStamp` records what a
digest covers now and hashes it later, off the scheduler's critical path; the tracer resolves a
stamp it holds when the events are read (engine/trace/tracer.py).
"""

from __future__ import annotations

import ctypes
import operator
import threading
from typing import TYPE_CHECKING

import torch
import xxhash

if TYPE_CHECKING:  # annotations only: engine/runtime/request.py imports this module
    from engine.runtime.request import SamplingBatchInfo, ScheduleBatch


def batch_digest(batch: ScheduleBatch, sampling: SamplingBatchInfo | None = None, name=id) -> str:
    """Fingerprint of everything the forward reads, with the sampling state it will use (the batch's
    own without `sampling`): the batch's metadata, requests named by `name`, and each tensor's bytes
    (read in place: no copy on CPU; a device tensor is copied to the host first)."""
    key, tensors = _stamp(batch, sampling)
    return _digest(key, tensors, _tensor_hash(tensors[3]), name)


def _stamp(batch: ScheduleBatch, sampling: SamplingBatchInfo | None = None) -> tuple[tuple, tuple]:
    """What `batch_digest` covers, by reference: (the values, the requests by identity, the tensors'
    identities and version counters — the logit bias's last, on its own; the tensors). Two stamps
    whose keys are equal record the same state (while both hold their tensors, ids are not reused):
    one tuple comparison, in C."""
    reqs = batch.reqs
    ids, pos, loc = batch.input_ids, batch.positions, batch.out_cache_loc
    bias = (sampling or batch.sampling_info).logit_bias
    versions = (id(ids), ids._version, id(pos), pos._version, id(loc), loc._version)
    return (
        (
            batch.bid,
            tuple(reqs),
            tuple(map(_slot, reqs)),
            tuple(batch.starts),
            tuple(batch.extends),
            tuple(batch.last_chunk),
            versions,
            (id(bias), bias._version),
        ),
        (ids, pos, loc, bias),
    )  # Req: == is identity


_slot = operator.attrgetter("slot")


def _digest(key: tuple, tensors: tuple, bias_hash: int, name) -> str:
    """The digest of a stamp's key (its values) and tensors. The bias enters by its own hash, so a
    forward's copy of the bias can be compared with the snapshot's alone (DigestStamp.same_as)."""
    bid, reqs, slots, starts, extends, last_chunk, _, _ = key
    meta = (bid, [name(r) for r in reqs], slots, starts, extends, last_chunk)
    h = xxhash.xxh3_64(repr(meta).encode())
    for t in tensors[:3]:
        _update(h, t)
    h.update(bias_hash.to_bytes(8, "little"))
    return h.hexdigest()


def _shared_digest(meta: tuple) -> str:
    """The one digest of a snapshot and of the forward that read it untouched (DigestStamp): equal
    by construction, so it only has to be cheap, stable across processes (a replay writes the same
    trace) and a fingerprint of the batch: its metadata (`_shared_meta`), the requests' identities
    and the tensors' bytes left out (the same objects on both sides; the two logit biases were
    compared byte for byte). A repr, not Python's hash(): a slot may be None, whose hash is its
    address. Computed when the trace is read, not in the run."""
    return xxhash.xxh3_64_hexdigest(repr(meta).encode())


def _shared_meta(key: tuple) -> tuple:
    bid, _, slots, starts, extends, last_chunk, _, _ = key
    return ("shared", bid, slots, starts, extends, last_chunk)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: the two logit biases of the shared path. On CPU by memcmp in
    place, keeping the GIL (a torch op would let it go: see _HASH_SLICE); else torch.equal where
    they are (a GPU: one sync, not both copied). Tensors on two devices are not equal here: each is
    then hashed. Bytes are values for these tensors: both are made by clone() (copy_for_forward),
    which resolves lazy conjugate and negation bits (a test checks it) — not checked here, a hot
    path."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_cpu and b.is_cpu:
        if _memcmp is not None and a.is_contiguous() and b.is_contiguous():
            return _memcmp(a.data_ptr(), b.data_ptr(), a.nbytes) == 0
    elif a.device != b.device:
        return False
    return bool(torch.equal(a, b))


def _tensor_hash(t: torch.Tensor) -> int:
    h = xxhash.xxh3_64()
    _update(h, t)
    return h.intdigest()


# xxhash releases the GIL for buffers over 64 KiB. In the engine that is a trap: the digests run on
# the forward worker while other threads run Python, and a thread that lets the GIL go, however
# briefly, may wait a whole switch interval to get it back. Slices of 64 KiB keep it.
_HASH_SLICE = 1 << 16
# One ctypes array type, made once, viewed over each slice. `c_char * n` makes a new type per
# distinct n, and ctypes caches it only weakly: the collector frees it, and building it again per
# tensor costs far more than this view.
_Slice = ctypes.c_char * _HASH_SLICE
try:  # PyDLL: the call keeps the GIL (a CDLL call lets it go, the trap above)
    _memcmp = ctypes.PyDLL(None).memcmp
    _memcmp.restype = ctypes.c_int
    _memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
except (OSError, AttributeError, TypeError):  # no C library to look it up in (Windows)
    _memcmp = None  # _equal then compares with torch.equal
_DTYPE_TAGS: dict = {}


def _update(h, t: torch.Tensor) -> None:
    """Feed the tensor's dtype (bytes alone: int32 [1, 0] = int64 [1]) and its bytes to the hash,
    read in place (no copy) when it is a contiguous CPU tensor; a device tensor is copied to the
    host first. Read through ctypes, not numpy: Tensor.numpy() lets the GIL go, and a thread that
    does that while another runs Python waits to get it back. The shape is not hashed (formatting it
    costs more than hashing these bytes): the digest's metadata fixes it (the batch's tokens and
    requests; the vocabulary)."""
    tag = _DTYPE_TAGS.get(t.dtype)
    if tag is None:
        tag = _DTYPE_TAGS[t.dtype] = str(t.dtype).encode()
    h.update(tag)
    if not (t.is_cpu and t.is_contiguous()):
        t = t.detach().cpu().contiguous()
    n, p = t.nbytes, t.data_ptr()  # valid while `t` is alive (it is, here)
    for off in range(0, n, _HASH_SLICE):
        chunk = _Slice.from_address(p + off)
        left = n - off
        h.update(chunk if left >= _HASH_SLICE else memoryview(chunk)[:left])


class DigestStamp:
    """A batch's digest, taken now and computed later. What `batch_digest` covers is recorded by
    reference — the tensors with their version counters, the lists' values, the requests by
    identity: cheap — and hashed when first asked for (`trace_value`): the forward's own once it
    has launched the forward (so that a change while run_batch reads the batch shows), else when the
    trace is read. Under the assumption that every write to these tensors is a torch write, which
    bumps `_version`, hashing later what has not changed since gives the digest of the moment of the
    stamp; whether anything changed is checked after hashing (the values hashed are the stamp's own,
    the bytes are read now). If anything did, that moment is gone, and the value is a marker that
    equals no digest (`<marker>:<batch>`, a marker per stamping point, so that two changed stamps
    differ too): what a rule comparing it with another digest has to see. This is stricter than
    comparing bytes: a write undone before the forward, or a rebinding to equal bytes, also reads as
    a change (a correct engine does neither to a batch in flight).

    `same_as`: the forward's stamp of a snapshot that nothing has touched finds the snapshot's stamp
    with the same values, requests and tensors (the same objects at the same versions). Resolved
    together, while both still hold (checked again at the forward's resolution), the two need no
    tensor read but the two logit biases (the forward's is its own copy): when those are equal byte
    for byte (`_equal`), both get one digest of the batch's metadata (`_shared_digest`, computed
    when the trace is read) — the tensors are the same objects, unchanged, so their bytes cannot
    differ. Any other case hashes each stamp in full; a snapshot resolved earlier (by a reader of
    the trace) lends its digest to the forward's when they are alike."""

    __slots__ = (
        "batch",
        "sampling",
        "name",
        "key",
        "refs",
        "marker",
        "same_as",
        "value",
        "changed",
        "bias_hash",
        "on_value",
    )

    def __init__(
        self,
        batch: ScheduleBatch,
        name=id,
        sampling: SamplingBatchInfo | None = None,
        marker: str = "changed",
        same_as: DigestStamp | None = None,
    ):
        self.batch, self.sampling, self.name, self.marker = batch, sampling, name, marker
        self.key, self.refs = key, refs = _stamp(batch, sampling)
        base = same_as
        # read once: another thread may resolve it
        base_refs = base.refs if base is not None else None
        # alike in all but the bias
        self.same_as = base if base_refs is not None and base.key[:-1] == key[:-1] else None
        # a str once resolved; the shared digest's metadata until the trace is read (_shared_digest)
        self.value: str | tuple | None = None
        self.changed = False
        self.bias_hash = None
        self.on_value = None  # the trace's recorder, told the value once it is computed

    def subscribe(self, on_value) -> str | None:
        """The value if it is computed already; else None, and `on_value(value)` is called once it
        is (engine/trace/recorder.py logs it as a record of its own)."""
        with _RESOLVE:
            if self.batch is None:
                return self.trace_value()
            self.on_value = on_value
            return None

    def trace_value(self) -> str:
        """The digest (or marker), resolved now if it is not yet."""
        with _RESOLVE:
            self.resolve()
            value = self.value
            if type(value) is tuple:
                value = self.value = _shared_digest(value)
            return value

    def resolve(self) -> None:
        """Hash what the stamp recorded (or find it changed), and let go of the batch. The worker
        calls this once the forward is launched; the string of a shared digest waits for the trace's
        reader."""
        with _RESOLVE:  # the worker and a reader of the trace may both ask
            batch = self.batch
            if batch is None:  # resolved already
                return
            key, refs, base = self.key, self.refs, self.same_as
            bias = refs[3]
            if base is not None and base.batch is not None:
                # the snapshot's bias: compared, then checked still the batch's and unwritten
                sb = base.refs[3]
                if (
                    base.batch is batch
                    and _equal(sb, bias)
                    and sb is base.batch.sampling_info.logit_bias
                    and base.key[-1][1] == sb._version
                    and _stamp(batch, self.sampling)[0] == key
                ):
                    meta = _shared_meta(key)
                    if base.on_value is not None or self.on_value is not None:
                        meta = _shared_digest(meta)  # a trace waits for it: once for both
                    base._resolved(meta, None, False)
                    self._resolved(meta, None, False)
                    return
            bias_hash = _tensor_hash(bias)
            if base is not None:
                base.resolve()  # in full (the lock is reentrant)
                if not base.changed and base.bias_hash == bias_hash:
                    # at the stamp the batch was as the snapshot's was when hashed
                    value = base.value
                else:
                    value = _digest(key, refs, bias_hash, self.name)
            else:
                value = _digest(key, refs, bias_hash, self.name)
            self._resolved(value, bias_hash, _stamp(batch, self.sampling)[0] != key)

    def _resolved(self, value, bias_hash: int | None, changed: bool) -> None:
        if changed:
            value = f"{self.marker}:{self.batch.bid}"
        if self.on_value is not None and type(value) is tuple:  # the trace waits for it: now
            value = _shared_digest(value)
        self.value, self.bias_hash, self.changed = value, bias_hash, changed
        if self.on_value is not None:
            self.on_value(value)
            self.on_value = None
        batch = self.batch
        # Keep nothing of the batch alive, nor the tracer: `name` is its bound method, and a trace
        # holding its stamps would be a cycle (freed only by the collector, not when dropped).
        self.batch = self.sampling = self.refs = self.same_as = self.name = None
        if batch.digest_stamp is self:
            batch.digest_stamp = None


_RESOLVE = threading.RLock()
