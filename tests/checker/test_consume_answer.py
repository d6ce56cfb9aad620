"""D-consume-answer (PR #35071 at each consumption point: the rooms pending, the query the prefetch
left for them, the answer used), on edits of the canonical decode trace of test_decode_rules: each
edit is reported by the linear checker and by the z3 checker alike."""

from __future__ import annotations

import pytest

from checker import z3check
from checker.linear import check_file

from .test_decode_rules import S, base, edit, find, insert_after, write

A = "127.0.0.1:8998"


def _sync_although_covered(e):
    """The consumption point cancels the query that covers its rooms exactly and asks them again
    synchronously: the prefetch is wasted (D-prefetch-match sees a cancelled query and a sync
    resolve, which it allows)."""
    i = find(e, "resolve", qid=2)
    t, ev, f = e[i]
    e[i] = (t, ev, {**f, "source": "sync", "qid": None})
    insert_after(
        e,
        ("query_end", dict(qid=2)),
        (S, "prefetch_cancel", dict(addr=A, rooms=[2], qid=2, reason="mismatch")),
        (S, "query_begin", dict(addr=A, rooms=[2], qid=8, source="sync")),
        (S, "query_end", dict(addr=A, rooms=[2], qid=8, result={"2": 1}, error=None)),
    )
    return e


EDITS = {
    "pending-lost": lambda e: edit(e, "resolve", dict(qid=2), pending=[]),
    "pending-extra": lambda e: edit(e, "resolve", dict(qid=2), pending=[2, 3]),
    "known-room-resolved": lambda e: edit(e, "resolve", dict(qid=None, rooms=[2]), rooms=[1, 2]),
    "covered-wrong": lambda e: edit(e, "resolve", dict(qid=2), covered=[]),
    "sync-although-covered": _sync_although_covered,
}


def _verdicts(path):
    lin = sorted({v.rule.id for v in check_file(path).violations})
    z = z3check.check_file(path)
    assert z.status != "unknown", z.uncovered
    return lin, z.violated


def test_canonical_trace_is_judged_and_passes(tmp_path):
    path = write(tmp_path / "d.jsonl", base())
    checks = dict((r.id, n) for r, n in check_file(path).rules)
    assert checks["D-consume-answer"] == 3  # its three resolves
    assert _verdicts(path) == ([], [])


@pytest.mark.parametrize("name", sorted(EDITS))
def test_edit_is_reported_by_both_checkers(tmp_path, name):
    lin, z = _verdicts(write(tmp_path / "d.jsonl", EDITS[name](base())))
    assert "D-consume-answer" in lin, lin
    assert lin == z, (lin, z)
