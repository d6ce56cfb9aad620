"""Templates of the rule kinds about batch steps (both roles): the order of each batch's events, the
thread each runs on, the spans they open and close, what must not overlap.

The finish-time templates (complete, order, within) read the shared batch index as arrays
(checker/streaming.py's Dense) when the batch ids allow it, and fall back to per-batch loops.
"""

from __future__ import annotations

from array import array
from collections import deque
from itertools import islice
from operator import attrgetter, lt

import numpy as np

from .streaming import TEMPLATES, Template, event_label, in_order

_SEQ, _THREAD, _BATCH, _RID = (attrgetter(f) for f in ("seq", "thread", "batch", "rid"))


@TEMPLATES.register("fifo")
class Fifo(Template):
    """Each listed event at most once per batch, only for a batch admitted before it, in batch
    order. `on_kinds` judges a chunk a kind at a time, in C (batches increasing along each kind's
    list; each batch's admit, by seq, before the event); a chunk where that fails is walked again
    event by event in trace order (`on_chunk`), which words the violations."""

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.events = tuple(rule["events"])
        self.last = {}  # ev -> (batch, seq) of its latest event
        self.admitted = {}  # batch -> seq of its first admit

    def on_kinds(self, by):
        admitted, n = self.admitted, 0
        admits = by.get("admit")
        if admits and "admit" in self.events:  # the first admit of each batch: setdefault, in C
            deque(map(admitted.setdefault, map(_BATCH, admits), map(_SEQ, admits)), maxlen=0)
        columns = []
        for ev in self.events:
            evs = by.get(ev)
            if not evs:
                continue
            n += len(evs)
            got = self.ctx.columns.get(ev)  # (made by the batch index for its kinds)
            batches, seqs = got[:2] if got else (list(map(_BATCH, evs)), list(map(_SEQ, evs)))
            prev = self.last.get(ev)
            if (prev is not None and batches[0] <= prev[0]) or not all(
                map(lt, batches, islice(batches, 1, None))
            ):
                break
            # admitted before it: the first admit's seq is smaller (default: its own, not smaller)
            if ev != "admit" and not all(map(lt, map(admitted.get, batches, seqs), seqs)):
                break
            columns.append((ev, batches[-1], seqs[-1]))
        else:
            self.checks += n
            for ev, b, seq in columns:
                self.last[ev] = (b, seq)
            return
        self.on_chunk(in_order(by, self.events))

    def on_chunk(self, evs):
        self.checks += len(evs)
        last, admitted = self.last, self.admitted
        for e in evs:
            ev, b, seq = e.ev, e.batch, e.seq
            if ev == "admit":
                admitted.setdefault(b, seq)
            elif not admitted.get(b, seq) < seq:
                self.fail(f"{ev} of batch {b}, which was never admitted before it", seq)
            prev = last.get(ev)
            if prev is not None and b <= prev[0]:
                what = "twice" if b == prev[0] else f"after batch {prev[0]}"
                self.fail(f"{ev} of batch {b} {what}", prev[1], seq)
            last[ev] = (b, seq)


@TEMPLATES.register("complete")
class Complete(Template):
    def finish(self):
        dense = self.ctx.dense()
        if dense is None:
            return self._finish_loop()
        evs = self.rule["events"]
        self.checks += len(dense.admits) * len(evs)
        missing = np.stack([dense.at(ev, 0)[0] == 0 for ev in evs], axis=1)  # [batch, event]
        admit_seq = dense.at("admit", 0)[0]
        # row-major: batch by batch, as the loop reports
        for j, i in zip(*np.nonzero(missing), strict=False):
            self.fail(
                f"batch {dense.admits[j]} was admitted but has no {evs[i]}", int(admit_seq[j])
            )

    def _finish_loop(self):
        idx = self.ctx.idx
        for b in self.ctx.admits:
            for ev in self.rule["events"]:
                self.checks += 1
                if b not in idx[ev]:
                    self.fail(f"batch {b} was admitted but has no {ev}", idx["admit"][b][0])


