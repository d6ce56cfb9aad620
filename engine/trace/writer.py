"""The flight recorder: a trace streamed to its file while the run goes on (docs/trace-format.md,
"Truncated traces").

The engine's threads only append to the tracer's in-memory list (engine/trace/tracer.py); a writer thread
hands what was added since its last pass to the trace sink (engine/trace/sink.py), a helper process
that formats the lines and writes them, every `flush_ms`, or sooner once `flush_events` events wait.
The writer's share is one pickle per pass, in C, where the line building it spares the engine's
threads would hold their GIL; one pickler writes a stream's passes, so that what its memo holds
(kinds, threads' names, identities) is reduced once, not at every pass. A thread that logs while
`max_pending` events wait blocks until the writer has caught up: nothing is ever dropped. After an exception or a signal the run's end writes
what is left and a final `trace_end` event; after SIGKILL the file holds every event handed to the
sink, up to the writer's last pass, and its last line may be cut (the checker reads such a file as
truncated).

A line once written is never rewritten, so a digest computed late (engine.trace.digest.DigestStamp) is
waited for: the writer stops at the first event whose stamp is not resolved yet (the worker resolves
it once the forward is launched) and takes it up on a later pass. A stamp left pending for
`stamp_wait_s` (a hang), or while the buffer is full, is resolved by the writer itself, as a reader of
the trace would (DigestStamp.trace_value). Objects are named (Tracer.obj) as the pickle meets them,
in the events' order, as the whole-trace writer names them.

The writer is a plain thread, not one of engine/sync/__init__.py's: it logs nothing and is no schedule point.
A tracer under a schedule controller does not stream at all (the fuzz harness writes its traces when
the run is over, engine/trace/tracer.py `write`), so a schedule's steps do not depend on the writer's pace.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import io
import itertools
import os
import pickle
import subprocess
import sys
import threading
import time
import types

from engine.trace import sink as trace_sink
from spec.errors import InternalError

FLUSH_MS = 50
FLUSH_EVENTS = 4096
MAX_PENDING = 1 << 16
STAMP_WAIT_S = 1.0
MEMO_EVENTS = 1 << 14  # events pickled with one memo: it keeps the sink's memo this small

dumps = trace_sink.dumps


class SinkError(InternalError, RuntimeError):
    """The trace sink failed: an internal error (its message says so)."""


def pending(d) -> bool:
    """A late digest (DigestStamp) not resolved yet by the thread whose job that is."""
    return getattr(d, "batch", None) is not None


class _Sink:
    """This process's trace sink (engine/trace/sink.py), shared by every trace it streams."""

    def __init__(self):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from engine.trace.sink import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self.pid = os.getpid()
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        atexit.register(self.shutdown)  # before the tracers' own: it runs after theirs

    def shutdown(self) -> None:
        """At exit: end the sink's input and let it finish the files it holds."""
        if self.pid != os.getpid():
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass

    @property
    def alive(self) -> bool:
        return self.pid == os.getpid() and self.proc.poll() is None

    def send(self, op: int, sid: int, payload: bytes = b"") -> None:
        with self.lock:
            self._send(op, sid, payload)

    def ask(self, op: int, sid: int, payload: bytes = b"") -> str:
        """Send, wait for the sink's acknowledgement, and return its error message ('' if none)."""
        with self.lock:  # acknowledgements come back in the order asked
            self._send(op, sid, payload)
            head = self.proc.stdout.read(trace_sink.ACK.size)
            if len(head) < trace_sink.ACK.size:
                raise self._gone()
            got, n = trace_sink.ACK.unpack(head)
            if got != sid:
                raise SinkError(f"internal error: the trace sink answered for {got}, not {sid}")
            return self.proc.stdout.read(n).decode()

    def _send(self, op: int, sid: int, payload: bytes) -> None:
        try:
            self.proc.stdin.write(trace_sink.HEAD.pack(op, sid, len(payload)) + payload)
            self.proc.stdin.flush()
        except (OSError, ValueError) as err:
            raise self._gone() from err

    def _gone(self) -> SinkError:
        return SinkError(
            f"internal error: the trace sink (pid {self.proc.pid}) has gone, "
            f"exit status {self.proc.poll()}"
        )


