"""The trace writer: one JSON object per event, a header first (format: docs/trace-format.md).

Tracing on must not distort the overlap it measures, so logging an event does as little as it can
on the engine's threads (a disabled tracer is a no-op method):

- The event's four parts (t_ns, thread, ev, fields) are appended to one in-memory list with one
  `list.extend`, atomic under the GIL, without a lock (a thread that blocks on a lock while its
  holder waits for the GIL can stall for a whole switch interval). The event's position in the list
  is its `seq`, the global order in which events were logged. `t_ns` is read just before the append,
  so across threads it may trail the previous event's by a thread switch; timelines use it, the
  checker orders by `seq`. Dicts are built only when the events are read (`events`) or written.
- No per-event tuple is kept beside the fields (a declared event's values are its fields): CPython
  starts a garbage collection after a fixed number of net allocations of container objects, so an
  extra tuple per event makes collections more frequent, now and then a full one, which is long in
  an engine process with torch loaded (the engine loops also run with their start-up objects frozen
  out of the collector, engine/runs/prefill_run.py).
- Hot paths log through declared events (`events_for`): the event's field names are given once, and
  a call passes the values positionally and keeps them as one tuple, named when the events are read:
  cheaper than `emit`, which builds a keyword dict per call, and the engine logs an event at every
  ordering point (docs/benchmarks.md has the costs).
- Object identities (the `obj` field) cost nothing in the run: the caller passes the object itself,
  the event keeps a reference to it, and it is named (o1, o2, ...: in the order the tracer first
  names them — when a digest covers them, or when the events are read) at that point. Kept alive
  by the trace, an object's id() cannot be reused by another, so identity is exact. A `digest`
  field may likewise be a value computed late (an object with `trace_value()`:
  engine.trace.digest.DigestStamp), resolved when read if nobody did before.

With a file to stream to (`stream`), a writer thread writes the events as they come
(engine/trace/writer.py); the one cost on the hot path is a length check against `_gate`.

Every event logged (by `emit` or a declared event) is also a schedule point: a controller
(checker/fuzz/) may block the calling thread there to choose which thread runs next.
"""

from __future__ import annotations

import atexit
import json
import threading
import types
from time import monotonic_ns as _monotonic_ns

from engine import sync
from engine.sync import hb
from engine.trace import writer as trace_writer

FORMAT = "pdo-trace"
VERSION = 4


class _Kind:
    """A declared event (Tracer.events_for): its name and its fields' names, in the order logged."""

    __slots__ = ("ev", "names")

    def __init__(self, ev: str, names: tuple[str, ...]):
        self.ev, self.names = ev, names


