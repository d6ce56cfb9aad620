"""Trace sets (checker/trace_sets.py), what `pdo check --ray DIR` runs one task for: the files of
one run grouped as `pdo run`, `pdo run --pd` and `pdo launch` name them, and each set's verdict the
one `pdo check` gives its files. No Ray needed (tests/checker/fuzz/test_ray.py runs them on Ray)."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from checker.trace_sets import check_set, fleet_code, trace_sets
from engine.cli import main
from spec.errors import BadInput
from tests.trace_fixtures import canonical, write


def test_sets_are_the_files_of_one_run(tmp_path):
    """Grouped by folder and by name less `.jsonl` and a trailing decode/prefill<i> part."""
    names = [
        "a.jsonl",
        "b.decode.jsonl",
        "b.prefill0.jsonl",
        "b.prefill1.jsonl",
        "b2.jsonl",
        "launch/decode.jsonl",
        "launch/prefill0.jsonl",
        "launch/prefill0.json",  # a role's summary, not a trace
        "fuzz/x.trace.decode.jsonl",
        "fuzz/x.trace.prefill0.jsonl",
        "notes.txt",
    ]
    for name in names:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).touch()
    got = {
        os.path.relpath(s.name, tmp_path) + ("/" if s.name.endswith("/") else ""): [
            os.path.basename(p) for p in s.paths
        ]
        for s in trace_sets([str(tmp_path)])
    }
    assert got == {
        "a": ["a.jsonl"],
        "b": ["b.decode.jsonl", "b.prefill0.jsonl", "b.prefill1.jsonl"],
        "b2": ["b2.jsonl"],
        "fuzz/x.trace": ["x.trace.decode.jsonl", "x.trace.prefill0.jsonl"],
        "launch/": ["decode.jsonl", "prefill0.jsonl"],
    }


def test_a_folder_without_traces_or_a_missing_one_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="no trace"):
        trace_sets([str(tmp_path)])
    with pytest.raises(BadInput, match="no such file or folder"):
        trace_sets([str(tmp_path / "absent")])


def _check(paths) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["check", "--json", *paths])
    return rc, out.getvalue(), err.getvalue()


def test_each_set_gets_the_verdict_of_pdo_check(tmp_path):
    """A pass, a violation, a trace cut short, a file that is not a trace: each set's exit code,
    reports (or bad-input line) are those of `pdo check` on its files; the fleet's code is the
    worst, a violation first."""
    events = canonical("ahead")
    write(tmp_path / "pass.jsonl", "ahead", events)
    k = next(i for i, e in enumerate(events) if e["ev"] == "chunk_dec")
    as_int = [{**e, "obj": 1000 + ord(e["obj"][-1])} if "obj" in e else e for e in events]
    mixed = [*as_int[:k], {**as_int[k], "obj": str(as_int[k]["obj"])}, *as_int[k + 1 :]]
    write(tmp_path / "fail.jsonl", "ahead", mixed)
    whole = (tmp_path / "pass.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "cut.jsonl").write_text("".join(whole[:-3]))
    (tmp_path / "junk.jsonl").write_text("not json\n")
    verdicts = [check_set(s) for s in trace_sets([str(tmp_path)])]
    assert {os.path.basename(v.name): v.code for v in verdicts} == {
        "cut": 3,
        "fail": 1,
        "junk": 2,
        "pass": 0,
    }
    for v in verdicts:
        rc, out, err = _check(v.paths)
        assert rc == v.code, v.name
        if rc == 2:
            assert err.strip() == f"pdo check: error: {v.error}"
        else:
            assert json.loads(out) == v.reports and v.events > 0
    assert fleet_code(verdicts) == 1
    assert fleet_code([v for v in verdicts if v.code != 1]) == 2
