"""Prefill-side hooks on SGLang 0.5.23: its PD prefill loops as pdo-trace events (docs/trace-format.md).

What each real SGLang function logs (the meaning is the reference engine's, engine/prefill/scheduler.py;
"mixin" is SchedulerDisaggregationPrefillMixin, "Scheduler" managers/scheduler.py's):

  mixin.event_loop_{normal,overlap}_disagg_prefill
      the trace header: role prefill, mode normal / overlap, page size, engine sglang. 0.5.23 runs the
      forward on the scheduler thread in both loops (there is no forward worker thread), so the thread
      modes (thread, ahead) never apply, and snapshot / submit / batch_copy / collect are never logged.
  mixin.get_next_disagg_prefill_batch_to_run
      admit when it returns a batch (ids 0, 1, ... per trace, by the batch object's identity), then
      chunk_inc for each middle chunk admission counted
  ReqToTokenPool.alloc / .free
      alloc / release of a request's req_to_token row (`slot`)
  ScheduleBatch.copy
      no event: the copy the overlap loop keeps for result processing answers to its source's batch id
  Scheduler.run_batch
      fwd_begin (a digest of the batch's requests, rows and lengths) and stage, then fwd_end when it
      returns. 0.5.23 has no staging step of its own: run_batch hands the inputs to the forward
      (resolve_forward_inputs, then the worker copies them into its buffers on the forward stream),
      so `stage` is logged where run_batch begins.
  Scheduler._apply_war_barrier
      war_barrier of the batch the last run_batch ran, once the wait is queued. The overlap loop
      defers a coarse (whole-forward) barrier past result processing of the previous batch
      (mixin._war_barrier_is_coarse); the event is logged where SGLang really applies it. With the
      barrier disabled (no CUDA and no SGLANG_ENABLE_WAR_BARRIER) the call fences nothing:
      x.war_barrier_off.
  Scheduler.launch_batch_sample_if_needed
      sample, when the batch result holds a deferred sampling function (the call launches it); a
      result whose tokens were sampled inside the forward gives x.sample_inline
  Scheduler.process_batch_result
      process_begin / process_end (prefill batches only), with the chunk_dec of every middle chunk it
      counted down
  mixin._send_kv_chunk, then the KV sender's send
      kv_send per call of the sender's send, with the tokens (num_kv_tokens) and pages (the page
      indices) SGLang hands it, and `start` (an extra field): the prompt offset of its first token.
      Inside mixin.maybe_send_cached_prefix_chunk (run_batch's early send of the cached prefix) the
      same send is prefix_send, with the batch run_batch is running.
  disaggregation.utils._poll_with_failure_injection(_pp) (the senders' poll(), for every caller of
      poll_and_all_reduce*)
      kv_delivered for every send of a sender whose poll() answers KVPoll.Success: a sender turns
      Success only once its transfer of every chunk handed to it has completed (docs/sglang.md,
      "Completions").
  Req.inflight_middle_chunks
      chunk_inc / chunk_dec. 0.5.23 changes it as a plain attribute (+= 1 in
      Scheduler._get_new_batch_prefill_raw, -= 1 in mixin.process_batch_result_disagg_prefill), so
      the hooks compare each watched request's value after admission, before each KV send and at the
      end of result processing with the value they last logged, one event per unit step.

The wrappers only read SGLang's state, host-side only (nothing that would synchronize with the GPU):
they pass every argument through and return what the real function returned.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import weakref

import wrapt
import xxhash

from engine.sglang import hooks
from engine.sglang import sink as trace_sink

LOOPS = {
    "event_loop_normal_disagg_prefill": "normal",
    "event_loop_overlap_disagg_prefill": "overlap",
}
_LOOP = "prefill_loop"
_local = (
    threading.local()
)  # .sending: stack of [Req, next token offset] of the _send_kv_chunk calls


class _State:
    """What one trace's hooks remember: batch ids by object, the Req objects whose middle-chunk counter
    is watched, the batch run_batch is running or ran last."""

    def __init__(self):
        self.bids: dict[int, tuple] = {}  # id(batch) -> (weakref to it, batch id)
        self.next_bid = 0
        self.running: int | None = None  # batch inside run_batch
        self.forwarded: int | None = None  # batch of the last run_batch
        self.barriered: set[int] = set()
        self.counters: dict[int, tuple] = {}  # id(req) -> (req, last value logged)
        # id(sender) -> (sender, [fields of each send not yet delivered])
        self.undelivered: dict[int, tuple] = {}

    def bid(self, batch) -> int | None:
        entry = self.bids.get(id(batch))
        if entry is None or entry[0]() is not batch:
            return None
        return entry[1]

    def name(self, batch, bid: int) -> None:
        self.bids[id(batch)] = (weakref.ref(batch), bid)


def _state(sink) -> _State:
    st = getattr(sink, "_pdo_prefill", None)
    if st is None:
        st = sink._pdo_prefill = _State()
    return st


def _in_loop() -> bool:
    return _LOOP in hooks.context()


def is_installed(sgl) -> bool:
    """Whether these hooks are on SGLang's classes now (the decode hooks may be installed alone)."""
    attr = inspect.getattr_static(
        sgl.prefill.SchedulerDisaggregationPrefillMixin, "get_next_disagg_prefill_batch_to_run"
    )
    return isinstance(attr, wrapt.FunctionWrapper)


