"""The embedded PD runner (`pdo run --pd`): bootstrap server, N prefill DP ranks and one decode
instance in one process, each role on its own threads, KV over the in-process transport.

  router ──► prefill rank i  (its own loop, any mode; PUT /route, POST /register_dp_rank per room)
        └──► decode          (prealloc queue → POST /query_dp_ranks → pull KV from rank i → decode)

Every role writes its own trace (a prefill trace per rank, one decode trace), as separate processes
would; `pdo check` reads them together. `pdo launch` (engine/cli/launch.py, engine/runs/pd_process.py) runs
the same roles as processes over ZMQ.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from dataclasses import dataclass, field

import torch

from engine import sync
from engine.bootstrap import client as bootstrap_client
from engine.bootstrap.server import BootstrapServer
from engine.decode.config import ROUTERS, PDError, PDStartupError
from engine.decode.loops import LOOPS as DECODE_LOOPS
from engine.decode.request import DecodeReq
from engine.decode.scheduler import DecodeScheduler
from engine.kv.transport import InProcKVClient, InProcKVServer
from engine.oracle.reference import intra_op_threads, reference_generate
from engine.prefill.loops import LOOPS as PREFILL_LOOPS
from engine.prefill.scheduler import PrefillScheduler
from engine.runs.role import die_after, frozen_gc, open_trace, role_header, watchdog
from engine.runs.spec import Kill, RunSpec
from engine.runs.workload import make_workload
from engine.runtime.config import check_dispatch
from engine.trace.tracer import ends_trace

STOP_GRACE_S = 5.0  # how long loops asked to stop after a timeout get to finish their batch


def route(reqs, dp: int, policy: str = "round_robin", seed: int = 0) -> list[int]:
    """The DP rank each request goes to. Seeded, so every process of `pdo launch` agrees."""
    if dp < 1:
        raise ValueError(f"--dp must be >= 1, got {dp}")
    if policy == "round_robin":
        return [i % dp for i in range(len(reqs))]
    if policy == "random":
        rng = random.Random(seed)
        return [rng.randrange(dp) for _ in reqs]
    raise ValueError(f"unknown router {policy!r}; choose one of {', '.join(ROUTERS)}")


def decode_requests(reqs, addr: str) -> list[DecodeReq]:
    return [
        DecodeReq(
            r.rid,
            r.bootstrap_room,
            addr,
            list(r.prompt),
            r.max_new_tokens,
            r.logit_bias,
            r.arrival_s,
        )
        for r in reqs
    ]


def rank_info(rank: int, dp: int, page_size: int, port: int) -> dict:
    """SGLang's PUT /route payload for a prefill rank with TP=PP=CP=1 and `dp` DP-attention ranks."""
    return {
        "role": "Prefill",
        "attn_tp_size": 1,
        "attn_tp_rank": 0,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": dp,
        "attn_dp_rank": rank,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": "127.0.0.1",
        "rank_port": port,
        "page_size": page_size,
        "kv_cache_dtype": "auto",
        "load_balance_method": "round_robin",
    }


def registrar(url: str, rank: int, errors: list, dp: int):
    """The prefill ingest hook: register each room this rank serves. One attempt, as SGLang; a
    failure leaves the room unknown, and decode aborts the request after its bootstrap timeout.
    With one DP rank nothing is registered, as in SGLang (CommonKVSender registers only with more
    than one): decode knows the answer is rank 0 from the parallel info alone."""
    if dp == 1:
        return lambda req: None

    def register(req):
        try:
            bootstrap_client.register_dp_rank(url, req.bootstrap_room, rank)
        except bootstrap_client.BootstrapError as exc:
            errors.append(f"room {req.bootstrap_room}: {exc}")

    return register


def trace_paths(trace_path: str | None, dp: int) -> tuple[str | None, list]:
    if not trace_path:
        return None, [None] * dp
    stem = trace_path[:-6] if trace_path.endswith(".jsonl") else trace_path
    return f"{stem}.decode.jsonl", [f"{stem}.prefill{i}.jsonl" for i in range(dp)]


