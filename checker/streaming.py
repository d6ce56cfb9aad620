"""The streaming checker's shared parts: what a template is, the state templates share while the
trace streams past (Ctx, with its batch index and the index's array view Dense), what a check
returns (Violation, Result), and the registries the template kinds are added to.

Each rule kind of spec/ is a small class (a template) instantiated with the rule's parameters:
`events` says which event names it listens to, `on_chunk(events)` gets them a chunk of the trace at
a time (or `on_kinds(by)` the chunk split by kind), `finish()` runs at the end. The kinds of one trace (prefill or decode) register into
TEMPLATES (checker/batch_templates.py, checker/request_templates.py, checker/decode_templates.py);
the cross-process kinds, which read a decode trace against the prefill traces of its DP ranks, into
CROSS_TEMPLATES (checker/cross_templates.py).
"""

from __future__ import annotations

import itertools
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from spec import Rule, load_events
from spec.registry import Registry

_SEQ, _BATCH, _THREAD, _RIDS = (attrgetter(f) for f in ("seq", "batch", "thread", "rids"))


@dataclass
class Violation:
    rule: Rule
    message: str
    seqs: list[int]


@dataclass
class Result:
    path: str
    header: dict
    events: int
    rules: list  # [(Rule, checks)]
    violations: list[Violation]
    # events of kinds no rule knows, skipped: ev -> count
    ignored: dict = field(default_factory=dict)
    # a trace (version 2 or later) without its trace_end: the line it was cut at (trace_io.py)
    truncated: int | None = None
    # the rules a truncated trace cannot decide (`needs_end` in spec/): ids
    not_judged: list = field(default_factory=list)
    stalls: int = 0  # the watchdog's stall markers in the trace
    end_reason: str | None = None  # its trace_end's reason (None: no trace_end)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def complete(self) -> bool:
        """A verdict on every rule: the trace is whole (a truncated one passes nothing)."""
        return self.truncated is None


