"""`pdo spec`: the formal model's answers. Sub-commands:

  table   the design's four-mode table, every yes/no cell a z3 query, and the AHEAD steady state
  prove   the safety properties for K batches (prefill) and K iterations (decode prefetch): PROVED
          (with a minimal set of rules), or REFUTED with a counterexample schedule; vacuity and
          loop-model conformance first
  docs    write docs/spec.md (generated from spec/)

Every query prints its time. Exit status: 0 all proved / as the design says, 1 a refutation or a
violated expectation, 3 a solver budget ran out (UNKNOWN: never reported as a pass).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from engine.cli.exits import FAILED, INCOMPLETE, OK

from . import docgen
from . import domains as d
from . import z3model as zm
from .errors import BadInput
from .tables import mode_table_lines, steady_lines
from .z3model import unbounded_run

# K, the batches (iterations) of a bounded proof: the model grows with K, so it is bounded too.
BATCHES = d.integer(1, 12)


def register(subparsers) -> None:
    spec_parser = subparsers.add_parser(
        "spec", help="the formal model: mode table, proofs, generated docs"
    )
    sub = spec_parser.add_subparsers(dest="spec_cmd", required=True)
    table = sub.add_parser(
        "table", help="the design's four-mode table computed by z3, and the AHEAD steady state"
    )
    table.add_argument("--batches", type=BATCHES, default=3, metavar="K")
    table.add_argument("--json", action="store_true", help='print {"modes": {...}} only')
    table.set_defaults(fn=cmd_table)
    prove = sub.add_parser(
        "prove", help="prove the safety properties for K batches, or print counterexamples"
    )
    prove.add_argument(
        "--role",
        choices=["all", "prefill", "decode"],
        default="all",
        help="prefill: the four loops over K batches; decode: the prefetch of "
        "DP-rank queries over K iterations; all (default): both",
    )
    prove.add_argument(
        "--mode",
        choices=zm.MODES,
        action="append",
        help="default: all of the role's modes (with --role all, a mode runs for "
        "each role that has it)",
    )
    prove.add_argument("--batches", type=BATCHES, default=4, metavar="K")
    prove.add_argument(
        "--basis",
        choices=["auto", "rules", "engine"],
        default="auto",
        help="prove from the rules alone, else engine ∧ rules (auto); or from one of them only",
    )
    prove.add_argument(
        "--drop",
        action="append",
        type=d.named(lambda: [r.id for r in zm.load_rules()], "a rule id of spec/"),
        default=[],
        metavar="RULE",
        help="leave a rule out (what if?)",
    )
    prove.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="MUTANT",
        choices=sorted({**zm.ENGINE_MUTANTS, **zm.DECODE_MODEL_MUTANTS}),
        help="a mutant of the loop model (prefill: ahead mode; decode: the decode loop)",
    )
    prove.add_argument(
        "--property",
        action="append",
        type=d.named(
            lambda: [p.id for role in ("prefill", "decode") for p in zm.properties(role)],
            "a property id (pdo spec prove lists them)",
        ),
        metavar="ID",
        help="only these properties",
    )
    prove.add_argument(
        "--timeout",
        type=d.number(0, 3600, above=True),
        default=60.0,
        metavar="S",
        help="per query (default 60 s)",
    )
    prove.add_argument(
        "--hidden", action="store_true", help="timelines also show queue and device points"
    )
    prove.add_argument(
        "--unbounded",
        action="store_true",
        help="prove every property for every K: the prefill loops and the decode prefetch "
        "loop as transition systems (docs/spec.md)",
    )
    prove.add_argument(
        "--confirm",
        action="store_true",
        help="with --unbounded: z3 also confirms each invariant (inductive, no bad move); slower",
    )
    if not any("--json" in a.option_strings for a in prove._actions):
        prove.add_argument("--json", action="store_true", help="print JSON on stdout")
    prove.set_defaults(fn=cmd_prove)
    docs = sub.add_parser("docs", help="write docs/spec.md from spec/")
    docs.add_argument("--out", type=d.path(), default=None, help="default: docs/spec.md")
    docs.add_argument(
        "--check", action="store_true", help="exit 1 if the file differs from what would be written"
    )
    docs.set_defaults(fn=cmd_docs)


def _say(line="") -> None:
    print(line, flush=True)


# ---- table


def cmd_table(args) -> int:
    t0 = time.perf_counter()
    log = None if args.json else _say
    if not args.json:
        _say(
            "pdo spec table: the design's four-mode table, each cell a z3 query "
            f"(K={args.batches}, "
            "reference batch N=1);"
        )
        _say("computed from the rules alone and again from the engine model alone")
    table, differ = zm.mode_table(args.batches, log=log)
    if args.json:
        print(json.dumps(table, indent=1, ensure_ascii=False))
        return 0
    _say()
    for line in mode_table_lines(table["modes"]):
        _say(line)
    bad = {m: d for m, d in differ.items() if d}
    _say(
        "\nthe engine model alone gives the same table"
        if not bad
        else f"\nRULES AND ENGINE DISAGREE: {bad}"
    )
    t1 = time.perf_counter()
    rows, answer = zm.ahead_steady_table()
    _say(
        "\nAHEAD steady state (design steps 1-7), read from a schedule z3 found for "
        "engine ∧ rules "
        f"({zm.verdict(answer)} in {answer.seconds:.3f} s, {time.perf_counter() - t1:.2f} s with "
        "the model):"
    )
    for line in steady_lines(rows):
        _say(line)
    _say(f"\ntotal {time.perf_counter() - t0:.2f} s")
    if bad or answer.status == "unsat":
        return 1
    return 3 if answer.status != "sat" else 0  # z3 gave no answer: no verdict


# ---- prove


def _status(answer: zm.Answer, want: str | None = None) -> str:
    s = {"sat": "SAT", "unsat": "UNSAT"}.get(answer.status, "UNKNOWN")
    if want is None:
        return s
    return s + ("" if answer.status == want or answer.status == "unknown" else " (!)")


def _say_timeline(model, witness, hidden, say) -> None:
    for line in zm.timeline(model, witness, hidden=hidden):
        say("      " + line)


def _decode_vacuity(model, k: int) -> list:
    """(query, expected status, note) for the decode loop model: it admits schedules, uses a
    prefetched answer (in a later iteration too), ends a prefetched query each way, and does
    nothing the universe lacks events for."""
    universe, both = model.universe, model.rule_ids + model.engine_ids
    first = zm.FIRST_SUBMIT
    checks = [
        (zm.Query("the rules admit a schedule", model.check(model.rule_ids)), "sat", ""),
        (zm.Query("engine ∧ rules admit a schedule", model.check(both)), "sat", ""),
        (
            zm.Query(
                "a resolve uses a prefetched answer (engine ∧ rules)",
                model.check(both, zm.prefetch_used(universe)),
            ),
            "sat" if k >= first else "unsat",
            "intended" if k >= first else f"needs K >= {first}",
        ),
        (
            zm.Query(
                "the loop does something the universe has no events for (loop model)",
                model.check(*zm.outside_universe(model)),
            ),
            "unsat",
            "as designed",
        ),
        (
            zm.Query(
                "... one submitted in an earlier iteration (engine ∧ rules)",
                model.check(both, zm.prefetch_used_later(universe)),
            ),
            "sat" if k >= 4 else "unsat",
            "intended" if k >= 4 else "needs K >= 4",
        ),
        (
            zm.Query(
                "a query begins after a cancel that did not stop it (engine ∧ rules)",
                model.check(both, zm.query_after_cancel(universe, stopped=False)),
            ),
            "sat" if k >= first else "unsat",
            "the pool thread took it first" if k >= first else f"needs K >= {first}",
        ),
        (
            zm.Query(
                "... after a cancel that stopped it (loop model)",
                model.check(model.engine_ids, zm.query_after_cancel(universe, stopped=True)),
            ),
            "unsat",
            "as designed",
        ),
    ]
    checks += [
        (
            zm.Query(
                f"a prefetched query {how} (engine ∧ rules)",
                model.check(both, zm.disj(*conditions)),
            ),
            "sat",
            "",
        )
        for how, conditions in universe.ends.items()
    ]
    return checks


def _prefill_vacuity(model, mode: str) -> list:
    """(query, expected status, note): the rules and engine ∧ rules admit schedules; an admission
    inside run_batch only in ahead mode."""
    want_overlap = "sat" if mode == "ahead" else "unsat"
    notes = {"sat": "intended", "unsat": "impossible, as designed"}
    return [
        (q, want, notes[want] if "inside" in q.what else "")
        for q, want in zip(zm.vacuity(model), ("sat", "sat", want_overlap))
    ]


def _say_vacuity(checks, counts, say) -> None:
    say("  vacuity")
    for q, want, note in checks:
        say(
            f"    {_status(q.answer, want):10s} {q.answer.seconds:7.3f} s  {q.what}"
            + (f" — {note}" if note else "")
        )
        if q.status == "unknown":
            counts["UNKNOWN"] += 1
        elif q.status != want:
            counts["problems"] += 1


def _say_conformance(model, counts, hidden, say) -> None:
    say("  conformance: the loop model satisfies each rule (engine ∧ ¬rule is UNSAT)")
    for q in zm.conformance(model):
        say(f"    {_status(q.answer, 'unsat'):10s} {q.answer.seconds:7.3f} s  {q.what}")
        if q.status == "sat":
            counts["problems"] += 1
            say("      the loop model violates it:")
            _say_timeline(model, q.answer.model, hidden, say)
        elif q.status == "unknown":
            counts["UNKNOWN"] += 1


def _say_properties(model, mode, role, *, basis, props, counts, hidden, say) -> None:
    say(f"  properties (basis: {basis}; 'rules' = from the rules alone)")
    for p in zm.properties(role):
        if not p.applies(mode) or (props and p.id not in props):
            continue
        pr = zm.prove(model, p, basis=basis)
        counts[pr.status] += 1
        core = "{" + ", ".join(pr.core) + "}" if pr.status == "PROVED" else pr.note
        say(
            f"    {pr.status:8s} {pr.seconds:7.3f} s  {p.id:22s} from {pr.basis:12s} {core}   "
            f"[engine alone: {pr.engine}]"
        )
        if pr.status == "REFUTED":
            say(f"      counterexample ({pr.basis}): {p.statement}")
            _say_timeline(model, pr.counterexample, hidden, say)
        elif pr.engine == "REFUTED":
            answer = model.check(model.engine_ids, zm.neg(p.formula(model.universe)))
            if answer.status == "sat":
                say(f"      the loop model alone violates it ({answer.seconds:.3f} s):")
                _say_timeline(model, answer.model, hidden, say)


def prove_mode(
    mode: str,
    k: int,
    *,
    basis="auto",
    drop=(),
    mutants=(),
    props=None,
    timeout_s=60.0,
    hidden=False,
    say=_say,
    role="prefill",
) -> dict:
    """Runs and prints everything `pdo spec prove` says about one mode; returns counts."""
    t0 = time.perf_counter()
    model = zm.Model(
        mode, k, drop=drop, mutants=mutants, timeout_ms=int(timeout_s * 1000), role=role
    )
    universe = model.universe
    unit = "iterations" if role == "decode" else "batches"
    say(
        f"== {role} mode {mode}, K={k} {unit}: {len(universe.events)} events, "
        f"{len(universe.hidden)} hidden points; "
        f"{len(model.rule_ids)} rules, {len(model.engine_ids)} engine groups"
        + (f"; without {', '.join(drop)}" if drop else "")
        + (f"; mutants {', '.join(mutants)}" if mutants else "")
        + f"; built in {model.build_seconds:.2f} s"
    )
    if model.not_encoded:
        say(f"   rules of kinds without an encoding (not used): {', '.join(model.not_encoded)}")
    if model.not_modelled:
        say(
            "   rules about events the loop model does not emit (judged on traces only): "
            + ", ".join(model.not_modelled)
        )
    counts = {"PROVED": 0, "REFUTED": 0, "UNKNOWN": 0, "problems": 0}
    checks = _decode_vacuity(model, k) if role == "decode" else _prefill_vacuity(model, mode)
    _say_vacuity(checks, counts, say)
    _say_conformance(model, counts, hidden, say)
    _say_properties(
        model, mode, role, basis=basis, props=props, counts=counts, hidden=hidden, say=say
    )
    say(
        f"  mode {mode}: {counts['PROVED']} proved, {counts['REFUTED']} refuted, "
        f"{counts['UNKNOWN']} unknown, {counts['problems']} failed expectation(s); "
        f"{time.perf_counter() - t0:.2f} s"
    )
    return counts


def cmd_prove(args) -> int:
    if args.confirm and not args.unbounded:
        raise BadInput("--confirm goes with --unbounded")
    if args.unbounded:
        modes = args.mode or zm.MODES
        counts = unbounded_run.run(
            modes=modes if args.role != "decode" else (),
            props=args.property,
            mutants=args.inject,
            as_json=args.json,
            say=_say,
            # one decode loop model serves both decode modes
            decode=args.role != "prefill" and any(m in zm.DECODE_MODES for m in modes),
            confirm=args.confirm,
        )
        if counts["REFUTED"]:
            return FAILED
        return INCOMPLETE if counts["UNKNOWN"] or counts["UNCONFIRMED"] else OK
    t0 = time.perf_counter()
    total = {"PROVED": 0, "REFUTED": 0, "UNKNOWN": 0, "problems": 0}
    roles = ("prefill", "decode") if args.role == "all" else (args.role,)
    runs = [
        (role, m)
        for role in roles
        for m in (zm.DECODE_MODES if role == "decode" else zm.MODES)
        if not args.mode or m in args.mode
    ]
    bad = [m for m in (args.mode or []) if args.role == "decode" and m not in zm.DECODE_MODES]
    if bad:
        raise BadInput(f"decode modes are {', '.join(zm.DECODE_MODES)}, not {', '.join(bad)}")
    for role, mode in runs:
        drop = [
            r
            for r in args.drop
            if any(x.id == r and x.role == role and x.applies(mode) for x in zm.load_rules())
        ]
        c = prove_mode(
            mode,
            args.batches,
            basis=args.basis,
            drop=drop,
            mutants=[m for m in args.inject if m in zm.DECODE_MODEL_MUTANTS]
            if role == "decode"
            else [m for m in args.inject if m in zm.ENGINE_MUTANTS]
            if mode == "ahead"
            else (),
            props=args.property,
            timeout_s=args.timeout,
            hidden=args.hidden,
            role=role,
        )
        for key in total:
            total[key] += c[key]
        _say()
    _say(
        f"pdo spec prove: {total['PROVED']} proved, {total['REFUTED']} refuted, "
        f"{total['UNKNOWN']} unknown (budget exhausted: not a pass), {total['problems']} failed "
        f"expectation(s); {time.perf_counter() - t0:.2f} s"
    )
    if total["REFUTED"] or total["problems"]:
        return 1
    return 3 if total["UNKNOWN"] else 0


# ---- docs


def cmd_docs(args) -> int:
    t0 = time.perf_counter()
    path = args.out or str(docgen.DEFAULT)
    text = docgen.generate()
    if args.check:
        try:
            old = open(path, encoding="utf-8").read()
        except OSError:
            old = None
        same = old == text
        state = "up to date" if same else "STALE (run `pdo spec docs`)"
        _say(f"{path}: {state} ({time.perf_counter() - t0:.1f} s)")
        return 0 if same else 1
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    _say(f"wrote {path} ({len(text.splitlines())} lines, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":  # python -m spec.cli ... (same as `pdo spec ...`)
    parser = argparse.ArgumentParser(prog="pdo")
    register(parser.add_subparsers(dest="cmd", required=True))
    ns = parser.parse_args(sys.argv[1:])
    sys.exit(ns.fn(ns))