def install(sgl) -> None:
    p, sched = sgl.prefill, sgl.scheduler.Scheduler
    mixin = p.SchedulerDisaggregationPrefillMixin
    # lazy: SGLang is optional
    from sglang.srt.disaggregation.base.conn import BaseKVSender
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    for name, mode in LOOPS.items():
        hooks.wrap(mixin, name, _loop(mode, sgl.version))
    hooks.wrap(mixin, "get_next_disagg_prefill_batch_to_run", _admit)
    hooks.wrap(ScheduleBatch, "copy", _copy)
    hooks.wrap(sched, "run_batch", _run_batch, ("batch",))
    hooks.wrap(sched, "_apply_war_barrier", _war_barrier)  # from 0.5.14
    # the batch it samples is a parameter from 0.5.16; before, the hook cannot name the batch
    hooks.wrap(sched, "launch_batch_sample_if_needed", _sample, ("batch_result", "cur_batch"))
    hooks.wrap(sched, "process_batch_result", _process, ("batch",))
    # the chunk's send: split out of send_kv_chunk (which adds a checksum around it) in 0.5.21
    if not hooks.wrap(mixin, "_send_kv_chunk", _send_kv_chunk, ("req",)):
        hooks.wrap(mixin, "send_kv_chunk", _send_kv_chunk, ("req",))
    hooks.wrap(mixin, "maybe_send_cached_prefix_chunk", _within("prefix_send"), ("req",))
    _import_senders()
    for cls in _classes_defining(BaseKVSender, "send"):
        hooks.wrap(cls, "send", _sender_send)
    for name in ("_poll_with_failure_injection", "_poll_with_failure_injection_pp"):
        if name in sgl.decode_utils.__dict__:
            _wrap_module_function(sgl.decode_utils, name, _polls)
            trace_sink.COMPLETIONS_OBSERVED[0] = True
    for cls in _classes_defining(ReqToTokenPool, "alloc"):
        hooks.wrap(cls, "alloc", _slot_alloc)
    for cls in _classes_defining(ReqToTokenPool, "free"):
        hooks.wrap(cls, "free", _slot_free)


_SENDER_MODULES = (
    "sglang.srt.disaggregation.fake.conn",
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.disaggregation.nixl.conn",
    "sglang.srt.disaggregation.mori.conn",
    "sglang.srt.disaggregation.ascend.conn",
)


def _import_senders() -> None:
    """The transfer backends' sender classes, so that their `send` is wrapped (a backend whose own
    dependencies are missing cannot be the one running)."""
    for name in _SENDER_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (any import failure means the backend is not in use)
            pass


def _classes_defining(base, method: str) -> list:
    """`base` and its subclasses known now that define `method` themselves (a subclass inheriting it
    is covered by its parent's wrapper)."""
    seen, out, todo = set(), [], [base]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if method in cls.__dict__:
            out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def _wrap_module_function(module, name: str, around) -> None:
    """hooks.wrap for a module-level function (hooks.wrap names a class's method), undone by
    hooks.uninstall like every other wrapper."""
    label = f"{module.__name__}.{name}"

    def wrapper(wrapped, instance, args, kwargs):
        sink = hooks.active()
        if sink is None:
            return wrapped(*args, **kwargs)
        hooks.ran[label] = hooks.ran.get(label, 0) + 1
        return around(sink, wrapped, module, args, kwargs)

    hooks.set_attribute(module, name, wrapt.FunctionWrapper(module.__dict__[name], wrapper))