class Ctx:
    """What the templates of one check share: the header, the page size, and the batch index.

    The index is the first (seq, thread) of each batch of each batch-indexed kind, and the rids of
    each batch's first admit. The checker hands it each chunk's events of those kinds (`add`), of
    which it keeps the batch, seq and thread (and an admit's rids) as columns, read in C while the
    chunk is fresh in the cache, and not the events: an event kept past its chunk costs its
    memory's reuse, and read again at the end, from all over memory, its fields cost several
    times as much. The index is built from the columns when first read: as dicts (`idx`,
    `admits`) for the loops that read a few batches, as numpy arrays (`dense()`) for the
    finish-time templates that read them all. A passing check of batch ids dense enough for
    arrays builds only the arrays."""

    def __init__(self, header: dict, page_size: int):
        self.header, self.page_size = header, page_size
        self._idx: dict = defaultdict(dict)  # ev -> batch -> (seq, thread)
        self._admits: dict = {}  # batch -> rids of its (first) admit
        # ev -> (batches, seqs, thread codes, rids (admits only, else empty)) of its events, in
        # trace order: machine ints (array 'q'), so that no int or str object of an event is kept
        self._columns: dict = {}
        # thread name -> code (a new name gets the next code, in C); `threads` the names by code
        self._thread_codes: defaultdict = defaultdict()
        self._thread_codes.default_factory = self._thread_codes.__len__
        self.thread_code = self._thread_codes.__getitem__  # name -> code (a new name: the next)
        self._indexed: dict = {}  # ev -> how many of its events _idx holds
        self._dense: object = None
        # the chunk's columns of each batch-indexed kind, made by `add` (cleared per chunk): ev ->
        # (batches, seqs, the set of its threads), for the templates that judge whole columns,
        # which would otherwise read every event's fields again
        self.columns: dict = {}

    def has(self, ev: str, *fields: str) -> bool:
        """Whether events of kind `ev` in this trace's role and version carry every one of
        `fields` (an optional one absent from an event reads None): a property of the format, not
        of an event, so that a template asks it once and not per event."""
        spec = load_events().get(self.header.get("role"), {}).get(ev)
        if spec is None or spec.get("since", 1) > self.header.get("version", 1):
            return False
        return all(f in spec.get("fields", {}) or f in spec.get("optional", {}) for f in fields)

    def thread_column(self, threads: list, names: set | None = None) -> array:
        """The codes of `threads` (thread names; `names`, their set, if known) as machine ints."""
        names = set(threads) if names is None else names
        if len(names) == 1:  # the usual case: one thread runs every event of a kind
            return array("q", [self.thread_code(threads[0])]) * len(threads)
        return array("q", list(map(self.thread_code, threads)))

    def add(self, ev: str, evs: list) -> None:
        """A chunk's events of a batch-indexed kind `ev` (trace order)."""
        cols = self._columns.get(ev)
        if cols is None:
            cols = self._columns[ev] = (array("q"), array("q"), array("q"), [])
        # (batch is a validated int of 64 bits for every kind indexed: spec's `batch = "int"`;
        # fromlist of a list: about half the time of extend from an iterator)
        batches, seqs, threads = (
            list(map(_BATCH, evs)),
            list(map(_SEQ, evs)),
            list(map(_THREAD, evs)),
        )
        cols[0].fromlist(batches)
        cols[1].fromlist(seqs)
        names = set(threads)
        cols[2].extend(self.thread_column(threads, names))
        self.columns[ev] = (batches, seqs, names)
        if ev == "admit":
            cols[3].extend(map(_RIDS, evs))
        self._dense = None

    @property
    def idx(self) -> dict:
        """ev -> batch -> (seq, thread) of the first `ev` of the batch."""
        self._index()
        return self._idx

    @property
    def admits(self) -> dict:
        """batch -> rids of its first admit, in admission order."""
        self._index()
        return self._admits

    def admitted(self) -> set:
        """The batch ids admitted so far."""
        cols = self._columns.get("admit")
        return set(cols[0]) if cols is not None else set()

    @property
    def threads(self) -> list[str]:
        """The thread names, by code."""
        return list(self._thread_codes)

    def _index(self) -> None:
        names = self.threads
        for ev, (batches, seqs, codes, rids) in self._columns.items():
            done = self._indexed.get(ev, 0)
            if done < len(batches):
                self._indexed[ev] = len(batches)
                _index(
                    self._idx[ev],
                    batches[done:].tolist(),
                    list(zip(seqs[done:], map(names.__getitem__, codes[done:]))),
                    rids[done:] if ev == "admit" else None,
                    self._admits,
                )

    def dense(self) -> Dense | None:
        """The batch index as arrays, for the finish-time templates (built once, at finish)."""
        if self._dense is None:
            self._dense = Dense.build(self) or False
        return self._dense or None


def _index(table: dict, batches: list, facts: list, rids: list | None, admits: dict) -> None:
    """The first (seq, thread) of each batch (`facts`, one per entry of `batches`, trace order)
    into `table`, and with `rids` (an admit's, per entry) the rids of each batch's first admit."""
    # later entries overwrite earlier ones: reversed, the first of a batch wins
    first = dict(zip(reversed(batches), reversed(facts)))
    if all(map(table.__contains__, first)):
        return
    order = [b for b in dict.fromkeys(batches) if b not in table]  # as first met
    table.update([(b, first[b]) for b in order])
    if rids is not None:
        first_rids = dict(zip(reversed(batches), reversed(rids)))
        admits.update((b, first_rids[b]) for b in order)


