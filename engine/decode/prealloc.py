"""The decode prealloc queue: which prefill DP rank holds each pending room, and receiver init.

SGLang's `DecodePreallocQueue` with PR #35071's prefetch. Pending requests are grouped by bootstrap
address. Without prefetch the DP-rank query (POST /query_dp_ranks) runs only at the consumption
point (`_resolve_pending_reqs`), an HTTP round trip on the scheduler's critical path; with prefetch,
the top of every loop iteration submits it to a thread pool so it overlaps intake and the device,
and the consumption point uses the future's answer when it still fits:

  prefetch_prefill_dp_rank_queries()   top of each iteration
    cancel futures of addresses with no pending request (stale)
    per address: skip if a query is in flight (keeps one query per address, FIFO), skip if the
    prefill side has not published its parallel info, query only rooms whose rank is unknown
  _resolve_pending_reqs()              consumption point
    rooms == prefetched rooms          -> future.result()                  source "prefetched"
    prefetched rooms a prefix of rooms -> sync tail, then future.result()  source "prefix"
    otherwise                          -> cancel it, query synchronously   source "sync"

Failures keep SGLang's meaning, "nothing known yet": the rooms stay pending and are asked again.
What SGLang leaves unbounded is bounded here (see docs/decode.md): consecutive failed queries per
address, time a room may stay unknown, attempts to fetch the parallel info; past a bound the
requests concerned are aborted with an error, never left hanging.
"""

from __future__ import annotations

import functools
import itertools
from concurrent.futures import Future
from dataclasses import dataclass

from engine import sync
from engine.bootstrap import client as bootstrap_client
from engine.decode.request import DecodeReq, ReceiverInit, ReqState, now
from engine.runtime import inject
from spec.vocabulary import PREFETCH, declared


@dataclass
class Prefetch:
    rooms: tuple
    future: Future
    qid: int
    t_submit: float


# A consumption point's `pending` and `covered` are the SGLang adapter's (engine/sglang/decode.py).
EVENTS = declared(
    "decode",
    *("req_add", "prefetch_begin", "prefetch_skip", "prefetch_submit", "prefetch_end"),
    *("prefetch_cancel", "query_begin", "query_end", "resolve", "release_memory"),
    "resume_memory",
    without={"resolve": ("pending", "covered")},
)


