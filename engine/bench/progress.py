"""Progress of long benchmark runs on stderr: only when stderr is a TTY, or when forced
(--progress). Within a run, a monitor thread reads the run's trace events every `period` seconds
(requests released = done; KV-send tokens = uncached tokens prefilled): nothing is added to the
engine."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    def __init__(self, enabled: bool | None = None, period: float = 0.5, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.enabled = self.tty if enabled is None else enabled
        self.period = period if self.tty else max(period, 2.0)

    def line(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\r\033[K" if self.tty else "") + text + ("" if self.tty else "\n"))
            self.stream.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def watch(self, label: str, tracer, total: int):
        """Context manager: report `label: done/total requests, tok/s` while the run goes on."""
        return _Watch(self, label, tracer, total)


class _Watch:
    def __init__(self, progress: Progress, label: str, tracer, total: int):
        self.progress, self.label, self.tracer, self.total = progress, label, tracer, total
        self.stop = threading.Event()
        self.thread = None

    def __enter__(self):
        if self.progress.enabled and getattr(self.tracer, "enabled", False):
            self.thread = threading.Thread(target=self._run, name="bench-progress", daemon=True)
            self.thread.start()
        return self

    def _run(self):
        t0 = time.perf_counter()
        seen = released = tokens = 0
        while not self.stop.wait(self.progress.period):
            new = self.tracer.names_and_fields(seen)  # not `events`: it would hash pending digests
            seen += len(new)
            for ev, fields in new:
                if ev == "release":
                    released += 1
                elif ev == "kv_send":
                    tokens += fields.get("tokens", 0)
            elapsed = time.perf_counter() - t0
            self.progress.line(
                f"{self.label}: {released}/{self.total} requests, "
                f"{tokens / elapsed:,.0f} uncached tok/s"
            )

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
