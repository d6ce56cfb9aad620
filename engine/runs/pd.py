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
import random
import time
from dataclasses import asdict, dataclass

import torch

from engine import sync
from engine.bootstrap import client as bootstrap_client
from engine.bootstrap.server import BootstrapServer
from engine.decode.config import ROUTERS, DecodeConfig, PDError, PDStartupError  # noqa: F401  (PDError re-exported)
from engine.decode.loops import LOOPS as DECODE_LOOPS
from engine.decode.request import DecodeReq
from engine.decode.scheduler import DecodeScheduler
from engine.kv.transport import InProcKVClient, InProcKVServer
from engine.oracle.reference import intra_op_threads, reference_generate
from engine.prefill.loops import LOOPS as PREFILL_LOOPS
from engine.prefill.scheduler import PrefillScheduler
from engine.runs.prefill_run import frozen_gc
from engine.runs.workload import WorkloadConfig, make_workload
from engine.runtime.config import EngineConfig, check_dispatch
from engine.runtime.model import TinyLlama
from engine.trace.tracer import NullTracer, Tracer
from engine.trace.writer import ends_trace

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


def run_pd(
    cfg: EngineConfig,
    wc: WorkloadConfig,
    dc: DecodeConfig,
    *,
    dp: int = 1,
    router: str = "round_robin",
    bootstrap_latency_ms: float = 0.0,
    latency_scope: str = "all",
    trace_path: str | None = None,
    hooks: dict | None = None,
    bootstrap_url: str | None = None,
    prefill_delay_s: float = 0.0,
    extra_decode_reqs=(),
    timeout_s: float = 120.0,
    verify: bool = True,
    server_hook=None,
    bootstrap: str | None = None,
    model: TinyLlama | None = None,
    kill: dict | None = None,
) -> dict:
    """Run all roles to completion and return a summary (outputs, aborts, waits, leaks, mismatches
    against the single-process reference when `verify`).

    `bootstrap`: "http" (the aiohttp server on its own thread, the default) or "inproc" (the same
    server's handlers called in-process, `inproc://bootstrap`; the default under a schedule
    controller, where every role thread is a managed thread and the run replays exactly). `model`:
    reuse a TinyLlama built for `cfg` (its weights are only read). `kill`: {"role": "prefill<i>",
    "at": N}, rank i dies once it sent N KV chunks (0: before its loop starts): its KV server
    fails, its loop stops, and decode aborts what it held (docs/faults.md). `hooks`: the decode
    scheduler's (`iter`, `after_prefetch`) and `tracers`, called with each role's tracer by name
    (`prefill<i>`, `decode`) before the roles start (a fuzz strategy that reads a trace as it grows).

    Every trace's header records the run (`workload`, `decode_config`, `pd_run`): what
    `pdo check --predict --confirm` rebuilds it from; `pd_run.unrecorded` names the options given
    that it cannot rebuild."""
    check_dispatch(cfg)
    torch.manual_seed(cfg.seed)
    reqs = make_workload(wc, cfg.model_config.vocab_size)
    ranks = route(reqs, dp, router, wc.seed)
    # the options a rebuild from the header cannot give back (no value of them is recorded)
    given = {"bootstrap_url": bootstrap_url, "extra_decode_reqs": extra_decode_reqs}
    given.update(server_hook=server_hook, hooks=set(hooks or ()) - {"tracers"})
    run_header = {
        "workload": _jsonable(asdict(wc)),
        "decode_config": asdict(dc),
        "pd_run": {
            "router": router,
            "bootstrap_latency_ms": bootstrap_latency_ms,
            "latency_scope": latency_scope,
            "prefill_delay_s": prefill_delay_s,
            "kill": kill,
            "unrecorded": sorted(k for k, v in given.items() if v),
        },
    }
    server = None
    if bootstrap is None:
        bootstrap = "inproc" if sync.controlled() else "http"
    if bootstrap not in ("http", "inproc"):
        raise ValueError(f"bootstrap must be 'http' or 'inproc', got {bootstrap!r}")
    if bootstrap_url is None:
        server = BootstrapServer(
            latency_s=bootstrap_latency_ms / 1000.0, latency_scope=latency_scope, expected_ranks=dp
        )
        server = server.start_inproc() if bootstrap == "inproc" else server.start()
        bootstrap_url = server.url
    try:
        if not bootstrap_client.health(bootstrap_url, timeout=2.0):
            raise PDStartupError(
                f"bootstrap server at {bootstrap_url} is not reachable: start it first (pdo bootstrap)"
            )
        if server_hook:
            server_hook(server)
        with intra_op_threads(1):  # every role has its own threads already
            return _run(
                cfg,
                wc,
                dc,
                reqs,
                ranks,
                dp,
                bootstrap_url,
                trace_path,
                hooks,
                prefill_delay_s,
                extra_decode_reqs,
                timeout_s,
                verify,
                model,
                kill,
                run_header,
            )
    finally:
        if server is not None:
            server.stop()


