"""The engine and workload flags of `pdo run` and `pdo launch`, and the configs built from them."""

from __future__ import annotations

import argparse

from ..config import EngineConfig, mode_from_env


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--mode",
        choices=["normal", "overlap", "thread", "ahead"],
        default=None,
        help="prefill loop (default: from SGLANG_ENABLE_PREFILL_FWD_THREAD / "
        "SGLANG_PREFILL_FWD_THREAD_AHEAD, else ahead)",
    )
    g.add_argument("--model", choices=["tiny", "large"], default="tiny")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument(
        "--dtype", default=None, help="float32 (CPU default), bfloat16 (CUDA default), float16"
    )
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-pages", type=int, default=512)
    g.add_argument("--chunk-size", type=int, default=128)
    g.add_argument("--max-batch-tokens", type=int, default=256)
    g.add_argument(
        "--admission-cost-us",
        type=float,
        default=0.0,
        help="extra host work per admitted request (models a heavier scheduler)",
    )
    g.add_argument(
        "--launch-cost-us",
        type=float,
        default=0.0,
        help="host time per layer launch inside run_batch (models eager CUDA launch overhead)",
    )
    g.add_argument("--seed", type=int, default=0, help="model seed")
    g.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="MUTANT",
        help="turn on a realistic bug (see `pdo fuzz --list-mutants`)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=24)
    w.add_argument("--prompt-len", default="24:160", help="MIN:MAX prompt tokens")
    w.add_argument(
        "--hit", type=float, default=0.8, help="prefix-hit ratio (the design text measured at 0.8)"
    )
    w.add_argument("--groups", type=int, default=3, help="distinct shared prefixes")
    w.add_argument("--arrival", choices=["burst", "poisson"], default="burst")
    w.add_argument("--rate", type=float, default=2000.0, help="requests/s for poisson arrival")
    w.add_argument("--workload-seed", type=int, default=0)


def build_configs(args: argparse.Namespace):
    """(EngineConfig, WorkloadConfig) from the flags of add_engine_args."""
    import torch  # lazy: start-up time (torch); `pdo --help` imports this module

    from ..workload import WorkloadConfig  # lazy: start-up time (engine.request imports torch)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    lo, _, hi = args.prompt_len.partition(":")
    cfg = EngineConfig(
        mode=args.mode or mode_from_env("ahead"),
        model=args.model,
        page_size=args.page_size,
        num_pages=args.num_pages,
        chunk_size=args.chunk_size,
        max_batch_tokens=args.max_batch_tokens,
        device=device,
        dtype=dtype,
        attention_backend=args.attention_backend,
        seed=args.seed,
        admission_cost_us=args.admission_cost_us,
        launch_cost_us=args.launch_cost_us,
        inject=frozenset(args.inject),
    )
    workload = WorkloadConfig(
        requests=args.requests,
        prompt_len=(int(lo), int(hi or lo)),
        hit=args.hit,
        groups=args.groups,
        arrival=args.arrival,
        rate=args.rate,
        seed=args.workload_seed,
    )
    return cfg, workload


def add_flight_args(p: argparse.ArgumentParser) -> None:
    """The flight recorder's flags (docs/trace-format.md, "Truncated traces")."""
    g = p.add_argument_group("flight recorder (with --trace)")
    g.add_argument(
        "--watchdog-s",
        type=float,
        default=None,
        metavar="S",
        help="log a `stall` event (every thread's state and stack) when no event was logged for S "
        "seconds while requests are pending (default: no watchdog)",
    )
    g.add_argument(
        "--on-stall",
        choices=["continue", "stop"],
        default="continue",
        help="after a stall: go on, or end the trace (reason watchdog) and exit 1",
    )
    g.add_argument(
        "--trace-flush-ms",
        type=float,
        default=None,
        metavar="MS",
        help="write the streamed trace at least every MS ms (default 50): what a SIGKILL can lose",
    )


def watchdog_of(args: argparse.Namespace) -> dict | None:
    if args.watchdog_s is None:
        return None
    if args.watchdog_s <= 0:
        raise ValueError("--watchdog-s: expected a positive number of seconds")
    return {"seconds": args.watchdog_s, "on_stall": args.on_stall}


def exit_on_sigterm() -> None:
    """SIGTERM ends the run as SIGINT does, through its exception paths (the trace then ends with
    `trace_end` reason signal), with the exit status of a SIGTERM."""
    import signal

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
