"""The formal model (spec/z3model/, spec/abstract.py): the design's tables computed by z3, the safety
properties proved with minimal rule sets, the loop model checked against the rules, the executable
model against both checkers and the loop model, budgets reported as UNKNOWN, docs/spec.md current.

PDO_SLOW=1 raises the number of generated schedules."""

from __future__ import annotations

import json
import os
import random

import pytest
import z3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checker.linear import check_file
from engine.cli import main as pdo
from spec import abstract, docgen
from spec import z3model as zm
from spec.z3model import as_z3

SLOW = os.environ.get("PDO_SLOW") == "1"
K = 3

# The design's four-mode table (../shared/seeds/README.md, §1): where run_batch runs, whether admission
# of the next batch can overlap a run_batch that has not returned, and the result-processing order.
SEED_TABLE = {
    "normal": ("scheduler", False, "run(N) → process(N)"),
    "overlap": ("scheduler", False, "run(N) → process(N-1) → sample(N)"),
    "thread": ("worker", False, "keeps the old pipeline order"),
    "ahead": ("worker", True, "build(N) → collect/sample(N-1) → submit(N) → process(N-1)"),
}
SEED_STEADY = [  # (scheduler step begins with, worker) — seed, AHEAD steady state, steps 1-7
    ("process_batch_result(N-1)", "run_batch(N)"),
    ("build batch N+1", "still run_batch(N)"),
    ("collect(N)", "returns result and batch copy, then idle"),
    ("sample(N)", "idle"),
    ("submit(N+1)", "starts run_batch(N+1)"),
    ("process_batch_result(N)", "run_batch(N+1)"),
    ("build batch N+2", "still run_batch(N+1)"),
]


@pytest.fixture(scope="module")
def models():
    return {mode: zm.Model(mode, K) for mode in zm.MODES}


# ---- the design's tables ------------------------------------------------------------------------------


def test_mode_table_equals_the_seed():
    table, differ = zm.mode_table(K)
    assert not any(differ.values()), f"rules and engine model disagree: {differ}"
    for mode, (where, overlaps, order) in SEED_TABLE.items():
        row = table["modes"][mode]
        assert row["run_batch_on"] == where
        assert row["admission_overlaps_unreturned_run_batch"] is overlaps
        assert row["processing_order"].startswith(order), row["processing_order"]
    # "keeps the old pipeline order": the thread loop's order is the overlap loop's
    assert table["modes"]["thread"]["processing_order"].endswith(
        table["modes"]["overlap"]["processing_order"]
    )


