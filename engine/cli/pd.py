"""The PD flags and summary shared by `pdo run --pd`, `pdo launch` and `pdo bench decode`: flags,
configs from flags, the summary printout. Imports nothing heavy, so every `pdo` command stays fast
to start."""

from __future__ import annotations

import argparse
import json

from engine.cli.exits import FAILED, OK
from engine.cli.flags import MAX_CONTEXT, build_spec, exit_on_sigterm
from engine.decode.config import ROUTERS, DecodeConfig
from engine.runs.spec import Kill, RunSpec
from spec import domains as d
from spec.errors import BadInput
from spec.vocabulary import DECODE_LOOPS

MAX_DP = 32  # prefill DP ranks (`pdo launch` starts a process for each)
SECONDS = d.number(0, 86400, above=True)  # a timeout: more than 0, at most a day
LATENCY_MS = d.number(0, 60_000)

# The run flags that open the window a prefetch can serve (docs/decode.md, "When the prefetch
# serves"): requests that arrive while decode is busy, an intake wait between the loop top and the
# consumption point, and a bootstrap round trip worth hiding, as `pdo bench decode` models them.
PRODUCTION_WINDOW_FLAGS = (
    "--arrival poisson --rate 10 --decode-recv-wait-us 17000 --bootstrap-latency-ms 2"
)


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
            type=d.url(),
            metavar="URL",
            help="use this bootstrap server (pdo bootstrap) instead of starting one in process",
        )
    g.add_argument("--dp", type=d.integer(1, MAX_DP), default=1, help="prefill DP ranks")
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
        "--bootstrap-latency-ms",
        type=LATENCY_MS,
        default=0.0,
        help="delay the bootstrap server adds",
    )
    g.add_argument("--bootstrap-latency-scope", choices=["all", "query_dp_ranks"], default="all")
    g.add_argument(
        "--decode-polling-interval",
        type=d.integer(1, 1000),
        default=1,
        help="poll the prealloc/transfer queues every N iterations (SGLang's "
        "--disaggregation-decode-polling-interval)",
    )
    g.add_argument(
        "--decode-recv-wait-us",
        type=d.number(0, 1e7),
        default=0.0,
        help="decode's wait in request intake per iteration (models recv_requests' TP broadcast)",
    )
    g.add_argument(
        "--max-new-tokens",
        type=d.integer(1, MAX_CONTEXT),
        default=8,
        help="tokens generated per request",
    )
    g.add_argument(
        "--decode-bootstrap-timeout-s",
        type=SECONDS,
        default=DecodeConfig.bootstrap_timeout_s,
        help="abort a request whose room the bootstrap server still does not know after this "
        "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
    )
    g.add_argument(
        "--decode-kv-timeout-s",
        type=SECONDS,
        default=DecodeConfig.kv_timeout_s,
        help="abort a request whose KV is still incomplete this long after its receiver init",
    )
    g.add_argument(
        "--kill",
        type=KILL,
        metavar="ROLE@N",
        help="fault: kill one role at a moment: prefillI@N once rank I sent N KV chunks (0: right "
        "after it registered)"
        + (
            "; decode@N at decode iteration N; bootstrap@N once the server answered N "
            "query_dp_ranks (SIGKILL)"
            if launch
            else ""
        )
        + " (docs/faults.md)",
    )
    if launch:  # `pdo run` has its own, for both of its runs (engine/cli/run.py)
        add_no_verify(g)


def add_no_verify(g) -> None:
    g.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the comparison of the outputs with the single-process reference",
    )


def _kill_text(text: str) -> str:
    role, sep, at = text.partition("@")
    if not sep or not (role in ("bootstrap", "decode") or role.startswith("prefill")):
        raise ValueError(text)
    if role.startswith("prefill") and not role[len("prefill") :].isdigit():
        raise ValueError(text)
    d.integer(0, 1_000_000_000)(at)
    return text


# Its form here; which roles exist (prefill0..dp-1, and bootstrap and decode under `pdo launch`)
# parse_kill checks once --dp is known.
KILL = d.Domain("ROLE@N (prefillI, decode or bootstrap; N in [0, 1e9])", _kill_text)


def parse_kill(text: str | None, dp: int, *, launch: bool) -> Kill | None:
    """`--kill ROLE@N` as Kill(ROLE, N); BadInput naming the flag otherwise. In one process
    (`pdo run --pd`) only a prefill rank can be killed."""
    if not text:
        return None
    role, _, at = text.partition("@")
    roles = [*(["bootstrap", "decode"] if launch else []), *(f"prefill{i}" for i in range(dp))]
    if role not in roles or not at.isdigit():
        raise BadInput(
            f"--kill {text}: this run's roles are {', '.join(roles)} (--dp {dp})"
            + ("" if launch else "; pdo launch kills decode and bootstrap too")
        )
    return Kill(role, int(at))


