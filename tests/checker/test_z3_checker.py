"""`pdo check --engine z3` (checker/z3check.py), the independent second checker: it agrees with the
linear checker (verdict and violated rule ids) on schedules of the abstract model and on mutations of
them, its unsat cores are minimal conflicts, it handles long traces, and a budget it exhausts is
UNKNOWN, never PASS.

PDO_SLOW=1 raises the number of generated traces."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import random
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from checker import z3check
from checker.linear import check_file as linear_check
from checker.trace_io import TraceFormatError, iter_chunks
from engine.cli import main as pdo
from engine.runs.spec import RunSpec
from spec import abstract, load_rules
from spec.vocabulary import PREFILL_LOOPS

SLOW = os.environ.get("PDO_SLOW") == "1"
MODES = PREFILL_LOOPS
MUTATIONS = ("swap", "drop", "duplicate", "move", "thread", "obj", "digest")


def mutate(events: list[dict], kind: str, rnd: random.Random) -> list[dict]:
    """One edit of a trace; seq is renumbered so the file stays well-formed."""
    ev = copy.deepcopy(events)
    i = rnd.randrange(len(ev))
    if kind == "swap":
        j = rnd.randrange(len(ev))
        ev[i], ev[j] = ev[j], ev[i]
    elif kind == "drop":
        del ev[i]
    elif kind == "duplicate":
        ev.insert(rnd.randrange(len(ev) + 1), copy.deepcopy(ev[i]))
    elif kind == "move":
        e = ev.pop(i)
        ev.insert(rnd.randrange(len(ev) + 1), e)
    elif kind == "thread":
        ev[i]["thread"] = "forward" if ev[i]["thread"] == "scheduler" else "scheduler"
    elif kind in ("obj", "digest"):
        having = [e for e in ev if kind in e]
        if having:
            rnd.choice(having)[kind] = rnd.choice(
                ["o1", "o2", "o99"] if kind == "obj" else ["d0", "d1", "dX"]
            )
    for k, e in enumerate(ev, 1):
        e["seq"], e["t_ns"] = k, k * 1000
    return ev


def verdicts(path):
    lin = linear_check(path)
    z = z3check.check_file(path)
    return sorted({v.rule.id for v in lin.violations}), lin.ok, z


def malformed(path) -> bool:
    """An edit can leave a trace malformed (a dropped admit leaves a gap in the batch ids): then both
    checkers must refuse it, with the same error."""
    try:
        for _ in iter_chunks(path):
            pass
    except TraceFormatError as exc:
        for check in (linear_check, z3check.check_file):
            with pytest.raises(TraceFormatError) as got:
                check(path)
            assert str(got.value) == str(exc)
        return True
    return False


def assert_agree(path):
    if malformed(path):
        return None, None
    lin_ids, lin_ok, z = verdicts(path)
    assert z.status != "unknown", z.uncovered
    assert (lin_ok, lin_ids) == (z.ok, z.violated), f"linear {lin_ids}, z3 {z.violated}: {path}"
    return lin_ids, z


@settings(
    max_examples=300 if SLOW else 60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from((None,) + MUTATIONS),
)
def test_checkers_agree_on_generated_traces(mode, seed, kind, tmp_path_factory):
    rnd = random.Random(seed)
    header, events = abstract.run(mode, rnd, abstract.Config(requests=4))
    if kind:
        events = mutate(events, kind, rnd)
    path = abstract.write_trace(tmp_path_factory.mktemp("z") / "t.jsonl", header, events)
    ids, z = assert_agree(path)
    if z is None:  # the edit left it malformed: both refuse it alike
        assert kind is not None
        return
    if kind is None:
        assert z.ok
    for rid, core in z.cores.items():  # each core: the rule and a minimal conflicting set of events
        seqs = [e["seq"] for e in core.events]
        assert z3check.conflicts(path, rid, seqs)
        for s in seqs:
            assert not z3check.conflicts(path, rid, [x for x in seqs if x != s]), (rid, seqs, s)


def test_checkers_agree_on_the_hand_written_fixtures(tmp_path):
    """The canonical trace of each mode and the one-violation-per-rule traces of the rule tests."""
    from tests import trace_fixtures
    from tests.checker.test_rules_violations import VIOLATIONS as violations

    for mode in MODES:
        ids, _ = assert_agree(
            trace_fixtures.write(tmp_path / f"{mode}.jsonl", mode, trace_fixtures.canonical(mode))
        )
        assert ids == []
    for rid, (mode, edit) in sorted(violations.items()):
        events = trace_fixtures.canonical(mode)
        edit(events)
        ids, z = assert_agree(trace_fixtures.write(tmp_path / f"{rid}.jsonl", mode, events))
        assert rid in ids and rid in z.cores


def test_core_names_the_conflict(tmp_path):
    header, events = abstract.run("ahead", random.Random(3), abstract.Config(requests=3))
    i = next(k for k, e in enumerate(events) if e["ev"] == "fwd_end" and e["batch"] == 0)
    j = next(k for k, e in enumerate(events) if e["ev"] == "fwd_begin" and e["batch"] == 1)
    events.insert(j + 1, events.pop(i))  # fwd_end(0) now comes after fwd_begin(1): two forwards
    for k, e in enumerate(events, 1):
        e["seq"] = k
    path = abstract.write_trace(tmp_path / "t.jsonl", header, events)
    ids, z = assert_agree(path)
    core = {(e["ev"], e.get("batch")) for e in z.cores["P-one-forward"].events}
    assert core == {("fwd_begin", 0), ("fwd_begin", 1), ("fwd_end", 0)}
    text = z3check.text_report(z)
    assert "minimal conflict: rule P-one-forward + 3 event(s)" in text


def test_long_trace(tmp_path):
    """Over 10,000 events: windows keep it linear. One late violation is still found, with the linear
    checker's rule ids."""
    header, events = abstract.run(
        "ahead", random.Random(5), abstract.Config(requests=420, max_slots=8)
    )
    assert len(events) >= 10_000
    k = max(i for i, e in enumerate(events) if e["ev"] == "sample")
    i = next(i for i in range(k, 0, -1) if events[i]["ev"] == "collect")
    events[i], events[k] = events[k], events[i]  # the last sample before its collect
    for n, e in enumerate(events, 1):
        e["seq"] = n
    path = abstract.write_trace(tmp_path / "long.jsonl", header, events)
    t0 = time.perf_counter()
    ids, z = assert_agree(path)
    assert ids and z.windows > 5
    assert time.perf_counter() - t0 < 240


