"""One prefill workload through SGLang 0.5.23's real PD prefill loop, on the Scheduler of
prefill_scheduler.py: `event_loop_normal_disagg_prefill` or `event_loop_overlap_disagg_prefill` runs
until the work is done and `gracefully_exit` ends the loop.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from .. import hooks, mutate
from ..sink import TraceSink
from .prefill_fakes import (
    CallLog,
    FakeCudaEvents,
    FakeTokenizerSocket,
    Schedule,
    scripted_sender,
    scripted_sender_class,
)
from .prefill_scheduler import SCENARIO_LOCK, Workload, build_scheduler, sglang


def _envs(workload: Workload):
    from sglang.srt.environ import envs  # lazy: SGLang is optional

    stack = contextlib.ExitStack()
    stack.enter_context(envs.SGLANG_ENABLE_DELAY_SAMPLE.override(workload.delay_sample))
    stack.enter_context(
        envs.SGLANG_ENABLE_DISAGG_PREFILL_CONTINUOUS_INPUT_POLLING.override(
            workload.continuous_polling
        )
    )
    stack.enter_context(
        envs.SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX.override(workload.early_send_prefix)
    )
    return stack


class Stuck(RuntimeError):
    """The loop ran past the workload's iteration bound without finishing its requests."""


def _install_intake(
    sched, workload: Workload, socket: FakeTokenizerSocket, log: CallLog, schedule: Schedule
) -> None:
    """The loop's ingest_requests, as the instance sees it: SGLang's real Scheduler.ingest_requests
    (the socket above feeds it), then, for each request it queued in the bootstrap queue, the
    scripted sender in place of the FakeKVSender create_sender made (before anything polls it), and
    the exit: `gracefully_exit` once every request arrived and SGLang's is_fully_idle says nothing
    is left."""
    real = type(sched).ingest_requests
    scripted = scripted_sender_class()
    state = {"iterations": 0}

    def ingest_requests(stop_at_pause: bool = False):
        state["iterations"] += 1
        if state["iterations"] > workload.max_iterations:
            raise Stuck(f"loop still running after {workload.max_iterations} iterations")
        out = real(sched, stop_at_pause=stop_at_pause)
        for req in sched.disagg_prefill_bootstrap_queue.queue:
            if not isinstance(req.disagg_kv_sender, scripted):
                req.disagg_kv_sender = scripted_sender(
                    req.disagg_kv_sender,
                    log,
                    str(req.rid),
                    bootstrap_polls=schedule.bootstrap_polls(),
                    transfer_polls=schedule.transfer_polls(),
                )
        if (
            not socket.pending
            and not sched.disagg_prefill_bootstrap_queue.queue
            and sched.is_fully_idle()
        ):
            log("exit")
            sched.gracefully_exit = True
        return out

    sched.ingest_requests = ingest_requests


LOOPS = {
    "normal": "event_loop_normal_disagg_prefill",
    "overlap": "event_loop_overlap_disagg_prefill",
}


def run_workload(
    workload: Workload, trace_path: str | None, fuzz_schedule=None, *, patch=None
) -> dict:
    """Run the workload's loop to its exit. With `trace_path`, under the adapter's hooks (one trace
    file); without, the same run with no sink active. `patch` is a context manager entered around
    the loop (a mutation). Returns the trace, the real SGLang functions the hooks saw run, the
    fakes' call log and what the scheduler holds at the end."""
    with SCENARIO_LOCK:
        sgl = sglang()
        from sglang.srt import runtime_context as rc  # lazy: SGLang is optional

        log, schedule = CallLog(), Schedule(fuzz_schedule)
        # The scenario publishes its own configuration; what was published before is put back after
        # (the process groups of the one-rank world stay: building them again is not supported).
        with _envs(workload), _restored(rc.snapshot_context(), rc.restore_context):
            sched = build_scheduler(workload, log, schedule)
            socket = FakeTokenizerSocket(workload.arrivals, sched.model_config.vocab_size, log)
            sched.request_receiver = SimpleNamespace(recv_requests=socket.recv_requests)
            _install_intake(sched, workload, socket, log, schedule)
            before = dict(hooks.ran)
            with contextlib.ExitStack() as stack:
                stack.enter_context(mutate.swapped(torch.cuda, "Event", FakeCudaEvents(log)))
                if patch is not None:
                    stack.enter_context(patch)
                if trace_path is not None:
                    stack.enter_context(hooks.tracing(TraceSink(trace_path)))
                # looked up inside the patch: a mutant is the loop that runs
                getattr(sched, LOOPS[workload.mode])()
        ran = sorted(k for k, v in hooks.ran.items() if v > before.get(k, 0))
        outputs = [
            rid
            for obj in sched.ipc_channels.send_to_detokenizer.sent
            for rid in getattr(obj, "rids", ())
        ]
        return {
            "trace": trace_path,
            "functions": ran,
            "calls": log.calls,
            "outputs": outputs,
            "leaks": _leaks(sched),
            "version": sgl.version,
        }


@contextlib.contextmanager
def _restored(state, restore):
    try:
        yield
    finally:
        restore(state)


def _leaks(sched) -> dict:
    return {
        "req_slots_in_use": sched.req_to_token_pool.size - sched.req_to_token_pool.available_size(),
        "inflight": len(sched.disagg_prefill_inflight_queue),
        "waiting": len(sched.waiting_queue),
        "chunked": sched.chunked_req is not None,
    }
