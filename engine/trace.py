"""The trace writer: one JSON object per event, a header first (format documented in docs/trace-format.md).

Events are appended to an in-memory list under a lock and written at close, so that logging an
event costs one dict and one append (tracing on must not distort the overlap it measures); a
disabled tracer is a no-op method. `seq` is the global order in which events were logged.
Every emit is also a schedule point: a controller (checker/fuzz.py) may block the calling thread
there to choose which thread runs next.
"""
from __future__ import annotations

import json
import threading
import time

FORMAT = "pdo-trace"
VERSION = 1


class Tracer:
    enabled = True

    def __init__(self, header: dict | None = None, *, controller=None):
        self.header = {"format": FORMAT, "version": VERSION, **(header or {})}
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._seq = 0
        self.controller = controller

    def emit(self, ev: str, **fields) -> None:
        thread = threading.current_thread().name
        if self.controller is not None:
            self.controller.point(thread, ev, fields)
        with self._lock:
            self._seq += 1
            self.events.append({"seq": self._seq, "t_ns": time.monotonic_ns(), "thread": thread, "ev": ev, **fields})

    def write(self, path: str, *, extra_header: dict | None = None) -> None:
        header = {**self.header, **(extra_header or {})}
        with open(path, "w") as f:
            f.write(json.dumps(header) + "\n")
            for e in self.events:
                f.write(json.dumps(e, separators=(",", ":")) + "\n")

    def of(self, ev: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == ev]


class NullTracer(Tracer):
    enabled = False

    def __init__(self, header: dict | None = None, **_):
        super().__init__(header)

    def emit(self, ev: str, **fields) -> None:  # noqa: D401 - deliberately nothing
        return None


def obj_id(x) -> str:
    """Identity of a Python object for the trace (the checker compares these, never dereferences)."""
    return f"{id(x):x}"
