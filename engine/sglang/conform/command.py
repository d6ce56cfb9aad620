"""What `pdo conform sglang` runs and prints, once SGLang's version is known to be the adapter's.

The scenarios and how their outcomes are judged are driver.py's; with `--mutant NAME` a real-code
mutation of SGLang (mutants.py) is applied, and the outcome is `flagged` when a rule caught it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

from checker.parallel import Progress, executor, in_order, ray_summary
from engine.sglang import hooks, versions
from engine.sglang.conform import (
    decode_life,
    decode_scenarios,
    driver,
    mutants,
    prefill_life,
    prefill_scenarios,
    tasks,
)


def run(a) -> int:
    """The command for the parsed arguments `a`; its exit code."""
    sgl = driver.session()
    scenarios = driver.all_scenarios(sgl)
    if a.list:
        _print_list(scenarios)
        _print_release(sgl)
        return 0
    if a.mutant in mutants.PREFILL_MUTANTS:
        return _prefill_mutant(sgl, a)
    mutant = None
    if a.mutant is not None:
        if a.mutant not in mutants.DECODE_MUTANTS:
            print(
                f"pdo conform: unknown mutant {a.mutant!r} (pdo conform sglang --list)",
                file=sys.stderr,
            )
            return 2
        mutant = mutants.DECODE_MUTANTS[a.mutant]
    wanted = a.scenario or (list(mutant.scenarios) if mutant else None)
    chosen = driver.selected(scenarios, wanted)
    if not chosen and driver.selected(_not_applicable(sgl), wanted):
        _print_results(sgl, [], "(none)")  # every scenario asked for is listed as not applicable
        return 0
    if not chosen:
        print(f"pdo conform: no scenario matches {wanted}", file=sys.stderr)
        return 2
    trace_dir = _trace_dir(a)
    seeds = [a.fuzz_seed] if a.fuzz_seed is not None else [None, *range(a.fuzz)]
    mutant_name = mutant.name if mutant else None
    runs = [
        (a.sglang_version, sgl.version, name, mutant_name, trace_dir, seed)
        for name, _ in chosen
        for seed in seeds
    ]
    try:
        results = _run_all(a, runs)
    except versions.VersionError as exc:  # a Ray worker with another SGLang
        cause = getattr(exc, "cause", exc)  # Ray's error wraps the worker's
        print(f"pdo conform: {' '.join(str(cause).split())}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(results, indent=1))
    else:
        _print_results(sgl, results, trace_dir)
    return 0 if all(driver.met(r) for r in results) else 1


def _run_all(a, runs: list[tuple]) -> list[dict]:
    """The outcome of every (scenario, schedule) run, in order: in this process, or as Ray tasks
    (--ray); with --stop-at-first, up to the first that does not meet its expectation (what was
    not run yet is cancelled)."""
    with executor(ray=a.ray, ray_cpus=a.ray_cpus) as pool:
        prog = Progress(
            len(runs), a.progress or (a.ray is not None and sys.stderr.isatty()), "runs"
        )
        results = []
        with contextlib.closing(in_order(pool, tasks.run_one, runs)) as outcomes:
            for r in outcomes:
                results.append(r)
                prog(len(results), None, not driver.met(r))
                if a.stop_at_first and not driver.met(r):
                    break
        ray_summary("conform", pool)
    return results


def _inapplicable(sgl) -> dict[str, str]:
    """Scenario (with its loop mode) -> why this release does not run it."""
    out = {}
    for scripts in (decode_scenarios.inapplicable(sgl), decode_life.inapplicable(sgl)):
        for name, absent in scripts.items():
            for mode in ("normal", "overlap"):
                out[f"{name}/{mode}"] = f"needs {', '.join(absent)}"
    return {**out, **prefill_scenarios.inapplicable(), **prefill_life.inapplicable()}


def _not_applicable(sgl) -> list[tuple[str, None]]:
    """(name, None) for the scenarios this release cannot run."""
    return [(name, None) for name in _inapplicable(sgl)]


def _trace_dir(a) -> str:
    trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="pdo-conform-")
    os.makedirs(trace_dir, exist_ok=True)
    return trace_dir


def _print_list(scenarios) -> None:
    print("scenarios:\n" + "\n".join(f"  {name}" for name, _ in scenarios))
    print(
        "mutants:\n"
        + "\n".join(f"  {name}: {m.what}" for name, m in mutants.DECODE_MUTANTS.items())
    )
    print("\n".join(f"  {name}: {m.what}" for name, m in mutants.PREFILL_MUTANTS.items()))


def _print_results(sgl, results: list[dict], trace_dir: str) -> None:
    for r in results:
        rules = ", ".join(f"{k} x{v}" for k, v in sorted(r["rules"].items()))
        mark = "ok " if driver.met(r) else "BAD"
        sched = "" if r["schedule"] is None else f" s{r['schedule']}"
        error = "  " + r["error"] if r["error"] else ""
        print(f"{mark} {r['scenario'] + sched:<44} {r['outcome']:<15} {rules}{error}")
        if not driver.met(r) and r["schedule"] is not None:
            replay = f"pdo conform sglang --scenario {r['scenario']} --fuzz-seed {r['schedule']}"
            print(f"    replay: {replay}{' --mutant ' + r['mutant'] if r['mutant'] else ''}")
    print(
        f"SGLang {sgl.version}; traces in {trace_dir}; "
        f"{len({f for r in results for f in r['sglang_functions']})} real SGLang functions ran"
    )
    _print_release(sgl)


def _print_release(sgl) -> None:
    """Which hooks attached on this release, and the scenarios it cannot run."""
    print(hooks.report())
    for name, why in _inapplicable(sgl).items():
        print(f"not applicable to SGLang {sgl.version}: {name} ({why})")


def _prefill_mutant(sgl, a) -> int:
    """A mutant of the real prefill loop: flagged when its rules fail."""
    result = driver.run_prefill_mutant(sgl, a.mutant, _trace_dir(a))
    if a.json:
        print(json.dumps([result], indent=1))
    else:
        rules = ", ".join(f"{k} x{v}" for k, v in sorted(result["rules"].items()))
        mark = "ok " if result["outcome"] == "flagged" else "BAD"
        print(f"{mark} {result['scenario']:<40} {result['outcome']:<10} {rules}")
    return 0 if result["outcome"] == "flagged" else 1
