"""The prefill lifecycle x fault matrix: one request in each prefill lifecycle state, one failure of
the transfer layer there, the lifecycle invariants (lifecycle.py) checked at every iteration.

What runs is SGLang's real prefill scheduler of prefill_scheduler.py and its real loops (intake,
the bootstrap queue's pop_bootstrapped, admission, run_batch, result processing, send_kv_chunk, the
inflight queue, handle_bootstrap_failure / handle_inflight_transfer_failure), client aborts through
`Scheduler.abort_request`, and `Scheduler.is_fully_idle` as the idleness report. The one addition to
the fakes of prefill_fakes.py is the fault: the scripted KV sender of the target request fails
through one door (faults.Fault).

What is checked: every request ends exactly once (one finished or abort output on the fakes'
sockets), its sender is cleared at most once and never used after, its request slot, KV pages and
metadata slot are free at the end and never while its transfer may still read them, and
is_fully_idle is right at every iteration. Not checked here: that a failed sender is cleared (SGLang
0.5.23's prefill clears a sender only after Success; docs/sglang.md says why that is left open).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from types import SimpleNamespace

import torch

from engine.sglang import hooks, mutate
from engine.sglang.conform import lifecycle
from engine.sglang.conform.faults import TIMEOUT_POLLS, Fault
from engine.sglang.conform.prefill_fakes import (
    Arrival,
    CallLog,
    FakeCudaEvents,
    FakeTokenizerSocket,
    Schedule,
)
from engine.sglang.conform.prefill_releases import cpu_kernels
from engine.sglang.conform.prefill_run import Stuck, _envs, _install_intake, _LoopEnd, _restored
from engine.sglang.conform.prefill_scenarios import HARNESS_OLDEST
from engine.sglang.conform.prefill_scheduler import SCENARIO_LOCK, Workload, build_scheduler, sglang
from engine.sglang.sink import TraceSink

TARGET = "t"


class PState(enum.Enum):
    BOOTSTRAP = "bootstrap"  # in the bootstrap queue, the handshake with the decode not done
    WAITING = "waiting"  # bootstrapped, in the waiting queue, not admitted yet
    IN_BATCH = "in-batch"  # being prefilled: the chunked request of the running batches
    INFLIGHT = "inflight"  # prefilled, in the inflight queue while its KV is sent


@dataclasses.dataclass(frozen=True)
class PCell:
    state: PState
    fault: Fault | None

    @property
    def name(self) -> str:
        return f"prefill-life/{self.state.value}/{self.fault.value if self.fault else 'none'}"


CELLS = [PCell(s, f) for s in PState for f in (None, *Fault)]

_ARRIVALS = {
    PState.BOOTSTRAP: [Arrival(TARGET, 20, 0)],
    # a long request that takes every chunk's budget while the target waits
    PState.WAITING: [Arrival("b", 120, 0), Arrival(TARGET, 20, 1)],
    PState.IN_BATCH: [Arrival(TARGET, 60, 0)],
    PState.INFLIGHT: [Arrival(TARGET, 20, 0)],
}

_FAULTY: list = []


def _faulty_class():
    """The scripted sender (prefill_fakes.ScriptedKVSender) with a fault door and a clear count."""
    if _FAULTY:
        return _FAULTY[0]
    from sglang.srt.disaggregation.base import KVPoll  # lazy: SGLang is optional

    from engine.sglang.conform.prefill_fakes import scripted_sender_class

    class FaultyKVSender(scripted_sender_class()):
        def _use(self, what):
            if self.cleared:
                self.misuse.append(f"{what} after clear")

        @property
        def label(self):
            return f"{self.rid}'s sender"

        def in_flight(self):
            """What the transfer may still read: pages handed over, nothing concluded."""
            if not self.sent or self.conclude_state is not None:
                return None
            return (self.req_slot(), self.sent, self.meta_slot())

        def poll(self):
            self._use("poll")
            if self.conclude_state is None:
                if self.fail_next_poll:
                    self.conclude_state = KVPoll.Failed
                elif self.deadline is not None:
                    self.deadline -= 1
                    if self.deadline < 0:
                        self.conclude_state = KVPoll.Failed
            return super().poll()

        def init(self, num_kv_indices, aux_index=None):
            self._use("init")
            if self.fail_in_call:
                self.conclude_state = KVPoll.Failed
            return super().init(num_kv_indices, aux_index)

        def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
            self._use("send")
            if self.fail_in_call:
                self.conclude_state = KVPoll.Failed
            self.sent.extend(int(i) for i in kv_indices)
            return super().send(kv_indices, state_indices, num_kv_tokens)

        def abort(self):
            self._use("abort")
            return super().abort()

        def clear(self):
            self.cleared += 1
            return super().clear()

    _FAULTY.append(FaultyKVSender)
    return FaultyKVSender


def _adopt(sender, req) -> None:
    """Make the scripted sender of `req` a FaultyKVSender (same state, fault doors closed)."""
    sender.__class__ = _faulty_class()
    sender.cleared, sender.misuse, sender.sent = 0, [], []
    sender.fail_next_poll, sender.deadline, sender.fail_in_call = False, None, False
    # the request's KV fields are on req.kv from 0.5.16 (before, on the request itself)
    sender.req_slot = lambda: getattr(getattr(req, "kv", req), "req_pool_idx", None)
    sender.meta_slot = lambda: getattr(req, "metadata_buffer_index", None)


class PrefillLife:
    def __init__(self, cell: PCell, mode: str):
        self.cell, self.mode = cell, mode
        self.senders: dict[str, object] = {}
        self.injected = False

    def _in_state(self, sched) -> bool:
        state = self.cell.state
        if state is PState.BOOTSTRAP:
            return any(r.rid == TARGET for r in sched.disagg_prefill_bootstrap_queue.queue)
        if state is PState.WAITING:
            return any(r.rid == TARGET for r in sched.waiting_queue)
        if state is PState.IN_BATCH:
            return sched.chunked_req is not None and sched.chunked_req.rid == TARGET
        return any(r.rid == TARGET for r in sched.disagg_prefill_inflight_queue)

    def _after_intake(self, sched) -> None:
        """After SGLang's intake of one iteration: take the new senders, inject, check."""
        for req in sched.disagg_prefill_bootstrap_queue.queue:
            if req.rid not in self.senders:
                _adopt(req.disagg_kv_sender, req)
                self.senders[req.rid] = req.disagg_kv_sender
                self.ledger.admitted.add(req.rid)
                if req.rid == TARGET and self.cell.state is PState.BOOTSTRAP:
                    req.disagg_kv_sender.bootstrap_left = 4
                if req.rid == TARGET and self.cell.state is PState.INFLIGHT:
                    req.disagg_kv_sender.transfer_left = 4
        self._count_ends(sched)
        self.ledger.check(list(self.senders.values()), sched.is_fully_idle(), f"intake {self.n}")
        if self.cell.fault is not None and not self.injected and self._in_state(sched):
            self._inject(sched)

    def _inject(self, sched) -> None:
        from sglang.srt.managers.io_struct import AbortReq  # lazy: SGLang is optional

        self.injected, fault = True, self.cell.fault
        hooks.active().emit("x.fault", rid=TARGET, state=self.cell.state.value, fault=fault.value)
        target = self.senders[TARGET]
        if fault is Fault.CLIENT_ABORT:
            sched.abort_request(AbortReq(rid=TARGET))
        elif fault is Fault.PEER_GONE:  # the decode server dies: every live transfer to it fails
            for sender in self.senders.values():
                if sender.conclude_state is None and not sender.cleared:
                    sender.fail_next_poll = True
        elif fault is Fault.POLL_FAILED:
            target.fail_next_poll = True
        elif fault is Fault.TIMEOUT:
            target.deadline = TIMEOUT_POLLS
        elif target.total_pages is None or target.sent_pages < target.total_pages:
            target.fail_in_call = True  # STATE_FAILED: SGLang's next init/send into it fails
        else:
            from sglang.srt.disaggregation.base import KVPoll  # lazy: SGLang is optional

            target.conclude_state = KVPoll.Failed  # recorded by the backend between two polls

    def _count_ends(self, sched) -> None:
        ends: dict[str, int] = {}
        for obj in sched.ipc_channels.send_to_detokenizer.sent:
            reasons = getattr(obj, "finished_reasons", None) or []
            for rid, reason in zip(getattr(obj, "rids", ()), reasons):
                if reason is not None:
                    ends[rid] = ends.get(rid, 0) + 1
        for obj in sched.ipc_channels.send_to_tokenizer.sent:
            rid = getattr(obj, "rid", None)
            if rid is not None:
                ends[rid] = ends.get(rid, 0) + 1
        for rid, n in ends.items():
            while self.ledger.ends[rid] < n:
                self.ledger.end(rid)

    def run(self, trace_path: str) -> str:
        workload = Workload(
            self.mode, list(_ARRIVALS[self.cell.state]), radix_cache=False, max_iterations=120
        )
        with SCENARIO_LOCK:
            from sglang.srt import runtime_context as rc  # lazy: SGLang is optional

            sglang()
            log, schedule = CallLog(), Schedule(None)
            with _envs(workload), _restored(rc):
                sched = build_scheduler(workload, log, schedule)
                self.ledger = lifecycle.Ledger(sched)
                capacity = lifecycle.capacity(sched)
                socket = FakeTokenizerSocket(workload.arrivals, sched.model_config.vocab_size, log)
                sched.request_receiver = SimpleNamespace(recv_requests=socket.recv_requests)
                _install_intake(sched, workload, socket, log, schedule)
                self._wrap_intake(sched)
                with contextlib.ExitStack() as stack:
                    stack.enter_context(mutate.swapped(torch.cuda, "Event", FakeCudaEvents(log)))
                    stack.enter_context(cpu_kernels())
                    stack.enter_context(hooks.tracing(TraceSink(trace_path)))
                    try:
                        getattr(sched, f"event_loop_{self.mode}_disagg_prefill")()
                    except Stuck:
                        pass  # a request that never ends: the ledger reports it below
                    except _LoopEnd:
                        pass  # the exit of a loop that reads no gracefully_exit (before 0.5.21)
                    except Exception:
                        # SGLang raised (its own leak check, say): the invariants at that point
                        # come first when they fail
                        idle = sched.is_fully_idle()
                        self.ledger.check(list(self.senders.values()), idle, "SGLang raised")
                        if self.ledger.found:
                            raise lifecycle.Violations(self.ledger.found) from None
                        raise
                self._count_ends(sched)
                self.ledger.check(list(self.senders.values()), sched.is_fully_idle(), "the end")
                if self.cell.fault is not None and not self.injected:
                    raise RuntimeError(f"{self.cell.name}: the request never reached the state")
                self.ledger.finish(list(self.senders.values()), capacity, must_clear=False)
        return trace_path

    def _wrap_intake(self, sched) -> None:
        """After each intake, the cell's step: at ingest_requests (0.5.20 on), else at the
        process_input_requests the loop calls after its own recv_requests."""
        name = "ingest_requests" if hasattr(sched, "ingest_requests") else "process_input_requests"
        inner = getattr(sched, name)
        self.n = 0

        def intake(*args, **kwargs):
            self.n += 1
            out = inner(*args, **kwargs)
            self._after_intake(sched)
            return out

        setattr(sched, name, intake)


