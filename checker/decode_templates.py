"""Templates for the decode rule kinds of spec/decode_rules.toml.

Same interface as the other templates (checker/streaming.py: `events`, `on(e)`, `finish()`,
`fail()`), registered into the same TEMPLATES. Most rules here follow one piece of state through the
decode trace: the outstanding prefetched query per bootstrap address (submitted, then consumed by a
resolve or cancelled), the rooms pending per address. The receiver's kinds (the rank each room was
resolved to, its KV, the request's end) are in checker/receiver_templates.py.

The cross-process check (`check_cross`, `cross_pairs`, CROSS_TEMPLATES) lives in
checker/cross_templates.py; it is re-exported here, where checker.z3check and the tests import it.
"""

from __future__ import annotations

from collections import defaultdict

from spec.vocabulary import SCHEDULER

from .cross_templates import CROSS_TEMPLATES, check_cross, cross_pairs  # noqa: F401 (re-exported)
from .streaming import TEMPLATES, Template

SCHED = SCHEDULER


class DecodeTemplate(Template):
    """The linear checker's template base (events, on, finish, fail), for decode rule kinds."""


def _rooms(e: dict) -> tuple:
    rooms = getattr(e, "rooms", None)
    return tuple(rooms) if isinstance(rooms, list) else ()


def _answered(e: dict) -> dict:
    """{room: rank} of a resolve or query_end event (keys are strings in JSON)."""
    res = getattr(e, "result", None)
    if not isinstance(res, dict):
        return {}
    out = {}
    for k, v in res.items():
        try:
            out[int(k)] = v
        except (TypeError, ValueError):
            pass
    return out


class Outstanding:
    """Prefetched queries not yet consumed or cancelled: addr -> (qid, rooms, seq); the qids
    cancelled, and of those the ones whose cancel did not stop them (`stopped` false or absent:
    the pool thread may have taken the call, its query_begin may follow)."""

    def __init__(self):
        self.by_addr: dict = {}
        self.cancelled: set = set()
        self.may_run: set = set()

    def on(self, e: dict):
        ev, addr = e.ev, getattr(e, "addr", None)
        if ev == "prefetch_submit":
            prev = self.by_addr.get(addr)
            self.by_addr[addr] = (e.qid, _rooms(e), e.seq)
            return prev
        if ev == "prefetch_cancel":
            self.cancelled.add(e.qid)
            if getattr(e, "stopped", None) is not True:
                self.may_run.add(e.qid)
            if addr in self.by_addr and self.by_addr[addr][0] == e.qid:
                del self.by_addr[addr]
        elif ev == "resolve" and getattr(e, "qid", None) is not None:
            if addr in self.by_addr and self.by_addr[addr][0] == e.qid:
                del self.by_addr[addr]
        return None


@TEMPLATES.register("prefetch_top")
class PrefetchTop(DecodeTemplate):
    events = ("*",)

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.thread = rule.get("thread", SCHED)
        self.enabled = ctx.header.get("prefetch", True)
        self.iter = None  # (iter, seq) just begun, prefetch not seen yet
        self.open = None  # (iter, seq) of a prefetch_begin without its prefetch_end

    def on(self, e):
        if e.thread != self.thread:
            return
        ev = e.ev
        if not self.enabled:
            if ev in ("prefetch_begin", "prefetch_submit"):
                self.checks += 1
                self.fail(f"{ev} although prefetch is off (header prefetch=false)", e.seq)
            return
        if self.iter is not None:
            it, s = self.iter
            self.iter = None
            self.checks += 1
            if ev != "prefetch_begin" or getattr(e, "iter", None) != it:
                self.fail(
                    f"iteration {it}: first step was {ev}, not prefetch_begin({it})", s, e.seq
                )
                if ev != "prefetch_begin":
                    return
            self.open = (getattr(e, "iter", None), e.seq)
            return
        if ev == "iter_begin":
            if self.open is not None:
                self.fail(
                    f"iteration {e.iter} began inside prefetch call of iteration {self.open[0]}",
                    self.open[1],
                    e.seq,
                )
                self.open = None
            self.iter = (e.iter, e.seq)
        elif ev == "prefetch_begin":
            self.checks += 1
            self.fail(
                f"prefetch_begin({getattr(e, 'iter', None)}) is not the first step of its iteration (a "
                "second call?)",
                e.seq,
            )
        elif ev == "prefetch_end":
            self.open = None

    def finish(self):
        if self.iter is not None and self.enabled:
            self.checks += 1
            self.fail(f"iteration {self.iter[0]} never called the prefetch", self.iter[1])


