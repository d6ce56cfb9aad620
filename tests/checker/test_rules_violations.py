"""Every rule of spec/rules.toml: the canonical trace of each mode passes, and one hand-made violation
per rule fails with that rule's id."""

import copy

import pytest

from checker import linear
from checker.linear import check_file
from spec import load_rules
from tests.trace_fixtures import canonical, find, move, move_before, write

MODES = ("normal", "overlap", "thread", "ahead")


@pytest.mark.parametrize("mode", MODES)
def test_canonical_trace_passes(mode, tmp_path):
    r = check_file(write(tmp_path / "t.jsonl", mode, canonical(mode)))
    assert r.ok, [(v.rule.id, v.message) for v in r.violations]
    assert all(checks > 0 for rule, checks in r.rules if rule.kind not in ("page_count",)), [
        (rule.id, c) for rule, c in r.rules if c == 0
    ]


def _set(ev, batch=None, rid=None, **fields):
    def edit(events):
        events[find(events, ev, batch, rid)].update(fields)

    return edit


def _delete(ev, batch=None, rid=None, nth=0):
    def edit(events):
        del events[find(events, ev, batch, rid, nth)]

    return edit


def _unsent_chunk(batch):
    """Batch `batch`'s admit records a chunk range for its first request that no send covers (the
    reference engine's sends carry no `start`, so none is counted as covering it)."""

    def edit(events):
        e = events[find(events, "admit", batch)]
        e["chunks"] = {e["rids"][0]: [0, 10**6]}

    return edit


def _after(ev, batch, target, tbatch, rid=None, trid=None):
    def edit(events):
        move(events, find(events, ev, batch, rid), find(events, target, tbatch, trid))

    return edit


def _before(ev, batch, target, tbatch, rid=None, trid=None):
    def edit(events):
        move_before(events, find(events, ev, batch, rid), find(events, target, tbatch, trid))

    return edit


def _admit_early(batch, before, bbatch):
    """Move admit(batch), with the allocs right before it, to just before `before`(bbatch)."""

    def edit(events):
        i = find(events, "admit", batch)
        j = i
        while events[j - 1]["ev"] == "alloc":
            j -= 1
        block = events[j : i + 1]
        del events[j : i + 1]
        k = find(events, before, bbatch)
        events[k:k] = block

    return edit


def _dup(ev, batch):
    def edit(events):
        i = find(events, ev, batch)
        events.insert(i + 1, copy.deepcopy(events[i]))

    return edit


VIOLATIONS = {
    "P-fifo": ("normal", _dup("process_begin", 0)),
    "P-complete": ("normal", _delete("stage", 1)),
    "P-complete-barrier": ("overlap", _delete("war_barrier", 1)),
    "P-chunk-sent": ("normal", _unsent_chunk(1)),
    "P-complete-thread": ("thread", _delete("batch_copy", 1)),
    "P-complete-sample": ("overlap", _delete("sample", 2)),
    "P-one-forward": ("overlap", _after("fwd_end", 0, "fwd_begin", 1)),
    "P-queue-capacity": ("ahead", _before("submit", 1, "collect", 0)),
    "P-stage-before-forward": ("normal", _after("stage", 1, "fwd_end", 1)),
    "P-war-after-forward": ("thread", _before("war_barrier", 1, "fwd_end", 1)),
    "P-war-before-next-stage": ("overlap", _after("war_barrier", 0, "stage", 1)),
    "P-war-device": ("thread", _after("fwd_done", 0, "staged", 1)),
    "P-process-after-forward": ("normal", _after("war_barrier", 0, "process_begin", 0)),
    "P-sample-idle": ("ahead", _after("sample", 0, "fwd_begin", 1)),
    "P-sample-before-process": ("overlap", _after("sample", 1, "process_begin", 1)),
    "P-collect-before-sample": ("thread", _before("sample", 0, "collect", 0)),
    "P-run-on-scheduler": ("normal", _set("fwd_begin", 1, thread="forward")),
    "P-run-on-worker": ("ahead", _set("fwd_end", 1, thread="scheduler")),
    "P-scheduler-thread": ("thread", _set("collect", 1, thread="forward")),
    "P-normal-order": ("normal", _after("admit", 1, "fwd_end", 0)),
    "P-overlap-order": ("overlap", _after("sample", 0, "admit", 1)),
    "P-overlap-process-prev": ("overlap", _before("sample", 1, "process_begin", 0)),
    "P-overlap-forward-before-prev": ("overlap", _after("fwd_end", 1, "process_begin", 0)),
    "P-thread-collect-immediately": ("thread", _after("sample", 0, "submit", 1)),
    "P-thread-order": ("thread", _after("snapshot", 1, "submit", 1)),
    "P-thread-collect-before-prev": ("thread", _after("collect", 1, "process_end", 0)),
    "P-ahead-build-first": ("ahead", _after("admit", 2, "collect", 1)),
    "P-ahead-submit-before-process": ("ahead", _after("submit", 1, "process_begin", 0)),
    "P-ahead-order": ("ahead", _after("snapshot", 1, "submit", 1)),
    "P-worker-runs-submitted": ("thread", _before("fwd_begin", 1, "submit", 1)),
    "P-ahead-stage-on-scheduler": ("ahead", _set("stage", 1, thread="forward")),
    "P-ahead-one-batch-ahead": ("ahead", _admit_early(2, "submit", 1)),
    "P-ahead-process-before-next-round": ("ahead", _after("process_end", 0, "admit", 2)),
    "P-worker-copy": ("thread", _before("batch_copy", 1, "war_barrier", 1)),
    "P-snapshot-isolation": ("ahead", _set("fwd_begin", 1, digest="changed")),
    "P-prefix-send-ahead": ("ahead", _after("prefix_send", 1, "fwd_begin", 1)),
    "P-prefix-send-in-run-batch": ("overlap", _before("prefix_send", 1, "fwd_begin", 1)),
    "P-chunk-counter": ("thread", _set("chunk_dec", rid="a", obj="a-copy")),
    "P-chunk-dec-in-processing": ("ahead", _after("chunk_dec", None, "process_end", 0, rid="a")),
    "P-release-once": ("normal", _delete("release", rid="c")),
    "P-release-after-done": ("ahead", _before("release", None, "process_begin", 1, rid="a")),
    "P-page-count": ("normal", _set("kv_send", rid="a", pages=0)),
    "P-page-aligned": ("normal", _set("kv_send", rid="a", start=1)),
    "P-send-after-forward": ("overlap", _before("kv_send", None, "process_begin", 2, rid="c")),
    "P-send-each-chunk": ("ahead", _delete("kv_send", rid="a", nth=1)),
    "P-release-after-delivery": (
        "thread",
        _before("release", None, "kv_delivered", None, rid="c", trid="c"),
    ),
    "P-store-after-copy": (
        "overlap",
        _before("store_entry", None, "store_copied", None, rid="b", trid="b"),
    ),
}