def test_table_json_cli(capsys):
    assert pdo(["spec", "table", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) == {"modes"} and set(got["modes"]) == set(zm.MODES)
    for row in got["modes"].values():
        assert row["run_batch_on"] in ("scheduler", "worker")
        assert isinstance(row["admission_overlaps_unreturned_run_batch"], bool)
        assert isinstance(row["processing_order"], str)


def test_ahead_steady_state_equals_the_seed():
    rows, answer = zm.ahead_steady_table()
    assert answer.status == "sat"
    assert [(i, w) for i, _, w in rows] == [(i + 1, w) for i, (_, w) in enumerate(SEED_STEADY)]
    for (_, sched, _), (want, _) in zip(rows, SEED_STEADY):
        assert sched.startswith(want), (sched, want)


def test_table_cli_prints_times(capsys):
    assert pdo(["spec", "table"]) == 0
    out = capsys.readouterr().out
    assert out.count(" s\n") > 40 and "| thread loop, AHEAD on | worker | yes |" in out


# ---- proofs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", zm.MODES)
def test_vacuity_and_conformance(models, mode):
    M = models[mode]
    rules_sat, both_sat, overlap = zm.vacuity(M)
    assert rules_sat.status == "sat" and both_sat.status == "sat"
    # the intended overlap: possible in ahead, impossible in the other modes
    assert overlap.status == ("sat" if mode == "ahead" else "unsat")
    bad = [(q.what, q.status) for q in zm.conformance(M) if q.status != "unsat"]
    assert not bad, f"the loop model of {mode} violates {bad}"


@pytest.mark.parametrize("mode", zm.MODES)
def test_properties_proved_with_minimal_sets(models, mode):
    M = models[mode]
    for p in zm.PROPERTIES:
        if not p.applies(mode):
            continue
        pr = zm.prove(M, p)
        assert pr.status == "PROVED" and pr.engine == "PROVED", (p.id, pr.status, pr.note)
        # the device-side WAR property needs the stream semantics; in normal mode the rules require no
        # WAR barrier (SGLang's normal loop applies none: P-complete-barrier), so that its processing
        # follows the barrier is the engine's doing; everything else follows from rules
        needs_engine = p.id == "war-device" or (
            mode == "normal" and p.id in ("process-after-forward", "war-host")
        )
        assert pr.basis == ("engine+rules" if needs_engine else "rules"), (p.id, pr.basis)
        if p.id == "war-device":
            assert "E:streams" in pr.core
            # normal: no rule requires the barrier, so the barrier rule or the engine's own program order
            # carries it (two minimal sets; which one deletion finds depends on the solver's state)
            carriers = (
                {"P-war-before-next-stage", "E:program-order"}
                if mode == "normal"
                else {"P-war-before-next-stage"}
            )
            assert carriers & set(pr.core), pr.core
        # minimal: without any one member, z3 finds a counterexample
        bad = zm.neg(p.formula(M.universe))
        for name in pr.core:
            rest = [x for x in pr.core if x != name]
            assert M.check(rest, bad).status == "sat", f"{p.id}/{mode}: {name} is not needed"


def test_dropping_a_rule_gives_a_counterexample(capsys):
    from spec.cli import prove_mode

    one_forward = next(p for p in zm.PROPERTIES if p.id == "one-forward")
    # In the thread modes P-one-forward is redundant: the worker runs only what was submitted, and a
    # submit waits for the previous collect, which waits for the worker's copy after its forward.
    pr = zm.prove(zm.Model("ahead", K, drop=["P-one-forward"]), one_forward, basis="rules")
    assert pr.status == "PROVED" and {"P-worker-runs-submitted", "P-worker-copy"} <= set(pr.core), (
        pr.core
    )
    drop = ["P-one-forward", "P-worker-runs-submitted"]
    lines = []
    counts = prove_mode(
        "ahead", K, basis="rules", drop=drop, props=["one-forward"], say=lines.append
    )
    assert counts["REFUTED"] == 1
    text = "\n".join(lines)
    assert "counterexample" in text and "| fwd_begin(" in text  # a two-lane timeline
    M = zm.Model("ahead", K, drop=drop)
    pr = zm.prove(M, one_forward, basis="rules")
    assert pr.status == "REFUTED"
    sched = M.schedule(pr.counterexample)
    depth, worst = 0, 0  # the counterexample really has two run_batch spans open at once
    for e in sched:
        depth += {"fwd_begin": 1, "fwd_end": -1}.get(e.name, 0)
        worst = max(worst, depth)
    assert worst >= 2


@pytest.mark.parametrize(
    "mutant,prop,rules",
    [
        ("two-forwards", "war-device", {"P-queue-capacity", "P-war-before-next-stage"}),
        ("no-war-barrier", "war-device", set()),
        ("sample-before-collect", "sample-idle", {"P-sample-idle", "P-collect-before-sample"}),
        ("prefix-send-on-worker", None, {"P-prefix-send-ahead"}),
    ],
)
def test_loop_mutants(mutant, prop, rules):
    """A mutated loop model: the engine alone no longer proves the property, and it violates the rules."""
    M = zm.Model("ahead", K, mutants=[mutant])
    if prop:
        pr = zm.prove(M, next(p for p in zm.PROPERTIES if p.id == prop))
        assert pr.engine == "REFUTED"
    violated = {q.what for q in zm.conformance(M) if q.status == "sat"}
    assert rules <= violated, violated


def test_budget_is_unknown_never_proved(capsys):
    M = zm.Model("ahead", K, rlimit=1000)
    pr = zm.prove(M, zm.PROPERTIES[0])
    assert pr.status == "UNKNOWN"
    assert pdo(["spec", "prove", "--mode", "normal", "--batches", "2", "--timeout", "0.001"]) == 3
    assert "UNKNOWN" in capsys.readouterr().out


def test_prove_cli_small(capsys):
    assert pdo(["spec", "prove", "--mode", "normal", "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "PROVED" in out and "0 refuted" in out and " s  " in out


# ---- the decode prefetch: loop model, rules, properties ----------------------------------------------

KD = 4  # decode iterations: a prefetch consumed in a later iteration than its submit needs 4


@pytest.fixture(scope="module")
def decode_models():
    return {mode: zm.Model(mode, KD, role="decode") for mode in zm.DECODE_MODES}


@pytest.mark.parametrize("mode", zm.DECODE_MODES)
def test_decode_loop_model_vacuity_and_conformance(decode_models, mode):
    """The loop model of the prefetch satisfies every decode rule; with the rules it admits schedules
    that use a prefetched answer, also iterations after its submit, and every way a prefetched query
    ends; it does nothing the universe has no events for."""
    M = decode_models[mode]
    both = M.rule_ids + M.engine_ids
    assert M.check(M.rule_ids).status == "sat" and M.check(both).status == "sat"
    assert M.check(both, zm.prefetch_used(M.universe)).status == "sat"
    assert M.check(both, zm.prefetch_used_later(M.universe)).status == "sat"
    assert set(M.universe.ends) == {
        "used as is",
        "used as a prefix with a sync tail",
        "cancelled as stale",
        "cancelled at release_memory",
        "cancelled with nothing pending",
        "cancelled on a room mismatch (sync query instead)",
    }
    for how, c in M.universe.ends.items():
        assert M.check(both, zm.disj(*c)).status == "sat", how
    assert M.check(*zm.outside_universe(M)).status == "unsat"
    bad = [(q.what, q.status) for q in zm.conformance(M) if q.status != "unsat"]
    assert not bad, f"the decode loop model violates {bad}"
    assert not M.not_encoded


def test_decode_later_consumption_needs_four_iterations():
    M = zm.Model("normal", 3, role="decode")
    assert M.check(M.rule_ids + M.engine_ids, zm.prefetch_used(M.universe)).status == "sat"
    assert M.check(M.rule_ids + M.engine_ids, zm.prefetch_used_later(M.universe)).status == "unsat"


@pytest.mark.parametrize("mode", zm.DECODE_MODES)
def test_decode_properties_proved_with_minimal_sets(decode_models, mode):
    """Each decode property: PROVED from the rules (the server's answer from E:server), the loop model
    alone proves it too, and the set is minimal: without any member z3 finds a counterexample."""
    M = decode_models[mode]
    want = {
        "room-init-server-rank": ("engine+rules", {"D-init-once", "E:server"}),
        "one-query-per-address": ("rules", {"D-one-query-per-addr"}),
        "nothing-after-release": ("rules", {"D-one-query-per-addr", "D-release-cancels"}),
    }
    for p in zm.DECODE_PROPERTIES:
        pr = zm.prove(M, p)
        assert pr.status == "PROVED" and pr.engine == "PROVED", (
            p.id,
            pr.status,
            pr.engine,
            pr.note,
        )
        assert (pr.basis, set(pr.core)) == want[p.id], (p.id, pr.basis, pr.core)
        bad = zm.neg(p.formula(M.universe))
        for name in pr.core:
            assert M.check([x for x in pr.core if x != name], bad).status == "sat", (p.id, name)


@pytest.mark.parametrize(
    "rule,prop",
    [
        ("D-release-cancels", "nothing-after-release"),
        ("D-one-query-per-addr", "one-query-per-address"),
        ("D-init-once", "room-init-server-rank"),
    ],
)
def test_decode_dropping_a_rule_gives_a_counterexample(rule, prop):
    from spec.cli import prove_mode

    lines = []
    counts = prove_mode(
        "overlap", KD, basis="rules", drop=[rule], props=[prop], say=lines.append, role="decode"
    )
    assert counts["REFUTED"] == 1
    text = "\n".join(lines)
    assert "counterexample" in text and "| prefetch_0" in text  # a two-lane timeline
    M = zm.Model("overlap", KD, role="decode", drop=[rule])
    p = next(p for p in zm.DECODE_PROPERTIES if p.id == prop)
    pr = zm.prove(M, p, basis="rules")
    assert pr.status == "REFUTED"
    assert not z3.is_true(
        pr.counterexample.eval(as_z3(p.formula(M.universe)), model_completion=True)
    )
    assert zm.prove(M, p, basis="engine").status == "PROVED"  # the loop model still has it


@pytest.mark.parametrize("mode", zm.DECODE_MODES)
def test_decode_loop_schedules_pass_both_checkers(decode_models, mode, tmp_path):
    """Schedules of the decode loop model, written as traces: each passes the linear and the z3 checker."""
    from checker import z3check

    M = decode_models[mode]
    wants = [True, zm.prefetch_used_later(M.universe)] + [
        zm.disj(*c) for c in M.universe.ends.values()
    ]
    for n, extra in enumerate(wants):
        a = M.check(M.engine_ids, extra)
        assert a.status == "sat"
        header, events = M.to_trace(a.model)
        path = abstract.write_trace(tmp_path / f"d{n}.jsonl", header, events)
        r = check_file(path)
        assert r.ok, [(v.rule.id, v.message) for v in r.violations]
        assert z3check.check_file(path).ok


# ---- the loop model, the abstract model and the checkers --------------------------------------------


@pytest.mark.parametrize("mode", zm.MODES)
def test_z3_schedules_pass_the_linear_checker(models, mode, tmp_path):
    """A schedule z3 finds for the loop model alone, and one for loop ∧ rules, written as a trace."""
    M = models[mode]
    for use in (M.engine_ids, M.engine_ids + M.rule_ids):
        a = M.check(use)
        assert a.status == "sat"
        header, events = M.to_trace(a.model)
        r = check_file(abstract.write_trace(tmp_path / "w.jsonl", header, events))
        assert r.ok, [(v.rule.id, v.message) for v in r.violations]


@settings(
    max_examples=200 if SLOW else 40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(mode=st.sampled_from(zm.MODES), seed=st.integers(0, 2**32 - 1))
def test_abstract_schedules_pass_the_linear_checker(mode, seed, tmp_path_factory):
    header, events = abstract.run(mode, random.Random(seed))
    kinds = {e["ev"] for e in events}
    assert {"admit", "fwd_begin", "process_end", "release"} <= kinds
    path = abstract.write_trace(tmp_path_factory.mktemp("a") / "t.jsonl", header, events)
    r = check_file(path)
    assert r.ok, [(v.rule.id, v.message) for v in r.violations]


@settings(
    max_examples=40 if SLOW else 8, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(mode=st.sampled_from(zm.MODES), seed=st.integers(0, 2**32 - 1))
def test_abstract_schedules_are_loop_model_schedules(mode, seed):
    header, events = abstract.run(mode, random.Random(seed), abstract.Config(requests=4))
    a = zm.fits_engine(mode, header, events)
    assert a.status == "sat", f"{mode}: the loop model does not admit this schedule ({a.reason})"


def test_abstract_model_covers_drains_idle_iterations_and_overlap():
    """Over a few seeds the abstract model produces the interesting shapes: an admission inside a
    run_batch (ahead), a pipeline drain, slot reuse, a request allocated before the batch admitting it."""
    seen = set()
    for seed in range(30):
        _, ev = abstract.run("ahead", random.Random(seed))
        pos = {(e["ev"], e.get("batch")): e["seq"] for e in ev if "batch" in e}
        n = max(e["batch"] for e in ev if e["ev"] == "admit")
        for b in range(n):
            if pos[("fwd_begin", b)] < pos[("admit", b + 1)] < pos[("fwd_end", b)]:
                seen.add("admit inside run_batch")
            if pos[("process_end", b)] < pos[("admit", b + 1)]:
                seen.add("drain")
        slots = [e["slot"] for e in ev if e["ev"] == "alloc"]
        if len(slots) != len(set(slots)):
            seen.add("slot reuse")
        for i, e in enumerate(ev):
            if e["ev"] == "alloc" and not any(
                x["ev"] == "admit" and e["rid"] in x["rids"] for x in ev[i : i + 3]
            ):
                seen.add("alloc ahead of admission")
    assert seen == {"admit inside run_batch", "drain", "slot reuse", "alloc ahead of admission"}, (
        seen
    )


def test_docs_are_generated_from_spec(tmp_path):
    """Generated in a fresh process, as `pdo spec docs` does: where a property has two minimal rule sets,
    which one deletion finds depends on the solver's state, and this worker's z3 context has run other
    tests' queries."""
    import subprocess
    import sys

    out = tmp_path / "spec.md"
    subprocess.run(
        [sys.executable, "-m", "spec.cli", "spec", "docs", "--out", str(out)],
        check=True,
        capture_output=True,
        cwd=docgen.DEFAULT.parent.parent,
    )
    with open(docgen.DEFAULT, encoding="utf-8") as f:
        committed = f.read()
    fresh = out.read_text(encoding="utf-8")
    if committed != fresh:
        import difflib

        diff = "".join(
            difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True), n=0)
        )
        pytest.fail(f"docs/spec.md is stale: run `pdo spec docs`\n{diff[:3000]}")


@pytest.mark.parametrize("mode", zm.MODES)
def test_docs_example_schedules_are_valid(mode, tmp_path):
    header, events = docgen.example(mode)
    assert check_file(abstract.write_trace(tmp_path / "e.jsonl", header, events)).ok
    assert zm.fits_engine(mode, header, events).status == "sat"
