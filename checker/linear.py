"""The linear checker: one streaming pass over a trace, every rule of spec/ evaluated as it goes.

Each rule kind of spec/rules.toml is a small class here (a template) instantiated with the rule's
parameters: `events` says which event names it listens to, `on(e)` runs per event, `finish()` at the
end. Batch-indexed facts (the seq and thread of `ev` for batch N) are kept in a shared index, so memory
grows with batches and requests, not with events.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from spec import Rule, load_rules

from .trace_io import iter_events


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
    admits: dict = field(default_factory=dict)                     # batch -> set(rids)
    rid_batches: dict = field(default_factory=lambda: defaultdict(list))  # rid -> [batch]


class Template:
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

    def on(self, e):
        ev, b = e["ev"], e["batch"]
        self.checks += 1
        if ev != "admit" and b not in self.ctx.admits:
            self.fail(f"{ev} of batch {b}, which was never admitted before it", e["seq"])
        prev = self.last.get(ev)
        if prev is not None and b <= prev[0]:
            what = "twice" if b == prev[0] else f"after batch {prev[0]}"
            self.fail(f"{ev} of batch {b} {what}", prev[1], e["seq"])
        self.last[ev] = (b, e["seq"])


class Complete(Template):
    def finish(self):
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
    def finish(self):
        idx = self.ctx.idx
        chain = [(ev, off, idx[ev]) for ev, off in self.rule["chain"]]
        when = self.rule.get("when")
        same = len(chain) if self.rule.get("same_thread") else self.rule.get("same_thread_prefix", 0)
        for n in self.ctx.admits:
            if when:
                (a, ao), (b, bo) = when
                wa, wb = idx[a].get(n + ao), idx[b].get(n + bo)
                if wa is None or wb is None:
                    continue
                if wa[0] > wb[0]:
                    self.checks += 1  # the implication holds vacuously for this batch
                    continue
            got = [(ev, n + off, table.get(n + off), i) for i, (ev, off, table) in enumerate(chain)]
            got = [g for g in got if g[2] is not None]
            if len(got) < 2:
                continue
            self.checks += 1
            for (ev1, b1, (s1, t1), i1), (ev2, b2, (s2, t2), i2) in zip(got, got[1:]):
                if s1 > s2:
                    self.fail(f"{ev2}({b2}) came before {ev1}({b1})", s1, s2)
                elif i2 < same and t1 != t2:
                    self.fail(f"{ev1}({b1}) on {t1} but {ev2}({b2}) on {t2}: expected one thread", s1, s2)


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
        self.seen = []

    def on(self, e):
        self.seen.append((e["seq"], e["thread"], e["batch"], e.get("rid")))

    def finish(self):
        idx, r = self.ctx.idx, self.rule
        for seq, thread, b, rid in self.seen:
            self.checks += 1
            lo, hi = idx[r["after"]].get(b), idx[r["before"]].get(b)
            if lo is None or hi is None:
                self.fail(f"{self.ev}({b}) for {rid}: batch has no {r['after'] if lo is None else r['before']}", seq)
                continue
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

    def on(self, e):
        self.checks += 1
        t = e["thread"]
        if self.thread is not None and t != self.thread:
            self.fail(f"{_ev(e)} ran on {t}, expected {self.thread}", e["seq"])
        if self.not_thread is not None and t == self.not_thread:
            self.fail(f"{_ev(e)} ran on {t}, expected another thread", e["seq"])


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

    def on(self, e):
        ev, rid, obj = e["ev"], e["rid"], e["obj"]
        if ev == self.owner:
            self.owned.add((rid, obj))
            return
        self.checks += 1
        if (rid, obj) not in self.owned:
            self.fail(f"{ev} for {rid} on object {obj}, which is not the Req object allocated for {rid}", e["seq"])
        cur = self.value.get(obj, (0, None, rid))[0]
        want = cur + (1 if ev == self.inc else -1)
        if e["value"] != want:
            self.fail(f"{ev} for {rid} reports {e['value']}, expected {want} on object {obj}", e["seq"])
        if e["value"] < 0:
            self.fail(f"{ev} for {rid} drove the counter below zero ({e['value']})", e["seq"])
        self.value[obj] = (e["value"], e["seq"], rid)

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
            self.events = (self.acq, self.rel, "admit", self.sent, inc, dec)
            self.count = defaultdict(int)
            self.sends = defaultdict(int)

    def handlers(self):
        if self.mode == "pairing":
            return {self.acq: self._pairing, self.rel: self._pairing}
        return {self.acq: _nothing, "admit": self._admit, self.inc: self._inc, self.dec: self._dec,
                self.sent: self._sent, self.rel: self._release}

    def _admit(self, e):
        for rid in e["rids"]:
            if rid in self.released:
                self.fail(f"{rid} admitted in batch {e['batch']} after it was released", self.released[rid], e["seq"])

    def _inc(self, e):
        self.count[e["obj"]] += 1

    def _dec(self, e):
        self.count[e["obj"]] -= 1

    def _sent(self, e):
        self.sends[e["rid"]] += 1

    def _release(self, e):
        self.checks += 1
        rid, seq = e["rid"], e["seq"]
        self.released[rid] = seq
        done = self.ctx.idx[self.rule["processed"][0]]
        for b in self.ctx.rid_batches.get(rid, ()):
            if b not in done:
                s = self.ctx.idx["admit"][b][0]
                self.fail(f"{rid} released while batch {b} holding it was not yet processed", s, seq)
        if self.count.get(e["obj"], 0) > 0:
            self.fail(f"{rid} released with {self.count[e['obj']]} middle chunk(s) in flight", seq)
        if self.sends[rid] == 0:
            self.fail(f"{rid} released before any of its KV was sent", seq)

    def _pairing(self, e):
        rid, obj, slot, seq = e["rid"], e["obj"], e["slot"], e["seq"]
        self.checks += 1
        if e["ev"] == self.acq:
            if slot in self.slots:
                other, s = self.slots[slot]
                self.fail(f"slot {slot} allocated to {rid} while still held by {other}", s, seq)
            if rid in self.live:
                self.fail(f"{rid} allocated twice", self.live[rid][2], seq)
            self.live[rid] = (obj, slot, seq)
            self.slots[slot] = (rid, seq)
        else:
            held = self.live.pop(rid, None)
            if held is None:
                self.fail(f"{rid} released but not allocated (or released twice)", seq)
                return
            self.slots.pop(held[1], None)
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

    def on(self, e):
        if "tokens" in e and "pages" in e:
            self.checks += 1
            want = -(-e["tokens"] // self.ctx.page_size)
            if e["pages"] != want:
                self.fail(f"{e['ev']} of {e['tokens']} tokens covers {e['pages']} pages; "
                          f"ceil({e['tokens']}/{self.ctx.page_size}) = {want}", e["seq"])


class InSpan(Template):
    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.ev = rule["ev"]
        self.begin, self.end = rule["span"]
        self.events = (self.ev, self.begin, self.end)
        self.open = {}  # thread -> batch

    def on(self, e):
        ev, t = e["ev"], e["thread"]
        if ev == self.begin:
            self.open[t] = e["batch"]
        elif ev == self.end:
            self.open.pop(t, None)
        else:
            self.checks += 1
            b = self.open.get(t)
            if b is None:
                self.fail(f"{ev} for {e['rid']} outside any {self.begin}/{self.end} span on {t}", e["seq"])
            elif e["rid"] not in self.ctx.admits.get(b, ()):
                self.fail(f"{ev} for {e['rid']} inside processing of batch {b}, which does not hold it", e["seq"])


TEMPLATES = {"fifo": Fifo, "complete": Complete, "disjoint": Disjoint, "order": Order, "adjacent": Adjacent,
             "outside": Outside, "within": Within, "thread": Thread, "equal": Equal, "counter": Counter,
             "lifecycle": Lifecycle, "page_count": PageCount, "in_span": InSpan}


@dataclass
class Result:
    path: str
    header: dict
    events: int
    rules: list          # [(Rule, checks)]
    violations: list[Violation]

    @property
    def ok(self) -> bool:
        return not self.violations


def check_file(path: str, *, rules: list[Rule] | None = None, extra_templates: dict | None = None) -> Result:
    header: dict = {}
    it = iter_events(path, header_out=header)
    first = next(it, None)  # reads (and validates) the header
    role, mode = header["role"], header.get("mode")
    rules = [r for r in (rules or load_rules()) if r.role == role and r.applies(mode)]
    ctx = Ctx(header, header.get("page_size", 1))
    from .decode_templates import TEMPLATES as DECODE_TEMPLATES  # decode kinds live in their own module

    templates = {**TEMPLATES, **DECODE_TEMPLATES, **(extra_templates or {})}
    active = [templates[r.kind](r, ctx) for r in rules if r.kind in templates]
    by_ev: dict[str, list] = defaultdict(list)
    star = [t.on for t in active if "*" in t.events]
    for t in active:
        for ev, fn in t.handlers().items():
            if ev != "*":
                by_ev[ev].append(fn)
    dispatch: dict[str, tuple] = {}  # ev -> every callable that wants it, star templates included
    idx, admits, rid_batches = ctx.idx, ctx.admits, ctx.rid_batches
    n = 0
    for _, e in itertools.chain((first,) if first is not None else (), it):
        n += 1
        ev = e["ev"]
        fns = dispatch.get(ev)
        if fns is None:
            fns = dispatch[ev] = tuple(by_ev.get(ev, ())) + tuple(star)
        b = e.get("batch")
        if b is not None and ev != "prefix_send":
            table = idx[ev]
            if b not in table:
                table[b] = (e["seq"], e["thread"])
            if ev == "admit":
                admits[b] = set(e["rids"])
                for rid in e["rids"]:
                    rid_batches[rid].append(b)
        for fn in fns:
            fn(e)
    for t in active:
        t.finish()
    violations = [v for t in active for v in t.violations]
    return Result(path, header, n, [(t.rule, t.checks) for t in active], violations)


def _nothing(e) -> None:
    return None


def check_files(paths, *, rules: list[Rule] | None = None) -> list[Result]:
    """Each file against its role's rules, then every decode trace together with the prefill traces of
    its DP ranks given alongside it (the cross-process rules, one extra Result per decode trace)."""
    from .decode_templates import check_cross

    rules = rules or load_rules()
    return [check_file(p, rules=rules) for p in paths] + check_cross(list(paths), rules)

