"""The CLI's contract: a bare `pdo run` works, `pdo check` exits 0/1/2, malformed traces get one line
naming file, line and field; the trace-format doc lists every event of the vocabulary."""
import json
import pathlib
import subprocess
import sys

import pytest

from engine.cli import main
from spec import load_events

from .trace_fixtures import canonical, write

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bare_run_and_check(tmp_path, capsys):
    trace = tmp_path / "run.jsonl"
    assert main(["run", "--trace", str(trace), "--requests", "6"]) == 0
    out = capsys.readouterr().out
    assert "mode=ahead" in out and "requests=6/6" in out and "leaks: slots=0 pages=0" in out
    assert main(["check", str(trace)]) == 0
    assert "PASS" in capsys.readouterr().out


def test_check_exit_codes(tmp_path, capsys):
    good = write(tmp_path / "good.jsonl", "normal", canonical("normal"))
    events = canonical("normal")
    events[[e["ev"] for e in events].index("war_barrier")]["thread"] = "elsewhere"
    bad = write(tmp_path / "bad.jsonl", "normal", events)
    assert main(["check", good]) == 0
    assert main(["check", good, bad]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "[P-run-on-scheduler]" in out and "scheduler:" in out
    assert main(["check", "--json", bad]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep[0]["ok"] is False and any(v["rule"] == "P-run-on-scheduler" for v in rep[0]["violations"])


MALFORMED = [
    ("", 1, "empty file"),
    ("not json\n", 1, "header is not JSON"),
    ('{"format": "other", "version": 1}\n', 1, "field 'format'"),
    ('{"format": "pdo-trace", "version": 99, "role": "prefill", "mode": "normal", "page_size": 16}\n', 1, "field 'version'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "ahead"}\n', 1, "field 'page_size'"),
    ('{"format": "pdo-trace", "version": true, "role": "prefill", "mode": "ahead", "page_size": 16}\n', 1, "field 'version'"),
    ('{"format": "pdo-trace", "version": 1.0, "role": "prefill", "mode": "ahead", "page_size": 16}\n', 1, "field 'version'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "page_size": 16}\n', 1, "field 'mode'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "sideways", "page_size": 16}\n', 1, "field 'mode'"),
    ('{"format": "pdo-trace", "version": 1, "role": "decode", "mode": "ahead"}\n', 1, "field 'mode'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "scheduler", "ev": "admit", "batch": 0}\n', 2, "field 'rids'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "s", "ev": "stage", "batch": 0}\n{oops\n', 3, "not JSON"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "s", "ev": 7}\n', 2, "field 'ev'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 1, "t_ns": 1, "ev": "teleport"}\n', 2, "field 'thread'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 2, "t_ns": 1, "thread": "s", "ev": "stage", "batch": 0}\n{"seq": 2, "t_ns": 1, "thread": "s", "ev": "stage", "batch": 1}\n', 3, "field 'seq'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "s", "ev": "stage", "batch": "zero"}\n', 2, "field 'batch'"),
]


@pytest.mark.parametrize("text,line,reason", MALFORMED)
def test_malformed_trace_exit_2_one_line(text, line, reason, tmp_path, capsys):
    p = tmp_path / "m.jsonl"
    p.write_text(text)
    assert main(["check", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{p}:{line}:" in err and reason in err, err


def test_an_engines_own_events_are_skipped_and_named(tmp_path, capsys):
    """An engine may log its own events, named x.<name> (docs/trace-format.md): the checker checks
    the trace as if they were not there and says what it skipped; any other unknown name, a
    misspelt event, is an error."""
    events = canonical("ahead")
    plus = []
    for e in events:
        plus.append(e)
        if e["ev"] == "submit":   # between submit and fwd_begin: where an adjacency rule would see it
            plus.append({"thread": e["thread"], "ev": "x.my_engine_note", "n": 1})
    path = write(tmp_path / "own.jsonl", "ahead", plus)
    assert main(["check", path]) == 0
    out = capsys.readouterr().out
    assert "skipped: x.my_engine_note (" in out, out
    assert main(["check", "--engine", "z3", path]) == 0
    assert "skipped: x.my_engine_note (" in capsys.readouterr().out
    assert main(["check", "--json", path]) == 0
    assert json.loads(capsys.readouterr().out)[0]["ignored"] == {"x.my_engine_note": sum(e["ev"] == "submit" for e in events)}
    typo = [{**e, "ev": "prefix_snd"} if e["ev"] == "prefix_send" else e for e in events]
    assert typo != events
    assert main(["check", write(tmp_path / "typo.jsonl", "ahead", typo)]) == 2
    assert "field 'ev': unknown event 'prefix_snd'" in capsys.readouterr().err


def test_missing_file_and_bad_flag_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "engine.cli", "check", str(tmp_path / "nope.jsonl")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "nope.jsonl" in r.stderr
    r = subprocess.run([sys.executable, "-m", "engine.cli", "run", "--mode", "sideways"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_trace_format_doc_lists_every_event():
    doc = (ROOT / "docs" / "trace-format.md").read_text()
    for ev in load_events()["prefill"]:
        assert f"`{ev}`" in doc, ev


def test_failed_check_explains_every_violated_rule(tmp_path):
    """With more violations than the text report shows, each violated rule is still explained once
    (the first of its kind), and the header counts them per rule."""
    from types import SimpleNamespace

    from checker.report import MAX_SHOWN, text_report

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}) + "\n")

    def rule(rid):
        return SimpleNamespace(id=rid, statement=f"statement of {rid}", seed="seed passage")

    many, rare = rule("P-many"), rule("P-rare")
    violations = [SimpleNamespace(rule=many, message=f"many #{i}", seqs=[]) for i in range(MAX_SHOWN + 5)]
    violations.append(SimpleNamespace(rule=rare, message="the rare one", seqs=[]))
    result = SimpleNamespace(ok=False, path=str(path), header={"role": "prefill", "mode": "ahead"}, events=99,
                             rules=[], violations=violations)
    text = text_report(result)
    assert f"{len(violations)} violation(s) of 2 rule(s)" in text
    assert f"P-many {MAX_SHOWN + 5}, P-rare 1" in text
    assert "the rare one" in text and text.count("[P-many]") == MAX_SHOWN - 1
    assert f"... and {len(violations) - MAX_SHOWN} more" in text
