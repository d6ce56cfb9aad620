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
    ('{"format": "pdo-trace", "version": 99, "role": "prefill", "page_size": 16}\n', 1, "field 'version'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill"}\n', 1, "field 'page_size'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "scheduler", "ev": "admit", "batch": 0}\n', 2, "field 'rids'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "s", "ev": "stage", "batch": 0}\n{oops\n', 3, "not JSON"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "s", "ev": "teleport"}\n', 2, "unknown event"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "page_size": 16}\n{"seq": 2, "t_ns": 1, "thread": "s", "ev": "stage", "batch": 0}\n{"seq": 2, "t_ns": 1, "thread": "s", "ev": "stage", "batch": 1}\n', 3, "field 'seq'"),
    ('{"format": "pdo-trace", "version": 1, "role": "prefill", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "s", "ev": "stage", "batch": "zero"}\n', 2, "field 'batch'"),
]


@pytest.mark.parametrize("text,line,reason", MALFORMED)
def test_malformed_trace_exit_2_one_line(text, line, reason, tmp_path, capsys):
    p = tmp_path / "m.jsonl"
    p.write_text(text)
    assert main(["check", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{p}:{line}:" in err and reason in err, err


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
    path.write_text(json.dumps({"format": "pdo-trace", "version": 1, "role": "prefill", "page_size": 16}) + "\n")

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
