"""No false findings: a scenario may call an internal SGLang method directly only in a state one of
its real callers can produce.

Each direct call a scenario makes (a bypass of SGLang's own caller) is listed in BYPASSES with the
real callers and the precondition they establish; the scenario checks that precondition with
`assert_reachable` right before the call. A scenario that would call the method where no caller
could fails with `Unreachable` (its outcome is `error`), never with a finding. docs/sglang.md,
"Direct calls and their callers", is this table in prose.
"""

from __future__ import annotations

import dataclasses


class Unreachable(AssertionError):
    """A scenario was about to call an SGLang method in a state none of its callers can produce."""


@dataclasses.dataclass(frozen=True)
class Bypass:
    call: str  # the SGLang method the scenario calls itself
    callers: tuple[str, ...]  # who calls it in SGLang
    precondition: str  # what those callers guarantee when they call it
    scenarios: str  # where the scenarios call it


BYPASSES: dict[str, Bypass] = {
    b.call: b
    for b in (
        Bypass(
            "DecodePreallocQueue.add",
            ("Scheduler._add_request_to_queue (from handle_generate_request)",),
            "the scheduler is in decode mode; priority scheduling is off, so "
            "_set_or_validate_priority lets every request through",
            "decode_scenarios.Harness._ingest (arrivals)",
        ),
        Bypass(
            "Scheduler._add_request_to_queue",
            ("Scheduler.handle_generate_request",),
            "the request passed handle_generate_request's checks: its prompt is shorter than "
            "max_req_input_len (min(context length, KV tokens) - 1 - 5)",
            "decode_life.LifeHarness._arrive (the matrix's arrivals)",
        ),
        Bypass(
            "prepare_abort on a queued request",
            (
                "DecodePreallocQueue._update_handshake_waiters, on the KVPoll.Failed that "
                "Scheduler.abort_request's kv_receiver.abort() makes the next poll report",
            ),
            "the request is in DecodePreallocQueue.queue (abort_request aborts only queued "
            "receivers; the poll covers the whole queue)",
            "decode_scenarios.Harness._ingest (aborts)",
        ),
        Bypass(
            "DecodePreallocQueue._resolve_pending_reqs",
            (
                "DecodePreallocQueue.pop_preallocated (its first step), from "
                "Scheduler.process_decode_queue",
            ),
            "the engine is not paused where the loop skips process_decode_queue then (from "
            "0.5.16; up to 0.5.15.post1 the loop runs it before its pause check), the retracted "
            "queue is empty (process_decode_queue returns before pop_preallocated otherwise), and "
            "it is a polling tick (polling_count % disaggregation_decode_polling_interval == 0)",
            "decode_scenarios.Harness._process_decode_queue",
        ),
    )
}


def assert_reachable(call: str, holds: bool, detail: str = "") -> None:
    """Raise Unreachable unless `holds`, the precondition BYPASSES records for `call`."""
    bypass = BYPASSES[call]
    if not holds:
        raise Unreachable(
            f"{call} called where none of its callers ({'; '.join(bypass.callers)}) could call "
            f"it: they guarantee {bypass.precondition}" + (f" ({detail})" if detail else "")
        )