def test_unknown_is_never_a_pass(tmp_path, capsys):
    header, events = abstract.run("thread", random.Random(1), abstract.Config(requests=3))
    path = abstract.write_trace(tmp_path / "t.jsonl", header, events)
    small = z3check.check_file(path, max_obligations=10)
    assert small.status == "unknown" and not small.ok and "size budget" in small.uncovered[0]
    starved = z3check.check_file(path, rlimit=10)
    assert starved.status == "unknown" and not starved.ok
    assert "not covered (UNKNOWN, not a pass)" in z3check.text_report(starved)
    assert z3check.check_file(path).ok


def test_cli(tmp_path, capsys):
    header, events = abstract.run("overlap", random.Random(2), abstract.Config(requests=3))
    good = abstract.write_trace(tmp_path / "good.jsonl", header, events)
    bad_events = copy.deepcopy(events)
    next(e for e in bad_events if e["ev"] == "fwd_begin")["digest"] = "dX"  # not checked in overlap
    next(e for e in bad_events if e["ev"] == "war_barrier")["thread"] = "forward"
    bad = abstract.write_trace(tmp_path / "bad.jsonl", header, bad_events)
    assert pdo(["check", "--engine", "z3", good]) == 0
    assert "PASS" in capsys.readouterr().out
    assert pdo(["check", "--engine", "z3", "--json", good, bad]) == 1
    got = json.loads(capsys.readouterr().out)
    assert [r["ok"] for r in got] == [True, False]
    assert {v["rule"] for v in got[1]["violations"]} == {
        "P-run-on-scheduler",
        "P-war-after-forward",
    }
    assert all(v["seqs"] for v in got[1]["violations"])


def test_every_kind_is_encoded():
    """Prefill, decode and cross rules: `pdo check --engine z3` checks every rule."""
    from spec.z3model import ENCODERS

    kinds = {r.kind for r in load_rules()}
    assert kinds <= set(ENCODERS), kinds - set(ENCODERS)


# ---- decode traces: the rules whose kinds have an encoding -------------------------------------------


