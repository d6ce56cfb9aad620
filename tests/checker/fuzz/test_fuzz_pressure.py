"""Memory pressure in fuzz cases: pools drawn near the working set make eviction, failed
allocations and postponed chunks common, the clean engine still passes every rule and oracle under
them, a campaign reports how often each happened, and one that never exercised them says so."""

import json

import pytest

from checker.fuzz import CampaignStats, Case, find_bug, pd_draws, pressure_draws, with_pressure
from checker.fuzz.pressure import page_needs, pressure_bounds
from engine.cli import main
from engine.runtime.memory import PrefixCache

MODES = ("normal", "overlap", "thread", "ahead")
CASE = Case(mode="ahead", requests=6, hit=0.8)


def _campaign(case, schedules, seed=3, draw=True):
    stats = CampaignStats(pd=case is None)
    if case is None:
        draw_fn = pd_draws(seed)
    else:
        draw_fn = pressure_draws(case, seed) if draw else None
    idx, out = find_bug(case, "pct", schedules=schedules, seed=seed, draw=draw_fn, stats=stats)
    return idx, out, stats


def test_pools_are_drawn_between_one_request_and_the_working_set():
    import random

    largest, working_set, _ = page_needs(CASE)
    lo, hi = pressure_bounds(CASE)
    assert lo == largest + 1 and hi >= lo and working_set >= largest
    drawn = [with_pressure(CASE, random.Random(i)) for i in range(50)]
    assert all(lo <= c.num_pages <= hi for c in drawn)
    assert all(1 <= c.max_slots <= CASE.requests + 1 for c in drawn)
    assert len({c.num_pages for c in drawn}) > 1


@pytest.mark.parametrize("mode", MODES)
def test_pressured_campaign_evicts_fails_allocations_and_still_passes(mode):
    """Under pressure the clean engine keeps every rule, the first-token/KV oracle and the leak
    check (find_bug returns no failure, and no stuck run), while the counters show the pressure."""
    idx, out, stats = _campaign(Case(mode=mode, requests=6, hit=0.8), schedules=6)
    assert idx is None, (out.failures, out.case)
    assert stats.schedules == 6
    assert stats.totals["evicted_pages"] > 0, stats.line()
    assert stats.totals["failed_allocs"] > 0, stats.line()
    assert stats.cases["failed_allocs"] >= 3, stats.line()


def test_the_old_default_pool_exercises_nothing_and_says_so():
    idx, _, stats = _campaign(CASE, schedules=3, draw=False)
    assert idx is None
    assert stats.not_exercised() == [
        "evicted pages",
        "failed allocations",
        "postponed chunks",
        "postponed requests",
    ]
    assert "not exercised: evicted pages, failed allocations" in stats.line()


def test_pd_campaign_reports_both_sides():
    idx, out, stats = _campaign(None, schedules=6, seed=1)
    assert idx is None, (out.failures, out.case)
    d = stats.as_dict()
    assert d["schedules"] == 6 and "decode_memory_waits" in d
    assert d["failed_allocs"] > 0 and d["decode_memory_waits"] > 0, stats.line()


def test_pdo_fuzz_prints_the_statistics_line_and_json(capsys):
    assert main(["fuzz", "--mode", "ahead", "--schedules", "4", "--seed", "2"]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if "memory:" in ln)
    assert "4 schedules" in line and "evicted pages" in line and "failed allocations" in line
    assert "failed allocations 0 " not in line
    rc = main(["fuzz", "--mode", "ahead", "--schedules", "4", "--seed", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["violation"] is False
    mem = report["memory"]
    assert mem["schedules"] == 4 and mem["failed_allocs"] > 0
    assert "failed allocations" not in mem["not_exercised"]


def test_pdo_fuzz_with_huge_pools_says_not_exercised(capsys):
    argv = ["fuzz", "--mode", "ahead", "--schedules", "2", "--num-pages", "4096", "--slots", "16"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "not exercised: evicted pages, failed allocations, postponed chunks" in text
    assert main([*argv, "--json"]) == 0
    assert "evicted pages" in json.loads(capsys.readouterr().out)["memory"]["not_exercised"]


def test_a_mutant_is_still_killed_under_pressure():
    idx, out, _ = _campaign(Case(mode="ahead", inject=("no-war-barrier",), requests=6, hit=0.8), 50)
    assert idx is not None, "no-war-barrier survived pressured cases"


def _evict_locked(self, n_pages):
    """A bug to catch: eviction that ignores the locks, freeing pages a request still reads."""
    freed = 0
    for key, node in list(self.nodes.items()):
        if freed >= n_pages:
            break
        if node.children == 0:
            del self.nodes[key]
            if node.parent is not None:
                node.parent.children -= 1
            self.pool.free([node.page])
            freed += 1
    return freed


def test_an_eviction_bug_is_found_only_under_pressure(monkeypatch):
    monkeypatch.setattr(PrefixCache, "evict", _evict_locked)
    idx, _, _ = _campaign(CASE, schedules=6, draw=False)
    assert idx is None  # the old default pool never evicts: the bug hides
    idx, out, _ = _campaign(CASE, schedules=20)
    assert idx is not None, "a lock-ignoring eviction survived pressured cases"
    assert any(f.startswith(("output", "leak", "engine")) for f in out.failures), out.failures


@pytest.mark.parametrize(
    "argv,what",
    [
        (["--num-pages", "3"], "the largest request needs"),
        (["--num-pages", "1"], "argument --num-pages: expected an integer in [2, 65536]"),
        (["--pd", "--slots", "0"], "argument --slots: expected an integer in [1, 1024]"),
    ],
)
def test_pdo_fuzz_refuses_pools_that_can_never_finish(capsys, argv, what):
    assert main(["fuzz", "--schedules", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert what in err and len(err.splitlines()) == 1
