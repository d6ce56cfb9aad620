"""The CLI's contract: a bare `pdo run` works, `pdo check` exits 0/1/2, malformed traces get one line
naming file, line and field; the trace-format doc lists every event of the vocabulary."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from engine.cli import main
from spec import load_events
from tests.trace_fixtures import canonical, write

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
    assert rep[0]["ok"] is False and any(
        v["rule"] == "P-run-on-scheduler" for v in rep[0]["violations"]
    )


MALFORMED = [
    ("", 1, "empty file"),
    ("not json\n", 1, "header is not JSON"),
    ('{"format": "other", "version": 1}\n', 1, "field 'format'"),
    (
        '{"format": "pdo-trace", "version": 99, "role": "prefill", "mode": "normal", "page_size": 16}\n',
        1,
        "field 'version'",
    ),
    (
        '{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "ahead"}\n',
        1,
        "field 'page_size'",
    ),
    (
        '{"format": "pdo-trace", "version": true, "role": "prefill", "mode": "ahead", "page_size": 16}\n',
        1,
        "field 'version'",
    ),
    (
        '{"format": "pdo-trace", "version": 1.0, "role": "prefill", "mode": "ahead", "page_size": 16}\n',
        1,
        "field 'version'",
    ),
    (
        '{"format": "pdo-trace", "version": 1, "role": "prefill", "page_size": 16}\n',
        1,
        "field 'mode'",
    ),
    (
        '{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "sideways", "page_size": 16}\n',
        1,
        "field 'mode'",
    ),
    (
        '{"format": "pdo-trace", "version": 1, "role": "decode", "mode": "ahead"}\n',
        1,
        "field 'mode'",
    ),
    (
        '{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "scheduler", "ev": "admit", "batch": 0}\n',
        2,
        "field 'rids'",
    ),
    (
        '{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "s", "ev": "stage", "batch": 0}\n{oops\n',
        3,
        "not JSON",
    ),
    (
        '{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "s", "ev": 7}\n',
        2,
        "field 'ev'",
    ),
    (
        '{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 1, "t_ns": 1, "ev": "teleport"}\n',
        2,
        "field 'thread'",
    ),
    (
        '{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 2, "t_ns": 1, "thread": "s", "ev": "stage", "batch": 0}\n{"seq": 2, "t_ns": 1, "thread": "s", "ev": "stage", "batch": 1}\n',
        3,
        "field 'seq'",
    ),
    (
        '{"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal", "page_size": 16}\n{"seq": 1, "t_ns": 1, "thread": "s", "ev": "stage", "batch": "zero"}\n',
        2,
        "field 'batch'",
    ),
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
        if (
            e["ev"] == "submit"
        ):  # between submit and fwd_begin: where an adjacency rule would see it
            plus.append({"thread": e["thread"], "ev": "x.my_engine_note", "n": 1})
    path = write(tmp_path / "own.jsonl", "ahead", plus)
    assert main(["check", path]) == 0
    out = capsys.readouterr().out
    assert "skipped: x.my_engine_note (" in out, out
    assert main(["check", "--engine", "z3", path]) == 0
    assert "skipped: x.my_engine_note (" in capsys.readouterr().out
    assert main(["check", "--json", path]) == 0
    assert json.loads(capsys.readouterr().out)[0]["ignored"] == {
        "x.my_engine_note": sum(e["ev"] == "submit" for e in events)
    }
    typo = [{**e, "ev": "prefix_snd"} if e["ev"] == "prefix_send" else e for e in events]
    assert typo != events
    assert main(["check", write(tmp_path / "typo.jsonl", "ahead", typo)]) == 2
    assert "field 'ev': unknown event 'prefix_snd'" in capsys.readouterr().err


def test_missing_file_and_bad_flag_are_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "check", str(tmp_path / "nope.jsonl")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "nope.jsonl" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "--mode", "sideways"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr


_TICK = re.compile(r"`([^`]+)`")
# role -> the doc and the header line of its vocabulary table
EVENT_TABLES = {
    "prefill": ("docs/trace-format.md", "| ev | where it is logged | fields |"),
    "decode": ("docs/decode.md", "| ev | where | fields |"),
}


def _table_rows(text: str, header: str) -> list[list[str]]:
    lines = text.splitlines()
    start = [i for i, ln in enumerate(lines) if ln.strip() == header]
    assert len(start) == 1, f"table {header!r}: found {len(start)} times"
    rows = []
    for ln in lines[start[0] + 2 :]:  # past the header and the |---| line
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def _row_fields(evs: list[str], cell: str) -> dict[str, set]:
    """The fields a table row gives each of its events. The cell's notation: `a`, `b` for every event
    of the row; `x` / `y` as the last item: the first event gets x, the second y; a clause `ev`: ...,
    `ev` also ..., or a suffix of one event's name (begin: ..., end: ...): that event only, also in
    parentheses; (+ `f`, ...): optional fields of every event; other parentheses and — are prose."""
    out = {e: set() for e in evs}

    def target(word):
        m = _TICK.fullmatch(word)
        hits = (
            [m.group(1)] if m and m.group(1) in evs else [e for e in evs if e.endswith("_" + word)]
        )
        return hits if len(hits) == 1 else None

    for par in re.findall(r"\(([^()]*)\)", cell):
        head, _, rest = par.partition(":")
        if par.lstrip().startswith("+"):
            for e in evs:
                out[e] |= set(_TICK.findall(par))
        elif rest and target(head.strip()):
            out[target(head.strip())[0]] |= set(_TICK.findall(rest))
    for clause in re.sub(r"\([^()]*\)", "", cell).split(";"):
        clause = clause.strip()
        m = re.match(r"(`\w+`|\w+)(:| also) ", clause)
        if m and target(m.group(1)):
            out[target(m.group(1))[0]] |= set(_TICK.findall(clause[m.end() :]))
        elif " / " in clause:
            assert len(evs) == 2, (evs, clause)
            left, right = clause.split(" / ")
            names = _TICK.findall(left)
            for e in evs:
                out[e] |= set(names[:-1])
            out[evs[0]].add(names[-1])
            out[evs[1]] |= set(_TICK.findall(right))
        elif clause != "—":
            for e in evs:
                out[e] |= set(_TICK.findall(clause))
    return out


def _doc_vocabulary(text: str, header: str) -> dict[str, set]:
    vocab: dict[str, set] = {}
    for cells in _table_rows(text, header):
        evs = _TICK.findall(cells[0])
        assert evs and not set(evs) & set(vocab), cells[0]
        vocab.update(_row_fields(evs, cells[-1]))
    return vocab


def _spec_vocabulary(role: str) -> dict[str, set]:
    return {
        ev: set(d.get("fields", {})) | set(d.get("optional", {}))
        for ev, d in load_events()[role].items()
    }


@pytest.mark.parametrize("role", sorted(EVENT_TABLES))
def test_trace_format_doc_lists_every_event(role):
    """The vocabulary tables of docs/trace-format.md (prefill) and docs/decode.md (decode) name exactly
    the events of spec/events.toml, each with exactly its fields (required and optional)."""
    path, header = EVENT_TABLES[role]
    doc, spec = _doc_vocabulary((ROOT / path).read_text(), header), _spec_vocabulary(role)
    assert sorted(set(doc) - set(spec)) == [] and sorted(set(spec) - set(doc)) == [], (
        path,
        "events differ",
    )
    wrong = {
        ev: {"doc": sorted(doc[ev]), "spec": sorted(spec[ev])} for ev in spec if doc[ev] != spec[ev]
    }
    assert not wrong, (path, wrong)


def test_the_doc_sync_parser_sees_each_notation():
    """The parser behind the doc-sync test reads every notation the tables use, and a dropped field or
    event shows up."""
    cells = {
        "`alloc` / `release`|`rid`, `obj`, `slot`": {
            "alloc": {"rid", "obj", "slot"},
            "release": {"rid", "obj", "slot"},
        },
        "`chunk_inc`|`rid`, `value` (after)": {"chunk_inc": {"rid", "value"}},
        "`prefix_send`|`batch` (+ `tokens`, `pages`, checked when present)": {
            "prefix_send": {"batch", "tokens", "pages"}
        },
        "`fwd_begin` / `fwd_end`|`batch`; `fwd_begin` also `digest` of what it reads": {
            "fwd_begin": {"batch", "digest"},
            "fwd_end": {"batch"},
        },
        "`q_begin` / `q_end`|`addr`; begin: `source`; end: `result` or `error`": {
            "q_begin": {"addr", "source"},
            "q_end": {"addr", "result", "error"},
        },
        "`req_done` / `req_abort`|`rid`, `room`, `tokens` / `reason`": {
            "req_done": {"rid", "room", "tokens"},
            "req_abort": {"rid", "room", "reason"},
        },
        "`release_memory` / `resume_memory`|—": {"release_memory": set(), "resume_memory": set()},
        "`admit`, `stage`|`batch` (`admit`: `rids`)": {
            "admit": {"batch", "rids"},
            "stage": {"batch"},
        },
    }
    for row, want in cells.items():
        evs, cell = row.split("|")
        assert _row_fields(_TICK.findall(evs), cell) == want, row
    path, header = EVENT_TABLES["prefill"]
    text = (ROOT / path).read_text()
    assert _doc_vocabulary(text, header) == _spec_vocabulary("prefill")
    dropped = _doc_vocabulary(text.replace("`fwd_begin` also `digest`", "`fwd_begin` also"), header)
    assert dropped["fwd_begin"] == {"batch"}
    without = re.sub(r"(?m)^\| `kv_send` \|.*\n", "", text)
    assert without != text and "kv_send" not in _doc_vocabulary(without, header)


def test_failed_check_explains_every_violated_rule(tmp_path):
    """With more violations than the text report shows, each violated rule is still explained once
    (the first of its kind), and the header counts them per rule."""
    from types import SimpleNamespace

    from checker.report import MAX_SHOWN, text_report

    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps(
            {
                "format": "pdo-trace",
                "version": 1,
                "role": "prefill",
                "mode": "normal",
                "page_size": 16,
            }
        )
        + "\n"
    )

    def rule(rid):
        return SimpleNamespace(id=rid, statement=f"statement of {rid}", design="design passage")

    many, rare = rule("P-many"), rule("P-rare")
    violations = [
        SimpleNamespace(rule=many, message=f"many #{i}", seqs=[]) for i in range(MAX_SHOWN + 5)
    ]
    violations.append(SimpleNamespace(rule=rare, message="the rare one", seqs=[]))
    result = SimpleNamespace(
        ok=False,
        path=str(path),
        header={"role": "prefill", "mode": "ahead"},
        events=99,
        rules=[],
        violations=violations,
        ignored={},
    )
    text = text_report(result)
    assert f"{len(violations)} violation(s) of 2 rule(s)" in text
    assert f"P-many {MAX_SHOWN + 5}, P-rare 1" in text
    assert "the rare one" in text and text.count("[P-many]") == MAX_SHOWN - 1
    assert f"... and {len(violations) - MAX_SHOWN} more" in text
