"""Where the adapter's events go: one pdo-trace per scheduler, logged by the flight recorder
(engine/trace/recorder.py) as they happen, so a SIGKILL leaves its log (`<trace>.pdolog`) whole
for `pdo check`. The header needs the role, loop mode and page size, known once a scheduler loop
starts: the log is in memory until `begin` logs the header and moves it to its file.

The hand-offs (engine/sync/hb.py) are logged unless PDO_HB=0: the adapter logs the prefetch
executor's (engine/sglang/decode.py), so `pdo check --predict` reads these traces too.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

from engine.trace.tracer import FORMAT, Tracer, end_reason
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


class TraceSink(Tracer):
    def __init__(self, path: str):
        super().__init__()
        self._hb = {"hb": self.header["hb"]} if "hb" in self.header else {}  # hb.ENABLED
        self.header = {"format": FORMAT, **self._hb}  # until `begin`
        self.path = path
        self._scheduler_ident: int | None = None
        self._loop_end: str | None = None  # how the traced scheduler loop ended, once it has

    def begin(self, role: str, mode: str, page_size: int, **extra) -> None:
        """Log the header (once) and keep the log in its file; the calling thread is the trace's
        `scheduler` thread."""
        with self._lock:
            self._scheduler_ident = threading.get_ident()
            if self._path is not None:
                return
            self.header = {
                "format": FORMAT,
                "version": 1 if role == "prefill" and not COMPLETIONS_OBSERVED[0] else VERSION,
                "role": role,
                "mode": mode,
                "page_size": page_size,
                **self._hb,
                **extra,
            }
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self.rec.set_header(self.header)
            self.rec.to_file(self.path)
            self._path = self.path
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

    def _thread_name(self) -> str:
        if threading.get_ident() == self._scheduler_ident:
            return "scheduler"
        return threading.current_thread().name

    def close(self, reason: str | None = None, *, end: bool = True) -> None:
        """Log the end (the loop's reason, else `reason`, else the exception on its way out) and
        write the trace's JSON Lines; a version 1 trace has no trace_end."""
        reason = self._loop_end or reason or end_reason(sys.exc_info()[1])
        super().close(reason, end=end and self.header.get("version", 1) >= 2)
