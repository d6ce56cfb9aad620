"""Compare two pdo traces of the same seeded run event for event: the header's keys and values,
and per thread the sequence of (ev, fields), leaving out what differs from run to run (t_ns; seq,
which interleaves threads by timing; `vc`, which a trace without happens-before lacks; `host`).
`--per-event`: per thread and event name instead (how a thread interleaves two of its event
kinds, a store's entries with releases, may differ from run to run of the same seed).
Exit 0 when they agree, 1 with the first difference, 2 on bad input.

    python scripts/same_traces.py [--per-event] A.jsonl B.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

VARIES = {"t_ns", "seq", "vc"}
HEADER_VARIES = {"hb", "host"}


def load(path: str, per_event: bool) -> tuple[dict, dict]:
    try:
        lines = [json.loads(x) for x in open(path, "rb").read().splitlines() if x.strip()]
    except (OSError, ValueError) as err:
        print(f"{path}: {err}", file=sys.stderr)
        sys.exit(2)
    header = {k: v for k, v in lines[0].items() if k not in HEADER_VARIES}
    threads = defaultdict(list)
    for e in lines[1:]:
        key = (e["thread"], e["ev"]) if per_event else e["thread"]
        threads[key].append({k: v for k, v in e.items() if k not in VARIES})
    return header, threads


def main(argv: list[str]) -> int:
    per_event = argv[:1] == ["--per-event"]
    argv = argv[per_event:]
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    (ha, ta), (hb, tb) = load(argv[0], per_event), load(argv[1], per_event)
    if ha != hb:
        keys = sorted(k for k in ha.keys() | hb.keys() if ha.get(k) != hb.get(k))
        print(f"headers differ in {keys}")
        return 1
    if set(ta) != set(tb):
        print(f"threads differ: {sorted(ta, key=str)} vs {sorted(tb, key=str)}")
        return 1
    for th in sorted(ta, key=str):
        for i, (x, y) in enumerate(zip(ta[th], tb[th])):
            if x != y:
                print(f"thread {th}, event {i}: {x} vs {y}")
                return 1
        if len(ta[th]) != len(tb[th]):
            print(f"thread {th}: {len(ta[th])} vs {len(tb[th])} events")
            return 1
    n = sum(map(len, ta.values()))
    print(f"same: {n} events in {len(ta)} sequences, header of {len(ha)} fields")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
