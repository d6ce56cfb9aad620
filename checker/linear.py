"""The linear checker: one streaming pass over a trace, every rule of spec/ evaluated as it goes.

Each rule kind of spec/rules.toml is a small class here (a template) instantiated with the rule's
parameters: `events` says which event names it listens to, `on_chunk(events)` gets them a chunk of
the trace at a time, `finish()` runs at the end. Batch-indexed facts (the seq and thread of `ev` for
batch N) are kept in a shared index, which the finish-time templates read as numpy columns (`Dense`);
memory grows with batches and requests, not with events.
"""
from __future__ import annotations

import gc
import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from spec import Rule, load_events, load_rules

from .trace_io import iter_chunks


@dataclass
class Violation:
    rule: Rule
    message: str
    seqs: list[int]


@dataclass
class Ctx:
    header: dict
    page_size: int
    idx: dict = field(default_factory=lambda: defaultdict(dict))   # ev -> batch -> (seq, thread)
    admits: dict = field(default_factory=dict)                     # batch -> rids of its (first) admit
    _dense: object = None

    def dense(self) -> "Dense | None":
        """The batch index as arrays, for the finish-time templates (built once, at finish)."""
        if self._dense is None:
            self._dense = Dense.build(self) or False
        return self._dense or None


class Dense:
    """idx as numpy columns over the batch range [lo, lo + n): seq (0 = no such event) and a thread
    code per event name, built on first use; `admits` the admitted batch ids in admission order.
    The finish-time templates evaluate all batches at once on these; a trace whose batch ids are too
    sparse for arrays (a foreign engine numbering batches by time, say) keeps the per-batch loops."""

    def __init__(self, ctx, lo: int, n: int):
        self.ctx, self.lo, self.n = ctx, lo, n
        self.admits = np.fromiter(ctx.admits, dtype=np.int64, count=len(ctx.admits))
        self.threads: list[str] = []
        self._codes: dict[str, int] = {}
        self._cols: dict[str, tuple] = {}

    @classmethod
    def build(cls, ctx) -> "Dense | None":
        keys = [k for t in ctx.idx.values() for k in (min(t, default=None), max(t, default=None)) if k is not None]
        if not ctx.admits or not keys:
            return None
        lo, hi = min(keys), max(keys)
        if not all(type(k) is int for k in keys) or hi - lo + 1 > 4 * len(ctx.admits) + 4096:
            return None
        return cls(ctx, lo, hi - lo + 1)

    def col(self, ev: str) -> tuple:
        """(seq, thread code) arrays of `ev` over the batch range."""
        got = self._cols.get(ev)
        if got is None:
            table = self.ctx.idx.get(ev, {})
            seq = np.zeros(self.n + 1, dtype=np.int64)    # one spare slot: out-of-range lookups land there
            thr = np.full(self.n + 1, -1, dtype=np.int64)
            if table:
                k = np.array(list(table), dtype=np.int64) - self.lo
                vals = list(table.values())
                seq[k] = [v[0] for v in vals]
                codes = self._codes
                thr[k] = [codes.setdefault(t, len(codes)) for _, t in vals]
                self.threads = list(codes)
            got = self._cols[ev] = (seq, thr)
        return got

    def at(self, ev: str, off: int) -> tuple:
        """(seq, thread code) of `ev` for batch n + off, for every admitted batch n (seq 0: none)."""
        seq, thr = self.col(ev)
        k = self.admits + (off - self.lo)
        k[(k < 0) | (k >= self.n)] = self.n
        return seq[k], thr[k]


class Template:
    """`events`: the event names it listens to ("*": all). The checker hands it, per chunk of the
    trace, the list of its events in trace order (`on_chunk`); the default calls the handler of each.
    A template keeps the state it needs while streaming itself; the shared index in Ctx (batch-indexed
    facts) is complete only when `finish()` runs."""
    events: tuple = ()

    def __init__(self, rule: Rule, ctx: Ctx):
        self.rule, self.ctx = rule, ctx
        self.checks = 0
        self.violations: list[Violation] = []

    def fail(self, message: str, *seqs) -> None:
        self.violations.append(Violation(self.rule, message, [s for s in seqs if s is not None]))

    def on(self, e: dict) -> None:
        pass

    def handlers(self) -> dict:
        """Event name -> callable; a template may route event kinds to separate methods."""
        return {ev: self.on for ev in self.events}

    def on_chunk(self, evs: list) -> None:
        h = self.handlers()
        star = h.get("*")
        if star is not None:
            for e in evs:
                star(e)
            return
        for e in evs:
            h[e["ev"]](e)

    def finish(self) -> None:
        pass


