import os
import sys

# Interpreter mode for Triton kernels on CPU; must be set before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


import json  # noqa: E402

import pytest  # noqa: E402

# Refinement on every engine trace of the suite (issue #19): each prefill or decode trace a test has
# the engine write (Tracer.write) is checked against the loop model of its mode, or the decode loop
# model, when the test ends (a decode trace the model leaves out is UNKNOWN, not judged). A
# mutant's trace (header `inject`) may drift on purpose and is left to the tests about it; a trace
# the test deleted or rewrote is skipped; a test marked `drifts` makes the loop drift on purpose.
# PDO_REFINE_SUITE=0 turns it off.
_REFINE = os.environ.get("PDO_REFINE_SUITE", "1") != "0"
_REFINE_TIMEOUT_MS = 30_000
_ROLES = ("prefill", "decode")


@pytest.fixture(autouse=True)
def _refine_engine_traces(request, monkeypatch):
    if not _REFINE or request.node.get_closest_marker("drifts"):
        yield
        return
    from engine.trace.tracer import Tracer

    written: list[str] = []

    def recorded(method):
        def wrapper(self, path, **kw):
            method(self, path, **kw)
            if self.header.get("role") in _ROLES and not self.header.get("inject"):
                written.append(str(path))

        return wrapper

    # a whole trace at once, or streamed (the flight recorder): judged once the test is over
    monkeypatch.setattr(Tracer, "write", recorded(Tracer.write))
    monkeypatch.setattr(Tracer, "stream", recorded(Tracer.stream))
    yield
    drifts = [d for d in (_drift(p) for p in dict.fromkeys(written)) if d]
    assert not drifts, "refinement: the engine wrote a trace its loop model does not admit\n" + (
        "\n".join(drifts)
    )


def _drift(path: str) -> str | None:
    from checker.refine import check_model, text
    from checker.trace_io import TraceFormatError

    try:
        with open(path) as f:
            header = json.loads(f.readline())
            last = json.loads(f.readlines()[-1] or "{}")
        if header.get("role") not in _ROLES or header.get("inject"):
            return None  # rewritten by the test since
        if header.get("version", 1) >= 2 and (last.get("ev"), last.get("reason")) != (
            "trace_end",
            "normal",
        ):
            return None  # a run cut short (or still open): not a whole schedule to refine
        check = check_model(path, timeout_ms=_REFINE_TIMEOUT_MS)
    except (OSError, ValueError, IndexError, TraceFormatError):
        return None  # deleted, or made unreadable on purpose, by the test
    if check.judged and not check.ok:
        return text(check)
    return None
