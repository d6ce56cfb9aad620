"""All three judges on (rules, outputs, refinement) for the unmutated engine, and what issue 33 found:
a prefetched query that a cancel did not stop (Future.cancel() returned False: the pool thread had
already taken it) may log query_begin after the cancel; and a shrunk case must keep every judge
that failed (a shrink that loses the failure says so).

The bounded campaign here is the CI part of the long one in docs/fuzzing.md: PDO_FUZZ_BUDGET=N
multiplies its schedules (N=250: the whole campaign, 2,000 schedules)."""

import json

import pytest

from checker.fuzz import Replay, find_bug, make_strategy, pct_steps, pd_draws, run_case, shrink
from checker.fuzz import runs as fuzz_runs
from checker.fuzz.pressure import CampaignStats
from checker.fuzz.shrink import fails_alike
from checker.refine import check_model, text
from engine.cli import main

from .test_fuzz import MODES, SCALE

# issue 33: `pdo fuzz --pd --strategy random --seed 1` failed at its 97th schedule (index 96, a
# refinement schedule: 96 % MODEL_EVERY == 0), shrunk file fuzz-pd-random-s1-96
ISSUE_SEED, ISSUE_INDEX = 1, 96


def _issue_case():
    case = pd_draws(ISSUE_SEED)(ISSUE_INDEX)
    strategy = make_strategy("random", ISSUE_SEED * 100_003 + ISSUE_INDEX, steps=pct_steps(case))
    return case, strategy


