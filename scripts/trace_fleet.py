"""Write a fleet of trace sets: N runs of `pdo run` (even i) and `pdo run --pd` (odd i), every fifth
under a mutant (a prefill one that breaks P-collect-before-sample in every run: its scheduler's own
order; a decode one, whose bug is race-dependent),
for `pdo check --ray DIR` (docs/scale.md, tests/checker/fuzz/test_ray.py).

    PYTHONPATH=. .venv/bin/python scripts/trace_fleet.py /tmp/fleet 200 [--requests 4]"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cli import main  # noqa: E402


def argv_of(out: str, i: int, requests: int = 4) -> list[str]:
    """The `pdo run` command line of run i."""
    size = ["--requests", str(requests), "--seed", str(i)]
    if i % 2:
        argv = ["run", "--pd", *size, "--trace", f"{out}/pd{i:03d}.jsonl"]
    else:
        argv = ["run", *size, "--trace", f"{out}/run{i:03d}.jsonl"]
    if i % 5 == 4:
        argv[1:1] = ["--inject", "double-prefetch" if i % 2 else "sample-before-collect"]
    return argv


def write(out: str, n: int, requests: int = 4) -> None:
    os.makedirs(out, exist_ok=True)
    for i in range(n):
        argv = argv_of(out, i, requests)
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(argv)
        if rc not in (0, 1):  # 1: a mutant's outputs differ from the reference, as it should
            raise SystemExit(f"pdo {' '.join(argv)}: exit {rc}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("n", type=int)
    p.add_argument("--requests", type=int, default=4, help="requests of each run")
    a = p.parse_args()
    write(a.out, a.n, a.requests)