@dataclass
class PDResult:
    """A PD run: `summary`, the report `pdo run --pd` prints (None when the run failed); the
    roles, for a caller that looks inside (as far as they were built); `error`, the exception
    that ended the run, when the run was asked to keep it."""

    summary: dict | None = None
    prefills: list[PrefillScheduler] = field(default_factory=list)
    decode: DecodeScheduler | None = None
    error: Exception | None = None


def run_pd(
    spec: RunSpec,
    *,
    hooks: dict | None = None,
    server_hook=None,
    extra_decode_reqs=(),
    keep_error: bool = False,
) -> PDResult:
    """Run all roles of `spec` to completion; the summary holds outputs, aborts, waits, leaks and,
    with `spec.verify`, the mismatches against the single-process reference. An exception that
    ends the run is raised, or with `keep_error` kept in the result.

    The hooks a spec cannot hold: `hooks`, the decode scheduler's (`iter`, `after_prefetch`) and
    `tracers`, called with each role's tracer by name (`prefill<i>`, `decode`) before the roles
    start (a fuzz strategy that reads a trace as it grows); `server_hook`, called with the
    bootstrap server once started; `extra_decode_reqs`, decode-only requests. `spec.kill`
    ({"role": "prefill<i>", "at": N}): rank i dies once it sent N KV chunks (0: before its loop
    starts): its KV server fails, its loop stops, and decode aborts what it held (docs/faults.md).

    Every trace's header records the run (RunSpec.to_header): what `pdo check --predict
    --confirm` rebuilds it from; `pd_run.unrecorded` names the hooks given, which it cannot."""
    result = PDResult()
    given = {"bootstrap_url": spec.bootstrap_url, "server_hook": server_hook}
    given["extra_decode_reqs"] = extra_decode_reqs
    given["hooks"] = set(hooks or ()) - {"tracers"}
    unrecorded = sorted(k for k, v in given.items() if v)
    try:
        _serve_and_run(spec, result, hooks, server_hook, extra_decode_reqs, unrecorded)
    except Exception as exc:
        if not keep_error:
            raise
        result.error = exc
    return result


def _serve_and_run(spec: RunSpec, result: PDResult, hooks, server_hook, extra, unrecorded):
    """The bootstrap server (the spec's, or one started here) around the run of the roles."""
    cfg = spec.engine
    check_dispatch(cfg)
    torch.manual_seed(cfg.seed)
    url, server = spec.bootstrap_url, None
    if url is None:
        server = BootstrapServer(
            latency_s=spec.bootstrap_latency_ms / 1000.0,
            latency_scope=spec.latency_scope,
            expected_ranks=spec.dp,
        )
        inproc = (spec.bootstrap or ("inproc" if sync.controlled() else "http")) == "inproc"
        server = server.start_inproc() if inproc else server.start()
        url = server.url
    try:
        if not bootstrap_client.health(url, timeout=2.0):
            raise PDStartupError(
                f"bootstrap server at {url} is not reachable: start it first (pdo bootstrap)"
            )
        if server_hook:
            server_hook(server)
        with intra_op_threads(1):  # every role has its own threads already
            _run(spec, result, url, hooks, extra, unrecorded)
    finally:
        if server is not None:
            server.stop()


def _run(spec: RunSpec, result: PDResult, url, hooks, extra, unrecorded) -> None:
    cfg, dp = spec.engine, spec.dp
    reqs = make_workload(spec.workload, cfg.model_config.vocab_size)
    ranks = route(reqs, dp, spec.router, spec.workload.seed)
    roles = _build_roles(spec, reqs, ranks, url, hooks, extra, unrecorded)
    result.prefills, result.decode = roles.prefills, roles.decode
    tracers = {f"prefill{i}": s.tr for i, s in enumerate(roles.prefills)}
    tracers["decode"] = roles.decode.tr
    killed = _arm_kill(roles, spec.kill)
    if (hooks or {}).get("tracers"):
        hooks["tracers"](tracers)
    with contextlib.ExitStack() as ending:  # the streamed traces end as `pdo run` ends its own
        for t in tracers.values():
            ending.enter_context(ends_trace(t))
        dogs = _watchdogs(spec, roles, tracers)
        try:
            wall = _run_roles(spec, roles, url, killed)
        finally:
            for dog in dogs:
                dog.stop()
    for i, s in enumerate(roles.prefills):
        if i == killed:  # cut where it stopped, as a killed process leaves its file
            s.tr.close("cut", end=False)
        else:
            s.tr.close("normal")
    # the header went out at the start: the count known at the end goes in trace_end
    roles.decode.tr.end_fields["memory_waits"] = roles.decode.stats["memory_waits"]
    roles.decode.tr.close("normal")
    result.summary = _summary(spec, roles, wall, killed, {r.rid: k for r, k in zip(reqs, ranks)})


