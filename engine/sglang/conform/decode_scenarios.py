"""Decode conformance scenarios: SGLang 0.5.23's real decode loops and prealloc queue, on CPU.

What runs is SGLang's own code: `Scheduler.event_loop_{normal,overlap}_disagg_decode`, and in
`DecodePreallocQueue` `add`, `prefetch_prefill_dp_rank_queries`, `_resolve_pending_reqs` (with
`_ensure_prefill_info`, `_resolve_prefill_dp_rank`, `_init_receiver`), `release_memory_occupation`,
`resume_memory_occupation`; in `CommonKVManager` `try_ensure_parallel_info` and the prefetch
executor; `CommonKVReceiver.query_prefill_dp_ranks` over real HTTP to a real bootstrap server on
loopback (`pdo bootstrap`, or SGLang's own `CommonKVBootstrapServer`).

What is faked, and why: the objects are made with `__new__` and given only the attributes those
methods read (as SGLang's unit tests do). The scheduler's other steps are stand-ins:
`ingest_requests` plays the scenario's script (arrivals, aborts, memory release through SGLang's
own caller, the prefill side registering rooms; each direct call checks its real callers'
precondition, reachable.py), `process_decode_queue` calls the real `_resolve_pending_reqs` (the first step of
`pop_preallocated`) and then plays the KV transfer, which needs RDMA and a GPU pool: a request whose
receiver was initialised gets its KV and first token one iteration later and finishes (kv_done,
req_done, logged by the harness); an aborted request is dropped from the queue as `pop_preallocated`
drops it. The KV receiver class is a stand-in (the transfer backend); no batch is formed (no decode
forward).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import types

from checker.fuzz import Controller, RandomWalk
from engine import sync
from engine.bootstrap import client as bootstrap_client
from engine.bootstrap.server import BootstrapServer
from engine.sglang import decode as decode_hooks
from engine.sglang import hooks, sglang_server
from engine.sglang.conform import decode_context
from engine.sglang.conform.reachable import assert_reachable
from engine.sglang.sink import LoopExit, TraceSink
from spec.registry import Registry

PAGE_SIZE = 16


@dataclasses.dataclass
class Step:
    """What the script does at the start of one loop iteration (inside ingest_requests)."""

    arrive: list = dataclasses.field(default_factory=list)  # (rid, room, server index)
    # (room, server index): the prefill took it
    register: list = dataclasses.field(default_factory=list)
    publish: list = dataclasses.field(default_factory=list)  # servers whose ranks register now
    abort: list = dataclasses.field(default_factory=list)  # rids
    # a client asks to release (resume) the KV memory: done through SGLang's own caller, pause
    # first, at the first iteration where that caller's idleness assertion holds (reachable.py)
    release: bool = False
    resume: bool = False


@dataclasses.dataclass
class Script:
    steps: dict  # iteration -> Step
    servers: int = 1
    dp_size: int = 2
    published: tuple = (0,)  # servers whose ranks are registered before the loop starts
    sglang_server: bool = False  # SGLang's CommonKVBootstrapServer instead of pdo bootstrap
    max_iters: int = 60
    polling_interval: int = 1  # process_decode_queue resolves every this many iterations


class _Receiver:
    """The KV receiver: stands in for the transfer backend (RDMA, GPU pool)."""

    def __init__(self, mgr=None, bootstrap_addr=None, bootstrap_room=None, **_):
        self.room, self.rank, self.conclude_state = bootstrap_room, None, None
        self.bootstrap_room = bootstrap_room
        self.aborted = False

    def abort(self):
        """What the queue calls when it gives up on the request's prefill (the transfer fails)."""
        self.aborted = True

    def init(self, prefill_dp_rank):
        self.rank = prefill_dp_rank


class _LoopEnd(LoopExit):
    """Raised by the idle stand-in to end a loop that has no exit of its own (before 0.5.21)."""


