"""Traces left as a binary log (spec/tracelog.py): a run killed before it closed its trace leaves
`T.jsonl.pdolog` and no `T.jsonl`. `pdo check` and `pdo trace` take either name: the JSON Lines
are made from the log beside it (T.jsonl, or a temporary file where that cannot be written), and
what the log lacked is said on stderr. Without `trace_end` the trace reads as truncated, as any
trace cut short does (docs/trace-format.md, "Truncated traces")."""

from __future__ import annotations

import os
import sys
import tempfile

from spec import tracelog


def materialize(path: str) -> str:
    """The JSON Lines trace to read for `path`: itself when it exists (a trace closed normally
    has its log removed), else the one made from its log."""
    if path.endswith(tracelog.SUFFIX):  # the log named: read it
        log, out = path, path[: -len(tracelog.SUFFIX)]
    elif os.path.exists(path) or not os.path.exists(path + tracelog.SUFFIX):
        return path
    else:
        log, out = path + tracelog.SUFFIX, path
    try:
        with open(log, "rb") as f:
            r = tracelog.read_log(f.read())
    except (tracelog.BadLog, KeyError, ValueError) as err:
        raise tracelog.BadLog(f"{log}: not a readable binary log: {err}") from None
    try:
        lines, whole = tracelog.write_jsonl(r, out)
    except OSError:  # a folder we may not write to: a file of our own
        fd, out = tempfile.mkstemp(suffix=".jsonl", prefix="pdo-trace-")
        os.close(fd)
        lines, whole = tracelog.write_jsonl(r, out)
    d = r.damage
    lost = {
        f"{d.torn} torn record(s) dropped": d.torn,
        f"{d.holes} slot(s) taken but never written": d.holes,
        f"the last {d.unresolved} event(s) dropped: a digest never computed": d.unresolved,
    }
    head = f"note: {log}: the run left only its binary log; {lines - 1} line(s) made from it"
    head += "" if whole else " (no trace_end: truncated)"
    print("; ".join([head, *(note for note, n in lost.items() if n)]), file=sys.stderr)
    return out
