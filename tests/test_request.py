"""Snapshot semantics of the seed: shallow batch copy, idempotent copy_for_forward without the
penalizer, shallow spec_info, Req objects by identity; in-place filter does not reach a snapshot."""
import pytest
import torch

from engine import inject
from engine.request import DigestStamp, Req, SamplingBatchInfo, ScheduleBatch, snapshot_for_forward


class Spec:
    def __init__(self, n):
        self.draft = list(range(n))

    def filter_(self, keep):
        self.draft = [self.draft[i] for i in keep]


def _batch(n=3):
    reqs = [Req(rid=f"r{i}", prompt=[1, 2, 3], bootstrap_room=i, logit_bias={i: 1.0}) for i in range(n)]
    return ScheduleBatch(bid=0, reqs=reqs, starts=[0] * n, extends=[3] * n, last_chunk=[True] * n,
                         input_ids=torch.arange(3 * n), positions=torch.arange(3 * n), out_cache_loc=torch.arange(3 * n),
                         sampling_info=SamplingBatchInfo.build(reqs, 8, "cpu"), spec_info=Spec(n))


def test_snapshot_is_isolated_from_in_place_filter():
    live = _batch()
    before = live.digest()
    snap = snapshot_for_forward(live)
    live.filter([1])
    assert [r.rid for r in live.reqs] == ["r1"] and live.sampling_info.logit_bias.shape[0] == 1
    assert [r.rid for r in snap.reqs] == ["r0", "r1", "r2"]
    assert snap.sampling_info.logit_bias.shape[0] == 3 and snap.spec_info.draft == [0, 1, 2]
    assert snap.digest() == before


def test_reqs_kept_by_identity_and_copy_is_shallow():
    live = _batch()
    snap = snapshot_for_forward(live)
    assert all(a is b for a, b in zip(live.reqs, snap.reqs))
    c = snap.copy()
    assert c.reqs is snap.reqs and c is not snap


def test_copy_for_forward_is_idempotent_and_drops_penalizer():
    info = _batch().sampling_info
    info.penalizer.accumulated += 0.5
    once = info.copy_for_forward()
    twice = once.copy_for_forward()
    assert once.penalizer is None and twice.penalizer is None
    assert torch.equal(once.logit_bias, twice.logit_bias)
    assert torch.equal(once.logit_bias, info.logit_bias + 0.5)
    assert once.logit_bias.data_ptr() != info.logit_bias.data_ptr() != twice.logit_bias.data_ptr()


def test_mutants_change_these_semantics():
    inject.set_active({"non-idempotent-copy-for-forward"})
    try:
        once = _batch().sampling_info.copy_for_forward()
        assert not torch.equal(once.copy_for_forward().logit_bias, once.logit_bias)
    finally:
        inject.set_active(())
    inject.set_active({"live-batch"})
    try:
        live = _batch()
        assert snapshot_for_forward(live) is live
    finally:
        inject.set_active(())


def test_digest_sees_every_input_in_place_and_every_identity():
    """The digest hashes the tensors' memory in place (no copies): an in-place write to any input
    changes it, and so does a copy of a request (a different object identity)."""
    import copy

    from engine.trace import Tracer

    tr = Tracer()
    b = _batch()
    base = b.digest(name=tr.obj)
    assert b.digest(name=tr.obj) == base and len(base) == 16
    for t in (b.input_ids, b.positions, b.out_cache_loc, b.sampling_info.logit_bias):
        t.view(-1)[-1] += 1
        assert b.digest(name=tr.obj) != base
        t.view(-1)[-1] -= 1
        assert b.digest(name=tr.obj) == base
    b.reqs[1] = copy.copy(b.reqs[1])
    assert b.digest(name=tr.obj) != base
    # a non-contiguous input is hashed by value: as its contiguous copy, and a changed value shows
    nc = _batch()
    nc.input_ids = torch.arange(6 * 3)[::2]
    d = nc.digest(name=tr.obj)
    dense = nc.input_ids
    nc.input_ids = dense.contiguous()
    assert nc.digest(name=tr.obj) == d
    nc.input_ids = dense
    dense[-1] += 1
    assert nc.digest(name=tr.obj) != d


