"""Predictive analysis (checker/predict.py): from one passing trace with happens-before clocks, the
rule violations another allowed interleaving would show."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from checker.fuzz.confirm import confirm
from checker.linear import check_file
from checker.predict import Clocks, NoClocks, predict_file, text_report
from checker.trace_io import iter_chunks
from engine.cli import main as pdo
from engine.decode.config import DecodeConfig
from engine.runs.pd import run_pd
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from engine.sync import hb
from engine.trace.tracer import VERSION
from spec import load_rules
from tests.helpers import run_mode
from tests.trace_fixtures import canonical

WL = WorkloadConfig(requests=8, prompt_len=(20, 150), hit=0.5, seed=1)


@pytest.fixture
def clocks(monkeypatch):
    monkeypatch.setattr(hb, "ENABLED", True)  # the default, whatever PDO_HB says


def _trace(tmp_path, mode, inject=(), name="t"):
    path = str(tmp_path / f"{name}.jsonl")
    run_mode(mode, trace_path=path, inject=inject, workload=WL)
    return path


@pytest.mark.parametrize("mode", ["normal", "overlap", "thread", "ahead"])
def test_a_clean_trace_predicts_nothing(tmp_path, clocks, mode):
    path = _trace(tmp_path, mode)
    assert check_file(path).ok
    r = predict_file(path)
    assert r.ok, [(p.rule.id, p.message) for p in r.predictions]


def test_the_report_says_which_rules_it_searched_and_why_not_the_others(tmp_path, clocks):
    path = _trace(tmp_path, "thread")
    r = predict_file(path)
    rules = [x.id for x in load_rules() if x.role == "prefill" and x.applies("thread", r.header)]
    why = dict(r.unsearched)
    assert sorted([*r.searched, *why]) == sorted(rules)  # each rule once, in one list
    assert "P-worker-copy" in r.searched and "P-chunk-counter" in r.searched
    assert "compares the digests" in why["P-snapshot-isolation"]
    assert "program order" in why["P-thread-collect-immediately"]
    assert "X-kv-pages" not in why  # a single-process run has no cross-process rules
    text = text_report(r)
    assert f"searched {len(r.searched)} rule(s)" in text and "P-snapshot-isolation" in text


def test_a_mutant_hidden_in_a_passing_trace_is_predicted(tmp_path, clocks):
    # copy-after-handoff: the worker logs batch_copy after handing the result back; the scheduler
    # usually wakes after it, so the trace passes, but nothing orders the two
    passing = 0
    for seed in range(2):
        path = _trace(tmp_path, "ahead", inject=("copy-after-handoff",), name=f"m{seed}")
        passing += check_file(path).ok
        r = predict_file(path)
        assert "P-worker-copy" in {p.rule.id for p in r.predictions}
    assert passing >= 1


def test_a_release_before_delivery_hidden_in_passing_traces_is_predicted(tmp_path, clocks):
    """release-before-delivery: the request is released once its last chunk is queued, not once the
    transfer delivered it; uncontrolled, the delivery is usually logged first, so the trace passes,
    but only the sender's poll would order the two, and the mutant skips it."""
    passing = 0
    for seed in range(8):
        if passing:
            break
        wl = WorkloadConfig(requests=8, prompt_len=(20, 150), hit=0.5, seed=seed)
        path = str(tmp_path / f"r{seed}.jsonl")
        run_mode("normal", trace_path=path, inject=("release-before-delivery",), workload=wl)
        if check_file(path).ok:  # the bug hid in this run
            passing += 1
            assert "P-release-after-delivery" in {p.rule.id for p in predict_file(path).predictions}
    assert passing >= 1


