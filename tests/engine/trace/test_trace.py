"""The tracer (engine/trace/tracer.py): exact object identities, declared events that read back as
emitted, schedule points, and the prefill engine's events as the spec names them."""

import copy
from types import SimpleNamespace

import pytest

from engine import sync
from engine.runs.prefill_run import run_prefill
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from engine.runtime.request import Req
from engine.trace.digest import DigestStamp
from engine.trace.tracer import NullTracer, Tracer
from spec import load_events
from tests.batch_fixtures import make_batch

# the loops' traces refine their models (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("refined")


def test_tracer_object_ids_survive_id_reuse():
    """Identities are exact: the tracer keeps what it named alive, so a dead object's id() is never
    handed to another. Objects emitted as the `obj` field are named when the events are read, in
    order of first appearance, consistently with `obj()`; a copy is a new identity."""
    tr = Tracer()
    a = Req(rid="a", prompt=[1], bootstrap_room=0)
    b = Req(rid="b", prompt=[1], bootstrap_room=1)
    assert tr.obj(a) == "o1" and tr.obj(b) == "o2" and tr.obj(a) == "o1"
    del a
    # would reuse ids
    names = {tr.obj(Req(rid=f"x{i}", prompt=[1], bootstrap_room=i)) for i in range(50)}
    assert len(names) == 50 and "o1" not in names and "o2" not in names
    assert tr.obj(b) == "o2"
    c, d = Req(rid="c", prompt=[1], bootstrap_room=2), copy.copy(b)
    for x in (c, b, d, c):
        tr.emit("kv_send", rid=x.rid, obj=x, tokens=1, pages=1)
    tr.emit("kv_send", rid="e", obj="o9999", tokens=1, pages=1)  # a name given by the caller stays
    assert [e["obj"] for e in tr.events] == ["o53", "o2", "o54", "o53", "o9999"]


def test_declared_events_read_back_as_emitted():
    """A declared event (Tracer.events_for, the engine's hot paths) reads back as `emit` would have
    logged it: the same fields, objects named, digest stamps resolved; the progress monitor's view
    (names_and_fields) names its objects too. A NullTracer's loggers keep nothing."""
    a = Req(rid="a", prompt=[1], bootstrap_room=0)
    kw, pos = Tracer(), Tracer()
    log = pos.events_for(kv_send=("rid", "obj", "tokens", "pages"), snapshot=("batch", "digest"))
    assert pos.declared == {
        "kv_send": ("rid", "obj", "tokens", "pages"),
        "snapshot": ("batch", "digest"),
    }
    for _tracer, send, snap in (
        (
            kw,
            lambda: kw.emit("kv_send", rid="a", obj=a, tokens=3, pages=1),
            lambda b: kw.emit("snapshot", batch=0, digest=DigestStamp(b, kw.obj)),
        ),
        (
            pos,
            lambda: log.kv_send("a", a, 3, 1),
            lambda b: log.snapshot(0, DigestStamp(b, pos.obj)),
        ),
    ):
        send()
        snap(make_batch())
    assert pos.names_and_fields()[0] == (
        "kv_send",
        {"rid": "a", "obj": "o1", "tokens": 3, "pages": 1},
    )
    strip = lambda evs: [{k: v for k, v in e.items() if k != "t_ns"} for e in evs]  # noqa: E731
    assert strip(pos.events) == strip(kw.events)
    assert pos.events[0]["obj"] == "o1" and len(pos.events[1]["digest"]) == 16
    null = NullTracer()
    null.events_for(kv_send=("rid", "obj", "tokens", "pages")).kv_send("a", a, 3, 1)
    assert null.count == 0


def test_a_declared_event_logged_with_the_wrong_values_fails_where_it_is_logged():
    for tr in (Tracer(), NullTracer()):
        alloc = tr.events_for(alloc=("rid", "obj", "slot")).alloc
        # the recorder's message is Python's for its generated call, which names the event
        wrong = r"event alloc(: 2 values logged for the fields rid, obj, slot|.* argument: 'slot')"
        with pytest.raises(TypeError, match=wrong):
            alloc("a", "o1")
        with pytest.raises(TypeError, match=r"event alloc(: 4 values|.* but 4 were given)"):
            alloc("a", "o1", 0, 1)
        assert tr.count == 0


def test_declared_events_and_emit_are_schedule_points_in_the_order_logged(monkeypatch):
    """Under a controller (checker/fuzz/) every event is a schedule point, whichever way it is
    logged and whether or not the tracer keeps it."""
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
    tr = Tracer()
    # as tests/helpers.py's run_mode: FIFO-paced admission, so prefix hits and chunks do not depend
    # on timing
    s = run_prefill(
        RunSpec(
            EngineConfig(mode="ahead", max_batch_tokens=128),
            WorkloadConfig(requests=12, prompt_len=(20, 150), hit=0.6, seed=3),
            verify=False,
        ),
        tracer=tr,
    )
    vocab = load_events()["prefill"]
    assert tr.declared and set(tr.declared) <= set(vocab)
    for ev, names in tr.declared.items():
        required, optional = set(vocab[ev]["fields"]), set(vocab[ev].get("optional", {}))
        assert required <= set(names) <= required | optional, ev
        assert len(set(names)) == len(names), ev
    # ...and the values land in their fields: each request's rid with its own object, its slot, its
    # batches; the tokens sent add up to its prompt, in page counts that fit them
    events, reqs = tr.events, {r.rid: r for r in s.requests}
    assert {e["ev"] for e in events} == set(tr.declared)  # every declared event was logged here
    objs, page = {}, s.scheduler.cfg.page_size
    for e in events:
        if "rid" in e:  # the AttentionStore's events name the request by rid alone
            assert e["rid"] in reqs, e
        if "obj" in e:
            assert objs.setdefault(e["rid"], e["obj"]) == e["obj"], e
        if e["ev"] in ("alloc", "release"):
            assert isinstance(e["slot"], int), e
        if e["ev"] in ("kv_send", "prefix_send") and "tokens" in e:
            assert 0 <= e["pages"] <= -(-e["tokens"] // page) + 1, e
    assert len(set(objs.values())) == len(reqs) == 12
    for rid, r in reqs.items():
        sent = sum(
            e.get("tokens", 0)
            for e in events
            if e["ev"] in ("kv_send", "prefix_send") and e["rid"] == rid
        )
        assert sent == len(r.prompt)
    assert [e["batch"] for e in events if e["ev"] == "admit"] == list(range(s.summary["batches"]))
