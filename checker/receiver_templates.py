"""Templates for the decode receiver's rule kinds of spec/decode_rules.toml: each receiver is
initialised once with the rank its room resolved to, in FIFO order; the KV it receives; how a
request ends. The prefetch kinds are in checker/decode_templates.py."""

from __future__ import annotations

from .decode_templates import DecodeTemplate, _answered
from .streaming import TEMPLATES


@TEMPLATES.register("init_once")
class InitOnce(DecodeTemplate):
    events = ("prefill_info", "req_add", "resolve", "receiver_init", "req_done")

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.rank: dict = {}  # room -> (rank, seq)
        self.inits: dict = {}  # room -> seq
        # addr -> (dp_size, follow_bootstrap_room, seq) from its parallel info
        self.local: dict = {}
        self.addr_of: dict = {}  # room -> addr

    def _local_rank(self, room):
        """The rank the parallel info alone decides (as SGLang's _resolve_prefill_dp_rank): 0 with
        one DP rank, room mod dp_size when the prefill follows the room; None when a query must
        say."""
        dp, follow, seq = self.local.get(self.addr_of.get(room), (None, False, None))
        if dp == 1:
            return 0, seq
        if follow and dp:
            return room % dp, seq
        return None, None

    def on(self, e):
        ev, seq = e.ev, e.seq
        if ev == "prefill_info":
            if getattr(e, "published", None) and isinstance(getattr(e, "dp_size", None), int):
                self.local[e.addr] = (
                    e.dp_size,
                    bool(getattr(e, "follow_bootstrap_room", None)),
                    seq,
                )
        elif ev == "req_add":
            self.addr_of[e.room] = e.addr
        elif ev == "resolve":
            for room, rank in _answered(e).items():
                if room in self.rank and self.rank[room][0] != rank:
                    self.fail(
                        f"room {room} resolved to rank {rank}, earlier to {self.rank[room][0]}",
                        self.rank[room][1],
                        seq,
                    )
                self.rank.setdefault(room, (rank, seq))
        elif ev == "receiver_init":
            self.checks += 1
            room = e.room
            if room in self.inits:
                self.fail(f"room {room} initialised twice", self.inits[room], seq)
            self.inits.setdefault(room, seq)
            if room not in self.rank:
                local, info_seq = self._local_rank(room)
                if local is None:
                    self.fail(
                        f"room {room} initialised (rank {e.rank}) before any resolve "
                        "answered its rank",
                        seq,
                    )
                elif local != e.rank:
                    self.fail(
                        f"room {room} initialised with rank {e.rank}, but the parallel "
                        f"info decides rank {local}",
                        info_seq,
                        seq,
                    )
            elif self.rank[room][0] != e.rank:
                self.fail(
                    f"room {room} initialised with rank {e.rank}, the bootstrap server "
                    f"said {self.rank[room][0]}",
                    self.rank[room][1],
                    seq,
                )
        else:
            self.checks += 1
            if e.room not in self.inits:
                self.fail(f"{e.rid} (room {e.room}) finished without a receiver", seq)


@TEMPLATES.register("init_fifo")
class InitFifo(DecodeTemplate):
    events = ("req_add", "resolve", "receiver_init", "req_abort")

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.order: list = []  # rooms in arrival order
        self.known: set = set()
        self.gone: set = set()  # initialised or aborted

    def on(self, e):
        ev = e.ev
        if ev == "req_add":
            self.order.append(e.room)
        elif ev == "resolve":
            self.known.update(_answered(e))
        elif ev == "req_abort":
            self.gone.add(e.room)
        else:
            self.checks += 1
            room = e.room
            for older in self.order:
                if older == room:
                    break
                if older in self.known and older not in self.gone:
                    self.fail(
                        f"room {room} initialised before older room {older}, whose rank was known",
                        e.seq,
                    )
                    break
            self.gone.add(room)


@TEMPLATES.register("kv_recv")
class KvRecv(DecodeTemplate):
    events = ("receiver_init", "kv_recv")

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.rank: dict = {}

    def on(self, e):
        if e.ev == "receiver_init":
            self.rank[e.room] = (e.rank, e.seq)
            return
        self.checks += 1
        init = self.rank.get(e.room)
        if init is None:
            self.fail(f"KV for room {e.room} written before its receiver was initialised", e.seq)
        elif init[0] != e.rank:
            self.fail(
                f"KV for room {e.room} from rank {e.rank}, receiver initialised for rank {init[0]}",
                init[1],
                e.seq,
            )


@TEMPLATES.register("req_end")
class ReqEnd(DecodeTemplate):
    events = ("req_add", "kv_done", "req_done", "req_abort")

    def __init__(self, rule, ctx):
        super().__init__(rule, ctx)
        self.added: dict = {}  # rid -> seq
        self.kv: set = set()
        self.ended: dict = {}

    def on(self, e):
        ev, rid, seq = e.ev, getattr(e, "rid", None), e.seq
        if ev == "req_add":
            self.added[rid] = seq
        elif ev == "kv_done":
            self.kv.add(rid)
        else:
            self.checks += 1
            if rid not in self.added:
                self.fail(f"{ev} for {rid}, which never arrived", seq)
            if rid in self.ended:
                self.fail(f"{rid} ended twice", self.ended[rid], seq)
            if ev == "req_done" and rid not in self.kv:
                self.fail(f"{rid} finished before its KV arrived (no kv_done)", seq)
            self.ended.setdefault(rid, seq)

    def finish(self):
        for rid, seq in self.added.items():
            self.checks += 1
            if rid not in self.ended:
                self.fail(f"{rid} never finished nor aborted (a hang)", seq)
