"""`pdo spec`: the formal model's answers. Sub-commands:

  table   the seed's four-mode table, every yes/no cell a z3 query, and the AHEAD steady state
  prove   the safety properties for K batches (prefill) and K iterations (decode prefetch): PROVED
          (with a minimal set of rules), or REFUTED with a counterexample schedule; vacuity and
          loop-model conformance first
  docs    write docs/spec.md (generated from spec/)

Every query prints its time. Exit status: 0 all proved / as the seed says, 1 a refutation or a
violated expectation, 3 a solver budget ran out (UNKNOWN: never reported as a pass).
"""
from __future__ import annotations

import json
import sys
import time

from . import z3model as zm


def register(subparsers) -> None:
    p = subparsers.add_parser("spec", help="the formal model: mode table, proofs, generated docs")
    sub = p.add_subparsers(dest="spec_cmd", required=True)
    t = sub.add_parser("table", help="the seed's four-mode table computed by z3, and the AHEAD steady state")
    t.add_argument("--batches", type=int, default=3, metavar="K")
    t.add_argument("--json", action="store_true", help='print {"modes": {...}} only')
    t.set_defaults(fn=cmd_table)
    v = sub.add_parser("prove", help="prove the safety properties for K batches, or print counterexamples")
    v.add_argument("--role", choices=["all", "prefill", "decode"], default="all",
                   help="prefill: the four loops over K batches; decode: the prefetch of DP-rank queries over K "
                        "iterations; all (default): both")
    v.add_argument("--mode", choices=zm.MODES, action="append",
                   help="default: all of the role's modes (with --role all, a mode runs for each role that has it)")
    v.add_argument("--batches", type=int, default=4, metavar="K")
    v.add_argument("--basis", choices=["auto", "rules", "engine"], default="auto",
                   help="prove from the rules alone, else engine ∧ rules (auto); or from one of them only")
    v.add_argument("--drop", action="append", default=[], metavar="RULE", help="leave a rule out (what if?)")
    v.add_argument("--inject", action="append", default=[], metavar="MUTANT", choices=sorted(zm.ENGINE_MUTANTS),
                   help="a mutant of the loop model (ahead mode)")
    v.add_argument("--property", action="append", metavar="ID", help="only these properties")
    v.add_argument("--timeout", type=float, default=60.0, metavar="S", help="per query (default 60 s)")
    v.add_argument("--hidden", action="store_true", help="timelines also show queue and device points")
    v.set_defaults(fn=cmd_prove)
    d = sub.add_parser("docs", help="write docs/spec.md from spec/")
    d.add_argument("--out", default=None, help="default: docs/spec.md")
    d.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be written")
    d.set_defaults(fn=cmd_docs)


def _say(line="") -> None:
    print(line, flush=True)


# ---- table ------------------------------------------------------------------------------------------

TABLE_HEAD = ("mode", "where run_batch runs",
              "can admission of the next batch overlap a run_batch that has not returned?",
              "result-processing order")
MODE_NAMES = {"normal": "normal loop, enable_overlap off", "overlap": "old overlap loop",
              "thread": "thread loop, AHEAD off", "ahead": "thread loop, AHEAD on"}


def mode_table_lines(modes: dict) -> list[str]:
    out = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "---|" * len(TABLE_HEAD)]
    for mode, row in modes.items():
        yes = {True: "yes", False: "no", None: "unknown"}[row["admission_overlaps_unreturned_run_batch"]]
        where = {"scheduler": "scheduler thread", "worker": "worker"}.get(row["run_batch_on"], row["run_batch_on"])
        out.append(f"| {MODE_NAMES[mode]} | {where} | {yes} | {row['processing_order']} |")
    return out


def steady_lines(rows) -> list[str]:
    out = ["| step | scheduler thread | forward worker |", "|---|---|---|"]
    out += [f"| {i} | {s} | {w} |" for i, s, w in rows]
    return out


