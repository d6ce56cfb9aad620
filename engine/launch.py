"""`pdo launch`: the bootstrap server, N prefill DP ranks and one decode instance as separate processes
on loopback, KV over ZMQ (engine/decode/transport.py), each process writing its own trace.

The parent writes one spec file (every config), starts `pdo bootstrap --port 0` and reads its URL,
starts the ranks (`python -m engine.launch prefill ...`) and the decode (`... decode ...`), waits,
then compares the decode's outputs with the single-process reference. Every process rebuilds the
seeded workload and the seeded router, so they agree on which rank serves which room without a
router process. A child that fails ends the run with its one-line error; none is left running.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from .decode.config import PDError
from .run import frozen_gc

REPO = Path(__file__).resolve().parents[1]


# ---- the parent ----------------------------------------------------------------------------------

def register(sub) -> None:
    from .cli import _add_engine_args
    from .decode.cli import add_pd_args

    p = sub.add_parser("launch", help="run bootstrap, N prefill ranks and a decode as processes (KV over ZMQ)")
    _add_engine_args(p)
    add_pd_args(p, launch=True)
    p.add_argument("--trace-dir", metavar="DIR", help="write each process's trace and summary here "
                                                      "(default: a temporary directory, removed)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="give up (and stop every process) after this")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(fn=cmd_launch)


def cmd_launch(a) -> int:
    from .decode.cli import configs_from_args, print_summary

    cfg, wc, dc, opts = configs_from_args(a)
    if a.trace_dir:
        os.makedirs(a.trace_dir, exist_ok=True)
        s = launch(cfg, wc, dc, out_dir=a.trace_dir, timeout_s=a.timeout_s, **opts)
    else:
        with tempfile.TemporaryDirectory(prefix="pdo-launch-") as d:
            s = launch(cfg, wc, dc, out_dir=d, timeout_s=a.timeout_s, **opts)
            s["traces"] = []
    return print_summary(s, a.json, "pdo launch")


def launch(cfg, wc, dc, *, out_dir: str, dp: int = 1, router: str = "round_robin", bootstrap_latency_ms: float = 0.0,
           latency_scope: str = "all", timeout_s: float = 120.0, verify: bool = True) -> dict:
    """Run every role as a process; returns the decode's summary extended like run_pd's."""
    from .config import check_dispatch
    from .decode.config import ROUTERS

    check_dispatch(cfg)
    if dp < 1 or router not in ROUTERS:  # before anything starts (the parent imports no torch until verify)
        raise ValueError(f"need --dp >= 1 and a router in {ROUTERS}, got dp={dp}, router={router!r}")
    out = Path(out_dir)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"cfg": {**asdict(cfg), "inject": sorted(cfg.inject)}, "wc": asdict(wc),
                                "dc": asdict(dc), "dp": dp, "router": router}))
    procs: list[tuple[str, subprocess.Popen]] = []
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.monotonic()
    try:
        boot = subprocess.Popen([sys.executable, "-m", "engine.cli", "bootstrap", "--port", "0", "--latency-ms",
                                 str(bootstrap_latency_ms), "--latency-scope", latency_scope, "--expected-ranks",
                                 str(dp)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        procs.append(("bootstrap", boot))
        url = _read_url(boot, timeout_s=30.0)
        common = ["--spec", str(spec), "--bootstrap", url, "--out", str(out)]
        for i in range(dp):
            procs.append((f"prefill{i}", _child(["prefill", "--rank", str(i), *common], env)))
        decode = _child(["decode", *common], env)
        procs.append(("decode", decode))
        _wait(procs, decode, t0 + timeout_s)
        for name, p in procs:
            if name.startswith("prefill"):
                _wait(procs, p, t0 + timeout_s)
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.terminate()
        for _, p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
    wall = time.monotonic() - t0
    s = json.loads((out / "decode.json").read_text())
    pre = [json.loads((out / f"prefill{i}.json").read_text()) for i in range(dp)]
    s.update(dp=dp, prefill_mode=cfg.mode, decode_mode=dc.loop, prefetch=dc.prefetch, launch_wall_s=wall,
             prefill_leaks=[p["leaks"] for p in pre], unclaimed_rooms=sorted(r for p in pre for r in p["unclaimed"]),
             registration_errors=[e for p in pre for e in p["registration_errors"]],
             traces=[str(out / "decode.jsonl")] + [str(out / f"prefill{i}.jsonl") for i in range(dp)])
    if verify:
        from .reference import reference_generate
        from .workload import make_workload
        reqs = {r.rid: r for r in make_workload(wc, cfg.model_config.vocab_size)}
        ref = reference_generate(cfg, [reqs[rid] for rid in s["outputs"]])
        s["mismatches"] = sorted(rid for rid, toks in s["outputs"].items() if ref[rid] != toks)
    return s


def _child(args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine.launch", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)


def _read_url(boot: subprocess.Popen, *, timeout_s: float) -> str:
    """The server prints one line, 'bootstrap server listening on URL', once it accepts requests."""
    box = {}
    reader = threading.Thread(target=lambda: box.setdefault("line", boot.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    line = box.get("line", "")
    if "listening on " not in line:
        try:
            boot.wait(timeout=2)  # stdout closed: it is exiting, its error is on stderr
            err = _last_line(boot)
        except subprocess.TimeoutExpired:
            err = f"no answer within {timeout_s:g} s"
        raise PDError(f"bootstrap server did not start: {err}")
    return line.strip().rsplit(" ", 1)[1]


def _last_line(p: subprocess.Popen) -> str:
    try:
        err = p.stderr.read() if p.stderr else ""
    except ValueError:
        err = ""
    lines = [x for x in err.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else f"exited with status {p.returncode}"


def _wait(procs, target: subprocess.Popen, deadline: float) -> None:
    """Wait for `target`; any child that exits with an error first ends the run with its message."""
    while target.poll() is None:
        for name, p in procs:
            if p.poll() not in (None, 0):
                raise PDError(f"{name} failed: {_last_line(p)}")
        if time.monotonic() > deadline:
            raise PDError(f"run did not finish within the timeout ({[n for n, p in procs if p.poll() is None]} still running)")
        time.sleep(0.02)
    if target.returncode != 0:
        name = next(n for n, p in procs if p is target)
        raise PDError(f"{name} failed: {_last_line(target)}")


# ---- the children ----------------------------------------------------------------------------------

def _load(spec_path: str):
    from .config import EngineConfig
    from .decode.config import DecodeConfig
    from .workload import WorkloadConfig

    spec = json.loads(Path(spec_path).read_text())
    c = spec["cfg"]
    c["inject"] = frozenset(c["inject"])
    wc = spec["wc"]
    wc["prompt_len"] = tuple(wc["prompt_len"])
    return EngineConfig(**c), WorkloadConfig(**wc), DecodeConfig(**spec["dc"]), spec["dp"], spec["router"]


def prefill_main(a) -> int:
    from . import bootstrap_client as bc
    from . import inject
    from .decode.transport import ZmqKVServer
    from .pd import rank_info, registrar, route
    from .prefill.loops import LOOPS
    from .prefill.scheduler import PrefillScheduler
    from .trace import Tracer
    from .workload import make_workload

    cfg, wc, dc, dp, router = _load(a.spec)
    inject.set_active(cfg.inject)
    reqs = make_workload(wc, cfg.model_config.vocab_size)
    mine = [r for r, k in zip(reqs, route(reqs, dp, router, wc.seed)) if k == a.rank]
    server = ZmqKVServer(a.rank)
    try:
        bc.register_prefill_rank(a.bootstrap, rank_info(a.rank, dp, cfg.page_size, server.port), retries=3,
                                 backoff_s=0.2)
    except bc.BootstrapError as exc:
        server.close()
        raise PDError(f"prefill rank {a.rank} could not register with the bootstrap server: {exc}") from exc
    tr = Tracer({"role": "prefill", "mode": cfg.mode, "page_size": cfg.page_size, "model": cfg.model, "seed": cfg.seed,
                 "workload_seed": wc.seed, "inject": sorted(cfg.inject), "dp_size": dp, "dp_rank": a.rank})
    errors: list[str] = []
    sched = PrefillScheduler(cfg, mine, tracer=tr, receiver=server, on_ingest=registrar(a.bootstrap, a.rank, errors, dp))
    threading.current_thread().name = "scheduler"
    try:
        with frozen_gc(cfg.freeze_gc):
            LOOPS[cfg.mode](sched)
    finally:
        sched.close()
    # Stay until decode has pulled every room (or said goodbye): the KV lives here until then.
    rooms = [r.bootstrap_room for r in mine]
    deadline = time.monotonic() + dc.kv_timeout_s + 30
    while not server.settled(rooms) and not server.byes and time.monotonic() < deadline:
        time.sleep(0.01)
    out = Path(a.out)
    tr.write(str(out / f"prefill{a.rank}.jsonl"))
    (out / f"prefill{a.rank}.json").write_text(json.dumps({
        "leaks": sched.leak_report(), "unclaimed": server.unclaimed(), "registration_errors": errors}))
    server.close()
    return 0


def decode_main(a) -> int:
    from . import bootstrap_client as bc
    from . import inject
    from .decode.loops import LOOPS
    from .decode.scheduler import DecodeScheduler
    from .decode.transport import KVTransportError, ZmqKVClient
    from .pd import decode_requests, summarize
    from .trace import Tracer
    from .workload import make_workload

    cfg, wc, dc, dp, router = _load(a.spec)
    inject.set_active(cfg.inject)
    reqs = make_workload(wc, cfg.model_config.vocab_size)
    addr = bc.base_url(a.bootstrap).split("://", 1)[1]
    client = ZmqKVClient(a.bootstrap, timeout_s=dc.query_timeout_s)
    tr = Tracer({"role": "decode", "mode": dc.loop, "prefill_mode": cfg.mode, "page_size": cfg.page_size,
                 "model": cfg.model, "seed": cfg.seed, "workload_seed": wc.seed, "inject": sorted(cfg.inject),
                 "dp_size": dp, "prefetch": dc.prefetch, "polling_interval": dc.polling_interval})
    sched = DecodeScheduler(cfg, dc, decode_requests(reqs, addr), client=client, tracer=tr)
    threading.current_thread().name = "scheduler"
    t0 = time.monotonic()
    try:
        with frozen_gc(cfg.freeze_gc):
            LOOPS[dc.loop](sched)
    finally:
        wall = time.monotonic() - t0
        for rank in range(dp):
            try:
                client.bye(rank)
            except KVTransportError:
                pass
        sched.close()
        time.sleep(0.05)  # let the byes leave before the sockets close
        client.close()
    out = Path(a.out)
    tr.write(str(out / "decode.jsonl"))
    (out / "decode.json").write_text(json.dumps(summarize(sched, wall)))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.launch", description="a child process of `pdo launch`")
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--spec", required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, default=0)
    a = p.parse_args(argv)
    try:
        import torch
        torch.set_num_threads(1)  # a role process runs several threads already (see engine/reference.py)
        return (prefill_main if a.role == "prefill" else decode_main)(a)
    except Exception as exc:  # one line on stderr; the parent reports it
        print(f"{a.role}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
