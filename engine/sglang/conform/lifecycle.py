"""The lifecycle invariants, checked on a decode scheduler at every iteration (the oracle part of
the lifecycle x fault matrix; D-request-ends judges the trace).

    Ledger.end(req)      a request's final output left the scheduler (finished or aborted)
    Ledger.check(...)    the invariants at one point of the run; violations are collected. Each
                         transfer endpoint (receiver or sender) passed in has `label`, `cleared`
                         (clear() calls), `misuse` (calls after clear) and `in_flight()`: what
                         its transfer may still touch (slot, pages, metadata slot) or None
    Violations           raised at the end of a run whose invariants failed

What is checked, per request:
- it ends exactly once: one final output (stream_output of a finished request, or an abort
  output), never two, and one by the end of the run;
- its receiver (decode) or sender (prefill) is cleared exactly once, and never used after;
- (decode) its metadata is not published while its transfer has failed and SGLang has not polled
  the receiver since (`unseen_failure`): a failure is seen before the room gets pages;
- its request slot (req_to_token), KV pages and metadata slot are free by the end, never freed
  twice, and never free while its transfer may still write them (metadata sent, not concluded);
- the scheduler's idleness report (`Scheduler.is_fully_idle`) never says idle while a request is
  alive, and does not stay busy (BUSY_LIMIT checks in a row) once none is.

The pools' free lists are read directly (a count such as `available_size` cannot show a slot freed
twice); their names, which may differ by release, are in the three functions at the end.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

BUSY_LIMIT = 3  # consecutive checks reporting busy with nothing alive before it is flagged


class Violations(Exception):
    """The lifecycle invariants a run broke: {invariant: [message, ...]}."""

    def __init__(self, found: dict[str, list[str]]):
        self.found = found
        first = next(iter(found.values()))[0]
        super().__init__(f"{sum(map(len, found.values()))} lifecycle violations; first: {first}")


@dataclasses.dataclass
class Ledger:
    pools: object  # has req_to_token_pool, token_to_kv_pool_allocator, metadata allocator
    ends: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    admitted: set = dataclasses.field(default_factory=set)
    found: dict = dataclasses.field(default_factory=dict)
    busy_idle: int = 0  # consecutive checks reporting busy with nothing alive

    def _flag(self, invariant: str, message: str) -> None:
        found = self.found.setdefault(invariant, [])
        if message not in found:
            found.append(message)

    def end(self, rid: str) -> bool:
        """Count a final output of `rid`; True the first time."""
        self.ends[rid] += 1
        if self.ends[rid] > 1:
            self._flag("ends-once", f"{rid} ended {self.ends[rid]} times")
        return self.ends[rid] == 1

    def alive(self) -> set:
        return {rid for rid in self.admitted if not self.ends[rid]}

    def check(self, receivers: list, idle: bool, where: str, exempt=frozenset()) -> None:
        """The invariants at one point: `receivers` every receiver made so far; `idle` what
        Scheduler.is_fully_idle answers now; `exempt` requests that hold nothing and wait for no
        work (held for re-bootstrap during a pause: SGLang keeps them out of every queue on
        purpose, so that a weight update's cache flush sees an idle scheduler)."""
        free_slots = _free_slots(self.pools)
        free_pages = _free_pages(self.pools)
        free_meta = _free_metadata(self.pools)
        for name, free in (("slot", free_slots), ("page", free_pages), ("metadata", free_meta)):
            dup = [i for i, n in collections.Counter(free).items() if n > 1]
            if dup:
                self._flag("freed-once", f"{where}: {name}s {dup[:4]} are free twice")
        for r in receivers:
            if r.cleared > 1:
                self._flag("cleared-once", f"{r.label}: cleared {r.cleared} times")
            for misuse in r.misuse:
                self._flag("cleared-once", f"{r.label}: {misuse}")
            for what in getattr(r, "unseen_failure", ()):  # decode receivers keep it
                self._flag("failure-polled", f"{r.label}: {what}")
            held = r.in_flight()
            if held is not None:
                self._transfer_holds(
                    r.label, held, set(free_slots), set(free_pages), set(free_meta), where
                )
        alive = self.alive() - set(exempt)
        if idle and alive:
            self._flag("idle-right", f"{where}: is_fully_idle says idle while {sorted(alive)} live")
        # Busy with nothing alive is a liveness question: a loop's last batch keeps the report busy
        # for the iteration after its last request ended, so only a report that stays busy is one.
        if not idle and not alive and not _busy_transfers(receivers):
            self.busy_idle += 1
            if self.busy_idle >= BUSY_LIMIT:
                self._flag("idle-right", f"{where}: is_fully_idle says busy with no request alive")
        else:
            self.busy_idle = 0

    def _transfer_holds(self, label, held, free_slots, free_pages, free_meta, where) -> None:
        """A transfer that may still read or write: its slot, pages and metadata slot must not be
        free. `held` is (request slot, page ids, metadata slot), any of them None when unknown."""
        slot, pages, meta = held
        if slot is not None and slot in free_slots:
            self._flag("held-while-writing", f"{where}: {label}: request slot freed mid-transfer")
        if pages and set(pages) & free_pages:
            self._flag("held-while-writing", f"{where}: {label}: KV pages freed mid-transfer")
        if meta is not None and meta in free_meta:
            self._flag("held-while-writing", f"{where}: {label}: metadata slot freed mid-transfer")

    def finish(self, receivers: list, capacity: dict, must_clear: bool = True) -> None:
        """The end of the run: every request ended once, every receiver cleared once, every pool
        whole again. Raises Violations when anything failed."""
        for rid in sorted(self.admitted):
            if self.ends[rid] == 0:
                self._flag("ends-once", f"{rid} never ended")
        for r in receivers:
            if r.cleared == 0 and must_clear:
                self._flag("cleared-once", f"{r.label}: never cleared")
        now = {
            "slot": len(set(_free_slots(self.pools))),
            "page": len(set(_free_pages(self.pools))),
            "metadata": len(set(_free_metadata(self.pools))),
        }
        for name, n in now.items():
            if n != capacity[name]:
                self._flag("freed-once", f"end: {capacity[name] - n} {name}s never freed")
        if self.found:
            raise Violations(self.found)


def capacity(pools) -> dict:
    return {
        "slot": len(set(_free_slots(pools))),
        "page": len(set(_free_pages(pools))),
        "metadata": len(set(_free_metadata(pools))),
    }


def _busy_transfers(receivers) -> bool:
    return any(r.in_flight() is not None for r in receivers)


# ---- where the pools keep their free lists (the names that may differ by release) --------------
def _ints(x) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(i) for i in x.tolist()]
    return [int(i) for i in x]


def _free_slots(pools) -> list[int]:
    return _ints(pools.req_to_token_pool.free_slots)


def _free_pages(pools) -> list[int]:
    allocator = pools.token_to_kv_pool_allocator
    pages = _ints(allocator.free_pages)
    release = getattr(allocator, "release_pages", None)
    return pages + (_ints(release) if release is not None else [])


def _free_metadata(pools) -> list[int]:
    return _ints(pools.req_to_metadata_buffer_idx_allocator.free_slots)
