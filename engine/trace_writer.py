"""The flight recorder: a trace streamed to its file while the run goes on (docs/trace-format.md,
"Truncated traces").

The engine's threads only append to the tracer's in-memory list (engine/trace.py); a writer thread
drains what was added since its last pass into JSON lines and flushes, every `flush_ms`, or sooner
once `flush_events` events wait. A thread that logs while `max_pending` events wait blocks until the
writer has caught up: nothing is ever dropped. After an exception or a signal the run's end writes
what is left and a final `trace_end` event; after SIGKILL the file holds every event up to the last
flush, and its last line may be cut (the checker reads such a file as truncated).

A line once written is never rewritten, so a digest computed late (engine.digest.DigestStamp) is
waited for: the writer stops at the first event whose stamp is not resolved yet (the worker resolves
it once the forward is launched) and takes it up on a later pass. A stamp left pending for
`stamp_wait_s` (a hang), or while the buffer is full, is resolved by the writer itself, as a reader of
the trace would (DigestStamp.trace_value).

The writer is a plain thread, not one of engine/sync.py's: it logs nothing and is no schedule point.
A tracer under a schedule controller does not stream at all (the fuzz harness writes its traces when
the run is over, engine/trace.py `write`), so a schedule's steps do not depend on the writer's pace.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

try:
    from orjson import dumps as _orjson_dumps
except ImportError:  # orjson is a declared dependency; the standard library still works without it
    _orjson_dumps = None

FLUSH_MS = 50
FLUSH_EVENTS = 4096
MAX_PENDING = 1 << 16
STAMP_WAIT_S = 1.0


def dumps(e: dict) -> bytes:
    if _orjson_dumps is not None:
        try:
            return _orjson_dumps(e)
        except TypeError:  # a value orjson does not take (an int over 64 bits): the reference path
            pass
    return json.dumps(e, separators=(",", ":")).encode()


def pending(d) -> bool:
    """A late digest (DigestStamp) not resolved yet by the thread whose job that is."""
    return getattr(d, "batch", None) is not None


class StreamWriter:
    """Writes tracer events [written, count) to `f` on its own thread; `close` writes the rest."""

    def __init__(
        self,
        tracer,
        f,
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
        self.tr, self.f = tracer, f
        self.flush_s, self.flush_events, self.max_pending = (
            flush_ms / 1e3,
            flush_events,
            max_pending,
        )
        self.stamp_wait_s = stamp_wait_s
        self.written = 0  # events written (and flushed)
        self.flushes = 0
        self._wait_since: float | None = None  # when the writer first stopped at a pending stamp
        self._wake = threading.Event()
        self._drained = threading.Condition()
        self._stop = False
        self._io = threading.Lock()  # one drain at a time: the writer's, or close's
        self._gate()
        self.thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self.thread.start()

    def _gate(self) -> None:
        """Where the next logged event calls `full` (engine/trace.py's hot-path check)."""
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
        """Write what was logged up to now (up to a pending stamp unless `force`), and flush."""
        with self._io:
            tr = self.tr
            n = tr.count
            start = self.written
            if n > start:
                force = force or n - start >= self.max_pending
                lines, stop_at = tr._lines(start, n, force=force)
                if stop_at < n and not force:
                    now = time.monotonic()
                    if self._wait_since is None:
                        self._wait_since = now
                    elif now - self._wait_since >= self.stamp_wait_s:
                        more, stop_at = tr._lines(stop_at, n, force=True)
                        lines += more
                else:
                    self._wait_since = None
                if lines:
                    self.f.write(b"".join(lines))
                    self.f.flush()
                    self.flushes += 1
                self.written = stop_at
            self._gate()
        with self._drained:
            self._drained.notify_all()
        return self.written

    def close(self) -> None:
        """Stop the thread and write everything that is left (stamps resolved now)."""
        self._stop = True
        self._wake.set()
        if self.thread is not threading.current_thread():
            self.thread.join(5.0)
        self.drain(force=True)
        self.tr._gate[0] = _NEVER


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
