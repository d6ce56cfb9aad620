"""`pdo check`: verify trace files against the rules in spec/ (linear checker, or z3)."""

from __future__ import annotations

import argparse
import json

from checker import refine
from checker.perfetto import export, violations_of
from checker.report import json_report, text_report


def register(sub) -> None:
    p = sub.add_parser("check", help="verify trace file(s) against the rules in spec/")
    p.add_argument("traces", nargs="+", metavar="TRACE")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--engine", choices=["linear", "z3"], default="linear", help="checker (default: linear)"
    )
    p.add_argument(
        "--model",
        action="store_true",
        help="also check that each prefill trace is a schedule of the loop model of its mode, "
        "each decode trace one of the decode loop model (spec/z3model/): exit 1 names the step "
        "where engine and model drift apart, exit 3 a trace the model leaves out",
    )
    p.add_argument(
        "--perfetto",
        metavar="OUT",
        help="also write the trace as Chrome trace-event "
        "JSON, violations highlighted (ui.perfetto.dev)",
    )
    p.set_defaults(fn=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    if args.engine == "z3":  # the second checker: z3 constraints, unsat cores on a violation
        from checker.z3check import main_check  # lazy: start-up time (z3)

        return main_check(args.traces, json_out=args.json)
    if args.perfetto and len(args.traces) != 1:
        raise ValueError("--perfetto takes exactly one trace")
    from checker.linear import check_files  # lazy: start-up time (numpy)

    # decode traces are also checked against the prefill traces given
    results = check_files(args.traces)
    if args.perfetto:
        export(args.traces[0], args.perfetto, violations=violations_of(results[0]))
    models = [_check_model(path) for path in args.traces] if args.model else []
    if args.json:
        out = [json_report(r) for r in results]
        for report, model in zip(out, models):
            report["model"] = refine.json_report(model)
        print(json.dumps(out, indent=1))
    else:
        print("\n".join(text_report(r) for r in results))
        for model in models:
            print(refine.text(model))
    if not all(r.ok for r in results) or any(m.judged and not m.ok for m in models):
        return 1
    return 3 if any(not m.judged for m in models) else 0


def _check_model(path: str):
    return refine.check_model(path)
