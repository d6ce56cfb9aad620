"""Running the conformance scenarios and judging their traces.

Each scenario (decode_scenarios.py, prefill_scenarios.py) writes one trace, which the checker
judges against the rules of spec/. Outcome per scenario: `conforms`, `finding` (the violations are
those of a real SGLang bug on the releases it shipped in, listed in FINDINGS: the command stays
green on those releases while the bug shows exactly so), `open-divergence` (exactly the rules prefill_scenarios.DIVERGENCES lists:
SGLang is safe there by a means the rules cannot see yet, explained in docs/sglang.md) or
`divergence` (anything else: the spec is wrong about SGLang, or SGLang has a new hazard). Under a
mutant (mutants.py) the outcome is `flagged` when a rule caught it, else `missed`.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from packaging.version import Version

from checker.linear import check_files
from engine.sglang import decode as decode_hooks
from engine.sglang import hooks, load
from engine.sglang import prefill as prefill_hooks
from engine.sglang.conform import (
    decode_life,
    decode_scenarios,
    lifecycle,
    mutants,
    prefill_life,
    prefill_scenarios,
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """A real SGLang bug the matrix reproduces on the releases it shipped in (docs/sglang.md,
    "Historical bug benchmark"): on those releases the scenarios it names break exactly `broken`
    (rules, or `oracle:<invariant>`), SGLang raising `error` (a substring) where it crashes, and the
    outcome is `finding`; on the others it is what the scenario's own expectation says."""

    bug: str  # the benchmark row and SGLang's PR
    releases: tuple[str, str]  # the first and the last release it affects (inclusive)
    scenarios: tuple[str, ...]  # the scenarios (or name prefixes) it shows in
    broken: tuple[str, ...]
    error: str | None = None

    def applies(self, name: str, version: str) -> bool:
        first, last = (Version(v) for v in self.releases)
        in_range = first <= Version(version) <= last
        return in_range and any(name == s or name.startswith(s) for s in self.scenarios)


def _cells(states: str, faults: str) -> tuple[str, ...]:
    return tuple(f"decode-life/{s}/{f}/" for s in states.split() for f in faults.split())


def _prefill_cells(states: str, faults: str) -> tuple[str, ...]:
    """The overlap-loop prefill lifecycle cells of those states and faults."""
    return tuple(f"prefill-life/{s}/{f}/overlap" for s in states.split() for f in faults.split())


_FAULTS = "poll-failed state-failed peer-gone client-abort timeout"
_PENDING_ENDS = "poll-failed client-abort timeout"  # the faults that end a DP-pending request
FINDINGS: tuple[Finding, ...] = (
    # pop_preallocated drops an aborted request and pop_transferred a Failed one without
    # kv_receiver.clear() (the request's status entries leak); fixed by #28022 in 0.5.14
    Finding(
        "S1 #28022",
        ("0.5.13", "0.5.13.post1"),
        _cells("dp-pending handshake transferring paused", _FAULTS)
        + _cells("prealloc-blocked", "poll-failed state-failed peer-gone client-abort"),
        ("oracle:cleared-once",),
    ),
    # the abort sweep drops an aborted request from `queue` but not from `pending_reqs`: the next
    # resolve answers its room again and initialises its receiver; from 0.5.14 (#28022 sets the
    # receiver to None) that init raises. Fixed by #29834 in 0.5.16
    Finding(
        "S2 #29834 (before #28022)",
        ("0.5.13", "0.5.13.post1"),
        _cells("dp-pending", _PENDING_ENDS),
        ("D-consume-answer",),
    ),
    Finding(
        "S2 #29834",
        ("0.5.14", "0.5.15.post1"),
        _cells("dp-pending", _PENDING_ENDS),
        ("D-consume-answer",),
        error="'NoneType' object has no attribute 'init'",
    ),
    # _update_handshake_waiters returns early while every queued request is WaitingForInput and
    # none has concluded Failed: a failure the receiver's state holds but no poll has read is not
    # seen, and the room gets pages and its metadata published. Fixed by #37483 in 0.5.20
    Finding(
        "C1 #37483",
        ("0.5.13", "0.5.19"),
        _cells("prealloc-blocked", "poll-failed peer-gone"),
        ("oracle:failure-polled",),
    ),
    # under the overlap loop, run_batch(N+1)'s early cached-prefix send (maybe_send_cached_prefix_
    # chunk, on by default) sends chunk N's KV before forward N is known to have written it, with no
    # forward-stream event for the transfer to wait on. Fixed by #31368 in 0.5.16
    Finding(
        "S5 #31368",
        ("0.5.15", "0.5.15.post1"),
        ("prefill-inline-sample/overlap", "prefill-life/bootstrap/none/overlap")
        + _prefill_cells("waiting inflight", f"none {_FAULTS}")
        + _prefill_cells("in-batch", "none poll-failed state-failed peer-gone timeout"),
        ("P-chunk-sent",),
    ),
)


def findings(name: str, version: str) -> list[Finding]:
    """The known bugs of this release that the scenario shows."""
    return [f for f in FINDINGS if f.applies(name, version)]


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
    broken, cut = judged(path) if os.path.exists(path) else ({}, "no trace was written")
    if error is None and cut is not None:  # a rule not judged is never passed
        error = cut
    broken.update({f"oracle:{name}": len(found) for name, found in violations.items()})
    return {
        "scenario": name,
        "sglang_version": sgl.version,
        "sglang_functions": functions,
        "trace": path,
        "outcome": _outcome(name, sgl.version, broken, error, mutant),
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


def judged(path: str) -> tuple[dict[str, int], str | None]:
    """The trace at `path` checked once: rule id -> violations, and why it leaves rules unjudged
    (a run that did not reach its end) or None when every rule was judged."""
    broken: dict[str, int] = {}
    cut = None
    for result in check_files([path]):
        for v in result.violations:
            broken[v.rule.id] = broken.get(v.rule.id, 0) + 1
        if cut is None and not result.complete:
            cut = (
                f"trace ended by {result.end_reason or 'nothing'} at line {result.truncated}: "
                f"{', '.join(result.not_judged)} not judged"
            )
    return broken, cut


def broken_rules(path: str) -> dict[str, int]:
    """rule id -> violations in the trace at `path`."""
    return judged(path)[0]


def incomplete(path: str) -> str | None:
    """Why the trace at `path` leaves rules unjudged, or None when every rule was judged."""
    return judged(path)[1]


def _outcome(name: str, version: str, broken: dict, error, mutant) -> str:
    if mutant is not None:
        return "flagged" if set(broken) & set(mutant.rules) else "missed"
    known = findings(name, version)
    if known:
        errors = [f.error for f in known if f.error]
        error_met = bool(errors) == (error is not None) and all(e in (error or "") for e in errors)
        if error_met and set(broken) == {r for f in known for r in f.broken}:
            return "finding"
    if error is not None:
        return "error"
    if not broken:
        return "conforms"
    if set(broken) == set(_open_divergences().get(name, ())):
        return "open-divergence"
    return "divergence"


def expected_outcome(name: str, version: str) -> str:
    if findings(name, version):
        return "finding"
    return "open-divergence" if name in _open_divergences() else "conforms"


def met(result: dict) -> bool:
    """Whether a scenario's outcome is what is expected of it."""
    if result["mutant"] is not None:
        return result["outcome"] == "flagged"
    return result["outcome"] == expected_outcome(result["scenario"], result["sglang_version"])
