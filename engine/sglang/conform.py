"""`pdo conform sglang`: run SGLang's real scheduler code on CPU with the adapter on, check every trace.

Each scenario (engine/sglang/conform_decode.py, engine/sglang/conform_prefill.py) writes one trace,
which the checker judges against the rules of spec/. Outcome per scenario: `conforms`, `finding`
(the violations are the ones docs/sglang.md records as a real hazard in SGLang, listed in FINDINGS:
the command stays green while they last) or `divergence` (anything else: the spec is wrong about
SGLang, or SGLang has a new hazard). With `--mutant NAME` a real-code mutation of SGLang's method
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
    p.add_argument("--list", action="store_true", help="list the scenarios and the mutants, then exit")
    p.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    p.set_defaults(fn=cmd_conform)


def _session():
    """SGLang loaded and the hooks installed, once per process."""
    from . import decode, hooks, load, prefill
    sgl = load()
    if not hooks.is_installed():
        decode.install(sgl)
        prefill.install(sgl)
    else:
        hooks.ran.clear()
    return sgl


def all_scenarios(sgl) -> list[tuple[str, object]]:
    from . import conform_decode, conform_prefill
    prefill = getattr(conform_prefill, "scenarios", lambda: [])()
    return conform_decode.scenarios(sgl) + [(name, _to_path(run)) for name, run in prefill]


def _to_path(run):
    """A prefill scenario writes into a folder and returns its trace's path: run it into the folder of
    the path asked for, and put the trace there."""
    def run_to(path: str) -> str:
        out = run(os.path.dirname(path))["trace"]
        if os.path.abspath(out) != os.path.abspath(path):
            os.replace(out, path)
        return path
    return run_to


def _selected(scenarios, wanted):
    if not wanted:
        return scenarios
    return [(n, run) for n, run in scenarios if any(n == w or n.startswith(w) for w in wanted)]


def run_scenario(sgl, name: str, run, trace_dir: str, mutant=None) -> dict:
    from checker.linear import check_files

    from . import hooks, mutants
    path = os.path.join(trace_dir, name.replace("/", "_") + ".jsonl")
    hooks.ran.clear()
    error = None
    try:
        if mutant is None:
            run(path)
        else:
            with mutants.applied(sgl, mutant):
                run(path)
    except Exception as exc:   # SGLang's code raising inside a scenario is an outcome, not a crash
        error = f"{type(exc).__name__}: {exc}"
    functions = sorted(hooks.ran)
    broken: dict[str, int] = {}
    if os.path.exists(path):
        for result in check_files([path]):
            for v in result.violations:
                broken[v.rule.id] = broken.get(v.rule.id, 0) + 1
    return {"scenario": name, "sglang_version": sgl.version, "sglang_functions": functions, "trace": path,
            "outcome": _outcome(name, broken, error, mutant), "rules": broken, "error": error,
            "mutant": mutant.name if mutant else None}


def _outcome(name: str, broken: dict, error, mutant) -> str:
    if mutant is not None:
        return "flagged" if set(broken) & set(mutant.rules) else "missed"
    if error is not None:
        return "error"
    if not broken:
        return "conforms"
    return "finding" if set(broken) == set(FINDINGS.get(name, ())) else "divergence"


def met(result: dict) -> bool:
    """Whether a scenario's outcome is what is expected of it."""
    if result["mutant"] is not None:
        return result["outcome"] == "flagged"
    expected = "finding" if result["scenario"] in FINDINGS else "conforms"
    return result["outcome"] == expected


def cmd_conform(a) -> int:
    try:
        check_version()
    except SGLangUnavailable as exc:
        print(f"pdo conform: {exc}", file=sys.stderr)
        return 2
    from . import mutants
    sgl = _session()
    scenarios = all_scenarios(sgl)
    if a.list:
        print("scenarios:\n" + "\n".join(f"  {n}" for n, _ in scenarios))
        print("mutants:\n" + "\n".join(f"  {m.name}: {m.what}" for m in mutants.MUTANTS.values()))
        return 0
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
    results = [run_scenario(sgl, n, run, trace_dir, mutant) for n, run in chosen]
    if a.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            rules = ", ".join(f"{k} x{v}" for k, v in sorted(r["rules"].items()))
            mark = "ok " if met(r) else "BAD"
            print(f"{mark} {r['scenario']:<40} {r['outcome']:<10} {rules}{'  ' + r['error'] if r['error'] else ''}")
        print(f"SGLang {sgl.version}; traces in {trace_dir}; "
              f"{len({f for r in results for f in r['sglang_functions']})} real SGLang functions ran")
    return 0 if all(met(r) for r in results) else 1
