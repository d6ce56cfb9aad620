"""Templates of the rule kinds about requests and what they hold (both roles): the middle-chunk
counter, slot and request lifecycles, page counts, and the requests a batch's spans work on."""

from __future__ import annotations

from .recent import Generations
from .streaming import TEMPLATES, Template

_EMPTY: dict = {}


@TEMPLATES.register("counter")
class Counter(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.inc, self.dec, self.owner = rule["inc"], rule["dec"], rule["owner"]
        self.events = (self.inc, self.dec, self.owner)
        # the objects allocated: rid -> its first (per generation: checker/recent.py; a counter
        # event reads the allocations of its chunk or the one before, mostly), and (rid, obj) for
        # any other (rare), so that no pair is built per allocation
        self.also: set = set()
        self.owned = Generations(self._merge)
        self.value = {}  # obj -> (value, last seq, rid)

    def _merge(self, old: dict, gen: dict) -> None:
        kept = list(map(old.setdefault, gen, gen.values()))  # (in C)
        if kept != list(gen.values()):  # another object of a rid allocated before (rare)
            self.also.update(
                (rid, obj) for rid, obj, was in zip(gen, gen.values(), kept) if was != obj
            )

    def on_chunk(self, evs):
        owner, inc, also, value = self.owner, self.inc, self.also, self.value
        owned = self.owned.young
        for e in evs:
            ev, rid, obj = e.ev, e.rid, e.obj
            if ev == owner:
                if owned.setdefault(rid, obj) != obj:
                    also.add((rid, obj))
                continue
            self.checks += 1
            if (
                owned.get(rid) != obj
                and (rid, obj) not in also
                and not self.owned.find(rid, obj.__eq__)
            ):
                self.fail(
                    f"{ev} for {rid} on object {obj}, which is not the Req object allocated "
                    f"for {rid}",
                    e.seq,
                )
            cur = value.get(obj, (0, None, rid))[0]
            want = cur + (1 if ev == inc else -1)
            if e.value != want:
                self.fail(
                    f"{ev} for {rid} reports {e.value}, expected {want} on object {obj}", e.seq
                )
            if e.value < 0:
                self.fail(f"{ev} for {rid} drove the counter below zero ({e.value})", e.seq)
            value[obj] = (e.value, e.seq, rid)
        self.owned.age()

    def finish(self):
        for obj, (v, s, rid) in self.value.items():
            self.checks += 1
            if v != 0:
                self.fail(f"inflight_middle_chunks of {rid} (object {obj}) ends at {v}, not 0", s)


@TEMPLATES.register("lifecycle")
class Lifecycle(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.acq, self.rel = rule["acquire"], rule["release"]
        self.mode = rule["check"]
        self.live = {}  # rid -> its acquiring event (obj, slot, seq)
        self.slots = {}  # slot -> the acquiring event that holds it
        if self.mode == "pairing":
            self.events = (self.acq, self.rel)
        else:
            inc, dec = rule["counter"]
            self.inc, self.dec, self.sent = inc, dec, rule["sent"]
            self.processed = rule["processed"][0]
            self.events = (self.rel, "admit", self.sent, inc, dec, self.processed)
            # Req object -> its middle chunks in flight, none at 0 (mostly empty: a release then
            # reads none of its fields)
            self.count: dict = {}
            # rid -> [whether some of its KV was sent, the batches that admitted it, the seq of
            # its latest release or None]: one entry per request, so that each event looks its
            # request up once (three tables of every request each cost a lookup, mostly a cache
            # miss, per event)
            self.reqs: dict = {}
            self.admit_seq = {}  # batch -> seq of its admit
            self.done = set()  # batches whose `processed` event was seen

    def on_chunk(self, evs):
        if self.mode == "pairing":
            self._pairing_chunk(evs)
            return
        inc, dec, sent, rel, processed = self.inc, self.dec, self.sent, self.rel, self.processed
        count, reqs, done = self.count, self.reqs, self.done
        checks = 0
        for e in evs:
            ev = e.ev
            if ev == sent:
                req = reqs.get(e.rid)
                if req is None:
                    reqs[e.rid] = [True, [], None]
                else:
                    req[0] = True
            elif ev == rel:
                checks += 1
                rid, seq = e.rid, e.seq
                req = reqs.get(rid)
                if req is None:
                    req = reqs[rid] = [False, [], seq]
                else:
                    req[2] = seq
                for b in req[1]:
                    if b not in done:
                        self.fail(
                            f"{rid} released while batch {b} holding it was not yet processed",
                            self.admit_seq[b],
                            seq,
                        )
                if count and count.get(e.obj, 0) > 0:
                    self.fail(f"{rid} released with {count[e.obj]} middle chunk(s) in flight", seq)
                if not req[0]:
                    self.fail(f"{rid} released before any of its KV was sent", seq)
            elif ev == "admit":
                self._admit(e)
            elif ev == processed:
                done.add(e.batch)
            elif ev == inc or ev == dec:
                obj = e.obj
                n = count.get(obj, 0) + (1 if ev == inc else -1)
                if n:
                    count[obj] = n
                else:
                    del count[obj]
        self.checks += checks

    def _admit(self, e):
        b, reqs = e.batch, self.reqs
        self.admit_seq.setdefault(b, e.seq)
        for rid in e.rids:
            req = reqs.get(rid)
            if req is None:
                reqs[rid] = [False, [b], None]
                continue
            req[1].append(b)
            if req[2] is not None:
                self.fail(f"{rid} admitted in batch {b} after it was released", req[2], e.seq)

    def _pairing_chunk(self, evs):
        # live and slots hold the acquiring event itself (no tuple built per event): it is
        # released soon after, with its request
        acq, live, slots = self.acq, self.live, self.slots
        self.checks += len(evs)
        for e in evs:
            rid, slot = e.rid, e.slot
            if e.ev == acq:
                if slot in slots:
                    other = slots[slot]
                    self.fail(
                        f"slot {slot} allocated to {rid} while still held by {other.rid}",
                        other.seq,
                        e.seq,
                    )
                if rid in live:
                    self.fail(f"{rid} allocated twice", live[rid].seq, e.seq)
                live[rid] = slots[slot] = e
                continue
            held = live.pop(rid, None)
            if held is None:
                self.fail(f"{rid} released but not allocated (or released twice)", e.seq)
                continue
            slots.pop(held.slot, None)
            if held.obj != e.obj or held.slot != slot:
                self.fail(
                    f"{rid} released as object {e.obj} slot {slot}, allocated as object "
                    f"{held.obj} slot {held.slot}",
                    held.seq,
                    e.seq,
                )

    def finish(self):
        if self.mode == "pairing":
            for rid, e in self.live.items():
                self.checks += 1
                self.fail(
                    f"{rid} (slot {e.slot}) is never released: a leaked req_to_token slot", e.seq
                )


@TEMPLATES.register("page_count")
class PageCount(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.events = tuple(rule["events"])
        self.sized = _having(self, ("tokens", "pages"))

    def on_chunk(self, evs):
        ps, checks = self.ctx.page_size, 0
        for e in evs if self.sized is None else _of(evs, self.sized):
            tokens, pages = e.tokens, e.pages
            if tokens is not None and pages is not None:
                checks += 1
                if pages != -(-tokens // ps):
                    self.fail(
                        f"{e.ev} of {tokens} tokens covers {pages} pages; "
                        f"ceil({tokens}/{ps}) = {-(-tokens // ps)}",
                        e.seq,
                    )
        self.checks += checks


@TEMPLATES.register("page_aligned")
class PageAligned(Template):
    """Sends in the chunk-range form (with `start`): each starts on a page boundary; a send followed
    by another for the same request covers whole pages (only the last may end in a partial page)."""

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.events = tuple(rule["events"])
        # rid -> (ev, tokens, seq) of its latest send with `start` if that covers a partial page,
        # else None
        self.previous: dict = {}
        self.ranged = _having(self, ("start", "tokens"))

    def on_chunk(self, evs):
        ps, previous, checks = self.ctx.page_size, self.previous, 0
        for e in evs if self.ranged is None else _of(evs, self.ranged):
            start, tokens = e.start, e.tokens
            # (type() first: the common case without a call)
            if not (type(start) is int or isinstance(start, int)) or not (
                type(tokens) is int or isinstance(tokens, int)
            ):
                continue
            checks += 1
            rid = e.rid
            if start % ps:
                self.fail(
                    f"{e.ev} for {rid} starts at token {start}, not on a page "
                    f"boundary (page_size {ps})",
                    e.seq,
                )
            before = previous.get(rid)
            if before is not None:
                ev, covers, seq = before
                self.fail(
                    f"{ev} for {rid} covers {covers} tokens, not whole "
                    f"pages (page_size {ps}), and is not the request's last send",
                    seq,
                    e.seq,
                )
            # what the message needs of a send that covers a partial page, not the event (kept
            # past its chunk, an event costs its memory's reuse); nothing for a whole-page send
            # after nothing to report
            if tokens % ps:
                previous[rid] = (e.ev, tokens, e.seq)
            elif before is not None:
                previous[rid] = None
        self.checks += checks


def _having(t: Template, fields: tuple) -> frozenset | None:
    """The kinds of `t.events` whose events carry `fields` in the trace's format, or None when
    they all do (the usual case: no event to filter out)."""
    kinds = frozenset(ev for ev in t.events if t.ctx.has(ev, *fields))
    return None if len(kinds) == len(t.events) else kinds


def _of(evs: list, kinds: frozenset) -> list:
    return [e for e in evs if e.ev in kinds]


@TEMPLATES.register("in_span")
class InSpan(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.ev = rule["ev"]
        self.begin, self.end = rule["span"]
        self.events = (self.ev, self.begin, self.end, "admit")
        self.open = {}  # thread -> batch
        self.rids = {}  # batch -> rids (the admit event's list)

    def on_chunk(self, evs):
        begin, end, open_, rids = self.begin, self.end, self.open, self.rids
        for e in evs:
            ev, t = e.ev, e.thread
            if ev == "admit":
                rids[e.batch] = e.rids
            elif ev == begin:
                open_[t] = e.batch
            elif ev == end:
                open_.pop(t, None)
            else:
                self.checks += 1
                b = open_.get(t)
                if b is None:
                    self.fail(f"{ev} for {e.rid} outside any {begin}/{end} span on {t}", e.seq)
                elif e.rid not in rids.get(b, ()):
                    self.fail(
                        f"{ev} for {e.rid} inside processing of batch {b}, which does not hold it",
                        e.seq,
                    )


@TEMPLATES.register("each_in_span")
class EachInSpan(Template):
    """The converse of in_span: every request a batch holds has an `ev` inside that batch's span (on
    the thread that began it, between its begin and its end, whatever else opened meanwhile)."""

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.ev = rule["ev"]
        self.begin, self.end = rule["span"]
        self.events = (self.ev, self.begin, self.end, "admit")
        self.open = {}  # batch -> (thread, seq) of its span's latest begin, until its end
        self.on = {}  # thread -> the batches whose spans are open on it (an `ev` reads only these)
        self.got = {}  # batch -> rids seen inside its span so far
        self.rids = {}  # batch -> rids (the admit event's list)

    def on_chunk(self, evs):
        begin, end, open_, on, got, rids = (
            self.begin,
            self.end,
            self.open,
            self.on,
            self.got,
            self.rids,
        )
        for e in evs:
            ev = e.ev
            if ev == "admit":
                rids[e.batch] = e.rids
            elif ev == begin:
                b, t = e.batch, e.thread
                if b in open_:  # begun again: open on the thread of its latest begin only
                    on[open_[b][0]].remove(b)
                open_[b], got[b] = (t, e.seq), set()
                on.setdefault(t, []).append(b)
            elif ev == end:
                b = e.batch
                if b not in open_:
                    continue  # an end without its begin: P-fifo and the order rules say so
                t, s = open_.pop(b)
                on[t].remove(b)
                seen = got.pop(b)
                for rid in rids.get(b, ()):
                    self.checks += 1
                    if rid not in seen:
                        self.fail(
                            f"batch {b} holds {rid}, but its {begin}/{end} span has no "
                            f"{self.ev} for it",
                            s,
                            e.seq,
                        )
            else:
                for b in on.get(e.thread, ()):
                    got[b].add(e.rid)
