"""The answers `pdo spec` prints, each built from queries to a Model: proofs of the properties
with minimal rule sets, vacuity and conformance checks, the four-mode table, the AHEAD steady state,
and a schedule as a two-lane timeline; with the conditions those queries assume.
"""

from __future__ import annotations

from dataclasses import dataclass

from .logic import conj, disj, is_term, lt, neg
from .prefill_universe import batch_groups
from .properties import Property
from .solver import Answer, Model
from .universe import FWD, MODES, SCHED, Ev, key_label

# ---- conditions the queries assume


def prefetch_used(universe):
    """Some resolve uses a prefetched answer: the overlap the prefetch is for."""
    return disj(*[r.exists for r in universe.named("resolve") if r.f["qid"] is not None])


def outside_universe(model):
    """(engine groups, formula): the loop model, without the positions, does something the
    universe has no events for or logs an event twice."""
    return [g for g in model.engine_ids if g != "E:order"], disj(*model.universe.outside)


def prefetch_used_later(universe):
    """Some resolve uses the answer of a query submitted in an earlier iteration (the prealloc queue
    was not polled in between)."""
    return disj(
        *[
            conj(r.exists, lt(universe.get(("iter_begin", r.key[2] + 1)), r))
            for r in universe.named("resolve")
            if r.f["qid"] is not None and r.key[2] < universe.K
        ]
    )


def query_after_cancel(universe, stopped: bool):
    """Some prefetched query begins (its pool thread's query_begin) after a cancel of it whose
    Future.cancel() returned `stopped`: possible after one that did not stop it (the pool thread
    had taken the call), never after one that did."""
    out = []
    for c in universe.named("prefetch_cancel"):
        qb = universe.get(("query_begin", *c.key[1:]))
        if qb is not None:
            held = c.f["stopped"] if stopped else neg(c.f["stopped"])
            out.append(conj(c.exists, qb.exists, held, lt(c, qb)))
    return disj(*out)


def admission_overlap(universe):
    """Some admission of N+1 falls inside run_batch(N): the overlap AHEAD is for."""
    b = universe.b
    return disj(
        *[
            conj(
                b("fwd_begin", n).exists,
                b("fwd_end", n).exists,
                lt(b("fwd_begin", n), b("admit", n + 1)),
                lt(b("admit", n + 1), b("fwd_end", n)),
            )
            for n in range(universe.K - 1)
        ]
    )


def steady(universe, mode):
    """No drains: each batch is admitted in the iteration that finishes the previous one."""
    b = universe.b
    if mode == "normal":
        return True
    late = "collect" if mode == "ahead" else "process_begin"
    return conj(*[lt(b("admit", n), b(late, n - 1)) for n in range(1, universe.K)])


# ---- proofs, vacuity, conformance


@dataclass
class Query:
    what: str
    answer: Answer

    @property
    def status(self):
        return self.answer.status


@dataclass
class Proof:
    prop: Property
    mode: str
    status: str  # PROVED | REFUTED | UNKNOWN
    basis: str  # "rules" (rules alone) | "engine+rules" | "engine" (engine alone)
    core: list  # a minimal set of rules (and engine groups) that proves it
    engine: str  # the engine model alone: PROVED | REFUTED | UNKNOWN
    seconds: float
    counterexample: object = None  # a z3 model of the negation (REFUTED)
    note: str = ""


