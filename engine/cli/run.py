"""`pdo run`: the prefill engine once (or, with --pd, the PD roles in this process), a summary."""

from __future__ import annotations

import argparse
import functools
import json
import os

from engine.cli.flags import add_engine_args, add_flight_args, build_spec, exit_on_sigterm
from engine.cli.pd import add_no_verify, add_pd_args, cmd_run_pd, pd_spec
from engine.sync import hb
from spec import domains as d
from spec.errors import BadInput

_UNSET = object()


def register(sub) -> None:
    p = sub.add_parser("run", help="run the prefill engine (optionally writing a trace)")
    add_engine_args(p)
    add_pd_args(p)
    p.add_argument(
        "--trace", type=d.path(), metavar="FILE", help="write a pdo-trace (JSON Lines) here"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--hb",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write each event's happens-before vector clock (`vc`), for `pdo check --predict` "
        "(default: on; --no-hb, or PDO_HB=0, leaves them out)",
    )
    add_no_verify(p)
    add_flight_args(p)
    p.set_defaults(fn=cmd_run, validate=functools.partial(validate_run, p))


def validate_run(run_parser: argparse.ArgumentParser, args: argparse.Namespace, argv) -> None:
    """What spans the flags of `pdo run`, before anything runs: BadInput naming the flag."""
    refuse_pd_only_flags(run_parser, args, argv)
    pd_spec(args) if args.pd else build_spec(args)


def cmd_run(args: argparse.Namespace) -> int:
    if args.hb is not None:  # else PDO_HB's, on unless it says 0
        os.environ["PDO_HB"] = "1" if args.hb else "0"  # role processes of --pd inherit it
        hb.enable(args.hb)
    if args.pd:
        return cmd_run_pd(args)
    from engine.runs.prefill_run import run_prefill  # lazy: start-up time (torch)

    spec = build_spec(args)
    exit_on_sigterm()
    s = run_prefill(spec).summary
    leaks = s["leaks"]
    verdict = s.get("verify")
    code = 0 if not any(leaks.values()) and not (verdict and verdict["mismatches"]) else 1
    if args.json:
        print(json.dumps(s))
        return code
    print(
        f"pdo run: mode={s['mode']} device={s['device']} attention={s['attention_backend']} "
        f"requests={s['finished']}/{s['requests']} batches={s['batches']}"
    )
    print(
        f"  input tokens {s['input_tokens']} (uncached {s['uncached_tokens']}, "
        f"cached {s['cached_tokens']}), wall {s['wall_s'] * 1e3:.1f} ms, "
        f"uncached input {s['uncached_tok_per_s']:.0f} tok/s"
    )
    print(memory_line(s["memory"]))
    print(
        f"  leaks: slots={leaks['slots_in_use']} pages={leaks['pages_unaccounted']} "
        f"locked={leaks['locked_cache_pages']} inflight={leaks['inflight']}"
        + (f"; trace: {args.trace} ({s['events']} events)" if args.trace else "")
    )
    print(
        "  " + (verdict["line"] if verdict else "outputs vs reference: not verified (--no-verify)")
    )
    return code


def memory_line(m: dict) -> str:
    """The run's memory pressure in one line (the counters of PrefillScheduler.memory_stats)."""
    return (
        f"  memory: evicted {m['evicted_pages']} page(s) in {m['evict_calls']} eviction(s), "
        f"failed allocations {m['failed_allocs']} (slots {m['failed_slot_allocs']}, "
        f"pages {m['failed_page_allocs']}), postponed requests {m['postponed_requests']}, "
        f"postponed chunks {m['postponed_chunks']}, admitted after waiting {m['retried_ok']}"
    )


def pd_only_flags_given(run_parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The options of `pdo run`'s "PD disaggregation" group, --pd aside, written on this command
    line (even at their default value): they only mean something with --pd."""
    group = next(g for g in run_parser._action_groups if g.title == "PD disaggregation")
    actions = [x for x in group._group_actions if x.dest != "pd"]
    # argparse fills in only what is unset
    namespace = argparse.Namespace(**{x.dest: _UNSET for x in actions})
    run_parser.parse_args(argv, namespace=namespace)
    return [x.option_strings[0] for x in actions if getattr(namespace, x.dest) is not _UNSET]


def refuse_pd_only_flags(
    run_parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]
) -> None:
    """BadInput for PD-only options given without --pd (they would be ignored)."""
    if args.pd:
        return
    given = pd_only_flags_given(run_parser, argv)
    if given:
        raise BadInput(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} with --pd")
