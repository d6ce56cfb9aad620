"""Which mutants write uncontrolled traces that pass `pdo check`, and whether
`pdo check --predict` finds them from those passing traces (docs/fuzzing.md, "Predictive analysis").

    PYTHONPATH=. .venv/bin/python scripts/predict_mutants.py --runs 5 [--modes ahead] [--mutants M ...]
    PYTHONPATH=. .venv/bin/python scripts/predict_mutants.py --pd --runs 3 [--dp 1 2] [--prefetch on off]

Each mutant runs uncontrolled (`pdo run --hb --inject M`, workload seeds 0..runs-1); of the traces
that pass `pdo check`, how many `pdo check --predict` flags, and whether the first prediction of a
flagged trace is confirmed under the controller (`--confirm`). With `--pd` each run is
`pdo run --pd --hb` (the prefill and the decode mutants; every role's trace counted, judged with
its run's other traces for the cross-process rules), for each prefill mode, `--dp` and `--prefetch`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time

from checker.fuzz.confirm import confirm
from checker.linear import check_file, check_files
from checker.predict import predict_file
from engine.cli import main as pdo
from engine.runs.pd import trace_paths
from engine.runtime import inject
from engine.sync import hb


def one(mutant: str | None, mode: str, seed: int, path: str) -> None:
    argv = ["run", "--hb", "--mode", mode, "--requests", "16", "--workload-seed", str(seed)]
    argv += ["--no-verify", "--trace", path] + (["--inject", mutant] if mutant else [])
    with contextlib.redirect_stdout(io.StringIO()):
        pdo(argv)


def one_pd(mutant: str | None, mode: str, dp: int, prefetch: bool, seed: int, stem: str) -> list:
    argv = ["run", "--pd", "--hb", "--mode", mode, "--dp", str(dp), "--requests", "8"]
    argv += ["--workload-seed", str(seed), "--no-verify", "--trace", stem]
    argv += ([] if prefetch else ["--no-prefetch"]) + (["--inject", mutant] if mutant else [])
    decode, prefills = trace_paths(stem, dp)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        pdo(argv)
    return [p for p in [decode, *prefills] if os.path.exists(p)]


def judge(path: str, stats: dict) -> None:
    """Predict one passing trace; confirm its first prediction."""
    stats["passing"] += 1
    t = time.perf_counter()
    r = predict_file(path)
    stats["times"].append(time.perf_counter() - t)
    if not r.ok:
        stats["predicted"] += 1
        stats["rules"] |= {p.rule.id for p in r.predictions}
        stats["confirmed"] += confirm(path, r.header, r.predictions[0]).confirmed


def row(label: str, total: int, st: dict) -> str:
    med = f"{statistics.median(st['times']) * 1e3:.0f} ms" if st["times"] else "-"
    names = f" ({', '.join(sorted(st['rules']))})" if st["rules"] else ""
    conf = f"{st['confirmed']}/{st['predicted']}" if st["predicted"] else "-"
    return f"| {label} | {st['passing']}/{total} | {st['predicted']}/{st['passing']}{names} | {conf} | {med} |"


def table_head(run: str, passing: str) -> None:
    """The table's first two lines: `run` names the second column, `passing` the third."""
    print(f"| mutant | {run} | {passing} | predicted | confirmed | predict time |")
    print("|---|---|---|---|---|---|")


def new_stats() -> dict:
    return dict(passing=0, predicted=0, confirmed=0, times=[], rules=set())


def main_pd(args, mutants) -> None:
    table_head("prefill mode, dp, prefetch", "passing traces")
    with tempfile.TemporaryDirectory() as d:
        for m in mutants:
            for mode in args.modes:
                for dp in args.dp:
                    for pf in args.prefetch:
                        st = new_stats()
                        total = 0
                        for seed in range(args.runs):
                            stem = os.path.join(d, f"t{seed}.jsonl")
                            for old in os.listdir(d):
                                os.unlink(os.path.join(d, old))
                            traces = one_pd(m, mode, dp, pf == "on", seed, stem)
                            total += dp + 1  # a run that wrote no trace passes none
                            results = check_files(traces) if traces else []
                            # a cross-process violation fails every trace of the run
                            cross_ok = all(passes(r) for r in results[len(traces) :])
                            for path, res in zip(traces, results):
                                if passes(res) and cross_ok:
                                    judge(path, st)
                        label = f"{m or '(none)'} | {mode}, dp {dp}, prefetch {pf}"
                        print(row(label, total, st), flush=True)


def passes(result) -> bool:
    """What `pdo check` passes (exit 0): no rule broken, on a whole trace. A run that ended by an
    exception (a mutant's engine found stuck) leaves a truncated trace: INCOMPLETE, not a pass."""
    return result.ok and result.complete


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["normal", "overlap", "thread", "ahead"])
    ap.add_argument("--mutants", nargs="*", default=None)
    ap.add_argument("--pd", action="store_true", help="PD runs (pdo run --pd), every role's trace")
    ap.add_argument("--dp", nargs="+", type=int, default=[2], help="with --pd: prefill DP ranks")
    ap.add_argument("--prefetch", nargs="+", choices=["on", "off"], default=["on"])
    args = ap.parse_args()
    hb.enable()
    every = [*inject.MUTANTS, *(inject.DECODE_MUTANTS if args.pd else ())]
    mutants = [None, *(args.mutants if args.mutants is not None else every)]
    if args.pd:
        if args.modes == ap.get_default("modes"):
            args.modes = ["ahead"]
        return main_pd(args, mutants)
    table_head("mode", "passing `pdo check`")
    with tempfile.TemporaryDirectory() as d:
        for m in mutants:
            for mode in args.modes:
                st = new_stats()
                for seed in range(args.runs):
                    path = os.path.join(d, f"t{seed}.jsonl")
                    one(m, mode, seed, path)
                    if passes(check_file(path)):
                        judge(path, st)
                print(row(f"{m or '(none)'} | {mode}", args.runs, st), flush=True)


if __name__ == "__main__":
    main()
