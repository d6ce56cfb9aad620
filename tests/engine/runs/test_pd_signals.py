"""Signals on the PD path (`pdo run --pd`): SIGINT and SIGTERM end every role, each of the three
traces ends with `trace_end` reason signal and holds every event logged, and the process exits
130 or 143 (README, "Exit codes"), never 134 from a role thread still inside torch at exit. A
Ctrl-C while pdo starts exits 130 without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checker.linear import check_files
from engine.runs.child_process import children_of
from spec import tracelog

ROOT = Path(__file__).resolve().parents[3]


def _pdo(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "engine.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_as_from_a_terminal,
    )


def _ctrl_c_as_from_a_terminal() -> None:
    """SIGINT at its default in pdo, as a terminal's Ctrl-C finds it: a test run started from a
    background shell inherits SIGINT ignored, and pdo would keep ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _until_torch_loads(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until pdo is inside its own imports (torch's libraries mapped): a signal before that lands in
    the interpreter's start-up (site), which says nothing about pdo, and on a loaded machine no
    fixed sleep is sure to be past it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/maps") as f:
            if "torch/lib" in f.read():
                return
        time.sleep(0.005)
    raise AssertionError("pdo never loaded torch")


def _lines(path: Path) -> int:
    """The events a role has logged so far: its binary log's while it runs."""
    try:
        return len(tracelog.read_log(Path(str(path) + tracelog.SUFFIX).read_bytes()).events)
    except (FileNotFoundError, tracelog.BadLog):
        return 0


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_mid_run_ends_every_pd_trace(tmp_path, sig, code):
    trace = tmp_path / "pd.jsonl"
    proc = _pdo(["run", "--pd", "--dp", "2", "--requests", "600", "--trace", str(trace)])
    try:
        deadline = time.monotonic() + 120
        # every role is running: both prefill ranks have logged a few hundred events
        while min(_lines(tmp_path / f"pd.prefill{i}.jsonl") for i in (0, 1)) < 200:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run did not get going"
            time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, (proc.returncode, err[-2000:])
    assert "terminate called" not in err and "Traceback" not in err, err[-2000:]
    paths = [tmp_path / f"pd.{role}.jsonl" for role in ("decode", "prefill0", "prefill1")]
    for path in paths:
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        end = lines[-1]
        assert end["ev"] == "trace_end" and end["reason"] == "signal", (path.name, end)
        assert end["events"] == len(lines) - 2 == lines[-2]["seq"], path.name  # every event
    results = check_files([str(p) for p in paths])
    assert all(r.ok for r in results), [v.rule.id for r in results for v in r.violations]


def test_ctrl_c_while_pdo_starts_exits_130_without_a_traceback(tmp_path):
    proc = _pdo(["run", "--pd", "--dp", "2", "--trace", str(tmp_path / "pd.jsonl")])
    _until_torch_loads(proc)  # inside its imports
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]


@pytest.mark.skipif(os.environ.get("PDO_SLOW") != "1", reason="PDO_SLOW=1 runs it")
def test_sigterm_to_pdo_launch_stops_every_child_and_ends_their_traces(tmp_path):
    out = tmp_path / "run"
    proc = _pdo(
        ["launch", "--dp", "1", "--requests", "40", "--arrival", "poisson", "--rate", "4"]
        + ["--trace-dir", str(out), "--timeout-s", "200"]
    )
    try:
        deadline = time.monotonic() + 150
        while _lines(out / "decode.jsonl") < 100:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        children = children_of(proc.pid)
        assert len(children) == 3, children  # bootstrap, prefill0, decode
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, (proc.returncode, err[-2000:])
    assert not any(Path(f"/proc/{pid}").exists() for pid in children)  # none outlived it
    for role in ("decode", "prefill0"):
        end = json.loads((out / f"{role}.jsonl").read_text().splitlines()[-1])
        assert end["ev"] == "trace_end" and end["reason"] == "signal", (role, end)
