"""Lost events: from version 2 of the format on, `seq` counts a trace's events (docs/trace-format.md),
so a gap in it, a first event that does not start the count, or a `trace_end` whose `events` is not
the number of events before it means lines are missing from the file. Such a trace is bad input: the
rules would judge a schedule that did not run (an event taken out of the middle can look like an
order broken), so no rule is judged on it.

Where the events carry happens-before clocks (`vc`, versions 3 and 4), each thread's own component
counts that thread's events, so the error also names the thread (or threads) whose events are
missing, and where."""

from __future__ import annotations

import json
from operator import lt

DENSE_SINCE = 2  # the version from which seq counts the events, 0 or 1 first


def seqs_ok(seqs: list, last_seq: int, dense: bool) -> bool:
    """Whether a chunk's seqs follow `last_seq` (-1 before the first event): each one more than the
    one before when `dense` (the first 0 or 1), else strictly increasing."""
    if not seqs:
        return True
    if dense:
        first = seqs[0] if last_seq < 0 and seqs[0] in (0, 1) else last_seq + 1
        return seqs == list(range(first, first + len(seqs)))
    return all(map(lt, [last_seq, *seqs], seqs))


def gap_reason(path: str, line: int, last_seq: int, seq: int, hb: str | None) -> str:
    """Why the event at `line` with `seq` (after `last_seq`, -1 at the first event) means lost
    events, naming the threads that lost them when the clocks say."""
    if last_seq < 0:
        what = f"the first event has seq {seq}: the events numbered before it are missing"
        lost = seq - 1
    else:
        lost = seq - last_seq - 1
        span = f"seq {last_seq + 1}" if lost == 1 else f"seq {last_seq + 1}..{seq - 1}"
        what = f"{seq} follows {last_seq}: {lost} event(s) missing ({span})"
    who = _threads_that_lost(path, line, lost, hb) if hb is not None else ""
    return f"field 'seq': {what}{who}; lost events: the trace is not whole"


def _own(e: dict, hb: str) -> int | None:
    vc = e.get("vc")
    if type(vc) is int:
        return vc
    if type(vc) is dict:
        own = vc.get(hb + e["thread"]) if type(e.get("thread")) is str else None
        return own if type(own) is int else None
    return None


def _threads_that_lost(path: str, line: int, lost: int, hb: str) -> str:
    """`: thread T lost k before line L, ...` from each thread's own clock count, read again from
    the file's start (an error path: the trace is refused anyway); "" when the clocks do not say."""
    last: dict = {}
    found: list = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n == 1 or not raw.strip():
                continue
            try:
                e = json.loads(raw)
            except (ValueError, RecursionError):  # not JSON, or nested too deep for json
                break
            if type(e) is not dict or type(e.get("thread")) is not str:
                break
            own = _own(e, hb)
            if own is None:
                continue
            t = e["thread"]
            if n >= line and own > last.get(t, 0) + 1:
                found.append((t, own - last.get(t, 0) - 1, n))
                if sum(k for _, k, _ in found) >= lost:
                    break
            last[t] = own
    if not found:
        return ""
    return ": " + ", ".join(f"thread {t!r} lost {k} before line {n}" for t, k, n in found)
