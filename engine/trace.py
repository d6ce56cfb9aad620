"""The trace writer: one JSON object per event, a header first (format documented in docs/trace-format.md).

Logging an event is one tuple appended to an in-memory list, without a lock: the append is atomic,
and its position in the list is the event's `seq`, the global order in which events were logged.
Dicts are built only when the events are read (`events`) or written at close. (No lock: a thread
that blocks on one while its holder waits for the GIL can stall for a whole switch interval.)
Tracing on must not distort the overlap it measures; a disabled tracer is a no-op method. `t_ns` is read just before the append, so across threads it may trail the
previous event's by the time a thread switch takes; timelines use it, the checker orders by `seq`.
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
        self._raw: list[tuple] = []     # (t_ns, thread, ev, fields); the position + 1 is the seq
        self._dicts: list[dict] = []    # the first len(_dicts) of _raw as event dicts
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._by_id: dict[int, tuple] = {}   # id(obj) -> (weakref to obj, name)
        self._obj_count = 0

    def emit(self, ev: str, **fields) -> None:
        thread = threading.current_thread().name
        sync.point(ev)
        self._raw.append((time.monotonic_ns(), thread, ev, fields))

    @property
    def events(self) -> list[dict]:
        """Every event so far as a dict (seq, t_ns, thread, ev, then its fields), in seq order. Safe to
        read while the run goes on (a progress monitor does): it converts what was added since."""
        with self._read_lock:   # two readers must not both convert the same tail
            raw, dicts = self._raw, self._dicts
            n = len(raw)
            if len(dicts) < n:
                dicts.extend({"seq": s, "t_ns": t, "thread": th, "ev": ev, **f}
                             for s, (t, th, ev, f) in enumerate(raw[len(dicts):n], len(dicts) + 1))
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
