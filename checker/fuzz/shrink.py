"""Shrinking a failing case: fewer requests, fewer complications (PD cases), a shorter schedule,
as long as it still fails the same way."""

from __future__ import annotations

import dataclasses

from .cases import PDCase
from .runs import run_case
from .strategies import Replay

# The PD knobs shrinking tries to turn off, in this order, each with its simplest value.
_PD_SIMPLER = (
    ("unserved", 0),
    ("aborts", ()),
    ("release", ()),
    ("failure_rate", 0.0),
    ("latency_ms", 0.0),
    ("prefill_delay_ms", 0.0),
    ("decode_slots", 64),
    ("polling_interval", 1),
    ("dp", 1),
    ("max_new_tokens", 1),
    ("arrival", "burst"),
)


def judge_of(failure: str) -> str:
    """The judge (kind) a failure comes from: rule, output, model, leak, engine, schedule."""
    return failure.split(":")[0].split(" ")[0]


def _same_failure(a: str, b: str) -> bool:
    """A rule violation must stay the same rule; other failures the same kind (output, leak,
    ...)."""
    if a.startswith("rule ") or b.startswith("rule "):
        return a == b
    return judge_of(a) == judge_of(b)


def fails_alike(out, failures: list[str]) -> bool:
    """`out` fails as `failures` did: the same first failure (the same rule for a violation), and
    every judge that flagged `failures` flags it too."""
    if not out.failed or not _same_failure(out.failures[0], failures[0]):
        return False
    return {judge_of(f) for f in failures} <= {judge_of(f) for f in out.failures}


class _Shrinker:
    """One shrink: the smallest case and outcome so far, and the runs left of the budget. Every run
    is judged by the judges of the run that failed (refinement too when it was on), so a failure
    only refinement saw can be kept."""

    def __init__(self, case, schedule: list[str], failures: list[str], budget: int, model: bool):
        self.case, self.schedule, self.failures, self.budget = case, schedule, failures, budget
        self.model = model
        self.best_out = None
        self.tries = 0

    def run(self, case, schedule):
        return run_case(case, Replay(schedule, strict=False), model=self.model)

    def fails(self, case, schedule):
        """The outcome of `case` under `schedule` if it fails the same way, else None."""
        out = self.run(case, schedule)
        return out if fails_alike(out, self.failures) else None

    def fewer_requests(self) -> None:
        while self.case.requests > 1 and self.tries < self.budget:
            self.tries += 1
            smaller = dataclasses.replace(self.case, requests=self.case.requests - 1)
            out = self.fails(smaller, self.schedule)
            if out is None:
                break
            self.case, self.best_out = smaller, out

    def simpler_pd(self) -> None:
        for name, simple in _PD_SIMPLER:
            if self.tries >= self.budget or getattr(self.case, name) == simple:
                continue
            self.tries += 1
            simpler = dataclasses.replace(self.case, **{name: simple})
            out = self.fails(simpler, self.schedule)
            if out is not None:
                self.case, self.best_out = simpler, out

    def shorter_schedule(self) -> None:
        """A binary search on the prefix length (the rest of the run non-preemptive)."""
        lo, hi = 0, len(self.schedule)
        while lo < hi and self.tries < self.budget:
            self.tries += 1
            mid = (lo + hi) // 2
            out = self.fails(self.case, self.schedule[:mid])
            if out is not None:
                hi, self.best_out = mid, out
            else:
                lo = mid + 1
        self.schedule = self.schedule[:hi]


def shrink(
    case, schedule: list[str], failures: list[str], *, budget: int = 40, model: bool = False
):
    """Make a failing case smaller: fewer requests, then (PD) no faults, aborts or other
    complications it does not need, then the shortest schedule prefix (the rest non-preemptive) that
    still fails the same way (`fails_alike`: the same first failure, every judge that failed still
    failing). `model`: judge refinement as the failing run did. Returns (case, schedule, outcome);
    when no smaller case fails alike, the case itself rerun, whose outcome may not fail alike
    either (a failure that does not replay): the caller checks `fails_alike`."""
    shrinker = _Shrinker(case, schedule, failures, budget, model)
    shrinker.fewer_requests()
    if isinstance(shrinker.case, PDCase):
        shrinker.simpler_pd()
    shrinker.shorter_schedule()
    best_out = shrinker.best_out
    if best_out is None:
        best_out = shrinker.run(shrinker.case, shrinker.schedule)
    return shrinker.case, best_out.schedule, best_out
