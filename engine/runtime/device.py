"""Streams and events with CUDA semantics, on CUDA and on CPU.

On CUDA these wrap `torch.cuda.Stream` / `torch.cuda.Event`: `launch(fn)` runs `fn` on the host with
the stream current, so the kernels it enqueues run asynchronously on that stream.

On CPU there is no device queue, so each stream is an in-order executor thread: `launch(fn)` enqueues
`fn` and returns at once, and `fn` (torch ops, which release the GIL) runs later on the stream thread.
Events are recorded into a stream's queue and complete when the stream reaches them; another stream
can be made to wait for an event (its queue blocks there), and the host can query or synchronize.
This reproduces what the overlap optimizations depend on: asynchronous submission, deferred
completion, cross-stream dependencies, and the write-after-read hazard when a barrier is missing.
"""

from __future__ import annotations

import collections
import os
import threading

import torch

from engine import sync
from engine.sync import hb

# Intra-op threads of each CPU stream thread (torch.set_num_threads is per thread with OpenMP). The
# emulated device's ops are tiny (<= 256 rows; attention per request), and with 2 OpenMP threads
# every parallel region waits for a second core that is busy with the scheduler, the worker or other
# streams, which on a machine with few cores makes even a small matmul many times slower. One
# thread per stream, as engine/oracle/reference.py and `pdo launch` roles already do. PDO_DEVICE_THREADS=N
# overrides (0: leave torch's default).
DEVICE_THREADS = int(os.environ.get("PDO_DEVICE_THREADS", "1") or 0)


class CpuEvent:
    """Recorded once, on `stream`, when made: it completes when the stream gets there. A thread
    that sees it complete (`query`, `synchronize`) receives its completion's hand-off the first
    time only: there is one send to receive (the stream's set), so a second receive adds no order."""

    def __init__(self, stream: "CpuStream"):
        self._done = threading.Event()
        self._received = None  # the last thread that received the completion
        stream._put(self)  # the stream sets it when it gets there

    def query(self) -> bool:
        if not self._done.is_set():
            return False
        if hb.ON and self._received != threading.get_ident():
            self._received = threading.get_ident()
            hb.recv(self._done)
        return True

    def synchronize(self) -> None:
        if self._received != threading.get_ident():
            sync.ev_wait(self._done, "event.synchronize")
            self._received = threading.get_ident()


class _Wait:
    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event


class CpuStream:
    """An in-order queue of host callables, executed by one thread named `stream:<name>`."""

    # A callable it runs is in the stream's order, so an event it logs marks where the stream's
    # work has got to (a CUDA stream runs the callable on the launching host thread instead).
    host_ordered = True

    def __init__(self, name: str, on_error=None):
        self.name = name
        self._q = sync.Inbox()
        self._error: BaseException | None = None
        self._thread = sync.start_thread(self._run, f"stream:{name}")

    def _run(self):
        if DEVICE_THREADS > 0:
            torch.set_num_threads(DEVICE_THREADS)
        while True:
            item = self._q.get("stream.idle")
            if item is None:
                return
            if isinstance(item, CpuEvent):
                sync.ev_set(item._done)  # events complete even after a failure, so no waiter hangs
            elif isinstance(item, _Wait):
                sync.ev_wait(item.event._done, "stream.wait_event")
            elif self._error is None:
                sync.point("stream.task")
                try:
                    item()
                except BaseException as exc:  # surfaced on the host at the next check()
                    self._error = exc

    def _put(self, item) -> None:
        self._q.put(item)  # what the launching thread did happens before the stream runs the item

    def launch(self, fn, *args) -> None:
        self._put((lambda: fn(*args)) if args else fn)

    def wait_event(self, event: CpuEvent) -> None:
        self._put(_Wait(event))

    def record_event(self) -> CpuEvent:
        return CpuEvent(self)

    def synchronize(self) -> None:
        self.record_event().synchronize()
        self.check()

    def check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"stream {self.name} failed: {self._error!r}") from self._error

    def close(self) -> None:
        self._put(None)
        if not sync.controlled():
            self._thread.join(timeout=10)


class CudaEvent:
    """A torch.cuda.Event with the CPU event's happens-before edges (engine/sync/hb.py), which on CUDA no
    stream thread carries: it completes after everything launched on its stream before it was
    recorded (by any host thread, and what that stream waited for), so a host thread that sees it
    complete (`query`, `synchronize`) is ordered after all of it."""

    def __init__(self, stream: "CudaStream"):
        self.ev = torch.cuda.Event()
        self.ev.record(stream.s)
        if hb.ON:
            hb.relay(stream, self)
            hb.send(self)

    def query(self) -> bool:
        done = self.ev.query()
        if done and hb.ON:
            hb.recv(self)
        return done

    def synchronize(self) -> None:
        self.ev.synchronize()
        if hb.ON:
            hb.recv(self)


class CudaStream:
    """A CUDA stream with the CPU stream's contract: what `fn` was given is safe to use until the
    stream has run it. Two things make that so on CUDA:

    - The stream first waits for the launching thread's current stream: inputs that thread just
      prepared there (a `.to(device)`, a write into req_to_token) are ready before `fn`'s kernels read
      them. (A CPU stream runs `fn` after everything the host did before `launch`.)
    - `fn` and its arguments are kept until an event recorded after them has completed. Tensors `fn`
      captured were allocated on another stream; dropped when `launch` returns, their memory could go
      to the next allocation there while this stream's kernels still read it (what
      `Tensor.record_stream` prevents, here for everything `fn` holds)."""

    host_ordered = False  # what `launch` runs, runs now on the host: not in the stream's order

    def __init__(self, name: str, device, on_error=None):
        self.name = name
        self.s = torch.cuda.Stream(device=device)
        self._alive: collections.deque = collections.deque()  # (event, fn, args), oldest first
        self._lock = threading.Lock()  # the worker and the scheduler both launch on some streams

    def launch(self, fn, *args) -> None:
        if (
            hb.ON
        ):  # the stream's later work, and events recorded after it, follow this thread's past
            hb.send(self)
        self.s.wait_stream(torch.cuda.current_stream(self.s.device))
        with torch.cuda.stream(self.s):
            fn(*args)
        ev = torch.cuda.Event()
        with self._lock:
            ev.record(self.s)
            self._prune()
            self._alive.append((ev, fn, args))

    def _prune(self) -> None:
        """Drop what the stream has run past (the lock held)."""
        alive = self._alive
        while alive and alive[0][0].query():
            alive.popleft()

    def wait_event(self, event: CudaEvent) -> None:
        self.s.wait_event(event.ev)
        if hb.ON:
            hb.relay(event, self)

    def record_event(self) -> CudaEvent:
        return CudaEvent(self)

    def synchronize(self) -> None:
        self.s.synchronize()
        with self._lock:
            self._prune()

    def check(self) -> None:
        return None

    def close(self) -> None:
        self.synchronize()


def then_log(fn, log, *values):
    """`fn`, then `log(*values)`: launched on a host-ordered stream, the event marks that the
    stream has run `fn`."""

    def task():
        fn()
        log(*values)

    return task


def make_stream(name: str, device: torch.device):
    if device.type == "cuda":
        return CudaStream(name, device)
    return CpuStream(name)
