"""Predictive analysis: the rule violations a passing trace was one thread switch away from.

A trace shows one interleaving. With each event's vector clock (`vc`, docs/trace-format.md, written
by `pdo run` unless `--no-hb`; each event holds what changed since its thread's previous one,
replayed here into whole clocks) the trace also says which orders were forced: e happened before f exactly when
`e.vc[own(e)] <= f.vc[own(e)]`, and any two events not ordered so could have run the other way.

For every rule of the trace's mode, the ordering pairs the rule constrains (a chain's consecutive
steps, an event and the span it must lie in or avoid, a step of two consecutive batches, the events
of one request on different threads) are checked against the clocks. A pair the clocks leave
unordered is a candidate: the reordering that moves the second event, with everything that happened
before it, ahead of the first is a schedule the engine allows. Each candidate is confirmed by running
that rule on the reordered trace (checker/linear.py), so what is reported is a violation the
checker itself would report on a run that happened to go that way; candidates are grouped by the
events and batch offsets involved, and a few of each group are tried.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from spec import Rule, load_rules
from spec.errors import BadInput

from .linear import check_events
from .streaming import TEMPLATES, event_label
from .trace_io import PRIVATE_PREFIX, iter_chunks

TRIES_PER_PATTERN = 3  # reorderings checked per group of alike candidates before giving it up
RID_KINDS = ("counter", "lifecycle", "in_span", "each_in_span", "chunk_sent", "delivered")
SEARCHED_KINDS = frozenset({"order", "fifo", "disjoint", "within", "outside", *RID_KINDS})
# Why a rule of these kinds is not searched: no reordering of the trace's events changes its
# verdict. Any other kind is a stateful template (checker/decode_templates.py): each event it reads
# is paired with the latest one of every other thread it reads.
_SAME = "no reordering changes its verdict"
UNSEARCHED_WHY = {
    "adjacent": f"orders one thread's events, which program order fixes: {_SAME}",
    "thread": f"names the thread each event runs on: {_SAME}",
    "complete": f"asks which events the trace holds: {_SAME}",
    "equal": f"compares the digests of two events: {_SAME}",
    "page_aligned": f"reads the sizes the sends carry: {_SAME}",
    "page_count": f"reads the pages the events count: {_SAME}",
}
CROSS_WHY = f"compares values across the run's traces: {_SAME}"  # every cross-process kind


class NoClocks(BadInput, ValueError):
    """The trace carries no happens-before clocks."""


@dataclass
class Prediction:
    rule: Rule
    first: dict  # the event that came first in the trace
    second: dict  # the event that could have come before it
    message: str  # the checker's violation on the reordered trace
    timeline: list[str]
    candidates: int = 1  # alike candidates (same events, same batch offset) in the trace


@dataclass
class PredictResult:
    path: str
    header: dict
    events: int
    candidates: int
    predictions: list[Prediction] = field(default_factory=list)
    searched: list[str] = field(default_factory=list)  # the rules whose pairs were searched
    unsearched: list[tuple[str, str]] = field(default_factory=list)  # (rule, why not)
    isolated: list[str] = field(default_factory=list)  # Clocks.isolated
    skipped: int = 0  # unordered pairs not searched: an event of an isolated thread in each

    @property
    def ok(self) -> bool:
        return not self.predictions

    @property
    def complete(self) -> bool:
        """Every unordered pair searched: no verdict of "no predicted violation" otherwise."""
        return not self.skipped


class Clocks:
    """The happens-before order of one trace's events, by position in the trace."""

    def __init__(self, path: str, header: dict, events: list[dict], keep=None):
        """`keep(e)`: the events to order, of `events` (default: all); the others still advance
        their thread's clock (an engine's own event, `x.<name>`, may carry a hand-off's
        components)."""
        tag = header.get("hb")
        if not isinstance(tag, str):
            raise NoClocks(
                f"{path}: header has no 'hb' field: no happens-before clocks (pdo run and the "
                "SGLang adapter write them unless run with --no-hb or PDO_HB=0)"
            )
        self.events: list[dict] = []
        self.keys, self.own, self.vcs = [], [], []
        last: dict = {}  # thread -> the clock of its previous event
        for e in events:
            vc, th = e.get("vc"), e["thread"]
            k = tag + th
            if isinstance(vc, int) and not isinstance(vc, bool) and th in last:
                vc = {**last[th], k: vc}  # only the count: the rest as at the previous event
            elif isinstance(vc, dict) and th in last and k in vc:
                # what changed (format 4); a whole clock (format 3) restates every component, and
                # a thread's clock only grows, so both read the same this way
                vc = {**last[th], **vc}
            if not isinstance(vc, dict) or not isinstance(vc.get(k), int):
                raise NoClocks(f"{path}: event seq {e['seq']}: field 'vc': no clock of its thread")
            if th in last and vc[k] <= last[th][k]:
                raise NoClocks(
                    f"{path}: event seq {e['seq']}: field 'vc': its thread's own count {vc[k]} "
                    f"does not follow the {last[th][k]} of its previous event"
                )
            last[th] = vc
            if keep is not None and not keep(e):
                continue
            self.events.append(e)
            self.keys.append(k)
            self.own.append(vc[k])
            self.vcs.append(vc)
        self.isolated = _isolated(tag, last)

    def before(self, i: int, j: int) -> bool:
        """Event i happened before event j (i != j)."""
        return self.own[i] <= self.vcs[j].get(self.keys[i], 0)

    def reorder(self, i: int, j: int) -> tuple[list[dict], int]:
        """The trace with event j and what happened before it since i moved ahead of i (i < j, i not
        before j), renumbered; and how many events moved."""
        ev = self.events
        moved = [x for x in range(i + 1, j) if self.before(x, j)] + [j]
        keep = set(moved)
        order = [
            *range(i),
            *moved,
            *(x for x in range(i, j) if x not in keep),
            *range(j + 1, len(ev)),
        ]
        return [{**ev[x], "seq": n + 1} for n, x in enumerate(order)], len(moved)


