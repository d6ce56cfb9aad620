"""`pdo conform sglang`: run SGLang's real scheduler code on CPU with the adapter on, and check
every trace.

    decode_scenarios   SGLang's real decode loops and prealloc queue, scripted (SCRIPTS)
    prefill_fakes      the stand-ins for what the prefill scheduler does on a GPU or the network
    prefill_scheduler  SGLang's real prefill Scheduler, built on those fakes
    prefill_run        one prefill workload through SGLang's real prefill loop
    prefill_scenarios  the prefill workloads (SCENARIOS) and the rules they are known to fail
    decode_context     a decode server's configuration, published as SGLang's launcher does
    reachable          direct calls of SGLang internals and their real callers' preconditions
    faults, lifecycle  the transfer failures the matrix injects; the invariants it checks
    decode_life        the decode lifecycle x fault matrix (real process_decode_queue, real pools)
    prefill_life       the prefill lifecycle x fault matrix (the real prefill loops)
    mutants            real-code mutations of SGLang's methods (DECODE_MUTANTS, PREFILL_MUTANTS)
    driver             runs the scenarios and judges each trace (the outcomes, FINDINGS)
    command            the command: which scenarios run, and what it prints

This module is the sub-command's entry (engine/cli.py registers it): the parser, and the version
check that comes before anything imports SGLang or torch.

Exit codes: 0 every scenario met its expectation, 1 otherwise, 2 SGLang missing, not installed in
the version asked for, or below the supported range.
"""

from __future__ import annotations

import sys

from checker.parallel import add_ray_args
from engine.sglang import SGLangUnavailable, check_version, range_warning, versions
from spec import domains as d


def register(sub) -> None:
    p = sub.add_parser(
        "conform", help="check SGLang's own scheduler code against the rules (docs/sglang.md)"
    )
    p.add_argument("target", choices=["sglang"], help="the system to check")
    p.add_argument(
        "--trace-dir",
        type=d.path(),
        default=None,
        help="keep the traces here (default: a temporary folder)",
    )
    p.add_argument(
        "--scenario",
        action="append",
        type=d.text(),
        default=None,
        help="run only this scenario (repeatable; a prefix such as 'decode-' selects several)",
    )
    p.add_argument(
        "--mutant", type=d.text(), default=None, help="apply this real-code mutation (see --list)"
    )
    p.add_argument(
        "--fuzz",
        type=d.integer(0, 100_000),
        default=0,
        metavar="N",
        help="also run each scenario under N controlled schedules (decode: thread interleavings of "
        "the scheduler and the prefetch pool; prefill: when transfers and copies complete)",
    )
    p.add_argument(
        "--fuzz-seed",
        type=d.seed(),
        default=None,
        metavar="S",
        help="run each scenario under schedule S only (what a failing --fuzz run prints to replay)",
    )
    p.add_argument(
        "--stop-at-first",
        action="store_true",
        help="stop at the first run that does not meet its expectation (with --ray: cancel the "
        "runs not yet done)",
    )
    add_ray_args(p, "each (scenario, schedule) run")
    p.add_argument(
        "--progress", action="store_true", help="show progress even when stderr is not a terminal"
    )
    p.add_argument(
        "--list", action="store_true", help="list the scenarios and the mutants, then exit"
    )
    p.add_argument(
        "--sglang-version",
        type=d.text(),
        default=None,
        metavar="V",
        help="check SGLang release V, installed side by side "
        "(python -m engine.sglang.versions install V); default: the one .venv has",
    )
    p.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    p.set_defaults(fn=cmd_conform)


def cmd_conform(a) -> int:
    try:
        if a.sglang_version is not None:
            versions.use(a.sglang_version)
        version = check_version()
    except (SGLangUnavailable, versions.VersionError) as exc:
        print(f"pdo conform: {exc}", file=sys.stderr)
        return 2
    warning = range_warning(version)
    if warning:
        print(f"pdo conform: warning: {warning}", file=sys.stderr)
    # lazy: the scenarios import torch and build on SGLang; every other `pdo` command starts without
    from engine.sglang.conform import command

    return command.run(a)
