"""`pdo launch`: the bootstrap server, N prefill DP ranks and one decode instance as separate
processes on loopback, KV over ZMQ (engine/decode/transport.py), each process writing its own trace.

The parent writes one spec file (every config), starts `pdo bootstrap --port 0` and reads its URL,
starts the ranks (`python -m engine.pd_process prefill ...`, engine/pd_process.py) and the decode
(`... decode ...`), waits, then compares the decode's outputs with the single-process reference.
Every process rebuilds the seeded workload and the seeded router, so they agree on which rank
serves which room without a router process. A child that fails ends the run with its one-line
error; none is left running.
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

from spec.errors import BadInput

from ..config import check_dispatch
from ..decode.config import ROUTERS, PDError
from .flags import add_engine_args, add_flight_args, watchdog_of
from .pd import add_pd_args, configs_from_args, print_summary

REPO = Path(__file__).resolve().parents[2]


def register(sub) -> None:
    p = sub.add_parser(
        "launch", help="run bootstrap, N prefill ranks and a decode as processes (KV over ZMQ)"
    )
    add_engine_args(p)
    add_pd_args(p, launch=True)
    p.add_argument(
        "--trace-dir",
        metavar="DIR",
        help="write each process's trace and summary here "
        "(default: a temporary directory, removed)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=120.0, help="give up (and stop every process) after this"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_flight_args(p)
    p.set_defaults(fn=cmd_launch)


def cmd_launch(args: argparse.Namespace) -> int:
    cfg, workload, decode, opts = configs_from_args(args)
    opts["flight"] = {"watchdog": watchdog_of(args), "flush_ms": args.trace_flush_ms}
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        s = launch(cfg, workload, decode, out_dir=args.trace_dir, timeout_s=args.timeout_s, **opts)
    else:
        with tempfile.TemporaryDirectory(prefix="pdo-launch-") as tmp:
            s = launch(cfg, workload, decode, out_dir=tmp, timeout_s=args.timeout_s, **opts)
            s["traces"] = []
    return print_summary(s, args.json, "pdo launch")


def launch(
    cfg,
    wc,
    dc,
    *,
    out_dir: str,
    dp: int = 1,
    router: str = "round_robin",
    bootstrap_latency_ms: float = 0.0,
    latency_scope: str = "all",
    timeout_s: float = 120.0,
    verify: bool = True,
    flight: dict | None = None,
) -> dict:
    """Run every role as a process; returns the decode's summary extended like run_pd's.
    `flight`: each role's watchdog (engine/watchdog.py keyword arguments, or None) and trace flush
    interval (ms, or None for the default)."""
    check_dispatch(cfg)
    if dp < 1 or router not in ROUTERS:  # before anything starts (no torch in the parent yet)
        raise BadInput(f"need --dp >= 1 and a router in {ROUTERS}, got dp={dp}, router={router!r}")
    out = Path(out_dir)
    spec = out / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "cfg": {**asdict(cfg), "inject": sorted(cfg.inject)},
                "wc": asdict(wc),
                "dc": asdict(dc),
                "dp": dp,
                "router": router,
                "flight": flight or {},
            }
        )
    )
    t0 = time.monotonic()
    _run_processes(spec, out, dp, bootstrap_latency_ms, latency_scope, t0 + timeout_s)
    wall = time.monotonic() - t0
    s = json.loads((out / "decode.json").read_text())
    pre = [json.loads((out / f"prefill{i}.json").read_text()) for i in range(dp)]
    s.update(
        dp=dp,
        prefill_mode=cfg.mode,
        decode_mode=dc.loop,
        prefetch=dc.prefetch,
        launch_wall_s=wall,
        prefill_leaks=[p["leaks"] for p in pre],
        unclaimed_rooms=sorted(r for p in pre for r in p["unclaimed"]),
        registration_errors=[e for p in pre for e in p["registration_errors"]],
        traces=[str(out / "decode.jsonl")] + [str(out / f"prefill{i}.jsonl") for i in range(dp)],
    )
    if verify:
        from ..reference import reference_generate  # lazy: start-up time (torch)
        from ..workload import make_workload  # lazy: start-up time (torch)

        reqs = {r.rid: r for r in make_workload(wc, cfg.model_config.vocab_size)}
        ref = reference_generate(cfg, [reqs[rid] for rid in s["outputs"]])
        s["mismatches"] = sorted(rid for rid, toks in s["outputs"].items() if ref[rid] != toks)
    return s


def _run_processes(
    spec: Path, out: Path, dp: int, bootstrap_latency_ms: float, latency_scope: str, deadline: float
) -> None:
    """Start the bootstrap server, the prefill ranks and the decode; wait for them all; leave none
    running."""
    procs: list[tuple[str, subprocess.Popen]] = []
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        boot = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine.cli",
                "bootstrap",
                "--port",
                "0",
                "--latency-ms",
                str(bootstrap_latency_ms),
                "--latency-scope",
                latency_scope,
                "--expected-ranks",
                str(dp),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        procs.append(("bootstrap", boot))
        url = _read_url(boot, timeout_s=30.0)
        common = ["--spec", str(spec), "--bootstrap", url, "--out", str(out)]
        for i in range(dp):
            procs.append((f"prefill{i}", _child(["prefill", "--rank", str(i), *common], env)))
        decode = _child(["decode", *common], env)
        procs.append(("decode", decode))
        _wait(procs, decode, deadline)
        for name, p in procs:
            if name.startswith("prefill"):
                _wait(procs, p, deadline)
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.terminate()
        for _, p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()


def _child(args, env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "engine.pd_process", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _read_url(boot: subprocess.Popen, *, timeout_s: float) -> str:
    """The server prints one line, 'bootstrap server listening on URL', once it accepts requests."""
    box = {}
    reader = threading.Thread(
        target=lambda: box.setdefault("line", boot.stdout.readline()), daemon=True
    )
    reader.start()
    reader.join(timeout_s)
    line = box.get("line", "")
    if "listening on " not in line:
        try:
            boot.wait(timeout=2)  # stdout closed: it is exiting, its error is on stderr
            err = _last_line(boot)
        except subprocess.TimeoutExpired:
            err = f"no answer within {timeout_s:g} s"
        raise BadInput(f"bootstrap server did not start: {err}")
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
            running = [n for n, p in procs if p.poll() is None]
            raise PDError(f"run did not finish within the timeout ({running} still running)")
        time.sleep(0.02)
    if target.returncode != 0:
        name = next(n for n, p in procs if p is target)
        raise PDError(f"{name} failed: {_last_line(target)}")