class DecodePreallocQueue:
    def __init__(self, sched, dc, tracer, mutants: frozenset = frozenset()):
        self.sched = sched
        # whether a mutant of the run's `mutants` is on (engine/runtime/inject.py)
        self.mutant = functools.partial(inject.on, mutants)
        self.dc = dc
        self.tr = tracer
        # Declared from spec/events.toml and logged positionally in its order, as the scheduler's
        # events are; prefill_info, whose layout fields are optional, goes through emit.
        self.log = tracer.events_for(**EVENTS)
        self.pending: list[DecodeReq] = []
        self.prefill_info_table: dict[str, dict] = {}
        self._queries: dict[str, Prefetch] = {}
        # concurrent.futures' pool; managed worker threads under a schedule controller (engine/sync/__init__.py)
        self._executor = sync.executor(dc.executor_workers, PREFETCH)
        self._qids = itertools.count()
        self._info_attempts: dict[
            str, tuple[int, float]
        ] = {}  # addr -> (failed attempts, last attempt)
        self._query_failures: dict[str, int] = {}
        self.memory_released = False
        self.resolves: list[dict] = []  # per consumption point that needed a query: for the bench

    def add(self, req: DecodeReq) -> None:
        req.state, req.t_add = ReqState.PENDING, now()
        self.pending.append(req)
        self.log.req_add(req.rid, req.room, req.addr)

    def _by_addr(self) -> dict[str, list[DecodeReq]]:
        groups: dict[str, list[DecodeReq]] = {}
        for r in self.pending:
            groups.setdefault(r.addr, []).append(r)
        return groups

    # ---- prefetch, at the top of every loop iteration -----------------------------------------
    def prefetch_prefill_dp_rank_queries(self, it: int) -> None:
        self.log.prefetch_begin(it)
        groups = self._by_addr()
        if not self.mutant("no-stale-cancel"):  # MUTANT: no-stale-cancel — stale futures are kept
            for addr in sorted(set(self._queries) - set(groups)):
                self._cancel(addr, "stale")
        for addr, reqs in groups.items():
            # MUTANT: query-every-iteration — rooms whose rank is already known are asked again
            rooms = tuple(
                r.room
                for r in reqs
                if r.prefill_dp_rank is None or self.mutant("query-every-iteration")
            )
            if self.prefill_info_table.get(addr, {}).get("dp_size") == 1:
                rooms = ()  # one DP rank: the consumption point knows the answer without a query
            reason = None
            if self.memory_released:
                reason = "released"
            # MUTANT: double-prefetch
            elif addr in self._queries and not self.mutant("double-prefetch"):
                reason = "in_flight"
            # MUTANT: prefetch-before-published — queries a prefill that has not published its info
            elif addr not in self.prefill_info_table and not self.mutant(
                "prefetch-before-published"
            ):
                reason = "not_published"
            elif not rooms:
                reason = "all_known"
            if reason is not None:
                self.log.prefetch_skip(addr, reason)
                continue
            qid = next(self._qids)
            # Logged before the hand-off: the pool thread's query_begin must follow its submit.
            self.log.prefetch_submit(addr, list(rooms), qid)
            fut = self._executor.submit(self._query, addr, rooms, qid, "prefetch")
            self._queries[addr] = Prefetch(rooms, fut, qid, now())
        self.log.prefetch_end(it)

    def _cancel(self, addr: str, reason: str) -> None:
        self._cancel_popped(addr, self._queries.pop(addr), reason)

    def cancel_all(self, reason: str) -> None:
        for addr in list(self._queries):
            self._cancel(addr, reason)

    def _query(
        self, addr: str, rooms: tuple, qid: int, source: str
    ) -> tuple[dict | None, str | None]:
        """One authoritative query (the client retries inside). Never raises: (result, error)."""
        self.log.query_begin(addr, list(rooms), qid, source)
        try:
            result = bootstrap_client.query_prefill_dp_ranks(
                addr, list(rooms), timeout_s=self.dc.query_timeout_s, retries=self.dc.query_retries
            )
            dp = self.prefill_info_table.get(addr, {}).get("dp_size")
            bad = [r for r, k in result.items() if dp is not None and not 0 <= k < dp]
            if bad:
                raise bootstrap_client.BootstrapError(
                    addr, f"rank out of range for dp_size {dp} for room(s) {bad}"
                )
            result = {r: k for r, k in result.items() if r in rooms}
            self.log.query_end(addr, list(rooms), qid, {str(r): k for r, k in result.items()}, None)
            return result, None
        except bootstrap_client.BootstrapError as exc:
            self.log.query_end(addr, list(rooms), qid, None, str(exc))
            return None, str(exc)

    # ---- consumption point ----------------------------------------------------------------------
    def _ensure_prefill_info(self, groups: dict[str, list[DecodeReq]]) -> list[str]:
        """Addresses whose parallel info is known; fetches it (GET /route) at most once per interval."""
        ready = []
        t = now()
        for addr, reqs in groups.items():
            if addr in self.prefill_info_table:
                ready.append(addr)
                continue
            fails, last = self._info_attempts.get(addr, (0, -1e9))
            if t - last < self.dc.info_retry_interval_s:
                continue
            error = None
            try:
                info = bootstrap_client.get_prefill_info(addr, timeout=self.dc.query_timeout_s)
            except bootstrap_client.BootstrapError as exc:
                info, error = None, str(exc)
            self.tr.emit(
                "prefill_info", addr=addr, published=info is not None, error=error, **_layout(info)
            )
            if info is not None:
                self.prefill_info_table[addr] = info
                self._info_attempts.pop(addr, None)
                ready.append(addr)
                continue
            fails += 1
            self._info_attempts[addr] = (fails, t)
            if fails >= self.dc.info_max_retries:
                why = error or "prefill parallel info not published (503)"
                for r in reqs:
                    self.sched.abort(
                        r,
                        f"could not fetch prefill parallel info from {addr} after {fails} attempts: {why}",
                    )
                self._info_attempts.pop(addr, None)
        return ready

    def _resolve_pending_reqs(self) -> None:
        if not self.pending:
            if not self.mutant("no-stale-cancel"):  # MUTANT: no-stale-cancel — leftovers stay
                self.cancel_all("empty")
            return
        groups = self._by_addr()
        for addr in self._ensure_prefill_info(groups):
            if self.prefill_info_table[addr].get("dp_size") == 1:
                for r in groups[addr]:  # as SGLang: one DP rank, so rank 0, with no query
                    r.prefill_dp_rank = 0
                continue
            need = [
                r for r in groups[addr] if r.prefill_dp_rank is None and r.state is ReqState.PENDING
            ]
            if need:
                self._resolve_addr(addr, need)
        t = now()
        for r in list(self.pending):
            if r.prefill_dp_rank is None and t - r.t_add > self.dc.bootstrap_timeout_s:
                self.sched.abort(
                    r,
                    f"room {r.room} still unknown to the bootstrap server after "
                    f"{self.dc.bootstrap_timeout_s:g} s"
                    + (
                        f" (prefill rank {', '.join(map(str, sorted(self.sched.failed_ranks)))}"
                        " failed)"
                        if self.sched.failed_ranks
                        else ""
                    ),
                )

    def _resolve_addr(self, addr: str, need: list[DecodeReq]) -> None:
        rooms = tuple(r.room for r in need)
        p = self._queries.pop(addr, None)
        t0 = now()
        lead = (t0 - p.t_submit) if p is not None else 0.0
        qid = None
        # MUTANT: prefetch-use-mismatched-rooms — the answer is used whatever rooms it was for
        if p is not None and (p.rooms == rooms or self.mutant("prefetch-use-mismatched-rooms")):
            source, qid = "prefetched", p.qid
            result, error = sync.result(p.future, "prefetch.result")
        elif p is not None and rooms[: len(p.rooms)] == p.rooms:
            # Requests that arrived after the prefetch: the future answers its rooms, the tail is
            # asked synchronously (SGLang's test of PR #35071 expects exactly this). The tail goes
            # first, so that the future's remaining time overlaps it: one round trip, not two.
            source, qid = "prefix", p.qid
            tail, error = self._query(addr, rooms[len(p.rooms) :], next(self._qids), "sync")
            head, head_error = sync.result(p.future, "prefetch.result")
            error = head_error or error
            result = None if error else {**head, **tail}
        else:
            if p is not None:
                self._cancel_popped(addr, p, "mismatch")
            source, lead = "sync", 0.0
            result, error = self._query(addr, rooms, next(self._qids), "sync")
        wait = now() - t0
        self.resolves.append({"source": source, "wait_s": wait, "lead_s": lead, "error": error})
        self.log.resolve(
            addr,
            list(rooms),
            source,
            qid,
            int(wait * 1e9),
            int(lead * 1e9),
            {str(r): k for r, k in (result or {}).items()},
            error,
        )
        if error is not None:
            fails = self._query_failures[addr] = self._query_failures.get(addr, 0) + 1
            if fails >= self.dc.query_failure_budget:
                for r in need:
                    self.sched.abort(
                        r, f"DP-rank query to {addr} failed {fails} times in a row: {error}"
                    )
                self._query_failures.pop(addr, None)
            return
        self._query_failures.pop(addr, None)
        for r in need:
            rank = result.get(r.room)
            if rank is not None:
                r.prefill_dp_rank = rank

    def _cancel_popped(self, addr: str, p: Prefetch, reason: str) -> None:
        # Future.cancel() cannot stop a query the pool thread has already taken (it returns False):
        # that query still runs, its query_begin may come after this event, its answer is never
        # used. The trace records which it was (`stopped`).
        stopped = p.future.cancel()
        self.log.prefetch_cancel(addr, list(p.rooms), p.qid, reason, stopped)

    def pop_preallocated(self) -> list[DecodeReq]:
        """Resolve ranks, then initialise receivers in arrival order while memory lasts. A request
        whose rank is still unknown does not hold back younger ones; one that does not fit in memory
        does (FIFO), and everything stays pending while memory is released: then not even the
        synchronous query runs (no query at all until resume, as in SGLang, where a released decode
        is idle and paused), nor the bootstrap timeout, which would abort rooms nobody asked about."""
        if self.memory_released:
            return []
        self._resolve_pending_reqs()
        out = []
        for r in list(self.pending):
            if r.prefill_dp_rank is None:
                continue
            status = self.sched.init_receiver(r)
            if status is ReceiverInit.NO_MEMORY:
                break
            if status is ReceiverInit.OK:
                self.pending.remove(r)
                out.append(r)
        return out

    def remove(self, req: DecodeReq) -> None:
        if req in self.pending:
            self.pending.remove(req)

    # ---- memory occupation ----------------------------------------------------------------------
    def release_memory_occupation(self) -> None:
        if not self.mutant(
            "no-cancel-on-release"
        ):  # MUTANT: no-cancel-on-release — futures outlive it
            self.cancel_all("release")
        self.memory_released = True
        self.log.release_memory()

    def resume_memory_occupation(self) -> None:
        self.memory_released = False
        self.log.resume_memory()

    def close(self) -> None:
        self.cancel_all("shutdown")
        self._executor.shutdown(wait=False, cancel_futures=True)


def _layout(info: dict | None) -> dict:
    """The parallel info's fields that decide a rank without a query (prefill_info's optional fields)."""
    if not info:
        return {}
    return {k: info[k] for k in ("dp_size", "follow_bootstrap_room") if k in info}
