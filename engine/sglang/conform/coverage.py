"""Which rules of spec/ judge SGLang's traces: the rules × SGLang table of docs/sglang.md, measured.

A rule judges SGLang when the linear checker judged at least one instance of it (`checks` > 0) on
the traces `pdo conform sglang --trace-dir D` writes. A rule that applies to a trace's mode and
version but whose events are never logged judges nothing there: it counts as not judged.

    python -m engine.sglang.conform.coverage D     # per rule: instances judged on D's traces

`documented()` reads the table of docs/sglang.md; tests/engine/sglang/test_rules_coverage.py
compares the two, so the table cannot go stale.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from pathlib import Path

from checker.linear import check_files
from spec import load_rules

DOC = Path(__file__).resolve().parents[3] / "docs" / "sglang.md"
SECTION = "## Which rules judge SGLang's traces"
_ROW = re.compile(r"^\| `([A-Z]-[A-Za-z0-9-]+)` \| (yes|no) \|")


def judged(paths) -> dict[str, int]:
    """rule id -> instances the linear checker judged on these traces, each checked on its own
    (every rule of spec/ is a key, 0 when it judged none)."""
    counts = {r.id: 0 for r in load_rules()}
    for path in paths:
        for result in check_files([path]):
            for rule, n in result.rules:
                counts[rule.id] += n
    return counts


def traces(trace_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(trace_dir, "*.jsonl")))


def documented(text: str | None = None) -> dict[str, bool]:
    """rule id -> the table's `judged` column (yes: True), from docs/sglang.md's section."""
    text = DOC.read_text(encoding="utf-8") if text is None else text
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    rows = {}
    for line in text[start : end if end != -1 else None].splitlines():
        m = _ROW.match(line)
        if m:
            if m.group(1) in rows:
                raise ValueError(f"docs/sglang.md: rule {m.group(1)} listed twice")
            rows[m.group(1)] = m.group(2) == "yes"
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python -m engine.sglang.conform.coverage TRACE_DIR", file=sys.stderr)
        return 2
    paths = traces(argv[0])
    if not paths:
        print(f"{argv[0]}: no trace (*.jsonl)", file=sys.stderr)
        return 2
    for rule_id, n in judged(paths).items():
        print(f"{rule_id}\t{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