def _with_clocks(events, *, drop_collect_edge=False):
    """A hand-built thread-mode trace with the clocks the engine's hand-offs give: submit(N) before
    fwd_begin(N) (the input queue), batch_copy(N) before collect(N) (the output queue); a send
    before its delivery (the transfer queue), a request's deliveries before its release (the
    sender's poll), the scheduler's staging before the copy stream's copy, the copy before the
    AttentionStore entry (its event)."""
    clock: dict = defaultdict(dict)
    sent: dict = defaultdict(dict)

    def join(c, key):
        for k, v in sent.get(key, {}).items():
            c[k] = max(c.get(k, 0), v)

    for e in events:
        c, ev = clock[e["thread"]], e["ev"]
        if ev == "fwd_begin":
            join(c, ("submit", e["batch"]))
        if ev == "collect" and not drop_collect_edge:
            join(c, ("batch_copy", e["batch"]))
        if ev == "kv_delivered":
            join(c, ("send", e["rid"], e["start"]))
        if ev == "release":
            join(c, ("delivered", e["rid"]))
        if ev == "store_copied":
            join(c, ("scheduler",))
        if ev == "store_entry":
            join(c, ("copied", e["rid"]))
        if ev == "fwd_done":  # the forward stream runs what the forward thread launched
            join(c, ("fwd_begin", e["batch"]))
        if ev == "staged":  # the schedule stream: its launch, and the WAR barrier's wait
            join(c, ("stage", e["batch"]))
            join(c, ("fwd_done", e["batch"] - 1))
        c[e["thread"]] = c.get(e["thread"], 0) + 1
        e["vc"] = dict(c)
        keys = [(ev, e["batch"])] if "batch" in e else []
        if ev in ("kv_send", "prefix_send"):
            keys.append(("send", e["rid"], e["start"]))
        if ev == "kv_delivered":
            keys.append(("delivered", e["rid"]))
        if ev == "store_copied":
            keys.append(("copied", e["rid"]))
        if e["thread"] == "scheduler":
            keys.append(("scheduler",))
        for key in keys:
            for k, v in c.items():
                sent[key][k] = max(sent[key].get(k, 0), v)
    return events


def _write(path, events):
    head = {"format": "pdo-trace", "version": VERSION, "role": "prefill", "mode": "thread"}
    end = {"thread": "scheduler", "ev": "trace_end", "events": len(events), "reason": "normal"}
    with open(path, "w") as f:
        f.write(json.dumps({**head, "page_size": 16, "hb": ""}) + "\n")
        for i, e in enumerate([*events, end], 1):
            f.write(json.dumps({"seq": i, "t_ns": 1000 * i, **e}) + "\n")
    return str(path)


def test_a_missing_hb_edge_is_predicted(tmp_path):
    full = _write(tmp_path / "full.jsonl", _with_clocks(canonical("thread")))
    cut = _write(tmp_path / "cut.jsonl", _with_clocks(canonical("thread"), drop_collect_edge=True))
    assert check_file(full).ok and check_file(cut).ok
    assert predict_file(full).ok
    found = {p.rule.id: p for p in predict_file(cut).predictions}
    assert "P-worker-copy" in found
    p = found["P-worker-copy"]
    assert (p.first["ev"], p.second["ev"]) == ("batch_copy", "collect")


def test_an_engines_own_event_still_carries_its_hand_off(tmp_path):
    """An `x.<name>` event is no rule's, but the delta it carries is its thread's: the replay
    reads it before the event is left out."""
    logged = [
        {"seq": 1, "thread": "scheduler", "ev": "admit", "vc": {"scheduler": 1}},
        {"seq": 2, "thread": "forward", "ev": "batch_copy", "vc": {"forward": 1}},
        {"seq": 3, "thread": "scheduler", "ev": "x.note", "vc": {"scheduler": 2, "forward": 1}},
        {"seq": 4, "thread": "scheduler", "ev": "collect", "vc": 3},
    ]
    clocks = Clocks("t.jsonl", {"hb": ""}, logged, keep=lambda e: not e["ev"].startswith("x."))
    assert [e["ev"] for e in clocks.events] == ["admit", "batch_copy", "collect"]
    assert clocks.before(1, 2)  # batch_copy before collect, through the x.note's join
    events = canonical("thread")
    events.insert(3, {"thread": "scheduler", "ev": "x.note"})
    path = _write(tmp_path / "own.jsonl", events)
    own = [e["ev"] for c in iter_chunks(path, own=True) for e in c]
    assert "x.note" in own and "x.note" not in [e["ev"] for c in iter_chunks(path) for e in c]


@pytest.mark.parametrize(
    "second, why",
    [
        ({"forward": 1}, "no clock of its thread"),  # a delta without its own count
        (1, "does not follow"),  # a count that does not grow
    ],
)
def test_a_clock_that_cannot_be_replayed_is_refused(second, why):
    logged = [
        {"seq": 1, "thread": "scheduler", "ev": "admit", "vc": {"scheduler": 1}},
        {"seq": 2, "thread": "scheduler", "ev": "stage", "vc": second},
    ]
    with pytest.raises(NoClocks, match=why):
        Clocks("t.jsonl", {"hb": ""}, logged)


