"""Timelines: spans derived from point events, the Perfetto (Chrome trace-event) export with its tracks
and flow arrows, violations highlighted by `pdo check --perfetto`, the static plot, and the chunked
trace reader keeping exact file:line error messages."""

import json

import pytest

from checker.perfetto import export, timeline_of
from checker.trace_io import TraceFormatError, iter_events
from engine.cli import main

HEADER = {"format": "pdo-trace", "version": 1, "role": "prefill", "page_size": 16, "mode": "ahead"}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("tl")
    out = {}
    for mode in ("thread", "ahead"):
        p = d / f"{mode}.jsonl"
        assert (
            main(
                [
                    "run",
                    "--mode",
                    mode,
                    "--requests",
                    "10",
                    "--launch-cost-us",
                    "200",
                    "--trace",
                    str(p),
                ]
            )
            == 0
        )
        out[mode] = p
    return out


def _ev(seq, t_us, thread, ev, **f):
    return {"seq": seq, "t_ns": t_us * 1000, "thread": thread, "ev": ev, **f}


def test_spans_from_point_events():
    evs = [
        _ev(1, 0, "scheduler", "alloc", rid="a", obj="o1", slot=0),
        _ev(2, 10, "scheduler", "admit", batch=0, rids=["a"]),
        _ev(3, 12, "scheduler", "submit", batch=0),
        _ev(4, 15, "forward", "fwd_begin", batch=0, digest="d"),
        _ev(5, 14, "scheduler", "process_begin", batch=7),
        _ev(6, 25, "forward", "fwd_end", batch=0),
        _ev(7, 30, "scheduler", "process_end", batch=7),
        _ev(8, 40, "scheduler", "admit", batch=1, rids=["b"]),
        _ev(9, 45, "scheduler", "collect", batch=0),
        _ev(10, 46, "scheduler", "sample", batch=0),
        _ev(11, 50, "scheduler", "snapshot", batch=1, digest="d"),
        _ev(12, 60, "scheduler", "sample", batch=1),
        _ev(13, 70, "scheduler", "alloc", rid="c", obj="o3", slot=1),
    ]
    _, spans, events = timeline_of(evs)
    got = {(s.kind, s.batch): (s.thread, s.t0 // 1000, s.t1 // 1000) for s in spans}
    assert got[("admit", 0)] == ("scheduler", 0, 10)  # first admission: from its first event
    assert got[("admit", 1)] == ("scheduler", 30, 40)  # from the previous scheduler event
    assert got[("fwd", 0)] == ("forward", 15, 25)
    assert got[("process", 7)] == ("scheduler", 14, 30)
    assert got[("collect", 0)] == ("scheduler", 40, 45)
    assert got[("sample", 0)] == ("scheduler", 46, 50)  # until the thread's next event
    assert got[("sample", 1)] == ("scheduler", 60, 60)  # next event is admission's: zero long
    assert len(events) == len(evs)


def test_perfetto_export_tracks_spans_flows(traces, tmp_path):
    for mode, path in traces.items():
        out = tmp_path / f"{mode}.json"
        assert main(["trace", "export", str(path), "--perfetto", str(out)]) == 0
        doc = json.loads(out.read_text())
        evs = doc["traceEvents"]
        names = {
            e["args"]["name"]: e["tid"]
            for e in evs
            if e["ph"] == "M" and e["name"] == "thread_name"
        }
        assert {"scheduler", "forward"} <= set(names)
        spans = [
            e
            for e in evs
            if e["ph"] == "X" and e.get("dur", 0) > 0 or e["ph"] == "X" and e["cat"] != "step"
        ]
        cats = {e["cat"] for e in spans}
        assert {"admit", "fwd", "collect", "process"} <= cats, cats
        assert all(e["tid"] == names["forward"] for e in spans if e["cat"] == "fwd")
        assert all(
            e["tid"] == names["scheduler"]
            for e in spans
            if e["cat"] in ("admit", "process", "collect")
        )
        assert all(
            isinstance(e["ts"], int) and isinstance(e.get("dur", 0), int) for e in evs if "ts" in e
        )
        kv = [e for e in evs if e["ph"] == "i" and e["cat"] == "kv"]
        assert kv and all(e["s"] == "t" for e in kv)
        # flow v2: every fwd span receives the arrow its submit sends; every collect receives batch_copy's
        outs = {e["bind_id"]: e for e in evs if e.get("flow_out")}
        ins = {e["bind_id"]: e for e in evs if e.get("flow_in")}
        fwd = [e for e in evs if e["ph"] == "X" and e["cat"] == "fwd"]
        batches = {e["args"]["batch"] for e in fwd}
        assert len(fwd) == len(batches) > 1
        for e in fwd:
            src = outs[e["bind_id"]]
            assert (
                src["name"] == f"submit {e['args']['batch']}" and src["tid"] == names["scheduler"]
            )
            assert src["ts"] <= e["ts"]
        copies = [e for e in evs if e["ph"] == "X" and e["name"].startswith("batch_copy")]
        assert len(copies) == len(batches)
        for e in copies:
            dst = ins[e["bind_id"]]
            assert (
                dst["name"] == e["name"].replace("batch_copy", "collect") and dst["ts"] >= e["ts"]
            )


def test_spans_on_a_thread_nest(traces, tmp_path):
    """Chrome/Perfetto need slices on one thread to nest: no partial overlaps."""
    out = tmp_path / "a.json"
    export(str(traces["ahead"]), str(out))
    by_tid = {}
    for e in json.loads(out.read_text())["traceEvents"]:
        if e["ph"] == "X":
            by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for tid, iv in by_tid.items():
        iv.sort(key=lambda x: (x[0], -x[1]))
        stack = []
        for a, b in iv:
            while stack and stack[-1] <= a:
                stack.pop()
            assert not stack or b <= stack[-1], (tid, a, b, stack)
            stack.append(b)


def test_check_perfetto_highlights_violation(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    assert (
        main(
            [
                "run",
                "--mode",
                "ahead",
                "--requests",
                "8",
                "--inject",
                "two-forwards",
                "--no-verify",  # the run's outputs are wrong too; here the trace is the point
                "--trace",
                str(trace),
            ]
        )
        == 0
    )
    out = tmp_path / "bad.json"
    assert main(["check", str(trace), "--perfetto", str(out)]) == 1
    assert "FAIL" in capsys.readouterr().out
    evs = json.loads(out.read_text())["traceEvents"]
    marks = [
        e
        for e in evs
        if e["ph"] == "X" and e["cat"] == "violation" and e["name"].startswith("VIOLATION")
    ]
    assert marks and all(e["args"]["message"] for e in marks)
    track = [
        e
        for e in evs
        if e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"] == "pdo check"
    ]
    assert track
    rules = [
        e for e in evs if e["ph"] == "X" and e["cat"] == "violation" and e["tid"] == track[0]["tid"]
    ]
    assert rules and all(not r["name"].startswith("VIOLATION") for r in rules)
    linked = [e for e in marks if "bind_id" in e]
    assert (
        linked and any(e.get("flow_out") for e in linked) and any(e.get("flow_in") for e in linked)
    )
    assert main(["check", str(trace), str(trace), "--perfetto", str(out)]) == 2  # one trace only


def test_plot_writes_png(traces, tmp_path, capsys):
    for mode, path in traces.items():
        png = tmp_path / f"{mode}.png"
        assert main(["trace", "plot", str(path), "-o", str(png), "--batches", "1:3"]) == 0
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    # scheduler and forward, the transfer thread and copy stream with their completions, and the
    # forward and schedule streams with the WAR barrier's device half (fwd_done, staged)
    assert "6 lanes" in capsys.readouterr().out
    assert (
        main(
            [
                "trace",
                "plot",
                str(traces["ahead"]),
                "-o",
                str(tmp_path / "x.png"),
                "--batches",
                "900:901",
            ]
        )
        == 2
    )


def _write(path, lines):
    path.write_text(json.dumps(HEADER) + "\n" + "".join(lines))
    return str(path)


def _line(seq, ev="stage", **f):
    return (
        json.dumps({"seq": seq, "t_ns": seq, "thread": "scheduler", "ev": ev, "batch": seq, **f})
        + "\n"
    )


def test_chunked_reader_keeps_exact_errors(tmp_path):
    n = 9000  # several chunks
    good = [_line(i + 1) for i in range(n)]
    assert sum(1 for _ in iter_events(_write(tmp_path / "g.jsonl", good))) == n
    cases = [
        (7000, '{"seq": 7001, oops\n', "not JSON"),
        (7000, '{"seq": 1, "t_ns": 1, "thread": "s", "ev": "stage", "batch": 1}\n', "field 'seq'"),
        (8000, _line(8001, ev="teleport"), "unknown event"),
        (
            5000,
            '{"seq": 5001, "t_ns": 1, "thread": "s", "ev": "stage", "batch": true}\n',
            "field 'batch'",
        ),
        (
            5000,
            '{"seq": 5001, "t_ns": 1, "thread": "s", "ev": "stage", "batch": 1}{"seq": 5002}\n',
            "not JSON",
        ),
        (5000, "[1, 2]\n", "must be a JSON object"),
    ]
    for i, bad, reason in cases:
        lines = good[:i] + [bad] + [_line(j + 100000) for j in range(i + 1, n)]
        p = _write(tmp_path / "b.jsonl", lines)
        with pytest.raises(TraceFormatError) as exc:
            for _ in iter_events(p):
                pass
        assert exc.value.line == i + 2 and reason in exc.value.reason, (exc.value, reason)
    # blank lines count, events after them keep their line numbers
    lines = good[:3] + ["\n", "   \n"] + good[3:6]
    got = [ln for ln, _ in iter_events(_write(tmp_path / "blank.jsonl", lines))]
    assert got == [2, 3, 4, 7, 8, 9]
    # invalid UTF-8 deep in the file: the line is named exactly
    p = tmp_path / "u.jsonl"
    p.write_bytes((json.dumps(HEADER) + "\n" + "".join(good[:6000])).encode() + b'{"seq": \xff}\n')
    with pytest.raises(TraceFormatError) as exc:
        for _ in iter_events(str(p)):
            pass
    assert exc.value.line == 6002 and "UTF-8" in exc.value.reason
