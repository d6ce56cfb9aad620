"""`pdo bench`: measurements of the engine and of its instruments.

  pdo bench prefill         the four prefill loops, interleaved, at several prefix-hit ratios:
                            uncached input tokens/s, TTFT, scheduler and forward busy time,
                            overlap efficiency                                   (prefill.py)
  pdo bench trace-overhead  the engine with tracing on vs off, and the cost of one trace event
                                                                          (trace_overhead.py)
  pdo bench checker         throughput and peak memory of the linear checker on a big valid
                            trace                                         (checker/bench.py)
  pdo bench decode          decode's DP-rank prefetch against the synchronous query  (decode.py)

The shared parts: stats.py (percentiles, bootstrap and t-intervals), trace_metrics.py (busy times
and overlap efficiency from a trace), progress.py, record.py (machine, date, JSON), knobs.py (the
engine and workload options), what_if.py (`--gil-free-device`), registry.py (the sub-commands,
which cli.py turns into parsers). docs/benchmarks.md has the current figures and how each is
computed.

This package re-exports the names that tests import from `engine.bench`.
"""

from __future__ import annotations

# the underscored names are the module-private names tests/engine/test_bench.py reads
from .knobs import engine_workload as _engine_workload  # noqa: F401
from .prefill import DEFAULT_LAUNCH_COST_US, bench_prefill, run_one
from .progress import Progress
from .stats import pct as _pct  # noqa: F401
from .trace_metrics import intersection as _intersection  # noqa: F401
from .trace_metrics import length as _length  # noqa: F401
from .trace_metrics import trace_metrics
from .trace_metrics import union as _union  # noqa: F401
from .trace_overhead import bench_trace_overhead, emit_cost_ns, format_trace_overhead

# checker/bench.py imports this package: its names are looked up when first asked for, since an
# import here would be a cycle
_FROM_CHECKER_BENCH = ("bench_checker", "format_checker", "make_big_trace")


def __getattr__(name: str):
    if name in _FROM_CHECKER_BENCH:
        from checker import bench as checker_bench  # lazy: checker.bench imports this package

        return getattr(checker_bench, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_LAUNCH_COST_US",
    "Progress",
    "bench_prefill",
    "bench_trace_overhead",
    "emit_cost_ns",
    "format_trace_overhead",
    "run_one",
    "trace_metrics",
    *_FROM_CHECKER_BENCH,
]
