"""scripts/sglang_hook_cost.py, tiny: every arm timed, and the logging arms' traces hold the events
it counted (read back here): for the prefill runs (one schedule), the same in today's sink and in
87a74b3's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BEFORE = "87a74b3"
SCENARIOS = {
    "prefill": ("prefill-chunked/normal", "prefill-chunked/overlap"),
    "decode": ("decode-arrivals/normal", "decode-abort-after-prefetch/overlap"),
}
# hooked functions those scenarios call, and events the hooks log there
CALLED = {
    "prefill": {"Scheduler.run_batch", "Scheduler.process_batch_result", "ReqToTokenPool.alloc"},
    "decode": {"DecodePreallocQueue.add", "DecodePreallocQueue._resolve_pending_reqs"},
}
LOGGED = {
    "prefill": {"admit", "fwd_begin", "war_barrier", "kv_send", "kv_delivered", "release"},
    "decode": {
        "iter_begin",
        "req_add",
        "prefetch_begin",
        "query_begin",
        "resolve",
        "receiver_init",
    },
}


@pytest.fixture(scope="module")
def runnable():
    from engine.sglang import SGLangUnavailable, load
    from engine.sglang.conform import decode_scenarios, prefill_scenarios

    try:
        sgl = load()
    except SGLangUnavailable as e:
        pytest.skip(str(e))
    available = set(dict(prefill_scenarios.scenarios())) | set(
        dict(decode_scenarios.scenarios(sgl))
    )
    if not {n for names in SCENARIOS.values() for n in names} <= available:
        pytest.skip("this SGLang release does not run these scenarios of the harness")
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


@pytest.mark.parametrize(
    ("role", "sink_per"), [("prefill", "process"), ("prefill", "run"), ("decode", "process")]
)
def test_every_arm_timed_and_the_events_logged(runnable, tmp_path, capsys, role, sink_per):
    cmd = [sys.executable, str(REPO / "scripts" / "sglang_hook_cost.py"), "--role", role]
    cmd += ["--rounds", "2", "--reps", "1", "--sink-per", sink_per, "--json"]
    cmd += ["--trace-dir", str(tmp_path)]
    for name in SCENARIOS[role]:
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
    assert CALLED[role] <= set(report["called"]), report["not_called"]

    # the last round's traces: the events the script counted
    logged = {}
    for arm in ("now", BEFORE):
        if sink_per == "process":
            paths = [tmp_path / f"{arm}.jsonl"]
        else:
            paths = [tmp_path / f"{arm}-{n.replace('/', '_')}.jsonl" for n in SCENARIOS[role]]
        logged[arm] = [ev for p in paths for ev in _events(p)]
        counted = report["arms"][arm]["events_per_round"]
        assert counted["min"] <= len(logged[arm]) <= counted["max"], arm
        assert LOGGED[role] <= set(logged[arm]), arm
    if role == "prefill":  # one schedule: the same events in both sinks, none logged twice
        assert logged["now"] == logged[BEFORE]
        assert "x.war_barrier_again" not in logged["now"]
    # the text output: one line per arm, every figure of its row named
    spec = importlib.util.spec_from_file_location(
        "hook_cost", REPO / "scripts" / "sglang_hook_cost.py"
    )
    script = sys.modules["hook_cost"] = importlib.util.module_from_spec(spec)  # for its dataclasses
    spec.loader.exec_module(script)
    script.print_report(report)
    text = capsys.readouterr().out
    for name, row in report["arms"].items():
        line = next(x for x in text.splitlines() if x.lstrip().startswith(f"{name}:"))
        assert all(script.LABELS[k] in line for k in row), name
    # the arms without a logging sink wrote no trace
    assert not list(tmp_path.glob("hooks*.jsonl")) and not list(tmp_path.glob("off*.jsonl"))