def test_digest_sees_every_list_value_and_slot():
    """Any change a Python mutation can make to what the forward reads shows in the digest; a
    rebinding to equal bytes does not (the digest is of values)."""
    from engine.trace import Tracer

    tr = Tracer()
    b = _batch()
    base = b.digest(name=tr.obj)
    assert b.digest(name=tr.obj) == base
    b.starts[0] += 1                      # a list mutated in place
    assert b.digest(name=tr.obj) != base
    b.starts[0] -= 1
    assert b.digest(name=tr.obj) == base
    b.reqs[0].slot = 5                    # a request given another slot
    assert b.digest(name=tr.obj) != base
    b.reqs[0].slot = None
    b.input_ids = b.input_ids.clone()     # rebound to equal bytes: the same digest, computed afresh
    assert b.digest(name=tr.obj) == base
    b.positions = b.positions + 1         # rebound to other bytes
    assert b.digest(name=tr.obj) != base
    assert b.copy().digest(name=tr.obj) == b.digest(name=tr.obj)   # a shallow copy digests the same


def test_digest_stamp_is_the_digest_of_its_moment_or_a_marker(monkeypatch):
    """A snapshot's digest is stamped on the scheduler and hashed later: unchanged since, it equals
    the digest taken at the stamp; after any change it is a marker no digest equals."""
    from engine import request
    from engine.request import DigestStamp
    from engine.trace import Tracer

    tr = Tracer()
    b = _batch()
    now = b.digest(name=tr.obj)
    assert DigestStamp(b, tr.obj).trace_value() == now
    ids = b.input_ids
    # A forward copy's bias is a fresh tensor at version 0, and so is any rebinding of it: the key holds
    # the bias's id, or a rebinding to another version-0 tensor would pass unseen.
    b.sampling_info = b.sampling_info.copy_for_forward()
    assert b.sampling_info.logit_bias._version == 0
    stamp = DigestStamp(b, tr.obj)
    b.sampling_info.logit_bias = b.sampling_info.logit_bias.clone()
    assert b.sampling_info.logit_bias._version == 0 and stamp.trace_value() == f"changed:{b.bid}"
    for change, undo in ((lambda: b.out_cache_loc.add_(1), lambda: b.out_cache_loc.sub_(1)),
                         (lambda: b.extends.__setitem__(0, 2), lambda: b.extends.__setitem__(0, 3)),
                         # rebound to a copy: equal bytes and version, another object (the key holds ids)
                         (lambda: setattr(b, "input_ids", ids.clone()), lambda: setattr(b, "input_ids", ids)),
                         (lambda: b.sampling_info.filter_([0, 1]), None)):
        stamp = DigestStamp(b, tr.obj)
        change()
        value = stamp.trace_value()
        assert value.startswith("changed:") and value != b.digest(name=tr.obj)
        assert stamp.trace_value() == value          # resolved once
        if undo:
            undo()
    tr.emit("snapshot", batch=0, digest=DigestStamp(b, tr.obj))   # resolved when the events are read
    assert tr.events[-1]["digest"] == b.digest(name=tr.obj)
    # a change that lands while the stamp is being hashed (admission beside the worker) shows too
    stamp = DigestStamp(b, tr.obj)
    b._digest_stamp = stamp
    hashing = request._digest

    def admission_lands_meanwhile(*a, **k):
        d = hashing(*a, **k)
        b.extends[0] = 1
        return d

    monkeypatch.setattr(request, "_digest", admission_lands_meanwhile)
    assert stamp.trace_value().startswith("changed:")
    monkeypatch.undo()
    assert stamp.batch is None and stamp.refs is None and "_digest_stamp" not in b.__dict__   # nothing kept


