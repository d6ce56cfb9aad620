"""`pdo`: the command-line entry point. Sub-commands: run, check, bootstrap (more come with spec,
fuzz, bench and trace). Errors print one line and exit 2; never a traceback for bad input."""
from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys

# Modules that add sub-commands: each defines `register(subparsers)`, setting `fn` on its parsers.
PLUGINS: list[str] = ["engine.bench.cli", "checker.trace_cli"]
PLUGINS += ["engine.launch"]  # pdo launch
PLUGINS += ["checker.fuzz.cli"]  # pdo fuzz
PLUGINS += ["spec.cli"]  # pdo spec table | prove | docs
PLUGINS += ["engine.sglang.conform"]  # pdo conform sglang (imports SGLang only when it runs)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--mode", choices=["normal", "overlap", "thread", "ahead"], default=None,
                   help="prefill loop (default: from SGLANG_ENABLE_PREFILL_FWD_THREAD / "
                        "SGLANG_PREFILL_FWD_THREAD_AHEAD, else ahead)")
    g.add_argument("--model", choices=["tiny", "large"], default="tiny")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (CUDA default), float16")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-pages", type=int, default=512)
    g.add_argument("--chunk-size", type=int, default=128)
    g.add_argument("--max-batch-tokens", type=int, default=256)
    g.add_argument("--admission-cost-us", type=float, default=0.0,
                   help="extra host work per admitted request (models a heavier scheduler)")
    g.add_argument("--launch-cost-us", type=float, default=0.0,
                   help="host time per layer launch inside run_batch (models eager CUDA launch overhead)")
    g.add_argument("--seed", type=int, default=0, help="model seed")
    g.add_argument("--inject", action="append", default=[], metavar="MUTANT",
                   help="turn on a realistic bug (see `pdo fuzz --list-mutants`)")
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=24)
    w.add_argument("--prompt-len", default="24:160", help="MIN:MAX prompt tokens")
    w.add_argument("--hit", type=float, default=0.8, help="prefix-hit ratio (the seed measured at 0.8)")
    w.add_argument("--groups", type=int, default=3, help="distinct shared prefixes")
    w.add_argument("--arrival", choices=["burst", "poisson"], default="burst")
    w.add_argument("--rate", type=float, default=2000.0, help="requests/s for poisson arrival")
    w.add_argument("--workload-seed", type=int, default=0)


def build_configs(a):
    import torch

    from .config import EngineConfig, mode_from_env
    from .workload import WorkloadConfig

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    lo, _, hi = a.prompt_len.partition(":")
    cfg = EngineConfig(mode=a.mode or mode_from_env("ahead"), model=a.model, page_size=a.page_size,
                       num_pages=a.num_pages, chunk_size=a.chunk_size, max_batch_tokens=a.max_batch_tokens,
                       device=device, dtype=dtype, attention_backend=a.attention_backend, seed=a.seed,
                       admission_cost_us=a.admission_cost_us, launch_cost_us=a.launch_cost_us, inject=frozenset(a.inject))
    wc = WorkloadConfig(requests=a.requests, prompt_len=(int(lo), int(hi or lo)), hit=a.hit, groups=a.groups,
                        arrival=a.arrival, rate=a.rate, seed=a.workload_seed)
    return cfg, wc


def cmd_run(a) -> int:
    if a.pd:
        from .decode.cli import cmd_run_pd
        return cmd_run_pd(a)
    from .run import run_prefill

    cfg, wc = build_configs(a)
    s = run_prefill(cfg, wc, trace_path=a.trace)
    leaks = s["leaks"]
    code = 0 if not any(leaks.values()) else 1
    if a.json:
        print(json.dumps(s))
        return code
    print(f"pdo run: mode={s['mode']} device={s['device']} attention={s['attention_backend']} "
          f"requests={s['finished']}/{s['requests']} batches={s['batches']}")
    print(f"  input tokens {s['input_tokens']} (uncached {s['uncached_tokens']}, cached {s['cached_tokens']}), "
          f"wall {s['wall_s'] * 1e3:.1f} ms, uncached input {s['uncached_tok_per_s']:.0f} tok/s")
    print(f"  leaks: slots={leaks['slots_in_use']} pages={leaks['pages_unaccounted']} "
          f"locked={leaks['locked_cache_pages']} inflight={leaks['inflight']}"
          + (f"; trace: {a.trace} ({s['events']} events)" if a.trace else ""))
    return code


_UNSET = object()


def pd_only_flags_given(run_parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The options of `pdo run`'s "PD disaggregation" group, --pd aside, written on this command line
    (even at their default value): they only mean something with --pd."""
    group = next(g for g in run_parser._action_groups if g.title == "PD disaggregation")
    actions = [x for x in group._group_actions if x.dest != "pd"]
    ns = argparse.Namespace(**{x.dest: _UNSET for x in actions})  # argparse fills in only what is unset
    run_parser.parse_args(argv, namespace=ns)
    return [x.option_strings[0] for x in actions if getattr(ns, x.dest) is not _UNSET]


def cmd_check(a) -> int:
    from checker.linear import check_files
    from checker.report import json_report, text_report

    if a.engine == "z3":  # the second checker: rules as z3 constraints, unsat cores on a violation
        from checker.z3check import main_check
        return main_check(a.traces, json_out=a.json)
    if a.perfetto and len(a.traces) != 1:
        raise ValueError("--perfetto takes exactly one trace")
    results = check_files(a.traces)  # decode traces are also checked against the prefill traces given
    if a.perfetto:
        from checker.perfetto import export, violations_of

        export(a.traces[0], a.perfetto, violations=violations_of(results[0]))
    if a.json:
        print(json.dumps([json_report(r) for r in results], indent=1))
    else:
        print("\n".join(text_report(r) for r in results))
    return 0 if all(r.ok for r in results) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pdo", description="pd-overlap: run the instrumented engine, check its traces.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = run_parser = sub.add_parser("run", help="run the prefill engine (optionally writing a trace)")
    _add_engine_args(p)
    from .decode.cli import add_pd_args
    add_pd_args(p)
    p.add_argument("--trace", metavar="FILE", help="write a pdo-trace (JSON Lines) here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("check", help="verify trace file(s) against the rules in spec/")
    p.add_argument("traces", nargs="+", metavar="TRACE")
    p.add_argument("--json", action="store_true")
    p.add_argument("--engine", choices=["linear", "z3"], default="linear", help="checker (default: linear)")
    p.add_argument("--perfetto", metavar="OUT", help="also write the trace as Chrome trace-event JSON, "
                   "violations highlighted (ui.perfetto.dev)")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("bootstrap", help="run the bootstrap HTTP server alone", add_help=False)
    p.set_defaults(fn=None)
    for mod in PLUGINS:
        importlib.import_module(mod).register(sub)
    if argv is None:
        argv = sys.argv[1:]
        if hasattr(signal, "SIGPIPE"):  # `pdo check t.jsonl | head` ends quietly, like any Unix tool
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if argv and argv[0] == "bootstrap":
        from .bootstrap import main as bootstrap_main
        return bootstrap_main(argv[1:])
    a = parser.parse_args(argv)
    if a.cmd == "run" and not a.pd:
        given = pd_only_flags_given(run_parser, argv[1:])
        if given:
            print(f"pdo run: error: {', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} with --pd",
                  file=sys.stderr)
            return 2
    try:
        return a.fn(a)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, never a traceback, for anything the user can cause
        from checker.trace_io import TraceFormatError

        if isinstance(exc, (TraceFormatError, ValueError, OSError)) or type(exc).__name__.endswith("Error"):
            print(f"pdo {a.cmd}: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
