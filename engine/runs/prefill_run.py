"""Run the prefill engine once: build the scheduler, run the chosen loop, return its result."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.oracle import judge as oracle
from engine.prefill.loops import LOOPS
from engine.prefill.scheduler import PrefillScheduler
from engine.runs.role import open_trace, role_header, role_loop
from engine.runs.spec import RunSpec
from engine.runs.workload import make_workload
from engine.runtime.config import check_dispatch
from engine.runtime.request import Req


@dataclass
class PrefillResult:
    """A prefill run: `summary`, the report `pdo run` prints (JSON-able: counts, times, leaks,
    memory, the verdict on the outputs); the scheduler and the requests, for a caller that looks
    inside; `error`, the exception that ended the run, when the run was asked to keep it."""

    summary: dict
    scheduler: PrefillScheduler
    requests: list[Req]
    error: Exception | None = None


def run_prefill(spec: RunSpec, *, tracer=None, keep_error: bool = False) -> PrefillResult:
    """The prefill engine once on `spec` (its engine, workload, trace, watchdog and `verify`: every
    output judged against the reference, engine/oracle/judge.py, into summary["verify"]). An
    exception that ends the run is raised, or with `keep_error` kept in the result. `tracer`: the
    one to log into (a caller that reads the events), else one made here. With a trace path the
    trace streams to its file as the run goes on and ends with `trace_end` whatever ends the run
    (engine/trace/recorder.py)."""
    cfg, wc, trace_path = spec.engine, spec.workload, spec.trace_path
    check_dispatch(cfg)
    torch.manual_seed(cfg.seed)
    tracer = open_trace(spec, role_header(spec, "prefill"), trace_path, pd=False, tracer=tracer)
    reqs = make_workload(wc, cfg.model_config.vocab_size)
    probe = oracle.OutputProbe() if spec.verify else None
    try:
        sched = PrefillScheduler(cfg, reqs, tracer=tracer, probe=probe)
    except BaseException:
        tracer.close("exception")
        raise
    t0 = time.perf_counter()
    error, ended, dog = None, "normal", None
    try:
        with role_loop(spec, sched, tracer, sched.arrivals) as dog:
            LOOPS[cfg.mode](sched)
    except Exception as exc:  # summarised for the CLI; tests re-raise through `error`
        error, ended = exc, "exception"
    except BaseException:  # KeyboardInterrupt, or SystemExit from a signal handler (engine/cli)
        ended = "signal"
        raise
    finally:
        wall = time.perf_counter() - t0
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
