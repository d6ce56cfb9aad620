"""Fuzz `pdo check` with mutated traces and print counts by exit code and the time.

    PYTHONPATH=. .venv/bin/python scripts/fuzz_check.py --cases 10000 --seed 1

Seed traces: the hand-written canonical prefill traces of the four modes (tests/trace_fixtures.py)
and, unless --no-engine, one `pdo run` trace (ahead, 3 requests). Exits 1 if any case ended in an
internal error or a bad-input message that is not one line starting with the path (each listed with
its case number, seed trace and mutations; replay one with --cases N+1 --only N).

--deletions instead deletes each line of engine traces in turn (one `pdo run` trace per prefill mode
and the three traces of a `pdo run --pd --dp 2` run, checked together), every line unless
--per-kind K (the header and K lines of each event kind): exits 1 if any case passed (exit 0) or
ended otherwise than in a verdict or a one-line bad-input error naming the file and line.

    PYTHONPATH=. .venv/bin/python scripts/fuzz_check.py --deletions"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
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


def deletions(per_kind: int | None) -> int:
    from engine.cli import main as pdo
    from engine.cli.check_deletions import campaign

    with tempfile.TemporaryDirectory() as d:
        sets = []
        with contextlib.redirect_stdout(io.StringIO()):
            for m in ("normal", "overlap", "thread", "ahead"):
                path = str(Path(d) / f"{m}.jsonl")
                if pdo(["run", "--mode", m, "--requests", "3", "--trace", path]) != 0:
                    sys.exit(f"the {m} run failed")
                sets.append([path])
            if pdo(["run", "--pd", "--dp", "2", "--requests", "4", "--trace", f"{d}/pd.jsonl"]):
                sys.exit("the PD run failed")
        sets.append([f"{d}/pd.{r}.jsonl" for r in ("decode", "prefill0", "prefill1")])
        t0 = time.perf_counter()
        res = campaign(sets, str(Path(d) / "cases"), per_kind=per_kind)
        for path, line, why in res["problems"]:
            print(f"PROBLEM {Path(path).name} without line {line}: {why}")
    counts = ", ".join(f"exit {k}: {v}" for k, v in res["counts"].items())
    print(
        f"pdo check deletions: {sum(res['counts'].values())} cases ({len(sets)} trace sets, "
        f"{len(res['kinds'])} event kinds): {counts}; {len(res['problems'])} problem(s); "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return 1 if res["problems"] else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-engine", action="store_true", help="fixture seed traces only")
    ap.add_argument("--deletions", action="store_true", help="delete each line of engine traces")
    ap.add_argument("--per-kind", type=int, default=None, help="with --deletions: a sample")
    a = ap.parse_args()
    if a.deletions:
        return deletions(a.per_kind)
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
