"""One prefill workload through SGLang 0.5.23's real PD prefill loop, on the Scheduler of
prefill_scheduler.py: `event_loop_normal_disagg_prefill` or `event_loop_overlap_disagg_prefill` runs
until the work is done and `gracefully_exit` ends the loop.
"""

from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace

import torch

from engine.sglang import hooks, mutate
from engine.sglang.conform.prefill_fakes import (
    CallLog,
    FakeCudaEvents,
    FakeTokenizerSocket,
    Schedule,
    scripted_sender,
    scripted_sender_class,
)
from engine.sglang.conform.prefill_releases import cpu_kernels
from engine.sglang.conform.prefill_scheduler import SCENARIO_LOCK, Workload, build_scheduler, sglang
from engine.sglang.sink import LoopExit, TraceSink


def _envs(workload: Workload):
    """The workload's switches, set where this release has them (missing_switches says whether a
    release without one can run the workload)."""
    from sglang.srt.environ import envs  # lazy: SGLang is optional

    stack = contextlib.ExitStack()
    for name, value in workload.switches().items():
        switch = getattr(envs, name, None)
        if switch is not None:
            stack.enter_context(switch.override(value))
    return stack


class Stuck(RuntimeError):
    """The loop ran past the workload's iteration bound without finishing its requests."""


class _LoopEnd(LoopExit):
    """Ends a loop that has no exit of its own (before 0.5.21 the prefill loops never leave)."""


def _install_intake(
    sched, workload: Workload, socket: FakeTokenizerSocket, log: CallLog, schedule: Schedule
) -> None:
    """The loop's intake, as the instance sees it: SGLang's real Scheduler.ingest_requests (from
    0.5.20; before, process_input_requests of what recv_requests got; the socket above feeds both),
    then, for each request it queued in the bootstrap queue, the scripted sender in place of the
    FakeKVSender create_sender made (before anything polls it), and the exit once every request
    arrived and SGLang's is_fully_idle says nothing is left: `gracefully_exit` where the loop reads
    it, else _LoopEnd."""
    name = (
        "ingest_requests" if hasattr(type(sched), "ingest_requests") else "process_input_requests"
    )
    real = getattr(type(sched), name)
    scripted = scripted_sender_class()
    state = {"iterations": 0}
    reads_exit = _reads_gracefully_exit(sched, workload)

    def intake(*args, **kwargs):
        state["iterations"] += 1
        if state["iterations"] > workload.max_iterations:
            raise Stuck(f"loop still running after {workload.max_iterations} iterations")
        out = real(sched, *args, **kwargs)
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
            if not reads_exit:
                raise _LoopEnd
        return out

    setattr(sched, name, intake)


def _reads_gracefully_exit(sched, workload: Workload) -> bool:
    """Whether the workload's loop reads `self.gracefully_exit` (from 0.5.21)."""
    from engine.sglang.decode import unwrap  # the plain function under the hooks' wrapper

    loop = unwrap(getattr(type(sched), LOOPS[workload.mode]))
    return "self.gracefully_exit" in inspect.getsource(loop)


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
        with _envs(workload), _restored(rc):
            sched = build_scheduler(workload, log, schedule)
            socket = FakeTokenizerSocket(workload.arrivals, sched.model_config.vocab_size, log)
            sched.request_receiver = SimpleNamespace(recv_requests=socket.recv_requests)
            _install_intake(sched, workload, socket, log, schedule)
            before = dict(hooks.ran)
            with contextlib.ExitStack() as stack:
                stack.enter_context(mutate.swapped(torch.cuda, "Event", FakeCudaEvents(log)))
                stack.enter_context(cpu_kernels())
                if patch is not None:
                    stack.enter_context(patch)
                if trace_path is not None:
                    stack.enter_context(hooks.tracing(TraceSink(trace_path)))
                # looked up inside the patch: a mutant is the loop that runs
                with contextlib.suppress(_LoopEnd):
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
def _restored(rc):
    """The published configuration put back after the block, where the release can snapshot it
    (0.5.19 on); before, the next publish replaces every field of it."""
    if not hasattr(rc, "snapshot_context"):
        yield
        return
    state = rc.snapshot_context()
    try:
        yield
    finally:
        rc.restore_context(state)


def _leaks(sched) -> dict:
    return {
        "req_slots_in_use": sched.req_to_token_pool.size - sched.req_to_token_pool.available_size(),
        "inflight": len(sched.disagg_prefill_inflight_queue),
        "waiting": len(sched.waiting_queue),
        "chunked": sched.chunked_req is not None,
    }
