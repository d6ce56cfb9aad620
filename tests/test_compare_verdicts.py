"""scripts/compare_verdicts.py: the same damaged traces checked at two commits, every answer
compared byte for byte; a difference is listed and fails the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import compare_verdicts  # noqa: E402 - the script, from its folder


def test_a_commit_answers_as_itself():
    cmd = [sys.executable, "scripts/compare_verdicts.py", "HEAD", "HEAD", "--cases", "12"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "16 traces (4 seeds, 12 mutants)" in out.stdout
    assert "answered otherwise at HEAD: 0" in out.stdout


def test_the_cases_are_drawn_from_the_seed_alone(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert compare_verdicts.make_cases(a, [], 8, 3) == compare_verdicts.make_cases(b, [], 8, 3)
    assert all((a / f.name).read_bytes() == f.read_bytes() for f in b.glob("*.jsonl"))
    assert len(list(a.glob("*.jsonl"))) == 12


def test_an_answer_that_differs_is_named():
    what = ["seed normal", "case 0: seed 0, flip"]
    first = [[0, "PASS x\n", ""], [2, "", "pdo check: error: D/1.jsonl:3: bad\n"]]
    other = [[0, "PASS x\n", ""], [2, "", "pdo check: error: D/1.jsonl:4: bad\n"]]
    assert compare_verdicts.differences(first, first, what) == []
    assert compare_verdicts.differences(first, other, what) == [
        "case 0: seed 0, flip: exit 2 -> 2; output differs"
    ]
    other[0][0] = 1
    assert compare_verdicts.differences(first, other, what)[0] == "seed normal: exit 0 -> 1"
