"""One vocabulary (spec/vocabulary.py): every loop mode has a loop in the engine and in both models,
and every event the engine logs has the fields of spec/events.toml, in its order."""

from __future__ import annotations

import json

import pytest

from engine.decode import loops as decode_loops
from engine.decode.config import DecodeConfig
from engine.prefill import loops as prefill_loops
from engine.runs.pd import run_pd
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from spec import abstract
from spec.errors import BadInput
from spec.vocabulary import DECODE_LOOPS, PREFILL_LOOPS, events, load
from spec.z3model import prefill_loops as z3_prefill_loops

pytestmark = pytest.mark.usefixtures("refined")

# Written by every event line (docs/trace-format.md), and `vc` with happens-before clocks on.
COMMON = ("seq", "t_ns", "thread", "ev")


def test_every_loop_mode_has_a_loop_in_the_engine_and_the_models():
    """The loops are written three times (engine, abstract model, z3 model): each names every mode
    of the vocabulary, and no other (docs/architecture.md, "Changing a loop")."""
    described = (prefill_loops.LOOPS, abstract.LOOPS, z3_prefill_loops.ITERATIONS)
    assert [tuple(d) for d in described] == [PREFILL_LOOPS] * 3
    assert tuple(decode_loops.LOOPS) == DECODE_LOOPS


def assert_logged_in_spec_order(path: str, role: str) -> set[str]:
    """Each event of the trace at `path` has its required fields and only known ones, in the order
    of spec/events.toml; returns the events seen."""
    vocab, seen = events()[role], set()
    with open(path) as f:
        next(f)  # the header
        for line in f:
            e = json.loads(line)
            assert tuple(e)[:4] == COMMON, e
            spec = vocab[e["ev"]]
            names = [n for n in tuple(e)[4:] if n != "vc"]
            assert set(spec["fields"]) <= set(names), e
            assert names == [n for n in spec["order"] if n in names], e
            seen.add(e["ev"])
    return seen


def test_a_pd_run_logs_every_event_in_the_spec_order(tmp_path):
    """Prefill ranks with a forward thread and a decode with prefetch: the events of both roles,
    declared (Tracer.events_for) and emitted, as spec/events.toml orders their fields."""
    s = run_pd(
        RunSpec(
            EngineConfig(mode="ahead"),
            WorkloadConfig(requests=6, prompt_len=(20, 80), hit=0.6, max_new_tokens=3, seed=5),
            DecodeConfig(loop="overlap"),
            dp=2,
            trace_path=str(tmp_path / "t.jsonl"),
        )
    ).summary
    seen = {}
    for path in s["traces"]:
        with open(path) as f:
            role = json.loads(next(f))["role"]
        seen.setdefault(role, set()).update(assert_logged_in_spec_order(path, role))
    # the loops' ordering points, each logged at least once
    assert {"admit", "snapshot", "submit", "fwd_begin", "kv_send", "release"} <= seen["prefill"]
    assert {"resolve", "receiver_init", "kv_recv", "req_done", "process_end"} <= seen["decode"]


def test_an_optional_field_is_marked_and_keeps_its_place(tmp_path):
    resolve = events()["decode"]["resolve"]
    assert resolve["order"][:4] == ("addr", "rooms", "source", "qid")
    assert "rooms" in resolve["optional"] and "source" in resolve["fields"]
    bad = tmp_path / "events.toml"
    bad.write_text('[decode.resolve]\nwhere = "x"\nfields = "addr"\n')
    with pytest.raises(
        BadInput, match=r"events.toml: \[decode.resolve\]: 'fields' must be a table"
    ):
        load(bad)
