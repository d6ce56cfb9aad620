"""What every role of every run shares, written once: its trace (header and stream), its loop's
surroundings (thread name, frozen GC, watchdog, close) and the "die after N KV chunks" fault."""

from __future__ import annotations

import contextlib
import gc
import platform
import threading

from engine.runs.spec import RunSpec
from engine.trace.tracer import NullTracer, Tracer
from engine.trace.watchdog import Watchdog


def role_header(spec: RunSpec, role: str, rank: int | None = None) -> dict:
    """The header fields of one role's trace (docs/trace-format.md): a prefill run's, a PD run's
    prefill rank `rank` (`dp_size`, `dp_rank`) or its decode (role "decode")."""
    cfg = spec.engine
    head = {"role": role, "mode": cfg.mode, "page_size": cfg.page_size, "model": cfg.model}
    head.update(seed=cfg.seed, workload_seed=spec.workload.seed, inject=sorted(cfg.inject))
    if role == "decode":
        dc = spec.decode
        head.update(mode=dc.loop, dp_size=spec.dp, prefill_mode=cfg.mode, prefetch=dc.prefetch)
        head["polling_interval"] = dc.polling_interval
    elif rank is not None:
        head.update(dp_size=spec.dp, dp_rank=rank)
    return head


def open_trace(
    spec: RunSpec, header: dict, path: str | None, *, pd: bool, tracer=None, unrecorded=()
):
    """The role's tracer (`tracer`, its header completed, or a new one: in memory without `path`),
    streaming to `path` with the run's record (RunSpec.to_header) in its header."""
    if tracer is None:
        tracer = Tracer(header) if path else NullTracer(header)
    else:
        tracer.header.update(header)
    if path:
        record = {"host": platform.node(), **spec.to_header(pd=pd, unrecorded=unrecorded)}
        tracer.stream(path, extra_header=record)
    return tracer


@contextlib.contextmanager
def role_loop(spec: RunSpec, sched, tracer, gone: list):
    """Around a role's loop on this thread: the thread named "scheduler" (the trace's thread
    field), the collector frozen (EngineConfig.freeze_gc), the watchdog of `spec` (see
    `watchdog`); after it, the watchdog stopped and `sched` closed. Yields the watchdog (None
    without one)."""
    thread = threading.current_thread()
    name, thread.name = thread.name, "scheduler"
    dog = watchdog(spec, tracer, sched, gone)
    try:
        with frozen_gc(spec.engine.freeze_gc):
            yield dog
    finally:
        thread.name = name
        if dog is not None:
            dog.stop()
        sched.close()


def watchdog(spec: RunSpec, tracer, sched, gone: list, *, exit=None) -> Watchdog | None:
    """The watchdog of `spec` on `tracer`, or None: none asked, or no trace to watch. It waits
    for work `sched` owes: requests neither done nor `gone` (a prefill's yet to arrive, a
    decode's aborted)."""
    if spec.watchdog is None or not tracer.enabled:
        return None
    w, kw = spec.watchdog, {"exit": exit} if exit else {}
    pending = lambda: sched.total - len(sched.done) - len(gone)  # noqa: E731
    return Watchdog(tracer, pending, seconds=w.seconds, on_stall=w.on_stall, **kw)


def die_after(server, chunks: int, die) -> None:
    """Make the KV server `server` call `die()` once it has delivered `chunks` chunks (a prefill
    rank killed by `--kill prefill<i>@N`)."""
    deliver, sent = server.deliver, [0]

    def deliver_then_die(chunk):
        deliver(chunk)
        sent[0] += 1
        if sent[0] == chunks:
            die()

    server.deliver = deliver_then_die


@contextlib.contextmanager
def frozen_gc(on: bool = True):
    """Everything alive now goes to the collector's permanent generation for the duration (see
    EngineConfig.freeze_gc), and back after: what the run leaves behind is collected as usual. A
    process that froze objects itself keeps its freeze (nothing is frozen or unfrozen then)."""
    if not on or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