class Dense:
    """The batch index as numpy columns over the batch range [lo, lo + n): seq (0 = no such
    event) and a thread code per event name, built on first use from Ctx's columns (the first
    event of each batch); `admits` the admitted batch ids in admission order. The finish-time
    templates evaluate all batches at once on these; a trace whose batch ids are too sparse for
    arrays (a foreign engine numbering batches by time, say) keeps the per-batch loops."""

    def __init__(self, ctx, lo: int, n: int, admits: list, batches: dict):
        self.ctx, self.lo, self.n = ctx, lo, n
        self.admits = np.array(admits, dtype=np.int64)
        self._batches = batches  # ev -> the batch of each of its events (an array)
        self.threads: list[str] = ctx.threads  # thread names by code
        self._cols: dict[str, tuple] = {}

    @classmethod
    def build(cls, ctx) -> Dense | None:
        batches = {}  # ev -> the batch of each of its events
        for ev, cols in ctx._columns.items():
            batches[ev] = np.frombuffer(cols[0], dtype=np.int64).copy()
        keys = [f(b) for b in batches.values() if len(b) for f in (np.min, np.max)]
        admitted = batches.get("admit")
        if admitted is None or not len(admitted) or not keys:
            return None
        admits = list(dict.fromkeys(admitted.tolist()))
        lo, hi = int(min(keys)), int(max(keys))
        if hi - lo + 1 > 4 * len(admits) + 4096:
            return None
        return cls(ctx, lo, hi - lo + 1, admits, batches)

    def col(self, ev: str) -> tuple:
        """(seq, thread code) arrays of `ev` over the batch range."""
        got = self._cols.get(ev)
        if got is None:
            b = self._batches.get(ev)
            # one spare slot: out-of-range lookups land there
            seq = np.zeros(self.n + 1, dtype=np.int64)
            thr = np.full(self.n + 1, -1, dtype=np.int64)
            if b is not None and len(b):  # in C: each batch's first event (np.unique's index)
                _, seqs, codes, _ = self.ctx._columns[ev]
                k, first = np.unique(b - self.lo, return_index=True)
                seq[k] = np.frombuffer(seqs, dtype=np.int64)[first]
                thr[k] = np.frombuffer(codes, dtype=np.int64)[first]
            got = self._cols[ev] = (seq, thr)
        return got

    def at(self, ev: str, off: int) -> tuple:
        """(seq, thread code) of `ev` for batch n + off, for every admitted batch n (seq 0:
        none)."""
        seq, thr = self.col(ev)
        k = self.admits + (off - self.lo)
        k[(k < 0) | (k >= self.n)] = self.n
        return seq[k], thr[k]


class Template:
    """`events`: the event names it listens to ("*": all). The checker hands it, per chunk of the
    trace, the list of its events in trace order (`on_chunk`); the default calls the handler of
    each. A template keeps the state it needs while streaming itself; the shared index in Ctx
    (batch-indexed facts) is complete only when `finish()` runs."""

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

    # A template may instead take its events a kind at a time: `on_kinds(by)`, with `by` the chunk's
    # events split by kind (ev -> its events in trace order, every kind of the chunk; shared with
    # the other templates, not to be changed), for rules judged on whole columns of a chunk (the
    # order between kinds read from `seq`). None: the checker calls on_chunk.
    on_kinds = None
    # A template fed its events in order may also skip a chunk: `idle(by)` (the split, as above)
    # records what it must of the chunk and returns True when walking it would judge nothing.
    idle = None

    def on_chunk(self, evs: list) -> None:
        h = self.handlers()
        star = h.get("*")
        if star is not None:
            for e in evs:
                star(e)
            return
        for e in evs:
            h[e.ev](e)

    def finish(self) -> None:
        pass


# The template kinds of one trace, prefill or decode: kind -> Template subclass.
TEMPLATES: Registry[type[Template]] = Registry("linear template")
# The cross-process kinds: a decode trace against the prefill traces of its DP ranks.
CROSS_TEMPLATES: Registry[type[Template]] = Registry("cross-process template")


def in_order(by: dict, kinds) -> list:
    """The events of `kinds` in `by` (ev -> events, each list in trace order) in trace order."""
    lists = [by[k] for k in kinds if k in by]
    if len(lists) <= 1:
        return lists[0] if lists else []
    return sorted(itertools.chain.from_iterable(lists), key=_SEQ)


def event_label(e) -> str:
    """`ev(batch)`, or `ev` for an event without a batch: how messages name an event (a struct
    of the linear checker, or a dict)."""
    b, ev = (e.get("batch"), e["ev"]) if type(e) is dict else (getattr(e, "batch", None), e.ev)
    return f"{ev}({b})" if b is not None else ev