class _Server:
    """One bootstrap server on loopback: pdo's, or SGLang's own."""

    def __init__(self, sgl, use_sglang: bool):
        if use_sglang:
            self._impl = sglang_server.start(sgl)
            self.host, self.port = "127.0.0.1", self._impl.port
        else:
            self._impl = BootstrapServer().start()
            self.host, self.port = "127.0.0.1", self._impl.port
        self.url = f"http://{self.host}:{self.port}"
        self.addr = f"{self.host}:{self.port}"

    def publish(self, dp_size: int) -> None:
        for rank in range(dp_size):
            bootstrap_client.register_prefill_rank(
                self.url,
                {
                    "role": "Prefill",
                    "attn_tp_size": 1,
                    "attn_cp_size": 1,
                    "attn_dp_size": dp_size,
                    "pp_size": 1,
                    "system_dp_size": 1,
                    "attn_tp_rank": 0,
                    "attn_cp_rank": 0,
                    "attn_dp_rank": rank,
                    "pp_rank": 0,
                    "system_dp_rank": 0,
                    "rank_ip": "127.0.0.1",
                    "rank_port": 20000 + rank,
                    "page_size": PAGE_SIZE,
                    "kv_cache_dtype": "auto",
                    # the decode side asks for ranks only when the prefill does not follow the room
                    "load_balance_method": "round_robin",
                },
                retries=0,
            )

    def stop(self) -> None:
        if hasattr(self._impl, "close"):
            self._impl.close()
        else:
            self._impl.stop()


def _kv_manager(conn):
    """CommonKVManager with what try_ensure_parallel_info and the executor read: one decode rank,
    TP 1, no MLA, the scenario's page size."""
    mgr = conn.CommonKVManager.__new__(conn.CommonKVManager)
    mgr.prefill_info_table = {}
    mgr.kv_args = types.SimpleNamespace(page_size=PAGE_SIZE, state_types=[], engine_rank=0)
    for name, value in dict(
        kv_cache_dtype_str="auto",
        server_args=types.SimpleNamespace(kv_cache_dtype="auto"),  # read there before 0.5.17
        attn_tp_size=1,
        attn_tp_rank=0,
        attn_cp_size=1,
        attn_cp_rank=0,
        pp_size=1,
        pp_rank=0,
        is_mla_backend=False,
        is_hybrid_mla_backend=False,
        kv_layout=None,
        dsv41_spec_layout=None,
        dcp_size=1,
        enable_all_cp_ranks_for_transfer=False,
        _prefill_recompute_executor=None,
        _prefill_recompute_executor_lock=threading.Lock(),
    ).items():
        setattr(mgr, name, value)
    return mgr


def _prealloc_queue(d, sched, mgr):
    q = d.DecodePreallocQueue.__new__(d.DecodePreallocQueue)
    q.scheduler, q.kv_manager = sched, mgr
    q.queue, q.retracted_queue, q.pending_reqs = [], [], []
    q._prefill_dp_rank_queries = {}
    q._ensure_retry_count, q._ensure_last_attempt_time = {}, {}
    q._max_ensure_retries = 15
    q._ensure_retry_interval = 0.0  # retry the parallel info every iteration (a scenario has few)
    q.transfer_backend = None
    q.token_to_kv_pool_allocator = types.SimpleNamespace(
        prealloc_ceiling_fits=lambda full, swa: True, page_size=PAGE_SIZE
    )
    q.token_to_kv_pool = None
    q.max_total_num_tokens = 1 << 20
    q.num_reserved_decode_tokens = 0
    return q