def test_check_predict_exit_codes(tmp_path, clocks, capsys, monkeypatch):
    clean = _trace(tmp_path, "thread")
    assert pdo(["check", "--predict", clean]) == 0
    cut = _write(tmp_path / "cut.jsonl", _with_clocks(canonical("thread"), drop_collect_edge=True))
    assert pdo(["check", "--predict", cut]) == 1
    assert "PREDICTED P-worker-copy" in capsys.readouterr().out
    assert pdo(["check", "--predict", "--json", cut]) == 1
    report = json.loads(capsys.readouterr().out)[0]["predict"]
    assert not report["ok"] and "P-worker-copy" in {p["rule"] for p in report["predictions"]}
    monkeypatch.setattr(hb, "ENABLED", False)
    bare = _trace(tmp_path, "thread", name="bare")
    with pytest.raises(NoClocks):
        predict_file(bare)
    assert pdo(["check", "--predict", bare]) == 2


def _drop_edges(src, dst, thread="scheduler", other="forward"):
    """The trace with every `thread` event's clock blind to `other` (as if no hand-off joined them)."""
    lines = open(src).read().splitlines()
    head = json.loads(lines[0])
    key = head["hb"] + other
    with open(dst, "w") as f:
        f.write(lines[0] + "\n")
        for line in lines[1:]:
            e = json.loads(line)
            if e["thread"] == thread and isinstance(e["vc"], dict):  # an int inherits the cut
                e["vc"].pop(key, None)
            f.write(json.dumps(e) + "\n")
    return str(dst)


def test_confirm_reaches_a_real_race_and_not_a_missing_edge(tmp_path, clocks):
    path = _trace(tmp_path, "ahead", inject=("copy-after-handoff",), name="m")
    r = predict_file(path)
    p = next(p for p in r.predictions if p.rule.id == "P-worker-copy")
    assert confirm(path, r.header, p).confirmed
    # the clean engine with its forward-to-scheduler edges hidden: predicted, never reached
    cut = _drop_edges(_trace(tmp_path, "ahead", name="c"), tmp_path / "cut.jsonl")
    r = predict_file(cut)
    assert r.predictions
    c = confirm(cut, r.header, r.predictions[0])
    assert not c.confirmed and "NOT CONFIRMED" in c.line


def test_a_clean_pd_run_predicts_nothing(tmp_path, clocks):
    wc = WorkloadConfig(requests=8, prompt_len=(20, 80), hit=0.5, seed=2, max_new_tokens=3)
    s = run_pd(
        RunSpec(
            EngineConfig(mode="ahead"),
            wc,
            DecodeConfig(),
            dp=2,
            trace_path=str(tmp_path / "t.jsonl"),
        )
    ).summary
    assert len(s["traces"]) == 3
    for path in s["traces"]:
        assert check_file(path).ok
        r = predict_file(path)
        assert r.header.get("hb") and r.ok, [(p.rule.id, p.message) for p in r.predictions]


def _isolate(src, dst, thread):
    """The trace as if no hand-off to or from `thread` had been logged: its clocks count its own
    events alone, and no other thread's clock has its component."""
    lines = open(src).read().splitlines()
    head = json.loads(lines[0])
    key, seen = head["hb"] + thread, set()
    with open(dst, "w") as f:
        f.write(lines[0] + "\n")
        for line in lines[1:]:
            e = json.loads(line)
            vc = e.get("vc")
            if e.get("thread") == thread:
                n = vc if isinstance(vc, int) else vc[key]
                e["vc"] = n if thread in seen else {key: n}
                seen.add(thread)
            elif isinstance(vc, dict):
                vc.pop(key, None)
            f.write(json.dumps(e) + "\n")
    return str(dst)


def test_a_thread_with_no_hand_off_is_named_and_its_pairs_are_not_judged(tmp_path, clocks, capsys):
    """A thread whose hand-offs the tracer missed altogether: its events look concurrent with every
    other thread's, orders its program forced included. Its pairs are not searched, and the
    verdict is INCOMPLETE, not a pass nor a prediction."""
    clean = _trace(tmp_path, "ahead")
    r = predict_file(clean)
    assert r.complete and r.isolated == []
    cut = _isolate(clean, tmp_path / "cut.jsonl", "forward")
    r = predict_file(cut)
    assert r.isolated == ["forward"] and r.skipped > 0 and not r.complete
    assert r.ok  # nothing predicted from the pairs it cannot judge
    assert pdo(["check", "--predict", cut]) == 3
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "forward" in out
    assert pdo(["check", "--predict", "--json", cut]) == 3
    report = json.loads(capsys.readouterr().out)[0]["predict"]
    assert report["isolated"] == ["forward"] and not report["complete"]
