"""`pdo conform sglang --sglang-version V` on the prefill scenarios of a release other than the venv's:
the oldest release the set-up installs (listed as not applicable, with the reason, exit 0) and the
oldest one the prefill harness covers (run, and its trace judged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.sglang import versions
from engine.sglang.conform import prefill_scenarios

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCENARIO = "prefill-chunked/normal"
LIFE_CELL = "prefill-life/inflight/poll-failed/normal"
S5_SCENARIO = "prefill-inline-sample/overlap"
S5_RELEASE = "0.5.15"  # the first release with the early cached-prefix send, and bug S5


def _conform(version: str, *args: str) -> subprocess.CompletedProcess:
    if version not in versions.installed():
        pytest.skip(
            f"SGLang {version} is not installed side by side (engine.sglang.versions install)"
        )
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", "conform", "sglang", "--sglang-version", version,
         "--scenario", SCENARIO, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )  # fmt: skip


def test_oldest_installed_release_lists_prefill_as_not_applicable():
    """The plain scenarios and the lifecycle cells alike (one run: CI's time)."""
    from engine.sglang.conform import prefill_life

    oldest = versions.RELEASES[0]
    out = _conform(oldest, "--scenario", LIFE_CELL)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert (
        f"not applicable to SGLang {oldest}: {SCENARIO} ({prefill_scenarios.NOT_COVERED})" in lines
    )
    assert f"not applicable to SGLang {oldest}: {LIFE_CELL} ({prefill_life.NOT_COVERED})" in lines
    assert not [ln for ln in lines if ln.startswith(("ok ", "BAD"))]


def _trace(path: str) -> tuple[dict, list[dict]]:
    with open(path) as f:
        header, *events = (json.loads(line) for line in f)
    return header, events


def test_oldest_covered_release_runs_and_judges_prefill(tmp_path):
    """Plain scenarios and a lifecycle cell (one run) on the oldest release with the plain
    scenarios' switches: the tree cache is the one that release's factory makes (ChunkCache for the
    cell's disabled radix cache), the harness leaves the loop, and each trace is judged whole."""
    version = S5_RELEASE
    out = _conform(
        version, "--scenario", LIFE_CELL, "--scenario", S5_SCENARIO, "--json",
        "--trace-dir", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    plain, s5, cell = json.loads(out.stdout[out.stdout.index("[") :])
    # bug S5 (#31368, 0.5.15-0.5.15.post1): the overlap loop's early cached-prefix send reads the
    # previous forward's KV with no device wait; a general scenario, recorded as that finding
    assert (s5["scenario"], s5["outcome"], s5["rules"]) == (
        S5_SCENARIO,
        "finding",
        {"P-chunk-sent": 4},
    )
    assert (plain["scenario"], plain["outcome"], plain["error"]) == (SCENARIO, "conforms", None)
    assert (cell["scenario"], cell["outcome"], cell["error"]) == (LIFE_CELL, "conforms", None)
    assert cell["violations"] == {}
    (header, events), (_, cell_events) = _trace(plain["trace"]), _trace(cell["trace"])
    assert header["sglang_version"] == version
    for trace in (events, cell_events):
        assert (trace[-1]["ev"], trace[-1]["reason"]) == ("trace_end", "normal")
    assert {"admit", "fwd_begin", "process_begin", "kv_send", "alloc", "release"} <= {
        e["ev"] for e in events
    }
    assert {"x.fault", "kv_send", "kv_failed", "release"} <= {e["ev"] for e in cell_events}


def test_oldest_covered_release_runs_the_lifecycle_cells_only(tmp_path):
    """On the oldest release the harness builds (0.5.14) every plain workload needs a switch the
    release lacks; the lifecycle cells run, built with what 0.5.14 makes inline in
    Scheduler.__init__ (metrics collector and reporter) and its legacy global server arguments."""
    version = prefill_scenarios.HARNESS_OLDEST
    out = _conform(version, "--scenario", LIFE_CELL, "--json", "--trace-dir", str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (cell,) = json.loads(out.stdout[out.stdout.index("[") :])  # the plain scenario is not run
    assert (cell["scenario"], cell["outcome"], cell["error"]) == (LIFE_CELL, "conforms", None)
    header, events = _trace(cell["trace"])
    assert header["sglang_version"] == version
    assert (events[-1]["ev"], events[-1]["reason"]) == ("trace_end", "normal")
    assert {"x.fault", "kv_send", "kv_failed", "release"} <= {e["ev"] for e in events}
