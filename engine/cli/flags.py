"""The engine and workload flags of `pdo run` and `pdo launch`, and the configs built from them.

Each flag has a declared domain (spec/domains.py); build_spec then checks what spans flags
(a prompt that fits the model, a pool of bounded size, arrivals within MAX_ARRIVAL_SPAN_S, a CUDA
device this torch has), so that every value that parses runs, with a bound."""

from __future__ import annotations

import argparse

from engine.runs.spec import RunSpec, WatchdogSpec, WorkloadConfig
from engine.runtime.config import MODEL_PRESETS, EngineConfig, mode_from_env
from engine.runtime.inject import DECODE_MUTANTS, MUTANTS
from spec import domains as d
from spec.errors import BadInput
from spec.vocabulary import PREFILL_LOOPS

# The limits of a run's size: each bounds a value the engine allocates or waits for up front.
MAX_REQUESTS = 100_000
MAX_POOL_TOKENS = 1 << 20  # --num-pages x --page-size: the KV pool allocated at start
# Poisson arrivals: the mean time to the last arrival (--requests / --rate) may be at most this, so
# that a tiny rate (1e-9) is refused instead of running for ever.
MAX_ARRIVAL_SPAN_S = 3600.0
MAX_CONTEXT = max(m.max_context for m in MODEL_PRESETS.values())
DTYPES = ("float32", "bfloat16", "float16")
COST_US = d.number(0, 1e6)  # modelled host work: at most one second per admission or launch


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--mode",
        choices=PREFILL_LOOPS,
        default=None,
        help="prefill loop (default: from SGLANG_ENABLE_PREFILL_FWD_THREAD / "
        "SGLANG_PREFILL_FWD_THREAD_AHEAD, else ahead)",
    )
    g.add_argument("--model", choices=list(MODEL_PRESETS), default="tiny")
    g.add_argument(
        "--device", type=d.device(), default=None, help="cpu or cuda (default: cuda if available)"
    )
    g.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="float32 (CPU default), bfloat16 (CUDA default), float16",
    )
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    g.add_argument("--page-size", type=d.integer(1, MAX_CONTEXT), default=16)
    g.add_argument(
        "--num-pages",
        type=d.integer(2, MAX_POOL_TOKENS),
        default=512,
        help=f"KV pool pages, page 0 reserved (pages x page size at most {MAX_POOL_TOKENS} tokens)",
    )
    g.add_argument("--chunk-size", type=d.integer(1, MAX_CONTEXT), default=128)
    g.add_argument("--max-batch-tokens", type=d.integer(1, MAX_POOL_TOKENS), default=256)
    g.add_argument(
        "--admission-cost-us",
        type=COST_US,
        default=0.0,
        help="extra host work per admitted request (models a heavier scheduler)",
    )
    g.add_argument(
        "--launch-cost-us",
        type=COST_US,
        default=0.0,
        help="host time per layer launch inside run_batch (models eager CUDA launch overhead)",
    )
    g.add_argument("--seed", type=d.seed(), default=0, help="model seed")
    g.add_argument(
        "--inject",
        action="append",
        type=d.one_of([*MUTANTS, *DECODE_MUTANTS], "a mutant"),
        default=[],
        metavar="MUTANT",
        help="turn on a realistic bug (see `pdo fuzz --list-mutants`)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=d.integer(1, MAX_REQUESTS), default=24)
    w.add_argument(
        "--prompt-len",
        type=d.span(1, MAX_CONTEXT),
        default="24:160",
        help="MIN:MAX prompt tokens (at most the model's context, less --max-new-tokens)",
    )
    w.add_argument(
        "--hit",
        type=d.ratio(),
        default=0.8,
        help="prefix-hit ratio (the design text measured at 0.8)",
    )
    w.add_argument(
        "--groups", type=d.integer(1, MAX_REQUESTS), default=3, help="distinct shared prefixes"
    )
    w.add_argument("--arrival", choices=["burst", "poisson"], default="burst")
    w.add_argument(
        "--rate",
        type=d.number(0, 1e9, above=True),
        default=2000.0,
        help="requests/s for poisson arrival "
        f"(--requests / --rate at most {MAX_ARRIVAL_SPAN_S:g} s)",
    )
    w.add_argument("--workload-seed", type=d.seed(), default=0)


def build_spec(args: argparse.Namespace, *, max_new_tokens: int = 1) -> RunSpec:
    """The run of the flags of add_engine_args, add_flight_args, --trace and --no-verify;
    BadInput (naming the flag) for flags that do not go together."""
    import torch  # lazy: start-up time (torch); `pdo --help` imports this module

    cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if cuda else "cpu")
    if device.startswith("cuda") and not cuda:
        raise BadInput(f"--device {device}: this torch ({torch.__version__}) sees no CUDA device")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise BadInput(f"--device {device}: this machine has {torch.cuda.device_count()} device(s)")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    check_sizes(args, max_new_tokens)
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
        prompt_len=args.prompt_len,
        hit=args.hit,
        groups=args.groups,
        arrival=args.arrival,
        rate=args.rate,
        seed=args.workload_seed,
        max_new_tokens=max_new_tokens,
    )
    watchdog = None
    if args.watchdog_s is not None:  # its domain (> 0) was checked as it was parsed
        watchdog = WatchdogSpec(args.watchdog_s, args.on_stall)
    return RunSpec(
        cfg,
        workload,
        trace_path=getattr(args, "trace", None),
        watchdog=watchdog,
        verify=not args.no_verify,
    )


def check_sizes(args: argparse.Namespace, max_new_tokens: int) -> None:
    """What spans flags: a request (prompt and new tokens) and a chunk fit the model's context, the
    KV pool has a bounded size, poisson arrivals end within MAX_ARRIVAL_SPAN_S on average."""
    context = MODEL_PRESETS[args.model].max_context
    if args.prompt_len[1] + max_new_tokens > context:
        raise BadInput(
            f"--prompt-len {args.prompt_len[0]}:{args.prompt_len[1]}: a request of the {args.model} "
            f"model holds at most {context} tokens, {max_new_tokens} of them generated"
        )
    if args.chunk_size > context:
        raise BadInput(f"--chunk-size {args.chunk_size}: more than the model's context ({context})")
    if args.num_pages * args.page_size > MAX_POOL_TOKENS:
        raise BadInput(
            f"--num-pages {args.num_pages} x --page-size {args.page_size}: a KV pool of more than "
            f"{MAX_POOL_TOKENS} tokens"
        )
    if args.arrival == "poisson" and args.requests / args.rate > MAX_ARRIVAL_SPAN_S:
        raise BadInput(
            f"--rate {args.rate:g}: {args.requests} poisson arrivals would take "
            f"{args.requests / args.rate:.3g} s on average, more than {MAX_ARRIVAL_SPAN_S:g} s"
        )


def add_flight_args(p: argparse.ArgumentParser) -> None:
    """The flight recorder's flags (docs/trace-format.md, "Truncated traces")."""
    g = p.add_argument_group("flight recorder (with --trace)")
    g.add_argument(
        "--watchdog-s",
        type=d.number(0, 86400, above=True),
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


def exit_on_sigterm() -> None:
    """SIGTERM ends the run as SIGINT does, through its exception paths (the trace then ends with
    `trace_end` reason signal), with the exit status of a SIGTERM."""
    import signal

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