@TEMPLATES.register("one_inflight")
class OneInflight(DecodeTemplate):
    events = ("prefetch_submit", "prefetch_cancel", "resolve")

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.out = Outstanding()

    def on(self, e):
        prev = self.out.on(e)
        if e.ev == "prefetch_submit":
            self.checks += 1
            if prev is not None:
                self.fail(
                    f"query {e.qid} submitted for {e.addr} while query {prev[0]} for "
                    f"it is still outstanding",
                    prev[2],
                    e.seq,
                )


@TEMPLATES.register("published_first")
class PublishedFirst(DecodeTemplate):
    events = ("prefill_info", "query_begin", "prefetch_submit")

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.published = set()

    def on(self, e):
        if e.ev == "prefill_info":
            if getattr(e, "published", None) is True:
                self.published.add(e.addr)
            return
        self.checks += 1
        if e.addr not in self.published:
            self.fail(
                f"{e.ev} (query {getattr(e, 'qid', None)}) to {e.addr} before its prefill "
                f"parallel info was seen published",
                e.seq,
            )


@TEMPLATES.register("unknown_rooms")
class UnknownRooms(DecodeTemplate):
    events = ("resolve", "query_begin", "prefetch_cancel")

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.known: dict = {}  # room -> seq of the resolve that answered it
        self.may_run = set()  # qids cancelled by a cancel that did not stop them

    def on(self, e):
        ev = e.ev
        if ev == "prefetch_cancel":
            if getattr(e, "stopped", None) is not True:
                self.may_run.add(e.qid)
        elif ev == "resolve":
            for room in _answered(e):
                self.known.setdefault(room, e.seq)
        # a future the cancel did not stop (the pool had taken it) starts anyway: it asks, unused
        elif e.qid not in self.may_run:
            self.checks += 1
            again = [r for r in _rooms(e) if r in self.known]
            if again:
                self.fail(
                    f"query {e.qid} to {e.addr} asks for room(s) {again} whose rank is known",
                    self.known[again[0]],
                    e.seq,
                )


