"""Refinement of one engine trace against its loop model, for the tests (the fixture `refined` of
tests/conftest.py and tests/engine/test_refinement.py)."""

from __future__ import annotations

import json

from checker.refine import check_model, text
from checker.trace_io import TraceFormatError

TIMEOUT_MS = 30_000
# The model check's encoding grows with the square of a trace's events: a test's trace is a few
# hundred; one far longer (a run that went on longer than its test meant) is not model-checked.
MAX_EVENTS = 3_000
ROLES = ("prefill", "decode")


def drift(path: str) -> str | None:
    try:
        with open(path) as f:
            header = json.loads(f.readline())
            rest = f.readlines()
            last = json.loads(rest[-1] or "{}")
        if len(rest) > MAX_EVENTS + 1:
            return None
        if header.get("role") not in ROLES or header.get("inject"):
            return None  # rewritten by the test since
        if header.get("version", 1) >= 2 and (last.get("ev"), last.get("reason")) != (
            "trace_end",
            "normal",
        ):
            return None  # a run cut short (or still open): not a whole schedule to refine
        check = check_model(path, timeout_ms=TIMEOUT_MS)
    except (OSError, ValueError, IndexError, TraceFormatError):
        return None  # deleted, or made unreadable on purpose, by the test
    if check.judged and not check.ok:
        return text(check)
    return None
