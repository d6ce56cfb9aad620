"""Deletion cases of `pdo check` (issue 29, defect 1): a set of traces (one file, or the files of one
PD run) with one line taken out of one file must never pass. The header's deletion is bad input, the
trace_end's a truncated trace (no verdict), any event's lost events (bad input).

scripts/fuzz_check.py --deletions runs every line of engine traces; tests/checker/test_lost_events.py
a sample that covers every event kind."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
from collections import Counter


def check_set(paths: list[str], parser=None) -> tuple[int, str]:
    """`pdo check PATHS...` in this process: (exit code, what it wrote on stderr)."""
    from engine.cli import main  # lazy: a module of the CLI package, imported by scripts and tests

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["check", *paths], parser=parser)
    return rc, err.getvalue()


def problem(rc: int, err: str, paths: list[str]) -> str | None:
    """What is wrong with `pdo check`'s answer on a set missing a line, or None."""
    if rc == 0:
        return "passed"
    if rc not in (1, 2, 3):
        return f"exit {rc}: {err.strip()[:300]}"
    if rc == 2:
        lines = err.strip().splitlines()
        if len(lines) != 1 or not any(
            lines[0].startswith(f"pdo check: error: {p}:") for p in paths
        ):
            return f"bad input not one line naming a file and line: {err.strip()[:300]!r}"
    return None


def lines_to_delete(path: str, per_kind: int | None, rng: random.Random) -> list[int]:
    """0-based line indices of `path` to delete one at a time: every line (`per_kind` None), or
    the header, and up to `per_kind` lines of each event kind (its first, its last, others drawn)."""
    with open(path, "rb") as f:
        lines = f.read().splitlines()
    if per_kind is None:
        return list(range(len(lines)))
    by_kind: dict = {}
    for i, line in enumerate(lines[1:], 1):
        by_kind.setdefault(json.loads(line)["ev"], []).append(i)
    picked = {0}
    for idx in by_kind.values():
        picked.update([idx[0], idx[-1]])
        picked.update(rng.sample(idx, min(len(idx), max(per_kind - 2, 0))))
    return sorted(picked)


def campaign(sets: list[list[str]], workdir: str, *, per_kind: int | None = None, seed: int = 0):
    """Each set with each chosen line of each of its files deleted, checked as a set. Returns
    {counts: exit code -> cases, kinds: the event kinds deleted, problems: [(file, line, why)]}."""
    from engine.cli import build_parser  # lazy: as main above

    parser = build_parser()
    rng = random.Random(seed)
    counts: Counter = Counter()
    kinds: set = set()
    problems = []
    for n, paths in enumerate(sets):
        d = os.path.join(workdir, f"set{n}")
        os.makedirs(d, exist_ok=True)
        copies = [os.path.join(d, os.path.basename(p)) for p in paths]
        for p, c in zip(paths, copies):
            shutil.copyfile(p, c)
        for p, c in zip(paths, copies):
            with open(p, "rb") as f:
                lines = f.read().splitlines(keepends=True)
            for i in lines_to_delete(p, per_kind, rng):
                if i:
                    kinds.add(json.loads(lines[i])["ev"])
                with open(c, "wb") as f:
                    f.write(b"".join(lines[:i] + lines[i + 1 :]))
                rc, err = check_set(copies, parser)
                counts[rc] += 1
                why = problem(rc, err, copies)
                if why:
                    problems.append((p, i + 1, why))
            shutil.copyfile(p, c)
    return {"counts": dict(sorted(counts.items())), "kinds": sorted(kinds), "problems": problems}
