"""Line numbers in a trace of many chunks: the reader counts lines only when one is needed (an
error, a cut line, the end of a trace cut short), so each such line is checked here against the
file's own numbering, deep in a file of several chunks, and against the reader that numbers every
line (iter_events)."""

from __future__ import annotations

import json

import pytest

from checker import trace_io
from checker.bench import make_big_trace
from checker.linear import check_file
from checker.trace_io import TraceFormatError, iter_events
from tests.trace_fixtures import canonical, write


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> list[str]:
    """The lines of a valid trace of about four chunks."""
    d = tmp_path_factory.mktemp("lines")
    base = write(d / "base.jsonl", "ahead", canonical("ahead"))
    out = str(d / "big.jsonl")
    make_big_trace(out, 4 * trace_io._CHUNK_BYTES // 110, base=base)
    lines = open(out).read().splitlines(keepends=True)
    assert sum(map(len, lines)) > 3 * trace_io._CHUNK_BYTES
    return lines


def _save(tmp_path, lines: list[str]) -> str:
    path = str(tmp_path / "t.jsonl")
    with open(path, "w") as f:
        f.writelines(lines)
    return path


def _error_line(path: str) -> int:
    with pytest.raises(TraceFormatError) as err:
        check_file(path)
    with pytest.raises(TraceFormatError) as numbered:
        list(iter_events(path))
    assert err.value.line == numbered.value.line
    return err.value.line


@pytest.mark.parametrize("at", [0.3, 0.62, 0.97])
def test_a_bad_line_deep_in_the_file_is_named_by_its_number(big, tmp_path, at):
    lines = list(big)
    k = int(len(lines) * at)
    lines[k] = lines[k].replace('"seq"', '"seq":"x","q"', 1)
    assert _error_line(_save(tmp_path, lines)) == k + 1


def test_a_cut_last_line_is_where_the_trace_stops(big, tmp_path):
    lines = big[:-3] + [big[-3][:20]]
    r = check_file(_save(tmp_path, lines))
    assert r.truncated == len(lines)


def test_a_trace_without_its_end_stops_after_its_last_line(big, tmp_path):
    r = check_file(_save(tmp_path, big[:-1]))
    assert r.truncated == len(big)


def test_a_run_ended_by_a_signal_stops_at_its_trace_end(big, tmp_path):
    end = json.loads(big[-1]) | {"reason": "signal"}
    r = check_file(_save(tmp_path, [*big[:-1], json.dumps(end) + "\n", "\n", "  \n"]))
    assert r.truncated == len(big)


def test_a_trace_end_that_miscounts_is_named_by_its_line(big, tmp_path):
    end = json.loads(big[-1])
    end["events"] += 1
    assert _error_line(_save(tmp_path, [*big[:-1], json.dumps(end) + "\n"])) == len(big)


def test_an_event_after_trace_end_names_the_end_s_line(big, tmp_path):
    """trace_end ends one chunk, another event begins the next."""
    i = next(n for n in range(len(big)) if sum(map(len, big[: n + 1])) >= trace_io._CHUNK_BYTES)
    end = json.loads(big[-1]) | {"seq": i, "events": i - 1}
    after = json.loads(big[i]) | {"seq": i + 1}
    lines = [*big[:i], json.dumps(end) + "\n", json.dumps(after) + "\n"]
    assert _error_line(_save(tmp_path, lines)) == i + 1


@pytest.mark.parametrize("newline", ["\n", ""])
def test_a_header_alone_stops_after_line_one(tmp_path, newline):
    header = {
        "format": "pdo-trace",
        "version": 4,
        "role": "prefill",
        "mode": "ahead",
        "page_size": 16,
    }
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(header) + newline)
    assert check_file(str(path)).truncated == 2