def cmd_table(a) -> int:
    t0 = time.perf_counter()
    log = None if a.json else _say
    if not a.json:
        _say(f"pdo spec table: the seed's four-mode table, each cell a z3 query (K={a.batches}, reference batch N=1);")
        _say("computed from the rules alone and again from the engine model alone")
    table, differ = zm.mode_table(a.batches, log=log)
    if a.json:
        print(json.dumps(table, indent=1, ensure_ascii=False))
        return 0
    _say()
    for line in mode_table_lines(table["modes"]):
        _say(line)
    bad = {m: d for m, d in differ.items() if d}
    _say("\nthe engine model alone gives the same table" if not bad else f"\nRULES AND ENGINE DISAGREE: {bad}")
    t1 = time.perf_counter()
    rows, ans = zm.ahead_steady_table()
    _say(f"\nAHEAD steady state (seed steps 1-7), read from a schedule z3 found for engine ∧ rules "
         f"({zm._verdict(ans)} in {ans.seconds:.3f} s, {time.perf_counter() - t1:.2f} s with the model):")
    for line in steady_lines(rows):
        _say(line)
    _say(f"\ntotal {time.perf_counter() - t0:.2f} s")
    return 1 if bad or ans.status != "sat" else 0


# ---- prove --------------------------------------------------------------------------------------------

def _status(a: zm.Answer, want: str | None = None) -> str:
    s = {"sat": "SAT", "unsat": "UNSAT"}.get(a.status, "UNKNOWN")
    return s if want is None else s + ("" if a.status == want or a.status == "unknown" else " (!)")


def prove_mode(mode: str, k: int, *, basis="auto", drop=(), mutants=(), props=None, timeout_s=60.0,
               hidden=False, say=_say, role="prefill") -> dict:
    """Runs and prints everything `pdo spec prove` says about one mode; returns counts."""
    t0 = time.perf_counter()
    M = zm.Model(mode, k, drop=drop, mutants=mutants, timeout_ms=int(timeout_s * 1000), role=role)
    U = M.U
    unit = "iterations" if role == "decode" else "batches"
    say(f"== {role} mode {mode}, K={k} {unit}: {len(U.events)} events, {len(U.hidden)} hidden points; "
        f"{len(M.rule_ids)} rules, {len(M.engine_ids)} engine groups"
        + (f"; without {', '.join(drop)}" if drop else "") + (f"; mutants {', '.join(mutants)}" if mutants else "")
        + f"; built in {M.build_seconds:.2f} s")
    if M.not_encoded:
        say(f"   rules of kinds without an encoding (not used): {', '.join(M.not_encoded)}")
    counts = {"PROVED": 0, "REFUTED": 0, "UNKNOWN": 0, "problems": 0}
    say("  vacuity")
    if role == "decode":
        checks = [(zm.Query("the rules admit a schedule", M.check(M.rule_ids)), "sat", ""),
                  (zm.Query("engine ∧ rules admit a schedule", M.check(M.rule_ids + M.engine_ids)), "sat", ""),
                  (zm.Query("a resolve uses a prefetched answer (engine ∧ rules)",
                            M.check(M.rule_ids + M.engine_ids, zm.prefetch_used(U))),
                   "sat" if k >= zm.FIRST_SUBMIT else "unsat",
                   "intended" if k >= zm.FIRST_SUBMIT else f"needs K >= {zm.FIRST_SUBMIT}"),
                  (zm.Query("the loop does something the universe has no events for (loop model)",
                            M.check(*zm.outside_universe(M))), "unsat", "as designed"),
                  (zm.Query("... one submitted in an earlier iteration (engine ∧ rules)",
                            M.check(M.rule_ids + M.engine_ids, zm.prefetch_used_later(U))),
                   "sat" if k >= 4 else "unsat", "intended" if k >= 4 else "needs K >= 4")]
        checks += [(zm.Query(f"a prefetched query {how} (engine ∧ rules)", M.check(M.rule_ids + M.engine_ids, zm.disj(*c))),
                    "sat", "") for how, c in U.ends.items()]
    else:
        want_overlap = "sat" if mode == "ahead" else "unsat"
        checks = [(q, want, ({"sat": "intended", "unsat": "impossible, as designed"}[want] if "inside" in q.what else ""))
                  for q, want in zip(zm.vacuity(M), ("sat", "sat", want_overlap))]
    for q, want, note in checks:
        say(f"    {_status(q.answer, want):10s} {q.answer.seconds:7.3f} s  {q.what}" + (f" — {note}" if note else ""))
        if q.status == "unknown":
            counts["UNKNOWN"] += 1
        elif q.status != want:
            counts["problems"] += 1
    say("  conformance: the loop model satisfies each rule (engine ∧ ¬rule is UNSAT)")
    for q in zm.conformance(M):
        say(f"    {_status(q.answer, 'unsat'):10s} {q.answer.seconds:7.3f} s  {q.what}")
        if q.status == "sat":
            counts["problems"] += 1
            say("      the loop model violates it:")
            for line in zm.timeline(M, q.answer.model, hidden=hidden):
                say("      " + line)
        elif q.status == "unknown":
            counts["UNKNOWN"] += 1
    say(f"  properties (basis: {basis}; 'rules' = from the rules alone)")
    for p in zm.properties(role):
        if not p.applies(mode) or (props and p.id not in props):
            continue
        pr = zm.prove(M, p, basis=basis)
        counts[pr.status] += 1
        core = "{" + ", ".join(pr.core) + "}" if pr.status == "PROVED" else pr.note
        say(f"    {pr.status:8s} {pr.seconds:7.3f} s  {p.id:22s} from {pr.basis:12s} {core}   [engine alone: {pr.engine}]")
        if pr.status == "REFUTED":
            say(f"      counterexample ({pr.basis}): {p.statement}")
            for line in zm.timeline(M, pr.counterexample, hidden=hidden):
                say("      " + line)
        elif pr.engine == "REFUTED":
            a = M.check(M.engine_ids, zm.neg(p.formula(U)))
            if a.status == "sat":
                say(f"      the loop model alone violates it ({a.seconds:.3f} s):")
                for line in zm.timeline(M, a.model, hidden=hidden):
                    say("      " + line)
    say(f"  mode {mode}: {counts['PROVED']} proved, {counts['REFUTED']} refuted, {counts['UNKNOWN']} unknown, "
        f"{counts['problems']} failed expectation(s); {time.perf_counter() - t0:.2f} s")
    return counts


