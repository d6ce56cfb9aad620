"""Command-line pieces shared by `pdo run --pd`, `pdo launch` and `pdo bench decode`: flags, configs
from flags, the summary printout. Imports nothing heavy, so every `pdo` command stays fast to start."""
from __future__ import annotations

import json

from .config import DECODE_LOOPS, ROUTERS, DecodeConfig


def add_pd_args(p, *, launch: bool = False) -> None:
    g = p.add_argument_group("PD disaggregation")
    if not launch:
        g.add_argument("--pd", action="store_true",
                       help="run prefill DP ranks, a decode instance and the bootstrap server in this process")
        g.add_argument("--bootstrap-url", metavar="URL",
                       help="use this bootstrap server (pdo bootstrap) instead of starting one in process")
    g.add_argument("--dp", type=int, default=1, help="prefill DP ranks")
    g.add_argument("--router", choices=ROUTERS, default="round_robin", help="request → DP rank (seeded)")
    g.add_argument("--decode-mode", choices=DECODE_LOOPS, default="overlap", help="decode event loop")
    g.add_argument("--no-prefetch", action="store_true",
                   help="query DP ranks only at the consumption point (the synchronous baseline)")
    g.add_argument("--bootstrap-latency-ms", type=float, default=0.0, help="delay the bootstrap server adds")
    g.add_argument("--bootstrap-latency-scope", choices=["all", "query_dp_ranks"], default="all")
    g.add_argument("--decode-polling-interval", type=int, default=1,
                   help="poll the prealloc/transfer queues every N iterations (SGLang's "
                        "--disaggregation-decode-polling-interval)")
    g.add_argument("--decode-recv-wait-us", type=float, default=0.0,
                   help="decode's wait in request intake per iteration (models recv_requests' TP broadcast)")
    g.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per request")
    g.add_argument("--no-verify", action="store_true", help="skip the comparison with the single-process reference")


def configs_from_args(a):
    if a.dp < 1:
        raise ValueError(f"--dp must be >= 1, got {a.dp}")
    if a.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.bootstrap_latency_ms < 0:
        raise ValueError(f"--bootstrap-latency-ms must be >= 0, got {a.bootstrap_latency_ms}")
    from ..cli import build_configs

    cfg, wc = build_configs(a)
    wc.max_new_tokens = a.max_new_tokens
    dc = DecodeConfig(loop=a.decode_mode, prefetch=not a.no_prefetch, polling_interval=a.decode_polling_interval,
                      recv_wait_us=a.decode_recv_wait_us, max_running=min(16, cfg.max_batch_reqs))
    opts = dict(dp=a.dp, router=a.router, bootstrap_latency_ms=a.bootstrap_latency_ms,
                latency_scope=a.bootstrap_latency_scope, verify=not a.no_verify)
    if getattr(a, "bootstrap_url", None):
        opts["bootstrap_url"] = a.bootstrap_url
    return cfg, wc, dc, opts


def cmd_run_pd(a) -> int:
    cfg, wc, dc, opts = configs_from_args(a)  # bad flags fail here, before torch is imported
    from ..pd import run_pd

    return print_summary(run_pd(cfg, wc, dc, trace_path=a.trace, **opts), a.json, "pdo run --pd")


def summary_ok(s: dict) -> bool:
    return not (s.get("mismatches") or s["aborted"] or any(s["decode_leaks"].values())
                or any(any(v.values()) for v in s["prefill_leaks"]))


def print_summary(s: dict, as_json: bool, prog: str) -> int:
    code = 0 if summary_ok(s) else 1
    if as_json:
        print(json.dumps(s))
        return code
    r = s["resolve"]
    print(f"{prog}: dp={s['dp']} prefill={s['prefill_mode']} decode={s['decode_mode']} "
          f"prefetch={'on' if s['prefetch'] else 'off'} requests={s['finished']}/{s['requests']} "
          f"aborted={len(s['aborted'])} wall {s['wall_s'] * 1e3:.0f} ms, decode {s['decode_tok_per_s']:.0f} tok/s")
    print(f"  DP-rank queries at the consumption point: {r['count']} {r['by_source']}, wait mean "
          f"{r['mean_wait_ms']:.3f} ms p99 {r['p99_wait_ms']:.3f} ms, prefetch lead {r['mean_lead_ms']:.3f} ms, "
          f"errors {r['errors']}")
    if "mismatches" in s:
        print("  outputs vs single-process reference: "
              + ("identical" if not s["mismatches"] else f"MISMATCH for {', '.join(s['mismatches'])}"))
    for rid, err in list(s["aborted"].items())[:5]:
        print(f"  aborted {rid}: {err}")
    leaks = {"decode": s["decode_leaks"], **{f"prefill{i}": v for i, v in enumerate(s["prefill_leaks"])}}
    held = {k: {n: x for n, x in v.items() if x} for k, v in leaks.items()}
    print("  leaks: " + ("none" if not any(held.values()) else json.dumps({k: v for k, v in held.items() if v}))
          + (f"; traces: {' '.join(s['traces'])}" if s.get("traces") else ""))
    return code
