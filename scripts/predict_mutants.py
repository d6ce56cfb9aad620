"""Which prefill mutants write uncontrolled traces that pass `pdo check`, and whether
`pdo check --predict` finds them from those passing traces (docs/fuzzing.md, "Predictive analysis").

    PYTHONPATH=. .venv/bin/python scripts/predict_mutants.py --runs 5 [--modes ahead] [--mutants M ...]

Each mutant runs uncontrolled (`pdo run --hb --inject M`, workload seeds 0..runs-1); of the traces
that pass `pdo check`, how many `pdo check --predict` flags, and whether the first prediction of a
flagged trace is confirmed under the controller (`--confirm`).
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
from checker.linear import check_file
from checker.predict import predict_file
from engine import hb, inject
from engine.cli import main as pdo


def one(mutant: str | None, mode: str, seed: int, path: str) -> None:
    argv = ["run", "--hb", "--mode", mode, "--requests", "16", "--workload-seed", str(seed)]
    argv += ["--no-verify", "--trace", path] + (["--inject", mutant] if mutant else [])
    with contextlib.redirect_stdout(io.StringIO()):
        pdo(argv)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["normal", "overlap", "thread", "ahead"])
    ap.add_argument("--mutants", nargs="*", default=None)
    args = ap.parse_args()
    hb.enable()
    mutants = [None, *(args.mutants if args.mutants is not None else inject.MUTANTS)]
    print(
        "| mutant | mode | passing `pdo check` | predicted (of passing) | confirmed | predict time |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for m in mutants:
            for mode in args.modes:
                passing = predicted = confirmed = 0
                times, rules = [], set()
                for seed in range(args.runs):
                    path = os.path.join(d, f"t{seed}.jsonl")
                    one(m, mode, seed, path)
                    if not check_file(path).ok:
                        continue
                    passing += 1
                    t = time.perf_counter()
                    r = predict_file(path)
                    times.append(time.perf_counter() - t)
                    if not r.ok:
                        predicted += 1
                        rules |= {p.rule.id for p in r.predictions}
                        confirmed += confirm(path, r.header, r.predictions[0]).confirmed
                med = f"{statistics.median(times) * 1e3:.0f} ms" if times else "-"
                names = f" ({', '.join(sorted(rules))})" if rules else ""
                print(
                    f"| {m or '(none)'} | {mode} | {passing}/{args.runs} | {predicted}/{passing}{names} | "
                    f"{f'{confirmed}/{predicted}' if predicted else '-'} | {med} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
