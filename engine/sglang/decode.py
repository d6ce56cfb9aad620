"""Decode-side hooks on SGLang 0.5.23: the DP-rank prefetch of PR #35071 as pdo-trace events.

What each real SGLang function logs (docs/decode.md has the events' meanings):

  Scheduler.event_loop_{normal,overlap}_disagg_decode   the trace header (role decode, mode, page size)
  Scheduler.gracefully_exit, read at the top of each loop iteration   iter_begin (x.paused_iter when the
      engine is paused: that iteration neither prefetches nor resolves)
  DecodePreallocQueue.prefetch_prefill_dp_rank_queries  prefetch_begin, prefetch_skip per address, prefetch_end
  the prefetch executor's submit of the query           prefetch_submit (the Future gets a qid)
  Future.cancel of a prefetched query                   prefetch_cancel, with the reason its caller means
      and whether the cancel stopped it (`stopped`: Future.cancel()'s own result)
  CommonKVReceiver.query_prefill_dp_ranks               query_begin / query_end, on the thread that runs it
  CommonKVManager.try_ensure_parallel_info (a fetch)    prefill_info
  DecodePreallocQueue._resolve_pending_reqs             resolve per address that needed a query: source
      prefetched (the Future's result), prefix (the Future's result plus a synchronous tail) or sync;
      `pending` (the address's rooms in pending_reqs) and `covered` (the rooms of its prefetched
      query, [] if none) as the call began
  DecodePreallocQueue._init_receiver                    receiver_init
  DecodePreallocQueue.add                               req_add (req_abort when add refuses it)
  DecodePreallocQueue.{release,resume}_memory_occupation   release_memory / resume_memory

The wrappers only read SGLang's state. The one object they stand in for is the prefetch executor: its
submit is observed through a proxy, which passes every call to the real executor (or, under a schedule
controller, to the managed pool, so a fuzzed schedule decides when the query runs).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time

from engine import sync
from engine.sglang import hooks
from engine.sync import hb

_local = threading.local()  # .query: (qid, "prefetch") while a prefetched query runs
_qids = itertools.count()
_futures: dict[
    int, dict
] = {}  # id(Future) -> {"future", "addr", "rooms", "qid", "t_submit", "t_end", "end"}
_resolving: list[dict] = []  # per active _resolve_pending_reqs call: what it consumed, per address
_iters: dict[int, int] = {}  # id(scheduler) -> decode iterations seen

LOOPS = {"event_loop_normal_disagg_decode": "normal", "event_loop_overlap_disagg_decode": "overlap"}


def install(sgl) -> None:
    """Attach the decode hooks where this release has their targets (hooks.report says which):
    the prefetch ones from 0.5.19, _cancel_prefill_dp_rank_queries and _init_receiver from 0.5.22;
    before that, a receiver's `init` is called directly and is hooked on the receiver classes."""
    d, conn = sgl.decode, sgl.conn
    queue = d.DecodePreallocQueue
    _QUERY_FN[:] = [unwrap(conn.CommonKVReceiver.__dict__["query_prefill_dp_ranks"])]
    for name, mode in LOOPS.items():
        hooks.wrap(d.SchedulerDisaggregationDecodeMixin, name, _loop(mode, sgl.version))
    _install_iteration_marker(sgl)
    hooks.wrap(queue, "prefetch_prefill_dp_rank_queries", _prefetch)
    hooks.wrap(queue, "_resolve_pending_reqs", _resolve)
    hooks.wrap(queue, "_cancel_prefill_dp_rank_queries", _within("cancel_all"))
    if not hooks.wrap(queue, "_init_receiver", _init_receiver, ("decode_req", "prefill_dp_rank")):
        for cls in _receiver_classes():
            hook_receiver(cls)
    hooks.wrap(queue, "add", _add, ("req",))
    hooks.wrap(queue, "release_memory_occupation", _memory("release_memory"))
    hooks.wrap(queue, "resume_memory_occupation", _memory("resume_memory"))
    hooks.wrap(conn.CommonKVReceiver, "query_prefill_dp_ranks", _query, _QUERY_PARAMS)
    hooks.wrap(
        conn.CommonKVManager, "try_ensure_parallel_info", _parallel_info, ("bootstrap_addr",)
    )
    hooks.wrap(conn.CommonKVManager, "_ensure_prefill_recompute_executor", _executor)
    hooks.wrap(concurrent.futures.Future, "cancel", _future_cancel)
    hooks.wrap(concurrent.futures.Future, "result", _future_result)