class Harness:
    """The decode scheduler around the real loop, and the script that feeds it."""

    def __init__(self, sgl, script: Script, mode: str):
        self.sgl, self.script, self.mode = sgl, script, mode
        d = sgl.decode
        # pdo's server where it speaks this release's wire, else the release's own
        own = script.sglang_server or not sglang_server.wire_matches(sgl)
        self.servers = [_Server(sgl, own) for _ in range(script.servers)]
        for i in script.published:
            self.servers[i].publish(script.dp_size)
        sched = self.sched = sgl.scheduler.Scheduler.__new__(sgl.scheduler.Scheduler)
        self.mgr = _kv_manager(sgl.conn)
        self.queue = _prealloc_queue(d, sched, self.mgr)
        self.iteration, self.reqs, self.initialised, self.ended = 0, {}, {}, set()
        self.release_wanted = self.resume_wanted = self.released = False
        self.updater = None  # SGLang's weight updater, made inside the published configuration
        self._bind_scheduler()

    def _bind_scheduler(self) -> None:
        s = self.sched
        s.__dict__.update(
            gracefully_exit=False,
            _engine_paused=False,
            disagg_decode_prealloc_queue=self.queue,
            chunked_req=None,
            last_batch=None,
            cur_batch_for_debug=None,
            _sched_idled=False,
            page_size=PAGE_SIZE,
            enable_overlap=self.mode == "overlap",
            ngram_embedding_manager=types.SimpleNamespace(
                prepare_for_forward=lambda b, chunked_req=None: b
            ),
            **decode_context.intake_state(self._recv, self._ingest),
            # what the queue reads of the server's arguments before 0.5.17 (after: get_disagg())
            server_args=types.SimpleNamespace(
                disaggregation_transfer_backend="mooncake",
                disaggregation_decode_enable_radix_cache=False,
                disaggregation_decode_polling_interval=self.script.polling_interval,
            ),
            process_decode_queue=self._process_decode_queue,
            get_next_disagg_decode_batch_to_run=self._no_batch,
            is_disable_overlap_for_batch=lambda batch, last_batch=None: False,
            launch_batch_sample_if_needed=lambda result, batch=None: None,  # batch: 0.5.16 on
            _war_barrier_enabled=False,
            scheduler_stage_metrics=None,  # process_input_requests' stage recorder (0.5.20 on): off  # the overlap loop's stream wait before 0.5.14: no forward
            on_idle=self._idle,
            _record_scheduler_state_for_paused_engine=lambda: None,
            retire_unadmitted_request=lambda req: None,
            output_streamer=types.SimpleNamespace(stream_output=lambda reqs, logprob: None),
            **self._idleness_state(),
        )

    def _no_batch(self, running_batch=None):
        """No decode batch is formed: from 0.5.16 the loop reads a plan, before it a batch."""
        if running_batch is None and not self._plans:
            return None
        return types.SimpleNamespace(running_batch=running_batch, batch_to_run=None)

    def _idleness_state(self) -> dict:
        return decode_context.idle_scheduler_state(self.sgl, self.queue)

    def _weight_updater(self):
        return decode_context.weight_updater(self.sched)

    # ---- the script, played at intake ---------------------------------------------------------
    def _ingest(self, *args, **kwargs):
        """ingest_requests (0.5.20 on): the script; on 0.5.20, whose loops have no other iteration
        marker, then SGLang's own process_input_requests, where the adapter marks the iteration."""
        recv = self._recv()
        if not self._loop_reads_exit:
            type(self.sched).process_input_requests(self.sched, recv)
        return recv

    def _recv(self, *args, **kwargs):
        """What the tokenizer's socket delivers this iteration: the script plays it, and nothing
        reaches the dispatcher."""
        self.iteration += 1
        step = self.script.steps.get(self.iteration, Step())
        for i in step.publish:
            self.servers[i].publish(self.script.dp_size)
        for room, i in step.register:
            bootstrap_client.register_dp_rank(self.servers[i].url, room, room % self.script.dp_size)
        for rid, room, i in step.arrive:
            req = self._req(rid, room, self.servers[i])
            self.reqs[rid] = req
            assert_reachable(
                "DecodePreallocQueue.add",
                self.sched.disaggregation_mode.name == "DECODE"
                and not getattr(self.sched, "enable_priority_scheduling", False),
            )
            self.queue.add(req)
        for rid in step.abort:
            assert_reachable(
                "prepare_abort on a queued request",
                any(d.req is self.reqs[rid] for d in self.queue.queue),
                rid,
            )
            self.sgl.decode_utils.prepare_abort(self.reqs[rid], "aborted by the client")
        self.release_wanted |= step.release
        self.resume_wanted |= step.resume
        self._memory_requests()
        return []

    def _memory_requests(self) -> None:
        """A client that honours SGLang's contract: it releases the KV memory once the server is
        idle (pause_generation, then SchedulerWeightUpdaterManager.release_memory_occupation, which
        asserts Scheduler.is_fully_idle), and resumes it (resume_memory_occupation, then
        continue_generation) after that."""
        from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE  # lazy: SGLang is optional
        from sglang.srt.managers import io_struct as io

        tags = [GPU_MEMORY_TYPE_KV_CACHE]
        if self.updater is None:
            self.updater = self._weight_updater()
        if self.release_wanted and self.sched.is_fully_idle():
            self.sched.pause_generation(io.PauseGenerationReqInput(mode="in_place"))
            self.updater.release_memory_occupation(io.ReleaseMemoryOccupationReqInput(tags=tags))
            self.release_wanted, self.released = False, True
        elif self.resume_wanted and self.released:
            self.updater.resume_memory_occupation(io.ResumeMemoryOccupationReqInput(tags=tags))
            self.sched.continue_generation(io.ContinueGenerationReqInput(torch_empty_cache=False))
            self.resume_wanted = self.released = False

    def _req(self, rid, room, server):
        return types.SimpleNamespace(
            rid=rid,
            bootstrap_room=room,
            bootstrap_host=server.host,
            bootstrap_port=server.port,
            disagg_prefill_dp_rank=None,
            finished_reason=None,
            origin_input_ids=[1] * 40,
            output_ids=[],
            is_retracted=False,
            return_logprob=False,
            time_stats=types.SimpleNamespace(),
            to_finish=None,
        )

    # ---- the queue step: the real consumption point, then the transfer stand-in ----------------
    def _process_decode_queue(self):
        sink = hooks.active()
        for rid in [
            r for r, n in self.initialised.items() if n < self.iteration and r not in self.ended
        ]:
            req = self.reqs[rid]
            sink.emit("kv_done", room=req.bootstrap_room, rid=rid, first_token=0)
            sink.emit("req_done", rid=rid, room=req.bootstrap_room, tokens=1)
            self.ended.add(rid)
            transfer = self.sched.disagg_decode_transfer_queue
            transfer.queue = [d for d in transfer.queue if d.req is not req]
        # as SGLang's process_decode_queue: pop_preallocated (whose first step is the resolve) runs
        # only every disaggregation_decode_polling_interval iterations
        if self.iteration % self.script.polling_interval:
            return
        assert_reachable(
            "DecodePreallocQueue._resolve_pending_reqs",
            not (self.sched._engine_paused and self._paused_skips_queue)
            and not self.queue.retracted_queue,
        )
        self.queue._resolve_pending_reqs()
        for decode_req in list(self.queue.queue):
            req = decode_req.req
            if type(req.finished_reason).__name__ == "FINISH_ABORT":
                self.queue.queue.remove(decode_req)
                self.queue.pending_reqs = [
                    p for p in self.queue.pending_reqs if p is not decode_req
                ]
                if req.rid not in self.ended:
                    sink.emit(
                        "req_abort",
                        rid=req.rid,
                        room=req.bootstrap_room,
                        reason=req.finished_reason.message,
                    )
                    self.ended.add(req.rid)
            elif decode_req.kv_receiver.rank is not None and req.rid not in self.initialised:
                self.initialised[req.rid] = self.iteration
                self.queue.queue.remove(decode_req)
                # in SGLang's transfer queue while the stand-in transfer runs, as pop_preallocated
                # hands it over: is_fully_idle sees it there
                self.sched.disagg_decode_transfer_queue.queue.append(decode_req)

    def _idle(self):
        last_step = max(self.script.steps, default=0)
        done = (
            self.iteration >= last_step
            and len(self.ended) == len(self.reqs)
            and not (self.release_wanted or self.resume_wanted)
        )
        if done or self.iteration >= self.script.max_iters:
            self.sched.gracefully_exit = True
            if not self._loop_reads_exit:
                raise _LoopEnd  # loops before 0.5.21 never leave on their own
        # the decode graph's time: lets a prefetched query finish before its consumer
        sync.sleep(0.002)

    def run(self, trace_path: str | None) -> str | None:
        """Run the loop to its end, tracing into `trace_path`, or into the process's active sink
        when it is None (a process traced through PDO_SGLANG_TRACE_DIR)."""
        loop = getattr(
            self.sgl.decode.SchedulerDisaggregationDecodeMixin,
            f"event_loop_{self.mode}_disagg_decode",
        )
        sink = TraceSink(trace_path) if trace_path is not None else hooks.active()
        self._loop_reads_exit = decode_hooks.reads_gracefully_exit(self.sgl)
        source = inspect.getsource(decode_hooks.unwrap(loop))
        self._plans = "plan = self.get_next_disagg_decode_batch_to_run" in source
        # from 0.5.16 the loop skips process_decode_queue while paused; before, it runs it first
        queue_at = source.find("self.process_decode_queue()")
        self._paused_skips_queue = -1 < source.find("self._engine_paused") < queue_at
        # the published ServerArgs that _init_receiver reads (get_disagg()), and the process
        # groups SGLang's weight updater reads
        config = decode_context.published(PAGE_SIZE)
        config.__enter__()
        decode = self.sgl.decode
        real_get_kv_class = decode.get_kv_class
        # the transfer backend's receiver class
        decode.get_kv_class = lambda backend, kind: _Receiver
        decode_hooks.hook_receiver(_Receiver)
        try:
            with contextlib.suppress(_LoopEnd):
                if trace_path is None:
                    loop(self.sched)
                else:
                    with hooks.tracing(sink):
                        loop(self.sched)
        finally:
            decode.get_kv_class = real_get_kv_class
            config.__exit__(None, None, None)
            cancel = getattr(self.queue, "_cancel_prefill_dp_rank_queries", None)  # 0.5.22 on
            if cancel is not None:
                cancel()
            executor = self.mgr._prefill_recompute_executor
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
            for server in self.servers:
                server.stop()
        return trace_path