def _names() -> list[str]:
    return [f"{cell.name}/{mode}" for cell in CELLS for mode in ("normal", "overlap")]


# The cells run on the scheduler the plain prefill scenarios run on, wherever the harness builds it
# (the tree cache is the one each release's own factory makes: ChunkCache for these cells' disabled
# radix cache up to 0.5.21); below it every cell is listed as not applicable, never run and never
# passed.
LIFE_OLDEST = HARNESS_OLDEST
NOT_COVERED = f"the prefill lifecycle cells cover {LIFE_OLDEST} on"


def inapplicable() -> dict[str, str]:
    """Cell -> why it is not run on this release."""
    from packaging.version import Version

    from engine.sglang import load

    if Version(load().version) < Version(LIFE_OLDEST):
        return dict.fromkeys(_names(), NOT_COVERED)
    return {}


def scenarios() -> list[tuple[str, object]]:
    """(name, run(trace_path, fuzz_seed=None)) for each cell under both prefill loops, on a release
    the harness covers (inapplicable() lists the others)."""
    out = []
    if inapplicable():
        return out
    for cell in CELLS:
        for mode in ("normal", "overlap"):
            out.append((f"{cell.name}/{mode}", _runner(cell, mode)))
    return out


def _runner(cell, mode):
    def run(trace_path: str, fuzz_seed: int | None = None) -> str:
        # one fixed schedule per cell: the state it reaches is scripted, so a seed is ignored
        return PrefillLife(cell, mode).run(trace_path)

    return run


# The rules a cell's trace breaks where SGLang 0.5.23 is right and the trace cannot say why
# (docs/sglang.md, "The lifecycle x fault matrix"). A client abort of the chunked request makes
# the running request end (abort_request sets its to_finish); SGLang then releases its KV without
# sending the chunks it computed, which is right: nothing was sent (the trace has no kv_send for
# it), so no transfer reads the pages released. The prefill
# trace has no abort event, so P-chunk-sent sees computed tokens never sent and P-release-after-done
# a release before any send.
_UNSENT_ABORT = {
    "P-chunk-sent": "an aborted request's computed chunks are never sent",
    "P-release-after-done": "an aborted request is released with none of its KV sent",
}
DIVERGENCES: dict[str, dict[str, str]] = {
    f"prefill-life/in-batch/client-abort/{mode}": dict(_UNSENT_ABORT)
    for mode in ("normal", "overlap")
}