def assert_agree_encoded(path):
    if malformed(path):
        return None, None
    lin = linear_check(path)
    z = z3check.check_file(path)
    encoded = {r.id for r, _ in z.rules}
    assert z.status != "unknown", z.uncovered
    want = sorted({v.rule.id for v in lin.violations} & encoded)
    assert want == z.violated, f"linear {want}, z3 {z.violated}: {path}"
    return want, z


def _decode_fixtures():
    from tests.checker import test_decode_rules

    return test_decode_rules


def test_checkers_agree_on_the_decode_fixtures(tmp_path):
    d = _decode_fixtures()
    ids, z = assert_agree_encoded(d.write(tmp_path / "base.jsonl", d.base()))
    assert ids == [] and z.not_encoded == []  # every decode kind has an encoding
    for rid, edit in sorted(d.VIOLATIONS.items()):
        ids, z = assert_agree_encoded(d.write(tmp_path / f"{rid}.jsonl", edit(d.base())))
        assert rid in ids and rid in z.cores


@settings(
    max_examples=200 if SLOW else 40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(MUTATIONS + ("rooms", "rank", "addr", "qid", "source")),
)
# a room added again after its request was done: pending from its second add only (z3 once held
# every add of a room to the point's `pending`)
@example(seed=267498385, kind="duplicate")
def test_checkers_agree_on_mutated_decode_traces(seed, kind, tmp_path_factory):
    d = _decode_fixtures()
    rnd = random.Random(seed)
    base = tmp_path_factory.mktemp("d") / "base.jsonl"
    d.write(base, d.base())
    lines = open(base).read().splitlines()
    header, events = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
    for _ in range(1 + rnd.randrange(2)):
        if kind in ("rooms", "rank", "addr", "qid", "source"):
            having = [e for e in events if kind in e]
            e = rnd.choice(having)
            e[kind] = {
                "rooms": rnd.choice([[rnd.randrange(1, 4)], [2, 3], [1, 3]]),
                "rank": rnd.randrange(2),
                "addr": "127.0.0.1:1",
                "qid": rnd.randrange(3),
                "source": rnd.choice(["sync", "prefetched", "prefix", "prefetch", "x"]),
            }[kind]
        else:
            events = mutate(events, kind, rnd)
    assert_agree_encoded(abstract.write_trace(base.parent / "m.jsonl", header, events))


@pytest.mark.parametrize("mode", ["thread", "ahead"])
def test_engine_trace(mode, tmp_path):
    """A trace of the real engine (tiny model, CPU)."""
    from engine.runs import prefill_run as run
    from engine.runs.spec import WorkloadConfig
    from engine.runtime.config import EngineConfig

    path = str(tmp_path / "e.jsonl")
    run.run_prefill(
        RunSpec(
            EngineConfig(mode=mode, device="cpu"),
            WorkloadConfig(requests=6),
            trace_path=path,
            verify=False,
        )
    )
    ids, z = assert_agree(path)
    assert ids == [] and z.ok


# ---- PD runs: decode and cross rules on real traces ------------------------------------------------


def assert_agree_all(paths):
    """Every trace, and the cross check of the decode trace with its prefill ranks: same verdicts and
    rule ids from both checkers, every rule encoded."""
    from checker.linear import check_files

    lin = check_files(paths)
    z = [z3check.check_file(p) for p in paths] + z3check.check_cross(paths)
    assert [(r.path, r.header["role"]) for r in lin] == [(r.path, r.header["role"]) for r in z]
    out = {}
    for lin_result, r in zip(lin, z):
        assert r.status != "unknown" and r.not_encoded == [], (r.uncovered, r.not_encoded)
        ids = sorted({v.rule.id for v in lin_result.violations})
        assert (lin_result.ok, ids) == (r.ok, r.violated), (
            f"{r.header['role']} {r.path}: linear {ids}, z3 {r.violated}"
        )
        out.setdefault(r.header["role"], set()).update(ids)
    return out


def _read(path):
    lines = open(path).read().splitlines()
    return json.loads(lines[0]), [json.loads(x) for x in lines[1:]]


@pytest.fixture(scope="module")
def pd_traces(tmp_path_factory):
    from engine.decode.config import DecodeConfig
    from engine.runs.pd import run_pd
    from engine.runs.spec import WorkloadConfig
    from engine.runtime.config import EngineConfig

    d = tmp_path_factory.mktemp("pd")
    s = run_pd(
        RunSpec(
            EngineConfig(mode="ahead", device="cpu"),
            WorkloadConfig(
                requests=10,
                prompt_len=(20, 80),
                arrival="poisson",
                rate=300,
                max_new_tokens=3,
                seed=3,
            ),
            DecodeConfig(loop="overlap", prefetch=True),
            dp=2,
            bootstrap_latency_ms=5.0,
            trace_path=str(d / "t.jsonl"),
        )
    ).summary
    return s["traces"]


