"""The safety properties: the design's safety claims as formulas over positions and objects, stated
without the rules (`prove` shows which rules, and which parts of the engine model, imply each)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .decode_loops import DECODE_MODES
from .logic import conj, disj, implies, lt
from .universe import MODES, THREAD_MODES


@dataclass(frozen=True)
class Property:
    id: str
    statement: str
    modes: tuple
    design: str  # the passage of the design it states
    formula: object = field(compare=False, repr=False)  # (universe) -> z3 formula

    def applies(self, mode) -> bool:
        return mode in self.modes


# ---- prefill: over a ModelUniverse of K batches


def _span_closed(universe, n, later):
    """run_batch(n) has returned before `later`: fwd_end(n) lies after fwd_begin(n) and before
    it."""
    fb, fe = universe.b("fwd_begin", n), universe.b("fwd_end", n)
    return implies(
        conj(fb.exists, later.exists, lt(fb, later)), conj(fe.exists, lt(fb, fe), lt(fe, later))
    )


def _batches(universe):
    return range(universe.K)


def p_one_forward(universe):
    return conj(
        *[
            _span_closed(universe, n, universe.b("fwd_begin", m))
            for n in _batches(universe)
            for m in _batches(universe)
            if m != n
        ]
    )


def p_sample_idle(universe):
    return conj(
        *[
            _span_closed(universe, n, universe.b("sample", m))
            for n in _batches(universe)
            for m in _batches(universe)
        ]
    )


def p_process_after_forward(universe):
    b = universe.b
    return conj(
        *[
            implies(
                b("process_begin", n).exists,
                conj(
                    b("fwd_end", n).exists,
                    b("war_barrier", n).exists,
                    lt(b("fwd_end", n), b("process_begin", n)),
                    lt(b("war_barrier", n), b("process_begin", n)),
                ),
            )
            for n in _batches(universe)
        ]
    )


def p_war_host(universe):
    b = universe.b
    return conj(
        *[
            implies(
                b("stage", m).exists,
                conj(b("war_barrier", n).exists, lt(b("war_barrier", n), b("stage", m))),
            )
            for n in _batches(universe)
            for m in _batches(universe)
            if m > n
        ]
    )


def p_war_device(universe):
    return conj(
        *[
            lt(universe.get(("dev_forward", n)), universe.get(("dev_stage", m)))
            for n in _batches(universe)
            for m in _batches(universe)
            if m > n
        ]
    )


def p_snapshot(universe):
    b = universe.b
    return conj(
        *[
            implies(
                b("fwd_begin", n).exists,
                conj(
                    b("snapshot", n).exists,
                    b("fwd_begin", n).f["digest"] == b("snapshot", n).f["digest"],
                ),
            )
            for n in _batches(universe)
        ]
    )


def p_live_batch(universe):
    return conj(
        *[
            _span_closed(universe, n, universe.b("admit", m))
            for n in _batches(universe)
            for m in _batches(universe)
            if m > n
        ]
    )


def p_dec_real(universe):
    out = []
    for e in universe.named("chunk_dec"):
        a = universe.r("alloc", e.rid)
        out.append(implies(e.exists, conj(a.exists, e.f["obj"] == a.f["obj"])))
    return conj(*out)


def p_no_free_in_flight(universe):
    out = []
    for rid in universe.workload.requests():
        rel = universe.r("release", rid)
        done = [
            conj(universe.b("process_end", n).exists, lt(universe.b("process_end", n), rel))
            for n in universe.workload.holding(rid)
        ]
        sent = [
            implies(s.exists, lt(s, rel))
            for s in universe.named("kv_send") + universe.named("prefix_send")
            if s.rid == rid
        ]
        out.append(implies(rel.exists, conj(*done, *sent)))
    return conj(*out)


ALL = MODES
PROPERTIES = [
    Property(
        "one-forward",
        "Never two forwards at once: run_batch(N) has returned before any other run_batch begins.",
        ALL,
        "一个 forward worker, 不会同时运行两个 run_batch() (digest: never two run_batch() at once)",
        p_one_forward,
    ),
    Property(
        "sample-idle",
        "Sampling is never concurrent with a forward: no sample launch inside a run_batch.",
        ("overlap", "thread", "ahead"),
        "Sampling 要在 worker 空闲时执行 (digest: sampling runs while the worker is idle)",
        p_sample_idle,
    ),
    Property(
        "process-after-forward",
        "Result processing of N starts only after forward N returned and its WAR barrier.",
        ALL,
        "后续结果处理在需要时等待结果就绪 (digest: later result processing waits for results)",
        p_process_after_forward,
    ),
    Property(
        "war-host",
        "No later batch's shared-buffer write (stage) is enqueued before forward N's WAR barrier.",
        ALL,
        "WAR barrier 让后续共享缓冲区写入等待此前 forward 的共享读取 (digest: the WAR barrier)",
        p_war_host,
    ),
    Property(
        "war-device",
        "On the device, every later batch's staging write runs after forward N read the shared "
        "buffers.",
        ALL,
        "WAR barrier 让后续共享缓冲区写入等待此前 forward 的共享读取 (digest: the WAR barrier)",
        p_war_device,
    ),
    Property(
        "snapshot-isolation",
        "The forward reads exactly the snapshot: run_batch(N) reads what snapshot(N) took.",
        THREAD_MODES,
        "_snapshot_batch_for_forward() (digest: why not hand the live batch to the thread)",
        p_snapshot,
    ),
    Property(
        "live-batch-stable",
        "Without a snapshot, no later admission (which filters the live batch) runs inside "
        "run_batch(N).",
        ("normal", "overlap"),
        "下一轮 admission 会 filter 或重新绑定 batch 字段 (digest: the next admission filters or "
        "rebinds batch fields)",
        p_live_batch,
    ),
    Property(
        "dec-on-real-request",
        "Every middle-chunk decrement lands on the real request (the object allocated for it).",
        ALL,
        "processing 必须对同一个对象递减 (digest: processing must decrement the same object)",
        p_dec_real,
    ),
    Property(
        "no-free-in-flight",
        "No slot or page is freed while a chunk of the request or a KV send of it is in flight.",
        ALL,
        "无法释放 req_to_token slot 和 KV; no req_to_token leak (digest: slot and KV freed only "
        "when done)",
        p_no_free_in_flight,
    ),
]


# ---- decode: over a DecodeUniverse of a few iterations


def _closed_between(universe, y, x):
    """The prefetched query y was cancelled or used (resolved) after y and before x."""
    closers = [
        z
        for z in universe.named("prefetch_cancel") + universe.named("resolve")
        if z.f.get("qid") == y.f["qid"] and z.f["addr"] == y.f["addr"]
    ]
    return disj(*[conj(z.exists, lt(y, z), lt(z, x)) for z in closers])


def p_room_rank(universe):
    return conj(
        *[
            implies(e.exists, e.f["rank"] == universe.workload.server_rank(e.f["room"]))
            for e in universe.named("receiver_init")
        ]
    )


def p_one_query(universe):
    subs = universe.named("prefetch_submit")
    return conj(
        *[
            implies(conj(y.exists, x.exists, lt(y, x)), _closed_between(universe, y, x))
            for y in subs
            for x in subs
            if x is not y and x.f["addr"] == y.f["addr"]
        ]
    )


def p_nothing_after_release(universe):
    rel, res = universe.get(("release_memory",)), universe.get(("resume_memory",))
    out = [
        implies(conj(rel.exists, e.exists, lt(rel, e)), conj(res.exists, lt(rel, res), lt(res, e)))
        for e in universe.named("prefetch_submit") + universe.named("receiver_init")
    ]
    out += [
        implies(conj(rel.exists, y.exists, lt(y, rel)), _closed_between(universe, y, rel))
        for y in universe.named("prefetch_submit")
    ]
    return conj(*out)


DECODE_PROPERTIES = [
    Property(
        "room-init-server-rank",
        "Every room's receiver is initialised (once) with the rank the bootstrap server gave it.",
        DECODE_MODES,
        "不改变消费点权威结果 (digest §2: without changing the authoritative result)",
        p_room_rank,
    ),
    Property(
        "one-query-per-address",
        "At most one prefetched query per bootstrap address is outstanding (submitted, neither "
        "used nor cancelled): a second is submitted only after the first was used or cancelled "
        "(a cancel the pool thread beat leaves that query running, its answer unused).",
        DECODE_MODES,
        "该地址已有在途查询，保持 FIFO，不重复提交 (digest §2 item 2)",
        p_one_query,
    ),
    Property(
        "nothing-after-release",
        "After release_memory and until resume_memory: no query is outstanding, "
        "none is submitted, no receiver is initialised.",
        DECODE_MODES,
        "_cancel_prefill_dp_rank_queries() 在 release_memory_occupation() 中调用 (digest §2 "
        "item 4)",
        p_nothing_after_release,
    ),
]


def properties(role: str) -> list:
    return DECODE_PROPERTIES if role == "decode" else PROPERTIES
