"""Run the prefill engine once: build the scheduler, run the chosen loop, return its result."""

from __future__ import annotations

import contextlib
import gc
import platform
import threading
import time
from dataclasses import asdict, dataclass

import torch

from engine.oracle import judge as oracle
from engine.prefill.loops import LOOPS
from engine.prefill.scheduler import PrefillScheduler
from engine.runs.workload import WorkloadConfig, make_workload
from engine.runtime.config import EngineConfig, check_dispatch
from engine.runtime.model import TinyLlama, default_forward_impl
from engine.runtime.request import Req
from engine.trace.tracer import NullTracer, Tracer
from engine.trace.watchdog import Watchdog


@dataclass
class PrefillResult:
    """A prefill run: `summary`, the report `pdo run` prints (JSON-able: counts, times, leaks,
    memory, the verdict on the outputs); the scheduler and the requests, for a caller that looks
    inside; `error`, the exception that ended the run, when the run was asked to keep it."""

    summary: dict
    scheduler: PrefillScheduler
    requests: list[Req]
    error: Exception | None = None


def run_prefill(
    cfg: EngineConfig,
    wc: WorkloadConfig,
    *,
    trace_path: str | None = None,
    tracer=None,
    keep_error: bool = False,
    model=None,
    verify: bool = False,
    watchdog: dict | None = None,
    flush_ms: float | None = None,
) -> PrefillResult:
    """An exception that ends the run is raised, or with `keep_error` kept in the result. `model`: weights to reuse (`shared_model`), else built from cfg's preset and seed. `verify`:
    judge every output against the reference (engine/oracle/judge.py) after the run, into
    summary["verify"]. With `trace_path` the trace streams to its file as the run goes on and ends
    with `trace_end` whatever ends the run (engine/trace/writer.py). `watchdog`: the keyword
    arguments of engine/trace/watchdog.py's Watchdog (seconds, on_stall), or None for none."""
    check_dispatch(cfg)
    torch.manual_seed(cfg.seed)
    header = {
        "role": "prefill",
        "mode": cfg.mode,
        "page_size": cfg.page_size,
        "model": cfg.model,
        "seed": cfg.seed,
        "workload_seed": wc.seed,
        "inject": sorted(cfg.inject),
    }
    if tracer is None:
        tracer = Tracer(header) if trace_path else NullTracer(header)
    else:
        tracer.header.update(header)
    if trace_path:
        tracer.stream(
            trace_path,
            extra_header={
                "host": platform.node(),
                "config": _jsonable(asdict(cfg)),
                "workload": _jsonable(asdict(wc)),
            },
            **({"flush_ms": flush_ms} if flush_ms else {}),
        )
    reqs = make_workload(wc, cfg.model_config.vocab_size)
    probe = oracle.OutputProbe() if verify else None
    try:
        sched = PrefillScheduler(cfg, reqs, tracer=tracer, model=model, probe=probe)
    except BaseException:
        tracer.close("exception")
        raise
    dog = None
    if watchdog and tracer.enabled:  # it watches the events: nothing to watch without a trace
        dog = Watchdog(tracer, lambda: _pending(sched), **watchdog)
    prev_name = threading.current_thread().name
    threading.current_thread().name = "scheduler"
    t0 = time.perf_counter()
    error = None
    ended = "normal"
    try:
        with frozen_gc(cfg.freeze_gc):
            LOOPS[cfg.mode](sched)
    except Exception as exc:  # summarised for the CLI; tests re-raise through `error`
        error, ended = exc, "exception"
    except BaseException:  # KeyboardInterrupt, or SystemExit from a signal handler (engine/cli)
        ended = "signal"
        raise
    finally:
        wall = time.perf_counter() - t0
        threading.current_thread().name = prev_name
        if dog is not None:
            dog.stop()
        try:
            sched.close()
        finally:
            if ended != "normal" and trace_path:
                tracer.close(dog.reason if dog is not None and dog.fired else ended)
    leaks = sched.leak_report()
    summary = {
        "mode": cfg.mode,
        "requests": len(reqs),
        "finished": len(sched.done),
        "batches": sched.stats["batches"],
        "input_tokens": sum(len(r.prompt) for r in reqs),
        "uncached_tokens": sched.stats["uncached_tokens"],
        "cached_tokens": sched.stats["cached_tokens"],
        "wall_s": wall,
        "uncached_tok_per_s": sched.stats["uncached_tokens"] / wall if wall else 0.0,
        "attention_backend": sched.backend.name,
        "forward": sched.model.impl_for(sched.backend),
        "device": str(sched.device),
        "leaks": leaks,
        "memory": sched.memory_stats(),
        "events": tracer.count if tracer.enabled else 0,
        "error": repr(error) if error else None,
    }
    if probe is not None:
        summary["verify"] = oracle.judge(cfg, reqs, sched.receiver, probe).as_dict()
    if trace_path:
        tracer.close("normal")
    if error is not None and not keep_error:
        raise error
    return PrefillResult(summary, sched, reqs, error)


_MODELS: dict = {}


def shared_model(cfg: EngineConfig):
    """The model of cfg (preset, seed, dtype, device, forward), built once per process: the weights
    are only read, and drawing the large preset's weights anew for every run of a benchmark would
    cost more than many runs."""
    impl = default_forward_impl() if cfg.forward == "auto" else cfg.forward
    key = (cfg.model, cfg.seed, cfg.dtype, cfg.device, impl)
    model = _MODELS.get(key)
    if model is None:
        model = _MODELS[key] = TinyLlama(
            cfg.model_config,
            seed=cfg.seed,
            dtype=getattr(torch, cfg.dtype),
            device=torch.device(cfg.device),
            forward_impl=impl,
        )
    return model


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


def _jsonable(d):
    return {k: (sorted(v) if isinstance(v, (set, frozenset)) else v) for k, v in d.items()}


def _pending(sched) -> int:
    """Requests arrived and not finished: work the engine owes (the watchdog's condition)."""
    return sched.total - len(sched.done) - len(sched.arrivals)
