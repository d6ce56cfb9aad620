"""Where a linear check's time goes: each rule's template (its on_chunk calls and its finish), and the
whole check with every rule against the check with only the rules an older commit had.

    PYTHONPATH=. .venv/bin/python scripts/checker_rule_time.py TRACE [--rules-of 2de26c8] [--reps 3]

Times are the best of --reps checks in this process (wall; the wrappers add about a microsecond a
call), so they rank the rules; the ratio between two figures holds better than either figure.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import time

import checker.linear as linear
from spec import load_rules


def _timed(spent: collections.Counter, fed: collections.Counter):
    """linear._instantiate with each template's on_chunk and finish timed into `spent`."""
    make = linear._instantiate

    def instantiate(rules, ctx, extra):
        templates = make(rules, ctx, extra)
        for t in templates:
            key = f"{t.rule.id} ({type(t).__name__})"
            if (
                getattr(t, "on_kinds", None) is not None
            ):  # fed the chunk's events by kind: count its own kinds'
                t.on_kinds = _wrap(t.on_kinds, key, spent, fed, set(t.handlers()))
            else:
                t.on_chunk = _wrap(t.on_chunk, key, spent, fed)
            t.finish = _wrap(t.finish, key, spent, None)
        return templates

    return instantiate


def _wrap(fn, key, spent, fed, kinds=None):
    def call(*args):
        start = time.perf_counter()
        fn(*args)
        spent[key] += time.perf_counter() - start
        if fed is not None:
            got = args[0]
            fed[key] += sum(len(got[k]) for k in kinds if k in got) if kinds else len(got)

    return call


def _best(trace: str, reps: int, rules=None) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        linear.check_file(trace, rules=rules)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--rules-of", metavar="COMMIT", help="also time the rules this commit had")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    whole = _best(a.trace, a.reps)
    spent, fed = collections.Counter(), collections.Counter()
    linear._instantiate = _timed(spent, fed)
    linear.check_file(a.trace)
    print(f"whole check: {whole:.3f} s (best of {a.reps}); per rule, one check:")
    for key, s in spent.most_common():
        print(f"  {s * 1e3:8.1f} ms  {fed[key]:9,} events  {key}")
    print(f"  {sum(spent.values()) * 1e3:8.1f} ms  in the templates")
    if a.rules_of:
        text = subprocess.run(
            ["git", "show", f"{a.rules_of}:spec/rules.toml"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        ids = set(re.findall(r'^id = "([^"]+)"', text, re.M))
        older = [r for r in load_rules() if r.role != "prefill" or r.id in ids]
        linear._instantiate = _timed(collections.Counter(), collections.Counter())
        sub = _best(a.trace, a.reps, older)
        print(
            f"only the prefill rules {a.rules_of} had ({len(ids)}): {sub:.3f} s, ×{whole / sub:.2f}"
        )


if __name__ == "__main__":
    main()
