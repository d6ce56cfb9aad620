"""The statistics the benchmarks report: percentiles, medians, bootstrap and t-intervals, paired
ratios. Every resampling is seeded, so a rerun on the same numbers prints the same interval."""

from __future__ import annotations

import math
import random
import statistics


def pct(xs, q: float) -> float:
    """Percentile by linear interpolation (q in 0..100); nan for no data."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(xs) -> float:
    """Median of xs, NaNs left out; nan for no data."""
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def ci95(xs, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of xs."""
    xs = [x for x in xs if x == x]
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


# two-sided 97.5% quantile of Student's t by degrees of freedom; 1.96 beyond the table
_T_975 = {
    1: 12.71,
    2: 4.30,
    3: 3.18,
    4: 2.78,
    5: 2.57,
    6: 2.45,
    7: 2.36,
    8: 2.31,
    9: 2.26,
    10: 2.23,
    12: 2.18,
    15: 2.13,
    20: 2.09,
    25: 2.06,
    30: 2.04,
    40: 2.02,
    60: 2.00,
    120: 1.98,
}


def geo_ci95(ratios) -> tuple[float, float, float]:
    """Geometric mean of ratios with a 95% t-interval (on the logs): (mean, lo, hi)."""
    logs = [math.log(r) for r in ratios if r > 0]
    n = len(logs)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    mean = statistics.fmean(logs)
    if n < 2:
        return math.exp(mean), math.exp(mean), math.exp(mean)
    df = n - 1
    quantile = next((v for k, v in sorted(_T_975.items()) if k >= df), 1.96)
    half = quantile * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def quantile_ratio(on, off, q: float = 20.0, n: int = 2000, seed: int = 0):
    """Ratio of the q-th percentiles of paired samples `on` and `off`, with a 95% bootstrap interval
    (pairs resampled together): (estimate, (lo, hi)). Interference from other jobs only adds time,
    so the faster runs of each side are the least disturbed: this estimates the ratio on a quiet
    machine."""
    est = pct(on, q) / pct(off, q)
    rng = random.Random(seed)
    idx = range(len(on))
    boots = []
    for _ in range(n):
        pick = rng.choices(idx, k=len(on))
        boots.append(pct([on[i] for i in pick], q) / pct([off[i] for i in pick], q))
    boots.sort()
    return est, (boots[int(0.025 * n)], boots[int(0.975 * n) - 1])
