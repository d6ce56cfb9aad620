"""`pdo run`'s exit codes: 1 when the run leaked (prefill) or its summary is not clean (PD: a mismatch
with the reference, an aborted request, a leak), with and without --json; 2, in one line, for a PD-only
flag given without --pd (it would be ignored)."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

import engine.runs.pd
import engine.runs.prefill_run
from engine.cli import main
from engine.cli.pd import summary_ok
from engine.decode.config import DecodeConfig
from engine.runs.pd import PDResult
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["--requests", "2", "--prompt-len", "16:40"]


@pytest.fixture(scope="module")
def prefill_summary():
    s = engine.runs.prefill_run.run_prefill(
        RunSpec(
            EngineConfig(mode="ahead"),
            WorkloadConfig(requests=2, prompt_len=(16, 40)),
            verify=False,
        )
    ).summary
    assert not any(s["leaks"].values())
    return s


@pytest.fixture(scope="module")
def pd_summary():
    s = engine.runs.pd.run_pd(
        RunSpec(
            EngineConfig(mode="ahead"),
            WorkloadConfig(requests=2, prompt_len=(16, 40), max_new_tokens=3),
            DecodeConfig(),
        )
    ).summary
    assert summary_ok(s), s
    return s


def _result(summary: dict) -> engine.runs.prefill_run.PrefillResult:
    return engine.runs.prefill_run.PrefillResult(summary, scheduler=None, requests=[])


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
def test_run_with_leaks_exits_1(monkeypatch, capsys, prefill_summary, as_json):
    leaky = copy.deepcopy(prefill_summary)
    leaky["leaks"]["pages_unaccounted"] = 3
    monkeypatch.setattr(engine.runs.prefill_run, "run_prefill", lambda *a, **k: _result(leaky))
    assert main(["run", *SMALL, *(["--json"] if as_json else [])]) == 1
    out = capsys.readouterr().out
    if as_json:
        assert json.loads(out)["leaks"]["pages_unaccounted"] == 3
    else:
        assert "pages=3" in out
    monkeypatch.setattr(
        engine.runs.prefill_run, "run_prefill", lambda *a, **k: _result(prefill_summary)
    )
    assert main(["run", *SMALL, "--json"]) == 0


def _spoil(s, how):
    s = copy.deepcopy(s)
    if how == "mismatch":
        s["mismatches"] = sorted(s["outputs"])[:1]
    elif how == "aborted":
        s["aborted"] = {"r0": "client went away"}
    elif how == "decode-leak":
        s["decode_leaks"]["pages_unaccounted"] = 1
    elif how == "prefill-leak":
        s["prefill_leaks"][0]["slots_in_use"] = 1
    return s


@pytest.mark.parametrize("how", ["mismatch", "aborted", "decode-leak", "prefill-leak"])
def test_summary_ok_flags_each_failure(pd_summary, how):
    assert summary_ok(pd_summary)
    assert not summary_ok(_spoil(pd_summary, how))


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
@pytest.mark.parametrize("how", ["mismatch", "aborted"])
def test_run_pd_with_a_failed_summary_exits_1(monkeypatch, capsys, pd_summary, how, as_json):
    spoilt = PDResult(_spoil(pd_summary, how))
    monkeypatch.setattr(engine.runs.pd, "run_pd", lambda *a, **k: spoilt)
    assert main(["run", "--pd", *SMALL, *(["--json"] if as_json else [])]) == 1
    out = capsys.readouterr().out
    if as_json:
        assert not summary_ok(json.loads(out))
    else:
        assert ("MISMATCH" if how == "mismatch" else "aborted r0: client went away") in out
    monkeypatch.setattr(engine.runs.pd, "run_pd", lambda *a, **k: PDResult(pd_summary))
    assert main(["run", "--pd", *SMALL, "--json"]) == 0


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--dp", "2"], "--dp only applies with --pd"),
        (["--dp", "1"], "--dp only applies with --pd"),  # even at its default value
        (
            ["--decode-mode", "normal", "--no-prefetch"],
            "--decode-mode, --no-prefetch only apply with --pd",
        ),
        (["--max-new-tokens=3"], "--max-new-tokens only applies"),
        (["--no-prefetch", "--router", "random"], "--router, --no-prefetch only apply"),
        (
            ["--bootstrap-url", "http://127.0.0.1:1", "--bootstrap-latency-ms", "5"],
            "--bootstrap-url, --bootstrap-latency-ms",
        ),
        (
            [
                "--bootstrap-latency-scope",
                "all",
                "--decode-polling-interval",
                "2",
                "--decode-recv-wait-us",
                "1",
            ],
            "--bootstrap-latency-scope, --decode-polling-interval, --decode-recv-wait-us",
        ),
        (["--no-pre"], "--no-prefetch only applies"),  # an abbreviation argparse accepts
    ],
)
def test_pd_only_flags_without_pd_are_rejected(monkeypatch, capsys, argv, named):
    monkeypatch.setattr(
        engine.runs.prefill_run,
        "run_prefill",
        lambda *a, **k: pytest.fail("ran despite a PD-only flag"),
    )
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("pdo run: error: ") and named in err and len(err.strip().splitlines()) == 1
    )


def test_pd_only_flag_rejection_from_the_shell():
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "--requests", "2", "--dp", "2", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.strip() == "pdo run: error: --dp only applies with --pd"
