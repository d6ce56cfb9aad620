"""Print docs/faults.md's table: each fault (`--kill ROLE@N`) run through `pdo launch` (processes,
SIGKILL) or `pdo run --pd` (one process), with what it measured.

    PYTHONPATH=. .venv/bin/python scripts/fault_table.py [--only launch|pd]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--dp", "2", "--requests", "8", "--prompt-len", "16:64", "--max-new-tokens", "4"]
COMMON += [
    "--workload-seed",
    "7",
    "--decode-bootstrap-timeout-s",
    "20",
    "--decode-kv-timeout-s",
    "20",
]

# (runner, --kill, moment in words)
CASES = [
    ("pd", "prefill1@0", "early: right after it registered"),
    ("pd", "prefill1@2", "mid-run: after 2 KV chunks"),
    ("launch", "prefill1@0", "early: right after it registered"),
    ("launch", "prefill1@2", "mid-run: after 2 KV chunks"),
    ("launch", "decode@3", "early: decode iteration 3"),
    ("launch", "decode@200", "mid-run: decode iteration 200"),
    ("launch", "bootstrap@0", "early: before the ranks registered"),
    ("launch", "bootstrap@1", "mid-run: at decode's first DP-rank query"),
]


def run(runner: str, kill: str, tmp: Path) -> tuple[int, dict]:
    if runner == "launch":
        cmd = ["launch", "--trace-dir", str(tmp), "--timeout-s", "150"]
    else:
        cmd = ["run", "--pd", "--trace", str(tmp / "t.jsonl")]
    p = subprocess.run(
        [sys.executable, "-m", "engine.cli", *cmd, *COMMON, "--kill", kill, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return p.returncode, json.loads(p.stdout)


def checked(traces: list) -> str:
    if not traces:
        return "none kept"
    p = subprocess.run(
        [sys.executable, "-m", "engine.cli", "check", *traces], cwd=ROOT, capture_output=True
    )
    names = ", ".join(
        Path(t).name.split(".")[-2] if "." in Path(t).stem else Path(t).stem for t in traces
    )
    verdict = {0: "PASS", 3: "PASS, cut traces INCOMPLETE"}.get(p.returncode, "FAIL")
    cut = [
        Path(t).name.split(".")[-2] if "." in Path(t).stem else Path(t).stem
        for t in traces
        if b'"trace_end"' not in Path(t).read_bytes()[-400:]
    ]
    return f"{names}: {verdict}" + (f" ({', '.join(cut)} cut)" if cut else "")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["launch", "pd"])
    only = ap.parse_args().only
    print(
        "| runner | fault | moment | finished | aborted (reason) | outputs vs reference "
        "| leaks | traces kept, `pdo check` | exit |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for runner, kill, moment in CASES:
        if only and runner != only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            code, s = run(runner, kill, Path(tmp))
            reasons = sorted(
                {
                    re.sub(r"room \d+", "room R", why.split(":")[0].split(" after ")[0])
                    for why in s["aborted"].values()
                }
            )
            leaks = [s["decode_leaks"], *s["prefill_leaks"]]
            print(
                f"| {'`pdo launch`' if runner == 'launch' else '`pdo run --pd`'} | `--kill {kill}` "
                f"| {moment} | {s['finished']}/{s['requests']} "
                f"| {len(s['aborted'])} ({'; '.join(reasons) or '-'}) "
                f"| {'identical' if not s.get('mismatches') else 'MISMATCH'} "
                f"| {'none' if not any(any(x.values()) for x in leaks) else 'LEAK'} "
                f"| {checked(s['traces'])} | {code} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
