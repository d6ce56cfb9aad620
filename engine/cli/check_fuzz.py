"""A fuzz campaign of `pdo check` itself: mutated traces (checker/fuzz/trace_mutate.py) through
engine.cli.main, every answer classified by exit code (scripts/fuzz_check.py, tests/test_check_fuzz.py).

A case passes when `pdo check` ends with 0, 1, 2 or 3 and, for 2 (bad input), says so in one
line that starts with the trace's path; an internal error (70) is a checker bug, kept with its
seed and mutations so that it can be replayed."""

from __future__ import annotations

import contextlib
import io
import os
import random
import time
from collections import Counter

from checker.fuzz.trace_mutate import mutate
from engine.cli import exits

VERDICTS = {exits.OK, exits.FAILED, exits.BAD_INPUT, exits.INCOMPLETE}


def check_once(path: str, extra: list[str], parser=None) -> tuple[int, str]:
    """`pdo check [extra] path` in this process: (exit code, what it wrote on stderr)."""
    from engine.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["check", *extra, path], parser=parser)
    return rc, err.getvalue()


def problem(rc: int, err: str, path: str) -> str | None:
    """What is wrong with this answer of `pdo check`, or None."""
    if rc not in VERDICTS:
        return f"exit {rc}: {err.strip()[:300]}"
    if rc == exits.BAD_INPUT:
        lines = err.strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith(f"pdo check: error: {path}"):
            return f"bad input not one line starting with the path: {err.strip()[:300]!r}"
    return None


def campaign(
    seeds: list[bytes],
    cases: int,
    seed: int,
    workdir: str,
    *,
    json_every: int = 10,
    z3_every: int = 50,
) -> dict:
    """`cases` mutants of the seed traces, each checked once (every `json_every`-th with --json,
    every `z3_every`-th with --engine z3). Returns counts by exit code, the problems found (case,
    mutations, what was wrong) and the wall time."""
    from engine.cli import build_parser

    parser = build_parser()  # built once: building it costs more than checking a small trace
    t0 = time.perf_counter()
    counts: Counter[int] = Counter()
    problems = []
    for case in range(cases):
        rng = random.Random(f"{seed}:{case}")
        base = rng.randrange(len(seeds))
        data, names = mutate(seeds[base], rng)
        path = os.path.join(workdir, f"case{case}.jsonl")
        with open(path, "wb") as f:
            f.write(data)
        extra = []
        if json_every and case % json_every == json_every - 1:
            extra.append("--json")
        if z3_every and case % z3_every == z3_every - 1:
            extra += ["--engine", "z3"]
        rc, err = check_once(path, extra, parser)
        counts[rc] += 1
        why = problem(rc, err, path)
        if why:
            problems.append({"case": case, "seed_trace": base, "mutations": names, "why": why})
        else:
            os.remove(path)  # a failing case's file is kept to replay it
    return {
        "counts": dict(sorted(counts.items())),
        "problems": problems,
        "seconds": time.perf_counter() - t0,
    }