def _isolated(tag: str, last: dict) -> set[str]:
    """The threads, of two or more, whose clock never met another's: no hand-off logged from them
    or to them. The clocks leave their events unordered against every other thread's, the orders
    their program forced included, so a reordering built from them could be one no run allows."""
    if len(last) < 2:
        return set()
    met = {k for vc in last.values() if len(vc) > 1 for k in vc}
    return {th for th in last if tag + th not in met}


def _index(events: list[dict]) -> dict:
    """ev -> batch -> position of its first event for that batch."""
    idx: dict = defaultdict(dict)
    for p, e in enumerate(events):
        b = e.get("batch")
        if isinstance(b, int):
            idx[e["ev"]].setdefault(b, p)
    return idx


def _ev(x) -> str:
    return x[0] if isinstance(x, list) else x


def _pairs(rule: Rule, events: list[dict], idx: dict, clocks: Clocks):
    """(i, j) with i < j in the trace, a pair the rule orders, that the clocks leave unordered."""
    batches = sorted(idx.get("admit", {}))
    out = []

    def consider(i, j):
        if i is not None and j is not None and i < j and not clocks.before(i, j):
            out.append((i, j))

    kind = rule.kind
    if kind == "order":
        chain = rule["chain"]
        for n in batches:
            pos = [idx.get(ev, {}).get(n + off) for ev, off in chain]
            pos = [p for p in pos if p is not None]
            for a, b in zip(pos, pos[1:]):
                consider(a, b)
    elif kind == "fifo":
        for ev in rule["events"]:
            for n in batches:
                consider(idx.get(ev, {}).get(n), idx.get(ev, {}).get(n + 1))
    elif kind == "disjoint":
        s0, s1 = (_ev(x) for x in rule["span"])
        for n in batches:
            consider(idx.get(s1, {}).get(n), idx.get(s0, {}).get(n + 1))
    elif kind in ("within", "outside"):
        if kind == "within":
            s0, s1 = rule["after"], rule["before"]
        else:
            s0, s1 = (_ev(x) for x in rule["span"])
        for p, e in enumerate(events):
            if e["ev"] != rule["ev"] or not isinstance(e.get("batch"), int):
                continue
            n = e["batch"]
            near = (n,) if kind == "within" else range(n - 2, n + 3)
            for m in near:
                a, b = idx.get(s0, {}).get(m), idx.get(s1, {}).get(m)
                if kind == "within":
                    consider(a, p)
                    consider(p, b)
                else:  # the event could fall inside the span: after its start or before its end
                    consider(p, a)
                    consider(b, p)
    elif kind not in SEARCHED_KINDS:  # a stateful template: a thread switch among its events
        listens = set(TEMPLATES[kind].events)
        last: dict = {}  # thread -> position of its latest event the rule reads
        for p, e in enumerate(events):
            if "*" in listens or e["ev"] in listens:
                for q in last.values():
                    consider(q, p)
                last[e["thread"]] = p
    elif kind in RID_KINDS:
        named = {_ev(v) for v in _param_events(rule)}
        last: dict = {}
        for p, e in enumerate(events):
            if e["ev"] in named and "rid" in e:
                q = last.get(e["rid"])
                if q is not None and events[q]["thread"] != e["thread"]:
                    consider(q, p)
                last[e["rid"]] = p
    return out


def _param_events(rule: Rule):
    for v in rule.params.values():
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, str) or (isinstance(x, list) and x and isinstance(x[0], str)):
                yield x