def _summary(spec: RunSpec, roles: _Roles, wall: float, killed, routed: dict) -> dict:
    summary = summarize(roles.decode, wall, routed)
    decode_path, prefill_paths = trace_paths(spec.trace_path, spec.dp)
    summary.update(
        dp=spec.dp,
        prefill_mode=spec.engine.mode,
        decode_mode=spec.decode.loop,
        prefetch=spec.decode.prefetch,
        registration_errors=roles.registration_errors,
        # a killed rank's memory went with it: its leaks are not counted
        prefill_leaks=[
            {} if i == killed else s.leak_report() for i, s in enumerate(roles.prefills)
        ],
        prefill_memory=[s.memory_stats() for s in roles.prefills],
        unclaimed_rooms=sorted(
            r for i, server in roles.servers.items() if i != killed for r in server.unclaimed()
        ),
        traces=[p for p in [decode_path, *prefill_paths] if p],
        faults=[]
        if killed is None
        else [{"role": f"prefill{killed}", "status": None, "error": roles.servers[killed].failed}],
    )
    if spec.verify:
        ref = reference_generate(spec.engine, roles.decode.done)
        summary["mismatches"] = sorted(
            rid for rid, toks in summary["outputs"].items() if ref[rid] != toks
        )
    return summary


def _watchdogs(spec: RunSpec, roles: _Roles, tracers: dict) -> list:
    """A watchdog per role's trace (as each process of `pdo launch` has its own); one that stops
    the run ends every trace first (reason watchdog), then the process."""

    def stop_all(code: int) -> None:
        for t in tracers.values():
            t.close("watchdog")
        os._exit(code)

    gone = [(s, s.arrivals) for s in roles.prefills] + [(roles.decode, roles.decode.aborted)]
    dogs = (watchdog(spec, t, *g, exit=stop_all) for t, g in zip(tracers.values(), gone))
    return [dog for dog in dogs if dog is not None]


@dataclass
class _Roles:
    """The roles of one embedded PD run, built and not started yet."""

    prefills: list[PrefillScheduler]
    decode: DecodeScheduler
    servers: dict[int, InProcKVServer]  # each prefill rank's end of the KV transport
    registration_errors: list[str]  # the register_dp_rank calls that failed, filled as they run


def _build_roles(spec: RunSpec, reqs, ranks, url, hooks, extra, unrecorded) -> _Roles:
    """The roles, their traces streaming (with a trace path) with the run in their headers."""
    cfg, dp = spec.engine, spec.dp
    # SGLang's bootstrap_addr is host:port; an in-process server keeps its inproc:// URL
    addr = url if url.startswith("inproc://") else bootstrap_client.base_url(url).split("://", 1)[1]
    decode_path, prefill_paths = trace_paths(spec.trace_path, dp)
    servers = {i: InProcKVServer(i) for i in range(dp)}
    registration_errors: list[str] = []
    prefills = []
    for i in range(dp):
        header = role_header(spec, "prefill", i)
        tracer = open_trace(spec, header, prefill_paths[i], pd=True, unrecorded=unrecorded)
        mine = [r for r, k in zip(reqs, ranks) if k == i]
        # under a controller: this rank's threads are "prefill<i>/..."
        with sync.group(f"prefill{i}"):
            prefills.append(
                PrefillScheduler(
                    cfg,
                    mine,
                    tracer=tracer,
                    receiver=servers[i],
                    on_ingest=registrar(url, i, registration_errors, dp),
                )
            )
    for r in extra:  # decode-only requests (tests: rooms no prefill rank serves)
        r.addr = r.addr or addr  # default address: this run's
    decode_reqs = decode_requests(reqs, addr) + list(extra)
    header = role_header(spec, "decode")
    decode_tracer = open_trace(spec, header, decode_path, pd=True, unrecorded=unrecorded)
    with sync.group("decode"):
        client = InProcKVClient(servers)
        decode = DecodeScheduler(
            cfg, spec.decode, decode_reqs, client=client, tracer=decode_tracer, hooks=hooks
        )
    return _Roles(prefills, decode, servers, registration_errors)