def _run(
    cfg,
    wc,
    dc,
    reqs,
    ranks,
    dp,
    url,
    trace_path,
    hooks,
    prefill_delay_s,
    extra,
    timeout_s,
    verify,
    model=None,
    kill=None,
    run_header=None,
) -> dict:
    if model is None:
        model = TinyLlama(
            cfg.model_config,
            seed=cfg.seed,
            dtype=getattr(torch, cfg.dtype),
            device=torch.device(cfg.device),
        )
    head = {"config": _jsonable(asdict(cfg)), **(run_header or {})}
    roles = _build_roles(cfg, wc, dc, reqs, ranks, dp, url, trace_path, hooks, extra, model, head)
    tracers = [s.tr for s in roles.prefills] + [roles.decode_tracer]
    killed = _arm_kill(roles, kill)
    if (hooks or {}).get("tracers"):
        named = {f"prefill{i}": s.tr for i, s in enumerate(roles.prefills)}
        hooks["tracers"]({**named, "decode": roles.decode_tracer})
    with contextlib.ExitStack() as ending:  # the streamed traces end as `pdo run` ends its own
        for t in tracers:
            ending.enter_context(ends_trace(t))
        wall = _run_roles(cfg, dc, roles, dp, url, prefill_delay_s, timeout_s, killed)
    for i, s in enumerate(roles.prefills):
        if i == killed:  # cut where it stopped, as a killed process leaves its file
            s.tr.cut()
        else:
            s.tr.close("normal")
    # the header went out at the start: the count known at the end goes in trace_end
    roles.decode_tracer.end_fields["memory_waits"] = roles.decode.stats["memory_waits"]
    roles.decode_tracer.close("normal")
    summary = summarize(roles.decode, wall, {r.rid: k for r, k in zip(reqs, ranks)})
    summary.update(
        dp=dp,
        prefill_mode=cfg.mode,
        decode_mode=dc.loop,
        prefetch=dc.prefetch,
        registration_errors=roles.registration_errors,
        # a killed rank's memory went with it: its leaks are not counted
        prefill_leaks=[
            {} if i == killed else s.leak_report() for i, s in enumerate(roles.prefills)
        ],
        prefill_memory=[s.memory_stats() for s in roles.prefills],
        unclaimed_rooms=sorted(
            r for i, server in roles.servers.items() if i != killed for r in server.unclaimed()
        ),
        traces=[p for p in [roles.decode_path, *roles.prefill_paths] if p],
        faults=[]
        if killed is None
        else [{"role": f"prefill{killed}", "status": None, "error": roles.servers[killed].failed}],
    )
    if verify:
        done = [r for r in roles.decode_reqs if r.rid in summary["outputs"]]
        ref = reference_generate(cfg, done, model=model)
        summary["mismatches"] = sorted(
            rid for rid, toks in summary["outputs"].items() if ref[rid] != toks
        )
    return summary


@dataclass
class _Roles:
    """The roles of one embedded PD run, built and not started yet."""

    prefills: list[PrefillScheduler]
    decode: DecodeScheduler
    servers: dict[int, InProcKVServer]  # each prefill rank's end of the KV transport
    decode_reqs: list[DecodeReq]
    decode_tracer: Tracer | NullTracer
    registration_errors: list[str]  # the register_dp_rank calls that failed, filled as they run
    decode_path: str | None
    prefill_paths: list


