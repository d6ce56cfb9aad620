"""scripts/rule_times.py: one check timed by part, every active rule among the parts, and the
checker left as it was."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import rule_times  # noqa: E402 - the script, from its folder

from checker import linear  # noqa: E402
from tests.trace_fixtures import canonical, write  # noqa: E402


def test_every_rule_of_the_trace_is_timed_and_the_parts_fit_in_the_whole(tmp_path):
    path = write(str(tmp_path / "t.jsonl"), "ahead", canonical("ahead"))
    split = linear._split
    whole, parts = rule_times.rule_times(path)
    assert linear._split is split  # the timers are gone
    result = linear.check_file(path)
    assert result.ok
    timed = {name.rsplit(".", 1)[0] for name in parts}
    applied = {rule.id for rule, _ in result.rules}
    assert applied <= timed and len(applied) > 20
    assert parts["reading (decode, validate)"] > 0 and parts["split by kind"] > 0
    assert sum(parts.values()) <= whole
