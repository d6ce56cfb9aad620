"""`pdo check --engine z3` and `pdo check --model` on a truncated trace (docs/trace-format.md
"Truncated traces"): the verdicts of the linear checker, never a pass; a prefix that breaks a rule,
or that no schedule of the loop model starts with, still fails. And the decode trace's
`memory_waits` read from its `trace_end` when the header lacks it (a streamed trace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checker import z3check
from checker.linear import check_file
from checker.refine import check_model, text
from checker.trace_io import TraceFormatError
from engine.cli import main as pdo
from engine.cli.exits import FAILED, INCOMPLETE, OK
from engine.decode import loops as decode_loops
from engine.prefill import loops as prefill_loops
from engine.runs.prefill_run import run_prefill
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from tests.checker.test_refine import _war_barrier_after_processing
from tests.checker.test_refine_decode import _decode_trace, _intake_before_prefetch


def _prefill_trace(tmp_path, name="t.jsonl", mode="thread", inject=()) -> Path:
    path = tmp_path / name
    cfg = EngineConfig(mode=mode, inject=frozenset(inject))
    run_prefill(RunSpec(cfg, WorkloadConfig(requests=6), trace_path=str(path), verify=False))
    return path


def _cuts(path: Path, out: Path, n: int):
    """n prefixes of the file spread over it (from the first event on), each ended after a whole
    line and in the middle of one."""
    lines = path.read_bytes().splitlines(keepends=True)
    for k in sorted({2 + i * (len(lines) - 3) // (n - 1) for i in range(n)}):
        for part in (lines[k - 1], lines[k - 1][: len(lines[k - 1]) // 2]):
            out.write_bytes(b"".join(lines[: k - 1]) + part)
            yield k


def _count_in_header(path: Path) -> Path:
    """The decode trace with its memory_waits in the header, as an emitter that knows it at the
    start writes it (a streamed trace carries it in trace_end, which a cut loses)."""
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[0]["memory_waits"] = lines[-1].pop("memory_waits")
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _cut_at(path: Path, out: Path, frac: float) -> Path:
    lines = path.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[: int(len(lines) * frac)]))
    return out


def test_z3_judges_a_truncated_trace_as_the_linear_checker(tmp_path, capsys):
    path = _prefill_trace(tmp_path)
    cut = tmp_path / "cut.jsonl"
    for k in _cuts(path, cut, 10):
        z, lin = z3check.check_file(str(cut)), check_file(str(cut))
        assert z.status == "incomplete" and not z.ok, (k, z.status, z.violated)
        assert z.truncated == lin.truncated is not None and z.not_judged == sorted(lin.not_judged)
        assert z.not_judged and not {r.id for r, _ in z.rules} & set(z.not_judged)
    assert pdo(["check", "--engine", "z3", str(cut)]) == INCOMPLETE
    assert f"INCOMPLETE {cut}" in capsys.readouterr().out
    assert pdo(["check", "--engine", "z3", "--json", str(cut)]) == INCOMPLETE
    (report,) = json.loads(capsys.readouterr().out)
    assert report["truncated"] == lin.truncated and report["not_judged"] == z.not_judged
    assert pdo(["check", "--engine", "z3", str(path)]) == OK  # the whole trace passes
    capsys.readouterr()
    # a mutant's violation in a prefix is still caught
    bad = _prefill_trace(tmp_path, "bad.jsonl", inject=("send-before-forward-done",))
    short = _cut_at(bad, tmp_path / "short.jsonl", 0.75)
    z = z3check.check_file(str(short))
    assert z.status == "fail" and z.truncated is not None, z.status
    assert set(z.violated) & {v.rule.id for v in check_file(str(short)).violations}
    assert pdo(["check", "--engine", "z3", str(short)]) == FAILED
    assert "truncated at line" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["normal", "overlap", "thread", "ahead"])
def test_a_truncated_prefill_trace_is_judged_as_a_prefix_of_the_model(tmp_path, mode):
    path = _prefill_trace(tmp_path, mode=mode)
    cut = tmp_path / "cut.jsonl"
    for k in _cuts(path, cut, 7):
        check = check_model(str(cut))
        assert check.truncated is not None and not check.complete, k
        assert check.answer.status in ("sat", "unknown"), (k, text(check))
        assert check.answer.status == "unknown" or "INCOMPLETE" in text(check)


def test_a_drifted_prefill_loop_drifts_in_a_prefix(tmp_path, monkeypatch, capsys):
    good = _cut_at(_prefill_trace(tmp_path, mode="normal"), tmp_path / "good.jsonl", 0.75)
    assert pdo(["check", "--model", str(good)]) == INCOMPLETE
    assert "a prefix of a schedule" in capsys.readouterr().out
    monkeypatch.setitem(prefill_loops.LOOPS, "normal", _war_barrier_after_processing)
    bad = _cut_at(_prefill_trace(tmp_path, "bad.jsonl", mode="normal"), tmp_path / "c.jsonl", 0.75)
    check = check_model(str(bad))
    assert check.judged and not check.ok and check.truncated is not None, text(check)
    assert "E:program-order" in check.answer.groups
    assert pdo(["check", "--model", str(bad)]) == FAILED
    assert "not even as a prefix" in capsys.readouterr().out


def test_a_truncated_decode_trace_is_judged_as_a_prefix_of_the_model(tmp_path):
    path = _count_in_header(Path(_decode_trace(tmp_path, dp=2, loop="overlap")))
    cut = tmp_path / "cut.jsonl"
    for k in _cuts(path, cut, 8):
        check = check_model(str(cut))
        assert check.truncated is not None and not check.complete, k
        assert check.answer.status in ("sat", "unknown"), (k, text(check))
    # streamed and cut: no memory_waits in its header, no trace_end to carry it
    lines = path.read_text().splitlines(keepends=True)
    header = {k: v for k, v in json.loads(lines[0]).items() if k != "memory_waits"}
    cut.write_text(json.dumps(header) + "\n" + "".join(lines[1 : len(lines) // 2]))
    check = check_model(str(cut))
    assert check.answer.status == "unknown" and "memory_waits" in check.answer.reason


def test_a_drifted_decode_loop_drifts_in_a_prefix(tmp_path, monkeypatch):
    monkeypatch.setitem(decode_loops.LOOPS, "normal", _intake_before_prefetch)
    path = _count_in_header(Path(_decode_trace(tmp_path, dp=1, loop="normal")))
    check = check_model(str(_cut_at(path, tmp_path / "cut.jsonl", 0.5)))
    assert check.judged and not check.ok and check.truncated is not None, text(check)
    assert "E:order" in check.answer.groups


def _move_memory_waits(path: Path, out: Path, *, to_end: bool) -> Path:
    """The trace as it is streamed: memory_waits out of the header, in trace_end (or in neither)."""
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    header, end = lines[0], lines[-1]
    assert end["ev"] == "trace_end"
    waits = header.pop("memory_waits", None)
    waits = end.pop("memory_waits", waits)
    if to_end:
        end["memory_waits"] = waits
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return out


def test_memory_waits_are_read_from_trace_end_when_the_header_lacks_them(tmp_path):
    path = Path(_decode_trace(tmp_path, dp=2))
    streamed = _move_memory_waits(path, tmp_path / "streamed.jsonl", to_end=True)
    check = check_model(str(streamed))
    assert check.ok and check.complete, text(check)
    assert check_file(str(streamed)).ok  # the optional field is part of the format
    neither = _move_memory_waits(path, tmp_path / "neither.jsonl", to_end=False)
    check = check_model(str(neither))
    assert check.answer.status == "unknown" and "memory_waits" in check.answer.reason
    # the field is type-checked as the format's (spec/events.toml), a bad one is bad input
    lines = streamed.read_text().splitlines(keepends=True)
    end = json.loads(lines[-1]) | {"memory_waits": "3"}
    streamed.write_text("".join(lines[:-1]) + json.dumps(end) + "\n")
    with pytest.raises(TraceFormatError, match="memory_waits"):
        check_model(str(streamed))
