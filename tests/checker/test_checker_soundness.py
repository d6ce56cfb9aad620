"""Traces that must not pass: edits of a valid trace that each slipped past both checkers."""

import json

import pytest

from checker import z3check
from checker.linear import CROSS_TEMPLATES, TEMPLATES, check_file
from engine.cli import main
from spec import PARAMS, _check_params
from tests.checker import test_decode_rules as decode_fixtures
from tests.checker.test_rules_violations import VIOLATIONS
from tests.trace_fixtures import canonical, write


def _renumber(events, f):
    return [{**e, "batch": f(e["batch"])} if "batch" in e else e for e in events]


def test_a_gap_in_batch_ids_is_malformed_not_a_pass(tmp_path, capsys):
    """The rules relate N to N±1 by id: with ids 0, 2, 4, ... nothing would be compared (the queue
    capacity violation below passed both checkers)."""
    mode, edit = VIOLATIONS["P-queue-capacity"]
    events = canonical(mode)
    edit(events)
    dense = write(tmp_path / "dense.jsonl", mode, events)
    assert "P-queue-capacity" in {v.rule.id for v in check_file(dense).violations}
    sparse = write(tmp_path / "sparse.jsonl", mode, _renumber(events, lambda b: 2 * b))
    for engine in ("linear", "z3"):
        assert main(["check", "--engine", engine, sparse]) == 2
        err = capsys.readouterr().err
        assert (
            "field 'batch': batch 1 was never admitted, but 0 and 2 were" in err
            and "\n" not in err.strip()
        ), err
    # far from 0 but consecutive is fine
    shifted = write(
        tmp_path / "shifted.jsonl", mode, _renumber(canonical(mode), lambda b: b + 1000)
    )
    assert main(["check", shifted]) == 0


def test_seq_may_start_at_zero(tmp_path, capsys):
    path = write(tmp_path / "t.jsonl", "ahead", canonical("ahead"))
    lines = open(path).read().splitlines()
    zero = [lines[0]] + [
        json.dumps({**json.loads(x), "seq": json.loads(x)["seq"] - 1}) for x in lines[1:]
    ]
    (tmp_path / "z.jsonl").write_text("\n".join(zero) + "\n")
    assert main(["check", str(tmp_path / "z.jsonl")]) == 0


def test_ahead_processing_cannot_spill_into_the_next_round(tmp_path):
    """process_end(0) after admit(2), collect(1), sample(1) and submit(2): P(0) spanning a whole round."""
    events = canonical("ahead")
    i = next(k for k, e in enumerate(events) if e["ev"] == "process_end" and e["batch"] == 0)
    e = events.pop(i)
    j = next(k for k, x in enumerate(events) if x["ev"] == "submit" and x["batch"] == 2)
    events.insert(j + 1, e)
    ids = {v.rule.id for v in check_file(write(tmp_path / "t.jsonl", "ahead", events)).violations}
    assert "P-ahead-process-before-next-round" in ids, ids


def _exit2(path, capsys, what):
    assert main(["check", path]) == 2
    err = capsys.readouterr().err.strip()
    assert what in err and ":" in err and "\n" not in err and "Traceback" not in err, err


def test_optional_fields_are_typed_when_present(tmp_path, capsys):
    """`rooms` as a string made the decode rooms rules vacuous; `tokens` as a string crashed the
    page-count rule with a bare Python message."""
    events = decode_fixtures.base()
    rooms = [e for e in events if "rooms" in e[2]]
    assert rooms
    bad = [(t, ev, {**f, "rooms": "x"}) if "rooms" in f else (t, ev, f) for t, ev, f in events]
    _exit2(
        decode_fixtures.write(tmp_path / "rooms.jsonl", bad), capsys, "field 'rooms': not list[int]"
    )
    ev = canonical("ahead")
    k = next(i for i, e in enumerate(ev) if e["ev"] == "prefix_send")
    ev[k] = {**ev[k], "tokens": "64"}
    _exit2(
        write(tmp_path / "tokens.jsonl", "ahead", ev),
        capsys,
        "field 'tokens': not int in 'prefix_send'",
    )


