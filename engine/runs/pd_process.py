"""One role of a PD run as its own process: a child of `pdo launch` (engine/cli/launch.py).

`python -m engine.runs.pd_process prefill --rank I ...` runs prefill DP rank I, `... decode ...` the
decode instance; both read the run's configs from the spec file the parent wrote, reach the
bootstrap server at --bootstrap, move KV over ZMQ (engine/kv/transport.py) and write their trace
and summary into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from engine.bootstrap import client as bootstrap_client
from engine.decode.config import DecodeConfig, PDError
from engine.decode.loops import LOOPS as DECODE_LOOPS
from engine.decode.scheduler import DecodeScheduler
from engine.kv.transport import HEARTBEAT_TIMEOUT_S, KVTransportError, ZmqKVClient, ZmqKVServer
from engine.prefill.loops import LOOPS as PREFILL_LOOPS
from engine.prefill.scheduler import PrefillScheduler
from engine.runs.pd import decode_requests, rank_info, registrar, route, summarize
from engine.runs.prefill_run import frozen_gc
from engine.runs.workload import WorkloadConfig, make_workload
from engine.runtime.config import EngineConfig
from engine.trace.tracer import Tracer
from engine.trace.watchdog import Watchdog
from engine.trace.writer import ends_trace


def _load(spec_path: str):
    spec = json.loads(Path(spec_path).read_text())
    cfg = spec["cfg"]
    cfg["inject"] = frozenset(cfg["inject"])
    workload = spec["wc"]
    workload["prompt_len"] = tuple(workload["prompt_len"])
    return (
        EngineConfig(**cfg),
        WorkloadConfig(**workload),
        DecodeConfig(**spec["dc"]),
        spec["dp"],
        spec["router"],
    )


def _flight(spec_path: str) -> dict:
    """The flight recorder's settings of `pdo launch` (engine/cli/launch.py)."""
    f = json.loads(Path(spec_path).read_text()).get("flight", {})
    ms = f.get("flush_ms")
    return {"watchdog": f.get("watchdog"), "stream": {"flush_ms": ms} if ms else {}}


def _watchdog(tracer, sched, flight: dict, gone: list):
    """The role's watchdog, or None: pending is every request not done nor `gone` (a prefill's
    requests yet to arrive, a decode's aborted ones)."""
    if not flight["watchdog"]:
        return None
    return Watchdog(tracer, lambda: sched.total - len(sched.done) - len(gone), **flight["watchdog"])


def _kill_at(spec_path: str, role: str) -> int | None:
    """The moment this process is to die by SIGKILL (`pdo launch --kill ROLE@N`), or None."""
    kill = json.loads(Path(spec_path).read_text()).get("kill")
    return kill["at"] if kill and kill["role"] == role else None


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _deliver_then_die(server: ZmqKVServer, after: int):
    """The rank's KV delivery that kills the process once `after` chunks have gone out."""
    deliver, sent = server.deliver, [0]

    def wrapped(chunk):
        deliver(chunk)
        sent[0] += 1
        if sent[0] >= after:
            time.sleep(0.05)  # let the chunk leave the socket first
            _die()

    return wrapped


def prefill_main(args: argparse.Namespace) -> int:
    cfg, wc, dc, dp, router = _load(args.spec)
    reqs = make_workload(wc, cfg.model_config.vocab_size)
    mine = [r for r, k in zip(reqs, route(reqs, dp, router, wc.seed)) if k == args.rank]
    server = ZmqKVServer(args.rank)
    kill = _kill_at(args.spec, f"prefill{args.rank}")
    if kill:
        server.deliver = _deliver_then_die(server, kill)
    try:
        bootstrap_client.register_prefill_rank(
            args.bootstrap,
            rank_info(args.rank, dp, cfg.page_size, server.port),
            retries=3,
            backoff_s=0.2,
        )
    except bootstrap_client.BootstrapError as exc:
        server.close()
        raise PDError(
            f"prefill rank {args.rank} could not register with the bootstrap server: {exc}"
        ) from exc
    if kill == 0:
        _die()
    tracer = Tracer(
        {
            "role": "prefill",
            "mode": cfg.mode,
            "page_size": cfg.page_size,
            "model": cfg.model,
            "seed": cfg.seed,
            "workload_seed": wc.seed,
            "inject": sorted(cfg.inject),
            "dp_size": dp,
            "dp_rank": args.rank,
        }
    )
    out = Path(args.out)
    flight = _flight(args.spec)
    tracer.stream(str(out / f"prefill{args.rank}.jsonl"), **flight["stream"])  # as it runs
    errors: list[str] = []
    with ends_trace(tracer):
        sched = PrefillScheduler(
            cfg,
            mine,
            tracer=tracer,
            receiver=server,
            on_ingest=registrar(args.bootstrap, args.rank, errors, dp),
        )
        dog = _watchdog(tracer, sched, flight, sched.arrivals)
        threading.current_thread().name = "scheduler"
        try:
            with frozen_gc(cfg.freeze_gc):
                PREFILL_LOOPS[cfg.mode](sched)
        finally:
            if dog is not None:
                dog.stop()
            sched.close()
        # Stay until decode has pulled every room (or said goodbye): the KV lives here until then. A
        # decode that stops its heartbeat (or never came within its bootstrap timeout) is gone: the
        # held KV is dropped and the rank ends.
        rooms = [r.bootstrap_room for r in mine]
        t_end = time.monotonic()
        deadline = t_end + dc.kv_timeout_s + 30
        lost = False
        while not server.settled(rooms) and not server.byes and time.monotonic() < deadline:
            wait = HEARTBEAT_TIMEOUT_S if server.last_peer is not None else dc.bootstrap_timeout_s
            if server.peer_lost(t_end, wait):
                lost = True
                break
            time.sleep(0.01)
    tracer.close("normal")
    (out / f"prefill{args.rank}.json").write_text(
        json.dumps(
            {
                "leaks": sched.leak_report(),
                "unclaimed": server.unclaimed(),
                "registration_errors": errors,
                "decode_lost": lost,
            }
        )
    )
    server.close()
    return 0