def pd_spec(args: argparse.Namespace) -> RunSpec:
    """The PD run of the flags; BadInput for flags that do not go together. Each flag's own
    domain was checked as it was parsed (spec/domains.py)."""
    spec = build_spec(args, max_new_tokens=args.max_new_tokens)
    spec.decode = DecodeConfig(
        loop=args.decode_mode,
        prefetch=not args.no_prefetch,
        polling_interval=args.decode_polling_interval,
        recv_wait_us=args.decode_recv_wait_us,
        max_running=min(16, spec.engine.max_batch_reqs),
        bootstrap_timeout_s=args.decode_bootstrap_timeout_s,
        kv_timeout_s=args.decode_kv_timeout_s,
    )
    spec.dp, spec.router = args.dp, args.router
    spec.bootstrap_latency_ms = args.bootstrap_latency_ms
    spec.latency_scope = args.bootstrap_latency_scope
    spec.kill = parse_kill(args.kill, args.dp, launch=not hasattr(args, "pd"))
    spec.bootstrap_url = getattr(args, "bootstrap_url", None)
    spec.timeout_s = getattr(args, "timeout_s", spec.timeout_s)
    return spec


def cmd_run_pd(args: argparse.Namespace) -> int:
    spec = pd_spec(args)  # bad flags fail here, before torch
    exit_on_sigterm()  # SIGTERM ends every role as SIGINT does: its trace ends with trace_end
    from engine.runs.pd import run_pd  # lazy: start-up time (torch)

    return print_summary(run_pd(spec).summary, args.json, "pdo run --pd")


def summary_ok(s: dict) -> bool:
    return not (
        s.get("mismatches")
        or s["aborted"]
        or s.get("faults")
        or s.get("failed_ranks")
        or any(s["decode_leaks"].values())
        or any(any(v.values()) for v in s["prefill_leaks"])
    )


def prefetch_note(s: dict, prog: str = "pdo run --pd") -> str | None:
    """Why the prefetch served no consumption point, when it was on and served none."""
    resolve = s["resolve"]
    if not s.get("prefetch") or not resolve["count"]:
        return None
    served = resolve["count"] - resolve["by_source"].get("sync", 0)
    if served:
        return None
    why = (
        f"prefetch served 0 of {resolve['count']} consumption points: no request stayed pending "
        "across an iteration (every query was answered in the iteration that needed it); "
    )
    if prog == "pdo launch":  # each process keeps its own clock, the ranks' runs ahead
        return why + (
            "here the prefill ranks start before the decode and have registered each room when "
            f"the decode first asks; the window appears with pdo run --pd {PRODUCTION_WINDOW_FLAGS} "
            "(docs/decode.md)"
        )
    return why + f"the production window appears with {PRODUCTION_WINDOW_FLAGS} (docs/decode.md)"


def fault_lines(s: dict) -> list[str]:
    """One line per fault: a process that died or failed, a prefill rank the decode lost."""
    lines = []
    for f in s.get("faults") or []:
        status = f["status"]  # None: killed in process (pdo run --pd --kill)
        how = (
            "killed"
            if status is None
            else f"killed by signal {-status}"
            if status < 0
            else f"exited {status}"
        )
        lines.append(f"  fault: {f['role']} {how}: {f['error']}")
    if s.get("decode_lost_by"):
        lines.append(
            f"  fault: prefill rank(s) {s['decode_lost_by']} lost the decode (no heartbeat, or "
            "none within its bootstrap timeout): held KV dropped, the ranks ended"
        )
    for f in s.get("failed_ranks") or []:
        in_flight = f.get("aborted_in_flight", f["aborted"])
        why = (
            f" ({in_flight} in flight when it failed, {f['aborted'] - in_flight} whose room it "
            "never registered)"
            if in_flight != f["aborted"]
            else ""
        )
        lines.append(
            f"  fault: decode lost prefill rank {f['rank']} ({f['reason']}): "
            f"{f['aborted']} of its request(s) aborted{why}"
        )
    return lines


def print_summary(s: dict, as_json: bool, prog: str) -> int:
    code = OK if summary_ok(s) else FAILED
    if as_json:
        print(json.dumps({**s, "prefetch_note": prefetch_note(s, prog)}))
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
    note = prefetch_note(s, prog)
    if note:
        print(f"  {note}")
    for line in fault_lines(s):
        print(line)
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
        "decode": s["decode_leaks"],  # {} for a process that died before its summary
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