def prove(model: Model, prop: Property, *, basis: str = "auto") -> Proof:
    """PROVED from the rules alone when they suffice, else from engine ∧ rules (basis "auto"); the
    core is minimal: drop any member and z3 finds a counterexample."""
    bad = neg(prop.formula(model.universe))
    spent = 0.0
    eng = model.check(model.engine_ids, bad)
    spent += eng.seconds
    engine_status = {"unsat": "PROVED", "sat": "REFUTED"}.get(eng.status, "UNKNOWN")
    tries = {
        "auto": [("rules", model.rule_ids), ("engine+rules", model.rule_ids + model.engine_ids)],
        "rules": [("rules", model.rule_ids)],
        "engine": [("engine", model.engine_ids)],
    }[basis]
    last = None
    for name, use in tries:
        core, a = model.minimal(use, bad)
        spent += a.seconds
        if a.status == "unsat":
            return Proof(prop, model.mode, "PROVED", name, core, engine_status, spent)
        last = (name, a)
    name, a = last
    if a.status == "sat":
        return Proof(
            prop, model.mode, "REFUTED", name, [], engine_status, spent, counterexample=a.model
        )
    return Proof(
        prop,
        model.mode,
        "UNKNOWN",
        name,
        [],
        engine_status,
        spent,
        note=f"solver gave up ({a.reason}) after {a.seconds:.1f} s",
    )


def vacuity(model: Model) -> list[Query]:
    """The rules admit a schedule; so do engine ∧ rules; and whether admission of N+1 can fall
    inside run_batch(N) (intended in ahead, impossible elsewhere)."""
    return [
        Query("the rules admit a schedule", model.check(model.rule_ids)),
        Query("engine ∧ rules admit a schedule", model.check(model.rule_ids + model.engine_ids)),
        Query(
            "admit(N+1) inside run_batch(N) (engine ∧ rules)",
            model.check(model.rule_ids + model.engine_ids, admission_overlap(model.universe)),
        ),
    ]


def conformance(model: Model) -> list[Query]:
    """The engine model satisfies each rule: engine ∧ ¬rule is unsat."""
    return [
        Query(rid, model.check(model.engine_ids, neg(model.groups[rid]))) for rid in model.rule_ids
    ]


# ---- the four-mode table
# The four-mode table of the design: which steps the "result-processing order" column names, per
# mode. Each step is (label, [(event, batch offset from N)]); the order between them is what z3
# computes.
ORDER_STEPS = {
    "normal": [("run(N)", [("fwd_begin", 0)]), ("process(N)", [("process_begin", 0)])],
    "overlap": [
        ("run(N)", [("fwd_begin", 0)]),
        ("process(N-1)", [("process_begin", -1)]),
        ("sample(N)", [("sample", 0)]),
    ],
    "thread": [
        ("run(N)", [("fwd_begin", 0)]),
        ("process(N-1)", [("process_begin", -1)]),
        ("sample(N)", [("sample", 0)]),
    ],
    "ahead": [
        ("build(N)", [("admit", 0)]),
        ("collect/sample(N-1)", [("collect", -1), ("sample", -1)]),
        ("submit(N)", [("submit", 0)]),
        ("process(N-1)", [("process_begin", -1)]),
    ],
}
OLD_PIPELINE = "keeps the old pipeline order"


def _forced(model, use, cond, a: Ev, b: Ev) -> Query:
    """a precedes b in every schedule (with cond): the opposite order is unsat."""
    return Query(
        f"{key_label(a.key)} < {key_label(b.key)}",
        model.check(use, conj(cond, a.exists, b.exists, lt(b, a))),
    )


