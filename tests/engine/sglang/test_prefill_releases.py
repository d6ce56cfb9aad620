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
    oldest = versions.RELEASES[0]
    out = _conform(oldest)
    assert out.returncode == 0, out.stdout + out.stderr
    line = f"not applicable to SGLang {oldest}: {SCENARIO} ({prefill_scenarios.NOT_COVERED})"
    assert line in out.stdout.splitlines()
    assert not [ln for ln in out.stdout.splitlines() if ln.startswith(("ok ", "BAD"))]


def test_oldest_covered_release_runs_and_judges_prefill(tmp_path):
    version = prefill_scenarios.HARNESS_OLDEST
    out = _conform(version, "--json", "--trace-dir", str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (result,) = json.loads(out.stdout[out.stdout.index("[") :])
    assert (result["scenario"], result["outcome"], result["error"]) == (SCENARIO, "conforms", None)
    with open(result["trace"]) as f:
        header, *events = (json.loads(line) for line in f)
    assert header["sglang_version"] == version
    kinds = {e["ev"] for e in events}
    assert {"admit", "fwd_begin", "process_begin", "kv_send", "alloc", "release"} <= kinds