_SINK: _Sink | None = None
_SINK_LOCK = threading.Lock()


def sink() -> _Sink:
    """The process's sink, started at its first use (and again in a forked child, or if it died)."""
    global _SINK
    with _SINK_LOCK:
        if _SINK is None or not _SINK.alive:
            _SINK = _Sink()
        return _SINK


class _Pickler(pickle.Pickler):
    """The events as the sink reads them: a declared event's kind as (ev, field names), an object
    as its identity, a late digest as its value; the rest as it is (subclasses as their base)."""

    _how: dict = {}  # class -> what becomes of its instances, decided once per class

    def __init__(self, buf, tracer):
        super().__init__(buf, protocol=5)
        self.name, self.kind = tracer.obj, tracer.kind_class

    def reducer_override(self, o):
        c = o.__class__
        how = self._how.get(c)
        if how is None:
            how = self._how[c] = self._classify(c)
        if how == "kind":
            return tuple, ((o.ev, o.names),)
        if how == "ident":
            return trace_sink.Ident, (self.name(o),)
        if how == "digest":
            return str, (o.trace_value(),)
        if how is None:
            return NotImplemented
        return how(o)  # a subclass of a JSON type, or an enum: what it is written as

    def _classify(self, c: type):
        if c is self.kind:
            return "kind"
        if issubclass(c, type) or c in (types.FunctionType, types.BuiltinFunctionType):
            return None  # a class or function a reduction names: pickled by reference
        if hasattr(c, "trace_value"):
            return "digest"
        if issubclass(c, enum.Enum):  # as orjson writes one: its value
            return lambda o: (trace_sink.value, (o.value,))
        for base, rebuilt, plain in _PLAIN:
            if issubclass(c, base):
                return lambda o, rebuilt=rebuilt, plain=plain: (rebuilt, (plain(o),))
        return "ident"


# subclasses of JSON's types: (subclass of, sent as, converted by), as orjson writes them
_PLAIN = (
    (str, str, str.__str__),
    (int, int, int),
    (float, float, float),
    (dict, dict, dict),
    (list, list, list),
    (tuple, list, list),
)