def _ev(e: dict) -> str:
    b = e.get("batch")
    return f"{e['ev']}({b})" if b is not None else e["ev"]


class Fifo(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.events = tuple(rule["events"])
        self.last = {}
        self.admitted = set()

    def on_chunk(self, evs):
        self.checks += len(evs)
        last, admitted = self.last, self.admitted
        for e in evs:
            ev, b = e["ev"], e["batch"]
            if ev == "admit":
                admitted.add(b)
            elif b not in admitted:
                self.fail(f"{ev} of batch {b}, which was never admitted before it", e["seq"])
            prev = last.get(ev)
            if prev is not None and b <= prev[0]:
                what = "twice" if b == prev[0] else f"after batch {prev[0]}"
                self.fail(f"{ev} of batch {b} {what}", prev[1], e["seq"])
            last[ev] = (b, e["seq"])


class Complete(Template):
    def finish(self):
        D = self.ctx.dense()
        if D is None:
            return self._finish_loop()
        evs = self.rule["events"]
        self.checks += len(D.admits) * len(evs)
        missing = np.stack([D.at(ev, 0)[0] == 0 for ev in evs], axis=1)   # [batch, event]
        admit_seq = D.at("admit", 0)[0]
        for j, i in zip(*np.nonzero(missing)):   # row-major: batch by batch, as the loop reports
            self.fail(f"batch {D.admits[j]} was admitted but has no {evs[i]}", int(admit_seq[j]))

    def _finish_loop(self):
        idx = self.ctx.idx
        for b in self.ctx.admits:
            for ev in self.rule["events"]:
                self.checks += 1
                if b not in idx[ev]:
                    self.fail(f"batch {b} was admitted but has no {ev}", idx["admit"][b][0])


class Disjoint(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.begin, self.end = rule["span"]
        self.events = (self.begin, self.end)
        self.open = {}

    def on(self, e):
        if e["ev"] == self.begin:
            self.checks += 1
            for b, s in self.open.items():
                self.fail(f"{self.begin}({e['batch']}) while span of batch {b} is open", s, e["seq"])
            self.open[e["batch"]] = e["seq"]
        else:
            self.open.pop(e["batch"], None)


class Outside(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.begin, self.end = rule["span"]
        self.ev = rule["ev"]
        self.events = (self.ev, self.begin, self.end)
        self.open = {}

    def on(self, e):
        ev = e["ev"]
        if ev == self.begin:
            self.open[e["batch"]] = e["seq"]
        elif ev == self.end:
            self.open.pop(e["batch"], None)
        else:
            self.checks += 1
            for b, s in self.open.items():
                self.fail(f"{_ev(e)} while {self.begin}({b}) has not reached {self.end}", s, e["seq"])


class Order(Template):
    """For each admitted batch n, the chain's events that exist for n (each at batch n + offset) must
    come in chain order, and the first `same` of them on one thread. Evaluated at finish on arrays
    (all batches at once); the failing batches are then rerun one by one to word the messages."""

    def finish(self):
        chain = self.rule["chain"]
        same = len(chain) if self.rule.get("same_thread") else self.rule.get("same_thread_prefix", 0)
        steps = [(ev, off, self.ctx.idx[ev], i < same) for i, (ev, off) in enumerate(chain)]
        D = self.ctx.dense()
        if D is None:
            for n in self._applicable(self.ctx.admits):
                self._check_batch(n, steps)
            return
        active = np.ones(len(D.admits), dtype=bool)
        when = self.rule.get("when")
        if when:
            (a, ao), (b, bo) = when
            wa, wb = D.at(a, ao)[0], D.at(b, bo)[0]
            active = (wa > 0) & (wb > 0)
            vacuous = active & (wa > wb)
            self.checks += int(np.count_nonzero(vacuous))   # the implication holds vacuously there
            active &= ~vacuous
        prev_s = np.zeros(len(D.admits), dtype=np.int64)    # seq of the last chain event found so far
        prev_t = np.full(len(D.admits), -1, dtype=np.int64)
        found = np.zeros(len(D.admits), dtype=np.int64)
        failing = np.zeros(len(D.admits), dtype=bool)
        for i, (ev, off) in enumerate(chain):
            s, t = D.at(ev, off)
            present = active & (s > 0)
            both = present & (prev_s > 0)
            failing |= both & (prev_s > s)
            if i < same:
                failing |= both & (prev_t != t)
            found += present
            prev_s = np.where(present, s, prev_s)
            prev_t = np.where(present, t, prev_t)
        self.checks += int(np.count_nonzero(active & (found >= 2)))
        for j in np.nonzero(failing)[0]:
            self._check_batch(int(D.admits[j]), steps, count=False)

    def _applicable(self, batches):
        """The batches the rule speaks about: with `when` (a, b), those where a precedes b."""
        when, idx = self.rule.get("when"), self.ctx.idx
        for n in batches:
            if when:
                (a, ao), (b, bo) = when
                wa, wb = idx[a].get(n + ao), idx[b].get(n + bo)
                if wa is None or wb is None:
                    continue
                if wa[0] > wb[0]:
                    self.checks += 1  # the implication holds vacuously for this batch
                    continue
            yield n

    def _check_batch(self, n, steps, *, count=True):
        prev, found = None, 0
        for ev, off, table, need_same in steps:
            got = table.get(n + off)
            if got is None:
                continue
            found += 1
            if prev is not None:
                (ev1, b1, (s1, t1)), (s2, t2) = prev, got
                if s1 > s2:
                    self.fail(f"{ev}({n + off}) came before {ev1}({b1})", s1, s2)
                elif need_same and t1 != t2:
                    self.fail(f"{ev1}({b1}) on {t1} but {ev}({n + off}) on {t2}: expected one thread", s1, s2)
            prev = (ev, n + off, got)
        if count and found >= 2:
            self.checks += 1


class Adjacent(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.first, self.then, self.thread = rule["first"], rule["then"], rule["thread"]
        self.pending = None
        self.events = ("*",)

    def on(self, e):
        if e["thread"] != self.thread:
            return
        if self.pending is not None:
            b, s = self.pending
            self.pending = None
            self.checks += 1
            if e["ev"] != self.then or e.get("batch") != b:
                self.fail(f"{self.first}({b}) was followed on {self.thread} by {_ev(e)}, not {self.then}({b})", s, e["seq"])
        if e["ev"] == self.first:
            self.pending = (e["batch"], e["seq"])

    def finish(self):
        if self.pending is not None:
            self.fail(f"{self.first}({self.pending[0]}) is never followed by {self.then}", self.pending[1])


class Within(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.ev = rule["ev"]
        self.events = (self.ev,)
        self.seqs, self.threads, self.batches, self.rids = [], [], [], []

    def on_chunk(self, evs):
        self.seqs += [e["seq"] for e in evs]
        self.threads += [e["thread"] for e in evs]
        self.batches += [e["batch"] for e in evs]
        self.rids += [e.get("rid") for e in evs]

    def finish(self):
        self.checks += len(self.seqs)
        D = self.ctx.dense()
        if D is None or not self.seqs:
            suspects = range(len(self.seqs))
        else:   # on arrays: which events might fail; the loop below words the messages for those
            r = self.rule
            seq = np.array(self.seqs, dtype=np.int64)
            k = np.array(self.batches, dtype=np.int64) - D.lo
            k[(k < 0) | (k >= D.n)] = D.n
            lo, hi = D.col(r["after"])[0][k], D.col(r["before"])[0][k]
            bad = (lo == 0) | (hi == 0) | (lo >= seq) | (seq >= hi)
            if r.get("thread"):
                bad |= np.array([t != r["thread"] for t in self.threads], dtype=bool)
            elif r.get("same_thread_as"):
                codes = D.col(r["same_thread_as"])[1][k]
                names = D.threads
                bad |= np.array([c < 0 or names[c] != t for c, t in zip(codes.tolist(), self.threads)], dtype=bool)
            suspects = np.nonzero(bad)[0].tolist()
        for i in suspects:
            self._check(self.seqs[i], self.threads[i], self.batches[i], self.rids[i])

    def _check(self, seq, thread, b, rid):
        idx, r = self.ctx.idx, self.rule
        lo, hi = idx[r["after"]].get(b), idx[r["before"]].get(b)
        if lo is None or hi is None:
            self.fail(f"{self.ev}({b}) for {rid}: batch has no {r['after'] if lo is None else r['before']}", seq)
            return
        if not lo[0] < seq < hi[0]:
            self.fail(f"{self.ev}({b}) for {rid} is not between {r['after']}({b}) and {r['before']}({b})", lo[0], seq, hi[0])
        want = r.get("thread") or idx[r["same_thread_as"]][b][1] if r.get("same_thread_as") else r.get("thread")
        if want and thread != want:
            self.fail(f"{self.ev}({b}) for {rid} ran on {thread}, expected {want}", seq)


class Thread(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.events = tuple(rule["events"])
        self.thread, self.not_thread = rule.get("thread"), rule.get("not_thread")

    def on_chunk(self, evs):
        self.checks += len(evs)
        if self.thread is not None:
            want = self.thread
            for e in evs:
                if e["thread"] != want:
                    self.fail(f"{_ev(e)} ran on {e['thread']}, expected {want}", e["seq"])
        if self.not_thread is not None:
            avoid = self.not_thread
            for e in evs:
                if e["thread"] == avoid:
                    self.fail(f"{_ev(e)} ran on {avoid}, expected another thread", e["seq"])


class Equal(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.a, self.b, self.field = rule["a"], rule["b"], rule["field"]
        self.events = (self.a, self.b)
        self.vals = {self.a: {}, self.b: {}}

    def on(self, e):
        self.vals[e["ev"]].setdefault(e["batch"], (e[self.field], e["seq"]))

    def finish(self):
        va, vb = self.vals[self.a], self.vals[self.b]
        for bt, (x, s1) in va.items():
            if bt in vb:
                self.checks += 1
                y, s2 = vb[bt]
                if x != y:
                    self.fail(f"batch {bt}: {self.a}.{self.field}={x} but {self.b}.{self.field}={y}", s1, s2)


class Counter(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.inc, self.dec, self.owner = rule["inc"], rule["dec"], rule["owner"]
        self.events = (self.inc, self.dec, self.owner)
        self.owned = set()     # (rid, obj) allocated
        self.value = {}        # obj -> (value, last seq, rid)

    def on_chunk(self, evs):
        owner, inc, owned, value = self.owner, self.inc, self.owned, self.value
        for e in evs:
            ev, rid, obj = e["ev"], e["rid"], e["obj"]
            if ev == owner:
                owned.add((rid, obj))
                continue
            self.checks += 1
            if (rid, obj) not in owned:
                self.fail(f"{ev} for {rid} on object {obj}, which is not the Req object allocated for {rid}", e["seq"])
            cur = value.get(obj, (0, None, rid))[0]
            want = cur + (1 if ev == inc else -1)
            if e["value"] != want:
                self.fail(f"{ev} for {rid} reports {e['value']}, expected {want} on object {obj}", e["seq"])
            if e["value"] < 0:
                self.fail(f"{ev} for {rid} drove the counter below zero ({e['value']})", e["seq"])
            value[obj] = (e["value"], e["seq"], rid)

    def finish(self):
        for obj, (v, s, rid) in self.value.items():
            self.checks += 1
            if v != 0:
                self.fail(f"inflight_middle_chunks of {rid} (object {obj}) ends at {v}, not 0", s)


class Lifecycle(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.acq, self.rel = rule["acquire"], rule["release"]
        self.mode = rule["check"]
        self.live = {}         # rid -> (obj, slot, seq)
        self.slots = {}        # slot -> (rid, seq)
        self.released = {}     # rid -> seq
        if self.mode == "pairing":
            self.events = (self.acq, self.rel)
        else:
            inc, dec = rule["counter"]
            self.inc, self.dec, self.sent = inc, dec, rule["sent"]
            self.processed = rule["processed"][0]
            self.events = (self.rel, "admit", self.sent, inc, dec, self.processed)
            self.count = defaultdict(int)   # Req object -> middle chunks in flight
            self.sent_any = set()           # rids with some KV sent
            self.rid_batches = defaultdict(list)
            self.admit_seq = {}             # batch -> seq of its admit
            self.done = set()               # batches whose `processed` event was seen

    def on_chunk(self, evs):
        if self.mode == "pairing":
            self._pairing_chunk(evs)
            return
        inc, dec, sent, rel, processed = self.inc, self.dec, self.sent, self.rel, self.processed
        count, sent_any, rid_batches, done, released = self.count, self.sent_any, self.rid_batches, self.done, self.released
        add_sent, checks = sent_any.add, 0
        for e in evs:
            ev = e["ev"]
            if ev == sent:
                add_sent(e["rid"])
            elif ev == rel:
                checks += 1
                rid, seq = e["rid"], e["seq"]
                released[rid] = seq
                for b in rid_batches.get(rid, ()):
                    if b not in done:
                        self.fail(f"{rid} released while batch {b} holding it was not yet processed", self.admit_seq[b], seq)
                if count.get(e["obj"], 0) > 0:
                    self.fail(f"{rid} released with {count[e['obj']]} middle chunk(s) in flight", seq)
                if rid not in sent_any:
                    self.fail(f"{rid} released before any of its KV was sent", seq)
            elif ev == "admit":
                self._admit(e)
            elif ev == processed:
                done.add(e["batch"])
            elif ev == inc:
                count[e["obj"]] += 1
            elif ev == dec:
                count[e["obj"]] -= 1
        self.checks += checks

    def _admit(self, e):
        b = e["batch"]
        self.admit_seq.setdefault(b, e["seq"])
        for rid in e["rids"]:
            self.rid_batches[rid].append(b)
            if rid in self.released:
                self.fail(f"{rid} admitted in batch {b} after it was released", self.released[rid], e["seq"])

    def _pairing_chunk(self, evs):
        acq, live, slots = self.acq, self.live, self.slots
        self.checks += len(evs)
        for e in evs:
            rid, obj, slot, seq = e["rid"], e["obj"], e["slot"], e["seq"]
            if e["ev"] == acq:
                if slot in slots:
                    other, s = slots[slot]
                    self.fail(f"slot {slot} allocated to {rid} while still held by {other}", s, seq)
                if rid in live:
                    self.fail(f"{rid} allocated twice", live[rid][2], seq)
                live[rid] = (obj, slot, seq)
                slots[slot] = (rid, seq)
                continue
            held = live.pop(rid, None)
            if held is None:
                self.fail(f"{rid} released but not allocated (or released twice)", seq)
                continue
            slots.pop(held[1], None)
            if held[0] != obj or held[1] != slot:
                self.fail(f"{rid} released as object {obj} slot {slot}, allocated as object {held[0]} slot {held[1]}", held[2], seq)

    def finish(self):
        if self.mode == "pairing":
            for rid, (obj, slot, seq) in self.live.items():
                self.checks += 1
                self.fail(f"{rid} (slot {slot}) is never released: a leaked req_to_token slot", seq)


class PageCount(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.events = tuple(rule["events"])

    def on_chunk(self, evs):
        ps = self.ctx.page_size
        for e in evs:
            if "tokens" in e and "pages" in e:
                self.checks += 1
                if e["pages"] != -(-e["tokens"] // ps):
                    self.fail(f"{e['ev']} of {e['tokens']} tokens covers {e['pages']} pages; "
                              f"ceil({e['tokens']}/{ps}) = {-(-e['tokens'] // ps)}", e["seq"])


class InSpan(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.ev = rule["ev"]
        self.begin, self.end = rule["span"]
        self.events = (self.ev, self.begin, self.end, "admit")
        self.open = {}    # thread -> batch
        self.rids = {}    # batch -> rids (the admit event's list)

    def on_chunk(self, evs):
        begin, end, open_, rids = self.begin, self.end, self.open, self.rids
        for e in evs:
            ev, t = e["ev"], e["thread"]
            if ev == "admit":
                rids[e["batch"]] = e["rids"]
            elif ev == begin:
                open_[t] = e["batch"]
            elif ev == end:
                open_.pop(t, None)
            else:
                self.checks += 1
                b = open_.get(t)
                if b is None:
                    self.fail(f"{ev} for {e['rid']} outside any {begin}/{end} span on {t}", e["seq"])
                elif e["rid"] not in rids.get(b, ()):
                    self.fail(f"{ev} for {e['rid']} inside processing of batch {b}, which does not hold it", e["seq"])


class EachInSpan(Template):
    """The converse of in_span: every request a batch holds has an `ev` inside that batch's span (on
    the thread that began it, between its begin and its end, whatever else opened meanwhile)."""

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.ev = rule["ev"]
        self.begin, self.end = rule["span"]
        self.events = (self.ev, self.begin, self.end, "admit")
        self.open = {}    # batch -> (thread, seq) of its span's latest begin, until its end
        self.got = {}     # batch -> rids seen inside its span so far
        self.rids = {}    # batch -> rids (the admit event's list)

    def on_chunk(self, evs):
        begin, end, open_, got, rids = self.begin, self.end, self.open, self.got, self.rids
        for e in evs:
            ev = e["ev"]
            if ev == "admit":
                rids[e["batch"]] = e["rids"]
            elif ev == begin:
                b = e["batch"]
                open_[b], got[b] = (e["thread"], e["seq"]), set()
            elif ev == end:
                b = e["batch"]
                if b not in open_:
                    continue   # an end without its begin: P-fifo and the order rules say so
                _, s = open_.pop(b)
                seen = got.pop(b)
                for rid in rids.get(b, ()):
                    self.checks += 1
                    if rid not in seen:
                        self.fail(f"batch {b} holds {rid}, but its {begin}/{end} span has no {self.ev} for it",
                                  s, e["seq"])
            else:
                t = e["thread"]
                for b, (bt, _) in open_.items():
                    if bt == t:
                        got[b].add(e["rid"])


class ChunkSent(Template):
    """For traces whose admits carry `chunks` (rid -> [start, end), the prompt tokens the batch computes
    for it) and whose sends carry `start`: every one of those tokens is sent ([start, start + tokens))
    once batch N's results were waited for (`done`(N) before the send), or with a device wait on the
    forward (`device_wait` true, `started`(N) before the send), and before the request is released.
    Sends without `start` are not judged; a trace without `chunks` has nothing to check."""

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.sends, self.done, self.started, self.release = (
            tuple(rule["sends"]), rule["done"], rule["started"], rule["release"])
        self.events = ("admit", self.done, self.started, self.release, *self.sends)
        self.chunks: dict = {}          # rid -> [[batch, remaining [lo, hi) intervals, admit seq]]
        self.done_b, self.started_b = set(), set()

    def on(self, e):
        ev = e["ev"]
        if ev == "admit":
            for rid, rng in (e.get("chunks") or {}).items():
                if isinstance(rng, list) and len(rng) == 2 and rng[0] < rng[1]:
                    self.chunks.setdefault(rid, []).append([e["batch"], [tuple(rng)], e["seq"]])
        elif ev == self.done:
            self.done_b.add(e["batch"])
        elif ev == self.started:
            self.started_b.add(e["batch"])
        elif ev == self.release:
            self._unsent(e["rid"], e["seq"])
        elif isinstance(e.get("start"), int) and isinstance(e.get("tokens"), int):
            lo, hi = e["start"], e["start"] + e["tokens"]
            for chunk in self.chunks.get(e["rid"], ()):
                batch, left, _ = chunk
                hit = [(max(a, lo), min(b, hi)) for a, b in left if max(a, lo) < min(b, hi)]
                if not hit:
                    continue
                self.checks += 1
                waited = batch in self.done_b
                if not waited and not (e.get("device_wait") is True and batch in self.started_b):
                    how = "with a device wait before its forward began" if e.get("device_wait") is True \
                        else f"before {self.done}({batch}), with no device wait"
                    self.fail(f"{_ev(e)} sends {e['rid']}'s tokens {hit[0][0]}..{hit[-1][1]} of batch {batch} {how}",
                              e["seq"])
                chunk[1] = [p for a, b in left for p in ((a, min(b, lo)), (max(a, hi), b)) if p[0] < p[1]]

    def _unsent(self, rid, seq):
        for batch, left, admit_seq in self.chunks.pop(rid, ()):
            self.checks += 1
            if left:
                self.fail(f"{rid}'s tokens {left[0][0]}..{left[-1][1]} computed by batch {batch} were never sent",
                          admit_seq, *([seq] if seq is not None else []))

    def finish(self):
        for rid in list(self.chunks):
            self._unsent(rid, None)


TEMPLATES = {"fifo": Fifo, "complete": Complete, "disjoint": Disjoint, "order": Order, "adjacent": Adjacent,
             "outside": Outside, "within": Within, "thread": Thread, "equal": Equal, "counter": Counter,
             "lifecycle": Lifecycle, "page_count": PageCount, "in_span": InSpan, "each_in_span": EachInSpan,
             "chunk_sent": ChunkSent}


@dataclass
class Result:
    path: str
    header: dict
    events: int
    rules: list          # [(Rule, checks)]
    violations: list[Violation]
    ignored: dict = field(default_factory=dict)   # events of kinds no rule knows, skipped: ev -> count

    @property
    def ok(self) -> bool:
        return not self.violations


def check_file(path: str, *, rules: list[Rule] | None = None, extra_templates: dict | None = None) -> Result:
    """Every rule of the trace's role and mode, in one streaming pass."""
    # The checker allocates millions of small, acyclic objects (events, index entries); the cyclic
    # garbage collector would rescan the growing index again and again (a quarter of the run time).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _check_file(path, rules, extra_templates)
    finally:
        if gc_was_enabled:
            gc.enable()


def _check_file(path: str, rules: list[Rule] | None, extra_templates: dict | None) -> Result:
    header: dict = {}
    ignored: dict = {}
    chunks = iter_chunks(path, header_out=header, ignored=ignored)
    first = next(chunks, [])  # reads (and validates) the header
    role, mode = header["role"], header.get("mode")
    rules = [r for r in (rules or load_rules()) if r.role == role and r.applies(mode, header)]
    ctx = Ctx(header, header.get("page_size", 1))
    from .decode_templates import TEMPLATES as DECODE_TEMPLATES  # decode kinds live in their own module

    templates = {**TEMPLATES, **DECODE_TEMPLATES, **(extra_templates or {})}
    missing = sorted({r.kind for r in rules} - set(templates))
    if missing:   # a rule this checker cannot check must not pass silently
        raise ValueError(f"no linear template for rule kind(s) {', '.join(missing)}")
    active = [templates[r.kind](r, ctx) for r in rules]
    # One pass per chunk routes each event to the lists of the templates that listen to it (an
    # append, not a call) and fills the shared batch index; then each template takes its list.
    feeds = [(t, []) for t in active]
    wants: dict[str, list] = defaultdict(list)
    star = []
    for t, feed in feeds:
        for ev in t.handlers():
            (star if ev == "*" else wants[ev]).append(feed)
    # Batch-indexed events: those the vocabulary gives an int `batch` (prefix_send is per request,
    # several per batch, and is not a batch step).
    batched = {ev for ev, spec in load_events().get(role, {}).items()
               if spec.get("fields", {}).get("batch") == "int" and ev != "prefix_send"}
    route: dict[str, tuple] = {}   # ev -> (feeds, index table or None)
    idx, admits = ctx.idx, ctx.admits
    n = 0
    for chunk in itertools.chain((first,), chunks):
        n += len(chunk)
        for e in chunk:
            ev = e["ev"]
            r = route.get(ev)
            if r is None:
                r = route[ev] = (tuple(feed.append for feed in (*wants.get(ev, ()), *star)),
                                 idx[ev] if ev in batched else None)
            for append in r[0]:
                append(e)
            table = r[1]
            if table is not None:
                b = e["batch"]
                if b not in table:
                    table[b] = (e["seq"], e["thread"])
                    if ev == "admit":
                        admits[b] = e["rids"]
        for t, feed in feeds:
            if feed:
                t.on_chunk(feed)
                feed.clear()
    for t in active:
        t.finish()
    violations = [v for t in active for v in t.violations]
    return Result(path, header, n, [(t.rule, t.checks) for t in active], violations, ignored)


def check_files(paths, *, rules: list[Rule] | None = None) -> list[Result]:
    """Each file against its role's rules, then every decode trace together with the prefill traces of
    its DP ranks given alongside it (the cross-process rules, one extra Result per decode trace)."""
    from .decode_templates import check_cross

    rules = rules or load_rules()
    return [check_file(p, rules=rules) for p in paths] + check_cross(list(paths), rules)

