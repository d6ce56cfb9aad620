"""Running the conformance scenarios and judging their traces.

Each scenario (decode_scenarios.py, prefill_scenarios.py) writes one trace, which the checker
judges against the rules of spec/. Outcome per scenario: `conforms`, `finding` (the violations are
the ones docs/sglang.md records as a real hazard in SGLang, listed in FINDINGS: the command stays
green while they last), `open-divergence` (exactly the rules prefill_scenarios.DIVERGENCES lists:
SGLang is safe there by a means the rules cannot see yet, explained in docs/sglang.md) or
`divergence` (anything else: the spec is wrong about SGLang, or SGLang has a new hazard). Under a
mutant (mutants.py) the outcome is `flagged` when a rule caught it, else `missed`.
"""

from __future__ import annotations

import logging
import os

from checker.linear import check_files

from .. import decode as decode_hooks
from .. import hooks, load
from .. import prefill as prefill_hooks
from . import decode_life, decode_scenarios, lifecycle, mutants, prefill_life, prefill_scenarios

# scenario -> the rules its expected finding breaks (docs/sglang.md, "Findings"). Finding 1 was
# retracted: its scenario released memory in a state SGLang's only caller refuses (reachable.py).
FINDINGS: dict[str, tuple[str, ...]] = {}


def session():
    """SGLang loaded and the hooks installed, once per process. SGLang's own log lines (its start-up
    notes, the errors its clients log for answers the scenarios provoke) are kept to real errors."""
    sgl = load()
    logging.getLogger("sglang").setLevel(logging.CRITICAL)
    if not hooks.is_installed():
        decode_hooks.install(sgl)
        prefill_hooks.install(sgl)
    return sgl


def all_scenarios(sgl) -> list[tuple[str, object]]:
    """(name, run(trace_path, fuzz_seed=None)) for every decode and prefill scenario."""
    prefill = prefill_scenarios.scenarios()
    return (
        decode_scenarios.scenarios(sgl)
        + decode_life.scenarios(sgl)
        + [(name, _to_path(run)) for name, run in prefill]
        + prefill_life.scenarios()
    )


def _to_path(run):
    """A prefill scenario writes into a folder and returns its trace's path: run it into the folder
    of the path asked for, and put the trace there."""

    def run_to(path: str, fuzz_seed: int | None = None) -> str:
        out = run(os.path.dirname(path), fuzz_schedule=fuzz_seed)["trace"]
        if os.path.abspath(out) != os.path.abspath(path):
            os.replace(out, path)
        return path

    return run_to


def selected(scenarios, wanted):
    """The scenarios named in `wanted` (or prefixed by one of its entries); all when it is empty."""
    if not wanted:
        return scenarios
    return [(n, run) for n, run in scenarios if any(n == w or n.startswith(w) for w in wanted)]


def run_scenario(
    sgl, name: str, run, trace_dir: str, mutant=None, fuzz_seed: int | None = None
) -> dict:
    """Run one scenario (under a decode mutant when given), and judge its trace."""
    suffix = "" if fuzz_seed is None else f".s{fuzz_seed}"
    path = os.path.join(trace_dir, name.replace("/", "_") + suffix + ".jsonl")
    hooks.ran.clear()
    error, violations = None, {}
    try:
        if mutant is None:
            run(path, fuzz_seed=fuzz_seed)
        else:
            with mutants.applied(sgl, mutant):
                run(path, fuzz_seed=fuzz_seed)
    except lifecycle.Violations as exc:  # the oracle's invariants (decode_life.py)
        violations = exc.found
    except Exception as exc:  # SGLang's code raising inside a scenario is an outcome, not a crash
        error = f"{type(exc).__name__}: {exc}"
    functions = sorted(hooks.ran)
    broken = broken_rules(path) if os.path.exists(path) else {}
    broken.update({f"oracle:{name}": len(found) for name, found in violations.items()})
    return {
        "scenario": name,
        "sglang_version": sgl.version,
        "sglang_functions": functions,
        "trace": path,
        "outcome": _outcome(name, broken, error, mutant),
        "rules": broken,
        "error": error,
        "violations": violations,
        "mutant": mutant.name if mutant else None,
        "schedule": fuzz_seed,
    }


def run_prefill_mutant(sgl, name: str, trace_dir: str) -> dict:
    """A mutant of the real prefill loop (mutants.PREFILL_MUTANTS), judged: flagged when its rules
    fail."""
    mutant = mutants.PREFILL_MUTANTS[name]
    out = mutant.run(trace_dir)
    broken = broken_rules(out["trace"])
    outcome = "flagged" if set(broken) & set(out["expect"]) else "missed"
    return {
        "scenario": mutant.scenario,
        "sglang_version": sgl.version,
        "sglang_functions": sorted(out.get("functions", [])),
        "trace": out["trace"],
        "outcome": outcome,
        "rules": broken,
        "error": None,
        "mutant": name,
    }


def _open_divergences() -> dict:
    known = {**prefill_scenarios.DIVERGENCES, **decode_life.DIVERGENCES, **prefill_life.DIVERGENCES}
    return {name: tuple(rules) for name, rules in known.items()}


def broken_rules(path: str) -> dict[str, int]:
    """rule id -> violations in the trace at `path`."""
    broken: dict[str, int] = {}
    for result in check_files([path]):
        for v in result.violations:
            broken[v.rule.id] = broken.get(v.rule.id, 0) + 1
    return broken


def _outcome(name: str, broken: dict, error, mutant) -> str:
    if mutant is not None:
        return "flagged" if set(broken) & set(mutant.rules) else "missed"
    if error is not None:
        return "error"
    if not broken:
        return "conforms"
    if set(broken) == set(FINDINGS.get(name, ())):
        return "finding"
    if set(broken) == set(_open_divergences().get(name, ())):
        return "open-divergence"
    return "divergence"


def expected_outcome(name: str) -> str:
    if name in FINDINGS:
        return "finding"
    return "open-divergence" if name in _open_divergences() else "conforms"


def met(result: dict) -> bool:
    """Whether a scenario's outcome is what is expected of it."""
    if result["mutant"] is not None:
        return result["outcome"] == "flagged"
    return result["outcome"] == expected_outcome(result["scenario"])
