"""`pdo conform sglang`: run SGLang's real scheduler code on CPU with the adapter on, check every trace.

Each scenario (engine/sglang/conform_decode.py, engine/sglang/conform_prefill.py) writes one trace,
which the checker judges against the rules of spec/. Outcome per scenario: `conforms`, `finding`
(the violations are the ones docs/sglang.md records as a real hazard in SGLang, listed in FINDINGS:
the command stays green while they last), `open-divergence` (exactly the rules conform_prefill.
DIVERGENCES lists: SGLang is safe there by a means the rules cannot see yet, explained in
docs/sglang.md) or `divergence` (anything else: the spec is wrong about SGLang, or SGLang has a new
hazard). With `--mutant NAME` a real-code mutation of SGLang's method
(engine/sglang/mutants.py) is applied, and the outcome is `flagged` when a rule caught it.

Exit codes: 0 every scenario met its expectation, 1 otherwise, 2 SGLang missing or of another version.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from . import SGLangUnavailable, check_version

# scenario -> the rules its expected finding breaks (docs/sglang.md, "Findings")
FINDINGS = {
    "decode-release-pending/normal": ("D-request-ends",),
    "decode-release-pending/overlap": ("D-request-ends",),
}


def register(sub) -> None:
    p = sub.add_parser("conform", help="check SGLang's own scheduler code against the rules (docs/sglang.md)")
    p.add_argument("target", choices=["sglang"], help="the system to check")
    p.add_argument("--trace-dir", default=None, help="keep the traces here (default: a temporary folder)")
    p.add_argument("--scenario", action="append", default=None,
                   help="run only this scenario (repeatable; a prefix such as 'decode-' selects several)")
    p.add_argument("--mutant", default=None, help="apply this real-code mutation (see --list)")
    p.add_argument("--fuzz", type=int, default=0, metavar="N",
                   help="also run each scenario under N controlled schedules (decode: thread interleavings of "
                        "the scheduler and the prefetch pool; prefill: when transfers and copies complete)")
    p.add_argument("--fuzz-seed", type=int, default=None, metavar="S",
                   help="run each scenario under schedule S only (what a failing --fuzz run prints to replay)")
    p.add_argument("--list", action="store_true", help="list the scenarios and the mutants, then exit")
    p.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    p.set_defaults(fn=cmd_conform)


def _session():
    """SGLang loaded and the hooks installed, once per process. SGLang's own log lines (its start-up
    notes, the errors its clients log for answers the scenarios provoke) are kept to real errors."""
    import logging

    from . import decode, hooks, load, prefill
    sgl = load()
    logging.getLogger("sglang").setLevel(logging.CRITICAL)
    if not hooks.is_installed():
        decode.install(sgl)
        prefill.install(sgl)
    return sgl


def all_scenarios(sgl) -> list[tuple[str, object]]:
    from . import conform_decode, conform_prefill
    prefill = getattr(conform_prefill, "scenarios", lambda: [])()
    return conform_decode.scenarios(sgl) + [(name, _to_path(run)) for name, run in prefill]


def _to_path(run):
    """A prefill scenario writes into a folder and returns its trace's path: run it into the folder of
    the path asked for, and put the trace there."""
    def run_to(path: str, fuzz_seed: int | None = None) -> str:
        out = run(os.path.dirname(path), fuzz_schedule=fuzz_seed)["trace"]
        if os.path.abspath(out) != os.path.abspath(path):
            os.replace(out, path)
        return path
    return run_to


def _selected(scenarios, wanted):
    if not wanted:
        return scenarios
    return [(n, run) for n, run in scenarios if any(n == w or n.startswith(w) for w in wanted)]


def run_scenario(sgl, name: str, run, trace_dir: str, mutant=None, fuzz_seed: int | None = None) -> dict:
    from . import hooks, mutants
    suffix = "" if fuzz_seed is None else f".s{fuzz_seed}"
    path = os.path.join(trace_dir, name.replace("/", "_") + suffix + ".jsonl")
    hooks.ran.clear()
    error = None
    try:
        if mutant is None:
            run(path, fuzz_seed=fuzz_seed)
        else:
            with mutants.applied(sgl, mutant):
                run(path, fuzz_seed=fuzz_seed)
    except Exception as exc:   # SGLang's code raising inside a scenario is an outcome, not a crash
        error = f"{type(exc).__name__}: {exc}"
    functions = sorted(hooks.ran)
    broken = _broken(path) if os.path.exists(path) else {}
    return {"scenario": name, "sglang_version": sgl.version, "sglang_functions": functions, "trace": path,
            "outcome": _outcome(name, broken, error, mutant), "rules": broken, "error": error,
            "mutant": mutant.name if mutant else None, "schedule": fuzz_seed}


def _open_divergences() -> dict:
    from .conform_prefill import DIVERGENCES
    return {name: tuple(rules) for name, rules in DIVERGENCES.items()}


def _broken(path: str) -> dict[str, int]:
    """rule id -> violations in the trace at `path`."""
    from checker.linear import check_files

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


def cmd_conform(a) -> int:
    try:
        check_version()
    except SGLangUnavailable as exc:
        print(f"pdo conform: {exc}", file=sys.stderr)
        return 2
    from . import mutants
    sgl = _session()
    scenarios = all_scenarios(sgl)
    from . import conform_prefill
    if a.list:
        print("scenarios:\n" + "\n".join(f"  {n}" for n, _ in scenarios))
        print("mutants:\n" + "\n".join(f"  {m.name}: {m.what}" for m in mutants.MUTANTS.values()))
        print("\n".join(f"  {n}: {conform_prefill.MUTANTS[n][1].__doc__.strip().splitlines()[0]}"
                        for n in conform_prefill.MUTANTS))
        return 0
    if a.mutant in conform_prefill.MUTANTS:
        return _prefill_mutant(sgl, a)
    mutant = None
    if a.mutant is not None:
        if a.mutant not in mutants.MUTANTS:
            print(f"pdo conform: unknown mutant {a.mutant!r} (pdo conform sglang --list)", file=sys.stderr)
            return 2
        mutant = mutants.MUTANTS[a.mutant]
    wanted = a.scenario or (list(mutant.scenarios) if mutant else None)
    chosen = _selected(scenarios, wanted)
    if not chosen:
        print(f"pdo conform: no scenario matches {wanted}", file=sys.stderr)
        return 2
    trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="pdo-conform-")
    os.makedirs(trace_dir, exist_ok=True)
    seeds = [a.fuzz_seed] if a.fuzz_seed is not None else [None, *range(a.fuzz)]
    results = [run_scenario(sgl, n, run, trace_dir, mutant, seed) for n, run in chosen for seed in seeds]
    if a.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            rules = ", ".join(f"{k} x{v}" for k, v in sorted(r["rules"].items()))
            mark = "ok " if met(r) else "BAD"
            sched = "" if r["schedule"] is None else f" s{r['schedule']}"
            print(f"{mark} {r['scenario'] + sched:<44} {r['outcome']:<15} {rules}{'  ' + r['error'] if r['error'] else ''}")
            if not met(r) and r["schedule"] is not None:
                replay = f"pdo conform sglang --scenario {r['scenario']} --fuzz-seed {r['schedule']}"
                print(f"    replay: {replay}{' --mutant ' + r['mutant'] if r['mutant'] else ''}")
        print(f"SGLang {sgl.version}; traces in {trace_dir}; "
              f"{len({f for r in results for f in r['sglang_functions']})} real SGLang functions ran")
    return 0 if all(met(r) for r in results) else 1


def _prefill_mutant(sgl, a) -> int:
    """A mutant of the real prefill loop (conform_prefill.MUTANTS): flagged when its rules fail."""
    from . import conform_prefill
    trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="pdo-conform-")
    os.makedirs(trace_dir, exist_ok=True)
    run = dict(conform_prefill.mutants())[a.mutant]
    out = run(trace_dir)
    broken = _broken(out["trace"])
    outcome = "flagged" if set(broken) & set(out["expect"]) else "missed"
    result = {"scenario": conform_prefill.MUTANTS[a.mutant][0], "sglang_version": sgl.version,
              "sglang_functions": sorted(out.get("functions", [])), "trace": out["trace"], "outcome": outcome,
              "rules": broken, "error": None, "mutant": a.mutant}
    if a.json:
        print(json.dumps([result], indent=1))
    else:
        rules = ", ".join(f"{k} x{v}" for k, v in sorted(broken.items()))
        print(f"{'ok ' if outcome == 'flagged' else 'BAD'} {result['scenario']:<40} {outcome:<10} {rules}")
    return 0 if outcome == "flagged" else 1