def _timeline(events: list[dict], i: int, j: int, moved_first: list[dict]) -> list[str]:
    threads = sorted({events[i]["thread"], events[j]["thread"]})
    width = max(len(t) for t in threads) + 2

    def line(e, mark=""):
        col = threads.index(e["thread"]) if e["thread"] in threads else 0
        return f"    {' ' * (col * width)}{e['thread']}: {event_label(e)} (seq {e['seq']}){mark}"

    seen = [
        line(events[i], "  <- first in the trace"),
        line(events[j], "  <- not ordered after it"),
    ]
    moved, first = moved_first[:-1], moved_first[-1]
    could = [line(e) for e in moved[:2]]
    if len(moved) > 4:
        could.append(f"    ... {len(moved) - 4} more moved ahead with it")
    could += [line(e) for e in moved[max(2, len(moved) - 2) :]] + [line(first)]
    return ["  seen:", *seen, "  possible:", *could]


def predict_file(path: str, *, rules: list[Rule] | None = None) -> PredictResult:
    header: dict = {}
    logged = [e for chunk in iter_chunks(path, header_out=header, own=True) for e in chunk]
    clocks = Clocks(path, header, logged, keep=lambda e: not e["ev"].startswith(PRIVATE_PREFIX))
    events = clocks.events
    role, mode = header["role"], header.get("mode")
    every = rules if rules is not None else load_rules()
    rules = [r for r in every if r.role == role and r.applies(mode, header)]
    idx = _index(events)
    result = PredictResult(path, header, len(events), 0, isolated=sorted(clocks.isolated))
    cross = [r for r in every if r.role == "cross"] if "pd_run" in header else []
    for rule in [*rules, *cross]:
        if rule.kind in UNSEARCHED_WHY or rule.role == "cross":
            result.unsearched.append((rule.id, UNSEARCHED_WHY.get(rule.kind, CROSS_WHY)))
            continue
        result.searched.append(rule.id)
        groups: dict = defaultdict(list)
        for i, j in _pairs(rule, events, idx, clocks):
            if events[i]["thread"] in clocks.isolated or events[j]["thread"] in clocks.isolated:
                result.skipped += 1
                continue
            a, b = events[i], events[j]
            off = b["batch"] - a["batch"] if "batch" in a and "batch" in b else None
            groups[(a["ev"], b["ev"], off)].append((i, j))
        result.candidates += sum(len(g) for g in groups.values())
        for pairs in groups.values():
            for i, j in pairs[:TRIES_PER_PATTERN]:
                reordered, moved = clocks.reorder(i, j)
                found = check_events(header, reordered, [rule])
                if found:
                    window = reordered[i : i + moved + 1]
                    result.predictions.append(
                        Prediction(
                            rule,
                            events[i],
                            events[j],
                            found[0].message,
                            _timeline(events, i, j, window),
                            len(pairs),
                        )
                    )
                    break
    return result


def text_report(r: PredictResult) -> str:
    head = (
        f"{r.path}: {r.header.get('role')} mode={r.header.get('mode')}, {r.events} events, "
        f"{r.candidates} unordered rule pair(s)"
    )
    lines = [
        head
        + (": no predicted violation" if r.ok else f": {len(r.predictions)} predicted violation(s)")
    ]
    if r.skipped:
        lines.append(
            f"  INCOMPLETE: {r.skipped} unordered pair(s) not searched: thread(s) "
            f"{', '.join(r.isolated)} logged events but no hand-off with any other thread, so the "
            "clocks cannot tell which of their orders the program forced (a hand-off the tracer "
            "does not log?)"
        )
    lines.append(
        f"  searched {len(r.searched)} rule(s); not searched:" + ("" if r.unsearched else " none")
    )
    by_why: dict = defaultdict(list)
    for rule, why in r.unsearched:
        by_why[why].append(rule)
    lines.extend(f"    {', '.join(ids)}: {why}" for why, ids in by_why.items())
    for p in r.predictions:
        lines.append(
            f"PREDICTED {p.rule.id}: {event_label(p.second)} (seq {p.second['seq']}, "
            f"{p.second['thread']}) could run before {event_label(p.first)} (seq "
            f"{p.first['seq']}, {p.first['thread']}); {p.candidates} alike pair(s)"
        )
        lines.append(f"  then: {p.message}")
        lines.extend(p.timeline)
    return "\n".join(lines)


def json_report(r: PredictResult) -> dict:
    return {
        "path": r.path,
        "events": r.events,
        "candidates": r.candidates,
        "ok": r.ok,
        "complete": r.complete,
        "isolated": r.isolated,
        "skipped": r.skipped,
        "searched": r.searched,
        "unsearched": [{"rule": rule, "why": why} for rule, why in r.unsearched],
        "predictions": [
            {
                "rule": p.rule.id,
                "first": {k: p.first[k] for k in ("seq", "thread", "ev")},
                "second": {k: p.second[k] for k in ("seq", "thread", "ev")},
                "message": p.message,
                "alike": p.candidates,
            }
            for p in r.predictions
        ],
    }