_QUERY_PARAMS = ("bootstrap_addr", "bootstrap_rooms")
_RECEIVER_MODULES = (
    "sglang.srt.disaggregation.fake.conn",
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.disaggregation.nixl.conn",
    "sglang.srt.disaggregation.mori.conn",
)


def _receiver_classes() -> list:
    """Every receiver class of the transfer backends that this process can import and that
    defines its own `init`."""
    import importlib  # lazy: only releases before 0.5.22 need the backends' classes

    from sglang.srt.disaggregation.base.conn import BaseKVReceiver

    for name in _RECEIVER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # a backend whose native library is missing here serves no request
    found, todo = [], [BaseKVReceiver]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "init" in cls.__dict__ and cls is not BaseKVReceiver:
            found.append(cls)
    return found


def hook_receiver(cls) -> None:
    """Log receiver_init at `cls.init` (a receiver class of a release before 0.5.22, where the prealloc
    queue calls the receiver's init directly); a backend class defined later is hooked the same way."""
    if not hooks.is_installed():
        return  # the adapter is off: nothing is hooked
    if hooks.attached.get("DecodePreallocQueue._init_receiver") == "attached":
        return  # the queue's own _init_receiver logs it
    if f"{cls.__qualname__}.init" not in hooks.attached:
        hooks.wrap(cls, "init", _receiver_init, ("prefill_dp_rank",))


# ---- the loop and its iterations ------------------------------------------------------------------
def _loop(mode: str, version: str):
    def around(sink, wrapped, sched, args, kwargs):
        page_size = getattr(sched, "page_size", None) or 1
        queue = getattr(sched, "disagg_decode_prealloc_queue", None)
        prefetch = hasattr(type(queue), "prefetch_prefill_dp_rank_queries")  # from 0.5.19
        sink.begin(
            "decode", mode, page_size, prefetch=prefetch, engine="sglang", sglang_version=version
        )
        _iters[id(sched)] = 0
        with hooks.inside("decode_loop"), sink.ends_with_loop():
            return wrapped(*args, **kwargs)

    return around


def _install_iteration_marker(sgl) -> None:
    """The top of each loop iteration. From 0.5.21 both decode loops read `self.gracefully_exit` once,
    first thing in each iteration, and nowhere else in it: a class property observes that read and
    keeps the value where the instance keeps it. Before, every iteration calls process_input_requests
    once (directly, or inside ingest_requests), preceded from 0.5.19 by the prefetch when the engine
    is not paused: the iteration begins at whichever of the two comes first."""
    sched_cls = sgl.scheduler.Scheduler
    if reads_gracefully_exit(sgl):

        def get(self):
            value = self.__dict__.get("gracefully_exit", False)
            if not value and _top_of_loop():
                _iteration(self)
            return value

        def set_(self, value):
            self.__dict__["gracefully_exit"] = value

        hooks.set_attribute(sched_cls, "gracefully_exit", property(get, set_))
        hooks.mark("Scheduler.gracefully_exit (iteration marker)", None)
        return
    hooks.mark("Scheduler.gracefully_exit (iteration marker)", "absent: marked at intake")
    hooks.wrap(sched_cls, "process_input_requests", _intake_marker)


def reads_gracefully_exit(sgl) -> bool:
    """Whether both decode loops of this release read `self.gracefully_exit` (0.5.21 on)."""
    import inspect  # lazy: read at install

    mixin = sgl.decode.SchedulerDisaggregationDecodeMixin
    return all(
        "self.gracefully_exit" in inspect.getsource(unwrap(mixin.__dict__[name])) for name in LOOPS
    )


def _top_of_loop() -> bool:
    stack = hooks.context()
    return bool(stack) and stack[-1] == "decode_loop"


def _iteration(sched, paused: bool | None = None) -> None:
    """Open an iteration; `paused`: whether it began paused, when the caller knows (else the
    scheduler's flag now)."""
    sink = hooks.active()
    if sink is None:
        return
    n = _iters[id(sched)] = _iters.get(id(sched), 0) + 1
    if paused is None:
        paused = getattr(sched, "_engine_paused", False)
    if paused:
        sink.emit("x.paused_iter", iter=n)
    else:
        sink.emit("iter_begin", iter=n)


