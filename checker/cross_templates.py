"""The cross-process check: a decode trace against the prefill traces of its DP ranks (header
`dp_rank`), what a receiver was told by the bootstrap server against what the prefill ranks actually
did. The prefill traces are read first (PrefillFacts); then each decode trace streams past the
cross-process templates."""

from __future__ import annotations

from collections import defaultdict

from .streaming import CROSS_TEMPLATES, Ctx, Result, Template
from .trace_header import check_set
from .trace_io import iter_events, read_header


class PrefillFacts:
    """What the prefill traces say: which DP rank admitted each rid, and the KV it sent."""

    def __init__(self):
        self.ranks_of: dict = defaultdict(set)
        self.sent: dict = defaultdict(lambda: [0, 0])  # (rank, rid) -> [tokens, pages]
        self.ranks_seen: set = set()
        # ranks whose trace ends with a trace_end other than normal: the rank was stopped (a
        # signal, an exception, the watchdog) before its run's end
        self.stopped: set = set()
        self.dp_size = None

    def add(self, path: str, header: dict) -> None:
        rank = header["dp_rank"]
        self.ranks_seen.add(rank)
        self.dp_size = header.get("dp_size", self.dp_size)
        status: dict = {}
        for _, e in iter_events(path, status=status):
            if e["ev"] == "admit":
                for rid in e["rids"]:
                    self.ranks_of[rid].add(rank)
            elif e["ev"] in ("kv_send", "prefix_send") and "pages" in e:
                s = self.sent[(rank, e["rid"])]
                s[0] += e.get("tokens", 0)
                s[1] += e["pages"]
        end = status.get("end")
        if end is not None and end.get("reason") != "normal":
            self.stopped.add(rank)

    @property
    def complete(self) -> bool:
        return self.dp_size is not None and self.ranks_seen >= set(range(self.dp_size))


@CROSS_TEMPLATES.register("cross_rank")
class CrossRank(Template):
    events = ("prefill_info", "req_add", "receiver_init")

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.local: set = set()  # addresses whose parallel info alone decides a room's rank
        self.addr_of: dict = {}  # room -> addr

    def on(self, e):
        if e["ev"] == "prefill_info":
            dp = e.get("dp_size")
            if (
                e.get("published")
                and isinstance(dp, int)
                and (dp == 1 or e.get("follow_bootstrap_room"))
            ):
                self.local.add(e["addr"])
            return
        if e["ev"] == "req_add":
            self.addr_of[e["room"]] = e["addr"]
            return
        facts = self.ctx.facts
        ranks = facts.ranks_of.get(e["rid"])
        if not ranks:
            # A rank the parallel info decided (as SGLang does) was not a route the bootstrap
            # server answered: a room no prefill serves then fails its transfer and must abort
            # (D-request-ends). A rank stopped before its run's end (a signal: trace_end says
            # so) may not have admitted a room the decode already initialised (the room was
            # registered, its request still queued): not judged then. A rank that died leaves
            # no trace_end and is excused only by the decode's `failed_rank`.
            if (
                facts.complete
                and not facts.stopped
                and self.addr_of.get(e["room"]) not in self.local
                and e["rank"] not in self.ctx.failed_ranks
            ):
                self.checks += 1
                self.fail(
                    f"{e['rid']} (room {e['room']}) initialised with rank {e['rank']}, "
                    f"but no prefill trace admitted it",
                    e["seq"],
                )
            return
        self.checks += 1
        if e["rank"] not in ranks or len(ranks) > 1:
            self.fail(
                f"{e['rid']} (room {e['room']}) initialised with rank {e['rank']}, served by "
                f"prefill rank(s) {sorted(ranks)}",
                e["seq"],
            )


@CROSS_TEMPLATES.register("cross_pages")
class CrossPages(Template):
    events = ("receiver_init", "kv_recv", "req_done")

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.init: dict = {}  # room -> (rid, rank)
        self.got: dict = defaultdict(lambda: [0, 0])  # room -> [tokens, pages]

    def on(self, e):
        ev, room = e["ev"], e["room"]
        if ev == "receiver_init":
            self.init[room] = (e["rid"], e["rank"])
        elif ev == "kv_recv":
            self.got[room][0] += e["tokens"]
            self.got[room][1] += e["pages"]
        elif room in self.init:
            rid, rank = self.init[room]
            if rank not in self.ctx.facts.ranks_seen or rank in self.ctx.failed_ranks:
                return
            self.checks += 1
            sent = self.ctx.facts.sent.get((rank, rid), [0, 0])
            if list(self.got[room]) != list(sent):
                self.fail(
                    f"{rid} (room {room}): decode received {self.got[room][0]} tokens in "
                    f"{self.got[room][1]} pages, prefill rank {rank} sent {sent[0]} tokens "
                    f"in {sent[1]} pages",
                    e["seq"],
                )


def cross_pairs(paths: list) -> tuple[dict, list, list]:
    """The headers of `paths`, the prefill traces among them that name their DP rank, and the decode
    traces: what the cross-process rules check together (here and in checker.z3check)."""
    headers = {}
    for p in paths:
        with open(p, "rb") as f:
            headers[p] = read_header(p, f)
    prefills = [
        p
        for p in paths
        if headers[p]["role"] == "prefill" and isinstance(headers[p].get("dp_rank"), int)
    ]
    decodes = [p for p in paths if headers[p]["role"] == "decode"]
    if prefills and decodes:
        check_set(headers, prefills, decodes)
    return headers, prefills, decodes


def failed_ranks(path: str) -> set:
    """The prefill ranks the decode trace records as failed (`req_abort` with `failed_rank`):
    their traces may be missing or cut short where the process died, so the cross-process rules
    do not judge that rank's requests against them."""
    return {
        e["failed_rank"]
        for _, e in iter_events(path)
        if e["ev"] == "req_abort" and isinstance(e.get("failed_rank"), int)
    }


def _check_decode(
    path: str, header: dict, prefills: list, facts: PrefillFacts, rules: list
) -> Result:
    """One decode trace against the facts of the prefill traces."""
    header = {**header, "role": "cross", "prefill_traces": prefills}
    ctx = Ctx(header, header.get("page_size", 1))
    ctx.facts = facts
    ctx.failed_ranks = failed_ranks(path)
    mode = header.get("mode")
    mine = [r for r in rules if r.role == "cross" and r.applies(mode)]
    missing = sorted({r.kind for r in mine} - set(CROSS_TEMPLATES))
    if missing:  # a rule this checker cannot check must not pass silently
        raise ValueError(f"no cross-process template for rule kind(s) {', '.join(missing)}")
    active = [CROSS_TEMPLATES[r.kind](r, ctx) for r in mine]
    n = 0
    for _, e in iter_events(path):
        n += 1
        for t in active:
            if e["ev"] in t.events:
                t.on(e)
    for t in active:
        t.finish()
    return Result(
        path,
        header,
        n,
        [(t.rule, t.checks) for t in active],
        [v for t in active for v in t.violations],
    )


def check_cross(paths: list, rules: list) -> list:
    """One Result per decode trace among `paths`, checked against every prefill trace among them
    that names its DP rank; nothing when there is no such pair."""
    headers, prefills, decodes = cross_pairs(paths)
    if not prefills or not decodes:
        return []
    facts = PrefillFacts()
    for p in prefills:
        facts.add(p, headers[p])
    return [_check_decode(d, headers[d], prefills, facts, rules) for d in decodes]