def mode_row(model: Model, basis: str, n: int = 1) -> tuple[dict, list[Query]]:
    """One row of the design's table for model.mode, every cell a z3 query on `basis` ("rules"
    or "engine")."""
    use = model.rule_ids if basis == "rules" else model.engine_ids
    universe, qs = model.universe, []
    fb = universe.b("fwd_begin", n)
    on_s = Query(
        "run_batch on the scheduler thread", model.check(use, conj(fb.exists, fb.thread == SCHED))
    )
    on_w = Query(
        "run_batch on another thread", model.check(use, conj(fb.exists, fb.thread != SCHED))
    )
    ov = Query("admit(N+1) inside run_batch(N)", model.check(use, admission_overlap(universe)))
    qs += [on_s, on_w, ov]
    where = (
        "scheduler"
        if (on_s.status, on_w.status) == ("sat", "unsat")
        else "worker"
        if (on_s.status, on_w.status) == ("unsat", "sat")
        else "unknown"
    )
    steps = [
        (label, [universe.b(ev, n + off) for ev, off in evs])
        for label, evs in ORDER_STEPS[model.mode]
    ]
    cond = steady(universe, model.mode)
    arrows = []
    for (_, a), (_, b) in zip(steps, steps[1:]):
        q = _forced(model, use, cond, a[-1], b[0])
        qs.append(q)
        arrows.append(" → " if q.status == "unsat" else " ? ")
    for _, evs in steps:  # a compound step ("collect/sample") must be ordered inside too
        for a, b in zip(evs, evs[1:]):
            q = _forced(model, use, cond, a, b)
            qs.append(q)
            if q.status != "unsat":
                arrows.append(" ? ")
    text = steps[0][0] + "".join(arr + label for arr, (label, _) in zip(arrows, steps[1:]))
    row = {
        "run_batch_on": where,
        "admission_overlaps_unreturned_run_batch": {"sat": True, "unsat": False}.get(ov.status),
        "processing_order": text,
    }
    return row, qs


def mode_table(k: int = 3, log=None) -> tuple[dict, dict]:
    """The design's four-mode table computed twice, from the rules alone and from the engine model
    alone. Returns ({"modes": {...}} from the rules, {mode: [disagreements]})."""
    modes, differ = {}, {}
    for mode in MODES:
        model = Model(mode, k)
        row, qs = mode_row(model, "rules")
        erow, eqs = mode_row(model, "engine")
        if log:
            for basis, qq in (("rules", qs), ("engine", eqs)):
                for q in qq:
                    log(
                        f"  {mode:8s} {basis:6s} {q.what:44s} {verdict(q.answer):8s} "
                        f"{q.answer.seconds:7.3f} s"
                    )
        differ[mode] = [k for k in row if row[k] != erow[k]]
        modes[mode] = row
    if modes["thread"]["processing_order"] == modes["overlap"]["processing_order"]:
        modes["thread"]["processing_order"] = (
            f"{OLD_PIPELINE}: {modes['thread']['processing_order']}"
        )
    return {"modes": modes}, differ


def verdict(a: Answer) -> str:
    return {"sat": "witness", "unsat": "UNSAT"}.get(a.status, "UNKNOWN")


# ---- the AHEAD steady state
# The AHEAD steady state (design, steps 1-7) for N = 1: the scenario in which the worker is busy
# with run_batch(N) while the scheduler processes N-1 and builds N+1, and busy with run_batch(N+1)
# while it processes N and builds N+2. z3 finds a schedule of engine ∧ rules with it; the table is
# read off it.
def ahead_scenario(universe, n=1):
    b = universe.b

    def built(m):  # the last event of building batch m
        return batch_groups(universe, m)[0][-1]

    return conj(
        steady(universe, "ahead"),
        lt(b("fwd_begin", n), b("process_begin", n - 1)),
        lt(built(n + 1), b("fwd_end", n)),
        lt(b("fwd_begin", n + 1), b("process_begin", n)),
        lt(built(n + 2), b("fwd_end", n + 1)),
    )


PHASES = [  # scheduler events that start a step of the table, and how the step is called
    ("process_begin", "process_batch_result({b}), KV inflight"),
    ("admit", "build batch {b}"),
    ("collect", "collect({b}), waiting for the worker if needed"),
    ("sample", "sample({b}); snapshot and staging for {next}; early-send cached prefix"),
    ("submit", "submit({b})"),
]


def _rel(m, n):
    return "N" if m == n else f"N{m - n:+d}"