def _within(name: str):
    def around(sink, wrapped, instance, args, kwargs):
        with hooks.inside(name):
            return wrapped(*args, **kwargs)

    return around


# ---- the loop -------------------------------------------------------------------------------------
def _loop(mode: str, version: str):
    def around(sink, wrapped, sched, args, kwargs):
        page_size = getattr(sched, "page_size", None) or sched.token_to_kv_pool_allocator.page_size
        sink.begin(
            "prefill",
            mode,
            int(page_size),
            engine="sglang",
            sglang_version=version,
            sampling=_sampling(mode),
            chunk_ranges=True,
        )
        with hooks.inside(_LOOP), sink.ends_with_loop():
            return wrapped(*args, **kwargs)

    return around


def _sampling(mode: str) -> str:
    """How the overlap loop's batches are sampled: SGLang's worker defers sampling past the forward
    (launch_batch_sample_if_needed then launches it) only with SGLANG_ENABLE_DELAY_SAMPLE, or for a
    grammar batch; otherwise it samples inside the forward. The header's `sampling` says which, so
    the rule that every batch is sampled after its forward is not applied to inline sampling."""
    from sglang.srt.environ import envs  # lazy: SGLang is optional

    # before 0.5.18 there is no switch: only grammar batches are deferred
    switch = getattr(envs, "SGLANG_ENABLE_DELAY_SAMPLE", None)
    return "deferred" if mode == "overlap" and switch is not None and switch.get() else "inline"


# ---- the middle-chunk counter ---------------------------------------------------------------------
def _watch(st: _State, reqs) -> None:
    for req in reqs:
        entry = st.counters.get(id(req))
        if entry is None or entry[0] is not req:
            st.counters[id(req)] = (req, int(req.inflight_middle_chunks))


def _flush_counters(sink, st: _State, reqs) -> None:
    """chunk_inc / chunk_dec for every unit step of a watched request's counter since it was last seen."""
    for req in reqs:
        entry = st.counters.get(id(req))
        if entry is None or entry[0] is not req:
            continue
        old, new = entry[1], int(req.inflight_middle_chunks)
        step = 1 if new > old else -1
        for v in range(old + step, new + step, step) if new != old else ():
            sink.emit(
                "chunk_inc" if step > 0 else "chunk_dec",
                rid=str(req.rid),
                obj=sink.obj(req),
                value=v,
            )
        st.counters[id(req)] = (req, new)


def _watched(st: _State) -> list:
    return [req for req, _ in st.counters.values()]


# ---- admission ------------------------------------------------------------------------------------
def _admit(sink, wrapped, sched, args, kwargs):
    if not _in_loop():
        return wrapped(*args, **kwargs)
    st = _state(sink)
    candidates = list(sched.waiting_queue)
    if sched.chunked_req is not None:
        candidates.append(sched.chunked_req)
    _watch(st, candidates)
    with hooks.inside("admission"):
        plan = wrapped(*args, **kwargs)
    # a plan (running_batch, batch_to_run) from 0.5.16; before, the batch itself
    batch = getattr(plan, "batch_to_run", plan)
    if batch is not None and st.bid(batch) is None:
        bid = st.next_bid
        st.next_bid += 1
        st.name(batch, bid)
        sink.emit("admit", batch=bid, rids=[str(r.rid) for r in batch.reqs], chunks=_chunks(batch))
        _watch(st, batch.reqs)
    _flush_counters(sink, st, _watched(st))
    return plan


def _chunks(batch) -> dict:
    """rid -> [start, end): the prompt tokens this batch computes for each request (its extend range,
    after the matched prefix), which the chunk-send rule matches with the sends' [start, start+tokens)."""
    out = {}
    for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        out[str(req.rid)] = [int(prefix), int(prefix) + int(extend)]
    return out


def _copy(sink, wrapped, batch, args, kwargs):
    out = wrapped(*args, **kwargs)
    st = _state(sink)
    bid = st.bid(batch)
    if bid is not None:
        st.name(out, bid)
    return out


