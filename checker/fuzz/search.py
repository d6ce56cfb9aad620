"""Searching for a failing schedule: a campaign of drawn schedules (`find_bug`) and the bounded
exhaustive search over preemptions (`dfs_schedules`)."""

from __future__ import annotations

from .cases import Case, pct_steps
from .runs import run_case
from .strategies import Replay, make_strategy


class _Recording(Replay):
    """Replays a prefix (then the default), recording every step's (enabled, running, chosen)."""

    def __init__(self, prefix):
        super().__init__(prefix, strict=False)
        self.steps = []

    def choose(self, enabled, running, step):
        pick = super().choose(enabled, running, step)
        self.steps.append((list(enabled), running, pick))
        return pick


def _preemptions(steps, alt, running) -> int:
    n = sum(1 for enabled, run, pick in steps if run in enabled and pick != run)
    return n + (1 if running is not None and alt != running else 0)


def dfs_schedules(case: Case, *, preemption_bound: int = 2, limit: int = 100):
    """Bounded exhaustive search: yields (schedule prefix, outcome) depth-first, each schedule
    differing from an earlier one by one more preemption, at most `preemption_bound` in all."""
    stack = [[]]
    seen = 0
    while stack and seen < limit:
        prefix = stack.pop()
        rec = _Recording(prefix)
        out = run_case(case, rec)
        seen += 1
        yield prefix, out
        # Branch at every step past the prefix where another thread was enabled.
        for i in range(len(rec.steps) - 1, len(prefix) - 1, -1):
            enabled, running, chosen = rec.steps[i]
            for alt in enabled:
                if alt == chosen:
                    continue
                branch = [s[2] for s in rec.steps[:i]] + [alt]
                if _preemptions(rec.steps[:i], alt, running) <= preemption_bound:
                    stack.append(branch)


def _drawn_runs(case, strategy: str, *, schedules: int, seed: int, draw):
    """The outcomes of `schedules` schedules drawn by `strategy`, seeded per schedule."""
    for i in range(schedules):
        c = draw(i) if draw is not None else case
        yield run_case(c, make_strategy(strategy, seed * 100_003 + i, steps=pct_steps(c)))


def find_bug(
    case, strategy: str, *, schedules: int, seed: int, on_progress=None, draw=None, stats=None
):
    """Run up to `schedules` schedules; return (index, outcome) of the first failing one, or
    (None, events checked). `draw(i)`, if given, makes a fresh case for schedule i (the outcome
    carries it as `.case`); `stats` (a CampaignStats), if given, sums every run's memory
    counters."""
    if strategy == "dfs":
        runs = (out for _, out in dfs_schedules(case, limit=schedules))
    else:
        runs = _drawn_runs(case, strategy, schedules=schedules, seed=seed, draw=draw)
    events = 0
    for i, out in enumerate(runs):
        events += out.events
        if stats is not None:
            stats.add(out)
        if on_progress:
            on_progress(i + 1, events, out.failed)
        if out.failed:
            return i, out
    return None, events
