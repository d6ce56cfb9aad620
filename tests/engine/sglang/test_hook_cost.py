"""scripts/sglang_hook_cost.py, tiny: every arm timed, and the logging arms' traces hold the events
it counted (read back here), the same in today's sink and in 87a74b3's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BEFORE = "87a74b3"
SCENARIOS = ("prefill-chunked/normal", "prefill-chunked/overlap")


@pytest.fixture(scope="module")
def runnable():
    from engine.sglang import SGLangUnavailable
    from engine.sglang.conform import prefill_scenarios

    try:
        available = dict(prefill_scenarios.scenarios())
    except SGLangUnavailable as e:
        pytest.skip(str(e))
    if not set(SCENARIOS) <= set(available):
        pytest.skip("this SGLang release runs no prefill scenario of the harness")
    known = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{BEFORE}^{{commit}}"], capture_output=True
    )
    if known.returncode != 0:
        pytest.skip(f"commit {BEFORE} is not in this clone")


def _events(path: Path) -> list[str]:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert lines[0]["format"] == "pdo-trace" and "ev" not in lines[0]
    assert lines[-1]["ev"] == "trace_end"
    return [line["ev"] for line in lines[1:-1]]


@pytest.mark.parametrize("sink_per", ["process", "run"])
def test_every_arm_timed_and_the_events_logged(runnable, tmp_path, sink_per):
    cmd = [sys.executable, str(REPO / "scripts" / "sglang_hook_cost.py"), "--rounds", "2"]
    cmd += ["--reps", "1", "--sink-per", sink_per, "--json", "--trace-dir", str(tmp_path)]
    for name in SCENARIOS:
        cmd += ["--scenario", name]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)

    assert list(report["arms"]) == ["off", "hooks", "now", BEFORE]
    for name, row in report["arms"].items():
        for measure in ("ns_per_call", "ns_per_event", "loop_ns_per_event"):
            assert row[measure]["min"] > 0, (name, measure)
    for name in ("now", BEFORE):
        assert report["arms"][name]["close_ns_per_trace"]["min"] > 0
    # the methods the harness drives in both loops, each called
    for fn in ("Scheduler.run_batch", "Scheduler.process_batch_result", "ReqToTokenPool.alloc"):
        assert report["called"][fn] > 0, fn

    # the last round's traces: the events the script counted, the same in both sinks
    logged = {}
    for arm in ("now", BEFORE):
        if sink_per == "process":
            paths = [tmp_path / f"{arm}.jsonl"]
        else:
            paths = [tmp_path / f"{arm}-{n.replace('/', '_')}.jsonl" for n in SCENARIOS]
        logged[arm] = [ev for p in paths for ev in _events(p)]
    assert len(logged["now"]) == report["events_per_round"] > 0
    assert logged["now"] == logged[BEFORE]
    assert {"admit", "fwd_begin", "kv_send", "release"} <= set(logged["now"])
    # the hooks-only arm logs nothing: its sink wrote no trace
    assert not list(tmp_path.glob("hooks*.jsonl"))