def test_pd_traces_pass_both_checkers(pd_traces, capsys):
    assert assert_agree_all(pd_traces) == {"decode": set(), "prefill": set(), "cross": set()}
    assert pdo(["check", "--engine", "z3", *pd_traces]) == 0
    out = capsys.readouterr().out
    assert "(cross, mode=" in out and "X-kv-pages" in out and "not checked" not in out


def _mutated(pd_traces, tmp_path, which, edit):
    paths = []
    for p in pd_traces:
        header, events = _read(p)
        if which(header):
            edit(events)
        paths.append(abstract.write_trace(tmp_path / pathlib.Path(p).name, header, events))
    return paths


def _is_decode(h):
    return h["role"] == "decode"


def _sync_as_prefetched(events):
    e = next(e for e in events if e["ev"] == "resolve" and e["source"] == "sync")
    e["source"] = "prefetched"  # a prefetched answer from a query never submitted


@pytest.mark.parametrize("rule_id", ["D-prefetch-match", "X-rank-served", "X-kv-pages"])
def test_pd_mutant_fails_on_both_checkers(pd_traces, tmp_path, rule_id):
    if rule_id == "D-prefetch-match":
        paths = _mutated(pd_traces, tmp_path, _is_decode, _sync_as_prefetched)
        role = "decode"
    else:
        _, dec = _read(next(p for p in pd_traces if _read(p)[0]["role"] == "decode"))
        init = next(e for e in dec if e["ev"] == "receiver_init")
        other = lambda h: h["role"] == "prefill" and h.get("dp_rank") == 1 - init["rank"]  # noqa: E731
        mine = lambda h: h["role"] == "prefill" and h.get("dp_rank") == init["rank"]  # noqa: E731

        def admit_too(events):
            next(e for e in events if e["ev"] == "admit")["rids"].append(init["rid"])

        def send_more(events):
            e = next(e for e in events if e["ev"] == "kv_send" and e["rid"] == init["rid"])
            e["tokens"], e["pages"] = e["tokens"] + 16, e["pages"] + 1

        paths = _mutated(
            pd_traces,
            tmp_path,
            other if rule_id == "X-rank-served" else mine,
            admit_too if rule_id == "X-rank-served" else send_more,
        )
        role = "cross"
    got = assert_agree_all(paths)
    assert got[role] == {rule_id}, got


@pytest.fixture(scope="module")
def loop_witnesses():
    """Schedules of the decode loop model (spec/z3model/), one per way a prefetched query ends: used
    as is, as a prefix with a sync tail, cancelled as stale, at release, with nothing pending, on a
    mismatch."""
    from spec import z3model as zm

    M = zm.Model("overlap", 4, role="decode")
    out = []
    for c in M.universe.ends.values():
        a = M.check(M.engine_ids, zm.disj(*c))
        assert a.status == "sat"
        out.append(M.to_trace(a.model))
    return out


@settings(
    max_examples=120 if SLOW else 30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(MUTATIONS + ("rooms", "source", "qid", None)),
)
def test_checkers_agree_on_mutated_loop_model_traces(loop_witnesses, seed, kind, tmp_path_factory):
    """The prefetch_match encoding (and the other decode kinds) against the linear checker on traces with
    prefixed, cancelled and reused queries, and on mutations of them."""
    rnd = random.Random(seed)
    header, events = copy.deepcopy(rnd.choice(loop_witnesses))
    if kind in ("rooms", "source", "qid"):
        having = [e for e in events if kind in e]
        e = rnd.choice(having)
        e[kind] = {
            "rooms": rnd.choice([[2], [3], [2, 3], [1, 2, 3]]),
            "qid": rnd.randrange(6),
            "source": rnd.choice(["sync", "prefetched", "prefix"]),
        }[kind]
    elif kind:
        events = mutate(events, kind, rnd)
    ids, _ = assert_agree_encoded(
        abstract.write_trace(tmp_path_factory.mktemp("w") / "w.jsonl", header, events)
    )
    if kind is None:
        assert ids == []
