"""`pdo conform sglang`: exit codes, JSON shape, replayable fuzzing, and the project without SGLang."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Run in a fresh interpreter with SGLang's distribution reported missing, or of another version.
_AS_IF = """
import importlib.metadata as md, sys
real, want = md.version, {v!r}
def version(name):
    if name == "sglang":
        if want is None:
            raise md.PackageNotFoundError(name)
        return want
    return real(name)
md.version = version
from engine.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _pdo_as_if(version, *args):
    return subprocess.run(
        [sys.executable, "-c", _AS_IF.format(v=version), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "version, says", [(None, "not installed"), ("0.5.12", "below the supported range")]
)
def test_missing_or_too_old_sglang_exits_2_with_one_line(version, says):
    out = _pdo_as_if(version, "conform", "sglang")
    assert out.returncode == 2
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_main_job_runs_without_sglang(tmp_path):
    trace = tmp_path / "run.jsonl"
    out = _pdo_as_if(None, "run", "--requests", "3", "--trace", str(trace))
    assert out.returncode == 0, out.stderr[-1000:]
    assert _pdo_as_if(None, "check", str(trace)).returncode == 0


sglang_adapter = pytest.importorskip("engine.sglang")
_skip = None
try:
    sglang_adapter.check_version()
except sglang_adapter.SGLangUnavailable as exc:
    _skip = str(exc)
needs_sglang = pytest.mark.skipif(_skip is not None, reason=_skip or "")


def _pdo(*args):
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@needs_sglang
def test_json_fuzz_and_replay(tmp_path):
    out = _pdo(
        "conform",
        "sglang",
        "--scenario",
        "decode-rooms-grow/overlap",
        "--fuzz",
        "2",
        "--json",
        "--trace-dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout)
    assert [r["schedule"] for r in results] == [None, 0, 1]
    for r in results:
        assert {
            "scenario",
            "sglang_version",
            "sglang_functions",
            "trace",
            "outcome",
            "rules",
        } <= set(r)
        assert r["sglang_version"] == "0.5.23" and r["outcome"] == "conforms"
        assert any(
            f.endswith("DecodePreallocQueue._resolve_pending_reqs") for f in r["sglang_functions"]
        )

    def steps(path):
        return [
            (e["ev"], e["thread"], e.get("rooms"))
            for e in map(json.loads, open(path).read().splitlines()[1:])
        ]

    first = steps(results[2]["trace"])
    again = _pdo(
        "conform",
        "sglang",
        "--scenario",
        "decode-rooms-grow/overlap",
        "--fuzz-seed",
        "1",
        "--json",
        "--trace-dir",
        str(tmp_path / "replay"),
    )
    assert steps(json.loads(again.stdout)[0]["trace"]) == first


@needs_sglang
def test_unknown_mutant_is_bad_input_and_list_names_every_mutant():
    assert _pdo("conform", "sglang", "--mutant", "nope").returncode == 2
    out = _pdo("conform", "sglang", "--list")
    assert out.returncode == 0
    for name in (
        "double-prefetch",
        "no-cancel-on-release",
        "prefill-sample-before-process",
        "decode-arrivals/normal",
        "prefill-chunked/normal",
    ):
        assert name in out.stdout


@needs_sglang
def test_prefill_mutant_is_flagged():
    out = _pdo("conform", "sglang", "--mutant", "prefill-sample-before-process", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    [r] = json.loads(out.stdout)
    assert r["outcome"] == "flagged" and "P-overlap-process-prev" in r["rules"]
