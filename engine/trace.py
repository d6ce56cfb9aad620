"""The trace writer: one JSON object per event, a header first (format documented in docs/trace-format.md).

Events are appended to an in-memory list under a lock as tuples and turned into dicts only when
read (`events`) or written at close, so that logging an event costs one tuple and one append
(tracing on must not distort the overlap it measures); a disabled tracer is a no-op method.
`seq` is the global order in which events were logged.
Every emit is also a schedule point: a controller (checker/fuzz.py) may block the calling thread
there to choose which thread runs next.
"""
from __future__ import annotations

import json
import threading
import time
import weakref

from . import sync

FORMAT = "pdo-trace"
VERSION = 1


class Tracer:
    enabled = True

    def __init__(self, header: dict | None = None):
        self.header = {"format": FORMAT, "version": VERSION, **(header or {})}
        self._raw: list[tuple] = []     # (seq, t_ns, thread, ev, fields), in seq order
        self._dicts: list[dict] = []    # the first len(_dicts) of _raw as event dicts
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._seq = 0
        self._by_id: dict[int, tuple] = {}   # id(obj) -> (weakref to obj, name)
        self._obj_count = 0

    def emit(self, ev: str, **fields) -> None:
        thread = threading.current_thread().name
        sync.point(ev)
        with self._lock:
            self._seq += 1
            self._raw.append((self._seq, time.monotonic_ns(), thread, ev, fields))

    @property
    def events(self) -> list[dict]:
        """Every event so far as a dict (seq, t_ns, thread, ev, then its fields), in seq order. Safe to
        read while the run goes on (a progress monitor does): it converts what was added since."""
        with self._read_lock:   # not the emit lock: converting must not hold up the threads that log
            raw, dicts = self._raw, self._dicts
            n = len(raw)
            if len(dicts) < n:
                dicts.extend({"seq": s, "t_ns": t, "thread": th, "ev": ev, **f} for s, t, th, ev, f in raw[len(dicts):n])
            return dicts

    def write(self, path: str, *, extra_header: dict | None = None) -> None:
        header = {**self.header, **(extra_header or {})}
        with open(path, "w") as f:
            f.write(json.dumps(header) + "\n")
            for e in self.events:
                f.write(json.dumps(e, separators=(",", ":")) + "\n")

    def obj(self, x) -> str:
        """Identity of a Python object for the trace: stable within a run (o1, o2, ... in order of first
        sight), so a copy of a request shows up as a new identity and reruns compare byte for byte.
        Looked up by id() without the lock (a dict read is atomic); the entry's weak reference proves
        the id still names the same object (ids are reused after an object dies)."""
        e = self._by_id.get(id(x))
        if e is not None and e[0]() is x:
            return e[1]
        with self._lock:
            e = self._by_id.get(id(x))
            if e is not None and e[0]() is x:
                return e[1]
            self._obj_count += 1
            name = f"o{self._obj_count}"
            key, by_id = id(x), self._by_id

            def forget(ref, key=key):  # drop the entry when the object dies, unless the id was reused
                if by_id.get(key, (None,))[0] is ref:
                    by_id.pop(key, None)

            self._by_id[key] = (weakref.ref(x, forget), name)
            return name

    def of(self, ev: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == ev]


class NullTracer(Tracer):
    enabled = False

    def __init__(self, header: dict | None = None, **_):
        super().__init__(header)

    def emit(self, ev: str, **fields) -> None:  # noqa: D401 - deliberately nothing
        sync.point(ev)

    def obj(self, x) -> str:
        return ""
