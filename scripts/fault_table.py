"""Print docs/faults.md's table: each fault (`--kill ROLE@N`) run through `pdo launch` (processes,
SIGKILL) or `pdo run --pd` (one process), and each outside kill (this script SIGKILLs one child of
`pdo launch` once the decode's trace shows a moment), with what it measured.

    PYTHONPATH=. .venv/bin/python scripts/fault_table.py [--only launch|pd|outside]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.runs.child_process import children_of

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


# Outside kills: (role, the child's command-line words, decode trace events that mark the moment,
# moment in words). Arrivals spread over about 2 s and 48 tokens each keep every role busy well past
# the moment (the decode's trace reaches the file up to a flush interval late).
OUTSIDE_FLAGS = ["--max-new-tokens", "48", "--arrival", "poisson", "--rate", "4"]
OUTSIDE = [
    (
        "bootstrap",
        ["engine.cli", "bootstrap"],
        ('"ev":"receiver_init"', 8),
        "after the last room resolved (8 receiver inits)",
    ),
    (
        "prefill1",
        ["engine.runs.pd_process", "prefill", "1"],
        ('"ev":"prefill_info"', 1),
        "as the decode starts (its prefill_info event)",
    ),
    (
        "decode",
        ["engine.runs.pd_process", "decode"],
        ('"ev":"receiver_init"', 4),
        "at 4 receiver inits",
    ),
]


def kill_from_outside(launcher: subprocess.Popen, words: list[str], trace: Path, mark) -> None:
    """SIGKILL the launcher's child whose command line holds `words` once `trace` holds `mark`
    (event text, count)."""
    text, count = mark
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and launcher.poll() is None:
        if trace.exists() and trace.read_text(errors="replace").count(text) >= count:
            for pid, argv in children_of(launcher.pid).items():
                if all(w in argv for w in words):
                    os.kill(pid, signal.SIGKILL)
                    return
        time.sleep(0.01)
    raise RuntimeError(f"the moment never came: {text} x{count} in {trace}")


def run_outside(role: str, words: list[str], mark, tmp: Path) -> tuple[int, dict]:
    p = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "launch", "--trace-dir", str(tmp), "--timeout-s"]
        + ["150", *COMMON, *OUTSIDE_FLAGS, "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        kill_from_outside(p, words, tmp / "decode.jsonl", mark)
        out, _err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p.returncode, json.loads(out)


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


def row(runner: str, fault: str, moment: str, code: int, s: dict) -> str:
    reasons = sorted(
        {
            re.sub(r"room \d+", "room R", why.split(":")[0].split(" after ")[0])
            for why in s["aborted"].values()
        }
    )
    leaks = [s["decode_leaks"], *s["prefill_leaks"]]
    faults = ", ".join(f"{f['role']} ({f['status']})" for f in s.get("faults") or []) or "none"
    return (
        f"| {runner} | {fault} | {moment} | {s['finished']}/{s['requests']} "
        f"| {len(s['aborted'])} ({'; '.join(reasons) or '-'}) "
        f"| {'identical' if not s.get('mismatches') else 'MISMATCH'} "
        f"| {'none' if not any(any(x.values()) for x in leaks) else 'LEAK'} "
        f"| {faults} | {checked(s['traces'])} | {code} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["launch", "pd", "outside"])
    only = ap.parse_args().only
    print(
        "| runner | fault | moment | finished | aborted (reason) | outputs vs reference "
        "| leaks | faults reported (status) | traces kept, `pdo check` | exit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for runner, kill, moment in CASES:
        if only and runner != only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            code, s = run(runner, kill, Path(tmp))
            name = "`pdo launch`" if runner == "launch" else "`pdo run --pd`"
            print(row(name, f"`--kill {kill}`", moment, code, s), flush=True)
    for role, words, mark, moment in OUTSIDE:
        if only and only != "outside":
            continue
        with tempfile.TemporaryDirectory() as tmp:
            code, s = run_outside(role, words, mark, Path(tmp))
            fault = f"`kill -9` {role} (poisson 4/s, 48 tokens)"
            print(row("`pdo launch`", fault, moment, code, s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
