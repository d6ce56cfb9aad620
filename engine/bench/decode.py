"""`pdo bench decode`: the DP-rank prefetch (PR #35071) against the synchronous baseline.

For each bootstrap latency, runs with and without the prefetch alternate (on, off, on, off, ...) so
drift on a shared machine hits both alike. Each run is a full embedded PD run (engine/runs/pd.py) against
a fresh `pdo bootstrap` process: the server has its own interpreter, as in a deployment, and no room
registered by an earlier run is known to a later one. Per arm, over all its runs:

  wait   time the decode scheduler is blocked at the consumption point (_resolve_pending_reqs) for
         the DP-rank answer: future.result() (plus the sync tail), or the whole synchronous query;
         mean and p99 over every consumption point that needed an answer
  lead   from the prefetch submit to the consumption point that uses it (prefetched/prefix only)
  tok/s  decode output tokens per second of decode wall time (median over runs)
  errors failed consumption points, aborted requests; `identical` compares every run's tokens with
         the single-process reference
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import tempfile

from engine.bench.record import add_json_arguments, write_json
from engine.bench.registry import BENCH, BenchCommand
from engine.bench.stats import pct
from engine.decode.config import DecodeConfig
from engine.runs.child_process import spawn, stop
from engine.runs.spec import RunSpec
from engine.runtime.config import MODEL_PRESETS, EngineConfig
from spec import domains as d
from spec.errors import BadInput
from spec.vocabulary import DECODE_LOOPS, PREFILL_LOOPS

LATENCIES_MS = (0.5, 2.0, 10.0)
MAX_ARRIVAL_SPAN_S = 3600.0  # as `pdo run --arrival poisson` (engine/cli/flags.py)


def add_decode_arguments(q) -> None:
    context = MODEL_PRESETS["tiny"].max_context  # the model these runs use (EngineConfig's default)
    q.add_argument(
        "--latencies",
        type=d.listed(d.number(0, 60_000)),
        default=",".join(f"{x:g}" for x in LATENCIES_MS),
        help="ms, comma-separated",
    )
    q.add_argument(
        "--reps", type=d.integer(1, 1000), default=2, help="runs per arm and latency (default 2)"
    )
    q.add_argument("--requests", type=d.integer(1, 100_000), default=24)
    q.add_argument("--max-new-tokens", type=d.integer(1, context), default=24)
    q.add_argument(
        "--rate",
        type=d.number(0, 1e9, above=True),
        default=10.0,
        help=f"request arrival rate (Poisson), per second (--requests / --rate at most "
        f"{MAX_ARRIVAL_SPAN_S:g} s)",
    )
    q.add_argument(
        "--prompt-len",
        type=d.span(1, context),
        default="24:160",
        help="MIN:MAX prompt tokens (with --max-new-tokens, within the model's context)",
    )
    q.add_argument(
        "--prefill-launch-cost-us",
        type=d.number(0, 1e6),
        default=200000.0,
        help="prefill host time per layer launch (EngineConfig.launch_cost_us, GIL "
        "released): the default makes a prefill iteration ~0.4 s, a large model's "
        "prefill step",
    )
    q.add_argument("--dp", type=d.integer(1, 32), default=2)
    q.add_argument("--mode", choices=PREFILL_LOOPS, default="normal", help="prefill loop")
    q.add_argument("--decode-mode", choices=DECODE_LOOPS, default="overlap")
    q.add_argument(
        "--polling-interval",
        type=d.integer(1, 1000),
        default=1,
        help="decode polls its prealloc queue every N iterations (SGLang's "
        "--disaggregation-decode-polling-interval)",
    )
    q.add_argument(
        "--recv-wait-us",
        type=d.number(0, 1e7),
        default=17000.0,
        help="decode's wait in request intake per iteration, between the loop top and "
        "the consumption point (default: the design text's measured prefetch lead, "
        "17.35 ms rounded down)",
    )
    q.add_argument("--latency-scope", choices=["all", "query_dp_ranks"], default="all")
    add_json_arguments(q)
    q.set_defaults(validate=validate_decode)


def validate_decode(a, _argv) -> None:
    """What spans the options: a request fits the model, the arrivals end within a bound."""
    context = MODEL_PRESETS["tiny"].max_context
    if a.prompt_len[1] + a.max_new_tokens > context:
        raise BadInput(
            f"--prompt-len {a.prompt_len[1]} + --max-new-tokens {a.max_new_tokens}: more than the "
            f"model's context ({context} tokens)"
        )
    if a.requests / a.rate > MAX_ARRIVAL_SPAN_S:
        raise BadInput(
            f"--rate {a.rate:g}: {a.requests} arrivals would take {a.requests / a.rate:.3g} s on "
            f"average, more than {MAX_ARRIVAL_SPAN_S:g} s"
        )


def cmd_decode(a) -> int:
    lat = [float(x) for x in a.latencies.split(",") if x.strip()]  # domain: spec/domains.py
    res = bench_decode(
        latencies_ms=lat,
        reps=a.reps,
        requests=a.requests,
        max_new_tokens=a.max_new_tokens,
        rate=a.rate,
        prompt_len=a.prompt_len,
        launch_cost_us=a.prefill_launch_cost_us,
        dp=a.dp,
        mode=a.mode,
        decode_mode=a.decode_mode,
        polling_interval=a.polling_interval,
        recv_wait_us=a.recv_wait_us,
        latency_scope=a.latency_scope,
        progress=not a.json,
    )
    if not a.json:
        print(markdown(res))
    write_json(a, res)
    return 0 if res["ok"] else 1


class _Bootstrap:
    """A `pdo bootstrap` process on a free port, for one run; its output goes to a log file in a
    temporary directory (engine/runs/child_process.py), removed with it."""

    def __init__(self, latency_ms: float, scope: str, dp: int):
        self.dir = tempfile.TemporaryDirectory(prefix="pdo-bench-bootstrap-")
        self.child = spawn(
            "bootstrap",
            [
                sys.executable,
                "-m",
                "engine.cli",
                "bootstrap",
                "--port",
                "0",
                "--latency-ms",
                str(latency_ms),
                "--latency-scope",
                scope,
                "--expected-ranks",
                str(dp),
            ],
            self.dir.name,
        )
        line = self.child.wait_for_line("listening on ", 30.0)
        if line is None:
            self.close()
            raise RuntimeError("bootstrap server did not start for the bench")
        self.url = line.rsplit(" ", 1)[1]

    def close(self) -> None:
        stop([self.child])
        self.dir.cleanup()


def _runs_at(
    lat, cfg, wc, *, reps, dp, decode_mode, polling_interval, recv_wait_us, latency_scope, progress
) -> dict:
    """`reps` PD runs per arm at one bootstrap latency, prefetch on and off alternating:
    {True: [summary, ...], False: [...]}."""
    from engine.runs.pd import run_pd  # lazy: imports torch, slow for every pdo start

    arms = {True: [], False: []}
    for rep in range(reps):
        for prefetch in (True, False):
            dc = DecodeConfig(
                loop=decode_mode,
                prefetch=prefetch,
                polling_interval=polling_interval,
                recv_wait_us=recv_wait_us,
            )
            server = _Bootstrap(lat, latency_scope, dp)
            try:
                s = run_pd(RunSpec(cfg, wc, dc, dp=dp, bootstrap_url=server.url)).summary
            finally:
                server.close()
            arms[prefetch].append(s)
            if progress:
                r = s["resolve"]
                print(
                    f"  {lat:g} ms prefetch={'on ' if prefetch else 'off'} rep {rep + 1}/{reps}: "
                    f"wait {r['mean_wait_ms']:.3f} ms over {r['count']} {r['by_source']}",
                    file=sys.stderr,
                )
    return arms


def bench_decode(
    *,
    latencies_ms=LATENCIES_MS,
    reps=2,
    requests=24,
    max_new_tokens=24,
    rate=10.0,
    prompt_len=(24, 160),
    launch_cost_us=200000.0,
    dp=2,
    mode="normal",
    decode_mode="overlap",
    polling_interval=1,
    recv_wait_us=17000.0,
    latency_scope="all",
    progress=False,
) -> dict:
    from engine.runs.spec import WorkloadConfig  # lazy: imports torch, slow for every pdo start

    cfg = EngineConfig(mode=mode, launch_cost_us=launch_cost_us)
    wc = WorkloadConfig(
        requests=requests,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        arrival="poisson",
        rate=rate,
        seed=1,
    )
    rows = []
    for lat in latencies_ms:
        arms = _runs_at(
            lat,
            cfg,
            wc,
            reps=reps,
            dp=dp,
            decode_mode=decode_mode,
            polling_interval=polling_interval,
            recv_wait_us=recv_wait_us,
            latency_scope=latency_scope,
            progress=progress,
        )
        rows.append(
            {"latency_ms": lat, "prefetch": _arm(arms[True]), "no_prefetch": _arm(arms[False])}
        )
    for row in rows:
        on, off = row["prefetch"], row["no_prefetch"]
        row["wait_cut"] = (
            off["mean_wait_ms"] / on["mean_wait_ms"] if on["mean_wait_ms"] > 0 else float("inf")
        )
    ok = all(
        a["errors"] == 0 and a["aborted"] == 0 and a["identical"]
        for r in rows
        for a in (r["prefetch"], r["no_prefetch"])
    )
    config = {
        "requests": requests,
        "max_new_tokens": max_new_tokens,
        "rate": rate,
        "prompt_len": list(prompt_len),
        "prefill_launch_cost_us": launch_cost_us,
        "dp": dp,
        "prefill_mode": mode,
        "decode_mode": decode_mode,
        "polling_interval": polling_interval,
        "recv_wait_us": recv_wait_us,
        "latency_scope": latency_scope,
        "reps": reps,
    }
    return {
        "bench": "decode",
        "date": datetime.date.today().isoformat(),
        "host": platform.node(),
        "cpus": _cpus(),
        "config": config,
        "rows": rows,
        "ok": ok,
    }


def _arm(runs: list) -> dict:
    samples = [x for s in runs for x in s["resolve"]["samples"]]
    waits = sorted(x["wait_ms"] for x in samples)
    leads = [x["lead_ms"] for x in samples if x["source"] != "sync"]
    by_source: dict = {}
    for x in samples:
        by_source[x["source"]] = by_source.get(x["source"], 0) + 1
    return {
        "consumption_points": len(samples),
        "by_source": by_source,
        "mean_wait_ms": statistics.fmean(waits) if waits else 0.0,
        "p99_wait_ms": pct(waits, 99) if waits else 0.0,
        "mean_lead_ms": statistics.fmean(leads) if leads else 0.0,
        "decode_tok_per_s": statistics.median(s["decode_tok_per_s"] for s in runs),
        "errors": sum(s["resolve"]["errors"] for s in runs),
        "aborted": sum(len(s["aborted"]) for s in runs),
        "identical": all(s["mismatches"] == [] for s in runs),
        "leaks": any(any(s["decode_leaks"].values()) for s in runs),
    }


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def markdown(res: dict) -> str:
    c = res["config"]
    host_ms = 2 * c["prefill_launch_cost_us"] / 1e3
    lines = [
        f"pdo bench decode — {res['date']}, {res['cpus']} CPUs; {c['requests']} requests "
        f"(Poisson {c['rate']:g}/s, prompts {c['prompt_len'][0]}-{c['prompt_len'][1]} "
        f"tokens), {c['max_new_tokens']} new tokens each; {c['dp']} prefill DP ranks "
        f"({c['prefill_mode']}, host path {host_ms:g} ms per iteration); decode "
        f"{c['decode_mode']}, polling interval {c['polling_interval']}, intake wait "
        f"{c['recv_wait_us'] / 1e3:g} ms; latency scope {c['latency_scope']}; {c['reps']} "
        f"runs per arm",
        "",
        "| bootstrap latency | arm | consumption points | wait mean (ms) | wait p99 (ms) "
        "| lead mean (ms) | decode tok/s | errors | outputs |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in res["rows"]:
        for name, key in (("prefetch", "prefetch"), ("--no-prefetch", "no_prefetch")):
            a = row[key]
            lines.append(
                f"| {row['latency_ms']:g} ms | {name} | {a['consumption_points']} | "
                f"{a['mean_wait_ms']:.3f} | {a['p99_wait_ms']:.3f} | "
                f"{a['mean_lead_ms']:.3f} | {a['decode_tok_per_s']:.0f} | "
                f"{a['errors'] + a['aborted']} | "
                f"{'identical' if a['identical'] else 'MISMATCH'} |"
            )
        lines.append(f"| | **wait cut** | | **{row['wait_cut']:.1f}×** | | | | | |")
    return "\n".join(lines)


BENCH.register("decode")(
    BenchCommand(
        help="decode DP-rank prefetch vs --no-prefetch at 0.5/2/10 ms bootstrap latency",
        add_arguments=add_decode_arguments,
        run=cmd_decode,
    )
)
