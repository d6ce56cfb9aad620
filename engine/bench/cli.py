"""`pdo bench`: a parser with one sub-command per entry of the bench registry.

Importing a benchmark module registers its sub-command, and `pdo bench --help` lists them in the
order they were registered: importing any module of this package runs `engine/bench/__init__.py`
first, which imports (and so registers) prefill and trace-overhead; then `checker.bench` registers
checker, and `.decode` decode.
"""

from __future__ import annotations

from checker import bench as checker_bench  # noqa: F401  (registers `pdo bench checker`)
from engine.bench import decode, prefill, trace_overhead  # noqa: F401  (register their sub-commands)
from engine.bench.registry import BENCH


def register(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmarks: prefill loops, tracing overhead, checker throughput"
    )
    bench_sub = p.add_subparsers(
        dest="bench", required=True, metavar="{prefill,trace-overhead,checker,...}"
    )
    for name, command in BENCH.items():
        q = bench_sub.add_parser(name, help=command.help)
        command.add_arguments(q)
        q.set_defaults(fn=command.run)
