"""The flight recorder's log (engine/trace/recorder.py, spec/tracelog.py): the fields it stores as
integers are those the spec types as integers, a log longer than a segment reads back whole, and
values of every kind read back as JSON would hold them."""

from __future__ import annotations

import enum
import gc
import json
import threading
import weakref

import pytest

from engine.sync import hb
from engine.trace.tracer import Tracer
from spec import load_events, tracelog


def test_the_int_and_json_fields_are_those_the_spec_types_so():
    types: dict[str, set[str]] = {}
    for events in load_events().values():
        for spec in events.values():
            for name, t in {**spec["fields"], **spec.get("optional", {})}.items():
                types.setdefault(name, set()).add(t)
    assert tracelog.INT_FIELDS == {name for name, ts in types.items() if ts == {"int"}}
    nested = {name for name, ts in types.items() if any(t[:4] in ("list", "obje") for t in ts)}
    assert tracelog.JSON_FIELDS == nested


class _Color(enum.Enum):
    RED = "red"


def test_values_of_every_kind_read_back_and_the_log_grows_past_a_segment(tmp_path):
    tr = Tracer({"role": "prefill"})
    path = tmp_path / "t.jsonl"
    tr.stream(str(path))
    log = tr.events_for(stage=("batch",), odd=("batch", "error", "rids"))
    n = tracelog.SEGMENT_SLOTS + 100
    for b in range(n):
        log.stage(b)
    values = [
        (None, None, ["a", "b"]),  # None in an int field: the general way
        (2**70, "boom", []),  # an int over 64 bits
        (True, _Color.RED, {"x": 1.5}),  # a bool where an int goes, an enum, a dict
        (-(2**63), "\ud800", ("t",)),  # the least int, a lone surrogate
    ]
    for v in values:
        log.odd(*v)
    tr.close()
    got = [e for e in tr.events if e["ev"] == "odd"]
    assert [e["batch"] for e in tr.events[:n]] == list(range(n))
    assert [(e["batch"], e["error"], e["rids"]) for e in got] == [
        (None, None, ["a", "b"]),
        (2**70, "boom", []),
        (1, "red", {"x": 1.5}),  # a bool in an int field reads as its int: the spec has none
        (-(2**63), "\ud800", ["t"]),
    ]
    assert path.read_bytes().count(b"\n") == n + len(values) + 2


def test_a_dropped_tracer_frees_its_log_and_logs_no_more_hand_offs():
    """No cycle keeps a recorder alive (the fuzz harness makes a tracer per schedule): once its
    tracer and loggers are dropped, its memory goes and the hand-offs stop reaching it."""
    gc.disable()  # what is freed here is freed without the collector
    try:
        tr = Tracer({"role": "prefill"})
        log = tr.events_for(admit=("batch", "rids"), alloc=("rid", "obj", "slot"))
        log.admit(0, ["r1"])
        log.alloc("r1", object(), 0)
        tr.emit("x.note", stacks={"a": [1]})
        gone, edge = weakref.ref(tr.rec), tr.rec.hand_offs
        assert edge in hb._sinks
        del tr, log
        assert gone() is None
        assert edge not in hb._sinks
    finally:
        gc.enable()


def test_a_trace_closed_by_a_thread_with_a_short_name_ends_whole(tmp_path):
    """END's thread field is 32 bits: the closing thread's name is a definition, never an inline
    string (under the fuzz controller a PD run's role is closed by its thread "decode")."""
    path = tmp_path / "t.jsonl"
    tr = Tracer({"role": "decode"})
    tr.stream(str(path))
    tr.emit("x.note")
    t = threading.Thread(target=tr.close, name="decode")
    t.start()
    t.join()
    end = json.loads(path.read_text().splitlines()[-1])
    assert end["ev"] == "trace_end" and end["reason"] == "normal" and end["thread"] == "decode"


def test_field_names_no_parameter_may_have_are_logged_as_one_value():
    """Field names a generated log call cannot take as parameters (a leading underscore, a keyword,
    not an identifier), or more than an event record holds, are logged as one JSON value (layout
    "*") and read back as given; `emit("x", _a=1)` used to recurse between emit and logger."""
    tr = Tracer({"role": "prefill"})
    many = {f"f{i}": i for i in range(tracelog.MAX_FIELDS + 1)}
    given = [{"_a": 1}, {"class": "x"}, {"a-b": [1, 2]}, many]
    for fields in given:
        tr.emit("x.odd", **fields)
    assert [fields for ev, fields in tr.names_and_fields()] == given
    log = tr.events_for(odd=("_a", "b"))
    log.odd(1, None)
    assert tr.names_and_fields(len(given)) == [("odd", {"_a": 1, "b": None})]


def test_a_log_past_its_bound_logs_nothing_more_and_its_trace_reads_truncated(
    tmp_path, monkeypatch, capsys
):
    """Memory and disk are bounded (PDO_TRACE_MAX_MB): past the bound nothing more is logged, not
    even the END record, so the trace is not whole and `pdo check` never passes it (exit 3)."""
    from engine.cli import main as pdo

    monkeypatch.setenv("PDO_TRACE_MAX_MB", "1")  # 768 KiB: two segments, 8,191 records
    path = tmp_path / "t.jsonl"
    assert pdo(["run", "--requests", "800", "--no-verify", "--trace", str(path)]) == 0
    assert "the trace log is full (768 KiB" in capsys.readouterr().err
    lines = path.read_text().splitlines()
    assert 2000 < len(lines) < 2 * tracelog.SEGMENT_SLOTS and '"trace_end"' not in lines[-1]
    assert pdo(["check", str(path)]) == 3
    assert "truncated" in capsys.readouterr().out


def test_a_bad_bound_is_bad_input(monkeypatch):
    from spec.errors import BadInput

    monkeypatch.setenv("PDO_TRACE_MAX_MB", "0")
    with pytest.raises(BadInput, match="PDO_TRACE_MAX_MB"):
        Tracer({"role": "prefill"}).obj(1)
