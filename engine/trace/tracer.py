"""The tracer: one JSON object per event, a header first (format: docs/trace-format.md).

Tracing must not distort the overlap it measures: logging an event is one binary record, filled by
the logging thread in a memory-mapped log (engine/trace/recorder.py); a disabled tracer does
nothing. An event's position in the log is its `seq`, the global order of logging; `t_ns`, read
just before the record is written, may trail the previous event's by a thread switch (timelines
use it, the checker orders by `seq`). Hot paths log declared events (`events_for`): field names
given once, values passed positionally, cheaper than `emit`'s keyword dict.

Every event logged is also a schedule point, where a controller (checker/fuzz/) may block the
calling thread to choose which thread runs next.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import types
import weakref

from engine import sync
from engine.sync import hb
from engine.trace.recorder import Recorder, arity_error
from spec import tracelog

FORMAT = "pdo-trace"
VERSION = 4


class Tracer:
    enabled = True
    _thread_name = None  # a thread's name in the trace, read at its first event (None: its own)

    def __init__(self, header: dict | None = None, *, clocks: bool | None = None):
        """`clocks`: whether the events get their `vc` from the hand-offs logged (engine/sync/hb.py);
        None: as hb.ENABLED says (PDO_HB, `pdo run --no-hb`)."""
        self.header = {"format": FORMAT, "version": VERSION, **(header or {})}
        if hb.ENABLED if clocks is None else clocks:
            self.header["hb"] = hb.TAG
        self._rec: Recorder | None = None  # made at the first record, or by `stream`
        self.declared: dict[str, tuple[str, ...]] = {}  # events_for's: ev -> field names
        self._path: str | None = None
        self._lock = threading.Lock()
        self.end_reason: str | None = None  # set once the trace is closed (trace_end written)
        self.end_fields: dict = {}  # extra fields of trace_end: counts known only at the end

    @property
    def rec(self) -> Recorder:
        """The log, started at its first use: the header is its first record."""
        if self._rec is None:
            rec = self._rec = Recorder(self.header, self._thread_name)
            if "hb" in self.header:  # until the trace is closed, or the recorder dropped
                hb.attach(rec.hand_offs)
                weakref.finalize(rec, hb.detach, rec.hand_offs)
        return self._rec

    def emit(self, ev: str, **fields) -> None:
        (self._rec or self.rec).emit(ev, fields)  # a schedule point, as any event's log call

    def events_for(self, **kinds: tuple[str, ...]) -> types.SimpleNamespace:
        """Declared events for a hot path: after `log = tracer.events_for(kv_send=("rid", "obj",
        "tokens", "pages"))`, `log.kv_send(req.rid, req, tokens, pages)` logs what `emit` would."""
        self.declared.update({ev: tuple(names) for ev, names in kinds.items()})
        return types.SimpleNamespace(**{ev: self._logger(ev, tuple(n)) for ev, n in kinds.items()})

    def _logger(self, ev: str, names: tuple[str, ...]):
        """One declared event's log call (engine/trace/recorder.py makes it)."""
        return self.rec.logger(ev, names)

    def _read(self) -> tracelog.LogReader:
        """The log read so far, late digests as they are (nothing before its first record)."""
        if self._rec is None:
            return tracelog.LogReader()
        with self._lock:  # two readers must not both read the same tail
            return self._rec.read()

    @property
    def count(self) -> int:
        return len(self._read().events)

    @property
    def logged(self) -> int:
        """How many records were logged: the watchdog's sign of progress, which reads nothing."""
        return 0 if self._rec is None else self._rec._peek() - 1

    def names_and_fields(self, start: int = 0) -> list[tuple[str, dict]]:
        """(ev, fields) of the events from index `start` on, late digests not computed (a progress
        monitor's: hashing one early would precede the forward's check after its launch)."""
        skip, r = ("seq", "t_ns", "thread", "ev", "vc"), self._read()
        return [
            (e["ev"], {k: r.late(v) if k == "digest" else v for k, v in e.items() if k not in skip})
            for e in r.events[start:]
        ]

    @property
    def events(self) -> list[dict]:
        """Every event so far as a dict (seq, t_ns, thread, ev, its fields), late digests computed
        now. Safe to read while the run goes on."""
        if self._rec is None:
            return []
        with self._lock:
            return self._rec.read().finish(final=False)

    def write(self, path: str, *, extra_header: dict | None = None, reason: str = "normal") -> None:
        """The whole trace at once, ended by `trace_end` (a streamed one: `close`)."""
        rec = self.rec
        if extra_header:
            self.header.update(extra_header)
            rec.set_header(self.header)
        hb.detach(rec.hand_offs)  # ended: later runs' hand-offs are not its own
        rec.write_jsonl(path, reason, self.end_fields)

    def stream(self, path: str, *, extra_header: dict | None = None) -> None:
        """Log into `<path>.pdolog` as the run goes on (under a schedule controller, in memory);
        `close`, run at exit if nothing else does, writes the trace to `path`."""
        self.header.update(extra_header or {})
        if self._rec is not None:  # made before the header was complete: it is logged again
            self._rec.set_header(self.header)
        self._path = path
        if sync.CONTROLLER is not None:
            return
        self.rec.to_file(path)
        atexit.register(self.close, "exit")

    def close(self, reason: str = "normal", *, end: bool = True) -> None:
        """End a streamed trace, once: `trace_end` with `reason` (none if not `end`: read as
        truncated, as a killed process's), then the JSON Lines from the log."""
        with self._lock:  # the watchdog's thread and the run's end may both close
            if self.end_reason is not None or self._path is None:
                return
            self.end_reason = reason
        atexit.unregister(self.close)
        rec = self.rec
        hb.detach(rec.hand_offs)
        rec.write_jsonl(self._path, reason if end else None, self.end_fields)
        rec.remove_file()

    def obj(self, x) -> str:
        """An object's trace identity, as logging it in a field names it: o1, o2, ... in order of
        first naming (a copy of a request is a new one; a replay names alike), the object kept
        alive, so identity is exact."""
        return (self._rec or self.rec).obj(x)


class NullTracer(Tracer):
    enabled = False

    def emit(self, ev: str, **fields) -> None:  # noqa: D401 - deliberately nothing
        sync.point(ev)

    def _logger(self, ev: str, names: tuple[str, ...]):
        n = len(names)

        def log(*values):  # nothing kept; still a schedule point, and checked as the real one
            if len(values) != n:
                raise arity_error(ev, names, values)
            if sync.CONTROLLER is not None or sync.JITTER_US:
                sync.point(ev)

        return log

    def obj(self, x) -> str:
        return ""

    def stream(self, path: str, **_) -> None:  # nothing kept, nothing to write
        pass


def end_reason(exc: BaseException | None) -> str:
    """The `trace_end` reason for an exception on its way out: signal for SIGINT or a signal
    handler's SystemExit, exception for anything else; normal for none."""
    if exc is None:
        return "normal"
    return "signal" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "exception"


@contextlib.contextmanager
def ends_trace(tracer):
    """A streamed trace's `trace_end` on the way out of an exception (a normal end closes it
    itself)."""
    try:
        yield
    except BaseException as exc:
        tracer.close(end_reason(exc))
        raise
