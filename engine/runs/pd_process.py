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
from engine.runs.role import die_after, open_trace, role_header, role_loop
from engine.runs.spec import RunSpec
from engine.runs.workload import make_workload
from engine.trace.tracer import ends_trace


def _load(path: str) -> RunSpec:
    return RunSpec.from_json(Path(path).read_bytes(), path)


def _kill_at(spec: RunSpec, role: str) -> int | None:
    """The moment this process is to die by SIGKILL (`pdo launch --kill ROLE@N`), or None."""
    return spec.kill.at if spec.kill and spec.kill.role == role else None


def _die() -> None:
    time.sleep(0.05)  # let what was sent last leave its socket first
    os.kill(os.getpid(), signal.SIGKILL)


def prefill_main(args: argparse.Namespace) -> int:
    spec = _load(args.spec)
    cfg, wc, dc, dp = spec.engine, spec.workload, spec.decode, spec.dp
    reqs = make_workload(wc, cfg.model_config.vocab_size)
    mine = [r for r, k in zip(reqs, route(reqs, dp, spec.router, wc.seed)) if k == args.rank]
    server = ZmqKVServer(args.rank)
    kill = _kill_at(spec, f"prefill{args.rank}")
    if kill:
        die_after(server, kill, _die)
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
    out = Path(args.out)
    header = role_header(spec, "prefill", args.rank)
    tracer = open_trace(spec, header, str(out / f"prefill{args.rank}.jsonl"), pd=True)
    errors: list[str] = []
    with ends_trace(tracer):
        sched = PrefillScheduler(
            cfg,
            mine,
            tracer=tracer,
            receiver=server,
            on_ingest=registrar(args.bootstrap, args.rank, errors, dp),
        )
        with role_loop(spec, sched, tracer, sched.arrivals):
            PREFILL_LOOPS[cfg.mode](sched)
        lost = _hold_kv(server, [r.bootstrap_room for r in mine], dc)
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


def _hold_kv(server: ZmqKVServer, rooms: list, dc: DecodeConfig) -> bool:
    """Stay until decode has pulled every room (or said goodbye): the KV lives here until then. A
    decode that stops its heartbeat (or never came within its bootstrap timeout) is gone: the held
    KV is dropped and the rank ends. Whether the decode was lost."""
    t_end = time.monotonic()
    deadline = t_end + dc.kv_timeout_s + 30
    while not server.settled(rooms) and not server.byes and time.monotonic() < deadline:
        wait = HEARTBEAT_TIMEOUT_S if server.last_peer is not None else dc.bootstrap_timeout_s
        if server.peer_lost(t_end, wait):
            return True
        time.sleep(0.01)
    return False


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
    spec = _load(args.spec)
    cfg, wc, dc, dp = spec.engine, spec.workload, spec.decode, spec.dp
    reqs = make_workload(wc, cfg.model_config.vocab_size)
    routed = {r.rid: k for r, k in zip(reqs, route(reqs, dp, spec.router, wc.seed))}
    addr = bootstrap_client.base_url(args.bootstrap).split("://", 1)[1]
    client = ZmqKVClient(args.bootstrap, timeout_s=dc.query_timeout_s)
    out = Path(args.out)
    tracer = open_trace(spec, role_header(spec, "decode"), str(out / "decode.jsonl"), pd=True)
    kill = _kill_at(spec, "decode")
    _await_prefill(args.bootstrap, dc)
    hooks = {"iter": lambda s: s.iter >= kill and _die()} if kill is not None else None
    sched = DecodeScheduler(
        cfg, dc, decode_requests(reqs, addr), client=client, tracer=tracer, hooks=hooks
    )
    t0 = time.monotonic()
    try:
        with ends_trace(tracer), role_loop(spec, sched, tracer, sched.aborted):
            DECODE_LOOPS[dc.loop](sched)
    finally:
        wall = time.monotonic() - t0
        for rank in range(dp):
            try:
                client.bye(rank)
            except KVTransportError:
                pass
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