def _arm_kill(roles: _Roles, kill: Kill | None) -> int | None:
    """Make the prefill rank `kill` names die at its moment; returns its rank (None: no fault)."""
    if not kill:
        return None
    rank = int(kill.role.removeprefix("prefill"))
    server, sched = roles.servers[rank], roles.prefills[rank]
    why = f"killed (--kill {kill.role}@{kill.at})"

    def die():
        server.fail(why)
        sched.stop()

    if kill.at == 0:  # dead once registered: _run_roles starts no loop for it
        die()
    else:
        die_after(server, kill.at, die)
    return rank


def _run_roles(spec: RunSpec, roles: _Roles, url, killed=None) -> float:
    """Every role's loop on its own thread until all end or timeout_s passes; the wall time.
    Raises PDError past the timeout or when a role failed."""
    errors: dict[str, BaseException] = {}
    cfg, dp, prefill_delay_s, timeout_s = spec.engine, spec.dp, spec.prefill_delay_s, spec.timeout_s

    def prefill_main(i, s):
        try:
            if prefill_delay_s:
                # a prefill that comes up late: decode sees 503 until then
                sync.sleep(prefill_delay_s)
            bootstrap_client.register_prefill_rank(
                url, rank_info(i, dp, cfg.page_size, 1 + i), retries=2, backoff_s=0.05
            )
            s.t0 = t_start  # arrivals are relative to the common start
            if i == killed and s.stopping:  # killed at once (--kill prefill<i>@0)
                return
            PREFILL_LOOPS[cfg.mode](s)
        except BaseException as exc:
            errors[f"prefill{i}"] = exc

    def decode_main():
        try:
            roles.decode.t0 = t_start
            DECODE_LOOPS[spec.decode.loop](roles.decode)
        except BaseException as exc:
            errors["decode"] = exc

    t_start = sync.now()
    wall0 = time.monotonic()
    # Every role's loop runs on a thread named "scheduler" (the trace's thread field); under a
    # controller they are managed threads "prefill<i>/scheduler" and "decode/scheduler".
    threads = [
        sync.start_thread(lambda i=i, s=s: prefill_main(i, s), "scheduler", group=f"prefill{i}")
        for i, s in enumerate(roles.prefills)
    ]
    threads.append(sync.start_thread(decode_main, "scheduler", group="decode"))
    deadline = wall0 + timeout_s
    try:
        with frozen_gc(cfg.freeze_gc):
            for t in threads:
                sync.join(t, "pd.join", max(0.0, deadline - time.monotonic()))
    except BaseException:
        # SIGINT or a signal handler's SystemExit: end every role first. A role thread inside a
        # torch call at interpreter exit is made to exit as it retakes the GIL, unwinding through
        # torch's noexcept C++ frames: std::terminate, exit 134.
        _stop_roles(roles, threads)
        _close_finished(roles, threads)
        raise
    wall = time.monotonic() - wall0
    _stop_and_close(roles, threads, timeout_s)
    if errors:
        who, exc = next(iter(errors.items()))
        raise PDError(f"{who} failed: {exc}") from exc
    return wall


