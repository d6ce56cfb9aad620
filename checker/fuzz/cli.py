"""`pdo fuzz`: controlled-schedule fuzzing of the engine, replay of a saved case, and the mutant
table."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import statistics
import sys
import time

from engine.runtime.inject import DECODE_MUTANTS, MUTANTS
from spec import domains as d
from spec.vocabulary import PREFILL_LOOPS

from ..parallel import Progress, add_ray_args, executor, ray_summary
from . import (
    CampaignStats,
    Case,
    PDCase,
    Replay,
    find_bug,
    load_case,
    pd_draws,
    pressure_bounds,
    pressure_draws,
    run_case,
    save_case,
    shrink,
    with_pressure,
)
from .runs import MODEL_EVERY, MODEL_TIMEOUT_MS
from .shrink import fails_alike

# The workload each prefill mutant is hunted with: small enough for hundreds of schedules a minute,
# rich enough to exercise what the bug breaks (chunked requests, cached prefixes, logit bias).
MUTANT_MODE = {m: "ahead" for m in MUTANTS}
# Decode mutants are hunted with whole PD cases drawn afresh for every schedule
# (checker.fuzz.draw_pd_case: workload, loops, DP ranks, decode knobs, client aborts, memory
# release, bootstrap latency and failures), the same draw for all six.
ALL_MUTANTS = {**MUTANTS, **DECODE_MUTANTS}
INCOMPLETE = 3  # no verdict (engine/cli/exits.py, which imports this module through engine.cli)
MAX_CASE_REQUESTS = 64  # a case is a small run: hundreds of schedules a minute


def _case_from_args(a) -> Case:
    return Case(
        mode=a.mode or "ahead",
        inject=tuple(a.inject or ()),
        requests=a.requests,
        hit=a.hit,
        workload_seed=a.workload_seed,
    )


def _pool_fixed(a, pd: bool = False) -> dict:
    """The pool sizes the command line fixes (else drawn per schedule near the working set)."""
    fixed = {}
    if a.num_pages is not None:
        fixed["num_pages"] = a.num_pages
        if pd:
            fixed["decode_pages"] = a.num_pages
    if a.slots is not None:
        fixed["max_slots"] = a.slots
    return fixed


def _pd_fixed(a) -> dict:
    """What the command line fixes in PD draws (everything else is drawn per schedule)."""
    fixed = {"inject": tuple(a.inject or ())}
    fixed.update(_pool_fixed(a, pd=True))
    if a.mode:
        fixed["mode"] = a.mode
    return fixed


def _error(message: str) -> int:
    print(f"pdo fuzz: error: {message}", file=sys.stderr)
    return 2


def _list_mutants() -> int:
    for name, what in MUTANTS.items():
        print(f"{name:34s} prefill  {what}")
    for name, what in DECODE_MUTANTS.items():
        print(f"{name:34s} decode   {what}")
    return 0


def _replay(a) -> int:
    """Run a saved case under its saved schedule, strictly: a step whose thread is not enabled, or
    a run that ends before the schedule does, is reported as diverged (exit 3, no verdict: what ran
    is not the saved run), never judged as if it were."""
    case, schedule, saved = load_case(a.replay)
    model = bool(saved.get("model", False))  # the judges of the run that saved it
    replay = Replay(schedule, strict=True)
    out = run_case(case, replay, trace_path=a.trace, model=model)
    step = replay.diverged_at
    if step is None and len(out.schedule) < len(schedule):
        step = len(out.schedule)
    if step is not None:
        what = (
            f"{schedule[step]!r} is not enabled there"
            if replay.diverged_at is not None
            else "the run ended there"
        )
        print(
            f"replayed {a.replay}: DIVERGED at schedule step {step} of {len(schedule)}: {what}; "
            "not the saved run, no verdict"
        )
        return INCOMPLETE
    print(f"replayed {a.replay}: {len(out.schedule)} steps, {out.events} events")
    if a.trace and isinstance(case, PDCase):
        stem = a.trace[:-6] if a.trace.endswith(".jsonl") else a.trace
        print(f"  traces: {stem}.{{decode,prefill<i>}}.jsonl")
    for f in out.failures:
        print(f"  FAIL {f}")
    if not out.failures:
        print("  no failure")
    return 1 if out.failed else 0


def _report_failure(a, idx: int, out, label: str) -> int:
    """Save the failing case and its shrunk form, write the shrunk case's trace, print the
    replay command."""
    case = out.case
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"fuzz-{label}-{a.strategy}-s{a.seed}-{idx}")
    save_case(
        stem + ".case.json",
        case,
        out.schedule,
        out.failures,
        strategy=a.strategy,
        seed=a.seed,
        index=idx,
        model=out.model,
    )
    print(f"pdo fuzz: failure after {idx + 1} schedule(s) ({a.strategy}, seed {a.seed}):")
    for f in out.failures[:6]:
        print(f"  {f}")
    small, sched, small_out = shrink(case, out.schedule, out.failures, model=out.model)
    traces = f"{stem}.trace.*.jsonl" if isinstance(small, PDCase) else f"{stem}.trace.jsonl"
    if not fails_alike(small_out, out.failures):
        # Neither a smaller case nor the case itself failed again as it did: no shrunk case, and
        # no replay command that would print "no failure".
        run_case(case, Replay(out.schedule, strict=False), trace_path=stem + ".trace.jsonl")
        print(
            "  shrink lost the failure: no run of the case, smaller or whole, failed again the "
            f"same way (the rerun: {', '.join(small_out.failures[:3]) or 'no failure'}); "
            "no shrunk case written"
        )
        print(f"  trace (a rerun of the case): {traces}   case: {stem}.case.json")
        print(f"replay (may not fail again): pdo fuzz --replay {stem}.case.json")
        return 1
    save_case(
        stem + ".shrunk.json",
        small,
        sched,
        small_out.failures,
        shrunk_from=stem + ".case.json",
        model=small_out.model,
    )
    run_case(small, Replay(sched, strict=False), trace_path=stem + ".trace.jsonl")
    print(
        f"  shrunk to {small.requests} request(s), {len(sched)} schedule steps: "
        f"{', '.join(small_out.failures[:3])}"
    )
    print(f"  trace: {traces}   case: {stem}.case.json")
    print(f"replay: pdo fuzz --replay {stem}.shrunk.json")
    return 1


def _prefill_draw(a, case: Case):
    """(case, draw) of a prefill campaign: the workload from the command line, the pools drawn near
    its working set per schedule (dfs: once, it runs one case), unless --num-pages/--slots fix them."""
    fixed = _pool_fixed(a)
    case = dataclasses.replace(case, **fixed)
    if a.strategy == "dfs":
        return with_pressure(case, random.Random(a.seed), fixed), None
    return case, pressure_draws(case, a.seed, fixed)


def _campaign_result(a, idx, out, label: str, stats: CampaignStats, what: str) -> int:
    """The campaign's report: no violation or the failure (saved, shrunk), then the memory
    statistics line; with --json one object (the failure's text report goes to stderr)."""
    if idx is None:
        if not a.json:
            print(
                f"pdo fuzz: {what} strategy={a.strategy} inject={list(a.inject or ()) or '-'}: "
                f"{a.schedules} schedules, {out} events, no violation"
            )
        code = 0
    else:
        with contextlib.redirect_stdout(sys.stderr) if a.json else contextlib.nullcontext():
            code = _report_failure(a, idx, out, label)
    if a.json:
        report = {
            "violation": idx is not None,
            "failures": out.failures if idx is not None else [],
            "events": out if idx is None else None,
            "memory": stats.as_dict(),
            "judges": stats.judges_dict(),
        }
        print(json.dumps(report))
    else:
        print(f"  {stats.line()}")
        print(f"  {stats.judges_line()}")
    return code


def _pool(a):
    """Where the schedules run: Ray (--ray), N worker processes (--jobs N), or this process; the
    same verdicts as one process."""
    return executor(jobs=a.jobs, ray=a.ray, ray_cpus=a.ray_cpus)


def _campaign(a) -> int:
    """Fuzz one prefill case, or PD cases drawn per schedule; on a failure, save and shrink it."""
    with _pool(a) as pool:
        code = _campaign_in(a, pool)
        ray_summary("fuzz", pool)
        return code


def _campaign_in(a, pool) -> int:
    prog = Progress(a.schedules, a.progress or sys.stderr.isatty())
    stats = CampaignStats(pd=a.pd)
    if a.pd:
        if a.strategy == "dfs":
            return _error("--pd draws a new case per schedule; use --strategy pct or random")
        idx, out = find_bug(
            None,
            a.strategy,
            schedules=a.schedules,
            seed=a.seed,
            on_progress=prog,
            draw=pd_draws(a.seed, **_pd_fixed(a)),
            stats=stats,
            pool=pool,
            model_every=a.model_every,
            model_timeout_ms=a.model_timeout_ms,
        )
        label, what = "pd", "PD cases"
    else:
        case, draw = _prefill_draw(a, _case_from_args(a))
        low = pressure_bounds(case)[0]
        if a.num_pages is not None and a.num_pages < low:
            return _error(
                f"--num-pages {a.num_pages}: the largest request needs {low - 1} pages "
                f"(plus the reserved page 0); a smaller pool can never finish"
            )
        idx, out = find_bug(
            case,
            a.strategy,
            schedules=a.schedules,
            seed=a.seed,
            on_progress=prog,
            draw=draw,
            stats=stats,
            pool=pool,
            model_every=a.model_every,
            model_timeout_ms=a.model_timeout_ms,
        )
        label, what = case.mode, f"mode={case.mode}"
    return _campaign_result(a, idx, out, label, stats, what)


def cmd_fuzz(a) -> int:
    if a.list_mutants:
        return _list_mutants()
    if a.inject and not a.mutants and any(m in DECODE_MUTANTS for m in a.inject):
        a.pd = True  # a decode mutant needs the decode side: PD cases
    if (a.jobs > 1 or a.ray is not None) and a.strategy == "dfs":
        which = "--ray" if a.ray is not None else "--jobs"
        return _error(f"--strategy dfs is one sequential search; {which} needs pct or random")
    if a.replay:
        return _replay(a)
    if a.mutants:
        return _mutant_table(a)
    return _campaign(a)


def mutant_row(name: str, *, strategy: str, seeds, budget: int, pool=None) -> dict:
    """Schedules to first kill of `name`, as a median over seeds. A prefill mutant is hunted on one
    fixed prefill case; a decode mutant on PD cases drawn afresh for every schedule."""
    kills, killed_by, failures, t0 = [], None, [], time.perf_counter()
    for seed in seeds:
        if name in DECODE_MUTANTS:
            idx, out = find_bug(
                None,
                strategy,
                schedules=budget,
                seed=seed,
                draw=pd_draws(seed, inject=(name,)),
                pool=pool,
            )
        else:
            case = Case(mode=MUTANT_MODE[name], inject=(name,), requests=6, hit=0.8)
            idx, out = find_bug(case, strategy, schedules=budget, seed=seed, pool=pool)
        if idx is not None:
            kills.append(idx + 1)
            killed_by = killed_by or out.killed_by
            failures.append(out.failures)
    return {
        "mutant": name,
        "side": "decode" if name in DECODE_MUTANTS else "prefill",
        "killed": len(kills) == len(seeds),
        "killed_by": killed_by,
        "failures": failures,
        "schedules_to_kill": statistics.median(kills) if kills else None,
        "kills_per_seed": kills,
        "kills": f"{len(kills)}/{len(seeds)}",
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _mutant_table(a) -> int:
    # dfs runs one fixed case: prefill mutants only
    names = a.inject or list(MUTANTS if a.strategy == "dfs" else ALL_MUTANTS)
    if a.strategy == "dfs" and any(n in DECODE_MUTANTS for n in names):
        return _error(
            "--strategy dfs runs one fixed prefill case; decode mutants need pct or random"
        )
    with _pool(a) as pool:
        code = _mutant_table_in(a, names, pool)
        ray_summary("fuzz", pool)
        return code


def _mutant_table_in(a, names, pool) -> int:
    seeds = range(a.seed, a.seed + a.seeds)
    rows = []
    for name in names:
        row = mutant_row(name, strategy=a.strategy, seeds=seeds, budget=a.schedules, pool=pool)
        rows.append(row)
        if not a.json:
            verdict = "killed" if row["killed"] else "SURVIVED"
            print(
                f"{row['mutant']:34s} {row['side']:7s} {verdict:8s} "
                f"{row['kills']:>5s} median {row['schedules_to_kill']!s:>5s} schedules  "
                f"{row['seconds']:6.1f}s  by {row['killed_by']}",
                flush=True,
            )
    if a.json:
        keys = (
            "mutant",
            "side",
            "killed",
            "killed_by",
            "schedules_to_kill",
            "kills_per_seed",
            "seconds",
        )
        print(json.dumps([{k: r[k] for k in keys} for r in rows]))
    return 0 if all(r["killed"] for r in rows) else 1


def register(sub) -> None:
    p = sub.add_parser("fuzz", help="fuzz schedules of the engine (controlled interleavings)")
    p.add_argument(
        "--mode",
        choices=PREFILL_LOOPS,
        default=None,
        help="prefill loop (default ahead; with --pd: drawn per schedule unless given)",
    )
    p.add_argument(
        "--pd",
        action="store_true",
        help="fuzz whole PD runs (prefill ranks + bootstrap + decode), a case drawn per schedule",
    )
    p.add_argument(
        "--inject",
        action="append",
        type=d.one_of(ALL_MUTANTS, "a mutant (--list-mutants)"),
        metavar="MUTANT",
        help="turn on a bug (repeatable)",
    )
    # dfs: prefill only
    p.add_argument("--strategy", choices=["pct", "random", "dfs"], default="pct")
    p.add_argument("--schedules", type=d.integer(1, 1_000_000), default=50)
    p.add_argument("--seed", type=d.seed(), default=0)
    p.add_argument(
        "--jobs",
        type=d.integer(1, 256),
        default=1,
        help="run the schedules in N worker processes (same verdicts and replay command as 1)",
    )
    add_ray_args(p, "the schedules")
    p.add_argument(
        "--model-every",
        type=d.integer(0, 1_000_000),
        default=MODEL_EVERY,
        metavar="N",
        help=f"judge refinement (z3, the costly judge) on every N-th schedule by index; 1: every "
        f"schedule, 0: none (default {MODEL_EVERY})",
    )
    p.add_argument(
        "--model-timeout-ms",
        type=d.integer(1, 3_600_000),
        default=MODEL_TIMEOUT_MS,
        metavar="MS",
        help=f"z3's time per trace for refinement; past it the trace is counted not judged "
        f"(default {MODEL_TIMEOUT_MS})",
    )
    p.add_argument("--requests", type=d.integer(1, MAX_CASE_REQUESTS), default=5)
    p.add_argument("--hit", type=d.ratio(), default=0.8)
    p.add_argument("--workload-seed", type=d.seed(), default=0)
    p.add_argument(
        "--num-pages",
        type=d.integer(2, 65536),
        default=None,
        help="KV pool pages (every pool of a PD case); default: drawn per schedule near the "
        "working set",
    )
    p.add_argument(
        "--slots",
        type=d.integer(1, 1024),
        default=None,
        help="prefill request slots; default: drawn per schedule, 1 to requests+1",
    )
    p.add_argument(
        "--replay",
        type=d.path(),
        metavar="FILE",
        help="replay a saved case (.case.json or .shrunk.json), strictly: a schedule step that "
        "does not fit is reported as diverged (exit 3)",
    )
    p.add_argument(
        "--trace",
        type=d.path(),
        metavar="FILE",
        help="with --replay: write the replayed trace here",
    )
    p.add_argument(
        "--mutants",
        action="store_true",
        help="the mutant table: schedules to first kill per mutant",
    )
    p.add_argument(
        "--seeds",
        type=d.integer(1, 1000),
        default=5,
        help="with --mutants: seeds to take the median over",
    )
    p.add_argument("--list-mutants", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--progress", action="store_true", help="show progress even when stderr is not a terminal"
    )
    p.add_argument(
        "--out", type=d.path(), default="fuzz-out", help="where failing cases are written"
    )
    p.set_defaults(fn=cmd_fuzz)
