"""Where the adapter's events go: one pdo-trace per scheduler, logged by the flight recorder
(engine/trace/recorder.py) as they happen.

A real SGLang server can die at any moment (that is when its trace matters): each event is one
record of the recorder's memory-mapped log (`<trace>.pdolog`) as soon as it is logged, which a
SIGKILL leaves whole; the JSON Lines are made from the log when the sink closes, or by `pdo check`
from the log alone. The header needs the role, the loop mode and the page size, known only once a
scheduler loop starts: the log is in memory until `begin`, which logs the header and moves the log
to its file. SGLang's threads hand work over with its own primitives, not engine/sync/__init__.py's,
so no happens-before edge is logged and the header has no `hb`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

from engine.trace.recorder import Recorder
from engine.trace.tracer import FORMAT, end_reason
from spec import tracelog
from spec.errors import ControlFlow

# Version 2: the adapter logs kv_delivered (a sender's poll() answering Success), and every trace
# ends with trace_end. It logs none of version 3's stream events (SGLang's streams are CUDA streams,
# whose order the host cannot see), so it declares the version whose events it writes.
VERSION = 2
# Whether the prefill hooks observe the senders' polls (prefill.install sets it where SGLang has the
# function they wrap). Without it a prefill trace would carry no kv_delivered, and version 2 would
# make P-release-after-delivery report every release: such a trace declares version 1, as before.
COMPLETIONS_OBSERVED = [False]


class LoopExit(ControlFlow):
    """Raised by a harness to leave a scheduler loop that has no exit of its own (before 0.5.21
    SGLang's loops never return; from 0.5.21 they return once `gracefully_exit` is set): the loop
    ends where a later release's would return, so its trace ends `normal`, as that release's does."""


class TraceSink:
    def __init__(self, path: str):
        self.path = path
        self.header: dict | None = None
        self._rec = Recorder({"format": FORMAT}, thread_name=self._thread)
        self._lock = threading.Lock()
        self._scheduler_ident: int | None = None
        self._loop_end: str | None = None  # how the traced scheduler loop ended, once it has
        self._ended = False

    def begin(self, role: str, mode: str, page_size: int, **extra) -> None:
        """Log the header (once) and keep the log in its file; the calling thread is the trace's
        `scheduler` thread."""
        with self._lock:
            self._scheduler_ident = threading.get_ident()
            if self.header is not None:
                return
            self.header = {
                "format": FORMAT,
                "version": 1 if role == "prefill" and not COMPLETIONS_OBSERVED[0] else VERSION,
                "role": role,
                "mode": mode,
                "page_size": page_size,
                **extra,
            }
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # an earlier server's trace
                os.remove(self.path)
            self._rec.set_header(self.header)
            self._rec.to_file(self.path + tracelog.SUFFIX)
        # A server process may exit without closing the sink: its trace still ends, with the
        # reason its loop gave (or `exit`, which reads as truncated: the loop never returned).
        atexit.register(self.close, "exit")

    @contextlib.contextmanager
    def ends_with_loop(self):
        """Around the traced scheduler loop: how it ends (returns, or a harness's LoopExit:
        `normal`; raises: `end_reason`) is the reason trace_end gives."""
        try:
            yield
        except BaseException as exc:
            self._loop_end = "normal" if isinstance(exc, LoopExit) else end_reason(exc)
            raise
        self._loop_end = "normal"

    def _thread(self) -> str:
        if threading.get_ident() == self._scheduler_ident:
            return "scheduler"
        return threading.current_thread().name

    def obj(self, o: object) -> str:
        """The identity name of a Python object (the format's `obj`), stable for the trace's life."""
        return self._rec.obj(o)

    def emit(self, ev: str, **fields) -> None:
        self._rec.emit(ev, fields)  # a schedule point, as any event's log call

    def close(self, reason: str | None = None) -> None:
        """Log the end (the loop's reason, else `reason`, else the exception on its way out) and
        write the trace's JSON Lines; a version 1 trace has no trace_end."""
        with self._lock:
            if self.header is None or self._ended:
                return
            self._ended = True
        if self.header["version"] >= 2:
            self._rec.end(self._loop_end or reason or end_reason(sys.exc_info()[1]), {})
        self._rec.write_jsonl(self.path)
        self._rec.remove_file()
        atexit.unregister(self.close)