def _decode_events(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _lost_race(events):
    """(cancel, query_begin) of a prefetched query whose query_begin follows its cancel."""
    cancels = {e["qid"]: e for e in events if e.get("ev") == "prefetch_cancel"}
    for e in events:
        c = cancels.get(e.get("qid"))
        if e.get("ev") == "query_begin" and c is not None and c["seq"] < e["seq"]:
            return c, e
    return None


def test_issue33_cancel_that_lost_the_race_is_no_drift(tmp_path):
    """The case of issue 33, rebuilt from (seed 1, index 96, random, PD): the scheduler cancels a
    query the pool thread has already taken (stopped false) and its query_begin comes after; every
    judge, refinement included, passes."""
    case, strategy = _issue_case()
    out = run_case(case, strategy, model=True, trace_path=str(tmp_path / "t.jsonl"))
    race = _lost_race(_decode_events(tmp_path / "t.decode.jsonl"))
    assert race is not None, "the schedule no longer reaches the race of issue 33"
    cancel, begin = race
    assert cancel["stopped"] is False and begin["thread"].startswith("prefetch"), race
    assert out.failures == [], out.failures
    assert out.judged.get("model_refines", 0) == out.judged["rules"], out.judged


def test_a_query_after_a_cancel_that_stopped_it_is_a_drift(tmp_path):
    """Only a cancel that did not stop the query lets it begin after: the same trace with that
    cancel's `stopped` true is a drift (E:pool); without the field (a trace from before it) the
    order is admitted, since either may have happened."""
    case, strategy = _issue_case()
    run_case(case, strategy, trace_path=str(tmp_path / "t.jsonl"))
    events = _decode_events(tmp_path / "t.decode.jsonl")
    cancel, _ = _lost_race(events)
    for value, verdict in ((True, "DRIFT"), (None, "REFINES"), (False, "REFINES")):
        lines = []
        for e in events:
            if e.get("seq") == cancel["seq"] and e.get("ev") == "prefetch_cancel":
                e = {k: v for k, v in e.items() if k != "stopped"}
                if value is not None:
                    e["stopped"] = value
            lines.append(json.dumps(e))
        path = tmp_path / f"flip-{value}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        check = check_model(str(path))
        report = text(check)
        assert report.startswith(verdict), report
        if verdict == "DRIFT":
            assert check.answer.groups == ["E:pool"], report


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", ["random", "pct"])
def test_unmutated_pd_engine_passes_all_three_judges(mode, strategy):
    """The bounded part of the issue-33 campaign: PD runs with this prefill loop, every schedule
    judged by the rules, the outputs and refinement (z3 5 s per trace, as the long campaign)."""
    stats = CampaignStats(pd=True)
    n = SCALE
    idx, out = find_bug(
        None,
        strategy,
        schedules=n,
        seed=33,
        draw=pd_draws(33, mode=mode),
        stats=stats,
        model_every=1,
        model_timeout_ms=5000,
    )
    assert idx is None, (out.failures, out.case)
    assert stats.schedules == stats.model_schedules == stats.judged["outputs"] == n
    j = stats.judged
    verdicts = sum(j[k] for k in ("model_refines", "model_drift", "model_outside", "model_timeout"))
    assert j["rules"] == verdicts >= 2 * n and j["model_drift"] == 0, j


def _model_only_failure(monkeypatch, fail_once=False):
    """Refinement, when judged, reports a drift (only that judge fails); `fail_once`: only the
    first time (a failure that does not come back)."""
    calls = []

    def fake(paths, judged=None, timeout_ms=0):
        calls.append(paths)
        if judged is not None:
            judged["model_drift"] = judged.get("model_drift", 0) + 1
        return ["model E:pool"] if not fail_once or len(calls) == 1 else []

    monkeypatch.setattr(fuzz_runs, "_model_failures", fake)
    return calls


def test_shrink_keeps_the_judge_that_failed(monkeypatch):
    """A failure only refinement sees: every shrink run judges refinement, the shrunk outcome
    fails the same way, and it records that refinement was on (a replay judges it again)."""
    _model_only_failure(monkeypatch)
    case, strategy = _issue_case()
    out = run_case(case, strategy, model=True)
    assert out.failures == ["model E:pool"]
    small, sched, small_out = shrink(case, out.schedule, out.failures, budget=6, model=out.model)
    assert small_out.model is True and small_out.failures == ["model E:pool"]
    assert fails_alike(small_out, out.failures)
    # without refinement the same run passes: a shrink that drops the judge loses the failure
    rerun = run_case(small, Replay(sched, strict=False), model=False)
    assert not rerun.failed and not fails_alike(rerun, out.failures)


def test_fails_alike_needs_every_failed_judge():
    class Out:
        def __init__(self, failures):
            self.failures, self.failed = failures, bool(failures)

    failed = ["rule D-no-stale", "model E:pool", "leak: decode.slots=1"]
    assert fails_alike(Out(["rule D-no-stale", "leak: x=1", "model E:loop"]), failed)
    assert not fails_alike(Out(["rule D-no-stale", "leak: x=1"]), failed)  # refinement lost
    assert not fails_alike(Out(["rule D-fifo", "model E:pool", "leak: x=1"]), failed)
    assert not fails_alike(Out([]), failed)


def _fuzz_cli(tmp_path, capsys):
    """One PD schedule, index 0: a refinement schedule by default (every MODEL_EVERY-th by index)."""
    rc = main(
        [
            "fuzz",
            "--pd",
            "--strategy",
            "random",
            "--seed",
            str(ISSUE_SEED),
            "--schedules",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    return rc, capsys.readouterr().out


def test_pdo_fuzz_saves_a_shrunk_case_that_replays_its_failure(tmp_path, capsys, monkeypatch):
    _model_only_failure(monkeypatch)
    rc, out = _fuzz_cli(tmp_path, capsys)
    assert rc == 1 and "model E:pool" in out, out
    shrunk = next(tmp_path.glob("*.shrunk.json"))
    saved = json.loads(shrunk.read_text())
    assert saved["model"] is True and saved["failures"] == ["model E:pool"], saved
    assert f"replay: pdo fuzz --replay {shrunk}" in out
    assert main(["fuzz", "--replay", str(shrunk)]) == 1
    assert "FAIL model E:pool" in capsys.readouterr().out


def test_pdo_fuzz_says_when_the_shrink_lost_the_failure(tmp_path, capsys, monkeypatch):
    """A failure that does not come back: no shrunk case, no replay command that would print
    "no failure"; the case itself is saved and named."""
    _model_only_failure(monkeypatch, fail_once=True)
    rc, out = _fuzz_cli(tmp_path, capsys)
    assert rc == 1 and "shrink lost the failure" in out, out
    assert not list(tmp_path.glob("*.shrunk.json"))
    case_file = next(tmp_path.glob("*.case.json"))
    assert f"pdo fuzz --replay {case_file}" in out and ".shrunk.json" not in out, out