_opened: dict[int, bool] = {}  # id(scheduler) -> an iteration was opened by its prefetch


def _intake_marker(sink, wrapped, sched, args, kwargs):
    if _top_of_loop():
        if not _opened.pop(id(sched), False):
            # 0.5.19 and 0.5.20 call the prefetch first unless the engine is paused: an iteration
            # it did not open began paused (a resume handled by this intake does not change that)
            prefetching = hooks.attached.get(_PREFETCH) == "attached"
            _iteration(sched, paused=True if prefetching else None)
    return wrapped(*args, **kwargs)


_PREFETCH = "DecodePreallocQueue.prefetch_prefill_dp_rank_queries"


def _within(name: str):
    def around(sink, wrapped, instance, args, kwargs):
        with hooks.inside(name):
            return wrapped(*args, **kwargs)

    return around


# ---- the prefetch ---------------------------------------------------------------------------------
def _addr(decode_req) -> str:
    req = decode_req.req
    return f"{req.bootstrap_host}:{req.bootstrap_port}"


def _groups(queue) -> dict[str, list]:
    groups: dict[str, list] = {}
    for decode_req in queue.pending_reqs:
        groups.setdefault(_addr(decode_req), []).append(decode_req)
    return groups


def _prefetch(sink, wrapped, queue, args, kwargs):
    if hooks.attached.get("Scheduler.process_input_requests") == "attached" and _top_of_loop():
        _iteration(queue.scheduler)  # the prefetch comes first in the iteration (0.5.19, 0.5.20)
        _opened[id(queue.scheduler)] = True
    it = _iters.get(id(queue.scheduler), 0)
    sink.emit("prefetch_begin", iter=it)
    before = {addr: id(fut) for addr, (_, fut) in queue._prefill_dp_rank_queries.items()}
    groups = _groups(queue)
    with hooks.inside("prefetch"):
        out = wrapped(*args, **kwargs)
    after = {addr: id(fut) for addr, (_, fut) in queue._prefill_dp_rank_queries.items()}
    for addr in groups:
        if addr in after and after[addr] != before.get(addr):
            continue  # submitted by this call
        if addr in before and after.get(addr) == before[addr]:
            reason = "in_flight"
        elif queue.kv_manager.prefill_info_table.get(addr) is None:
            reason = "not_published"
        else:
            reason = "all_known"
        sink.emit("prefetch_skip", addr=addr, reason=reason)
    sink.emit("prefetch_end", iter=it)
    return out


class _ObservedExecutor:
    """The prefetch executor as SGLang sees it: submit of a DP-rank query is logged (prefetch_submit)
    and its Future remembered; every other call goes to the executor behind it unchanged."""

    def __init__(self, real, query_fn):
        self._real = real
        self._query_fn = query_fn
        self._managed = None

    def _target(self):
        if sync.CONTROLLER is None:
            return self._real
        if self._managed is None:
            self._managed = sync.executor(2, "prefetch")
        return self._managed

    def submit(self, fn, *args, **kwargs):
        sink = hooks.active()
        if sink is None or unwrap(fn) is not self._query_fn:
            return self._real.submit(fn, *args, **kwargs)
        addr, rooms = args[0], list(args[1])
        qid = next(_qids)
        sink.emit("prefetch_submit", addr=addr, rooms=rooms, qid=qid)

        # The query's hand-offs: the submit happens before it runs, its end before the result
        # is taken (_future_result), so its events are ordered as the executor orders them.
        start, end = hb.snapshot(), object()

        def run():
            hb.recv(start)
            _local.query = qid
            try:
                return fn(*args, **kwargs)
            finally:
                _local.query = None
                hb.send(end)

        record = {
            "addr": addr,
            "rooms": rooms,
            "qid": qid,
            "t_submit": time.monotonic_ns(),
            "t_end": None,
            "end": end,
        }
        future = self._target().submit(run)
        record["future"] = future
        _futures[id(future)] = record
        return future

    def __getattr__(self, name):
        return getattr(self._real, name)


_proxies: dict[int, _ObservedExecutor] = {}
_QUERY_FN: list = []  # the real CommonKVReceiver.query_prefill_dp_ranks, set by install


