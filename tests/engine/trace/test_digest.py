"""Batch digests (engine/trace/digest.py): what a digest covers, and how a DigestStamp taken now and
hashed later gives the digest of its moment, a marker after a change, or one shared digest for a
forward that read its snapshot untouched."""

import copy

import torch
import xxhash

from engine.runtime.request import SamplingBatchInfo
from engine.trace import digest
from engine.trace.digest import _HASH_SLICE, DigestStamp, _equal, _tensor_hash, batch_digest
from engine.trace.tracer import Tracer
from tests.batch_fixtures import make_batch


def test_digest_sees_every_input_in_place_and_every_identity():
    """The digest hashes the tensors' memory in place (no copies): an in-place write to any input
    changes it, and so does a copy of a request (a different object identity)."""
    tr = Tracer()
    b = make_batch()
    base = batch_digest(b, name=tr.obj)
    assert batch_digest(b, name=tr.obj) == base and len(base) == 16
    for t in (b.input_ids, b.positions, b.out_cache_loc, b.sampling_info.logit_bias):
        t.view(-1)[-1] += 1
        assert batch_digest(b, name=tr.obj) != base
        t.view(-1)[-1] -= 1
        assert batch_digest(b, name=tr.obj) == base
    b.reqs[1] = copy.copy(b.reqs[1])
    assert batch_digest(b, name=tr.obj) != base
    # a non-contiguous input is hashed by value: as its contiguous copy, and a changed value shows
    nc = make_batch()
    nc.input_ids = torch.arange(6 * 3)[::2]
    d = batch_digest(nc, name=tr.obj)
    dense = nc.input_ids
    nc.input_ids = dense.contiguous()
    assert batch_digest(nc, name=tr.obj) == d
    nc.input_ids = dense
    dense[-1] += 1
    assert batch_digest(nc, name=tr.obj) != d


def test_digest_sees_every_list_value_and_slot():
    """Any change a Python mutation can make to what the forward reads shows in the digest; a
    rebinding to equal bytes does not (the digest is of values)."""
    tr = Tracer()
    b = make_batch()
    base = batch_digest(b, name=tr.obj)
    assert batch_digest(b, name=tr.obj) == base
    b.starts[0] += 1  # a list mutated in place
    assert batch_digest(b, name=tr.obj) != base
    b.starts[0] -= 1
    assert batch_digest(b, name=tr.obj) == base
    b.reqs[0].slot = 5  # a request given another slot
    assert batch_digest(b, name=tr.obj) != base
    b.reqs[0].slot = None
    b.input_ids = b.input_ids.clone()  # rebound to equal bytes: the same digest, computed afresh
    assert batch_digest(b, name=tr.obj) == base
    b.positions = b.positions + 1  # rebound to other bytes
    assert batch_digest(b, name=tr.obj) != base
    assert batch_digest(b.copy(), name=tr.obj) == batch_digest(
        b, name=tr.obj
    )  # a shallow copy digests the same


def test_digest_stamp_is_the_digest_of_its_moment_or_a_marker(monkeypatch):
    """A snapshot's digest is stamped on the scheduler and hashed later: unchanged since, it equals
    the digest taken at the stamp; after any change it is a marker no digest equals."""
    tr = Tracer()
    b = make_batch()
    now = batch_digest(b, name=tr.obj)
    assert DigestStamp(b, tr.obj).trace_value() == now
    ids = b.input_ids
    # A forward copy's bias is a fresh tensor at version 0, and so is any rebinding of it: the key
    # holds the bias's id, or a rebinding to another version-0 tensor would pass unseen.
    b.sampling_info = b.sampling_info.copy_for_forward()
    assert b.sampling_info.logit_bias._version == 0
    stamp = DigestStamp(b, tr.obj)
    b.sampling_info.logit_bias = b.sampling_info.logit_bias.clone()
    assert b.sampling_info.logit_bias._version == 0 and stamp.trace_value() == f"changed:{b.bid}"
    for change, undo in (
        (lambda: b.out_cache_loc.add_(1), lambda: b.out_cache_loc.sub_(1)),
        (lambda: b.extends.__setitem__(0, 2), lambda: b.extends.__setitem__(0, 3)),
        # rebound to a copy: equal bytes and version, another object (the key holds ids)
        (lambda: setattr(b, "input_ids", ids.clone()), lambda: setattr(b, "input_ids", ids)),
        (lambda: b.sampling_info.filter_([0, 1]), None),
    ):
        stamp = DigestStamp(b, tr.obj)
        change()
        value = stamp.trace_value()
        assert value.startswith("changed:") and value != batch_digest(b, name=tr.obj)
        assert stamp.trace_value() == value  # resolved once
        if undo:
            undo()
    tr.emit("snapshot", batch=0, digest=DigestStamp(b, tr.obj))  # resolved when the events are read
    assert tr.events[-1]["digest"] == batch_digest(b, name=tr.obj)
    # a change that lands while the stamp is being hashed (admission beside the worker) shows too
    stamp = DigestStamp(b, tr.obj)
    b.digest_stamp = stamp
    hashing = digest._digest

    def admission_lands_meanwhile(*a, **k):
        d = hashing(*a, **k)
        b.extends[0] = 1
        return d

    monkeypatch.setattr(digest, "_digest", admission_lands_meanwhile)
    assert stamp.trace_value().startswith("changed:")
    monkeypatch.undo()
    # nothing kept
    assert stamp.batch is None and stamp.refs is None and b.digest_stamp is None


