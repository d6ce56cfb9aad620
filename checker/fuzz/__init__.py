"""Schedule fuzzing: run the engine one thread at a time, with a strategy choosing who goes next at
every schedule point, and check each run (trace rules, outputs against the reference, leaks).

A schedule is the list of thread names chosen at each step, so it replays exactly (same workload,
same choices → same trace, timestamps aside) and stays valid across Python versions.
Strategies: `random` (uniform random walk), `pct` (probabilistic concurrency testing: random thread
priorities with d-1 priority-change points), `dfs` (bounded exhaustive search over preemptions).

The modules: controller (the schedule-controlling thread scheduler), strategies (how schedules are
drawn), cases (prefill and PD cases, and their seeded draw), pressure (pools
drawn near the working set, the campaign's memory statistics), runs (running and judging one case),
search (campaigns and the bounded search), shrink, casefile (failing cases on disk), and cli
(`pdo fuzz`, not imported here).
"""

from __future__ import annotations

from ..parallel import WorkerPool
from .casefile import load_case, save_case
from .cases import Case, PDCase, draw_pd_case, pct_steps, pd_draws
from .controller import Controller, ManagedThread, StepLimit
from .pressure import CampaignStats, pressure_bounds, pressure_draws, with_pressure
from .runs import CLIENT_ABORT, Outcome, run_case, run_pd_case, run_prefill_case
from .search import campaign, dfs_schedules, find_bug, run_drawn
from .shrink import shrink
from .strategies import PCT, Default, Indices, RandomWalk, Replay, ScheduleDiverged, make_strategy

__all__ = [
    "CLIENT_ABORT",
    "CampaignStats",
    "PCT",
    "Case",
    "Controller",
    "Default",
    "Indices",
    "ManagedThread",
    "Outcome",
    "PDCase",
    "RandomWalk",
    "Replay",
    "ScheduleDiverged",
    "StepLimit",
    "WorkerPool",
    "campaign",
    "dfs_schedules",
    "draw_pd_case",
    "find_bug",
    "load_case",
    "make_strategy",
    "pct_steps",
    "pd_draws",
    "pressure_bounds",
    "pressure_draws",
    "run_case",
    "run_drawn",
    "run_pd_case",
    "run_prefill_case",
    "save_case",
    "shrink",
    "with_pressure",
]
