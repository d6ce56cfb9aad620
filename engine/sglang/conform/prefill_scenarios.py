"""The prefill conformance scenarios: SGLang 0.5.23's PD prefill loops on CPU
(prefill_scheduler.py), one workload each, traced by the adapter's hooks.

    scenarios()    [(name, run(trace_dir, fuzz_schedule=None) -> {"trace", "functions", ...})]

`fuzz_schedule` (an int seed, or None for the fixed schedule) decides what the fakes decide in a
real run: after how many polls a request's bootstrap handshake and its KV transfer complete, and
after how many queries a result's device-to-host copy is done. The loops run on one thread, so those
are the only choices a schedule has.

    DIVERGENCES    per scenario, the rules its trace fails, each with why (SGLang 0.5.23 against the
                   spec, not a hazard in SGLang)
"""

from __future__ import annotations

import os

from engine.sglang.conform.prefill_fakes import Arrival
from engine.sglang.conform.prefill_run import run_workload
from engine.sglang.conform.prefill_scheduler import Workload, missing_switches
from spec.registry import Registry


def _chunked_mix() -> list[Arrival]:
    """A request of 2.5 chunks, one that becomes the chunked request in the batch finishing the
    first, a short one arriving later, and a late one after the first ones left (several batches,
    two chunked requests, every batch shape: a lone middle chunk, a last chunk with a new chunked
    one)."""
    return [Arrival("r0", 40, 0), Arrival("r1", 10, 0), Arrival("r2", 7, 2), Arrival("r3", 21, 9)]


def _polling_mix() -> list[Arrival]:
    """As _chunked_mix, with r3 arriving while the loop waits on the last batch's copy (with the
    fixed schedule): it is admitted and forwarded before that batch's result is processed."""
    return [Arrival("r0", 40, 0), Arrival("r1", 10, 0), Arrival("r2", 7, 2), Arrival("r3", 21, 7)]


def _shared_prefix() -> list[Arrival]:
    """r1 arrives after r0 finished and shares r0's first 24 tokens: its prefix is matched in the
    radix cache, and SGLang's early send of the cached prefix has pages to send."""
    return [
        Arrival("r0", 30, 0),
        Arrival("r1", 34, 14, prefix_of="r0", shared=24),
        Arrival("r2", 9, 15),
    ]


# name -> (the workload, what the scenario shows)
SCENARIOS: Registry[tuple[Workload, str]] = Registry("prefill scenario")


def _add(name: str, workload: Workload, what: str) -> None:
    SCENARIOS.register(name)((workload, what))


_add(
    "prefill-chunked/normal",
    Workload("normal", _chunked_mix()),
    "the normal loop: run_batch then process_batch_result; middle chunks are sent at the next "
    "admission",
)
_add(
    "prefill-prefix-send/normal",
    Workload("normal", _shared_prefix()),
    "the normal loop with a radix hit: run_batch sends the cached prefix early",
)
_add(
    "prefill-chunked/overlap",
    Workload("overlap", _chunked_mix()),
    "the overlap loop as configured by default but for deferred sampling: fine WAR barrier, the "
    "early cached-prefix send on, which sends a continuing chunked request's previous chunk from "
    "run_batch",
)
_add(
    "prefill-no-early-send/overlap",
    Workload("overlap", _chunked_mix(), early_send_prefix=False),
    "the overlap loop with SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX off: every chunk is sent "
    "by its own batch's result processing",
)
_add(
    "prefill-coarse-barrier/overlap",
    Workload("overlap", _chunked_mix(), fine_barrier=False),
    "the overlap loop with the coarse WAR barrier, deferred past result processing",
)
_add(
    "prefill-polling/overlap",
    Workload("overlap", _polling_mix(), continuous_polling=True, fine_barrier=False),
    "the overlap loop with continuous input polling: a request admitted and forwarded while the "
    "oldest result's copy is pending, the coarse barrier applied while waiting",
)
_add(
    "prefill-inline-sample/overlap",
    Workload("overlap", _chunked_mix(), delay_sample=False),
    "the overlap loop as configured by default: tokens sampled inside the forward",
)
# Not run: a radix hit under the overlap loop. The early cached-prefix send then records a
# torch.cuda.Event on the forward stream (maybe_send_cached_prefix_chunk), which a CPU build of
# torch cannot make; the overlap workloads' prompts share no prefix, so the send returns before it.


# The rules a scenario's trace breaks where SGLang 0.5.23 is safe by means the rules cannot see
# (docs/sglang.md, "Open divergences"): none. The rules allow for how SGLang's loops work: the
# normal loop applies no WAR barrier (P-complete-barrier names only the overlap modes); the overlap
# loop samples inside the forward unless SGLANG_ENABLE_DELAY_SAMPLE or a grammar defers it
# (P-complete-sample is not applied to sampling = "inline"); and a middle chunk's KV is sent at the
# next admission (normal) or from run_batch(N+1) with a device wait (overlap; docs/sglang.md),
# which P-chunk-sent judges by token ranges.
DIVERGENCES: dict[str, dict[str, str]] = {}


def _scenario(name: str):
    workload, what = SCENARIOS[name]

    def run(trace_dir: str, fuzz_schedule=None) -> dict:
        path = os.path.join(trace_dir, f"sglang-{name.replace('/', '_')}.jsonl")
        out = run_workload(workload, path, fuzz_schedule)
        out["name"] = name
        return out

    run.__name__ = "scenario_" + name.replace("-", "_").replace("/", "_")
    run.__doc__ = what
    return run


# The oldest release whose prefill Scheduler the harness builds (prefill_scheduler.py discovers each
# release's steps, settings and constructor parameters; older releases differ further, first in
# their configuration: 0.5.13 has no runtime_context). Below it every prefill scenario is listed as
# not applicable, never run and never passed; on 0.5.14 every workload turns on a switch the
# release lacks (the early cached-prefix send arrives in 0.5.15), so only the lifecycle cells run.
HARNESS_OLDEST = "0.5.14"
NOT_COVERED = "the harness's scheduler build does not cover it"


def inapplicable() -> dict[str, str]:
    """Scenario -> why it is not run on this release: a release older than the harness covers, or
    a switch its workload turns on that the release lacks."""
    from packaging.version import Version

    from engine.sglang import load

    # load(): SGLang imported with the CPU workarounds before anything reads its switches
    if Version(load().version) < Version(HARNESS_OLDEST):
        return {name: NOT_COVERED for name in SCENARIOS}
    out = {}
    for name, (workload, _) in SCENARIOS.items():
        if missing := missing_switches(workload):
            out[name] = f"needs {', '.join(missing)}"
    return out


def scenarios() -> list:
    """[(name, run(trace_dir, fuzz_schedule=None) -> {"trace", "functions", ...})] for each
    scenario this release can run (inapplicable() lists the others)."""
    skip = inapplicable()
    return [(name, _scenario(name)) for name in SCENARIOS if name not in skip]