def test_forward_stamp_shares_the_snapshot_digest_only_when_it_may(monkeypatch):
    """The forward's stamp of an untouched snapshot reads only the two logit biases (its own copy
    and the snapshot's) and resolves both stamps to one digest; a bias copy with other bytes, a bias
    written after the snapshot, or a batch changed in between gives each its own digest; two changed
    stamps give two different markers."""
    tr = Tracer()
    b = make_batch()
    snap = DigestStamp(b, tr.obj)
    sampling = b.sampling_info.copy_for_forward()  # the forward's copy: another tensor
    read, compared = [], []
    update, equal = digest._update, digest._equal
    monkeypatch.setattr(digest, "_update", lambda h, t: (read.append(t), update(h, t)))
    monkeypatch.setattr(digest, "_equal", lambda x, y: (compared.append((x, y)), equal(x, y))[1])
    fwd = DigestStamp(b, tr.obj, sampling, marker="changed-in-launch", same_as=snap)
    assert fwd.same_as is snap and compared == []  # compared when resolved, not at the stamp
    fwd.resolve()  # as the worker: no string made yet
    assert snap.batch is None and fwd.batch is None  # resolved together
    assert type(fwd.value) is tuple and fwd.value is snap.value  # the metadata, kept for the reader
    shared = fwd.trace_value()
    monkeypatch.undo()
    assert shared == snap.trace_value() and isinstance(shared, str) and len(shared) == 16
    assert read == []  # no tensor hashed
    # the two biases, once
    assert len(compared) == 1 and compared[0][0] is b.sampling_info.logit_bias
    assert compared[0][1] is sampling.logit_bias
    assert shared != batch_digest(b, name=tr.obj)  # a kind of its own: no tensor bytes
    # the same batch stamped again gives the same shared digest (deterministic, not identity-based)
    snap2 = DigestStamp(b, tr.obj)
    again = DigestStamp(b, tr.obj, b.sampling_info.copy_for_forward(), same_as=snap2)
    assert again.trace_value() == shared
    # the snapshot's bias written after its stamp: no sharing, the snapshot reads as changed
    snap = DigestStamp(b, tr.obj)
    b.sampling_info.logit_bias.add_(0)
    copy = b.sampling_info.copy_for_forward()
    fwd = DigestStamp(b, tr.obj, copy, same_as=snap)
    assert fwd.same_as is snap  # the bias is not compared at the stamp
    assert fwd.trace_value() == batch_digest(b, copy, tr.obj)  # in full, its own moment
    assert snap.value == f"changed:{b.bid}"
    # either bias written after the forward's stamp (equal bytes): the writer's stamp reads as
    # changed
    for written, marker in (("snapshot", "changed"), ("forward", "changed-in-launch")):
        snap = DigestStamp(b, tr.obj)
        copy = b.sampling_info.copy_for_forward()
        fwd = DigestStamp(b, tr.obj, copy, marker="changed-in-launch", same_as=snap)
        (b.sampling_info if written == "snapshot" else copy).logit_bias.add_(0)
        fwd.resolve()
        writer = snap if written == "snapshot" else fwd
        assert writer.trace_value() == f"{marker}:{b.bid}", written
        assert (fwd if written == "snapshot" else snap).trace_value() == (
            batch_digest(b, copy, tr.obj) if written == "snapshot" else batch_digest(b, name=tr.obj)
        ), written
    # a forward copy whose bias differs (a non-idempotent copy_for_forward) digests differently
    snap = DigestStamp(b, tr.obj)
    other = b.sampling_info.copy_for_forward()
    other.logit_bias.view(-1)[0] += 1
    fwd = DigestStamp(b, tr.obj, other, marker="changed-in-launch", same_as=snap)
    assert fwd.same_as is snap and fwd.trace_value() != snap.trace_value()
    assert fwd.value == batch_digest(b, other, tr.obj)
    # values changed between the stamps: no shortcut, the forward hashes its own moment
    snap = DigestStamp(b, tr.obj)
    b.starts = [s + 0 for s in b.starts[:-1]] + [b.starts[-1] + 1]
    fwd = DigestStamp(b, tr.obj, sampling, same_as=snap)
    assert fwd.same_as is None
    assert fwd.trace_value() == batch_digest(b, sampling, tr.obj)
    assert snap.trace_value().startswith("changed:")
    # both changed before they are hashed: markers that differ from each other
    snap = DigestStamp(b, tr.obj)
    fwd = DigestStamp(b, tr.obj, sampling, marker="changed-in-launch", same_as=snap)
    b.input_ids.add_(0)
    assert fwd.trace_value() != snap.trace_value()
    assert {snap.value, fwd.value} == {f"changed:{b.bid}", f"changed-in-launch:{b.bid}"}