def cmd_prove(a) -> int:
    t0 = time.perf_counter()
    total = {"PROVED": 0, "REFUTED": 0, "UNKNOWN": 0, "problems": 0}
    roles = ("prefill", "decode") if a.role == "all" else (a.role,)
    runs = [(role, m) for role in roles for m in (zm.DECODE_MODES if role == "decode" else zm.MODES)
            if not a.mode or m in a.mode]
    bad = [m for m in (a.mode or []) if a.role == "decode" and m not in zm.DECODE_MODES]
    if bad:
        raise ValueError(f"decode modes are {', '.join(zm.DECODE_MODES)}, not {', '.join(bad)}")
    for role, mode in runs:
        drop = [r for r in a.drop if any(x.id == r and x.role == role and x.applies(mode) for x in zm.load_rules())]
        c = prove_mode(mode, a.batches, basis=a.basis, drop=drop,
                       mutants=a.inject if (mode == "ahead" and role == "prefill") else (),
                       props=a.property, timeout_s=a.timeout, hidden=a.hidden, role=role)
        for key in total:
            total[key] += c[key]
        _say()
    _say(f"pdo spec prove: {total['PROVED']} proved, {total['REFUTED']} refuted, {total['UNKNOWN']} unknown "
         f"(budget exhausted: not a pass), {total['problems']} failed expectation(s); {time.perf_counter() - t0:.2f} s")
    if total["REFUTED"] or total["problems"]:
        return 1
    return 3 if total["UNKNOWN"] else 0


# ---- docs ----------------------------------------------------------------------------------------------

def cmd_docs(a) -> int:
    from . import docgen

    t0 = time.perf_counter()
    path = a.out or str(docgen.DEFAULT)
    text = docgen.generate()
    if a.check:
        try:
            old = open(path, encoding="utf-8").read()
        except OSError:
            old = None
        same = old == text
        _say(f"{path}: {'up to date' if same else 'STALE (run `pdo spec docs`)'} ({time.perf_counter() - t0:.1f} s)")
        return 0 if same else 1
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    _say(f"wrote {path} ({len(text.splitlines())} lines, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":  # python -m spec.cli ... (same as `pdo spec ...`)
    import argparse

    ap = argparse.ArgumentParser(prog="pdo")
    register(ap.add_subparsers(dest="cmd", required=True))
    ns = ap.parse_args(sys.argv[1:])
    sys.exit(ns.fn(ns))
