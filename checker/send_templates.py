"""Templates of the rule kinds about the KV sends (prefill): each computed chunk sent once, in its
own tokens (`chunk_sent`), and what a request holds released only after its sends are delivered
(`delivered`)."""

from __future__ import annotations

from .streaming import TEMPLATES, Template, event_label, has_fields, in_order

_EMPTY: dict = {}


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
        # seq, lo, hi, (lo, hi)]: `remaining` is [(lo, hi)] with that very tuple until a send
        # takes some of it
        self.chunks: dict = {}
        self.tangled: set = set()  # rids some of whose admitted ranges overlap
        self.done_b, self.started_b = set(), set()
        self.ranged: dict = {}  # the struct types of the sends -> whether they have start, tokens

    def on_chunk(self, evs):
        done, started, release = self.done, self.started, self.release
        chunks, tangled, done_b, started_b = self.chunks, self.tangled, self.done_b, self.started_b
        ranged = self.ranged
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
                        if chunk[1]:
                            self._unsent(rid, chunk, e.seq)
            else:
                held = chunks.get(e.rid)
                if held is None:
                    continue
                has = ranged.get(type(e))
                if not (has or has is None and has_fields(ranged, e, ("start", "tokens"))):
                    continue
                lo, tokens = e.start, e.tokens
                if type(lo) is not int or type(tokens) is not int:
                    continue
                if e.rid not in tangled:  # exactly one chunk's tokens, no other chunk holds any
                    for chunk in held:
                        if chunk[3] == lo:
                            left = chunk[1]
                            if chunk[4] == lo + tokens and len(left) == 1 and left[0] is chunk[5]:
                                checks += 1
                                if chunk[0] not in done_b:
                                    self._early(e, chunk[0], left)
                                chunk[1] = []
                                break
                            self._send(e, held, lo, lo + tokens)
                            break
                    else:
                        self._send(e, held, lo, lo + tokens)
                else:
                    self._send(e, held, lo, lo + tokens)
        self.checks += checks

    def _admit(self, e):
        chunks, b, seq = self.chunks, e.batch, e.seq
        for rid, rng in (getattr(e, "chunks", None) or _EMPTY).items():
            if isinstance(rng, list) and len(rng) == 2 and rng[0] < rng[1]:
                lo, hi = span = tuple(rng)
                chunk = [b, [span], seq, lo, hi, span]
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
            left = chunk[1]
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
        batch, left, admit_seq = chunk[0], chunk[1], chunk[2]
        self.fail(
            f"{rid}'s tokens {left[0][0]}..{left[-1][1]} computed by batch {batch} were never sent",
            admit_seq,
            *([seq] if seq is not None else []),
        )

    def finish(self):
        for rid, held in self.chunks.items():
            self.checks += len(held)
            for chunk in held:
                if chunk[1]:
                    self._unsent(rid, chunk, None)


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
    every chunk once a `failed` or a send without an int `start` was seen."""

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
        self.sent: dict = {}  # rid -> {start (None: a send without one): seq of its first send}
        self.closed: dict = {}  # rid -> {start: seq of its first completion}
        self.first_done: dict = {}  # rid -> seq of its first completion (or failed)
        self.walking = False  # from the first `failed` or send without an int start on

    def on_kinds(self, by):
        if self.walking or (self.failed is not None and self.failed in by):
            self.walking = True
            self._walk(in_order(by, self.events))
            return
        try:
            ok = self._record(by)
        except AttributeError:  # a kind without `start`: the walk reads it with a default
            ok, self.walking = False, True
        if ok:
            self.checks += len(by.get(self.consumer, ())) + (
                len(by.get(self.done, ())) if self.sends else 0
            )
        else:  # word the violations, in trace order (recording again changes nothing)
            self._walk(in_order(by, self.events))

    def _record(self, by) -> bool:
        """Record the chunk's sends and completions; whether no judgement of it fails (False also
        where a send has no int start: the walk then takes over for good)."""
        sent, closed, first_done = self.sent, self.closed, self.first_done
        for e in in_order(by, self.sends):  # in trace order: the walk words in send order
            rid, start, seq = e.rid, e.start, e.seq
            if type(start) is not int:
                self.walking = True
                return False
            got = sent.get(rid)
            if got is None:
                sent[rid] = {start: seq}
            elif start not in got:
                got[start] = seq
        ok = True
        if self.sends:
            for e in by.get(self.done, ()):
                rid, start, seq = e.rid, e.start, e.seq
                got = closed.get(rid)
                if got is None:
                    closed[rid] = {start: seq}
                    if rid not in first_done:
                        first_done[rid] = seq
                elif start not in got:
                    got[start] = seq
                if not sent.get(rid, _EMPTY).get(start, seq) < seq:  # completes no earlier send
                    ok = False
            for e in by.get(self.consumer, ()):
                # every send of the rid so far (some may come after it) closed before it
                rid, seq = e.rid, e.seq
                got = sent.get(rid)
                if got:
                    done = closed.get(rid, _EMPTY)
                    for start in got:
                        if not done.get(start, seq) < seq:
                            ok = False
            return ok
        for e in by.get(self.done, ()):
            if e.rid not in first_done:
                first_done[e.rid] = e.seq
        for e in by.get(self.consumer, ()):
            if not first_done.get(e.rid, e.seq) < e.seq:
                ok = False
        return ok

    def on_chunk(self, evs):
        self._walk(evs)

    def _walk(self, evs):
        """Record and judge `evs` (in trace order) one by one."""
        done, failed, consumer = self.done, self.failed, self.consumer
        sent, closed, first_done = self.sent, self.closed, self.first_done
        for e in evs:
            ev, rid, seq = e.ev, e.rid, e.seq
            if ev == done:
                start = getattr(e, "start", None)
                closed.setdefault(rid, {}).setdefault(start, seq)
                first_done.setdefault(rid, seq)
                if self.sends:
                    self.checks += 1
                    got = sent.get(rid, _EMPTY)
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
                first_done.setdefault(rid, seq)
                got = closed.setdefault(rid, {})
                for start, at in sent.get(rid, _EMPTY).items():
                    if at < seq:
                        got.setdefault(start, seq)
            else:  # a send
                start = getattr(e, "start", None)
                if type(start) is not int:
                    start, self.walking = None, True
                sent.setdefault(rid, {}).setdefault(start, seq)

    def _closed_by(self, rid, start, seq) -> bool:
        """Whether the rid's send at `start` (None: a send without one) has a completion before
        `seq`."""
        if start is None:
            return self.first_done.get(rid, seq) < seq
        return self.closed.get(rid, _EMPTY).get(start, seq) < seq

    def _consumer(self, e, rid, seq):
        if not self.sends:
            if not self.first_done.get(rid, seq) < seq:
                self.fail(f"{event_label(e)} for {rid} before any {self.done} of {rid}", seq)
            return
        for start, at in self.sent.get(rid, _EMPTY).items():
            if at < seq and not self._closed_by(rid, start, seq):
                where = f" at token {start}" if start is not None else ""
                self.fail(
                    f"{event_label(e)} for {rid} while its send{where} was not yet delivered "
                    f"(no {self.done} before it)",
                    at,
                    seq,
                )

    def finish(self):
        self.checks += sum(map(len, self.sent.values()))
        closed, end = self.closed, float("inf")
        for rid, sent in self.sent.items():  # in send order
            done = closed.get(rid)
            if done is not None and sent.keys() <= done.keys():  # every start completed
                continue
            for start, seq in sent.items():
                if not self._closed_by(rid, start, end):
                    where = f" at token {start}" if start is not None else ""
                    self.fail(f"{rid}'s send{where} was never delivered ({self.done})", seq)
