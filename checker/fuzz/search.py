"""Searching for a failing schedule: a campaign of drawn schedules (`find_bug`) and the bounded
exhaustive search over preemptions (`dfs_schedules`)."""

from __future__ import annotations

from ..parallel import in_order
from .cases import Case, pct_steps
from .runs import MODEL_EVERY, MODEL_TIMEOUT_MS, run_case
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


def run_drawn(
    case,
    strategy: str,
    seed: int,
    i: int,
    draw=None,
    model_every: int = MODEL_EVERY,
    model_timeout_ms: int = MODEL_TIMEOUT_MS,
):
    """Schedule i of a campaign: its case (`draw(i)`, or `case`) under `strategy` seeded from
    (campaign seed, i) alone, so that it is the same run in any process, in any order. Refinement
    is judged on every `model_every`-th schedule by index (1: every one, 0: none)."""
    c = draw(i) if draw is not None else case
    strategy = make_strategy(strategy, seed * 100_003 + i, steps=pct_steps(c))
    model = model_every > 0 and i % model_every == 0
    return run_case(c, strategy, model=model, model_timeout_ms=model_timeout_ms)


def _run_drawn_slim(case, strategy: str, seed: int, i: int, draw, judges: tuple):
    """run_drawn in a worker process: the outcome without its trace (pickled back)."""
    return run_drawn(case, strategy, seed, i, draw, *judges).slim()


def campaign(
    case,
    strategy: str,
    *,
    schedules: int,
    seed: int,
    draw=None,
    pool=None,
    model_every: int = MODEL_EVERY,
    model_timeout_ms: int = MODEL_TIMEOUT_MS,
):
    """The outcomes of `schedules` drawn schedules, yielded in schedule-index order. With `pool`
    (an executor of checker.parallel: WorkerPool, RayPool) the schedules run there, a window of
    them ahead of the one yielded; the outcomes are those of one process (each schedule depends on
    (seed, index) only), without their traces. Closing the generator early cancels what has not
    run."""
    judges = (model_every, model_timeout_ms)
    if pool is None:
        for i in range(schedules):
            yield run_drawn(case, strategy, seed, i, draw, *judges)
        return
    tasks = ((case, strategy, seed, i, draw, judges) for i in range(schedules))
    yield from in_order(pool, _run_drawn_slim, tasks)


def find_bug(
    case,
    strategy: str,
    *,
    schedules: int,
    seed: int,
    on_progress=None,
    draw=None,
    pool=None,
    stats=None,
    model_every: int = MODEL_EVERY,
    model_timeout_ms: int = MODEL_TIMEOUT_MS,
):
    """Run up to `schedules` schedules; return (index, outcome) of the first failing one, or
    (None, events checked). `draw(i)`, if given, makes a fresh case for schedule i (the outcome
    carries it as `.case`). `pool`: run them on that executor (campaign); the answer is the
    same. `stats` (a CampaignStats), if given, sums every run's memory counters and what each
    judge judged. `model_every`: refinement on every that many schedules (1: all, 0: none), z3
    given `model_timeout_ms` per trace."""
    if strategy == "dfs":
        runs = (out for _, out in dfs_schedules(case, limit=schedules))
    else:
        runs = campaign(
            case,
            strategy,
            schedules=schedules,
            seed=seed,
            draw=draw,
            pool=pool,
            model_every=model_every,
            model_timeout_ms=model_timeout_ms,
        )
    events = 0
    for i, out in enumerate(runs):
        events += out.events
        if stats is not None:
            stats.add(out)
        if on_progress:
            on_progress(i + 1, events, out.failed)
        if out.failed:
            runs.close()
            return i, out
    return None, events
