"""`pdo spec prove --unbounded`: the prefill loops (unbounded.py) and the decode prefetch loop
(decode_unbounded.py) proved for every K, printed or as JSON, with z3's confirmation of each
invariant on request; and spec/unbounded_table.json, the table docs/spec.md shows."""

from __future__ import annotations

import json
import time
from pathlib import Path

from . import decode_unbounded, unbounded
from .decode_transition import Step
from .decode_workload import DECODE_MODEL_MUTANTS
from .transition import System
from .unbounded import MODES_ALL, STRUCTURAL, TABLE

DECODE_VARIANTS = tuple(decode_unbounded.VARIANTS)


def table_rows(results) -> list[dict]:
    """The rows docs/spec.md shows (verdict, how, time), in the order of the run."""
    return [
        {
            "property": r.prop,
            "mode": r.mode,
            "verdict": r.status,
            "how": r.how,
            "seconds": round(r.seconds, 2),
        }
        for r in results
    ]


def prove_everything() -> list:
    """Every prefill mode and every decode variant, clean."""
    return unbounded.prove_all() + decode_unbounded.prove_all()


def _confirm_prefill(mode, props, mutants) -> tuple:
    t0 = time.perf_counter()
    system = System(mode, mutants)
    ids = [
        p
        for p in unbounded.PROPERTIES
        if p.applies(mode) and (not props or p.id in props) and p.id not in STRUCTURAL
    ]
    ids = [p.id for p in ids]
    parent, _, _ = unbounded.reach(system, ids)
    t1 = time.perf_counter()
    got = unbounded.confirm(system, list(parent), ids)
    return got, t1 - t0, time.perf_counter() - t1


def _confirm_decode(variant, props, mutants) -> tuple:
    t0 = time.perf_counter()
    step = Step(decode_unbounded.VARIANTS[variant], mutants)
    ids = [p for p in decode_unbounded.PROPS if not props or p in props]
    layers, _, _ = decode_unbounded.reach(step)
    t1 = time.perf_counter()
    got = decode_unbounded.confirm(step, list(layers[0]), ids)
    return got, t1 - t0, time.perf_counter() - t1


def _agrees(got, rs) -> bool:
    """z3 says what the search said: the set is inductive and in the domain, and a bad move or
    state from it exists ("sat") exactly for the refuted properties."""
    want = {r.prop: "sat" if r.status == "REFUTED" else "unsat" for r in rs}
    return all(v == want.get(k, "unsat") for k, v in got.items())


def _say_confirm(got, ok, search_s, z3_s, say) -> None:
    """z3's answers ("unsat": no such move or state)."""
    words = ", ".join(f"{k} {v}" for k, v in got.items())
    verdict = "confirmed" if ok else "NOT CONFIRMED"
    say(f"    confirm (z3): {verdict}: {words}; {z3_s:.2f} s (search again {search_s:.2f} s)")


def _say_results(rs, say) -> None:
    for r in rs:
        say(f"    {r.status:8s} {r.seconds:7.3f} s  {r.prop:22s} {r.how}")
        if r.trace:
            say(f"      counterexample ({r.k} {'iterations' if '/' in r.mode else 'events'}):")
            lines = (
                decode_unbounded.timeline_lines
                if r.mode.startswith("decode")
                else unbounded.timeline_lines
            )(r.trace)
            for line in lines:
                say("      " + line)


def run(
    modes=MODES_ALL,
    props=None,
    mutants=(),
    as_json=False,
    say=print,
    decode=True,
    variants=DECODE_VARIANTS,
    confirm=False,
) -> dict:
    """Every property of every prefill mode, and (with `decode`) of each decode variant, for every
    K; with `confirm`, z3's confirmation of each invariant. Returns the counts of verdicts."""
    t0 = time.perf_counter()
    results, confirmed = [], []

    def check(what, rs, fn, *a):
        got, search_s, z3_s = fn(*a)
        ok = _agrees(got, rs)
        confirmed.append({"mode": what, "results": got, "agrees": ok, "seconds": round(z3_s, 3)})
        if not as_json:
            _say_confirm(got, ok, search_s, z3_s, say)

    prefill_mutants = [m for m in mutants if m not in DECODE_MODEL_MUTANTS]
    decode_mutants = [m for m in mutants if m in DECODE_MODEL_MUTANTS]
    for mode in modes:
        mu = prefill_mutants if mode == "ahead" else ()
        rs = unbounded.prove_mode(mode, props, mu)
        results += rs
        if not as_json:
            say(f"== prefill mode {mode}, every K (transition system, {rs[0].how if rs else ''})")
            _say_results(rs, say)
        if confirm:
            check(mode, rs, _confirm_prefill, mode, props, mu)
    for variant in variants if decode else ():
        rs = decode_unbounded.prove_variant(variant, props, decode_mutants)
        results += rs
        if not as_json:
            say(
                f"== decode loop (normal and overlap), {variant}, every K"
                + (f"; mutants {', '.join(decode_mutants)}" if decode_mutants else "")
                + f" ({rs[0].how if rs else ''})"
            )
            _say_results(rs, say)
        if confirm:
            check(f"decode/{variant}", rs, _confirm_decode, variant, props, decode_mutants)
    counts = {s: sum(r.status == s for r in results) for s in ("PROVED", "REFUTED", "UNKNOWN")}
    # z3 out of budget ("unknown") or disagreeing with the search: no verdict, never a pass
    counts["UNCONFIRMED"] = sum(not c["agrees"] for c in confirmed)
    total = time.perf_counter() - t0
    if as_json:
        data = {"results": [r.as_dict() for r in results], "seconds": round(total, 3)}
        if confirm:
            data["confirm"] = confirmed
        say(json.dumps(data))
    else:
        say(
            f"pdo spec prove --unbounded: {counts['PROVED']} proved, {counts['REFUTED']} "
            f"refuted, {counts['UNKNOWN']} unknown"
            + (f", {counts['UNCONFIRMED']} not confirmed by z3" if confirm else "")
            + f"; {total:.2f} s"
        )
    return counts


def write_table(path=TABLE) -> None:
    """spec/unbounded_table.json: what docs/spec.md shows (times from the run that wrote it)."""
    t0 = time.perf_counter()
    rows = table_rows(prove_everything())
    data = {"command": "pdo spec prove --unbounded", "rows": rows}
    data["seconds"] = round(time.perf_counter() - t0, 2)
    Path(path).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":  # python -m spec.z3model.unbounded_run: refresh docs/spec.md's table
    write_table()
