"""Memory pressure in fuzz cases: pools drawn near the working set of the case's workload, so that
prefix-cache eviction, failed allocations and postponed chunks happen in a large share of cases,
and the campaign statistics that say how often they did.

The working set is the pages the prompts need at the case's page size, a full page shared by
prompts with the same prefix counted once. A pool is never drawn below what the largest request
needs on its own (plus the reserved page 0): smaller, the run could never finish.
"""

from __future__ import annotations

import dataclasses
import math
import random

_NEEDS: dict = {}


def page_needs(case) -> tuple[int, int, int]:
    """(largest request's pages, working set in pages, largest decode need in pages) of `case`'s
    workload; the decode need is prompt plus generated tokens, nothing shared."""
    spec = case.spec()
    cfg, wc = spec.engine, spec.workload
    new_tokens = getattr(case, "max_new_tokens", 0)
    key = (dataclasses.astuple(wc), cfg.model, case.page_size, new_tokens)
    if key not in _NEEDS:
        from engine.runs.workload import make_workload
        from engine.runtime.memory import pages_for  # lazy: engine.runtime.memory imports torch

        ps = case.page_size
        prefixes, tails, largest, decode = set(), 0, 0, 0
        for r in make_workload(wc, cfg.model_config.vocab_size):
            n = len(r.prompt)
            prefixes.update(tuple(r.prompt[: (i + 1) * ps]) for i in range(n // ps))
            tails += n % ps != 0
            largest = max(largest, pages_for(n, ps))
            decode = max(decode, pages_for(n + new_tokens, ps))
        _NEEDS[key] = (largest, len(prefixes) + tails, decode)
    return _NEEDS[key]


def pressure_bounds(case) -> tuple[int, int]:
    """The range num_pages is drawn from: the largest request's need (+1 for page 0) up to 1.5x
    the working set of one prefill rank (a PD case's DP ranks share the requests)."""
    largest, working_set, _ = page_needs(case)
    per_rank = working_set / getattr(case, "dp", 1)
    return largest + 1, max(largest, math.ceil(1.5 * per_rank)) + 1


def with_pressure(case, rng: random.Random, fixed=()):
    """`case` with its pools drawn near its working set: prefill pages and slots, and for a PD case
    the decode's pages. What `fixed` names is left as it is."""
    lo, hi = pressure_bounds(case)
    per_rank = math.ceil(case.requests / getattr(case, "dp", 1))
    knobs = {"num_pages": rng.randint(lo, hi), "max_slots": rng.randint(1, per_rank + 1)}
    if hasattr(case, "decode_pages"):
        need = page_needs(case)[2]
        total = need * (case.requests + case.unserved)
        knobs["decode_pages"] = rng.randint(need + 1, max(need, math.ceil(1.5 * total)) + 1)
    knobs = {k: v for k, v in knobs.items() if k not in fixed}
    return dataclasses.replace(case, **knobs)


@dataclasses.dataclass(frozen=True)
class PressureDraws:
    """The case draw of a prefill campaign: schedule i of seed s runs `case` with pools drawn by
    Random(s * 100003 + i). A value, not a closure, so that `pdo fuzz --jobs` workers draw the same
    cases."""

    case: object
    seed: int
    fixed: tuple = ()  # the pool knobs the command line fixed

    def __call__(self, i: int):
        return with_pressure(self.case, random.Random(self.seed * 100_003 + i), self.fixed)


def pressure_draws(case, seed: int, fixed=()) -> PressureDraws:
    return PressureDraws(case, seed, tuple(fixed))


# ---- campaign statistics -------------------------------------------------------------------------
# (summary key, what the report calls it)
COUNTERS = (
    ("evicted_pages", "evicted pages"),
    ("failed_allocs", "failed allocations"),
    ("postponed_chunks", "postponed chunks"),
    ("postponed_requests", "postponed requests"),
    ("decode_memory_waits", "decode memory waits"),
)


JUDGED = (
    "rules",
    "outputs",
    "model_refines",
    "model_drift",
    "model_outside",
    "model_timeout",
    "model_unknown",
)


class CampaignStats:
    """Sums over a campaign's schedules of the memory counters of each run (Outcome.stats), and in
    how many schedules each was nonzero; and what each judge judged (Outcome.judged): traces
    checked against the rules, schedules whose outputs were compared, schedules judged for
    refinement and their traces by verdict."""

    def __init__(self, pd: bool = False):
        self.pd = pd
        self.schedules = 0
        self.totals = {k: 0 for k, _ in COUNTERS}
        self.cases = {k: 0 for k, _ in COUNTERS}
        self.judged = dict.fromkeys(JUDGED, 0)
        self.model_schedules = 0

    def add(self, outcome) -> None:
        self.schedules += 1
        judged = getattr(outcome, "judged", None) or {}
        for k in JUDGED:
            self.judged[k] += judged.get(k, 0)
        self.model_schedules += bool(getattr(outcome, "model", False))
        for k, _ in COUNTERS:
            n = (outcome.stats or {}).get(k, 0)
            self.totals[k] += n
            self.cases[k] += n > 0

    def _counters(self):
        # the decode waits exist only in PD runs
        return [(k, name) for k, name in COUNTERS if self.pd or k != "decode_memory_waits"]

    def not_exercised(self) -> list[str]:
        return [name for k, name in self._counters() if self.totals[k] == 0]

    def line(self) -> str:
        parts = [
            f"{name} {self.totals[k]} (in {self.cases[k]}/{self.schedules})"
            for k, name in self._counters()
        ]
        missing = self.not_exercised()
        tail = f"; not exercised: {', '.join(missing)}" if missing else ""
        return f"memory: {self.schedules} schedules, " + ", ".join(parts) + tail

    def judges_line(self) -> str:
        j = self.judged
        return (
            f"judges: {self.schedules} schedules; rules {j['rules']} traces; outputs "
            f"{j['outputs']} schedules; refinement {self.model_schedules} schedules, traces "
            f"{j['model_refines']} refine, {j['model_drift']} drift, not judged: "
            f"{j['model_outside']} outside the model, {j['model_timeout']} z3 out of time"
            + (f", {j['model_unknown']} with no model" if j["model_unknown"] else "")
        )

    def judges_dict(self) -> dict:
        return {"schedules": self.schedules, "model_schedules": self.model_schedules, **self.judged}

    def as_dict(self) -> dict:
        keys = [k for k, _ in self._counters()]
        return {
            "schedules": self.schedules,
            **{k: self.totals[k] for k in keys},
            "schedules_with": {k: self.cases[k] for k in keys},
            "not_exercised": self.not_exercised(),
        }


def prefill_run_stats(summary) -> dict:
    """The memory counters of one prefill run (engine/runs/prefill_run.py's summary)."""
    return dict(summary.get("memory") or {})


def pd_run_stats(summary) -> dict:
    """The memory counters of one PD run: the prefill ranks' summed, and the decode's waits."""
    out: dict = {}
    for m in summary.get("prefill_memory") or []:
        for k, v in m.items():
            out[k] = out.get(k, 0) + v
    out["decode_memory_waits"] = summary.get("decode_memory_waits", 0)
    return out