def test_a_change_during_the_shared_resolution_gives_both_markers(monkeypatch):
    """The shared digest is given only if the batch is still as stamped after the biases are read: a
    change landing in between (admission beside the worker) turns both stamps into their markers."""
    tr = Tracer()
    b = make_batch()
    snap = DigestStamp(b, tr.obj)
    b.digest_stamp = snap
    fwd = DigestStamp(
        b, tr.obj, b.sampling_info.copy_for_forward(), marker="changed-in-launch", same_as=snap
    )
    assert fwd.same_as is snap
    equal = digest._equal

    def admission_lands_meanwhile(x, y):  # while the two biases are compared
        b.extends[0] = 1
        return equal(x, y)

    monkeypatch.setattr(digest, "_equal", admission_lands_meanwhile)
    assert fwd.trace_value() == f"changed-in-launch:{b.bid}"
    assert snap.value == f"changed:{b.bid}" and b.digest_stamp is None


def test_bias_comparison_is_exact():
    """The shared path compares the two logit biases byte for byte (memcmp on CPU, keeping the GIL):
    equal only with the same dtype, shape and bytes; a strided view goes through torch.equal."""
    a = torch.randn(4, 64)
    assert _equal(a, a.clone())
    c = a.clone()
    c.view(-1)[-1] += 1  # the last byte region differs
    assert not _equal(a, c)
    assert not _equal(a, a.clone().view(64, 4))  # same bytes, another shape
    assert not _equal(a, a.view(torch.int32))  # same bytes, another dtype
    assert _equal(a.t(), a.clone().t()) and not _equal(a.t(), c.t())  # not contiguous
    assert _equal(a[:0], a[:0].clone())  # empty
    assert _equal(a[1:], a.clone()[1:])  # a storage offset: data_ptr() includes it
    # _equal compares bytes; the biases it is given are made by copy_for_forward's clone(), which
    # resolves lazy negation and conjugate bits, so their bytes are their values
    z = torch.randn(4, 4, dtype=torch.complex64)
    for lazy, values in ((torch._neg_view(a), -a), (z.conj(), z.conj().resolve_conj())):
        assert lazy.is_neg() or lazy.is_conj()
        # first and second call
        for info in (SamplingBatchInfo(lazy, None), SamplingBatchInfo(lazy, None, True)):
            copy = info.copy_for_forward().logit_bias
            assert not (copy.is_neg() or copy.is_conj()) and _equal(copy, values.clone())


def test_sliced_hash_is_the_hash_of_the_whole_buffer():
    """Large tensors are hashed in slices (xxhash keeps the GIL up to 64 KiB); streaming the slices
    gives exactly the hash of the whole buffer, and any changed byte changes it."""
    big = torch.randn(3 * _HASH_SLICE // 4 + 7)
    assert big.numpy().nbytes > _HASH_SLICE
    whole = xxhash.xxh3_64(str(big.dtype).encode())  # the dtype first
    whole.update(big.numpy().tobytes())
    assert _tensor_hash(big) == whole.intdigest()
    before = _tensor_hash(big)
    big[_HASH_SLICE // 4 + 1] += 1
    assert _tensor_hash(big) != before
    # every size reads exactly its own bytes through the one slice type: empty, under, at, just past
    # and over a slice (a tail view shorter than the slice)
    for n in (0, 1, _HASH_SLICE - 1, _HASH_SLICE, _HASH_SLICE + 1, 2 * _HASH_SLICE + 3):
        t = torch.arange(n, dtype=torch.uint8)
        expected = xxhash.xxh3_64(b"torch.uint8" + t.numpy().tobytes()).intdigest()
        assert _tensor_hash(t) == expected, n


def test_digest_covers_dtype_not_only_bytes():
    """int32 [1, 0] and int64 [1] have the same bytes; rebinding one to the other changes the
    digest."""
    b = make_batch()
    base = batch_digest(b)
    b.input_ids = b.input_ids.view(torch.int32)  # the same bytes read as twice as many int32
    assert batch_digest(b) != base
    pair, one = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([1], dtype=torch.int64)
    assert _tensor_hash(pair) != _tensor_hash(one)


def test_forward_stamp_of_a_resolved_snapshot_hashes_itself_and_readers_leave_stamps_pending():
    """A snapshot stamp already resolved (by a reader of the trace) gives the forward's stamp
    nothing to reuse: it hashes itself, to the same digest. A progress monitor reads events through
    names_and_fields, which resolves nothing."""
    tr = Tracer()
    b = make_batch()
    snap = DigestStamp(b, tr.obj)
    tr.emit("snapshot", batch=0, digest=snap)
    assert tr.names_and_fields() == [("snapshot", {"batch": 0, "digest": snap})]
    assert snap.value is None
    assert (
        tr.events[-1]["digest"] == snap.value == batch_digest(b, name=tr.obj)
    )  # `events` resolves it
    fwd = DigestStamp(b, tr.obj, b.sampling_info.copy_for_forward(), same_as=snap)
    assert fwd.same_as is None and fwd.trace_value() == snap.value
