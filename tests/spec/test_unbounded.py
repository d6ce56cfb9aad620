"""The unbounded prover (spec/z3model/transition.py, unbounded.py): it agrees with the bounded
model's engine-alone answers for fixed K, it refutes a broken loop, and the table in docs/spec.md
(spec/unbounded_table.json) is the one it computes."""

from __future__ import annotations

import json
import os

import pytest

from spec.z3model import PROPERTIES, Model, neg
from spec.z3model.transition import System, _iteration, worker_slots
from spec.z3model.unbounded import TABLE, confirm, prove_mode, reach
from spec.z3model.unbounded_run import prove_everything

# The transition system restricted to K batches against the bounded model, where both are quick;
# PDO_SLOW=1 runs every mode for K = 2..6.
FAST = [("normal", 2, ()), ("thread", 3, ()), ("ahead", 3, ("two-forwards",))]
FULL = [(m, k, ()) for m in ("normal", "overlap", "thread", "ahead") for k in range(2, 7)] + [
    ("ahead", k, (mu,)) for k in range(2, 7) for mu in ("two-forwards", "no-war-barrier")
]
CASES = FULL if os.environ.get("PDO_SLOW") else FAST


def _bounded(mode, k, mutants):
    model = Model(mode, k, mutants=mutants)
    out = {}
    for p in PROPERTIES:
        if p.applies(mode):
            a = model.check(model.engine_ids, neg(p.formula(model.universe)))
            out[p.id] = {"sat": "REFUTED", "unsat": "PROVED"}.get(a.status, "UNKNOWN")
    return out


@pytest.mark.parametrize("mode,k,mutants", CASES)
def test_agrees_with_bounded_model(mode, k, mutants):
    bounded = _bounded(mode, k, mutants)
    for r in prove_mode(mode, mutants=mutants, batches=k):
        if r.how.startswith("assumes war-host"):  # not a verdict: its assumption was refuted
            assert bounded["war-host"] == "REFUTED"
            continue
        assert r.status == bounded[r.prop], (mode, k, mutants, r.prop, r.how)


def test_refutes_a_broken_loop():
    clean = {r.prop: r.status for r in prove_mode("ahead")}
    assert set(clean.values()) == {"PROVED"}
    no_war = {r.prop: r for r in prove_mode("ahead", mutants=("no-war-barrier",))}
    assert no_war["war-device"].status == "REFUTED"
    assert no_war["war-device"].trace[-1] == ("device", "dev_stage(1)")
    two = {r.prop: r for r in prove_mode("ahead", mutants=("two-forwards",))}
    assert two["war-host"].status == "REFUTED"
    assert two["sample-idle"].status == "REFUTED"
    events = [e for _, e in two["war-host"].trace]
    assert events[-1].startswith("stage(") and "war_barrier(0)" not in events


def test_reaches_a_fixed_point_within_the_domain():
    parent, bad, complete = reach(System("thread"), [])
    assert complete and "domain" not in bad and len(parent) > 100


def test_table_in_docs_is_current():
    """docs/spec.md shows spec/unbounded_table.json; its verdicts are what the prover says now,
    prefill and decode (regenerate with `python -m spec.z3model.unbounded_run`)."""
    table = json.loads(TABLE.read_text(encoding="utf-8"))
    now = [(r.prop, r.mode, r.status, r.how) for r in prove_everything()]
    assert [(r["property"], r["mode"], r["verdict"], r["how"]) for r in table["rows"]] == now


def test_z3_confirms_the_invariant():
    """z3, on the symbolic moves, agrees the searched set is inductive and has no bad move; with
    states left out it is not inductive."""
    system = System("normal")
    ids = ["one-forward", "war-host", "no-free-in-flight"]
    parent, _, _ = reach(system, ids)
    assert set(confirm(system, list(parent), ids).values()) == {"unsat"}
    some = [k for k in parent if k[0] < system.by_name[("M", True)].start]
    assert confirm(system, some, [])["inductive"] == "sat"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PDO_SLOW"), reason="PDO_SLOW=1: a 2,500-state query")
def test_z3_finds_the_bad_move_of_a_mutant():
    broken = System("ahead", ("no-war-barrier",))
    states, _, _ = reach(broken, ["war-device"])
    assert confirm(broken, list(states), ["war-device"])["war-device"] == "sat"


@pytest.mark.parametrize("mode", ["normal", "overlap", "thread", "ahead"])
def test_segments_repeat(mode):
    """The premise of the finite state: an iteration of batch N >= 2 (and a last batch N >= 2,
    and the worker's iteration) reads the same, relative to N, whatever N and K are."""
    for steady in (False, True):
        assert _iteration(mode, 4, 2, steady, ()) == _iteration(mode, 6, 4, steady, ())
        assert _iteration(mode, 3, 2, steady, ()) == _iteration(mode, 6, 5, steady, ())
    if mode in ("thread", "ahead"):
        assert worker_slots(mode, (), 1) == worker_slots(mode, (), 3)


def test_cli_exit_codes_and_json(capsys):
    from engine.cli import main as pdo
    from engine.cli.exits import FAILED, OK

    argv = ["spec", "prove", "--unbounded", "--role", "prefill", "--mode", "normal", "--json"]
    assert pdo(argv) == OK
    data = json.loads(capsys.readouterr().out)
    assert {r["verdict"] for r in data["results"]} == {"PROVED"} and len(data["results"]) == 7
    argv = ["spec", "prove", "--unbounded", "--role", "prefill", "--mode", "ahead"]
    argv += ["--inject", "no-war-barrier"]
    assert pdo(argv) == FAILED
    assert "REFUTED" in capsys.readouterr().out
