"""The historical bug benchmark (scripts/sglang_bugs.py): a decode row and a prefill row, each on both
of its releases, behind PDO_SGLANG_MATRIX=1 (each runs the general scenarios on two releases side by
side)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.sglang import versions

ROOT = Path(__file__).resolve().parents[3]


# row -> (its two releases, what must be among "caught by")
ROWS = {
    "S2": (("0.5.15.post1", "0.5.16"), ("D-consume-answer", "raised AttributeError")),
    "S5": (("0.5.15.post1", "0.5.16"), ("P-chunk-sent",)),
}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_a_row_is_flagged_on_its_buggy_release_and_clean_on_the_fixed(row):
    releases, caught = ROWS[row]
    if os.environ.get("PDO_SGLANG_MATRIX") != "1" or not set(releases) <= set(versions.installed()):
        pytest.skip(
            "the release matrix (PDO_SGLANG_MATRIX=1, scripts/sglang-matrix.sh installs it)"
        )
    out = subprocess.run(
        [sys.executable, "scripts/sglang_bugs.py", row],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith(f"| {row}")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3].startswith("yes") and cells[4] == "yes"
    assert all(c in cells[5] for c in caught)
