"""The PD flags and summary shared by `pdo run --pd`, `pdo launch` and `pdo bench decode`: flags,
configs from flags, the summary printout. Imports nothing heavy, so every `pdo` command stays fast
to start."""

from __future__ import annotations

import argparse
import json

from spec.errors import BadInput

from ..decode.config import DECODE_LOOPS, ROUTERS, DecodeConfig
from .flags import build_configs


def add_pd_args(p: argparse.ArgumentParser, *, launch: bool = False) -> None:
    g = p.add_argument_group("PD disaggregation")
    if not launch:
        g.add_argument(
            "--pd",
            action="store_true",
            help="run prefill DP ranks, a decode instance and the bootstrap server in this process",
        )
        g.add_argument(
            "--bootstrap-url",
            metavar="URL",
            help="use this bootstrap server (pdo bootstrap) instead of starting one in process",
        )
    g.add_argument("--dp", type=int, default=1, help="prefill DP ranks")
    g.add_argument(
        "--router", choices=ROUTERS, default="round_robin", help="request → DP rank (seeded)"
    )
    g.add_argument(
        "--decode-mode", choices=DECODE_LOOPS, default="overlap", help="decode event loop"
    )
    g.add_argument(
        "--no-prefetch",
        action="store_true",
        help="query DP ranks only at the consumption point (the synchronous baseline)",
    )
    g.add_argument(
        "--bootstrap-latency-ms", type=float, default=0.0, help="delay the bootstrap server adds"
    )
    g.add_argument("--bootstrap-latency-scope", choices=["all", "query_dp_ranks"], default="all")
    g.add_argument(
        "--decode-polling-interval",
        type=int,
        default=1,
        help="poll the prealloc/transfer queues every N iterations (SGLang's "
        "--disaggregation-decode-polling-interval)",
    )
    g.add_argument(
        "--decode-recv-wait-us",
        type=float,
        default=0.0,
        help="decode's wait in request intake per iteration (models recv_requests' TP broadcast)",
    )
    g.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per request")
    if launch:  # `pdo run` has its own, for both of its runs (engine/cli/run.py)
        add_no_verify(g)


def add_no_verify(g) -> None:
    g.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the comparison of the outputs with the single-process reference",
    )


def configs_from_args(args: argparse.Namespace):
    """(EngineConfig, WorkloadConfig, DecodeConfig, run_pd's keyword options) from the flags."""
    if args.dp < 1:
        raise BadInput(f"--dp must be >= 1, got {args.dp}")
    if args.max_new_tokens < 1:
        raise BadInput(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.bootstrap_latency_ms < 0:
        raise BadInput(f"--bootstrap-latency-ms must be >= 0, got {args.bootstrap_latency_ms}")
    cfg, workload = build_configs(args)
    workload.max_new_tokens = args.max_new_tokens
    decode = DecodeConfig(
        loop=args.decode_mode,
        prefetch=not args.no_prefetch,
        polling_interval=args.decode_polling_interval,
        recv_wait_us=args.decode_recv_wait_us,
        max_running=min(16, cfg.max_batch_reqs),
    )
    opts = dict(
        dp=args.dp,
        router=args.router,
        bootstrap_latency_ms=args.bootstrap_latency_ms,
        latency_scope=args.bootstrap_latency_scope,
        verify=not args.no_verify,
    )
    if getattr(args, "bootstrap_url", None):
        opts["bootstrap_url"] = args.bootstrap_url
    return cfg, workload, decode, opts


def cmd_run_pd(args: argparse.Namespace) -> int:
    cfg, workload, decode, opts = configs_from_args(args)  # bad flags fail here, before torch
    from ..pd import run_pd  # lazy: start-up time (torch)

    summary = run_pd(cfg, workload, decode, trace_path=args.trace, **opts)
    return print_summary(summary, args.json, "pdo run --pd")


def summary_ok(s: dict) -> bool:
    return not (
        s.get("mismatches")
        or s["aborted"]
        or any(s["decode_leaks"].values())
        or any(any(v.values()) for v in s["prefill_leaks"])
    )


def print_summary(s: dict, as_json: bool, prog: str) -> int:
    code = 0 if summary_ok(s) else 1
    if as_json:
        print(json.dumps(s))
        return code
    resolve = s["resolve"]
    print(
        f"{prog}: dp={s['dp']} prefill={s['prefill_mode']} decode={s['decode_mode']} "
        f"prefetch={'on' if s['prefetch'] else 'off'} requests={s['finished']}/{s['requests']} "
        f"aborted={len(s['aborted'])} wall {s['wall_s'] * 1e3:.0f} ms, "
        f"decode {s['decode_tok_per_s']:.0f} tok/s"
    )
    print(
        f"  DP-rank queries at the consumption point: {resolve['count']} {resolve['by_source']}, "
        f"wait mean {resolve['mean_wait_ms']:.3f} ms p99 {resolve['p99_wait_ms']:.3f} ms, "
        f"prefetch lead {resolve['mean_lead_ms']:.3f} ms, errors {resolve['errors']}"
    )
    if "mismatches" in s:
        print(
            "  outputs vs single-process reference: "
            + ("identical" if not s["mismatches"] else f"MISMATCH for {', '.join(s['mismatches'])}")
        )
    mem = s.get("prefill_memory") or []
    print(
        f"  memory: prefill evicted {sum(m['evicted_pages'] for m in mem)} page(s), "
        f"failed allocations {sum(m['failed_allocs'] for m in mem)}, "
        f"postponed chunks {sum(m['postponed_chunks'] for m in mem)}; "
        f"decode waits for memory {s.get('decode_memory_waits', 0)}"
    )
    for rid, err in list(s["aborted"].items())[:5]:
        print(f"  aborted {rid}: {err}")
    leaks = {
        "decode": s["decode_leaks"],
        **{f"prefill{i}": v for i, v in enumerate(s["prefill_leaks"])},
    }
    held = {role: {name: n for name, n in counts.items() if n} for role, counts in leaks.items()}
    print(
        "  leaks: "
        + (
            "none"
            if not any(held.values())
            else json.dumps({role: counts for role, counts in held.items() if counts})
        )
        + (f"; traces: {' '.join(s['traces'])}" if s.get("traces") else "")
    )
    return code