@TEMPLATES.register("prefetch_match")
class PrefetchMatch(DecodeTemplate):
    events = ("prefetch_submit", "prefetch_cancel", "query_begin", "resolve")

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.out = Outstanding()
        self.submitted: dict = {}  # qid -> (addr, rooms, seq)
        self.sync: dict = defaultdict(list)  # addr -> sync query rooms since its last resolve

    def on(self, e):
        ev = e.ev
        if ev == "prefetch_submit":
            self.submitted[e.qid] = (e.addr, _rooms(e), e.seq)
        elif ev == "query_begin" and getattr(e, "source", None) == "sync":
            self.sync[e.addr].append(_rooms(e))
        if ev != "resolve":
            self.out.on(e)
            return
        self.checks += 1
        addr, rooms, src, qid, seq = (
            e.addr,
            _rooms(e),
            getattr(e, "source", None),
            getattr(e, "qid", None),
            e.seq,
        )
        syncs, self.sync[addr] = self.sync[addr], []
        outstanding = self.out.by_addr.get(addr)
        self.out.on(e)
        if src in ("prefetched", "prefix"):
            sub = self.submitted.get(qid)
            if sub is None or sub[0] != addr:
                self.fail(
                    f"resolve for {addr} uses query {qid}, never submitted for that address", seq
                )
            elif qid in self.out.cancelled:
                self.fail(f"resolve uses query {qid}, which was cancelled", sub[2], seq)
            elif src == "prefetched" and sub[1] != rooms:
                self.fail(
                    f"prefetched answer for rooms {list(sub[1])} used for rooms {list(rooms)}",
                    sub[2],
                    seq,
                )
            elif src == "prefix":
                n = len(sub[1])
                if not (0 < n < len(rooms) and rooms[:n] == sub[1]):
                    self.fail(
                        f"answer for rooms {list(sub[1])} used as a prefix of {list(rooms)}",
                        sub[2],
                        seq,
                    )
                elif getattr(e, "error", None) is None and [rooms[n:]] != syncs:
                    self.fail(
                        f"prefix resolve of {list(rooms)}: tail {list(rooms[n:])} expected "
                        f"as one sync query, got {[list(s) for s in syncs]}",
                        sub[2],
                        seq,
                    )
        elif src == "sync":
            if outstanding is not None:
                self.fail(
                    f"sync resolve for {addr} while prefetched query {outstanding[0]} was "
                    f"neither used nor cancelled",
                    outstanding[2],
                    seq,
                )
            if syncs != [rooms]:
                self.fail(
                    f"sync resolve of {list(rooms)}: expected one sync query for exactly "
                    f"these rooms, got {[list(s) for s in syncs]}",
                    seq,
                )
        else:
            self.fail(f"resolve with unknown source {src!r}", seq)


class Pending:
    """Rooms pending per address: added at req_add, gone at receiver_init or req_abort."""

    def __init__(self):
        self.addr_of: dict = {}
        self.by_addr: dict = defaultdict(set)

    def on(self, e: dict) -> None:
        ev, room = e.ev, getattr(e, "room", None)
        if ev == "req_add":
            self.addr_of[room] = e.addr
            self.by_addr[e.addr].add(room)
        elif ev in ("receiver_init", "req_abort") and room in self.addr_of:
            self.by_addr[self.addr_of[room]].discard(room)


@TEMPLATES.register("no_stale")
class NoStale(DecodeTemplate):
    events = (
        "req_add",
        "receiver_init",
        "req_abort",
        "prefetch_submit",
        "prefetch_cancel",
        "resolve",
        "prefetch_end",
    )

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.out = Outstanding()
        self.pending = Pending()

    def on(self, e):
        if e.ev == "prefetch_end":
            for addr, (qid, rooms, s) in self.out.by_addr.items():
                self.checks += 1
                if not self.pending.by_addr.get(addr):
                    self.fail(
                        f"after prefetch call {e.iter}: query {qid} for {addr} (rooms "
                        f"{list(rooms)}) is still outstanding, no request pending there",
                        s,
                        e.seq,
                    )
            return
        self.pending.on(e)
        self.out.on(e)


def _asks_while_released(e, may_run: set) -> bool:
    """What D-release-cancels forbids between release_memory and resume_memory: a prefetch
    submitted, a query, a parallel-info fetch, a receiver initialised; but the query_begin of a
    prefetched query whose cancel did not stop it (`may_run`: the pool thread had taken the call,
    so it runs after the cancel; a cancel that stopped it means it never runs)."""
    ev = e.ev
    return ev in ("prefetch_submit", "receiver_init", "prefill_info") or (
        ev == "query_begin"
        and not (getattr(e, "source", None) == "prefetch" and getattr(e, "qid", None) in may_run)
    )


@TEMPLATES.register("release")
class Release(DecodeTemplate):
    events = (
        "release_memory",
        "resume_memory",
        "prefetch_submit",
        "prefetch_cancel",
        "resolve",
        "receiver_init",
        "query_begin",
        "prefill_info",
    )

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.out = Outstanding()
        self.released = None

    def on(self, e):
        ev = e.ev
        if ev == "release_memory":
            self.checks += 1
            for addr, (qid, _, s) in self.out.by_addr.items():
                self.fail(f"query {qid} for {addr} still outstanding at release_memory", s, e.seq)
            self.released = e.seq
        elif ev == "resume_memory":
            self.released = None
        elif self.released is not None and _asks_while_released(e, self.out.may_run):
            self.checks += 1
            what = {"receiver_init": lambda: f"room {e.room}", "prefill_info": lambda: e.addr}.get(
                ev, lambda: f"query {e.qid}"
            )()
            self.fail(
                f"{ev} ({what}) after release_memory, before resume_memory", self.released, e.seq
            )
        self.out.on(e)