# ---- the forward ----------------------------------------------------------------------------------
def _digest(batch) -> str:
    """What run_batch reads of the batch, from its host-side fields only (reading a device tensor
    would synchronize the scheduler with the GPU, which the hooks must not do): its requests, their
    req_to_token rows, prefix, extend and sequence lengths."""
    rows = batch.req_pool_indices_cpu
    seqs = batch.seq_lens_cpu
    return xxhash.xxh3_64(
        repr(
            (
                [str(r.rid) for r in batch.reqs],
                list(batch.prefix_lens or ()),
                list(batch.extend_lens or ()),
                rows.tolist() if rows is not None else None,
                seqs.tolist() if seqs is not None else None,
            )
        ).encode()
    ).hexdigest()


def _loop_batch(sink, batch) -> tuple:
    """(state, id) of a batch the traced loop admitted; id None outside the loop or for another batch."""
    st = _state(sink)
    return st, (st.bid(batch) if batch is not None and _in_loop() else None)


def _run_batch(sink, wrapped, sched, args, kwargs):
    batch = args[0] if args else kwargs["batch"]
    st, bid = _loop_batch(sink, batch)
    if bid is None:
        return wrapped(*args, **kwargs)
    sink.emit("fwd_begin", batch=bid, digest=_digest(batch))
    sink.emit("stage", batch=bid)
    st.running = bid
    try:
        with hooks.inside("run_batch"):
            return wrapped(*args, **kwargs)
    finally:
        st.running = None
        st.forwarded = bid
        sink.emit("fwd_end", batch=bid)


def _war_barrier(sink, wrapped, sched, args, kwargs):
    if not _in_loop():
        return wrapped(*args, **kwargs)
    st = _state(sink)
    out = wrapped(*args, **kwargs)
    bid = st.forwarded
    if not sched._war_barrier_enabled:
        sink.emit("x.war_barrier_off", batch=bid)
    elif bid is None or bid in st.barriered:
        sink.emit("x.war_barrier_again", batch=bid)
    else:
        st.barriered.add(bid)
        sink.emit("war_barrier", batch=bid)
    return out


def _sample(sink, wrapped, sched, args, kwargs):
    result = args[0] if args else kwargs.get("batch_result")
    batch = args[1] if len(args) > 1 else kwargs.get("cur_batch")
    _, bid = _loop_batch(sink, batch)
    if bid is None or result is None:
        return wrapped(*args, **kwargs)
    deferred = result.delay_sample_func is not None
    out = wrapped(*args, **kwargs)
    sink.emit("sample" if deferred else "x.sample_inline", batch=bid)
    return out


# ---- result processing ----------------------------------------------------------------------------
def _process(sink, wrapped, sched, args, kwargs):
    batch = args[0] if args else kwargs["batch"]
    st, bid = _loop_batch(sink, batch)
    if bid is None:
        return wrapped(*args, **kwargs)
    _watch(st, batch.reqs)
    sink.emit("process_begin", batch=bid)
    with hooks.inside("process"):
        out = wrapped(*args, **kwargs)
    _flush_counters(sink, st, batch.reqs)
    sink.emit("process_end", batch=bid)
    return out


def _send_kv_chunk(sink, wrapped, sched, args, kwargs):
    req = args[0] if args else kwargs["req"]
    if not _in_loop():
        return wrapped(*args, **kwargs)
    _flush_counters(sink, _state(sink), [req])  # a middle chunk's count-down precedes its send
    stack = getattr(_local, "sending", None)
    if stack is None:
        stack = _local.sending = []
    entry = [req, int(req.start_send_idx), None]  # [req, next token offset, a send left to size]
    stack.append(entry)
    try:
        out = wrapped(*args, **kwargs)
    finally:
        stack.pop()
    if entry[2] is not None:  # the send's tokens: how far the chunk advanced start_send_idx
        entry[2](int(req.start_send_idx) - entry[1])
    return out


