"""`pdo check`: verify trace files against the rules in spec/ (linear checker, or z3)."""

from __future__ import annotations

import argparse
import json

from checker import refine
from checker.parallel import add_ray_args
from checker.perfetto import export, violations_of
from checker.report import json_report, text_report
from checker.trace_log import materialize
from checker.trace_sets import verdict
from engine.cli import check_fleet, exits
from spec import domains as d
from spec.errors import BadInput


def register(sub) -> None:
    p = sub.add_parser("check", help="verify trace file(s) against the rules in spec/")
    # "*": `pdo check --ray DIR` gives DIR to --ray, and check_fleet.validate takes it back
    p.add_argument(
        "traces",
        nargs="*",
        type=d.path(),
        metavar="TRACE",
        help="trace files; with --ray, folders (every trace set under them) or files",
    )
    p.add_argument("--json", action="store_true", help="print the reports as one JSON array")
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
        type=d.path(),
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
    add_ray_args(p, "one task per trace set (the files of one run) under the folders given")
    p.add_argument(
        "--progress",
        action="store_true",
        help="with --ray: show progress even when stderr is not a terminal",
    )
    p.set_defaults(fn=cmd_check, validate=check_fleet.validate)


def cmd_check(args: argparse.Namespace) -> int:
    if args.ray is not None:
        return check_fleet.cmd_check_ray(args)
    args.traces = [materialize(p) for p in args.traces]  # a killed run's binary log: its lines
    if args.engine == "z3":  # the second checker: z3 constraints, unsat cores on a violation
        return _check_z3(args.traces, args.json)
    if args.perfetto and len(args.traces) != 1:
        raise BadInput("--perfetto takes exactly one trace")
    from checker.linear import check_files  # lazy: start-up time (numpy)

    # decode traces are also checked against the prefill traces given
    results = check_files(args.traces)
    if args.perfetto:
        export(args.traces[0], args.perfetto, violations=violations_of(results[0]))
    models = [_check_model(path) for path in args.traces] if args.model else []
    predicted = _predict(args.traces, args.confirm) if args.predict else []
    if args.json:
        out = [json_report(r) for r in results]
        for report, model in zip(out, models):
            report["model"] = refine.json_report(model)
        for report, (prediction, _) in zip(out, predicted):
            report["predict"] = prediction
        print(json.dumps(out, indent=1))
    else:
        print("\n".join(text_report(r) for r in results))
        for model in models:
            print(refine.text(model))
        for _, text in predicted:
            print(text)
    if any(not p["ok"] for p, _ in predicted) or any(m.judged and not m.ok for m in models):
        return exits.FAILED
    code = verdict(results)  # a truncated trace is never a pass
    if code == exits.OK and any(not p["complete"] for p, _ in predicted):
        return exits.INCOMPLETE  # pairs the clocks cannot judge: never a pass
    if code == exits.OK and any(not m.complete for m in models):
        return exits.INCOMPLETE  # a model not judged: never a pass
    return code


def _check_z3(paths: list[str], json_out: bool) -> int:
    """`pdo check --engine z3`: FAILED on a violation, INCOMPLETE when a window went undecided or a
    trace was truncated (never OK for a truncated file), else OK."""
    from checker import z3check  # lazy: start-up time (z3)

    results = z3check.check_files(paths)
    if json_out:
        print(json.dumps([z3check.json_report(r) for r in results], indent=1))
    else:
        print("\n".join(z3check.text_report(r) for r in results))
    if any(r.status == "fail" for r in results):
        return exits.FAILED
    return exits.OK if all(r.ok for r in results) else exits.INCOMPLETE


def _predict(paths: list[str], confirm: bool) -> list[tuple[dict, str]]:
    """The predictive analysis of each trace (checker/predict.py), as (JSON report, text); with
    `confirm`, each prediction replayed under the fuzz controller."""
    from checker import predict  # lazy: start-up time (numpy, through the linear checker)

    results = [predict.predict_file(p) for p in paths]  # NoClocks is bad input
    out = []
    for r in results:
        report, text = predict.json_report(r), predict.text_report(r)
        if confirm and r.predictions:
            from checker.fuzz.confirm import confirm as replay  # lazy: start-up time (torch)

            done = [replay(r.path, r.header, p) for p in r.predictions]
            for item, c in zip(report["predictions"], done):
                item["confirmed"], item["confirm"] = c.confirmed, c.line
            text += "\n" + "\n".join(c.line for c in done)
        out.append((report, text))
    return out


def _check_model(path: str):
    return refine.check_model(path)
