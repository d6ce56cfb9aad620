"""`pdo check --ray [ADDRESS] DIR...`: every trace set under the folders (checker/trace_sets.py),
each one a Ray task, checked as `pdo check` checks its files; one line per set, the whole report of
a set that is not a pass, and the exit code of the worst set (a violation, then bad input, then
no verdict)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from checker.parallel import RAY_LOCAL, Progress, executor, in_order, ray_summary
from checker.trace_sets import check_set, fleet_code, line, summary, trace_sets
from spec.errors import BadInput

# What `pdo check` does beyond the rules, not run per set on Ray (yet).
_SINGLE_ONLY = {
    "--engine z3": lambda a: a.engine == "z3",
    "--model": lambda a: a.model,
    "--perfetto": lambda a: a.perfetto,
    "--predict": lambda a: a.predict,
    "--confirm": lambda a: a.confirm,
}


def validate(args: argparse.Namespace, argv) -> None:
    """`pdo check --ray DIR`: argparse gives DIR to --ray (its ADDRESS is optional); a value of
    --ray that names an existing file or folder is a trace path, and Ray starts here."""
    if args.ray not in (None, RAY_LOCAL) and os.path.exists(args.ray):
        args.traces, args.ray = [args.ray, *args.traces], RAY_LOCAL
    if not args.traces:
        raise BadInput("the following arguments are required: TRACE")
    if args.ray is None:
        if args.ray_cpus is not None:
            raise BadInput("--ray-cpus sizes the Ray instance --ray starts here; it needs --ray")
        return
    given = [name for name, on in _SINGLE_ONLY.items() if on(args)]
    if given:
        raise BadInput(f"{given[0]}: not with --ray, which checks each set with the rules only")


def cmd_check_ray(args: argparse.Namespace) -> int:
    sets = trace_sets(args.traces)
    t0 = time.perf_counter()
    with executor(ray=args.ray, ray_cpus=args.ray_cpus) as pool:
        t1 = time.perf_counter()
        prog = Progress(len(sets), args.progress or sys.stderr.isatty(), unit="trace sets")
        verdicts, events = [], 0
        for v in in_order(pool, check_set, ((s,) for s in sets)):
            verdicts.append(v)
            events += v.events
            prog(len(verdicts), events, v.code != 0)
        _rate(events, t0, t1, time.perf_counter())
        ray_summary("check", pool)
    if args.json:
        print(json.dumps([_json(v) for v in verdicts], indent=1))
    else:
        for v in verdicts:
            print(line(v))
            if v.code not in (0, 2):
                print(v.text)
        print(summary(verdicts))
    return fleet_code(verdicts)


def _rate(events: int, t0: float, t1: float, t2: float) -> None:
    """The throughput line on stderr: events a second, with and without Ray's start-up."""
    print(
        f"pdo check: {events} events in {t2 - t0:.1f} s, {events / max(t2 - t0, 1e-9):,.0f} "
        f"events/s; Ray's start-up {t1 - t0:.1f} s, {events / max(t2 - t1, 1e-9):,.0f} events/s "
        "after it",
        file=sys.stderr,
    )


def _json(v) -> dict:
    return {
        "set": v.name,
        "traces": list(v.paths),
        "exit": v.code,
        "events": v.events,
        "error": v.error,
        "reports": v.reports,
    }