def _build_roles(
    cfg, wc, dc, reqs, ranks, dp, url, trace_path, hooks, extra, model, head
) -> _Roles:
    """The roles, their traces streaming with `head` in their headers (when `trace_path`)."""
    # SGLang's bootstrap_addr is host:port; an in-process server keeps its inproc:// URL
    addr = url if url.startswith("inproc://") else bootstrap_client.base_url(url).split("://", 1)[1]
    decode_path, prefill_paths = trace_paths(trace_path, dp)
    common = {
        "mode": cfg.mode,
        "page_size": cfg.page_size,
        "model": cfg.model,
        "seed": cfg.seed,
        "workload_seed": wc.seed,
        "inject": sorted(cfg.inject),
        "dp_size": dp,
    }
    servers = {i: InProcKVServer(i) for i in range(dp)}
    registration_errors: list[str] = []
    prefills = []
    for i in range(dp):
        tracer = Tracer({"role": "prefill", **common, "dp_rank": i}) if trace_path else NullTracer()
        if trace_path:
            tracer.stream(prefill_paths[i], extra_header=head)
        mine = [r for r, k in zip(reqs, ranks) if k == i]
        # under a controller: this rank's threads are "prefill<i>/..."
        with sync.group(f"prefill{i}"):
            prefills.append(
                PrefillScheduler(
                    cfg,
                    mine,
                    tracer=tracer,
                    receiver=servers[i],
                    model=model,
                    on_ingest=registrar(url, i, registration_errors, dp),
                )
            )
    for r in extra:  # decode-only requests (tests: rooms no prefill rank serves)
        r.addr = r.addr or addr  # default address: this run's
    decode_reqs = decode_requests(reqs, addr) + list(extra)
    decode_tracer = (
        Tracer(
            {
                "role": "decode",
                **common,
                "mode": dc.loop,
                "prefill_mode": cfg.mode,
                "prefetch": dc.prefetch,
                "polling_interval": dc.polling_interval,
            }
        )
        if trace_path
        else NullTracer()
    )
    if trace_path:
        decode_tracer.stream(decode_path, extra_header=head)
    with sync.group("decode"):
        decode = DecodeScheduler(
            cfg,
            dc,
            decode_reqs,
            client=InProcKVClient(servers),
            tracer=decode_tracer,
            model=model,
            hooks=hooks,
        )
    return _Roles(
        prefills,
        decode,
        servers,
        decode_reqs,
        decode_tracer,
        registration_errors,
        decode_path,
        prefill_paths,
    )


def _arm_kill(roles: _Roles, kill: dict | None) -> int | None:
    """Make the prefill rank `kill` names die at its moment; returns its rank (None: no fault)."""
    if not kill:
        return None
    rank = int(kill["role"].removeprefix("prefill"))
    server, sched, at = roles.servers[rank], roles.prefills[rank], kill["at"]
    why = f"killed (--kill {kill['role']}@{at})"
    if at == 0:  # dead once registered: _run_roles starts no loop for it
        server.fail(why)
        sched.stop()
        return rank
    deliver, sent = server.deliver, [0]

    def deliver_then_die(chunk):
        deliver(chunk)
        sent[0] += 1
        if sent[0] == at:
            server.fail(why)
            sched.stop()

    server.deliver = deliver_then_die
    return rank


def _run_roles(cfg, dc, roles: _Roles, dp, url, prefill_delay_s, timeout_s, killed=None) -> float:
    """Every role's loop on its own thread until all end or timeout_s passes; the wall time.
    Raises PDError past the timeout or when a role failed."""
    errors: dict[str, BaseException] = {}

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
            DECODE_LOOPS[dc.loop](roles.decode)
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


def _jsonable(d):
    return {k: (sorted(v) if isinstance(v, (set, frozenset)) else v) for k, v in d.items()}


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
