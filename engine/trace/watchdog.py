"""The watchdog: a run that logs nothing for a while with requests still pending is stuck (a lost
wakeup, a deadlock, a device that never answers). It logs a `stall` event naming each thread's
state and the innermost frames of its stack, so that the trace says where every thread was, then
lets the run go on (`continue`) or ends it (`stop`: the trace is closed with reason `watchdog` and
the process exits with FAILED — a hung thread may never return, so nothing short of an exit is
sure to end the run).

It reads the wall clock, so it is off under a schedule controller (virtual time: engine/sync/__init__.py),
and it is a plain thread, outside the controller's threads.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from engine import sync

FRAMES = 6  # innermost frames kept per thread: the line stays bounded
FAILED = 1  # engine/cli/exits.py FAILED (the engine core does not import the CLI)


def stacks(frames: int = FRAMES) -> dict:
    """thread name -> {"state", "frames": ["file:line function", ...] innermost last}."""
    current = sys._current_frames()
    out = {}
    for t in threading.enumerate():
        frame = current.get(t.ident)
        summary = traceback.extract_stack(frame, limit=None)[-frames:] if frame else []
        state = "alive" if t.is_alive() else "ended"
        if t.daemon:
            state += ", daemon"
        out[t.name] = {
            "state": state,
            "frames": [f"{os.path.basename(s.filename)}:{s.lineno} {s.name}" for s in summary],
        }
    return out


class Watchdog:
    def __init__(
        self,
        tracer,
        pending,
        *,
        seconds: float,
        on_stall: str = "continue",
        frames: int = FRAMES,
        exit=os._exit,
    ):
        if seconds <= 0 or on_stall not in ("continue", "stop"):
            raise ValueError("watchdog: seconds > 0 and on_stall continue or stop expected")
        self.tr, self.pending, self.seconds, self.on_stall = tracer, pending, seconds, on_stall
        self.frames, self._exit = frames, exit
        self.fired = 0
        self.reason = "watchdog"
        self._stop = threading.Event()
        self.thread = None
        if sync.CONTROLLER is None:
            self.thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        seen, since = self.tr.logged, time.monotonic()
        tick = min(self.seconds / 4, 0.25)
        while not self._stop.wait(tick):
            n, now = self.tr.logged, time.monotonic()
            if n != seen:
                seen, since = n, now
                continue
            waiting = self.pending()
            if now - since < self.seconds or waiting <= 0:
                continue
            self.fired += 1
            self.tr.emit(
                "stall",
                idle_ms=int((now - since) * 1e3),
                pending=waiting,
                stacks=stacks(self.frames),
            )
            seen, since = self.tr.logged, time.monotonic()
            if self.on_stall == "stop":
                print(
                    f"pdo: watchdog: no event for {self.seconds:g} s with {waiting} request(s) "
                    "pending; stopping (the trace has a stall event with every thread's stack)",
                    file=sys.stderr,
                )
                self.tr.close("watchdog")
                self._exit(FAILED)
                return

    def stop(self) -> None:
        self._stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(1.0)
