"""Admission of the prefill scheduler: fold the previous batch, continue the chunked request, admit
waiting requests (prefix match, slot and page allocation), cut chunks to the token budget and build
the batch's inputs. PrefillScheduler (engine/prefill/scheduler.py) holds one; it owns the waiting
queue, the chunked request and the batch ids, and uses the pools and the prefix cache it is given.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.runtime import inject
from engine.runtime.config import EngineConfig
from engine.runtime.memory import KVPool, PrefixCache, ReqToTokenPool, pages_for
from engine.runtime.request import Req, SamplingBatchInfo, ScheduleBatch


@dataclass(eq=False)
class Admission:
    """The admission steps, with what they read and write. `stats` is the scheduler's counter dict
    (admission adds batches, tokens, cached tokens and the memory-pressure counts); `log` the
    scheduler's event loggers; `release` frees a request's slot and pages (for a mutant only);
    `probe` (engine/oracle/judge.py) is told each prefix match when outputs are verified."""

    cfg: EngineConfig
    device: torch.device
    pool: KVPool
    req_to_token: ReqToTokenPool
    cache: PrefixCache
    log: Any
    stats: dict
    release: Callable[..., None] | None
    probe: Any = None
    waiting: list[Req] = field(default_factory=list)
    chunked_req: Req | None = None
    last_batch: ScheduleBatch | None = None
    next_bid: int = 0
    postponed: set[str] = field(default_factory=set)  # rids cut short for lack of memory

    def __post_init__(self):
        for k in (
            "failed_slot_allocs",
            "failed_page_allocs",
            "postponed_requests",
            "postponed_chunks",
            "retried_ok",
            "cached_tokens",
            "batches",
            "tokens",
        ):
            self.stats.setdefault(k, 0)

    def get_next_batch(self) -> ScheduleBatch | None:
        """Admission: fold the previous batch, continue the chunked request, admit waiting requests
        (prefix match, slot and page allocation), cut chunks to the token budget, build inputs."""
        cfg, ps = self.cfg, self.cfg.page_size
        if self.last_batch is not None:
            # As SGLang's filter_batch on the last batch: in place, keeping only the continuing chunk.
            keep = [i for i, r in enumerate(self.last_batch.reqs) if r is self.chunked_req]
            self.last_batch.filter(keep)
            self.last_batch = None
        budget = cfg.max_batch_tokens
        picked: list[tuple[Req, int, int, bool]] = []
        continuing, self.chunked_req = self.chunked_req, None
        candidates = ([continuing] if continuing else []) + list(self.waiting)
        for req in candidates:
            if len(picked) >= cfg.max_batch_reqs or budget < ps:
                break
            if req.slot is None and not self._prepare(req):
                self._postpone(req, "slot")
                break  # out of slots: keep FIFO order, try again next round
            take = min(req.remaining, cfg.chunk_size, budget)
            last = take == req.remaining
            if not last:
                take -= take % ps
                if take == 0:
                    break
            if not self._alloc_pages(req, req.filled + take):
                self._postpone(req, "pages")
                break
            if req.rid in self.postponed:
                self.postponed.discard(req.rid)
                self.stats["retried_ok"] += 1
            if req in self.waiting:
                self.waiting.remove(req)
            picked.append((req, req.filled, take, last))
            req.filled += take
            budget -= take
            if not last:
                self.chunked_req = req
                break  # one chunked request at a time, as in SGLang
            if cfg.admission_cost_us:
                _busy_wait_us(cfg.admission_cost_us)
        if continuing is not None and all(p[0] is not continuing for p in picked):
            self.chunked_req = (
                continuing  # not admitted this round (no pages yet): stays first in line
            )
        if not picked:
            return None
        return self._build_batch(picked)

    def _postpone(self, req: Req, lacking: str) -> None:
        """Count an admission cut short for lack of a slot or pages: the request (its first chunk)
        or the chunked request's next chunk waits for the next round."""
        self.stats["failed_slot_allocs" if lacking == "slot" else "failed_page_allocs"] += 1
        chunk = req.slot is not None and req.filled > req.prefix_len
        self.stats["postponed_chunks" if chunk else "postponed_requests"] += 1
        self.postponed.add(req.rid)

    def memory_stats(self) -> dict:
        """How often the run met memory pressure: evictions from the prefix cache, allocations that
        failed (and so postponed a request or a chunk), and postponed ones admitted later."""
        st = self.stats
        return {
            "evicted_pages": self.cache.evicted_pages,
            "evict_calls": self.cache.evict_calls,
            "failed_allocs": st["failed_slot_allocs"] + st["failed_page_allocs"],
            "failed_slot_allocs": st["failed_slot_allocs"],
            "failed_page_allocs": st["failed_page_allocs"],
            "postponed_requests": st["postponed_requests"],
            "postponed_chunks": st["postponed_chunks"],
            "retried_ok": st["retried_ok"],
        }

    def _prepare(self, req: Req) -> bool:
        """First admission of a request: prefix-cache match, a req_to_token slot."""
        if self.req_to_token.available == 0:
            return False
        nodes = self.cache.match(req.prompt, len(req.prompt) - 1)
        self.cache.lock(nodes)
        req.prefix_nodes = nodes
        req.pages = [n.page for n in nodes]
        req.prefix_len = req.filled = len(nodes) * self.cfg.page_size
        req.prefix_sent = req.prefix_len == 0
        req.slot = self.req_to_token.alloc()
        if req.pages:
            idx = self.pool.token_indices(req.pages, 0, req.prefix_len)
            self.req_to_token.table[req.slot, : req.prefix_len] = idx.to(self.device)
            if (
                self.probe is not None
            ):  # verification only (engine/oracle/judge.py): the matched pages' KV
                self.probe.prefix_matched(self.pool, req, req.pages, idx)
        self.log.alloc(req.rid, req, req.slot)
        self.stats["cached_tokens"] += req.prefix_len
        return True

    def _alloc_pages(self, req: Req, end: int) -> bool:
        need = pages_for(end, self.cfg.page_size) - len(req.pages)
        if need <= 0:
            return True
        if self.pool.available < need:
            self.cache.evict(need - self.pool.available)
        pages = self.pool.alloc(need)
        if pages is None:
            return False
        start = len(req.pages) * self.cfg.page_size
        req.pages.extend(pages)
        stop = len(req.pages) * self.cfg.page_size
        self.req_to_token.table[req.slot, start:stop] = self.pool.token_indices(
            req.pages, start, stop
        ).to(self.device)
        return True

    def _build_batch(self, picked) -> ScheduleBatch:
        bid = self.next_bid
        self.next_bid += 1
        reqs = [p[0] for p in picked]
        ids, pos, loc = [], [], []
        on_host = self.device.type == "cpu"
        for req, start, take, _last in picked:
            ids.append(torch.tensor(req.prompt[start : start + take], dtype=torch.int32))
            pos.append(torch.arange(start, start + take, dtype=torch.int32))
            # the req_to_token row as written (_prepare, _alloc_pages); on a GPU from the host's pages,
            # not read back (a device-to-host copy per request)
            loc.append(
                self.req_to_token.table[req.slot, start : start + take]
                if on_host
                else self.pool.token_indices(req.pages, start, start + take)
            )
        ids, pos, loc = torch.cat(ids), torch.cat(pos), torch.cat(loc)
        if not on_host:
            # Pinned, so that staging's copies are asynchronous: a copy from pageable memory waits for
            # the schedule stream, which waits for the forward in flight (the WAR barrier).
            ids, pos, loc = ids.pin_memory(), pos.pin_memory(), loc.pin_memory()
        batch = ScheduleBatch(
            bid=bid,
            reqs=reqs,
            starts=[p[1] for p in picked],
            extends=[p[2] for p in picked],
            last_chunk=[p[3] for p in picked],
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            sampling_info=SamplingBatchInfo.build(
                reqs, self.cfg.model_config.vocab_size, self.device
            ),
        )
        self.log.admit(
            bid,
            [r.rid for r in reqs],
            {r.rid: [s, s + n] for r, s, n in zip(reqs, batch.starts, batch.extends)},
        )
        for req, last in zip(reqs, batch.last_chunk):
            if not last:
                req.inflight_middle_chunks += 1
                self.log.chunk_inc(req.rid, req, req.inflight_middle_chunks)
            elif inject.on(self.cfg.inject, "free-slot-before-forward-done"):
                # MUTANT: slot and pages freed as soon as the last chunk is scheduled; the request still
                # uses them (its forward reads the req_to_token row, its KV send reads the pages).
                self.release(req, early=True)
        self.stats["batches"] += 1
        self.stats["tokens"] += batch.num_tokens
        self.last_batch = batch
        return batch


def _busy_wait_us(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass
