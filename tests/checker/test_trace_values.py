"""Values in a trace: the traces of a PD run must agree (dp_size, one trace per rank), header
values of the wrong type are refused, the nesting limit counts arrays and objects alike, and the
typed fast path (checker/typed_decode.py) accepts only what the exact path accepts, reading it the
same (issue 29, defects 8 and 9)."""

from __future__ import annotations

import contextlib
import io
import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checker.fuzz.trace_mutate import ODD_VALUES
from checker.json_values import MAX_DEPTH
from checker.linear import check_file
from checker.trace_io import _chunk_slow, _role_tables
from checker.typed_decode import decode_chunk
from engine.cli import exits, main
from engine.cli.check_deletions import check_set
from tests.trace_fixtures import canonical, write


@pytest.fixture(scope="module")
def pd_set(tmp_path_factory):
    d = tmp_path_factory.mktemp("pdset")
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            main(["run", "--pd", "--dp", "2", "--requests", "3", "--trace", str(d / "pd.jsonl")])
            == 0
        )
    return [str(d / f"pd.{r}.jsonl") for r in ("decode", "prefill0", "prefill1")]


def _with_header(src: str, dst, **fields) -> str:
    lines = open(src).read().splitlines(keepends=True)
    header = json.loads(lines[0]) | fields
    open(dst, "w").write(json.dumps(header) + "\n" + "".join(lines[1:]))
    return str(dst)


def test_a_pd_set_whose_dp_size_differs_is_bad_input(pd_set, tmp_path):
    decode, p0, p1 = pd_set
    odd = _with_header(p0, tmp_path / "pd.prefill0.jsonl", dp_size=3)
    for engine in ([], ["--engine", "z3"]):
        rc, err = check_set([*engine, decode, odd, p1])
        assert rc == exits.BAD_INPUT
        assert err.strip() == (
            f"pdo check: error: {odd}:1: field 'dp_size': 3, but {decode} says 2 "
            "(the traces of one PD run must agree)"
        )


def test_a_pd_set_with_two_traces_of_one_rank_is_bad_input(pd_set, tmp_path):
    decode, p0, p1 = pd_set
    twin = _with_header(p1, tmp_path / "pd.prefill1.jsonl", dp_rank=0)
    rc, err = check_set([decode, p0, twin])
    assert rc == exits.BAD_INPUT and f"{twin}:1: field 'dp_rank': 0 is also the rank of" in err


@pytest.mark.parametrize(
    "field,value",
    [
        ("chunk_ranges", "true"),
        ("memory_waits", "0"),
        ("memory_waits", -1),
        ("sampling", "sometimes"),
        ("hb", 5),
        ("prefetch", "yes"),
    ],
)
def test_a_header_value_of_the_wrong_type_is_refused(tmp_path, field, value):
    path = write(tmp_path / "t.jsonl", "ahead", canonical("ahead"))
    odd = _with_header(path, tmp_path / "odd.jsonl", **{field: value})
    rc, err = check_set([odd])
    assert rc == exits.BAD_INPUT and err.startswith(f"pdo check: error: {odd}:1: field '{field}'")


def _nested(kind: str, levels: int, inner: str) -> str:
    """`levels` arrays or objects inside one another, `inner` in the innermost."""
    if kind == "[]":
        return "[" * levels + inner + "]" * levels
    value = inner or ""
    for _ in range(levels):
        value = '{"k":' + value + "}" if value else "{}"
    return value


@pytest.mark.parametrize("where", ["event", "header"])
@pytest.mark.parametrize("inner", ["", "1"])
def test_the_nesting_limit_counts_arrays_and_objects_alike(tmp_path, where, inner):
    """A line's own object is level 1; at most MAX_DEPTH levels, whichever kinds nest."""
    path = write(tmp_path / "t.jsonl", "ahead", canonical("ahead"))
    lines = open(path).read().splitlines()
    row = 0 if where == "header" else 1
    verdicts = {}
    for kind in ("[]", "{}"):
        for levels in range(MAX_DEPTH - 2, MAX_DEPTH + 2):  # with the line's own object: +1
            edited = list(lines)
            edited[row] = lines[row][:-1] + ', "x_deep": ' + _nested(kind, levels, inner) + "}"
            case = tmp_path / f"{where}{kind}{levels}.jsonl"
            case.write_text("\n".join(edited) + "\n")
            rc, err = check_set([str(case)])
            verdicts[kind, levels] = rc
            if levels + 1 > MAX_DEPTH:
                assert rc == exits.BAD_INPUT and "nested deeper than 64 levels" in err
            else:
                assert rc == exits.OK, err
    assert {lv: rc for (k, lv), rc in verdicts.items() if k == "[]"} == {
        lv: rc for (k, lv), rc in verdicts.items() if k == "{}"
    }


def test_a_json_error_message_says_at_once(tmp_path):
    path = write(tmp_path / "t.jsonl", "ahead", canonical("ahead"))
    lines = open(path).read().splitlines()
    lines[1] = lines[1].replace('"scheduler"', '"sched\tuler"')  # a raw control character
    open(path, "w").write("\n".join(lines) + "\n")
    rc, err = check_set([path])
    assert rc == exits.BAD_INPUT and "Invalid control character at column" in err
    assert "at at" not in err


HEADER = {"format": "pdo-trace", "version": 4, "role": "prefill", "mode": "ahead", "page_size": 16}
EVENTS = [{"seq": i, "t_ns": i, **e} for i, e in enumerate(canonical("ahead"), 1)]


