"""An executable abstract model of the four prefill loops: plain Python, no tensors.

The scheduler loop of each mode and the forward worker are generators that mirror
engine/prefill/loops.py, scheduler.py and worker.py step for step: they yield after every trace event
(a schedule point) and, where the engine blocks on a queue, yield the condition they wait for. A
driver picks which runnable thread steps next. Everything the engine leaves to timing is a choice:
which thread runs, when requests arrive (so iterations may admit nothing and pipelines drain), how
many requests a batch takes, whether memory (slots, pages) runs out, and when a finished request's
KV transfer completes (so releases come late, in any order). Every choice sequence is a schedule the
loop code can produce, and the traces it writes are pdo-traces (checker/trace_io.py).

    header, events = run("ahead", random.Random(1))
    write_trace("/tmp/t.jsonl", header, events)
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from .vocabulary import FORWARD as FWD
from .vocabulary import SCHEDULER as SCHED
from .vocabulary import THREAD_LOOPS

_STOP = object()


@dataclass(eq=False)
class Req:
    rid: str
    obj: str
    chunks: list  # tokens per chunk; all but the last are "middle" chunks
    prefix: int  # cached-prefix tokens (0: none), sent once before the first forward
    slot: int | None = None
    next_chunk: int = 0
    inflight_middle_chunks: int = 0
    prefix_sent: bool = False


@dataclass(eq=False)
class Batch:
    bid: int
    reqs: list  # [(Req, chunk index, last)]
    staged: bool = False


@dataclass
class Config:
    requests: int = 6
    max_slots: int = 3  # small, so that slots are reused and admission sometimes waits for memory
    max_batch_reqs: int = 3
    max_chunks: int = 3
    page_size: int = 16
    queue_cap: int = 1


class Choices:
    """Where the model asks "which way?". Backed by a Random; `patience` bounds how long the
    environment may withhold progress (arrivals, transfer completion) so every run terminates."""

    def __init__(self, rnd: random.Random, patience: int = 4):
        self.rnd, self.patience, self.stalled = rnd, patience, 0

    def pick(self, n: int) -> int:
        return self.rnd.randrange(n) if n > 1 else 0

    def chance(self, p: float) -> bool:
        return self.rnd.random() < p

    def progress(self, p: float) -> bool:
        """An environment event that eventually happens: forced after `patience` refusals."""
        if self.stalled >= self.patience or self.rnd.random() < p:
            self.stalled = 0
            return True
        self.stalled += 1
        return False


class World:
    def __init__(self, mode: str, cfg: Config, ch: Choices):
        self.mode, self.cfg, self.ch = mode, cfg, ch
        self.events: list[dict] = []
        self.arrivals = [self._request(i) for i in range(cfg.requests)]
        self.total = len(self.arrivals)
        self.waiting: list[Req] = []
        self.chunked_req: Req | None = None
        self.inflight: list[Req] = []
        self.done = 0
        self.free = list(range(cfg.max_slots))
        self.next_bid = 0
        self.in_q: list = []
        self.out_q: list = []

    def _request(self, i) -> Req:
        ps, ch = self.cfg.page_size, self.ch
        n = 1 + ch.pick(self.cfg.max_chunks)
        chunks = [ps * (1 + ch.pick(4)) for _ in range(n - 1)] + [1 + ch.pick(3 * ps)]
        return Req(f"r{i}", f"o{i + 1}", chunks, ps * ch.pick(3))

    def emit(self, thread, ev, **fields):
        seq = len(self.events) + 1
        self.events.append({"seq": seq, "t_ns": seq * 1000, "thread": thread, "ev": ev, **fields})

    @property
    def finished_all(self) -> bool:
        return self.done == self.total


# ---- scheduler steps (scheduler.py) -----------------------------------------------------------------
# Each is a generator: `yield` after an event lets the other thread run; `yield cond` blocks on cond.


def _ev(w: World, thread, ev, **f):
    w.emit(thread, ev, **f)
    yield


def _pages(w, tokens):
    return -(-tokens // w.cfg.page_size)


def loop_top(w: World):
    """retire_ascache_writes, ingest_requests, get_next_batch."""
    if w.arrivals and (not (w.waiting or w.chunked_req) or w.ch.chance(0.5)):
        if w.ch.progress(0.6):
            k = 1 + w.ch.pick(len(w.arrivals))
            w.waiting += w.arrivals[:k]
            del w.arrivals[:k]
    budget = 1 + w.ch.pick(w.cfg.max_batch_reqs)
    picked = []
    continuing, w.chunked_req = w.chunked_req, None
    candidates = ([continuing] if continuing else []) + list(w.waiting)
    for req in candidates:
        if len(picked) >= budget:
            break
        if req.slot is None:
            if not w.free:
                break  # out of slots: keep FIFO order, try again next round
            req.slot = w.free.pop(0)
            yield from _ev(w, SCHED, "alloc", rid=req.rid, obj=req.obj, slot=req.slot)
        if w.ch.chance(0.05):
            break  # out of pages: the slot stays taken, admission waits
        last = req.next_chunk == len(req.chunks) - 1
        if req in w.waiting:
            w.waiting.remove(req)
        picked.append((req, req.next_chunk, last))
        req.next_chunk += 1
        if not last:
            w.chunked_req = req
            break  # one chunked request at a time
    if continuing is not None and all(r is not continuing for r, _, _ in picked):
        w.chunked_req = continuing  # not admitted this round: stays first in line
    if not picked:
        return None
    b = Batch(w.next_bid, picked)
    w.next_bid += 1
    yield from _ev(w, SCHED, "admit", batch=b.bid, rids=[r.rid for r, _, _ in picked])
    for req, _, last in picked:
        if not last:
            req.inflight_middle_chunks += 1
            yield from _ev(
                w, SCHED, "chunk_inc", rid=req.rid, obj=req.obj, value=req.inflight_middle_chunks
            )
    return b


def stage(w, b, thread):
    b.staged = True
    yield from _ev(w, thread, "stage", batch=b.bid)


def maybe_send_cached_prefix(w, b, req, thread):
    if req.prefix_sent:
        return
    req.prefix_sent = True
    if req.prefix:
        yield from _ev(
            w,
            thread,
            "prefix_send",
            batch=b.bid,
            rid=req.rid,
            obj=req.obj,
            tokens=req.prefix,
            pages=_pages(w, req.prefix),
        )


def run_batch(w, b, thread, early_send_prefix=True):
    yield from _ev(w, thread, "fwd_begin", batch=b.bid, digest=f"d{b.bid}")
    if early_send_prefix:
        for req, _, _ in b.reqs:
            yield from maybe_send_cached_prefix(w, b, req, thread)
    if not b.staged:
        yield from stage(w, b, thread)
    yield from _ev(w, thread, "fwd_end", batch=b.bid)


def war_barrier(w, b, thread):
    yield from _ev(w, thread, "war_barrier", batch=b.bid)


def sample(w, b):
    yield from _ev(w, SCHED, "sample", batch=b.bid)


def process_batch_result(w, b):
    yield from _ev(w, SCHED, "process_begin", batch=b.bid)
    finished = []
    for req, k, _ in b.reqs:
        tokens = req.chunks[k]
        if req.inflight_middle_chunks > 0:
            req.inflight_middle_chunks -= 1
            yield from _ev(
                w, SCHED, "chunk_dec", rid=req.rid, obj=req.obj, value=req.inflight_middle_chunks
            )
        else:
            finished.append(req)
        yield from _ev(
            w, SCHED, "kv_send", rid=req.rid, obj=req.obj, tokens=tokens, pages=_pages(w, tokens)
        )
    yield from _ev(w, SCHED, "process_end", batch=b.bid)
    w.inflight += finished


def process_inflight_queue(w):
    """Release the requests whose KV transfer has completed (each polled: a choice)."""
    still = []
    for req in w.inflight:
        if w.ch.progress(0.7):
            yield from _ev(w, SCHED, "release", rid=req.rid, obj=req.obj, slot=req.slot)
            w.free.append(req.slot)
            w.free.sort()
            req.slot = None
            w.done += 1
        else:
            still.append(req)
    w.inflight = still


def snapshot(w, b):
    yield from _ev(w, SCHED, "snapshot", batch=b.bid, digest=f"d{b.bid}")
    return b


# ---- the forward worker (worker.py) -----------------------------------------------------------------


def worker(w: World):
    while True:
        yield lambda: bool(w.in_q)
        item = w.in_q.pop(0)
        if item is _STOP:
            return
        b, early = item
        yield from run_batch(w, b, FWD, early_send_prefix=early)
        yield from war_barrier(w, b, FWD)
        yield from _ev(w, FWD, "batch_copy", batch=b.bid)
        yield lambda: len(w.out_q) < w.cfg.queue_cap
        w.out_q.append(b)


def submit(w, b, early):
    yield from _ev(w, SCHED, "submit", batch=b.bid)
    yield lambda: len(w.in_q) < w.cfg.queue_cap
    w.in_q.append((b, early))


def collect(w):
    yield lambda: bool(w.out_q)
    b = w.out_q.pop(0)
    yield from _ev(w, SCHED, "collect", batch=b.bid)
    return b


def shutdown(w):
    yield lambda: len(w.in_q) < w.cfg.queue_cap
    w.in_q.append(_STOP)


# ---- the four loops (loops.py) ------------------------------------------------------------------------


def loop_normal(w):
    while not w.finished_all:
        b = yield from loop_top(w)
        if b:
            yield from run_batch(w, b, SCHED)  # samples inline: no `sample` event
            yield from war_barrier(w, b, SCHED)
            yield from process_batch_result(w, b)
        yield from process_inflight_queue(w)


def loop_overlap(w):
    last = None
    while not w.finished_all or last:
        b = yield from loop_top(w)
        if b:
            yield from run_batch(w, b, SCHED)
            yield from war_barrier(w, b, SCHED)
        if last:
            yield from process_batch_result(w, last)
        yield from process_inflight_queue(w)
        if b:
            yield from sample(w, b)
        last = b


def loop_thread(w):
    last = None
    while not w.finished_all or last:
        b = yield from loop_top(w)
        if b:
            snap = yield from snapshot(w, b)
            yield from submit(w, snap, early=True)
            yield from collect(w)
        if last:
            yield from process_batch_result(w, last)
        yield from process_inflight_queue(w)
        if b:
            yield from sample(w, b)
        last = b
    yield from shutdown(w)


def loop_ahead(w):
    inflight = None
    while not w.finished_all or inflight:
        b = yield from loop_top(w)
        previous = None
        if inflight is not None:
            previous = yield from collect(w)
            yield from sample(w, previous)
        if b:
            snap = yield from snapshot(w, b)
            yield from stage(w, snap, SCHED)
            for req, _, _ in snap.reqs:
                yield from maybe_send_cached_prefix(w, snap, req, SCHED)
            yield from submit(w, snap, early=False)
        if previous is not None:
            yield from process_batch_result(w, previous)
        yield from process_inflight_queue(w)
        inflight = b
    yield from shutdown(w)


LOOPS = {"normal": loop_normal, "overlap": loop_overlap, "thread": loop_thread, "ahead": loop_ahead}


# ---- the driver -----------------------------------------------------------------------------------------


def run(
    mode: str,
    rnd: random.Random | None = None,
    cfg: Config | None = None,
    *,
    policy=None,
    max_steps: int = 200_000,
) -> tuple[dict, list[dict]]:
    """One schedule of `mode`: (header, events). `policy(runnable, world)` may pick the thread that
    steps next (default: a random choice)."""
    cfg = cfg or Config()
    ch = Choices(rnd or random.Random(0))
    w = World(mode, cfg, ch)
    threads = {SCHED: LOOPS[mode](w)}
    if mode in THREAD_LOOPS:
        threads[FWD] = worker(w)
    waiting = {t: None for t in threads}
    for _ in range(max_steps):
        if SCHED not in threads:
            break
        runnable = [t for t in threads if waiting[t] is None or waiting[t]()]
        if not runnable:
            raise RuntimeError(f"abstract {mode}: deadlock at event {len(w.events)}")
        t = policy(runnable, w) if policy else runnable[ch.pick(len(runnable))]
        try:
            got = next(threads[t])
            waiting[t] = got if callable(got) else None
        except StopIteration:
            del threads[t]
    else:
        raise RuntimeError(f"abstract {mode}: no end after {max_steps} steps")
    header = {
        "format": "pdo-trace",
        "version": 1,
        "role": "prefill",
        "mode": mode,
        "page_size": cfg.page_size,
        "source": "spec.abstract",
    }
    return header, w.events


def scheduler_first(runnable, w):
    """A deterministic policy: the scheduler runs whenever it can (the worker fills its waits)."""
    return SCHED if SCHED in runnable else runnable[0]


def write_trace(path, header: dict, events: list[dict]) -> str:
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        for e in events:
            f.write(json.dumps(e, separators=(",", ":")) + "\n")
    return str(path)
