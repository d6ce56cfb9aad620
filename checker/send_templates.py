"""Templates of the rule kinds about the KV sends (prefill): each computed chunk sent once, in its
own tokens (`chunk_sent`), and what a request holds released only after its sends are delivered
(`delivered`)."""

from __future__ import annotations

from collections import deque
from operator import attrgetter, itemgetter

from .recent import Generations
from .streaming import TEMPLATES, Template, event_label, in_order

_EMPTY: dict = {}
_SECOND = itemgetter(1)
_BATCH = attrgetter("batch")


@TEMPLATES.register("chunk_sent")
class ChunkSent(Template):
    """For traces whose admits carry `chunks` (rid -> [start, end), the prompt tokens the batch
    computes for it) and whose sends carry `start`: every one of those tokens is sent
    ([start, start + tokens)) once batch N's results were waited for (`done`(N) before the send),
    or with a device wait on the forward (`device_wait` true, `started`(N) before the send), and
    before the request is released. Sends without `start` are not judged; a trace without `chunks`
    has nothing to check."""

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.sends, self.done, self.started, self.release = (
            tuple(rule["sends"]),
            rule["done"],
            rule["started"],
            rule["release"],
        )
        self.events = ("admit", self.done, self.started, self.release, *self.sends)
        # rid -> its chunks not yet released, each [batch, remaining [lo, hi) intervals, admit
        # seq, lo, hi]: `remaining` is None (all of [lo, hi)) until a send takes some of it (no
        # interval built per chunk for the usual send of the whole chunk at once)
        self.chunks: dict = {}
        self.tangled: set = set()  # rids some of whose admitted ranges overlap
        self.done_b, self.started_b = set(), set()
        # the kinds of sends without start and tokens in the trace's format: not judged
        self.unranged = frozenset(k for k in self.sends if not ctx.has(k, "start", "tokens"))

    def idle(self, by) -> bool:
        """With no chunk held and no admit of the chunk carrying chunks (a trace without them), a
        send or a release has nothing to judge: only the batches done and started are kept."""
        if self.chunks or any(getattr(e, "chunks", None) for e in by.get("admit", ())):
            return False
        self.done_b.update(map(_BATCH, by.get(self.done, ())))
        self.started_b.update(map(_BATCH, by.get(self.started, ())))
        return True

    def on_chunk(self, evs):
        done, started, release = self.done, self.started, self.release
        chunks, tangled, done_b, started_b = self.chunks, self.tangled, self.done_b, self.started_b
        unranged = self.unranged
        checks = 0
        for e in evs:
            ev = e.ev
            if ev == "admit":
                self._admit(e)
            elif ev == done:
                done_b.add(e.batch)
            elif ev == started:
                started_b.add(e.batch)
            elif ev == release:
                rid = e.rid
                held = chunks.pop(rid, None)
                if held is not None:
                    checks += len(held)
                    tangled.discard(rid)
                    for chunk in held:
                        if chunk[1] is None or chunk[1]:
                            self._unsent(rid, chunk, e.seq)
            else:
                held = chunks.get(e.rid)
                if held is None:
                    continue
                if unranged and ev in unranged:
                    continue
                lo, tokens = e.start, e.tokens
                if type(lo) is not int or type(tokens) is not int:
                    continue
                if e.rid not in tangled:  # exactly one chunk's tokens, no other chunk holds any
                    for chunk in held:
                        if chunk[3] == lo:
                            if chunk[4] == lo + tokens and chunk[1] is None:
                                checks += 1
                                if chunk[0] not in done_b:
                                    self._early(e, chunk[0], _left(chunk))
                                chunk[1] = ()
                                break
                            self._send(e, held, lo, lo + tokens)
                            break
                    else:  # (a prefix send: mostly tokens no chunk of the request computes)
                        hi = lo + tokens
                        for chunk in held:
                            if chunk[3] < hi and lo < chunk[4]:
                                self._send(e, held, lo, hi)
                                break
                else:
                    self._send(e, held, lo, lo + tokens)
        self.checks += checks

    def _admit(self, e):
        chunks, b, seq = self.chunks, e.batch, e.seq
        for rid, rng in (getattr(e, "chunks", None) or _EMPTY).items():
            if isinstance(rng, list) and len(rng) == 2 and rng[0] < rng[1]:
                lo, hi = rng
                chunk = [b, None, seq, lo, hi]
                held = chunks.get(rid)
                if held is None:
                    chunks[rid] = [chunk]
                    continue
                for c in held:
                    if c[3] < hi and lo < c[4]:
                        self.tangled.add(rid)
                        break
                held.append(chunk)

    def _send(self, e, held, lo, hi):
        """A send of tokens [lo, hi) of e.rid: each admitted chunk it covers in part is judged."""
        for chunk in held:
            left = _left(chunk)
            if not left or left[0][0] >= hi or left[-1][1] <= lo:  # nothing of it in [lo, hi)
                continue
            hit = [(max(a, lo), min(b, hi)) for a, b in left if max(a, lo) < min(b, hi)]
            if not hit:
                continue
            self.checks += 1
            batch = chunk[0]
            if batch not in self.done_b:
                self._early(e, batch, hit)
            chunk[1] = [
                p for a, b in left for p in ((a, min(b, lo)), (max(a, hi), b)) if p[0] < p[1]
            ]

    def _early(self, e, batch, hit):
        """A send of batch `batch`'s tokens before its `done`: a violation unless the send waits
        on the device for a forward that has begun."""
        wait = getattr(e, "device_wait", None) is True
        if wait and batch in self.started_b:
            return
        how = (
            "with a device wait before its forward began"
            if wait
            else f"before {self.done}({batch}), with no device wait"
        )
        self.fail(
            f"{event_label(e)} sends {e.rid}'s tokens "
            f"{hit[0][0]}..{hit[-1][1]} of batch {batch} {how}",
            e.seq,
        )

    def _unsent(self, rid, chunk, seq):
        """A chunk with tokens left unsent at the release of its rid (`seq`; None: at the end)."""
        batch, left, admit_seq = chunk[0], _left(chunk), chunk[2]
        self.fail(
            f"{rid}'s tokens {left[0][0]}..{left[-1][1]} computed by batch {batch} were never sent",
            admit_seq,
            *([seq] if seq is not None else []),
        )

    def finish(self):
        for rid, held in self.chunks.items():
            self.checks += len(held)
            for chunk in held:
                if chunk[1] is None or chunk[1]:
                    self._unsent(rid, chunk, None)


