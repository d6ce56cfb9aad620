"""`pdo check`: verify trace files against the rules in spec/ (linear checker, or z3)."""

from __future__ import annotations

import argparse
import json

from checker import refine
from checker.perfetto import export, violations_of
from checker.report import json_report, text_report

from . import exits


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
        help="also check that each prefill trace is a schedule of the loop model of its mode "
        "(spec/z3model/): exit 1 names the step where engine and model drift apart",
    )
    p.add_argument(
        "--perfetto",
        metavar="OUT",
        help="also write the trace as Chrome trace-event "
        "JSON, violations highlighted (ui.perfetto.dev)",
    )
    p.add_argument(
        "--predict",
        action="store_true",
        help="also search the reorderings the trace's happens-before clocks allow (pdo run --hb) "
        "for a rule violation: exit 1 names the two events that would swap",
    )
    p.add_argument(
        "--confirm",
        action="store_true",
        help="with --predict: rerun each predicted reordering under the fuzz controller and say "
        "whether the engine really breaks the rule",
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
    if args.predict and not _predict(args.traces, args.json, args.confirm):
        return exits.FAILED
    if not all(r.ok for r in results) or any(m.judged and not m.ok for m in models):
        return 1
    return 3 if any(not m.judged for m in models) else 0


def _predict(paths: list[str], json_out: bool, confirm: bool) -> bool:
    """The predictive analysis of each trace (checker/predict.py); whether none predicts a violation."""
    from checker import predict  # lazy: start-up time (numpy, through the linear checker)

    try:
        results = [predict.predict_file(p) for p in paths]
    except predict.NoClocks as exc:
        raise ValueError(str(exc)) from None
    if json_out:
        print(json.dumps([predict.json_report(r) for r in results], indent=1))
    else:
        print("\n".join(predict.text_report(r) for r in results))
    if confirm:
        from checker.fuzz.confirm import confirm as run_confirm  # lazy: start-up time (torch)

        for r in results:
            for p in r.predictions:
                print(run_confirm(r.path, r.header, p).line)
    return all(r.ok for r in results)


def _check_model(path: str):
    return refine.check_model(path)