def _room_list(e, key: str):
    """A list-of-int field, or None when the event does not carry it."""
    v = getattr(e, key, None)
    return tuple(v) if isinstance(v, list) else None


@TEMPLATES.register("consume_answer")
class ConsumeAnswer(DecodeTemplate):
    """At each consumption point (a resolve carrying `pending` and `covered`, what SGLang's queue held
    when the point began): the pending rooms are those the trace has pending at the address, the
    resolved rooms are pending rooms whose rank no earlier resolve answered, `covered` is the rooms
    of the address's query still open (submitted, no resolve of the address since, not cancelled
    but by this point's mismatch), and the answer used is the one PR #35071 prescribes: the
    prefetched one when it covers the rooms (all: prefetched; a proper prefix: prefix), otherwise
    a synchronous query."""

    events = (
        "req_add",
        "receiver_init",
        "req_abort",
        "prefetch_submit",
        "prefetch_cancel",
        "resolve",
    )

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.pending = Pending()
        self.open: dict = {}  # addr -> (qid, rooms, seq) of the query open for the next point
        self.known: set = set()  # rooms some resolve answered with a rank

    def on(self, e):
        ev = e.ev
        if ev == "prefetch_submit":
            self.open[e.addr] = (e.qid, _rooms(e), e.seq)
        elif ev == "prefetch_cancel":
            q = self.open.get(e.addr)
            if q is not None and q[0] == e.qid and getattr(e, "reason", None) != "mismatch":
                del self.open[e.addr]
        elif ev == "resolve":
            self._resolve(e)
            self.open.pop(e.addr, None)
            self.known.update(r for r, k in _answered(e).items() if isinstance(k, int))
        self.pending.on(e)

    def _resolve(self, e):
        pending, covered = _room_list(e, "pending"), _room_list(e, "covered")
        if pending is None or covered is None:
            return
        self.checks += 1
        addr, rooms, seq = e.addr, _rooms(e), e.seq
        have = self.pending.by_addr.get(addr, set())
        if set(pending) != have:
            self.fail(
                f"consumption point for {addr} held pending rooms {sorted(pending)}; the trace "
                f"has {sorted(have)} pending there",
                seq,
            )
        stray = [r for r in rooms if r not in pending or r in self.known]
        if stray:
            self.fail(f"resolve for {addr} asks rooms {stray}: not pending, or rank known", seq)
        q = self.open.get(addr)
        want = q[1] if q is not None else ()
        if covered != want:
            self.fail(
                f"consumption point for {addr} found a query for rooms {list(covered)}; the trace "
                f"has {list(want)} open",
                *([q[2]] if q else []),
                seq,
            )
        expected = _answer(rooms, covered)
        used = getattr(e, "source", None)
        if used != expected or (
            expected != "sync" and q is not None and getattr(e, "qid", None) != q[0]
        ):
            self.fail(
                f"resolve of {list(rooms)} with the query for {list(covered)} open used the "
                f"{used} answer (query {getattr(e, 'qid', None)}); PR #35071 prescribes {expected}",
                *([q[2]] if q else []),
                seq,
            )


def _answer(rooms: tuple, covered: tuple) -> str:
    """The answer SGLang's consumption point uses (DecodePreallocQueue._resolve_pending_reqs): the
    prefetched one when its rooms are a prefix of the rooms needing a query, the tail then asked
    synchronously; otherwise a synchronous query for them all."""
    if covered and tuple(rooms[: len(covered)]) == tuple(covered):
        return "prefetched" if len(covered) == len(rooms) else "prefix"
    return "sync"