def _stop_and_close(roles: _Roles, threads: list, timeout_s: float) -> None:
    """Close every role whose loop has ended; past the timeout, first ask every loop to end and
    give it a bounded grace, then raise PDError."""
    decode = roles.decode
    hung = [t for t in threads if not sync.finished(t)]
    if hung:
        # Past the timeout: ask every loop to end and give it a bounded grace, so that its worker,
        # streams, transfer thread and query pool are closed below rather than left running.
        _stop_roles(roles, threads)
    still = _close_finished(roles, threads)
    if not still:
        # under a controller: every stream, transfer and prefetch thread has exited
        sync.quiesce("pd.quiesce")
    if hung:
        left = (
            f"; still running after a {STOP_GRACE_S:g} s grace, not closed: {', '.join(still)}"
            if still
            else ""
        )
        raise PDError(
            f"PD run did not finish within {timeout_s:g} s (decode: {len(decode.done)} "
            f"done, {len(decode.aborted)} aborted of {decode.total}){left}"
        )


def _stop_roles(roles: _Roles, threads: list) -> None:
    """Ask every role's loop to end (it finishes the batch in flight) and wait a bounded grace."""
    for s in [*roles.prefills, roles.decode]:
        s.stop()
    grace = time.monotonic() + STOP_GRACE_S
    for t in threads:
        sync.join(t, "pd.stop", max(0.0, grace - time.monotonic()))


def _close_finished(roles: _Roles, threads: list) -> list[str]:
    """Close every role whose loop has returned (its worker, streams, transfer thread, query
    pool); returns the names of those still running, left open: closing under a loop that still
    runs would race with it."""
    by_name = {**{f"prefill{i}": s for i, s in enumerate(roles.prefills)}, "decode": roles.decode}
    still = []
    for (name, s), t in zip(by_name.items(), threads):  # in the order of `threads`
        if sync.finished(t):
            s.close()
        else:
            still.append(name)
    return still


def summarize(decode: DecodeScheduler, wall: float, routed: dict[str, int] | None = None) -> dict:
    """`routed`: the DP rank each request was routed to (the seeded router every role of the run
    agrees on), to count a failed rank's aborted requests whatever ended them."""
    res = [x for x in decode.prealloc.resolves]
    waits = sorted(x["wait_s"] for x in res)
    leads = [x["lead_s"] for x in res if x["source"] != "sync"]
    by_source: dict[str, int] = {}
    for x in res:
        by_source[x["source"]] = by_source.get(x["source"], 0) + 1
    return {
        "requests": decode.total,
        "finished": len(decode.done),
        "outputs": {r.rid: r.output for r in decode.done},
        "aborted": {r.rid: r.error for r in decode.aborted},
        "wall_s": wall,
        "decode_tokens": decode.stats["decode_tokens"],
        "decode_tok_per_s": decode.stats["decode_tokens"] / wall if wall else 0.0,
        "iterations": decode.iter,
        "batches": decode.stats["batches"],
        "resolve": {
            "count": len(res),
            "by_source": by_source,
            "samples": [
                {"source": x["source"], "wait_ms": 1e3 * x["wait_s"], "lead_ms": 1e3 * x["lead_s"]}
                for x in res
            ],
            "errors": sum(1 for x in res if x["error"]),
            "mean_wait_ms": 1e3 * sum(waits) / len(waits) if waits else 0.0,
            "p99_wait_ms": 1e3 * waits[min(len(waits) - 1, int(0.99 * len(waits)))]
            if waits
            else 0.0,
            "mean_lead_ms": 1e3 * sum(leads) / len(leads) if leads else 0.0,
        },
        "decode_leaks": decode.leak_report(),
        "decode_memory_waits": decode.stats["memory_waits"],
        "failed_ranks": failed_ranks(decode, routed),
    }


def failed_ranks(decode: DecodeScheduler, routed: dict[str, int] | None) -> list[dict]:
    """Each prefill rank the decode lost: `aborted`, its requests that were aborted (those in
    flight when it failed, `aborted_in_flight`, and those whose room it never registered, which end
    at the bootstrap timeout with a reason naming the failed rank); without `routed`, only the
    former are known."""
    gone = [r.rid for r in decode.aborted]
    out = []
    for rank, why in sorted(decode.failed_ranks.items()):
        in_flight = decode.failed_aborts.get(rank, 0)
        mine = in_flight if routed is None else sum(1 for rid in gone if routed.get(rid) == rank)
        out.append({"rank": rank, "reason": why, "aborted": mine, "aborted_in_flight": in_flight})
    return out
