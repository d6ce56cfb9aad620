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
"""