def test_forward_stamp_shares_the_snapshot_digest_only_when_it_may(monkeypatch):
    """The forward's stamp of an untouched snapshot reads only the two logit biases (its own copy and
    the snapshot's) and resolves both stamps to one digest; a bias copy with other bytes, a bias
    written after the snapshot, or a batch changed in between gives each its own digest; two changed
    stamps give two different markers."""
    from engine import request
    from engine.request import DigestStamp
    from engine.trace import Tracer

    tr = Tracer()
    b = _batch()
    snap = DigestStamp(b, tr.obj)
    sampling = b.sampling_info.copy_for_forward()          # the forward's copy: another tensor
    read, compared = [], []
    update, equal = request._update, request._equal
    monkeypatch.setattr(request, "_update", lambda h, t: (read.append(t), update(h, t)))
    monkeypatch.setattr(request, "_equal", lambda x, y: (compared.append((x, y)), equal(x, y))[1])
    fwd = DigestStamp(b, tr.obj, sampling, marker="changed-in-launch", same_as=snap)
    assert fwd.same_as is snap and compared == []                  # compared when resolved, not at the stamp
    fwd.resolve()                                                  # as the worker: no string made yet
    assert snap.batch is None and fwd.batch is None                # resolved together
    assert type(fwd.value) is tuple and fwd.value is snap.value    # the metadata, kept for the reader
    shared = fwd.trace_value()
    monkeypatch.undo()
    assert shared == snap.trace_value() and isinstance(shared, str) and len(shared) == 16
    assert read == []                                              # no tensor hashed
    assert len(compared) == 1 and compared[0][0] is b.sampling_info.logit_bias   # the two biases, once
    assert compared[0][1] is sampling.logit_bias
    assert shared != b.digest(name=tr.obj)                        # a kind of its own: no tensor bytes
    # the same batch stamped again gives the same shared digest (deterministic, not identity-based)
    snap2 = DigestStamp(b, tr.obj)
    assert DigestStamp(b, tr.obj, b.sampling_info.copy_for_forward(), same_as=snap2).trace_value() == shared
    # the snapshot's bias written after its stamp: no sharing, the snapshot reads as changed
    snap = DigestStamp(b, tr.obj)
    b.sampling_info.logit_bias.add_(0)
    copy = b.sampling_info.copy_for_forward()
    fwd = DigestStamp(b, tr.obj, copy, same_as=snap)
    assert fwd.same_as is snap                                    # the bias is not compared at the stamp
    assert fwd.trace_value() == b.digest(copy, tr.obj)            # in full, its own moment
    assert snap.value == f"changed:{b.bid}"
    # either bias written after the forward's stamp (equal bytes): the writer's stamp reads as changed
    for written, marker in (("snapshot", "changed"), ("forward", "changed-in-launch")):
        snap = DigestStamp(b, tr.obj)
        copy = b.sampling_info.copy_for_forward()
        fwd = DigestStamp(b, tr.obj, copy, marker="changed-in-launch", same_as=snap)
        (b.sampling_info if written == "snapshot" else copy).logit_bias.add_(0)
        fwd.resolve()
        assert (snap if written == "snapshot" else fwd).trace_value() == f"{marker}:{b.bid}", written
        assert (fwd if written == "snapshot" else snap).trace_value() == (
            b.digest(copy, tr.obj) if written == "snapshot" else b.digest(name=tr.obj)), written
    # a forward copy whose bias differs (a non-idempotent copy_for_forward) digests differently
    snap = DigestStamp(b, tr.obj)
    other = b.sampling_info.copy_for_forward()
    other.logit_bias.view(-1)[0] += 1
    fwd = DigestStamp(b, tr.obj, other, marker="changed-in-launch", same_as=snap)
    assert fwd.same_as is snap and fwd.trace_value() != snap.trace_value()
    assert fwd.value == b.digest(other, tr.obj)
    # values changed between the stamps: no shortcut, the forward hashes its own moment
    snap = DigestStamp(b, tr.obj)
    b.starts = [s + 0 for s in b.starts[:-1]] + [b.starts[-1] + 1]
    fwd = DigestStamp(b, tr.obj, sampling, same_as=snap)
    assert fwd.same_as is None
    assert fwd.trace_value() == b.digest(sampling, tr.obj) and snap.trace_value().startswith("changed:")
    # both changed before they are hashed: markers that differ from each other
    snap = DigestStamp(b, tr.obj)
    fwd = DigestStamp(b, tr.obj, sampling, marker="changed-in-launch", same_as=snap)
    b.input_ids.add_(0)
    assert fwd.trace_value() != snap.trace_value()
    assert {snap.value, fwd.value} == {f"changed:{b.bid}", f"changed-in-launch:{b.bid}"}