class StreamWriter:
    """Hands tracer events [written, count) to the sink for `path` on its own thread; `close`
    hands over the rest and the `trace_end` line."""

    def __init__(
        self,
        tracer,
        path: str,
        *,
        flush_ms: float = FLUSH_MS,
        flush_events: int = FLUSH_EVENTS,
        max_pending: int = MAX_PENDING,
        stamp_wait_s: float = STAMP_WAIT_S,
    ):
        if flush_ms <= 0 or flush_events < 1 or max_pending < flush_events:
            raise ValueError(
                "trace streaming: flush_ms > 0 and 1 <= flush_events <= max_pending expected"
            )
        self.tr, self.path = tracer, path
        self.flush_s, self.flush_events, self.max_pending = (
            flush_ms / 1e3,
            flush_events,
            max_pending,
        )
        self.stamp_wait_s = stamp_wait_s
        self.written = 0  # events handed to the sink
        self._digest_at: dict = {}  # kind -> index of its digest field, "digest" (a dict), None
        self._has_digest: set = set()  # the kinds whose index is not None
        self._wait_since: float | None = None  # when the writer first stopped at a pending stamp
        self._wake = threading.Event()
        self._drained = threading.Condition()
        self._stop = False
        self._io = threading.Lock()  # one drain at a time: the writer's, or close's
        self._buf = io.BytesIO()
        self._pickler: _Pickler | None = None
        self._memo_left = 0  # events the pickler's memo may still take
        self.sink = sink()
        self.sid = next(self.sink.ids)
        self.sink.send(trace_sink.OPEN, self.sid, os.fsencode(path))
        self._gate()
        self.thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self.thread.start()

    def _gate(self) -> None:
        """Where the next logged event calls `full` (engine/trace/tracer.py's hot-path check)."""
        self.tr._gate[0] = 4 * (self.written + self.flush_events)

    def full(self) -> None:
        """Called by a logging thread once `flush_events` wait: wake the writer; past `max_pending`,
        wait until it has written some."""
        self._wake.set()
        if self.tr.count - self.written < self.max_pending or self._stop:
            return
        with self._drained:
            while self.tr.count - self.written >= self.max_pending and not self._stop:
                self._wake.set()
                self._drained.wait(self.flush_s)

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            if self._stop:
                return
            self.drain(force=False)

    def drain(self, *, force: bool) -> int:
        """Hand over what was logged up to now (up to a pending stamp unless `force`)."""
        with self._io:
            n = self.tr.count
            start = self.written
            if n > start:
                force = force or n - start >= self.max_pending
                part = self.tr._raw[4 * start : 4 * n]
                stop = n if force else start + self._cut(part)
                if stop < n and not force:
                    now = time.monotonic()
                    if self._wait_since is None:
                        self._wait_since = now
                    elif now - self._wait_since >= self.stamp_wait_s:
                        stop = n
                else:
                    self._wait_since = None
                if stop > start:
                    self._send(start, part if stop == n else part[: 4 * (stop - start)])
                self.written = stop
            self._gate()
        with self._drained:
            self._drained.notify_all()
        return self.written

    def _send(self, start: int, events: list) -> None:
        op = trace_sink.EVENTS
        if self._memo_left <= 0:
            self._pickler, self._memo_left = _Pickler(self._buf, self.tr), MEMO_EVENTS
            op = trace_sink.EVENTS_NEW
        self._memo_left -= len(events) // 4
        try:
            self._pickler.dump((start + 1, events))
            payload = self._buf.getvalue()
        except BaseException:  # a memo the sink will not see: the next pass starts a new one
            self._memo_left = 0
            raise
        finally:
            self._buf.seek(0)
            self._buf.truncate()
        self.sink.send(op, self.sid, payload)

    def _cut(self, part: list) -> int:
        """How many of the events in `part` (a slice of the tracer's list) come before the first
        whose digest is still to be computed by its own thread. Only the kinds that carry a digest
        are looked at, found by a set lookup per event (most events have none)."""
        kinds = part[2::4]
        at, has = self._digest_at, self._has_digest
        for kind in set(kinds).difference(at):
            if kind.__class__ is str:  # Tracer.emit: its fields are a dict, "digest" maybe in it
                at[kind] = "digest"
            else:
                at[kind] = kind.names.index("digest") if "digest" in kind.names else None
            if at[kind] is not None:
                has.add(kind)
        for i in itertools.compress(range(len(kinds)), map(has.__contains__, kinds)):
            values = part[4 * i + 3]
            j = at[kinds[i]]
            d = values.get(j) if j == "digest" else values[j]
            if d is not None and pending(d):
                return i
        return len(kinds)

    def sync(self) -> None:
        """Hand over everything and wait until the sink has written it."""
        self.drain(force=True)
        self._check(self.sink.ask(trace_sink.SYNC, self.sid))

    def close(self, end) -> None:
        """Stop the thread, hand over everything that is left (stamps resolved now), then the
        `trace_end` line (`end()`, made once the rest is counted), and wait until the file is
        whole."""
        self._stop = True
        self._wake.set()
        if self.thread is not threading.current_thread():
            self.thread.join(5.0)
        try:
            self.drain(force=True)
            self._check(self.sink.ask(trace_sink.END, self.sid, end()))
        finally:
            self.tr._gate[0] = _NEVER

    def _check(self, error: str) -> None:
        if error:
            raise SinkError(f"internal error: trace {self.path}: {error}")


_NEVER = 1 << 62


@contextlib.contextmanager
def ends_trace(tracer):
    """A streamed trace's `trace_end` on the way out of an exception: reason signal for SIGINT or
    a signal handler's SystemExit, exception for anything else (a normal end closes it itself)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        tracer.close("signal")
        raise
    except BaseException:
        tracer.close("exception")
        raise
