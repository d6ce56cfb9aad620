"""`pdo launch`: the bootstrap server, N prefill DP ranks and one decode instance as separate
processes on loopback, KV over ZMQ (engine/kv/transport.py), each process writing its own trace.

The parent writes one spec file (every config), starts `pdo bootstrap --port 0` and reads its URL,
starts the ranks (`python -m engine.runs.pd_process prefill ...`, engine/runs/pd_process.py) and the decode
(`... decode ...`), waits, then compares the decode's outputs with the single-process reference.
Every process rebuilds the seeded workload and the seeded router, so they agree on which rank
serves which room without a router process. A child that dies (or fails) is a fault, not the end of
the run: the others go on (the decode aborts what the dead rank held, docs/faults.md), every survivor
writes its trace and summary, and the summary names the fault. None is left running.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checker.trace_log import materialize
from engine.bootstrap import client as bootstrap_client
from engine.cli.flags import add_engine_args, add_flight_args, exit_on_sigterm
from engine.cli.pd import add_pd_args, pd_spec, print_summary
from engine.decode.config import PDError
from engine.runs.child_process import Child, spawn, stop
from engine.runs.spec import Kill, RunSpec
from engine.runtime.config import check_dispatch
from spec import domains as d
from spec import tracelog
from spec.errors import BadInput

REPO = Path(__file__).resolve().parents[2]
_LISTENING = "listening on "  # the line `pdo bootstrap` prints once it serves (its URL)


def register(sub) -> None:
    p = sub.add_parser(
        "launch", help="run bootstrap, N prefill ranks and a decode as processes (KV over ZMQ)"
    )
    add_engine_args(p)
    add_pd_args(p, launch=True)
    p.add_argument(
        "--trace-dir",
        type=d.path(),
        metavar="DIR",
        help="write each process's trace and summary here "
        "(default: a temporary directory, removed)",
    )
    p.add_argument(
        "--timeout-s",
        type=d.number(0, 86400, above=True),
        default=120.0,
        help="give up (and stop every process) after this",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_flight_args(p)
    p.set_defaults(fn=cmd_launch, validate=lambda args, _argv: pd_spec(args))


def cmd_launch(args: argparse.Namespace) -> int:
    spec = pd_spec(args)
    exit_on_sigterm()  # through _run_processes' cleanup: no child outlives the launcher
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        s = launch(spec, out_dir=args.trace_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="pdo-launch-") as tmp:
            s = launch(spec, out_dir=tmp)
            s["traces"] = []
    return print_summary(s, args.json, "pdo launch")


def _traces(paths: list[Path]) -> list[str]:
    """Each role's trace: a role killed before it closed its trace left only its binary log, whose
    JSON Lines are made now (truncated, checker/trace_log.py)."""
    logs = [p for p in paths if p.exists() or Path(str(p) + tracelog.SUFFIX).exists()]
    return [materialize(str(p)) for p in logs]


def launch(spec: RunSpec, *, out_dir: str) -> dict:
    """Run every role of `spec` as a process; returns the decode's summary extended like
    run_pd's, with `faults` (each process that died or failed)."""
    cfg, dc, dp = spec.engine, spec.decode, spec.dp
    check_dispatch(cfg)
    out = Path(out_dir)
    (out / "spec.json").write_bytes(spec.to_json())
    t0 = time.monotonic()
    faults = _run_processes(spec, out, t0 + spec.timeout_s)
    wall = time.monotonic() - t0
    s = _read(out / "decode.json") or _lost_decode(spec.workload.requests)
    pre = [_read(out / f"prefill{i}.json") or {} for i in range(dp)]
    s.update(
        dp=dp,
        prefill_mode=cfg.mode,
        decode_mode=dc.loop,
        prefetch=dc.prefetch,
        launch_wall_s=wall,
        prefill_leaks=[p.get("leaks", {}) for p in pre],
        unclaimed_rooms=sorted(r for p in pre for r in p.get("unclaimed", [])),
        registration_errors=[e for p in pre for e in p.get("registration_errors", [])],
        traces=_traces([out / "decode.jsonl", *(out / f"prefill{i}.jsonl" for i in range(dp))]),
        faults=faults,
        decode_lost_by=[i for i, p in enumerate(pre) if p.get("decode_lost")],
    )
    if spec.verify:
        from engine.oracle.reference import reference_generate  # lazy: start-up time (torch)
        from engine.runs.workload import make_workload  # lazy: start-up time (torch)

        reqs = {r.rid: r for r in make_workload(spec.workload, cfg.model_config.vocab_size)}
        ref = reference_generate(cfg, [reqs[rid] for rid in s["outputs"]])
        s["mismatches"] = sorted(rid for rid, toks in s["outputs"].items() if ref[rid] != toks)
    return s


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _lost_decode(n: int) -> dict:
    """The summary of a decode that died before writing its own: nothing is known finished."""
    return {
        "requests": n,
        "finished": 0,
        "outputs": {},
        "aborted": {},
        "wall_s": 0.0,
        "decode_tok_per_s": 0.0,
        "resolve": {
            "count": 0,
            "by_source": {},
            "errors": 0,
            "mean_wait_ms": 0.0,
            "p99_wait_ms": 0.0,
            "mean_lead_ms": 0.0,
        },
        "decode_leaks": {},
        "failed_ranks": [],
    }


