"""The cost of refining the decode trace of drawn PD fuzz cases (checker/refine.py), and how many the
decode loop model judges: `PYTHONPATH=. .venv/bin/python scripts/decode_refine_cost.py [N]`.

Draws N cases (checker/fuzz/cases.py draw_pd_case, random.Random(1)), runs each under PCT (seed =
its index, 400 steps), refines its decode trace with the fuzz judge's timeout, and prints one line
per case, then the counts and the mean and max seconds of the judged ones.
"""

from __future__ import annotations

import collections
import os
import random
import sys
import tempfile
import time

from checker.fuzz.cases import draw_pd_case
from checker.fuzz.runs import MODEL_TIMEOUT_MS, run_case
from checker.fuzz.strategies import make_strategy
from checker.refine import check_model


def main(n: int) -> None:
    rng, counts, seconds = random.Random(1), collections.Counter(), []
    for i in range(n):
        case = draw_pd_case(rng)
        with tempfile.TemporaryDirectory() as d:
            stem = os.path.join(d, "t.jsonl")
            run_case(case, make_strategy("pct", i, steps=400), trace_path=stem)
            path = os.path.join(d, "t.decode.jsonl")
            if not os.path.exists(path):
                counts["no trace"] += 1
                continue
            t0 = time.perf_counter()
            check = check_model(path, MODEL_TIMEOUT_MS)
            dt = time.perf_counter() - t0
        status = check.answer.status
        counts[status] += 1
        if check.judged:
            seconds.append(dt)
        reason = (check.answer.reason or "")[:80]
        print(f"{i} {status} {dt:.2f}s {len(check.events)} events {check.answer.groups} {reason}")
    print(dict(counts))
    if seconds:
        print(f"judged: mean {sum(seconds) / len(seconds):.2f} s, max {max(seconds):.2f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