def test_only_a_requests_last_send_may_end_in_a_partial_page(tmp_path):
    """P-page-aligned's second half: a's first chunk (32 tokens) sent as 30 breaks it, naming that
    send; a's last send (8 tokens, a partial page) does not."""
    events = canonical("normal")
    first = find(events, "kv_send", None, "a")
    events[first].update(tokens=30)
    r = check_file(write(tmp_path / "v.jsonl", "normal", events))
    hits = [v for v in r.violations if v.rule.id == "P-page-aligned"]
    assert len(hits) == 1 and hits[0].seqs[0] == first + 1, hits  # write() numbers seq from 1
    assert "not the request's last send" in hits[0].message


def test_every_rule_has_a_violation_case():
    prefill = {r.id for r in load_rules() if r.role == "prefill"}
    assert prefill == set(VIOLATIONS), prefill ^ set(VIOLATIONS)


@pytest.mark.parametrize("rule_id", sorted(VIOLATIONS))
def test_violation_is_reported_with_rule_id(rule_id, tmp_path):
    mode, edit = VIOLATIONS[rule_id]
    events = canonical(mode)
    edit(events)
    r = check_file(write(tmp_path / "v.jsonl", mode, events))
    ids = {v.rule.id for v in r.violations}
    assert rule_id in ids, (rule_id, sorted(ids))


def _verdict(path):
    r = check_file(path)
    return (
        [(rule.id, c) for rule, c in r.rules],
        [(v.rule.id, v.message, v.seqs) for v in r.violations],
    )


@pytest.mark.parametrize("rule_id", sorted(VIOLATIONS))
def test_array_and_loop_evaluation_agree(rule_id, tmp_path, monkeypatch):
    """The finish-time templates run on arrays (checker.linear.Dense) unless batch ids are too sparse;
    both paths must give the same checks, violations, messages and seqs on every violation fixture,
    and batch ids far from 0 change nothing but the numbers."""
    mode, edit = VIOLATIONS[rule_id]
    events = canonical(mode)
    edit(events)
    path = write(tmp_path / "v.jsonl", mode, events)
    fast = _verdict(path)
    with monkeypatch.context() as m:
        m.setattr(linear.Dense, "build", classmethod(lambda cls, ctx: None))
        assert _verdict(path) == fast
    shifted = copy.deepcopy(events)
    for e in shifted:
        if "batch" in e:
            e["batch"] += 10**9
    checks, violations = _verdict(write(tmp_path / "shifted.jsonl", mode, shifted))
    assert checks == fast[0] and [v[0] for v in violations] == [v[0] for v in fast[1]]