def _run_processes(spec: RunSpec, out: Path, deadline: float) -> list[dict]:
    """Start the bootstrap server, the prefill ranks and the decode, each writing its output into
    `out`/ROLE.log (engine/runs/child_process.py); wait for them all (a child that dies does not stop the
    others); leave none running. Returns the faults: each child that ended with a non-zero status
    before the run was over, the bootstrap server included, with its last output line."""
    children: list[Child] = []
    dp, kill = spec.dp, spec.kill
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        boot = spawn(
            "bootstrap",
            [
                sys.executable,
                "-m",
                "engine.cli",
                "bootstrap",
                "--port",
                "0",
                "--latency-ms",
                str(spec.bootstrap_latency_ms),
                "--latency-scope",
                spec.latency_scope,
                "--expected-ranks",
                str(dp),
                # `--kill bootstrap@N` counts the server's answers through its test-only stats route
                *(["--test-routes"] if kill and kill.role == "bootstrap" else []),
            ],
            out,
            env,
        )
        children.append(boot)
        url = _read_url(boot, timeout_s=30.0)
        common = ["--spec", str(out / "spec.json"), "--bootstrap", url, "--out", str(out)]
        for i in range(dp):
            children.append(_child(f"prefill{i}", ["prefill", "--rank", str(i), *common], out, env))
        children.append(_child("decode", ["decode", *common], out, env))
        killer = _bootstrap_killer(boot.proc, url, kill)
        while any(c.proc.poll() is None for c in children if c is not boot):
            if time.monotonic() > deadline:
                running = [c.name for c in children if c.proc.poll() is None]
                raise PDError(f"run did not finish within the timeout ({running} still running)")
            killer()
            time.sleep(0.02)
        boot.proc.poll()  # a server killed from outside: its status, before it is stopped below
        return [
            {"role": c.name, "status": c.proc.returncode, "error": c.last_line(skip=_LISTENING)}
            for c in children
            if c.proc.returncode not in (None, 0)
        ]
    finally:
        stop(children)


def _child(name: str, args: list[str], out: Path, env: dict) -> Child:
    return spawn(name, [sys.executable, "-m", "engine.runs.pd_process", *args], out, env)


def _read_url(boot: Child, *, timeout_s: float) -> str:
    """The server prints one line, 'bootstrap server listening on URL', once it accepts requests."""
    line = boot.wait_for_line(_LISTENING, timeout_s)
    if line is None:
        err = (
            boot.last_line()
            if boot.proc.poll() is not None
            else f"no answer within {timeout_s:g} s"
        )
        raise BadInput(f"bootstrap server did not start: {err}")
    return line.rsplit(" ", 1)[1]


def _bootstrap_killer(boot: subprocess.Popen, url: str, kill: Kill | None):
    """The step of the wait loop that SIGKILLs the bootstrap server once it has answered
    kill.at query_dp_ranks (`--kill bootstrap@N`); nothing for another fault."""
    if not kill or kill.role != "bootstrap":
        return lambda: None

    def step():
        if boot.poll() is not None:
            return
        if kill.at > 0:
            try:
                counters = bootstrap_client.get_stats(url, timeout=1.0)["counters"]
            except bootstrap_client.BootstrapError:
                return
            if counters.get("query_dp_ranks", 0) < kill.at:
                return
        boot.kill()
        boot.wait()

    return step
