"""SGLang 0.5.23's PD prefill loops under the adapter's hooks (engine/sglang/prefill.py), driven by the
CPU scenarios of engine/sglang/conform/prefill_scenarios.py and judged by the checker.

Each scenario's trace fails exactly the rules prefill_scenarios.DIVERGENCES lists for it (SGLang
against the spec, analysed there), and nothing else; the mutant of SGLang's real overlap loop is
reported; the hooks change none of the calls SGLang makes. SGLang is imported once for the module.
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys

import pytest

from engine import sglang as adapter

try:
    adapter.check_version()
except adapter.SGLangUnavailable as e:
    pytest.skip(f"SGLang unavailable: {e}", allow_module_level=True)

from checker.linear import check_file  # noqa: E402
from engine.sglang import mutate  # noqa: E402
from engine.sglang.conform import mutants, prefill_run, prefill_scenarios, prefill_scheduler  # noqa: E402
from spec import load_rules  # noqa: E402

NAMES = [name for name, _ in prefill_scenarios.scenarios()]
PDO = os.path.join(os.path.dirname(sys.executable), "pdo")


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sglang-prefill"))


@pytest.fixture(scope="module")
def runs(trace_dir):
    return {name: run(trace_dir) for name, run in prefill_scenarios.scenarios()}


def _failing(path: str) -> set[str]:
    return {v.rule.id for v in check_file(path).violations}


def _events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f][1:]


@pytest.mark.parametrize("name", NAMES)
def test_scenario_fails_only_its_documented_divergences(runs, name):
    out = runs[name]
    assert _failing(out["trace"]) == set(prefill_scenarios.DIVERGENCES.get(name, {}))
    # the run finished its work: every request's output went to the detokenizer, nothing is held
    w, _ = prefill_scenarios.SCENARIOS[name]
    assert sorted(out["outputs"]) == sorted(a.rid for a in w.arrivals)
    assert out["leaks"] == {"req_slots_in_use": 0, "inflight": 0, "waiting": 0, "chunked": False}


def test_pdo_check_exit_codes_and_json(runs):
    for name, out in runs.items():
        r = subprocess.run([PDO, "check", "--json", out["trace"]], capture_output=True, text=True)
        expected = set(prefill_scenarios.DIVERGENCES.get(name, {}))
        assert r.returncode == (1 if expected else 0), (name, r.stdout[-2000:], r.stderr[-2000:])
        (result,) = json.loads(r.stdout)
        assert result["header"]["mode"] == prefill_scenarios.SCENARIOS[name][0].mode
        assert {v["rule"] for v in result["violations"]} == expected


def test_every_divergence_names_a_rule_of_its_scenarios_mode():
    by_id = {r.id: r for r in load_rules() if r.role == "prefill"}
    for name, rules in prefill_scenarios.DIVERGENCES.items():
        mode = prefill_scenarios.SCENARIOS[name][0].mode
        for rule_id, why in rules.items():
            assert by_id[rule_id].applies(mode) and why


def test_mutant_of_the_real_overlap_loop_is_reported(runs, trace_dir):
    assert not _failing(
        runs["prefill-no-early-send/overlap"]["trace"]
    )  # the mutants' base conforms
    for name, mutant in mutants.PREFILL_MUTANTS.items():
        out = mutant.run(trace_dir)
        failing = _failing(out["trace"])
        assert set(out["expect"]) <= failing, (name, failing)
        if name == "prefill-sample-before-process":
            assert "P-overlap-process-prev" in failing
    # the mutation lasts only for its run: SGLang's loop is its own again
    loop = prefill_scheduler.sglang().prefill.SchedulerDisaggregationPrefillMixin.__dict__[
        "event_loop_overlap_disagg_prefill"
    ]
    assert not hasattr(mutate.inspect.unwrap(loop), "__pdo_mutant_of__")


@pytest.mark.parametrize("name", NAMES)
def test_hooks_change_no_call_sglang_makes(runs, name):
    w, _ = prefill_scenarios.SCENARIOS[name]
    plain = prefill_run.run_workload(w, None)
    assert plain["calls"] == runs[name]["calls"]
    assert plain["outputs"] == runs[name]["outputs"]


@pytest.mark.parametrize(
    "name,seed",
    [
        ("prefill-chunked/normal", 3),
        ("prefill-polling/overlap", 1),
        ("prefill-polling/overlap", 2),
        ("prefill-coarse-barrier/overlap", 3),
    ],
)
def test_fuzzed_schedules_fail_the_same_rules(trace_dir, name, seed):
    run = dict(prefill_scenarios.scenarios())[name]
    out = run(os.path.join(trace_dir, f"seed{seed}"), fuzz_schedule=seed)
    assert _failing(out["trace"]) == set(prefill_scenarios.DIVERGENCES.get(name, {}))
    assert (
        prefill_run.run_workload(prefill_scenarios.SCENARIOS[name][0], None, seed)["calls"]
        == out["calls"]
    )


def test_real_functions_the_hooks_saw(runs):
    ran = set(runs["prefill-chunked/overlap"]["functions"])
    for fn in (
        "disaggregation.prefill.SchedulerDisaggregationPrefillMixin.event_loop_overlap_disagg_prefill",
        "disaggregation.prefill.SchedulerDisaggregationPrefillMixin.get_next_disagg_prefill_batch_to_run",
        "disaggregation.prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk",
        "managers.scheduler.Scheduler.run_batch",
        "managers.scheduler.Scheduler._apply_war_barrier",
        "managers.scheduler.Scheduler.launch_batch_sample_if_needed",
        "managers.scheduler.Scheduler.process_batch_result",
        "managers.schedule_batch.ScheduleBatch.copy",
        "mem_cache.memory_pool.ReqToTokenPool.alloc",
        "mem_cache.memory_pool.ReqToTokenPool.free",
        "disaggregation.fake.conn.FakeKVSender.send",
    ):
        assert "sglang.srt." + fn in ran
    assert any(
        f.endswith("event_loop_normal_disagg_prefill")
        for f in runs["prefill-chunked/normal"]["functions"]
    )
    assert any(
        f.endswith("maybe_send_cached_prefix_chunk")
        for f in runs["prefill-prefix-send/normal"]["functions"]
    )


def _seq(evs, ev, **match):
    return [e["seq"] for e in evs if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())]


def test_war_barrier_placement(runs):
    fine = _events(runs["prefill-chunked/overlap"]["trace"])
    coarse = _events(runs["prefill-coarse-barrier/overlap"]["trace"])
    for n in range(1, 5):
        # fine barrier: right after run_batch(N); coarse: after P(N-1), before S(N)
        assert _seq(fine, "war_barrier", batch=n)[0] == _seq(fine, "fwd_end", batch=n)[0] + 1
        assert (
            _seq(coarse, "process_end", batch=n - 1)[0]
            < _seq(coarse, "war_barrier", batch=n)[0]
            < _seq(coarse, "sample", batch=n)[0]
        )
    assert not _seq(_events(runs["prefill-chunked/normal"]["trace"]), "war_barrier")


def test_polling_admits_while_the_oldest_result_is_pending(runs):
    evs = _events(runs["prefill-polling/overlap"]["trace"])
    admits = {e["batch"]: e["seq"] for e in evs if e["ev"] == "admit"}
    # some batch N+1 is admitted and forwarded before P(N) begins, with the coarse barrier applied
    # while the loop waited on N's copy
    assert any(
        admits[n + 1] < _seq(evs, "process_begin", batch=n)[0] for n in admits if n + 1 in admits
    )


@pytest.mark.parametrize("name", NAMES)
def test_sends_cover_each_prompt_once_in_order(runs, name):
    # what SGLang hands the sender: consecutive ranges from token 0 to the prompt's end, each of
    # ceil(tokens / page_size) pages
    evs = _events(runs[name]["trace"])
    for a in prefill_scenarios.SCENARIOS[name][0].arrivals:
        sends = [e for e in evs if e["ev"] in ("kv_send", "prefix_send") and e["rid"] == a.rid]
        assert [e["start"] for e in sends] == [
            sum(e["tokens"] for e in sends[:i]) for i in range(len(sends))
        ]
        assert sum(e["tokens"] for e in sends) == a.length
        assert all(e["pages"] == math.ceil(e["tokens"] / 4) for e in sends)


def test_prefix_sends(runs):
    evs = _events(runs["prefill-prefix-send/normal"]["trace"])
    (p,) = [e for e in evs if e["ev"] == "prefix_send"]
    assert (p["rid"], p["start"], p["tokens"], p["pages"]) == ("r1", 0, 24, 6)  # the radix hit
    assert (
        _seq(evs, "fwd_begin", batch=p["batch"])[0]
        < p["seq"]
        < _seq(evs, "fwd_end", batch=p["batch"])[0]
    )
    # under the overlap loop, run_batch(1) sends the chunk batch 0 computed, before P(0)
    evs = _events(runs["prefill-chunked/overlap"]["trace"])
    first = [e for e in evs if e["ev"] == "prefix_send"][0]
    assert (first["batch"], first["rid"], first["start"], first["tokens"]) == (1, "r0", 0, 16)
    assert first["seq"] < _seq(evs, "process_begin", batch=0)[0]
    assert not [
        e
        for e in _events(runs["prefill-no-early-send/overlap"]["trace"])
        if e["ev"] == "prefix_send"
    ]
    assert (
        max(e["value"] for e in evs if e["ev"] == "chunk_inc") == 2
    )  # two middle chunks in flight


def test_batch_copies_keep_their_batch_id(runs):
    evs = _events(runs["prefill-chunked/overlap"]["trace"])
    admitted = sorted(e["batch"] for e in evs if e["ev"] == "admit")
    assert admitted == list(range(len(admitted)))
    assert sorted(e["batch"] for e in evs if e["ev"] == "process_begin") == admitted


# ---- the mutation helper (engine/sglang/mutate.py) -------------------------------------------------
def _toy(x):
    a = x + 1
    b = a * 2
    return a, b


def test_mutated_moves_a_statement_and_keeps_the_original():
    new = mutate.mutated(_toy, mutate.MoveStatement("b = a * 2", "a = x + 1"))
    with pytest.raises(NameError):  # b's line now runs before a exists: the move is real
        new(1)
    assert _toy(1) == (2, 4)
    assert new.__pdo_mutant_of__ is _toy and new.__code__.co_filename == _toy.__code__.co_filename


def test_mutated_keeps_closures_and_super():
    k = 10

    class Base:
        def f(self):
            return 1

    class Child(Base):
        def f(self):
            y = super().f()
            z = y + k
            return y, z

    class One(ast.NodeTransformer):
        def visit_Constant(self, node):
            return ast.Constant(5) if node.value == 1 else node

    class Minus(ast.NodeTransformer):
        def visit_BinOp(self, node):
            return ast.BinOp(left=node.left, op=ast.Sub(), right=node.right)

    assert Child().f() == (1, 11)
    with mutate.mutation(Base, "f", One()):
        assert Child().f() == (5, 15)  # Child's super() reaches the mutant
    assert Child().f() == (1, 11)
    # the mutant of Child.f closes over `k` and over the `__class__` cell its super() needs
    assert mutate.mutated(Child.f, Minus())(Child()) == (1, -9)


def test_mutation_errors_and_swap_restores():
    with pytest.raises(mutate.MutationError):
        mutate.mutated(_toy, mutate.MoveStatement("no such line", "a = x + 1"))

    class C:
        pass

    with mutate.swapped(C, "g", 3):
        assert C.g == 3
    assert not hasattr(C, "g")
