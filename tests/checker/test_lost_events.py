"""A trace missing events never passes (issue 29, defect 1): from format version 2 on, `seq` counts
the events and `trace_end` says how many there were, so a line taken out anywhere is bad input that
names the file and line (and, with happens-before clocks, the thread that lost it); a trace without
its `trace_end` stays truncated (exit 3)."""

from __future__ import annotations

import contextlib
import io
import json
import random

import pytest

from engine.cli import exits, main
from engine.cli.check_deletions import campaign, check_set
from tests.trace_fixtures import canonical, write

MODES = ("normal", "overlap", "thread", "ahead")


def _run(*args: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["run", *args, "--no-verify"]) == 0


@pytest.fixture(scope="module")
def engine_traces(tmp_path_factory):
    """One engine trace per prefill mode, one with clocks (--hb), and a PD run's three traces."""
    d = tmp_path_factory.mktemp("lost")
    out = {}
    for m in MODES:
        out[m] = str(d / f"{m}.jsonl")
        _run("--mode", m, "--requests", "3", "--trace", out[m])
    out["hb"] = str(d / "hb.jsonl")
    _run("--mode", "thread", "--requests", "3", "--hb", "--trace", out["hb"])
    _run("--pd", "--dp", "2", "--requests", "4", "--trace", str(d / "pd.jsonl"))
    out["pd"] = [str(d / f"pd.{r}.jsonl") for r in ("decode", "prefill0", "prefill1")]
    return out


def _lines(path: str) -> list[str]:
    return open(path).read().splitlines(keepends=True)


def _write(path, lines) -> str:
    open(path, "w").write("".join(lines))
    return str(path)


def test_the_whole_traces_pass(engine_traces):
    for m in MODES:
        assert check_set([engine_traces[m]]) == (exits.OK, "")
    assert check_set(engine_traces["pd"]) == (exits.OK, "")


def test_the_issue_reproductions_do_not_pass(engine_traces, tmp_path):
    lines = _lines(engine_traces["ahead"])
    lost = _write(tmp_path / "lost.jsonl", [x for x in lines if '"ev":"store_entry"' not in x])
    rc, err = check_set([lost])
    assert rc == exits.BAD_INPUT and err.startswith(f"pdo check: error: {lost}:")
    assert "field 'seq'" in err and "missing" in err and "lost events" in err
    none = _write(tmp_path / "none.jsonl", [lines[0], lines[-1]])
    rc, err = check_set([none])
    assert rc == exits.BAD_INPUT and f"{none}:2: field 'seq'" in err
    decode, *prefills = engine_traces["pd"]
    d = _lines(decode)
    i = next(i for i, x in enumerate(d) if '"ev":"query_begin"' in x)
    cut = _write(tmp_path / "pd.decode.jsonl", d[:i] + d[i + 1 :])
    rc, err = check_set([cut, *prefills])
    assert rc == exits.BAD_INPUT and err.startswith(f"pdo check: error: {cut}:{i + 1}: field 'seq'")


def test_a_trace_end_that_counts_more_is_named(engine_traces, tmp_path):
    lines = _lines(engine_traces["normal"])
    end = json.loads(lines[-1])
    end["events"] += 1
    path = _write(tmp_path / "t.jsonl", lines[:-1] + [json.dumps(end) + "\n"])
    rc, err = check_set([path])
    assert rc == exits.BAD_INPUT
    assert f"{path}:{len(lines)}: field 'events': trace_end says {end['events']} events" in err


def test_a_trace_without_its_end_stays_truncated(engine_traces, tmp_path):
    path = _write(tmp_path / "t.jsonl", _lines(engine_traces["thread"])[:-1])
    assert check_set([path])[0] == exits.INCOMPLETE


def test_the_clocks_name_the_thread_that_lost_events(engine_traces, tmp_path):
    lines = _lines(engine_traces["hb"])
    i = next(i for i, x in enumerate(lines) if i > 20 and '"thread":"forward"' in x)
    path = _write(tmp_path / "t.jsonl", lines[:i] + lines[i + 1 :])
    rc, err = check_set([path])
    assert rc == exits.BAD_INPUT and f"{path}:{i + 1}: field 'seq'" in err
    assert "thread 'forward' lost 1 before line" in err


def test_a_line_too_deep_for_json_after_a_gap_is_still_bad_input(engine_traces, tmp_path):
    """Naming the thread that lost events reads the file again with json, which a line nested
    thousands deep overflows (a fuzz case: exit 70, an internal error): the clocks say nothing
    past it, and the gap is bad input as any other."""
    lines = _lines(engine_traces["hb"])
    i = next(
        i
        for i, x in enumerate(lines)
        if i > 20 and '"thread":"forward"' in x and '"thread":"forward"' not in lines[i + 1]
    )
    kept = lines[:i] + lines[i + 1 :]  # the clocks see the loss at the next forward event
    deep = '{"x": ' + "[" * 5000 + "]" * 5000 + "}\n"
    path = _write(tmp_path / "t.jsonl", kept[: i + 1] + [deep] + kept[i + 1 :])
    rc, err = check_set([path])
    assert rc == exits.BAD_INPUT and f"{path}:{i + 1}: field 'seq'" in err


def test_deleting_any_event_of_an_engine_trace_never_passes(engine_traces, tmp_path):
    """Every event kind of every prefill mode and of a PD run (decode and prefill traces checked
    together), three lines of each kind, and the header: never exit 0."""
    sets = [[engine_traces[m]] for m in MODES] + [engine_traces["pd"]]
    res = campaign(sets, str(tmp_path), per_kind=3, seed=0)
    assert res["problems"] == []
    assert set(res["counts"]) == {exits.BAD_INPUT, exits.INCOMPLETE}
    assert {"trace_end", "admit", "fwd_begin", "query_begin", "kv_send"} <= set(res["kinds"])


def test_deleting_every_line_of_the_fixture_traces_never_passes(tmp_path):
    paths = [write(tmp_path / f"{m}.jsonl", m, canonical(m)) for m in MODES]
    res = campaign([[p] for p in paths], str(tmp_path / "cases"))
    assert res["problems"] == []
    assert res["counts"][exits.INCOMPLETE] == len(paths)  # the trace_end lines


def test_a_version_1_trace_still_reads_as_before(tmp_path):
    """Version 1 (the SGLang adapter's) has no trace_end and promises only an increasing seq."""
    events = canonical("normal")
    lines = [
        json.dumps(
            {"format": "pdo-trace", "version": 1, "role": "prefill", "mode": "normal"}
            | {"page_size": 16}
        )
    ]
    v1 = [e for e in events if e["ev"] not in ("kv_delivered", "store_copied", "store_entry")]
    v1 = [e for e in v1 if e["ev"] not in ("fwd_done", "staged")]
    seqs = sorted(random.Random(0).sample(range(1, 10 * len(v1)), len(v1)))
    lines += [json.dumps({"seq": s, "t_ns": s, **e}) for s, e in zip(seqs, v1)]
    path = _write(tmp_path / "v1.jsonl", [x + "\n" for x in lines])
    assert check_set([path])[0] == exits.OK