def test_a_change_during_the_shared_resolution_gives_both_markers(monkeypatch):
    """The shared digest is given only if the batch is still as stamped after the biases are read: a
    change landing in between (admission beside the worker) turns both stamps into their markers."""
    from engine import request
    from engine.request import DigestStamp
    from engine.trace import Tracer

    tr = Tracer()
    b = _batch()
    snap = DigestStamp(b, tr.obj)
    b._digest_stamp = snap
    fwd = DigestStamp(b, tr.obj, b.sampling_info.copy_for_forward(), marker="changed-in-launch", same_as=snap)
    assert fwd.same_as is snap
    equal = request._equal

    def admission_lands_meanwhile(x, y):   # while the two biases are compared
        b.extends[0] = 1
        return equal(x, y)

    monkeypatch.setattr(request, "_equal", admission_lands_meanwhile)
    assert fwd.trace_value() == f"changed-in-launch:{b.bid}"
    assert snap.value == f"changed:{b.bid}" and "_digest_stamp" not in b.__dict__


def test_bias_comparison_is_exact():
    """The shared path compares the two logit biases byte for byte (memcmp on CPU, keeping the GIL):
    equal only with the same dtype, shape and bytes; a strided view goes through torch.equal."""
    from engine.request import _equal

    a = torch.randn(4, 64)
    assert _equal(a, a.clone())
    c = a.clone()
    c.view(-1)[-1] += 1                          # the last byte region differs
    assert not _equal(a, c)
    assert not _equal(a, a.clone().view(64, 4))  # same bytes, another shape
    assert not _equal(a, a.view(torch.int32))    # same bytes, another dtype
    assert _equal(a.t(), a.clone().t()) and not _equal(a.t(), c.t())   # not contiguous
    assert _equal(a[:0], a[:0].clone())          # empty
    assert _equal(a[1:], a.clone()[1:])          # a storage offset: data_ptr() includes it
    # _equal compares bytes; the biases it is given are made by copy_for_forward's clone(), which
    # resolves lazy negation and conjugate bits, so their bytes are their values
    z = torch.randn(4, 4, dtype=torch.complex64)
    for lazy, values in ((torch._neg_view(a), -a), (z.conj(), z.conj().resolve_conj())):
        assert lazy.is_neg() or lazy.is_conj()
        for info in (SamplingBatchInfo(lazy, None), SamplingBatchInfo(lazy, None, True)):  # first and second call
            copy = info.copy_for_forward().logit_bias
            assert not (copy.is_neg() or copy.is_conj()) and _equal(copy, values.clone())


