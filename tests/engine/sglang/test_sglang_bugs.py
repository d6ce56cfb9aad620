"""The historical bug benchmark (scripts/sglang_bugs.py): one row, both of its releases, behind
PDO_SGLANG_MATRIX=1 (it runs the lifecycle matrix on two releases side by side)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.sglang import versions

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(
    os.environ.get("PDO_SGLANG_MATRIX") != "1"
    or not {"0.5.15.post1", "0.5.16"} <= set(versions.installed()),
    reason="the release matrix (PDO_SGLANG_MATRIX=1, scripts/sglang-matrix.sh installs it)",
)
def test_s2_is_flagged_on_its_buggy_release_and_clean_on_the_fixed():
    out = subprocess.run(
        [sys.executable, "scripts/sglang_bugs.py", "S2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("| S2")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3].startswith("yes") and cells[4] == "yes"
    assert "D-consume-answer" in cells[5] and "raised AttributeError" in cells[5]
