"""scripts/trace_arms.py: each arm traces what its name says, and the script reports every arm."""

from __future__ import annotations

import gc
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import trace_arms  # noqa: E402 - the script, from its folder

from engine.runs.prefill_run import run_prefill  # noqa: E402
from engine.runs.spec import RunSpec, WorkloadConfig  # noqa: E402
from engine.runtime.config import EngineConfig  # noqa: E402
from engine.sync import hb  # noqa: E402


def _run(arm: str, tmp_path) -> tuple[object, str | None]:
    make, to_file = trace_arms.ARMS[arm]
    tracer, path = make(), str(tmp_path / f"{arm}.jsonl") if to_file else None
    spec = RunSpec(EngineConfig(mode="ahead"), WorkloadConfig(requests=6), trace_path=path)
    run_prefill(spec, tracer=tracer)
    return tracer, path


def test_each_arm_logs_what_it_says(tmp_path):
    off, _ = _run("off", tmp_path)
    assert not off.enabled
    nohb, path = _run("nohb", tmp_path)
    assert nohb.count > 50 and "hb" not in nohb.header and Path(path).exists()
    stream, _ = _run("stream", tmp_path)
    assert stream.count == nohb.count and "hb" in stream.header
    edges, _ = _run("edges", tmp_path)
    assert edges.count == 0 and "hb" in edges.header
    assert edges.logged > 100  # the hand-offs' records, and nothing else of the run
    floor, _ = _run("floor", tmp_path)
    checks = [struct.unpack_from("<q", trace_arms._Floor._ring, i * 96 + 24)[0] for i in range(50)]
    assert checks == list(range(50))  # one record per event, in slot order
    floor_hb, _ = _run("floor-hb", tmp_path)
    codes = {struct.unpack_from("<q", trace_arms._Floor._ring, i * 96)[0] for i in range(200)}
    assert codes == {16, 3}  # events and hand-offs
    edges = floor_hb._edges
    assert edges in hb._sinks
    del floor_hb
    gc.collect()
    assert edges not in hb._sinks  # detached with its tracer


def test_the_script_reports_every_traced_arm(monkeypatch, capsys):
    argv = ["trace_arms.py", "--rounds", "2", "--requests", "4", "--arms", "off,floor,edges"]
    monkeypatch.setattr(sys, "argv", argv)
    trace_arms.main()
    out = capsys.readouterr().out
    assert "floor/off: geometric mean" in out and "edges/off: geometric mean" in out