def test_the_typed_path_reads_every_event_of_the_fixtures_as_orjson_does():
    tables = _role_tables("prefill", 4)
    raw = [json.dumps(e).encode() + b"\n" for e in EVENTS]
    assert decode_chunk(tables[3], raw) == [orjson.loads(x) for x in raw]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(range(len(EVENTS))),
    st.sampled_from(["seq", "t_ns", "thread", "batch", "rid", "obj", "rids", "chunks", "vc", "zz"]),
    st.sampled_from(
        ODD_VALUES + [1 << 63, -(1 << 63) - 1, (1 << 63) - 1, {"a": [1, {"b": 2}]}, {"r": [0, 1]}]
    ),
)
def test_the_typed_path_accepts_only_what_the_exact_path_accepts(i, field, value):
    tables = _role_tables("prefill", 4)
    e = dict(EVENTS[i]) | {field: value}
    raw = [json.dumps(e).encode() + b"\n"]
    fast = decode_chunk(tables[3], raw)
    if fast is None:
        return
    exact = [ev for _, ev in _chunk_slow("t", 2, raw, e["seq"] - 1, tables, HEADER)]
    assert fast == exact


def test_deep_nesting_in_a_typed_field_is_bad_input_not_a_crash(tmp_path):
    """msgspec gives up on 2,000 nested arrays with a RecursionError: the exact path words it."""
    path = write(tmp_path / "t.jsonl", "ahead", canonical("ahead"))
    lines = open(path).read().splitlines()
    e = json.loads(lines[2])
    lines[2] = json.dumps(e | {"seq": 0})[:-1].replace(
        '"seq": 0', '"seq": ' + "[" * 2000 + "]" * 2000
    )
    lines[2] += "}"
    open(path, "w").write("\n".join(lines) + "\n")
    rc, err = check_set([path])
    assert rc == exits.BAD_INPUT and f"{path}:3: not a checkable value (nested deeper" in err


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(range(len(EVENTS))),
    st.sampled_from(["seq", "batch", "rid", "obj", "chunks", "vc", "start", "tokens", "zz"]),
    st.sampled_from(ODD_VALUES + [1 << 63, (1 << 63) - 1, {"r": [0, 1]}, 5, "x"]),
)
def test_the_checker_s_structs_hold_what_the_exact_path_reads(i, field, value):
    """The linear checker's structs: accepted only where the exact path accepts, every field the
    exact path reads, and None for an optional field that is absent."""
    tables = _role_tables("prefill", 4)
    e = dict(EVENTS[i]) | {field: value}
    raw = [json.dumps(e).encode() + b"\n"]
    fast = decode_chunk(tables[3], raw, structs=True)
    if fast is None:
        return
    (exact,) = [ev for _, ev in _chunk_slow("t", 2, raw, e["seq"] - 1, tables, HEADER)]
    (s,) = fast
    assert s.ev == exact["ev"] and set(exact) - {"ev"} <= set(s.__struct_fields__)
    assert all(getattr(s, f) == exact.get(f) for f in s.__struct_fields__)


def test_a_chunk_on_the_general_path_is_judged_as_the_typed_one(tmp_path):
    """An extra field sends its chunk to the general path (dicts, turned into structs there): the
    violations are the same, message for message."""
    events = canonical("ahead")
    events = [e for e in events if not (e["ev"] == "process_begin" and e.get("batch") == 1)]
    plain = write(tmp_path / "plain.jsonl", "ahead", events)
    extra = write(tmp_path / "extra.jsonl", "ahead", [dict(e, zz=1) for e in events])
    a, b = check_file(plain), check_file(extra)
    assert a.violations and [(v.rule.id, v.message, v.seqs) for v in a.violations] == [
        (v.rule.id, v.message, v.seqs) for v in b.violations
    ]


def test_thread_names_are_learnt_and_read_as_one_string_each():
    """The typed path reads `thread` against the names seen so far (one string per name); a name
    it has not seen decodes as any string would, and is learnt; a line that is not valid is still
    refused."""
    from msgspec import to_builtins

    from checker.typed_decode import make_kinds
    from spec import load_events

    kinds = make_kinds(load_events()["prefill"])
    events = [dict(e, thread="my:own") if i % 2 else e for i, e in enumerate(EVENTS)]
    raw = [json.dumps(e).encode() + b"\n" for e in events]
    assert "my:own" not in kinds.threads
    first = decode_chunk(kinds, raw, structs=True)
    assert "my:own" in kinds.threads and kinds.named is not None
    again = decode_chunk(kinds, raw, structs=True)
    plain = kinds.structs.decode_lines(b"".join(raw))
    assert to_builtins(first) == to_builtins(again) == to_builtins(plain)
    assert [e.thread for e in again] == [e["thread"] for e in events]
    assert again[1].thread is again[3].thread  # the learnt name's one string
    assert decode_chunk(kinds, raw[:3] + [raw[3].replace(b'"seq"', b'"zz"')]) is None
    many = [json.dumps(dict(EVENTS[0], thread=f"t{i}")).encode() + b"\n" for i in range(70)]
    assert [e.thread for e in decode_chunk(kinds, many, structs=True)] == [
        f"t{i}" for i in range(70)
    ]
    assert kinds.named is None and len(kinds.threads) > 64  # too many: read as any string
    assert [e.thread for e in decode_chunk(kinds, raw, structs=True)] == [
        e["thread"] for e in events
    ]