def ahead_steady_table(k: int = 4, n: int = 1):
    """Rows (step, scheduler, forward worker) read from a z3 model of the AHEAD scenario."""
    model = Model("ahead", max(k, n + 3))
    a = model.check(model.rule_ids + model.engine_ids, ahead_scenario(model.universe, n))
    if a.status != "sat":
        return [], a
    witness = a.model
    evs = model.schedule(witness)
    pos = {e.key: i for i, e in enumerate(evs)}  # ranks: "the next event" is +1
    start, stop = pos[("process_begin", n - 1)], pos[("fwd_end", n + 1)]
    phases = dict((ev, text) for ev, text in PHASES)
    rows, cur = [], None
    for e in evs:
        if not start <= pos[e.key] < stop or model.thread_of(witness, e) != SCHED:
            continue
        if e.name in phases:
            m = e.batch
            kind = "build" if e.name == "admit" else e.name
            if cur is None or (kind, m) != cur[:2]:
                cur = (kind, m, pos[e.key])
                rows.append([cur, phases[e.name].format(b=_rel(m, n), next=_rel(m + 1, n))])
    # A step runs from its first scheduler event to the next step's; `collect` is entered as soon as
    # the previous step's work is done (its wait for the worker is part of it).
    sched = sorted(pos[e.key] for e in evs if model.thread_of(witness, e) == SCHED)
    ends = [
        max(p for p in sched if r[0][2] <= p < (rows[i + 1][0][2] if i + 1 < len(rows) else stop))
        for i, r in enumerate(rows)
    ]
    out, before = [], None
    for i, (cur, text) in enumerate(rows):
        lo = ends[i - 1] + 1 if cur[0] == "collect" and i else cur[2]
        hi = rows[i + 1][0][2] if i + 1 < len(rows) else stop
        if i + 1 < len(rows) and rows[i + 1][0][0] == "collect":
            hi = ends[i] + 1
        state = _worker_state(witness, pos, lo, hi, n, model.K)
        out.append(
            (
                i + 1,
                text,
                ("still " + state) if state == before and state.startswith("run_batch") else state,
            )
        )
        before = state
    return out, a


def _worker_state(witness, pos, lo, hi, n, k):
    """What the forward worker does while the scheduler runs the step [lo, hi)."""
    for m in range(k):
        fb, fe = pos[("fwd_begin", m)], pos[("fwd_end", m)]
        if lo <= fb < hi:
            return f"starts run_batch({_rel(m, n)})"
        if lo <= fe < hi or lo <= pos[("batch_copy", m)] < hi:
            return "returns result and batch copy, then idle"
        if fb < lo and fe >= hi:
            return f"run_batch({_rel(m, n)})"
    return "idle"


# ---- a schedule as a timeline


def timeline(model: Model, witness, *, hidden=False, width=34) -> list[str]:
    """A schedule as two lanes, scheduler | forward (and device work when `hidden`)."""
    lanes = [model.thread_name(SCHED), model.thread_name(FWD)] + (["device"] if hidden else [])
    lines = ["      " + " | ".join(f"{x:<{width}}" for x in lanes).rstrip()]
    for i, e in enumerate(model.schedule(witness, hidden=hidden), 1):
        if e.name in ("iteration_end", "iteration_top"):
            continue
        t = model.thread_of(witness, e)
        col = {SCHED: 0, FWD: 1}.get(t, 2)
        cells = [""] * len(lanes)
        cells[col] = _show(e, witness)
        lines.append(f"{i:>4}  " + " | ".join(f"{c:<{width}}" for c in cells).rstrip())
    return lines


def _show(e: Ev, witness) -> str:
    extra = []
    for k in ("obj", "slot", "value", "digest"):
        v = e.f.get(k)
        if is_term(v) and e.name in (
            "alloc",
            "release",
            "chunk_inc",
            "chunk_dec",
            "snapshot",
            "fwd_begin",
        ):
            v = witness.eval(v, model_completion=True).as_long()
            extra.append(f"{k}={'o' if k == 'obj' else 'd' if k == 'digest' else ''}{v}")
    return key_label(e.key) + (f" [{' '.join(extra)}]" if extra else "")
