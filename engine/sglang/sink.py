"""Where the adapter's events go: one pdo-trace file per scheduler, written line by line as they happen.

A real SGLang server can die at any moment (that is when its trace matters), so every event is written
and flushed when it is logged, not at exit. The header needs the role, the loop mode and the page size,
which are known only once a scheduler loop starts: events logged before `begin` are held and written
after the header. `seq` is taken under the same lock as the write, so it is the logging order.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time

from engine import sync
from engine.trace.tracer import FORMAT
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
        self._file = None
        self._held: list[str] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._names: dict[int, tuple[object, str]] = {}  # id -> (object kept alive, o1, o2, ...)
        self._scheduler_ident: int | None = None
        self._loop_end: str | None = None  # how the traced scheduler loop ended, once it has
        self._ended = False

    def begin(self, role: str, mode: str, page_size: int, **extra) -> None:
        """Write the header (once); the calling thread is the trace's `scheduler` thread."""
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
            self._file = open(self.path, "w", encoding="utf-8")
            self._file.write(json.dumps(self.header) + "\n")
            for line in self._held:
                self._file.write(line)
            self._held.clear()
            self._file.flush()
        # A server process may exit without closing the sink: its trace still ends, with the
        # reason its loop gave (or `exit`, which reads as truncated: the loop never returned).
        atexit.register(self._at_exit)

    @contextlib.contextmanager
    def ends_with_loop(self):
        """Around the traced scheduler loop: how it ends (returns: `normal`; raises: `exception`, or
        `signal` for KeyboardInterrupt and SystemExit; a harness's LoopExit: `normal`) is the
        reason trace_end gives."""
        try:
            yield
        except LoopExit:
            self._loop_end = "normal"
            raise
        except (KeyboardInterrupt, SystemExit):
            self._loop_end = "signal"
            raise
        except BaseException:
            self._loop_end = "exception"
            raise
        self._loop_end = "normal"

    def _at_exit(self) -> None:
        self.close("exit")

    def _thread(self) -> str:
        if threading.get_ident() == self._scheduler_ident:
            return "scheduler"
        return threading.current_thread().name

    def obj(self, o: object) -> str:
        """The identity name of a Python object (the format's `obj`), stable for the trace's life."""
        entry = self._names.get(id(o))
        if entry is None or entry[0] is not o:
            entry = self._names[id(o)] = (o, f"o{len(self._names) + 1}")
        return entry[1]

    def emit(self, ev: str, **fields) -> None:
        sync.point(ev)
        self._write(ev, fields)

    def _write(self, ev: str, fields: dict) -> None:
        with self._lock:
            self._seq += 1
            line = (
                json.dumps(
                    {
                        "seq": self._seq,
                        "t_ns": time.monotonic_ns(),
                        "thread": self._thread(),
                        "ev": ev,
                        **fields,
                    }
                )
                + "\n"
            )
            if self._file is None:
                self._held.append(line)
                return
            self._file.write(line)
            self._file.flush()

    def close(self, reason: str | None = None) -> None:
        """Write `trace_end` (the loop's reason, else `reason`, else the exception on its way out)
        and close the file."""
        if self._file is not None and not self._ended and self.header["version"] >= 2:
            exc = sys.exc_info()[1]
            fallback = (
                "normal"
                if exc is None
                else "signal"
                if isinstance(exc, (KeyboardInterrupt, SystemExit))
                else "exception"
            )
            end = self._loop_end or reason or fallback
            self._write("trace_end", {"events": self._seq, "reason": end})
            self._ended = True
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        atexit.unregister(self._at_exit)