def _sender_send(sink, wrapped, sender, args, kwargs):
    stack = getattr(_local, "sending", None)
    if not stack or not _in_loop() or "sender_send" in hooks.context():
        return wrapped(*args, **kwargs)  # (a subclass's send calling its parent's is one send)
    entry = stack[-1]
    req = entry[0]
    page_indices = args[0] if args else kwargs["kv_indices"]
    tokens = (
        kwargs["num_kv_tokens"] if "num_kv_tokens" in kwargs else args[2] if len(args) > 2 else None
    )
    # SGLang's early cached-prefix send under overlap hands the sender a CUDA event of the forward
    # stream, consumed by this call: whether the transfer may wait on the forward that wrote the KV
    device_wait = getattr(sender, "_early_send_wait_event", None) is not None
    with hooks.inside("sender_send"):
        out = wrapped(*args, **kwargs)
    prefix, running = "prefix_send" in hooks.context(), _state(sink).running

    def emit(tokens: int) -> None:
        fields = dict(
            rid=str(req.rid),
            obj=sink.obj(req),
            tokens=int(tokens),
            pages=int(len(page_indices)),
            start=entry[1],
        )
        entry[1] += int(tokens)
        if not prefix:
            sink.emit("kv_send", **fields)
        elif running is None:  # 0.5.23 sends the cached prefix from run_batch only
            sink.emit("x.prefix_send_outside_run_batch", **fields)
        else:
            sink.emit("prefix_send", batch=running, device_wait=device_wait, **fields)
        _expect_delivery(_state(sink), sender, fields)

    if tokens is None:  # 0.5.16's send_kv_chunk does not tell the sender: sized once it returns
        entry[2] = emit
    else:
        emit(tokens)
    return out


# ---- completions ----------------------------------------------------------------------------------
def _expect_delivery(st: _State, sender, fields: dict) -> None:
    entry = st.undelivered.get(id(sender))
    if entry is None or entry[0] is not sender:
        entry = st.undelivered[id(sender)] = (sender, [])
    entry[1].append({k: fields[k] for k in ("rid", "obj", "start", "tokens")})


def _polls(sink, wrapped, module, args, kwargs):
    """The senders' own poll() answers, as the scheduler collects them before its all-reduce: a
    sender that answers Success has delivered every chunk handed to it (kv_delivered each); one that
    answers Failed has ended its transfer without delivering (kv_failed, once per request)."""
    pollers = list(args[0] if args else kwargs["pollers"])
    polls = wrapped(*args, **kwargs)
    if not _in_loop():
        return polls
    from sglang.srt.disaggregation.base import KVPoll  # lazy: SGLang is optional

    st = _state(sink)
    ended = (int(KVPoll.Success), int(KVPoll.Failed))
    for poller, state in zip(pollers, polls):
        entry = st.undelivered.get(id(poller))
        if state not in ended or entry is None or entry[0] is not poller:
            continue
        del st.undelivered[id(poller)]
        if state == int(KVPoll.Success):
            for fields in entry[1]:
                sink.emit("kv_delivered", **fields)
        else:  # the transfer ended in failure: none of its sends is read after this
            for rid, obj in dict.fromkeys((f["rid"], f["obj"]) for f in entry[1]):
                sink.emit("kv_failed", rid=rid, obj=obj)
    return polls


# ---- req_to_token rows ----------------------------------------------------------------------------
def _slot_alloc(sink, wrapped, pool, args, kwargs):
    reqs = list(args[0] if args else kwargs["reqs"])
    if not _in_loop() or "slot_alloc" in hooks.context():
        return wrapped(*args, **kwargs)
    held = [_slot(r) is not None for r in reqs]
    with hooks.inside("slot_alloc"):
        out = wrapped(*args, **kwargs)
    if out is not None:
        for req, before in zip(reqs, held):
            if not before and _slot(req) is not None:
                sink.emit("alloc", rid=str(req.rid), obj=sink.obj(req), slot=int(_slot(req)))
    return out


def _slot(req) -> int | None:
    """The request's req_to_token row: on its KV record (req.kv.req_pool_idx, 0.5.23), or before
    that record held it, on the Req itself (req.req_pool_idx)."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "req_pool_idx"):
        return kv.req_pool_idx
    return getattr(req, "req_pool_idx", None)


def _slot_free(sink, wrapped, pool, args, kwargs):
    req = args[0] if args else kwargs["req"]
    # a request (its slot on req.kv from 0.5.16, on the request itself before), not a bare index
    if not _in_loop() or "slot_free" in hooks.context() or not hasattr(req, "rid"):
        return wrapped(*args, **kwargs)
    slot = _slot(req)
    with hooks.inside("slot_free"):
        out = wrapped(*args, **kwargs)
    if slot is not None:
        sink.emit("release", rid=str(req.rid), obj=sink.obj(req), slot=int(slot))
        st = _state(sink)
        entry = st.counters.get(id(req))
        if entry is not None and entry[0] is req and entry[1] == int(req.inflight_middle_chunks):
            del st.counters[id(req)]  # nothing left to observe on a released request
    return out
