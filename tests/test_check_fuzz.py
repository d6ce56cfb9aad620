"""Fuzz `pdo check` with mutated traces (checker/fuzz/trace_mutate.py): every answer is a verdict
(0, 1, 3) or a one-line bad-input error starting with the path (2), never an internal error (70).

300 cases in CI (seconds); PDO_FUZZ_BUDGET=N multiplies them (docs/fuzzing.md). The 10,000-case
campaign is scripts/fuzz_check.py (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import random

from checker import trace_io
from checker.fuzz.trace_mutate import MUTATIONS, mutate
from engine.cli import exits
from engine.cli.check_fuzz import campaign, check_once, problem
from tests.trace_fixtures import canonical, write

SCALE = int(os.environ.get("PDO_FUZZ_BUDGET", "1"))
MODES = ("normal", "overlap", "thread", "ahead")


def _seeds(tmp_path) -> list[bytes]:
    return [open(write(tmp_path / f"{m}.jsonl", m, canonical(m)), "rb").read() for m in MODES]


def test_mutated_traces_never_crash_the_checker(tmp_path):
    res = campaign(_seeds(tmp_path), 300 * SCALE, seed=7, workdir=str(tmp_path))
    assert res["problems"] == []
    assert sum(res["counts"].values()) == 300 * SCALE
    assert set(res["counts"]) <= {0, 1, 2, 3} and res["counts"].get(2, 0) > 0


def test_every_mutation_changes_something_and_is_seeded(tmp_path):
    seed = _seeds(tmp_path)[3]
    for name, fn in MUTATIONS.items():
        changed = {fn(seed, random.Random(i)) != seed for i in range(20)}
        assert True in changed, name
    assert mutate(seed, random.Random("s:1")) == mutate(seed, random.Random("s:1"))


def test_the_campaign_catches_a_checker_that_crashes(tmp_path, monkeypatch):
    """With the value checks taken out (the standard library's decoder as it was), deep nesting
    ends in a RecursionError inside the checker: exit 70, which the campaign reports."""
    monkeypatch.setattr(trace_io, "strict_loads", json.loads)
    monkeypatch.setattr(trace_io, "suspect", lambda raw: True)
    path = write(tmp_path / "deep.jsonl", "ahead", canonical("ahead"))
    lines = open(path).read().splitlines()
    lines[2] = lines[2][:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}"
    open(path, "w").write("\n".join(lines) + "\n")
    rc, err = check_once(path, [])
    assert rc == exits.INTERNAL and "bug in pdo" in err
    assert problem(rc, err, path) is not None
    monkeypatch.undo()
    rc, err = check_once(path, [])
    assert rc == exits.BAD_INPUT and problem(rc, err, path) is None


def test_problem_wants_one_line_starting_with_the_path():
    assert problem(2, "pdo check: error: /t.jsonl:3: field 'seq': ...\n", "/t.jsonl") is None
    assert problem(2, "pdo check: error: int too large\n", "/t.jsonl") is not None
    assert problem(2, "pdo check: error: /t.jsonl:3: a\nTraceback\n", "/t.jsonl") is not None
    assert problem(70, "pdo check: internal error ...", "/t.jsonl") is not None
    assert all(problem(rc, "", "/t") is None for rc in (0, 1, 3))
