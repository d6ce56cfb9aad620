"""P-release-after-delivery with a transfer that fails (`kv_failed`): a release after the failure is
the release SGLang makes when a sender's poll answers Failed; a release before it, or a send after it
that is never delivered, still breaks the rule. Both checkers judge it alike."""

from __future__ import annotations

import pytest

from checker import z3check
from checker.linear import check_file
from tests.trace_fixtures import REQS, E, canonical, find, write

RULE = "P-release-after-delivery"


def _failed_instead_of_delivered(rid: str, where: str):
    """c's deliveries replaced by one kv_failed, placed `where`: after its last send ("sent") or
    after its release ("released")."""
    events = [e for e in canonical("thread") if not (e["ev"] == "kv_delivered" and e["rid"] == rid)]
    anchor = "release" if where == "released" else "kv_send"
    last = max(i for i, e in enumerate(events) if e["ev"] == anchor and e.get("rid") == rid)
    events.insert(last + 1, E("transfer", "kv_failed", rid=rid, obj=REQS[rid][0]))
    return events


def _verdicts(tmp_path, name, events):
    path = write(tmp_path / f"{name}.jsonl", "thread", events)
    linear = {v.rule.id for v in check_file(path).violations}
    z = z3check.check_file(path)
    return linear, set(z.cores)


def test_a_release_after_the_failure_holds(tmp_path):
    linear, z = _verdicts(tmp_path, "ok", _failed_instead_of_delivered("c", "sent"))
    assert RULE not in linear and RULE not in z


def test_a_release_before_the_failure_breaks_the_rule(tmp_path):
    linear, z = _verdicts(tmp_path, "early", _failed_instead_of_delivered("c", "released"))
    assert RULE in linear and RULE in z


def test_a_send_after_the_failure_still_needs_its_delivery(tmp_path):
    events = _failed_instead_of_delivered("c", "sent")
    failed = find(events, "kv_failed", None, "c")
    send = {**events[find(events, "kv_send", None, "c")], "start": 16, "tokens": 4, "pages": 1}
    events.insert(failed + 1, send)  # a send after the transfer failed, never delivered
    linear, z = _verdicts(tmp_path, "late", events)
    assert RULE in linear and RULE in z


@pytest.mark.parametrize("rid", ["a", "b"])
def test_a_failure_of_another_request_excuses_nothing(rid, tmp_path):
    events = [e for e in canonical("thread") if not (e["ev"] == "kv_delivered" and e["rid"] == "c")]
    last = max(i for i, e in enumerate(events) if e["ev"] == "kv_send" and e.get("rid") == "c")
    events.insert(last + 1, E("transfer", "kv_failed", rid=rid, obj=REQS[rid][0]))
    linear, z = _verdicts(tmp_path, "other", events)
    assert RULE in linear and RULE in z