def test_header_fields_rules_read_are_validated(tmp_path, capsys):
    for header, what in [
        ({"page_size": 0}, "field 'page_size'"),
        ({"page_size": "16"}, "field 'page_size'"),
        ({"prefetch": "false"}, "field 'prefetch'"),
        ({"dp_size": "2"}, "field 'dp_size'"),
        ({"dp_size": 2, "dp_rank": 2}, "field 'dp_rank'"),
    ]:
        _exit2(
            decode_fixtures.write(tmp_path / "h.jsonl", decode_fixtures.base(), **header),
            capsys,
            what,
        )
    head = json.dumps({"format": "pdo-trace", "version": 1, "role": "decode", "mode": "overlap"})
    (tmp_path / "nops.jsonl").write_text(head + "\n")
    _exit2(str(tmp_path / "nops.jsonl"), capsys, "field 'page_size'")


def test_a_dropped_kv_send_fails(tmp_path):
    """Dropping a chunk's KV send (here the last chunk's of a chunked request) passed both checkers
    while any other send of that request existed."""
    events = canonical("ahead")
    sends = [i for i, e in enumerate(events) if e["ev"] == "kv_send"]
    multi = [
        r
        for r in {events[i]["rid"] for i in sends}
        if sum(events[i]["rid"] == r for i in sends) > 1
    ]
    assert multi, "the fixture needs a chunked request"
    for drop in (min, max):  # its first chunk's send, then its last chunk's
        ev = list(events)
        del ev[drop(i for i in sends if ev[i]["rid"] == multi[0])]
        path = write(tmp_path / "t.jsonl", "ahead", ev)
        assert "P-send-each-chunk" in {v.rule.id for v in check_file(path).violations}
        assert "P-send-each-chunk" in z3check.check_file(path).violated


def test_rule_parameters_are_checked_at_load():
    """A misspelt event or parameter in the rule data fails at load instead of checking nothing."""
    # every kind has a linear template
    assert set(PARAMS) == set(TEMPLATES) | set(CROSS_TEMPLATES)
    ok = {"chain": [["collect", 0], ["sample", 0]]}
    _check_params("rules.toml", "X", "order", ok, "prefill", ("ahead",))
    for params, what in [
        ({"chain": [["colect", 0], ["sample", 0]]}, "'colect' is not an event"),
        ({**ok, "not_thred": "forward"}, r"unknown parameter\(s\) not_thred"),
        ({"chain": [["collect", 0]]}, "at least two"),
        ({**ok, "same_thread": "yes"}, "expected bool"),
    ]:
        with pytest.raises(ValueError, match=what):
            _check_params("rules.toml", "X", "order", params, "prefill", ("ahead",))
    with pytest.raises(ValueError, match="missing parameter 'span'"):
        _check_params("rules.toml", "X", "in_span", {"ev": "kv_send"}, "prefill", ("ahead",))


def test_no_synchronous_query_while_memory_is_released(tmp_path):
    """D-release-cancels covered only prefetch submits and receiver inits: a synchronous query (or a
    parallel-info fetch) between release_memory and resume_memory passed."""
    events = decode_fixtures.base()
    k = next(i for i, (_, ev, f) in enumerate(events) if ev == "query_begin" and f["qid"] == 1)
    events[k:k] = [(decode_fixtures.S, "release_memory", {})]
    j = next(i for i, (_, ev, f) in enumerate(events) if ev == "resolve" and f["rooms"] == [2])
    events[j + 1 : j + 1] = [(decode_fixtures.S, "resume_memory", {})]
    path = decode_fixtures.write(tmp_path / "t.jsonl", events)
    lin = [v for v in check_file(path).violations if v.rule.id == "D-release-cancels"]
    assert lin and "query_begin (query 1) after release_memory" in lin[0].message, lin
    assert "D-release-cancels" in z3check.check_file(path).violated


def test_a_gap_in_decode_batch_ids_is_malformed_too(tmp_path, capsys):
    events = [
        (t, ev, {**f, "batch": 2 * f["batch"]}) if "batch" in f else (t, ev, f)
        for t, ev, f in decode_fixtures.base()
    ]
    assert len({f["batch"] for _, ev, f in events if ev == "admit"}) > 1
    _exit2(
        decode_fixtures.write(tmp_path / "gap.jsonl", events),
        capsys,
        "admitted batch ids must be consecutive",
    )


def test_rule_modes_and_threads_are_checked_at_load():
    ok = {"chain": [["collect", 0], ["sample", 0]]}
    with pytest.raises(ValueError, match="'modes' must list modes of role prefill"):
        _check_params("rules.toml", "X", "order", ok, "prefill", ("ahaed",))
    with pytest.raises(ValueError, match="expected a thread"):
        _check_params(
            "rules.toml",
            "X",
            "thread",
            {"events": ["submit"], "thread": "forwrd"},
            "prefill",
            ("ahead",),
        )
