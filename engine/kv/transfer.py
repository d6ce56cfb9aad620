"""KV transfer (prefill → decode) and the host-side AttentionStore.

A `KVSender` per request hands chunks to the `TransferEngine`, whose thread waits until the forward
that wrote the chunk has finished on the device, gathers the pages' K/V and delivers them to a
receiver. The in-process `KVReceiverStore` keeps what arrived per bootstrap room; the decode side
(engine/decode/) installs its own receiver. Completion is polled by the prefill inflight queue.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from engine import sync
from engine.runtime import device_ops, inject
from engine.runtime.memory import pages_for
from engine.sync import hb
from spec.vocabulary import TRANSFER


@dataclass
class KVChunk:
    room: int
    start: int  # first position in the request
    k: torch.Tensor  # [layers, tokens, Hkv, D]
    v: torch.Tensor
    pages: int
    last: bool
    meta: dict = field(
        default_factory=dict
    )  # with the last chunk: what decode needs (first token ...)


class KVReceiverStore:
    """Receiver for the embedded prefill-only run: assembles each room's KV on the host."""

    def __init__(self):
        self.rooms: dict[int, dict] = {}
        self._lock = threading.Lock()

    def deliver(self, chunk: KVChunk) -> None:
        with self._lock:
            r = self.rooms.setdefault(chunk.room, {"k": {}, "v": {}, "meta": None, "pages": 0})
            r["k"][chunk.start] = chunk.k
            r["v"][chunk.start] = chunk.v
            r["pages"] += chunk.pages
            if chunk.last:
                r["meta"] = chunk.meta

    def kv(self, room: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rooms[room]
        starts = sorted(r["k"])
        return torch.cat([r["k"][s] for s in starts], 1), torch.cat([r["v"][s] for s in starts], 1)


class TransferEngine:
    def __init__(self, pool, receiver, *, device, mutants: frozenset = frozenset()):
        self.pool = pool
        self.mutants = mutants  # the run's (engine/runtime/inject.py); its senders read them too
        self.receiver = receiver
        self.device = device
        self._q = sync.Inbox()
        self.error: BaseException | None = None
        self._gather = device_ops.ops()["gather_kv"] if pool.k.device.type == "cpu" else None
        # called on this thread with (req, start, tokens) once a chunk's KV is in the receiver's
        # hands: the trace's kv_delivered, what the release of the request's pages must follow
        self.on_delivered = None
        self._thread = sync.start_thread(self._run, TRANSFER)

    def _run(self):
        while True:
            item = self._q.get("transfer.idle")
            if item is None:
                return
            sender, req, idx, start, pages, ready, last, meta = item
            try:
                if ready is not None:
                    ready.synchronize()  # the forward that wrote these pages has finished
                if self._gather is not None:  # CPU: one call (engine/runtime/device_ops.py)
                    k, v = self._gather(self.pool.k, self.pool.v, idx)
                else:
                    i = idx.long()
                    k, v = _pinned_copy(self.pool.k[:, i]), _pinned_copy(self.pool.v[:, i])
                self.receiver.deliver(KVChunk(sender.room, start, k, v, pages, last, meta))
                if self.on_delivered is not None:
                    self.on_delivered(req, start, len(idx))
            except BaseException as exc:
                self.error = exc
            finally:
                sender._done()

    def enqueue(self, *item) -> None:
        self._q.put(item)  # the sender's work happens before the transfer thread takes the item

    def close(self):
        """Stop after the chunks queued so far are delivered (and logged)."""
        self._q.put(None)
        sync.join(self._thread, "transfer.join", timeout=10)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A device tensor copied to pinned host memory: decode's write of the chunk to its device is then
    asynchronous without a second copy to pin it (Tensor.pin_memory keeps a pinned tensor as it is)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


class KVSender:
    """One per request. `send` covers positions [start_send_idx, end) and advances the pointer."""

    def __init__(self, engine: TransferEngine, room: int, page_size: int):
        self.engine, self.room, self.ps = engine, room, page_size
        self._pending = 0
        self._lock = threading.Lock()
        self.sent_last = False

    def send(
        self, req, end: int, ready_event, *, last: bool, meta=None, announce=None
    ) -> tuple[int, int]:
        """Hand positions [start_send_idx, end) to the transfer thread; `announce(tokens, pages)` is
        called before the hand-off, so the send is logged before its delivery can be."""
        start = req.start_send_idx
        tokens = end - start
        pages = pages_for(tokens, self.ps)
        if inject.on(self.engine.mutants, "floor-page-count"):
            pages = tokens // self.ps  # MUTANT: the tail page is rounded down and never sent
        first_page = start // self.ps
        page_ids = req.pages[first_page : first_page + pages]
        idx = self.engine.pool.token_indices(page_ids, 0, len(page_ids) * self.ps)[:tokens]
        with self._lock:
            self._pending += 1
        if announce is not None:
            announce(tokens, pages)
        self.engine.enqueue(self, req, idx, start, pages, ready_event, last, meta or {})
        req.start_send_idx = end
        if last:
            self.sent_last = True
        return tokens, pages

    def _done(self):
        if hb.ON:  # the delivery (and its trace event) happens before a poll that sees it
            hb.send(self)
        with self._lock:
            self._pending -= 1

    def poll(self) -> bool:
        """True once the last chunk was sent and every chunk has been delivered."""
        with self._lock:
            done = self.sent_last and self._pending == 0
        if done and hb.ON:
            hb.recv(self)
        return done


class AttentionStore:
    """Host-side KV store for finished requests. Finished requests of one result-processing step are
    staged together (one cross-request gather, the design's batched staging) before the host write
    consumes the staging buffer; `retire()` at the top of each loop moves completed writes in."""

    def __init__(self, pool, copy_stream, mutants: frozenset = frozenset()):
        self.pool = pool
        self.mutants = mutants  # the run's (engine/runtime/inject.py)
        self.stream = copy_stream
        self.pending: list[tuple] = []
        self.store: dict[str, tuple[int, int]] = {}  # rid -> (tokens, bytes)
        self.staged_batches = 0
        # Verification only (engine/oracle/judge.py): called with each entry's KV as it is retired.
        self.on_entry = None
        # Trace hooks: on_copied(rids) when a staging copy has completed (on the copy stream where
        # the stream runs on a host thread; where the host first sees its event done on CUDA), and
        # on_retired(rid) as each entry is written from it, which must come after.
        self.on_copied = None
        self.on_retired = None

    def stage(self, reqs, ready_event) -> None:
        if not reqs:
            return
        spans, idx = [], []
        for r in reqs:
            ti = self.pool.token_indices(r.pages, 0, len(r.prompt))
            spans.append((r.rid, len(r.prompt)))
            idx.append(ti)
        idx = torch.cat(idx).to(self.pool.k.device)
        pinned = self.pool.k.device.type == "cuda"
        holder = {"on_stream": not pinned}  # a host-thread stream logs its copy's completion

        if not pinned:  # CPU: the gather is the host copy; one call (engine/runtime/device_ops.py)
            stage_kv = device_ops.ops()["stage_kv"]

            def gather():
                holder["kv"] = stage_kv(self.pool.k, self.pool.v, idx)
                self._copied(spans)
        else:

            def gather():  # one gather for all requests, then one device-to-host copy (async on CUDA)
                staged = torch.stack([self.pool.k[:, idx.long()], self.pool.v[:, idx.long()]])
                host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=pinned)
                holder["kv"] = host.copy_(staged, non_blocking=True)

        if ready_event is not None:
            self.stream.wait_event(ready_event)
        self.stream.launch(gather)
        done = self.stream.record_event()
        for r in reqs:
            r.as_event = done
        self.pending.append((done, spans, holder))
        self.staged_batches += 1

    def _copied(self, spans) -> None:
        if self.on_copied is not None:
            self.on_copied([rid for rid, _ in spans])

    def drain(self) -> None:
        """Shutdown: wait for every pending write and retire it."""
        for done, _, _ in self.pending:
            done.synchronize()
        self.retire()

    def retire(self) -> int:
        """Completes finished writes; returns how many were retired."""
        keep, n = [], 0
        for done, spans, holder in self.pending:
            if done.query() or inject.on(
                self.mutants, "retire-before-copy"
            ):  # MUTANT: no wait for the copy
                if not holder["on_stream"] and not holder.get("copied"):  # first seen done here
                    holder["copied"] = True
                    self._copied(spans)
                kv = holder.get("kv")
                off = 0
                for rid, tokens in spans:
                    part = kv[:, :, off : off + tokens] if kv is not None else None
                    self.store[rid] = (
                        tokens,
                        part.numel() * part.element_size() if part is not None else 0,
                    )
                    off += tokens
                    if self.on_retired is not None:
                        self.on_retired(rid)
                    if self.on_entry is not None:
                        self.on_entry(rid, part)
                n += 1
            else:
                keep.append((done, spans, holder))
        self.pending = keep
        return n
