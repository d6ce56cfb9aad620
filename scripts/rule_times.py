"""Where one `pdo check` spends its time: each rule's template, the split of each chunk by kind,
the batch index, reading, in one check of TRACE in this process.

    PYTHONPATH=. .venv/bin/python scripts/rule_times.py TRACE [--top 20]

Each template's `on_chunk`, `on_kinds`, `idle` and `finish` are timed where the checker calls
them (wall time, `time.perf_counter`), and so are the split (`linear._split`), the batch index
(`Ctx.add`) and the reader (the chunks' iterator). The timers add their own cost to the total,
about 0.2 µs a call; the parts are what one template costs beside the others, not alone (the rules
are bound by memory: one that touches an event first pays for bringing it into the caches)."""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time

import checker.linear as linear
from checker.streaming import Ctx

HOOKS = ("on_chunk", "on_kinds", "idle", "finish")


def timed(total: collections.Counter, name: str, fn):
    @functools.wraps(fn)
    def run(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            total[name] += time.perf_counter() - t

    return run


def rule_times(path: str) -> tuple[float, collections.Counter]:
    """(seconds of the whole check, seconds by part) for one check of `path`."""
    total: collections.Counter = collections.Counter()
    instantiate, split, add, chunks = (
        linear._instantiate,
        linear._split,
        Ctx.add,
        linear.iter_chunks,
    )

    def instances(rules, ctx, extra):
        active = instantiate(rules, ctx, extra)
        for t in active:
            for hook in HOOKS:
                fn = getattr(t, hook)
                if fn is not None:  # on_kinds and idle are None unless a template has them
                    setattr(t, hook, timed(total, f"{t.rule.id}.{hook}", fn))
        return active

    def reading(*a, **kw):
        it = chunks(*a, **kw)
        while True:
            t = time.perf_counter()
            chunk = next(it, None)
            total["reading (decode, validate)"] += time.perf_counter() - t
            if chunk is None:
                return
            yield chunk

    linear._instantiate, linear._split, linear.iter_chunks = (
        instances,
        timed(total, "split by kind", split),
        reading,
    )
    Ctx.add = timed(total, "batch index (Ctx.add)", add)
    try:
        t = time.perf_counter()
        linear.check_file(path)
        return time.perf_counter() - t, total
    finally:
        linear._instantiate, linear._split, linear.iter_chunks, Ctx.add = (
            instantiate,
            split,
            chunks,
            add,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=20, help="parts to print, the costliest first")
    a = ap.parse_args()
    whole, parts = rule_times(a.trace)
    print(f"whole check {whole * 1e3:.1f} ms; the parts:")
    for name, s in parts.most_common(a.top):
        print(f"  {s * 1e3:7.1f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
