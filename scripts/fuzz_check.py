"""Fuzz `pdo check` with mutated traces and print counts by exit code and the time.

    PYTHONPATH=. .venv/bin/python scripts/fuzz_check.py --cases 10000 --seed 1

Seed traces: the hand-written canonical prefill traces of the four modes (tests/trace_fixtures.py)
and, unless --no-engine, one `pdo run` trace (ahead, 3 requests). Exits 1 if any case ended in an
internal error or a bad-input message that is not one line starting with the path (each listed with
its case number, seed trace and mutations; replay one with --cases N+1 --only N)."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path


def seed_traces(workdir: str, engine: bool) -> list[bytes]:
    from tests.trace_fixtures import canonical, write

    paths = [
        write(Path(workdir) / f"seed-{m}.jsonl", m, canonical(m))
        for m in ("normal", "overlap", "thread", "ahead")
    ]
    if engine:
        from engine.cli import main

        run = str(Path(workdir) / "seed-run.jsonl")
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(["run", "--requests", "3", "--mode", "ahead", "--trace", run])
        if rc != 0:
            sys.exit(f"the seed run failed (exit {rc})")
        paths.append(run)
    return [Path(p).read_bytes() for p in paths]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-engine", action="store_true", help="fixture seed traces only")
    a = ap.parse_args()
    from engine.cli.check_fuzz import campaign

    with tempfile.TemporaryDirectory() as d:
        seeds = seed_traces(d, not a.no_engine)
        res = campaign(seeds, a.cases, a.seed, d)
        for p in res["problems"]:
            print(
                f"PROBLEM case {p['case']} (seed trace {p['seed_trace']}, {'+'.join(p['mutations'])}): {p['why']}"
            )
    counts = ", ".join(f"exit {k}: {v}" for k, v in res["counts"].items())
    print(
        f"pdo check fuzz: {a.cases} cases, seed {a.seed}, {len(seeds)} seed traces: {counts}; "
        f"{len(res['problems'])} problem(s); {res['seconds']:.1f} s"
    )
    return 1 if res["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