# ---- the scenarios -------------------------------------------------------------------------------
def _arrivals(n: int, every: int, server: int = 0, lag: int = 1, first_room: int = 100) -> dict:
    steps: dict = {}
    for k in range(n):
        it, room = 1 + k * every, first_room + k
        steps.setdefault(it, Step()).arrive.append((f"r{room}", room, server))
        steps.setdefault(it + lag, Step()).register.append((room, server))
    return steps


def _merge(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for it, step in part.items():
            s = out.setdefault(it, Step())
            for f in dataclasses.fields(Step):
                v = getattr(step, f.name)
                if isinstance(v, list):
                    getattr(s, f.name).extend(v)
                elif v:
                    setattr(s, f.name, v)
    return out


# name -> the script, run under both decode loops
SCRIPTS: Registry[Script] = Registry("decode scenario")


def _add(name: str, script: Script) -> None:
    SCRIPTS.register(name)(script)


_BURST = _merge(_arrivals(3, 0, lag=0), _arrivals(3, 2, lag=2, first_room=200))
_add("decode-arrivals", Script(_BURST))
_add(
    "decode-two-addresses",
    Script(
        _merge(
            _arrivals(3, 1, server=0, lag=0),
            _arrivals(3, 1, server=1, lag=0, first_room=300),
            {4: Step(publish=[1])},
        ),
        servers=2,
        published=(0,),
    ),
)
_add(
    "decode-abort-after-prefetch", Script(_merge(_arrivals(2, 0, lag=3), {2: Step(abort=["r101"])}))
)
_add(
    "decode-rooms-grow",
    Script(
        {
            1: Step(arrive=[("r100", 100, 0)]),
            2: Step(arrive=[("r101", 101, 0)], register=[(100, 0), (101, 0)]),
            3: Step(arrive=[("r102", 102, 0)], register=[(102, 0)]),
        }
    ),
)
_add(
    "decode-rooms-change",
    Script(
        {
            1: Step(arrive=[("r100", 100, 0), ("r101", 101, 0)]),
            2: Step(abort=["r100"], register=[(101, 0)]),
        }
    ),
)
# SGLang releases memory only when the scheduler is idle, but its idleness test does not look at
# the prealloc queue: a request still waiting for its rank may be there (docs/sglang.md, finding 1).
_add(
    "decode-release-idle",
    Script(
        _merge(
            _arrivals(2, 0, lag=0),
            {5: Step(release=True), 7: Step(resume=True)},
            {
                8: Step(arrive=[("r200", 200, 0), ("r201", 201, 0)]),
                9: Step(register=[(200, 0), (201, 0)]),
            },
        )
    ),
)
_add(
    "decode-release-pending",
    Script(_merge(_arrivals(2, 0, lag=4), {2: Step(release=True), 4: Step(resume=True)})),
)
_add("decode-single-rank", Script(_arrivals(3, 1, lag=0), dp_size=1))
_add(
    "decode-polling-interval",
    Script(
        _merge(_arrivals(3, 1, lag=2), _arrivals(2, 3, lag=0, first_room=400)), polling_interval=3
    ),
)
_add("decode-sglang-server", Script(_BURST, sglang_server=True))


def needs(script: Script) -> list[str]:
    """The SGLang entry points a script drives beyond the loops and the queue's add/resolve."""
    steps = script.steps.values()
    memory = any(s.release or s.resume for s in steps)
    return ["DecodePreallocQueue.release_memory_occupation"] if memory else []


def missing(sgl, script: Script) -> list[str]:
    """The entry points the script needs that this release does not have."""
    owners = {"DecodePreallocQueue": sgl.decode.DecodePreallocQueue}
    return [n for n in needs(script) if not hasattr(owners[n.split(".")[0]], n.split(".")[1])]


def inapplicable(sgl) -> dict[str, list[str]]:
    """Scenario -> the entry points it needs that this release lacks (it is not run there)."""
    return {name: m for name, script in SCRIPTS.items() if (m := missing(sgl, script))}


def scenarios(sgl) -> list[tuple[str, object]]:
    """(name, run(trace_path) -> trace_path) for each script this release can run, under both
    decode loops."""
    out = []
    for name, script in SCRIPTS.items():
        if missing(sgl, script):
            continue
        for mode in ("normal", "overlap"):
            out.append((f"{name}/{mode}", _runner(sgl, script, mode)))
    return out


def _runner(sgl, script, mode):
    def run(trace_path: str, fuzz_seed: int | None = None) -> str:
        harness = Harness(sgl, script, mode)
        if fuzz_seed is None:
            return harness.run(trace_path)
        return _controlled(harness, trace_path, fuzz_seed)

    return run


def _controlled(harness: Harness, trace_path: str, seed: int) -> str:
    """The scenario under the schedule controller: the scheduler thread and the prefetch pool (the
    adapter's executor proxy hands the queries to the managed pool) run one at a time, in the order
    a seeded random walk picks at every trace event; the same seed replays the same schedule."""
    controller = Controller(RandomWalk(seed), max_steps=200_000).install("scheduler")
    try:
        harness.run(trace_path)
    finally:
        controller.uninstall()
    if controller.error is not None:
        raise controller.error
    return trace_path
