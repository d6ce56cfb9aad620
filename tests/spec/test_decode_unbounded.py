"""The unbounded prover of the decode prefetch loop (spec/z3model/decode_transition.py,
decode_unbounded.py): restricted to K iterations it gives the bounded decode model's engine-alone
answers, it refutes the loop-model mutants with a printed schedule, its iteration reads alike for
every i >= CANON, and z3 confirms its invariant."""

from __future__ import annotations

import os

import pytest

from spec.z3model import DECODE_PROPERTIES, DecodeWorkload, Model, neg
from spec.z3model.decode_transition import CANON, Step
from spec.z3model.decode_unbounded import PROPS, confirm, prove_variant, reach


class _NoPrefetch(DecodeWorkload):
    prefetching = False


# where both are quick; PDO_SLOW=1: every variant and mutant for K = 2..6
FAST = [("prefetch", 4, ("double-prefetch",)), ("no-prefetch", 3, ())]
FULL = [
    (v, k, mu)
    for k in range(2, 7)
    for v, mu in (
        ("prefetch", ()),
        ("no-prefetch", ()),
        ("prefetch", ("double-prefetch",)),
        ("prefetch", ("no-cancel-on-release",)),
    )
]
CASES = FULL if os.environ.get("PDO_SLOW") else FAST


def _bounded(variant, k, mutants):
    workload = (DecodeWorkload if variant == "prefetch" else _NoPrefetch)(k, mutants=mutants)
    model = Model("normal", k, role="decode", workload=workload)
    out = {}
    for p in DECODE_PROPERTIES:
        a = model.check(model.engine_ids, neg(p.formula(model.universe)))
        out[p.id] = {"sat": "REFUTED", "unsat": "PROVED"}.get(a.status, "UNKNOWN")
    return out


@pytest.mark.parametrize("variant,k,mutants", CASES)
def test_agrees_with_bounded_model(variant, k, mutants):
    bounded = _bounded(variant, k, mutants)
    got = {r.prop: r.status for r in prove_variant(variant, mutants=mutants, iterations=k)}
    assert got == bounded, (variant, k, mutants)


def test_a_mutant_is_refuted_only_from_the_iteration_it_needs():
    """double-prefetch needs a second submit, in iteration 4 at the earliest (FIRST_SUBMIT + 1)."""
    three = {r.prop: r.status for r in prove_variant("prefetch", None, ("double-prefetch",), 3)}
    assert set(three.values()) == {"PROVED"}


def test_refutes_no_cancel_on_release_with_a_schedule(capsys):
    from engine.cli import main as pdo
    from engine.cli.exits import FAILED

    argv = ["spec", "prove", "--unbounded", "--role", "decode", "--inject", "no-cancel-on-release"]
    assert pdo(argv) == FAILED
    out = capsys.readouterr().out
    assert "REFUTED" in out and "nothing-after-release" in out
    lines = out[out.index("counterexample") :].splitlines()
    submit = next(n for n, x in enumerate(lines) if "prefetch_submit" in x)
    release = next(n for n, x in enumerate(lines) if "release_memory" in x)
    between = lines[submit:release]
    assert submit < release and not any("prefetch_cancel" in x for x in between)
    assert "5 proved, 1 refuted, 0 unknown" in out


def test_iterations_from_canon_read_alike():
    """The premise of the finite state: iteration i > CANON (on a universe of i iterations, its
    outstanding queries from i - 1) gives what iteration CANON gives from the same state."""
    step, big = Step(), Step(iterations=CANON + 2)
    layers, _, _ = reach(step, iterations=CANON + 1)
    states = [k for k in layers[-1] if dict(zip(step.names, k))["age"] == CANON]
    assert len(states) > 50
    for key in states[::5]:
        s = dict(zip(step.names, key))
        for e in step.choices(s)[::7]:
            s2, events, domain = step.run(s, e)
            s3, events3, domain3 = big.run(s, e, at=CANON + 2)
            assert s3 == s2 and [k[0] for k, c, _ in events if c is True] == [
                k[0] for k, c, _ in events3 if c is True
            ]
            assert any(d is True for d in domain) == any(d is True for d in domain3)


SMALL = (("127.0.0.1:8998", (1, 2)),)  # one address, two rooms: a quick z3 query


def test_z3_confirms_the_invariant():
    """z3, on the iteration built on z3 terms, agrees the searched set is inductive, stays in the
    domain and has no bad state; with states left out it is not inductive."""
    step = Step(rooms=SMALL)
    layers, exit_, complete = reach(step)
    assert complete and exit_ is None
    states = list(layers[0])
    assert set(confirm(step, states, PROPS).values()) == {"unsat"}
    age = step.names.index("age")
    assert confirm(step, [k for k in states if k[age] < CANON], [])["inductive"] == "sat"


def test_z3_finds_the_bad_state_of_a_mutant():
    step = Step(mutants=("double-prefetch",), rooms=SMALL)
    layers, _, _ = reach(step)
    got = confirm(step, list(layers[0]), PROPS)
    assert got["one-query-per-address"] == "sat" and got["inductive"] == "unsat"


def test_cli_confirm_prints_z3s_answer_and_fails_when_it_disagrees(capsys, monkeypatch):
    import json

    from engine.cli import main as pdo
    from engine.cli.exits import BAD_INPUT, INCOMPLETE, OK
    from spec.z3model import unbounded

    argv = ["spec", "prove", "--unbounded", "--role", "prefill", "--mode", "normal", "--confirm"]
    assert pdo(argv + ["--json"]) == OK
    data = json.loads(capsys.readouterr().out)
    assert [c["mode"] for c in data["confirm"]] == ["normal"] and data["confirm"][0]["agrees"]
    assert data["confirm"][0]["results"]["inductive"] == "unsat"
    # z3 finding a bad move the search did not: not a pass
    real = unbounded.confirm
    monkeypatch.setattr(unbounded, "confirm", lambda *a, **k: {**real(*a, **k), "war-host": "sat"})
    assert pdo(argv) == INCOMPLETE
    out = capsys.readouterr().out
    assert "NOT CONFIRMED" in out and "1 not confirmed by z3" in out
    assert pdo(["spec", "prove", "--confirm"]) == BAD_INPUT