def _first_wins(old: dict, gen: dict) -> None:
    # (in C; older generations first: the first completion stays)
    deque(map(old.setdefault, gen, gen.values()), maxlen=0)


def _left(chunk: list):
    """The [lo, hi) intervals of an admitted chunk not sent yet."""
    return [(chunk[3], chunk[4])] if chunk[1] is None else chunk[1]


@TEMPLATES.register("delivered")
class Delivered(Template):
    """A consumer comes after the completion it needs (spec/z3model/delivery_encodings.py encodes the
    same): without `sends`, some `done` of the rid before each `consumer`; with `sends`, the `done`
    of each of the rid's sends before the consumer (the same `start` where the send carries one),
    every send completed by the end, and no completion without an earlier send. A `failed` of the
    rid (its transfer ended in failure) completes every send of the rid logged before it.

    The state is the seq of the first occurrence of each fact (a send, a completion), and every
    judgement compares seqs: "X before event e" is "X's first seq < e.seq". First occurrences do
    not depend on the order they are recorded in, so `on_kinds` records a chunk a kind at a time
    (no merge, no dispatch per event), then judges it; only a chunk in which some judgement fails
    is walked again event by event (`_walk`, which words the violations in trace order), and so is
    every chunk once a `failed` or a send without an int `start` was seen. The messages name sends
    in the order they were first made (sorted by seq: recording a kind at a time does not keep
    it)."""

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.done, self.consumer = rule["done"], rule["consumer"]
        self.failed = rule.get("failed")
        self.sends = tuple(rule.get("sends") or ())
        self.events = (
            self.done,
            self.consumer,
            *self.sends,
            *([self.failed] if self.failed else []),
        )
        # with `sends`: rid -> [{start (None: a send without one): seq of its first send},
        # {start: seq of its first completion} or None, seq of its first completion (or failed)
        # or None]: one entry per request, so that an event looks its request up once (a table
        # per fact costs a lookup, mostly a cache miss, per fact).
        self.reqs: dict = {}
        # without `sends`: rid -> seq of its first completion, by generation (checker/recent.py: a
        # consumer reads the completion of its own chunk or the one before, mostly)
        self.first = Generations(_first_wins)
        # with `sends`: the rids some of whose sends may not be completed (a send was recorded
        # since the last consumer that found them all completed): the only ones finish reads
        self.pending: set = set()
        self.sent_keys = 0  # with `sends`: the (rid, start) sent, each counted once
        self.walking = False  # from the first `failed` or send without an int start on

    def on_kinds(self, by):
        if self.walking or (self.failed is not None and self.failed in by):
            self.walking = True
            self._walk(in_order(by, self.events))
            return
        try:
            ok = self._record(by) if self.sends else self._record_done(by)
        except AttributeError:  # a kind without `start`: the walk reads it with a default
            ok, self.walking = False, True
        if ok:
            self.checks += len(by.get(self.consumer, ())) + (
                len(by.get(self.done, ())) if self.sends else 0
            )
        else:  # word the violations, in trace order (recording again changes nothing)
            self._walk(in_order(by, self.events))
        self.first.age()

    def _record_done(self, by) -> bool:
        """Without sends: record the chunk's completions; whether every consumer follows one."""
        first_done, ok = self.first.young, True
        for e in by.get(self.done, ()):
            if e.rid not in first_done:
                first_done[e.rid] = e.seq
        for e in by.get(self.consumer, ()):
            if not self._done_before(e.rid, e.seq):
                ok = False
        return ok

    def _done_before(self, rid, seq) -> bool:
        """Without sends: whether a completion of `rid` was recorded before `seq`."""
        first = self.first.young.get(rid)
        return first is not None and first < seq or self.first.find(rid, seq.__gt__)

    def _record(self, by) -> bool:
        """Record the chunk's sends and completions; whether no judgement of it fails (False also
        where a send has no int start: the walk then takes over for good)."""
        reqs, pending, new = self.reqs, self.pending, 0
        for kind in self.sends:  # a kind at a time: keep the earliest seq of each (rid, start)
            for e in by.get(kind, ()):
                rid, start, seq = e.rid, e.start, e.seq
                if type(start) is not int:
                    self.walking, self.sent_keys = True, self.sent_keys + new
                    return False
                req = reqs.get(rid)
                if req is None:
                    reqs[rid] = [{start: seq}, None, None]
                    pending.add(rid)
                    new += 1
                else:
                    got = req[0]
                    first = got.setdefault(start, seq)
                    if first == seq:
                        pending.add(rid)
                        new += 1
                    elif first > seq:  # also sent by a kind recorded before, later
                        got[start] = seq
        self.sent_keys += new
        ok = True
        for e in by.get(self.done, ()):
            rid, start, seq = e.rid, e.start, e.seq
            req = reqs.get(rid)
            if req is None:  # completes no send
                reqs[rid] = [{}, {start: seq}, seq]
                ok = False
                continue
            closed = req[1]
            if closed is None:
                req[1] = {start: seq}
                if req[2] is None:
                    req[2] = seq
            elif start not in closed:
                closed[start] = seq
            if not req[0].get(start, seq) < seq:  # completes no earlier send
                ok = False
        for e in by.get(self.consumer, ()):
            # every send of the rid so far (some may come after it) closed before it
            rid, seq = e.rid, e.seq
            req = reqs.get(rid)
            if req is not None and req[0]:
                closed = req[1] or _EMPTY
                for start in req[0]:
                    if not closed.get(start, seq) < seq:
                        ok = False
                        break
                else:
                    pending.discard(rid)
        return ok

    def on_chunk(self, evs):
        self._walk(evs)

    def _req(self, rid) -> list:
        req = self.reqs.get(rid)
        if req is None:
            req = self.reqs[rid] = [{}, None, None]
        return req

    def _walk(self, evs):
        """Record and judge `evs` (in trace order) one by one."""
        done, failed, consumer = self.done, self.failed, self.consumer
        if not self.sends:
            first_done = self.first.young
            for e in evs:
                rid, seq = e.rid, e.seq
                if e.ev == done or e.ev == failed:  # a failed transfer is over too
                    first_done.setdefault(rid, seq)
                else:
                    self.checks += 1
                    if not self._done_before(rid, seq):
                        self.fail(f"{event_label(e)} for {rid} before any {done} of {rid}", seq)
            return
        for e in evs:
            ev, rid, seq = e.ev, e.rid, e.seq
            if ev == done:
                start = getattr(e, "start", None)
                req = self._req(rid)
                if req[1] is None:
                    req[1] = {}
                req[1].setdefault(start, seq)
                if req[2] is None:
                    req[2] = seq
                self.checks += 1
                got = req[0]
                if not (got.get(start, seq) < seq or got.get(None, seq) < seq):
                    self.fail(
                        f"{event_label(e)} completes a send of {rid} at token {start} "
                        "that was never made",
                        seq,
                    )
            elif ev == consumer:
                self.checks += 1
                self._consumer(e, rid, seq)
            elif ev == failed:  # every send of the rid so far is over: completed, undelivered
                req = self._req(rid)
                if req[2] is None:
                    req[2] = seq
                if req[1] is None:
                    req[1] = {}
                for start, at in req[0].items():
                    if at < seq:
                        req[1].setdefault(start, seq)
            else:  # a send
                start = getattr(e, "start", None)
                if type(start) is not int:
                    start, self.walking = None, True
                got = self._req(rid)[0]
                if start not in got:
                    got[start] = seq
                    self.sent_keys += 1
                elif got[start] > seq:  # recorded from a later send, a kind at a time
                    got[start] = seq
                self.pending.add(rid)

    @staticmethod
    def _closed_by(req, start, seq) -> bool:
        """Whether the request's send at `start` (None: a send without one) has a completion
        before `seq`."""
        if start is None:
            return req[2] is not None and req[2] < seq
        return (req[1] or _EMPTY).get(start, seq) < seq

    def _consumer(self, e, rid, seq):
        req = self.reqs.get(rid)
        if req is None:
            return
        for start, at in sorted(req[0].items(), key=_SECOND):  # in send order
            if at < seq and not self._closed_by(req, start, seq):
                where = f" at token {start}" if start is not None else ""
                self.fail(
                    f"{event_label(e)} for {rid} while its send{where} was not yet delivered "
                    f"(no {self.done} before it)",
                    at,
                    seq,
                )

    def finish(self):
        if not self.sends:
            return
        reqs, end = self.reqs, float("inf")
        self.checks += self.sent_keys
        late = []  # (rid, its sends) with some send never completed
        for rid in self.pending:
            req = reqs[rid]
            closed = req[1]
            if closed is not None and req[0].keys() <= closed.keys():  # every start completed
                continue
            late.append((min(req[0].values()), rid, req))
        for _, rid, req in sorted(late):  # in the order of their first sends
            for start, seq in sorted(req[0].items(), key=_SECOND):
                if not self._closed_by(req, start, end):
                    where = f" at token {start}" if start is not None else ""
                    self.fail(f"{rid}'s send{where} was never delivered ({self.done})", seq)