def _await_prefill(url: str, dc: DecodeConfig) -> None:
    """The router's readiness gate: no request reaches the decode before the bootstrap server
    publishes the prefill parallel info (every rank registered), as a PD router routes only to
    healthy workers. Without it the decode's clock starts while the ranks still import torch, and
    its loop spins through an idle iteration per half millisecond of their start-up. A server that
    does not answer, or ranks that never all register within the bootstrap timeout, end the wait:
    the loop then meets that fault itself (docs/faults.md)."""
    deadline = time.monotonic() + dc.bootstrap_timeout_s
    while time.monotonic() < deadline:
        try:
            if bootstrap_client.get_prefill_info(url, timeout=1.0) is not None:
                return
        except bootstrap_client.BootstrapError:
            return
        time.sleep(dc.info_retry_interval_s)


def decode_main(args: argparse.Namespace) -> int:
    cfg, wc, dc, dp, router = _load(args.spec)
    reqs = make_workload(wc, cfg.model_config.vocab_size)
    routed = {r.rid: k for r, k in zip(reqs, route(reqs, dp, router, wc.seed))}
    addr = bootstrap_client.base_url(args.bootstrap).split("://", 1)[1]
    client = ZmqKVClient(args.bootstrap, timeout_s=dc.query_timeout_s)
    tracer = Tracer(
        {
            "role": "decode",
            "mode": dc.loop,
            "prefill_mode": cfg.mode,
            "page_size": cfg.page_size,
            "model": cfg.model,
            "seed": cfg.seed,
            "workload_seed": wc.seed,
            "inject": sorted(cfg.inject),
            "dp_size": dp,
            "prefetch": dc.prefetch,
            "polling_interval": dc.polling_interval,
        }
    )
    out = Path(args.out)
    flight = _flight(args.spec)
    tracer.stream(str(out / "decode.jsonl"), **flight["stream"])  # the flight recorder: as it runs
    kill = _kill_at(args.spec, "decode")
    _await_prefill(args.bootstrap, dc)
    hooks = {"iter": lambda s: s.iter >= kill and _die()} if kill is not None else None
    sched = DecodeScheduler(
        cfg, dc, decode_requests(reqs, addr), client=client, tracer=tracer, hooks=hooks
    )
    dog = _watchdog(tracer, sched, flight, sched.aborted)
    threading.current_thread().name = "scheduler"
    t0 = time.monotonic()
    try:
        with ends_trace(tracer), frozen_gc(cfg.freeze_gc):
            DECODE_LOOPS[dc.loop](sched)
    finally:
        if dog is not None:
            dog.stop()
        wall = time.monotonic() - t0
        for rank in range(dp):
            try:
                client.bye(rank)
            except KVTransportError:
                pass
        sched.close()
        time.sleep(0.05)  # let the byes leave before the sockets close
        client.close()
    # the header was written at the start: the count goes in trace_end (docs/trace-format.md)
    tracer.end_fields["memory_waits"] = sched.stats["memory_waits"]
    tracer.close("normal")
    (out / "decode.json").write_text(json.dumps(summarize(sched, wall, routed)))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.runs.pd_process", description="a child process of `pdo launch`"
    )
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--spec", required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, default=0)
    args = p.parse_args(argv)
    # SIGTERM (the parent stopping its children) ends the role through its exception paths, so
    # that its trace ends with trace_end reason signal
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        # a role process runs several threads already (see engine/oracle/reference.py)
        torch.set_num_threads(1)
        return (prefill_main if args.role == "prefill" else decode_main)(args)
    except Exception as exc:  # one line on stderr; the parent reports it
        print(f"{args.role}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