class Tracer:
    enabled = True
    kind_class = _Kind  # a declared event's kind, as stored (the trace writer reads it)

    def __init__(self, header: dict | None = None):
        self.header = {"format": FORMAT, "version": VERSION, **(header or {})}
        self._hb = hb.new_tag() if hb.ON else None  # each event's `vc` (engine/sync/hb.py)
        if self._hb is not None:
            self.header["hb"] = self._hb
        self._raw: list = []  # t_ns, thread, ev, fields, t_ns, ...: event i at 4*i, seq i + 1
        self._extend = self._raw.extend
        self._thread = threading.local()  # .name: the thread's name, read at its first event
        self._dicts: list[dict] = []  # the first len(_dicts) events as dicts
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._names: dict[
            int, tuple
        ] = {}  # id(obj) -> (obj, kept alive so its id stays its own; name)
        self._obj_count = 0
        self.declared: dict[
            str, tuple[str, ...]
        ] = {}  # ev -> field names, of the events declared by events_for
        # the length of _raw at which a logging thread calls the writer (trace_writer.StreamWriter)
        self._gate = [trace_writer._NEVER]
        self._writer: trace_writer.StreamWriter | None = None
        self._path: str | None = None
        self.end_reason: str | None = None  # set once the trace is closed (trace_end written)
        self.end_fields: dict = {}  # extra fields of trace_end: counts known only at the end

    def emit(self, ev: str, **fields) -> None:
        try:
            thread = self._thread.name
        except AttributeError:  # this thread's first event (current_thread().name is not free)
            thread = self._thread.name = threading.current_thread().name
        sync.point(ev)
        if self._hb is not None:
            fields["vc"] = hb.tick(self._hb + thread)
        self._extend((_monotonic_ns(), thread, ev, fields))  # this tuple is freed at once
        if len(self._raw) >= self._gate[0]:
            self._writer.full()

    def events_for(self, **kinds: tuple[str, ...]) -> types.SimpleNamespace:
        """Declared events for a hot path: `log = tracer.events_for(kv_send=("rid", "obj", "tokens",
        "pages"))`, then `log.kv_send(req.rid, req, tokens, pages)` logs what `emit("kv_send", rid=...,
        obj=..., ...)` would, at less cost. The values are kept as one tuple and named when the
        events are read; a call with too many or too few values raises TypeError where it is made."""
        declared = {ev: _Kind(ev, tuple(names)) for ev, names in kinds.items()}
        self.declared.update({ev: k.names for ev, k in declared.items()})
        return types.SimpleNamespace(**{ev: self._logger(k) for ev, k in declared.items()})

    def _logger(self, kind: "_Kind"):
        """One declared event's log call; with happens-before clocks on (`self._hb`), its thread's
        vector clock is kept as a last field `vc`."""
        ext, local, now, ev, n = self._extend, self._thread, _monotonic_ns, kind.ev, len(kind.names)
        raw, gate = self._raw, self._gate
        tag, tick = self._hb, hb.tick
        stored = kind if tag is None else _Kind(kind.ev, (*kind.names, "vc"))

        def log(*values):
            if len(values) != n:
                raise _arity(kind, values)
            try:
                thread = local.name
            except AttributeError:
                thread = local.name = threading.current_thread().name
            if (
                sync.CONTROLLER is not None or sync.JITTER_US
            ):  # sync.point, without its call when idle
                sync.point(ev)
            if tag is not None:
                values = (*values, tick(tag + thread))
            ext((now(), thread, stored, values))
            if len(raw) >= gate[0]:
                self._writer.full()

        return log

    @staticmethod
    def _fields(ev, fields) -> tuple[str, dict]:
        """(ev, fields) of a stored event: a declared event's values named."""
        if ev.__class__ is not _Kind:
            return ev, fields
        return ev.ev, dict(zip(ev.names, fields))

    @property
    def count(self) -> int:
        """How many events were logged (without converting them)."""
        return len(self._raw) // 4

    def names_and_fields(self, start: int = 0) -> list[tuple[str, dict]]:
        """(ev, fields) of the events from index `start` on, as logged: nothing converted, named or
        hashed (a progress monitor reads these while the run goes on; reading `events` would hash
        pending digest stamps early, before the forward's stamp can be checked after its launch).
        The fields are the tracer's own: read them, do not change them."""
        raw = self._raw
        part = raw[4 * start : 4 * (len(raw) // 4)]
        return [self._fields(ev, f) for ev, f in zip(part[2::4], part[3::4])]

    @property
    def events(self) -> list[dict]:
        """Every event so far as a dict (seq, t_ns, thread, ev, then its fields), in seq order. Safe to
        read while the run goes on (a progress monitor does): it converts what was added since."""
        with self._read_lock:  # two readers must not both convert the same tail
            raw, dicts = self._raw, self._dicts
            n = len(raw) // 4
            if len(dicts) < n:
                part = raw[4 * len(dicts) : 4 * n]
                name, named = self.obj, self._fields
                for s, t, th, ev, f in zip(
                    range(len(dicts) + 1, n + 1), part[0::4], part[1::4], part[2::4], part[3::4]
                ):
                    ev, f = named(ev, f)
                    e = {"seq": s, "t_ns": t, "thread": th, "ev": ev, **f}
                    o = e.get("obj")
                    if o is not None and not isinstance(o, str):
                        e["obj"] = name(o)
                    d = e.get("digest")
                    if d is not None and not isinstance(d, str):
                        e["digest"] = (
                            d.trace_value()
                        )  # a value computed late (engine.trace.digest.DigestStamp)
                    dicts.append(e)
            return dicts

    def write(
        self,
        path: str,
        *,
        extra_header: dict | None = None,
        reason: str = "normal",
        end: bool = True,
    ) -> None:
        """The whole trace at once, ended by `trace_end` unless not `end` (a tracer that streams
        has its file already: `close`)."""
        header = {**self.header, **(extra_header or {})}
        # resolved before the file is opened: a failure leaves no partial trace
        events = self.events
        dumps = trace_writer.dumps  # the sink's, so that both ways write the same lines
        lines = [dumps(e) + b"\n" for e in events]
        with open(path, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n")
            f.write(b"".join(lines))
            if end:
                f.write(dumps(self._end(len(events), reason)) + b"\n")

    def _end(self, n: int, reason: str) -> dict:
        thread = threading.current_thread().name
        return (
            {"seq": n + 1, "t_ns": _monotonic_ns(), "thread": thread, "ev": "trace_end"}
            | {"events": n, "reason": reason}
            | self.end_fields
        )

    def stream(
        self,
        path: str,
        *,
        extra_header: dict | None = None,
        flush_ms: float = trace_writer.FLUSH_MS,
        flush_events: int = trace_writer.FLUSH_EVENTS,
        max_pending: int = trace_writer.MAX_PENDING,
    ) -> None:
        """Write the trace to `path` as the run goes on: the header now, the events by a writer
        thread (engine/trace/writer.py), `trace_end` at `close`, which an exit that skips it
        (an uncaught exception, sys.exit) still runs (atexit). Under a schedule controller nothing
        streams: `close` writes the whole file then."""
        self.header.update(extra_header or {})
        self._path = path
        if sync.CONTROLLER is not None:
            return
        with open(path, "wb") as f:  # the header at once: the sink appends the events
            f.write(json.dumps(self.header).encode() + b"\n")
        self._writer = trace_writer.StreamWriter(
            self, path, flush_ms=flush_ms, flush_events=flush_events, max_pending=max_pending
        )
        atexit.register(self.close, "exit")

    @property
    def streaming(self) -> bool:
        return self._writer is not None and self.end_reason is None

    def flush(self) -> None:
        """Write every event logged so far to the file, late digests resolved now."""
        if self.streaming:
            self._writer.sync()

    def close(self, reason: str = "normal") -> None:
        """End a streamed trace: the rest of the events, then `trace_end` with `reason` (normal,
        exception, signal, watchdog, exit). Once: a later call does nothing."""
        self._finish(reason, end=True)

    def cut(self) -> None:
        """End a streamed trace without `trace_end`, as a killed process leaves its file (a role
        that dies inside an embedded PD run): every event logged so far, read as truncated."""
        self._finish("cut", end=False)

    def _finish(self, reason: str, *, end: bool) -> None:
        with self._read_lock:  # the watchdog's thread and the run's end may both close
            if self.end_reason is not None or self._path is None:
                return
            self.end_reason = reason
        atexit.unregister(self.close)
        if self._writer is None:  # under a controller: the file at once
            self.write(self._path, reason=reason, end=end)
            return
        w = self._writer
        w.close(lambda: trace_writer.dumps(self._end(w.written, reason)) + b"\n" if end else b"")

    def obj(self, x) -> str:
        """The trace identity of a Python object: o1, o2, ... in order of first naming, stable within
        a run, so a copy of a request shows up as a new identity; under a schedule controller the
        order is the schedule's, so a replay names alike.
        Emitting the object itself as the `obj` field names it the same way, when the events are
        read. The tracer keeps the object alive, so its id() is never another object's."""
        e = self._names.get(id(x))
        if e is None:
            with self._lock:
                e = self._names.get(id(x))
                if e is None:
                    self._obj_count += 1
                    e = self._names[id(x)] = (x, f"o{self._obj_count}")
        return e[1]

    def of(self, ev: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == ev]


def _arity(kind: _Kind, values: tuple) -> TypeError:
    return TypeError(
        f"event {kind.ev}: {len(values)} values logged for the fields {', '.join(kind.names)}"
    )


class NullTracer(Tracer):
    enabled = False

    def __init__(self, header: dict | None = None, **_):
        super().__init__(header)

    def emit(self, ev: str, **fields) -> None:  # noqa: D401 - deliberately nothing
        sync.point(ev)

    def _logger(self, kind: _Kind):
        ev, n = kind.ev, len(kind.names)

        def log(*values):  # nothing kept; still a schedule point, and checked as the real one
            if len(values) != n:
                raise _arity(kind, values)
            if sync.CONTROLLER is not None or sync.JITTER_US:
                sync.point(ev)

        return log

    def obj(self, x) -> str:
        return ""

    def stream(self, path: str, **_) -> None:  # nothing kept, nothing to write
        pass