@TEMPLATES.register("disjoint")
class Disjoint(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.begin, self.end = rule["span"]
        self.events = (self.begin, self.end)
        self.open = {}

    def on(self, e):
        if e.ev == self.begin:
            self.checks += 1
            for b, s in self.open.items():
                self.fail(f"{self.begin}({e.batch}) while span of batch {b} is open", s, e.seq)
            self.open[e.batch] = e.seq
        else:
            self.open.pop(e.batch, None)


@TEMPLATES.register("outside")
class Outside(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.begin, self.end = rule["span"]
        self.ev = rule["ev"]
        self.events = (self.ev, self.begin, self.end)
        self.open = {}

    def on(self, e):
        ev = e.ev
        if ev == self.begin:
            self.open[e.batch] = e.seq
        elif ev == self.end:
            self.open.pop(e.batch, None)
        else:
            self.checks += 1
            for b, s in self.open.items():
                self.fail(
                    f"{event_label(e)} while {self.begin}({b}) has not reached {self.end}", s, e.seq
                )


@TEMPLATES.register("order")
class Order(Template):
    """For each admitted batch n, the chain's events that exist for n (each at batch n + offset)
    must come in chain order, and the first `same` of them on one thread. Evaluated at finish on
    arrays (all batches at once); the failing batches are then rerun one by one to word the
    messages."""

    def finish(self):
        chain = self.rule["chain"]
        same = (
            len(chain) if self.rule.get("same_thread") else self.rule.get("same_thread_prefix", 0)
        )
        dense = self.ctx.dense()
        if dense is None:
            steps = self._steps(chain, same)
            for n in self._applicable(self.ctx.admits):
                self._check_batch(n, steps)
            return
        active = np.ones(len(dense.admits), dtype=bool)
        when = self.rule.get("when")
        if when:
            (a, ao), (b, bo) = when
            wa, wb = dense.at(a, ao)[0], dense.at(b, bo)[0]
            active = (wa > 0) & (wb > 0)
            vacuous = active & (wa > wb)
            self.checks += int(np.count_nonzero(vacuous))  # the implication holds vacuously there
            active &= ~vacuous
        # seq and thread of the last chain event found so far
        prev_s = np.zeros(len(dense.admits), dtype=np.int64)
        prev_t = np.full(len(dense.admits), -1, dtype=np.int64)
        found = np.zeros(len(dense.admits), dtype=np.int64)
        failing = np.zeros(len(dense.admits), dtype=bool)
        for i, (ev, off) in enumerate(chain):
            s, t = dense.at(ev, off)
            present = active & (s > 0)
            both = present & (prev_s > 0)
            failing |= both & (prev_s > s)
            if i < same:
                failing |= both & (prev_t != t)
            found += present
            prev_s = np.where(present, s, prev_s)
            prev_t = np.where(present, t, prev_t)
        self.checks += int(np.count_nonzero(active & (found >= 2)))
        failing = np.nonzero(failing)[0].tolist()
        if failing:  # (the index as dicts is built only here)
            steps = self._steps(chain, same)
            for j in failing:
                self._check_batch(int(dense.admits[j]), steps, count=False)

    def _steps(self, chain, same) -> list:
        """(ev, offset, its index table, whether on the chain's thread) per chain step."""
        return [(ev, off, self.ctx.idx[ev], i < same) for i, (ev, off) in enumerate(chain)]

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
                    self.fail(
                        f"{ev1}({b1}) on {t1} but {ev}({n + off}) on {t2}: expected one thread",
                        s1,
                        s2,
                    )
            prev = (ev, n + off, got)
        if count and found >= 2:
            self.checks += 1


@TEMPLATES.register("adjacent")
class Adjacent(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.first, self.then, self.thread = rule["first"], rule["then"], rule["thread"]
        self.pending = None
        self.events = ("*",)

    def on(self, e):
        if e.thread != self.thread:
            return
        if self.pending is not None:
            b, s = self.pending
            self.pending = None
            self.checks += 1
            if e.ev != self.then or getattr(e, "batch", None) != b:
                self.fail(
                    f"{self.first}({b}) was followed on {self.thread} by {event_label(e)}, "
                    f"not {self.then}({b})",
                    s,
                    e.seq,
                )
        if e.ev == self.first:
            self.pending = (e.batch, e.seq)

    def finish(self):
        if self.pending is not None:
            self.fail(
                f"{self.first}({self.pending[0]}) is never followed by {self.then}", self.pending[1]
            )


@TEMPLATES.register("within")
class Within(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.ev = rule["ev"]
        self.events = (self.ev,)
        # columns, in C: machine ints (no int or str of an event kept past its chunk), the thread
        # as Ctx's code; the rids for the messages
        self.seqs, self.threads, self.batches = array("q"), array("q"), array("q")
        self.rids: list = []

    def on_chunk(self, evs):
        # (fromlist of a list: about half the time of extend from an iterator)
        self.seqs.fromlist(list(map(_SEQ, evs)))
        self.threads.extend(self.ctx.thread_column(list(map(_THREAD, evs))))
        self.batches.fromlist(list(map(_BATCH, evs)))
        try:
            rids = list(map(_RID, evs))
        except AttributeError:  # a kind without `rid`
            rids = [getattr(e, "rid", None) for e in evs]
        self.rids += rids

    def finish(self):
        self.checks += len(self.seqs)
        dense = self.ctx.dense()
        if dense is None or not self.seqs:
            suspects = range(len(self.seqs))
        else:  # on arrays: which events might fail; the loop below words the messages for those
            r = self.rule
            seq = np.frombuffer(self.seqs, dtype=np.int64)
            threads = np.frombuffer(self.threads, dtype=np.int64)
            k = np.frombuffer(self.batches, dtype=np.int64) - dense.lo
            k[(k < 0) | (k >= dense.n)] = dense.n
            lo, hi = dense.col(r["after"])[0][k], dense.col(r["before"])[0][k]
            bad = (lo == 0) | (hi == 0) | (lo >= seq) | (seq >= hi)
            if r.get("thread"):
                bad |= threads != self.ctx.thread_code(r["thread"])
            elif r.get("same_thread_as"):
                codes = dense.col(r["same_thread_as"])[1][k]  # -1: no such event
                bad |= (codes < 0) | (codes != threads)
            suspects = np.nonzero(bad)[0].tolist()
            del seq, threads  # views of the columns
        names = self.ctx.threads
        for i in suspects:
            self._check(self.seqs[i], names[self.threads[i]], self.batches[i], self.rids[i])

    def _check(self, seq, thread, b, rid):
        idx, r = self.ctx.idx, self.rule
        lo, hi = idx[r["after"]].get(b), idx[r["before"]].get(b)
        if lo is None or hi is None:
            self.fail(
                f"{self.ev}({b}) for {rid}: batch has no "
                f"{r['after'] if lo is None else r['before']}",
                seq,
            )
            return
        if not lo[0] < seq < hi[0]:
            self.fail(
                f"{self.ev}({b}) for {rid} is not between {r['after']}({b}) and {r['before']}({b})",
                lo[0],
                seq,
                hi[0],
            )
        want = (
            r.get("thread") or idx[r["same_thread_as"]][b][1]
            if r.get("same_thread_as")
            else r.get("thread")
        )
        if want and thread != want:
            self.fail(f"{self.ev}({b}) for {rid} ran on {thread}, expected {want}", seq)


@TEMPLATES.register("thread")
class Thread(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.events = tuple(rule["events"])
        self.thread, self.not_thread = rule.get("thread"), rule.get("not_thread")

    def on_kinds(self, by):
        """The threads of each kind's events, as a set, in C; the chunk is walked event by event
        (in trace order, to word the messages) only when some thread is not as the rule says."""
        n, ok = 0, True
        for kind in self.events:
            evs = by.get(kind)
            if evs:
                n += len(evs)
                got = self.ctx.columns.get(kind)  # (made by the batch index for its kinds)
                threads = got[2] if got else set(map(_THREAD, evs))
                if self.thread is not None and (len(threads) > 1 or self.thread not in threads):
                    ok = False
                if self.not_thread is not None and self.not_thread in threads:
                    ok = False
        if ok:
            self.checks += n
        else:
            self.on_chunk(in_order(by, self.events))

    def on_chunk(self, evs):
        self.checks += len(evs)
        if self.thread is not None:
            want = self.thread
            for e in evs:
                if e.thread != want:
                    self.fail(f"{event_label(e)} ran on {e.thread}, expected {want}", e.seq)
        if self.not_thread is not None:
            avoid = self.not_thread
            for e in evs:
                if e.thread == avoid:
                    self.fail(f"{event_label(e)} ran on {avoid}, expected another thread", e.seq)


@TEMPLATES.register("equal")
class Equal(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.a, self.b, self.field = rule["a"], rule["b"], rule["field"]
        self.events = (self.a, self.b)
        self.vals = {self.a: {}, self.b: {}}

    def on(self, e):
        self.vals[e.ev].setdefault(e.batch, (getattr(e, self.field), e.seq))

    def finish(self):
        va, vb = self.vals[self.a], self.vals[self.b]
        for bt, (x, s1) in va.items():
            if bt in vb:
                self.checks += 1
                y, s2 = vb[bt]
                if x != y:
                    self.fail(
                        f"batch {bt}: {self.a}.{self.field}={x} but {self.b}.{self.field}={y}",
                        s1,
                        s2,
                    )
