"""`pdo fuzz`: controlled-schedule fuzzing of the engine, replay of a saved case, and the mutant table."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

from engine.inject import MUTANTS

from .fuzz import Case, Replay, find_bug, load_case, run_case, save_case, shrink

# The workload each mutant is hunted with: small enough for hundreds of schedules a minute, rich
# enough to exercise what the bug breaks (chunked requests, cached prefixes, logit bias).
MUTANT_MODE = {m: "ahead" for m in MUTANTS}


class Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.t0 = total, enabled, time.perf_counter()

    def __call__(self, done: int, events: int, failed: bool):
        if not self.enabled:
            return
        width = 24
        fill = int(width * done / max(1, self.total))
        rate = events / max(1e-9, time.perf_counter() - self.t0)
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} schedules, "
                         f"{events} events checked ({rate:,.0f}/s), violations: {int(failed)}")
        sys.stderr.flush()
        if done == self.total or failed:
            sys.stderr.write("\n")


def _case_from_args(a) -> Case:
    return Case(mode=a.mode, inject=tuple(a.inject or ()), requests=a.requests, hit=a.hit, workload_seed=a.workload_seed)


def cmd_fuzz(a) -> int:
    if a.list_mutants:
        for name, what in MUTANTS.items():
            print(f"{name:34s} {what}")
        return 0
    if a.replay:
        case, schedule, meta = load_case(a.replay)
        out = run_case(case, Replay(schedule, strict=False), trace_path=a.trace)
        print(f"replayed {a.replay}: {len(out.schedule)} steps, {out.events} events")
        for f in out.failures:
            print(f"  FAIL {f}")
        if not out.failures:
            print("  no failure")
        return 1 if out.failed else 0
    if a.mutants:
        return _mutant_table(a)
    case = _case_from_args(a)
    prog = Progress(a.schedules, a.progress or sys.stderr.isatty())
    idx, out = find_bug(case, a.strategy, schedules=a.schedules, seed=a.seed, on_progress=prog)
    if idx is None:
        print(f"pdo fuzz: mode={case.mode} strategy={a.strategy} inject={list(case.inject) or '-'}: "
              f"{a.schedules} schedules, {out} events, no violation")
        return 0
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"fuzz-{case.mode}-{a.strategy}-s{a.seed}-{idx}")
    save_case(stem + ".case.json", case, out.schedule, out.failures, strategy=a.strategy, seed=a.seed, index=idx)
    small, sched, small_out = shrink(case, out.schedule, out.failures)
    save_case(stem + ".shrunk.json", small, sched, small_out.failures, shrunk_from=stem + ".case.json")
    run_case(small, Replay(sched, strict=False), trace_path=stem + ".trace.jsonl")
    print(f"pdo fuzz: failure after {idx + 1} schedule(s) ({a.strategy}, seed {a.seed}):")
    for f in out.failures[:6]:
        print(f"  {f}")
    print(f"  shrunk to {small.requests} request(s), {len(sched)} schedule steps: {', '.join(small_out.failures[:3])}")
    print(f"  trace: {stem}.trace.jsonl   case: {stem}.case.json")
    print(f"replay: pdo fuzz --replay {stem}.shrunk.json")
    return 1


def mutant_row(name: str, *, strategy: str, seeds, budget: int) -> dict:
    """Schedules to first kill of `name`, as a median over seeds."""
    case = Case(mode=MUTANT_MODE[name], inject=(name,), requests=6, hit=0.8)
    kills, killed_by, t0 = [], None, time.perf_counter()
    for seed in seeds:
        idx, out = find_bug(case, strategy, schedules=budget, seed=seed)
        if idx is not None:
            kills.append(idx + 1)
            killed_by = killed_by or out.killed_by
    return {"mutant": name, "killed": len(kills) == len(seeds), "killed_by": killed_by,
            "schedules_to_kill": statistics.median(kills) if kills else None,
            "kills": f"{len(kills)}/{len(seeds)}", "seconds": round(time.perf_counter() - t0, 2)}


def _mutant_table(a) -> int:
    names = a.inject or list(MUTANTS)
    seeds = range(a.seed, a.seed + a.seeds)
    rows = []
    for name in names:
        row = mutant_row(name, strategy=a.strategy, seeds=seeds, budget=a.schedules)
        rows.append(row)
        if not a.json:
            print(f"{row['mutant']:34s} {'killed' if row['killed'] else 'SURVIVED':8s} {row['kills']:>5s} "
                  f"median {row['schedules_to_kill']!s:>5s} schedules  {row['seconds']:6.1f}s  by {row['killed_by']}",
                  flush=True)
    if a.json:
        print(json.dumps([{k: r[k] for k in ("mutant", "killed", "killed_by", "schedules_to_kill", "seconds")} for r in rows]))
    return 0 if all(r["killed"] for r in rows) else 1


def register(sub) -> None:
    p = sub.add_parser("fuzz", help="fuzz schedules of the engine (controlled interleavings)")
    p.add_argument("--mode", choices=["normal", "overlap", "thread", "ahead"], default="ahead")
    p.add_argument("--inject", action="append", metavar="MUTANT", help="turn on a bug (repeatable)")
    p.add_argument("--strategy", choices=["pct", "random", "dfs"], default="pct")
    p.add_argument("--schedules", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--hit", type=float, default=0.8)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--replay", metavar="FILE", help="replay a saved case (.case.json or .shrunk.json)")
    p.add_argument("--trace", metavar="FILE", help="with --replay: write the replayed trace here")
    p.add_argument("--mutants", action="store_true", help="the mutant table: schedules to first kill per mutant")
    p.add_argument("--seeds", type=int, default=5, help="with --mutants: seeds to take the median over")
    p.add_argument("--list-mutants", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--progress", action="store_true", help="show progress even when stderr is not a terminal")
    p.add_argument("--out", default="fuzz-out", help="where failing cases are written")
    p.set_defaults(fn=cmd_fuzz)
