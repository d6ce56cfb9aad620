"""Which judge (rule, content oracle, refinement, leak, engine error) flags the schedule that killed
each registered mutant in `pdo fuzz --mutants`' hunts; prints the table of docs/fuzzing.md.

Run: .venv/bin/python scripts/fuzz_judges.py [MUTANT ...]   (default: every registered mutant)
"""

import sys

from checker.fuzz.cli import mutant_row
from engine.runtime.inject import DECODE_MUTANTS, MUTANTS

KINDS = [
    ("rule", "rule "),
    ("content oracle", "output"),
    ("refinement", "model "),
    ("leak", "leak"),
    ("engine error", ""),
]


def kind(f):
    for name, p in KINDS[:-1]:
        if f.startswith(p):
            return name
    return "engine error"


print(
    "| mutant | side | killed | median schedules to kill | judges that flag the killing schedule (seeds of 5) |"
)
print("|---|---|---|---|---|")
for name in sys.argv[1:] or list(MUTANTS) + list(DECODE_MUTANTS):
    row = mutant_row(name, strategy="pct", seeds=range(5), budget=60)
    counts = {}
    for fails in row["failures"]:
        for k in sorted({kind(f) for f in fails}):
            counts[k] = counts.get(k, 0) + 1
    judged = ", ".join(
        f"{k} {n}/5"
        for k, n in sorted(counts.items(), key=lambda kv: [n for n, _ in KINDS].index(kv[0]))
    )
    print(
        f"| {name} | {row['side']} | {row['kills']} | {row['schedules_to_kill']} | {judged} |",
        flush=True,
    )