def unwrap(fn):
    """The plain function under wrappers and method binding."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return getattr(fn, "__func__", fn)


def _executor(sink, wrapped, manager, args, kwargs):
    real = wrapped(*args, **kwargs)
    proxy = _proxies.get(id(real))
    if proxy is None or proxy._real is not real:
        proxy = _proxies[id(real)] = _ObservedExecutor(real, _QUERY_FN[0])
    return proxy


def _record(future) -> dict | None:
    record = _futures.get(id(future))
    return record if record is not None and record["future"] is future else None


_CANCEL_REASONS = {
    "prefetch": "stale",
    "release": "release",
    "cancel_all": "empty",
    "resolve": "mismatch",
}


def _future_cancel(sink, wrapped, future, args, kwargs):
    record = _record(future)
    if record is None or record.get("closed"):
        return wrapped(*args, **kwargs)
    stack = hooks.context()
    reason = next((_CANCEL_REASONS[s] for s in reversed(stack) if s in _CANCEL_REASONS), "shutdown")
    if reason == "empty" and "release" in stack:
        reason = "release"
    if reason == "mismatch" and _resolving and record["addr"] not in _resolving[-1]["queried"]:
        reason = "stale"  # popped because every room of the address became known
    record["closed"] = True
    # Logged after the real cancel, with its result: False when the executor had already started
    # the query (it runs on, its query_begin may follow this event, its answer is never used).
    stopped = wrapped(*args, **kwargs)
    sink.emit(
        "prefetch_cancel",
        addr=record["addr"],
        rooms=record["rooms"],
        qid=record["qid"],
        reason=reason,
        stopped=bool(stopped),
    )
    return stopped


def _future_result(sink, wrapped, future, args, kwargs):
    record = _record(future)
    if record is None:
        return wrapped(*args, **kwargs)
    try:
        return _result(wrapped, future, record, args, kwargs)
    finally:  # whatever it returns or raises, the query's end is seen
        hb.recv(record["end"])


def _result(wrapped, future, record, args, kwargs):
    if not _resolving or threading.get_ident() != _resolving[-1]["thread"]:
        return wrapped(*args, **kwargs)
    if sync.CONTROLLER is not None and sync.CONTROLLER.manages_current():
        sync.CONTROLLER.block_until(future.done, "prefetch.result")
    t0 = time.monotonic_ns()
    value = wrapped(*args, **kwargs)
    entry = _resolving[-1]["addrs"].setdefault(record["addr"], {"sync": []})
    entry.update(future=record, result=dict(value), t_result=t0, wait=time.monotonic_ns() - t0)
    record["closed"] = True
    return value


# ---- the queries ----------------------------------------------------------------------------------
def _query(sink, wrapped, instance, args, kwargs):
    addr = args[0] if args else kwargs["bootstrap_addr"]
    rooms = list(args[1] if len(args) > 1 else kwargs["bootstrap_rooms"])
    qid = getattr(_local, "query", None)
    source = "prefetch" if qid is not None else "sync"
    if qid is None:
        qid = next(_qids)
    sink.emit("query_begin", addr=addr, rooms=rooms, qid=qid, source=source)
    t0 = time.monotonic_ns()
    value = wrapped(*args, **kwargs)
    sink.emit("query_end", addr=addr, rooms=rooms, qid=qid, result=dict(value), error=None)
    if source == "sync" and _resolving and threading.get_ident() == _resolving[-1]["thread"]:
        entry = _resolving[-1]["addrs"].setdefault(addr, {"sync": []})
        entry["sync"].append(
            {"rooms": rooms, "result": dict(value), "wait": time.monotonic_ns() - t0}
        )
    return value


def _parallel_info(sink, wrapped, manager, args, kwargs):
    addr = args[0] if args else kwargs["bootstrap_addr"]
    cached = addr in manager.prefill_info_table
    ok = wrapped(*args, **kwargs)
    if not cached:
        info = manager.prefill_info_table.get(addr)
        layout = (
            {}
            if info is None
            else {"dp_size": info.dp_size, "follow_bootstrap_room": info.follow_bootstrap_room}
        )
        sink.emit(
            "prefill_info",
            addr=addr,
            published=bool(ok),
            error=None if ok else "prefill parallel info not available",
            **layout,
        )
    return ok


# ---- the consumption point ------------------------------------------------------------------------
def _resolve(sink, wrapped, queue, args, kwargs):
    state = {
        "thread": threading.get_ident(),
        "addrs": {},
        "queried": set(),
        "need": {},
        "flushed": False,
        # what the consumption point holds as it begins, per address (resolve's pending, covered)
        "pending": {},
        "covered": {},
    }
    for addr, reqs in _groups(queue).items():
        state["pending"][addr] = [r.req.bootstrap_room for r in reqs]
        # the prefetched query of the address (0.5.19 on; before, nothing is prefetched)
        query = getattr(queue, "_prefill_dp_rank_queries", {}).get(addr)
        state["covered"][addr] = list(query[0]) if query is not None else []
        need = [r.req.bootstrap_room for r in reqs if queue._resolve_prefill_dp_rank(r.req) is None]
        if need:
            state["queried"].add(addr)
            state["need"][addr] = need
    _resolving.append(state)
    try:
        with hooks.inside("resolve"):
            return wrapped(*args, **kwargs)
    finally:
        _resolving.pop()
        _flush_resolves(sink, state)


def _flush_resolves(sink, state) -> None:
    """One resolve event per address that needed a query, before the first receiver of the call is
    initialised (SGLang initialises them all after resolving every address)."""
    if state["flushed"]:
        return
    state["flushed"] = True
    for addr, entry in state["addrs"].items():
        future, syncs = entry.get("future"), entry["sync"]
        if future is not None:
            # the rooms this consumption point needed, as it saw them when it began
            rooms = state["need"].get(addr) or list(future["rooms"]) + [
                r for s in syncs for r in s["rooms"]
            ]
            result = {**entry["result"], **{k: v for s in syncs for k, v in s["result"].items()}}
            source = "prefix" if syncs else "prefetched"
            wait = entry["wait"] + sum(s["wait"] for s in syncs)
            lead = max(0, entry["t_result"] - future["t_submit"])
            qid = future["qid"]
        else:
            rooms = [r for s in syncs for r in s["rooms"]]
            result = {k: v for s in syncs for k, v in s["result"].items()}
            source, wait, lead, qid = "sync", sum(s["wait"] for s in syncs), 0, None
        sink.emit(
            "resolve",
            addr=addr,
            rooms=rooms,
            source=source,
            qid=qid,
            wait_ns=wait,
            lead_ns=lead,
            result={str(k): v for k, v in result.items()},
            error=None,
            pending=state["pending"].get(addr, []),
            covered=state["covered"].get(addr, []),
        )


def _init_receiver(sink, wrapped, queue, args, kwargs):
    decode_req, rank = args[0], args[1]
    if _resolving:
        _flush_resolves(sink, _resolving[-1])
    req = decode_req.req
    sink.emit("receiver_init", room=req.bootstrap_room, rank=int(rank), rid=str(req.rid))
    return wrapped(*args, **kwargs)


def _receiver_init(sink, wrapped, receiver, args, kwargs):
    room = getattr(receiver, "bootstrap_room", None)
    rank = args[0] if args else kwargs["prefill_dp_rank"]
    if _resolving:
        _flush_resolves(sink, _resolving[-1])
    sink.emit("receiver_init", room=room, rank=int(rank), rid=_rids.get(room, str(room)))
    return wrapped(*args, **kwargs)


_rids: dict = {}  # bootstrap room -> rid, from req_add (a receiver knows its room, not its rid)


def _add(sink, wrapped, queue, args, kwargs):
    req = args[0]
    _rids[req.bootstrap_room] = str(req.rid)
    sink.emit(
        "req_add",
        rid=str(req.rid),
        room=req.bootstrap_room,
        addr=f"{req.bootstrap_host}:{req.bootstrap_port}",
    )
    out = wrapped(*args, **kwargs)
    reason = getattr(req, "finished_reason", None)
    if reason is not None and type(reason).__name__ == "FINISH_ABORT":
        sink.emit(
            "req_abort", rid=str(req.rid), room=req.bootstrap_room, reason=str(reason.message)
        )
    return out


def _memory(ev: str):
    def around(sink, wrapped, queue, args, kwargs):
        with hooks.inside("release" if ev == "release_memory" else "resume"):
            out = wrapped(*args, **kwargs)
        sink.emit(ev)
        return out

    return around
