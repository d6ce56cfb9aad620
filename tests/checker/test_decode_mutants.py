"""Each decode mutant (engine/runtime/inject.py DECODE_MUTANTS) is caught by its rule, in a hand-written run that
makes the bug reachable; the same run without the mutant passes (tests/engine/runs/test_pd_faults.py covers the
clean runs). These are the minimal reproductions, over the real HTTP bootstrap server; schedule
fuzzing hunts the same mutants on drawn, controlled PD runs (tests/checker/fuzz/test_fuzz.py, `pdo fuzz --mutants`)."""

from __future__ import annotations

import pytest

from engine.decode.config import DecodeConfig
from engine.runtime import inject
from tests.engine.runs.test_pd_faults import (
    abort_everything_prefetched,
    abort_one_of_several_prefetched,
    pd,
    release_then_resume,
    violated,
)

SCENARIOS = {
    # mutant: (the rule that must catch it, run arguments that reach the bug)
    "prefetch-use-mismatched-rooms": (
        "D-prefetch-match",
        dict(extra=2, hooks={"after_prefetch": abort_one_of_several_prefetched}),
    ),
    "no-stale-cancel": (
        "D-no-stale",
        dict(extra=2, hooks={"after_prefetch": abort_everything_prefetched}),
    ),
    "no-cancel-on-release": (
        "D-release-cancels",
        dict(extra=1, hooks={"after_prefetch": release_then_resume}),
    ),
    "double-prefetch": (
        "D-one-query-per-addr",
        dict(extra=1, dc=DecodeConfig(bootstrap_timeout_s=0.6, polling_interval=2)),
    ),
    "prefetch-before-published": ("D-published-first", dict(prefill_delay_s=0.3)),
    "query-every-iteration": (
        "D-unknown-rooms-only",
        dict(requests=10, dc=DecodeConfig(num_pages=12)),
    ),
}


def test_every_decode_mutant_has_a_scenario():
    assert set(SCENARIOS) == set(inject.DECODE_MUTANTS)


@pytest.mark.parametrize("mutant", sorted(SCENARIOS))
def test_decode_mutant_is_caught_by_its_rule(tmp_path, mutant):
    rule, kw = SCENARIOS[mutant]
    s, results = pd(tmp_path, inject=[mutant], **kw)
    assert rule in violated(results), (mutant, violated(results))
    assert not any(s["decode_leaks"].values())  # caught by the rules, still no leak


def test_query_every_iteration_scenario_is_clean_without_the_mutant(tmp_path):
    _, kw = SCENARIOS["query-every-iteration"]
    s, results = pd(tmp_path, **kw)
    assert not violated(results) and s["mismatches"] == [] and not s["aborted"]