def test_sliced_hash_is_the_hash_of_the_whole_buffer():
    """Large tensors are hashed in slices (xxhash keeps the GIL up to 64 KiB); streaming the slices
    gives exactly the hash of the whole buffer, and any changed byte changes it."""
    import xxhash

    from engine.request import _HASH_SLICE, _tensor_hash

    big = torch.randn(3 * _HASH_SLICE // 4 + 7)
    assert big.numpy().nbytes > _HASH_SLICE
    whole = xxhash.xxh3_64(str(big.dtype).encode())   # the dtype first
    whole.update(big.numpy().tobytes())
    assert _tensor_hash(big) == whole.intdigest()
    before = _tensor_hash(big)
    big[_HASH_SLICE // 4 + 1] += 1
    assert _tensor_hash(big) != before
    # every size reads exactly its own bytes through the one slice type: empty, under, at, just past
    # and over a slice (a tail view shorter than the slice)
    for n in (0, 1, _HASH_SLICE - 1, _HASH_SLICE, _HASH_SLICE + 1, 2 * _HASH_SLICE + 3):
        t = torch.arange(n, dtype=torch.uint8)
        assert _tensor_hash(t) == xxhash.xxh3_64(b"torch.uint8" + t.numpy().tobytes()).intdigest(), n


def test_tracer_object_ids_survive_id_reuse():
    """Identities are exact: the tracer keeps what it named alive, so a dead object's id() is never
    handed to another. Objects emitted as the `obj` field are named when the events are read, in
    order of first appearance, consistently with `obj()`; a copy is a new identity."""
    import copy

    from engine.trace import Tracer

    tr = Tracer()
    a = Req(rid="a", prompt=[1], bootstrap_room=0)
    b = Req(rid="b", prompt=[1], bootstrap_room=1)
    assert tr.obj(a) == "o1" and tr.obj(b) == "o2" and tr.obj(a) == "o1"
    del a
    names = {tr.obj(Req(rid=f"x{i}", prompt=[1], bootstrap_room=i)) for i in range(50)}  # would reuse ids
    assert len(names) == 50 and "o1" not in names and "o2" not in names
    assert tr.obj(b) == "o2"
    c, d = Req(rid="c", prompt=[1], bootstrap_room=2), copy.copy(b)
    for x in (c, b, d, c):
        tr.emit("kv_send", rid=x.rid, obj=x, tokens=1, pages=1)
    tr.emit("kv_send", rid="e", obj="o9999", tokens=1, pages=1)   # a name given by the caller stays
    assert [e["obj"] for e in tr.events] == ["o53", "o2", "o54", "o53", "o9999"]


def test_digest_covers_dtype_not_only_bytes():
    """int32 [1, 0] and int64 [1] have the same bytes; rebinding one to the other changes the digest."""
    from engine.request import _tensor_hash

    b = _batch()
    base = b.digest()
    b.input_ids = b.input_ids.view(torch.int32)   # the same bytes read as twice as many int32
    assert b.digest() != base
    assert _tensor_hash(torch.tensor([1, 0], dtype=torch.int32)) != _tensor_hash(torch.tensor([1], dtype=torch.int64))


def test_forward_stamp_of_a_resolved_snapshot_hashes_itself_and_readers_leave_stamps_pending():
    """A snapshot stamp already resolved (by a reader of the trace) gives the forward's stamp nothing
    to reuse: it hashes itself, to the same digest. A progress monitor reads events through
    names_and_fields, which resolves nothing."""
    from engine.request import DigestStamp
    from engine.trace import Tracer

    tr = Tracer()
    b = _batch()
    snap = DigestStamp(b, tr.obj)
    tr.emit("snapshot", batch=0, digest=snap)
    assert tr.names_and_fields() == [("snapshot", {"batch": 0, "digest": snap})] and snap.value is None
    assert tr.events[-1]["digest"] == snap.value == b.digest(name=tr.obj)   # `events` resolves it
    fwd = DigestStamp(b, tr.obj, b.sampling_info.copy_for_forward(), same_as=snap)
    assert fwd.same_as is None and fwd.trace_value() == snap.value


def test_declared_events_read_back_as_emitted():
    """A declared event (Tracer.events_for, the engine's hot paths) reads back as `emit` would have
    logged it: the same fields, objects named, digest stamps resolved; the progress monitor's view
    (names_and_fields) names its values too. A NullTracer's loggers keep nothing."""
    from engine.trace import NullTracer, Tracer

    a = Req(rid="a", prompt=[1], bootstrap_room=0)
    kw, pos = Tracer(), Tracer()
    log = pos.events_for(kv_send=("rid", "obj", "tokens", "pages"), snapshot=("batch", "digest"))
    assert pos.declared == {"kv_send": ("rid", "obj", "tokens", "pages"), "snapshot": ("batch", "digest")}
    for tr, send, snap in ((kw, lambda: kw.emit("kv_send", rid="a", obj=a, tokens=3, pages=1),
                            lambda b: kw.emit("snapshot", batch=0, digest=DigestStamp(b, kw.obj))),
                           (pos, lambda: log.kv_send("a", a, 3, 1), lambda b: log.snapshot(0, DigestStamp(b, pos.obj)))):
        send()
        snap(_batch())
    assert pos.names_and_fields()[0] == ("kv_send", {"rid": "a", "obj": a, "tokens": 3, "pages": 1})
    strip = lambda evs: [{k: v for k, v in e.items() if k != "t_ns"} for e in evs]  # noqa: E731
    assert strip(pos.events) == strip(kw.events)
    assert pos.events[0]["obj"] == "o1" and len(pos.events[1]["digest"]) == 16
    null = NullTracer()
    null.events_for(kv_send=("rid", "obj", "tokens", "pages")).kv_send("a", a, 3, 1)
    assert null.count == 0


def test_a_declared_event_logged_with_the_wrong_values_fails_where_it_is_logged():
    from engine.trace import NullTracer, Tracer

    for tr in (Tracer(), NullTracer()):
        alloc = tr.events_for(alloc=("rid", "obj", "slot")).alloc
        with pytest.raises(TypeError, match=r"event alloc: 2 values logged for the fields rid, obj, slot"):
            alloc("a", "o1")
        with pytest.raises(TypeError, match=r"event alloc: 4 values"):
            alloc("a", "o1", 0, 1)
        assert tr.count == 0


def test_declared_events_and_emit_are_schedule_points_in_the_order_logged(monkeypatch):
    """Under a controller (checker/fuzz.py) every event is a schedule point, whichever way it is
    logged and whether or not the tracer keeps it."""
    from types import SimpleNamespace

    from engine import sync
    from engine.trace import NullTracer, Tracer

    points = []
    monkeypatch.setattr(sync, "CONTROLLER", SimpleNamespace(point=points.append))
    tr, null = Tracer(), NullTracer()
    tr.events_for(a=("batch",)).a(0)
    tr.emit("b", batch=1)
    null.events_for(c=("batch",)).c(2)
    null.emit("d", batch=3)
    assert points == ["a", "b", "c", "d"] and [e["ev"] for e in tr.events] == ["a", "b"]


def test_the_prefill_engine_declares_its_events_as_the_spec_names_them():
    """Every event the prefill scheduler declares is in the spec's prefill vocabulary, with all the
    required fields and no field the spec does not know (spec/events.toml)."""
    from spec import load_events

    from engine.config import EngineConfig
    from engine.run import run_prefill
    from engine.trace import Tracer
    from engine.workload import WorkloadConfig

    tr = Tracer()
    # as tests/helpers.py's run_mode: FIFO-paced admission, so prefix hits and chunks do not depend on timing
    s = run_prefill(EngineConfig(mode="ahead", max_batch_tokens=128),
                    WorkloadConfig(requests=12, prompt_len=(20, 150), hit=0.6, seed=3), tracer=tr, keep_scheduler=True)
    vocab = load_events()["prefill"]
    assert tr.declared and set(tr.declared) <= set(vocab)
    for ev, names in tr.declared.items():
        required, optional = set(vocab[ev]["fields"]), set(vocab[ev].get("optional", {}))
        assert required <= set(names) <= required | optional, ev
        assert len(set(names)) == len(names), ev
    # ...and the values land in their fields: each request's rid with its own object, its slot, its
    # batches; the tokens sent add up to its prompt, in page counts that fit them
    events, reqs = tr.events, {r.rid: r for r in s["_requests"]}
    assert {e["ev"] for e in events} == set(tr.declared)   # every declared event was logged here
    objs, page = {}, s["_scheduler"].cfg.page_size
    for e in events:
        if "rid" in e:
            assert e["rid"] in reqs and objs.setdefault(e["rid"], e["obj"]) == e["obj"], e
        if e["ev"] in ("alloc", "release"):
            assert isinstance(e["slot"], int), e
        if e["ev"] in ("kv_send", "prefix_send") and "tokens" in e:
            assert 0 <= e["pages"] <= -(-e["tokens"] // page) + 1, e
    assert len(set(objs.values())) == len(reqs) == 12
    for rid, r in reqs.items():
        assert sum(e.get("tokens", 0) for e in events if e["ev"] in ("kv_send", "prefix_send") and e["rid"] == rid) == len(r.prompt)
    assert [e["batch"] for e in events if e["ev"] == "admit"] == list(range(s["batches"]))
