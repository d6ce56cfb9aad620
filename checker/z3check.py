"""The second trace checker: every rule of spec/ as z3 constraints over the trace's events.

Each event becomes a z3 position tied to its seq by a fact switched on by the event's own literal;
each rule becomes the obligations its template kind's encoding yields (spec/z3model/, the same
encodings the proofs use), switched on by the rule's literal. The trace satisfies a rule iff z3
finds the rule's obligations and the event facts satisfiable; when it cannot, the unsat core names
the rule and the events that conflict with it, shrunk until dropping any event makes it consistent.

Obligations only read the facts of the events they name, so they are solved in windows of a bounded
size: long traces cost time linear in their length. A window the solver gives up on, or a trace over
the size budget, makes the verdict UNKNOWN with what was covered, never PASS.

A truncated trace (checker/trace_io.py `truncation`) is judged as the linear checker judges it: the
rules a prefix can break are solved, those that need the run's end (`needs_end`) are listed as not
judged, and the verdict is FAIL or INCOMPLETE, never PASS.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import z3

from spec import Rule, load_rules
from spec.z3model import TraceUniverse, as_z3, conj, implies, obligations

from .report import ended_by, ignored_note, truncation_lines
from .trace_io import iter_events, truncation

WINDOW = 2000  # obligations per solver
TIMEOUT_MS = 20000  # per check
MAX_OBLIGATIONS = 2_000_000  # size budget


@dataclass
class Core:
    rule: Rule
    events: list[dict]  # the minimal conflicting events, in trace order


@dataclass
class Z3Result:
    path: str
    header: dict
    events: int
    status: str  # "pass" | "fail" | "unknown" | "incomplete" (truncated, nothing broken)
    rules: list = field(
        default_factory=list
    )  # [(Rule, obligations)]: instances, trivial ones included
    cores: dict = field(default_factory=dict)  # rule id -> Core
    not_encoded: list = field(default_factory=list)
    uncovered: list = field(default_factory=list)  # what an UNKNOWN did not cover, one line each
    windows: int = 0
    seconds: float = 0.0
    ignored: dict = field(
        default_factory=dict
    )  # events of kinds no rule knows, skipped: ev -> count
    truncated: int | None = None  # the line a truncated trace stops at (as checker.linear)
    not_judged: list = field(default_factory=list)  # the needs_end rules of a truncated trace
    end_reason: str | None = None  # its trace_end's reason (None: no trace_end)

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    @property
    def violated(self) -> list[str]:
        return sorted(self.cores)


def _load(path, ignored: dict | None = None, status: dict | None = None):
    header: dict = {}
    events = [e for _, e in iter_events(path, header_out=header, ignored=ignored, status=status)]
    if not header:  # an empty trace still has its header read by iter_events
        next(iter_events(path, header_out=header), None)
    return header, events


def _judged(rules: list[Rule], cut: int | None) -> tuple[list[Rule], list[str]]:
    """The rules to solve and the ids of those left unjudged: on a truncated trace (`cut` is its
    line) the rules that need the run's end say nothing."""
    if cut is None:
        return rules, []
    return [r for r in rules if not r.needs_end], sorted({r.id for r in rules if r.needs_end})


def _mark_truncated(res: Z3Result, cut: int | None, not_judged: list, end: dict | None) -> None:
    res.end_reason = end["reason"] if end else None
    if cut is None:
        return
    res.truncated, res.not_judged = cut, not_judged
    if res.status == "pass":
        res.status = "incomplete"


def check_file(
    path: str,
    *,
    rules: list[Rule] | None = None,
    window: int = WINDOW,
    timeout_ms: int = TIMEOUT_MS,
    max_obligations: int = MAX_OBLIGATIONS,
    rlimit: int = 0,
) -> Z3Result:
    t0 = time.perf_counter()
    ignored: dict = {}
    status: dict = {}
    header, events = _load(path, ignored, status)
    role, mode = header["role"], header.get("mode")
    rules = [r for r in (rules or load_rules()) if r.role == role and r.applies(mode, header)]
    cut = truncation(status)
    rules, not_judged = _judged(rules, cut)
    res = _check(
        path,
        header,
        events,
        TraceUniverse(header, events),
        rules,
        t0,
        window=window,
        timeout_ms=timeout_ms,
        max_obligations=max_obligations,
        rlimit=rlimit,
    )
    res.ignored = ignored
    _mark_truncated(res, cut, not_judged, status.get("end"))
    return res


def check_cross(
    paths, *, rules: list[Rule] | None = None, truncated: int | None = None, **kw
) -> list[Z3Result]:
    """The cross rules (role "cross"): each decode trace among `paths` with the prefill traces among them
    that name their DP rank (header dp_rank) as facts; nothing when there is no such pair. As
    checker.decode_templates.check_cross. `truncated`: the line at which one of the traces given
    was cut (the cross rules read it too), as checker.linear.check_files."""
    from .decode_templates import cross_pairs

    _, prefills, decodes = cross_pairs(paths)
    if not prefills or not decodes:
        return []
    statuses = [{} for _ in prefills]
    remote = [_load(p, status=st) for p, st in zip(prefills, statuses)]
    out = []
    for d in decodes:
        t0 = time.perf_counter()
        dh, events = _load(d)
        header = {**dh, "role": "cross", "prefill_traces": prefills}
        universe = TraceUniverse(header, events)
        for (h, evs), st in zip(remote, statuses):
            end = st.get("end")
            universe.add_remote(h, evs, stopped=end is not None and end.get("reason") != "normal")
        mine = [
            r for r in (rules or load_rules()) if r.role == "cross" and r.applies(dh.get("mode"))
        ]
        mine, not_judged = _judged(mine, truncated)
        res = _check(d, header, events, universe, mine, t0, **kw)
        _mark_truncated(res, truncated, not_judged, None)
        out.append(res)
    return out


def check_files(paths, *, rules: list[Rule] | None = None) -> list[Z3Result]:
    """Each file against its role's rules, then the cross rules of each decode trace with the
    prefill traces given alongside it (`pdo check --engine z3`)."""
    results = [check_file(p, rules=rules) for p in paths]
    cut = next((r.truncated for r in results if r.truncated is not None), None)
    return results + check_cross(list(paths), rules=rules, truncated=cut)


def _check(
    path,
    header,
    events,
    universe,
    rules,
    t0,
    *,
    window: int = WINDOW,
    timeout_ms: int = TIMEOUT_MS,
    max_obligations: int = MAX_OBLIGATIONS,
    rlimit: int = 0,
) -> Z3Result:
    res = Z3Result(path, header, len(events), "pass")
    todo, counts = [], {}
    for r in rules:
        obs = obligations(r, universe, counts)
        if obs is None:
            res.not_encoded.append(r.id)
            continue
        res.rules.append((r, counts[r.id]))
        todo += [(r, f, evs) for f, evs in obs]
        if len(todo) > max_obligations:
            res.status = "unknown"
            res.uncovered.append(
                f"size budget: over {max_obligations} obligations at rule {r.id}; nothing solved"
            )
            res.seconds = time.perf_counter() - t0
            return res
    by_seq = {e["seq"]: e for e in events}
    for i in range(0, len(todo), window):
        res.windows += 1
        _solve_window(todo[i : i + window], res, by_seq, timeout_ms, i // window, rlimit)
    if res.cores:
        res.status = "fail"
    elif res.uncovered:
        res.status = "unknown"
    res.seconds = time.perf_counter() - t0
    return res


def _solve_window(
    chunk, res: Z3Result, by_seq: dict, timeout_ms: int, index: int, rlimit: int = 0
) -> None:
    chunk = [
        (r, f, evs) for r, f, evs in chunk if r.id not in res.cores
    ]  # one core per rule is enough
    if not chunk:
        return
    # First the verdict: positions fixed outright, one literal per rule.
    s = z3.Solver()
    s.set(timeout=timeout_ms)
    if rlimit:
        s.set(rlimit=rlimit)
    rule_lit = {r.id: z3.Bool(f"rule:{r.id}") for r, _, _ in chunk}
    seen = {}
    for _, _, evs in chunk:
        for e in evs:
            seen.setdefault(e.seq, e)
    s.add(
        conj(*[e.pos == e.seq for e in seen.values()]),
        conj(*[implies(rule_lit[r.id], f) for r, f, _ in chunk]),
    )
    got = s.check(*rule_lit.values())
    if got == z3.sat:
        return
    if got != z3.unsat:
        res.uncovered.append(
            f"window {index}: rules {', '.join(sorted(rule_lit))} not decided ({s.reason_unknown()})"
        )
        return
    for rid, lit in rule_lit.items():
        got = s.check(lit)
        if got == z3.unsat:
            mine = [(r, f, evs) for r, f, evs in chunk if r.id == rid]
            res.cores[rid] = Core(mine[0][0], [by_seq[q] for q in _core(mine, timeout_ms)])
        elif got != z3.sat:
            res.uncovered.append(f"window {index}: rule {rid} not decided ({s.reason_unknown()})")


def _core(obls, timeout_ms) -> list[int]:
    """The events of a minimal conflict with one rule: each event's position fact behind its own
    literal. A formula that folded to a constant read only static fields, so all its events are the
    reason; otherwise its subject switches it on and the other events enter through their positions."""
    s = z3.Solver()
    s.set(timeout=timeout_ms)
    lit, facts = {}, []
    for _, f, evs in obls:
        for e in evs:
            if e.seq not in lit:
                lit[e.seq] = z3.Bool(f"#{e.seq}")
                facts.append(implies(lit[e.seq], e.pos == e.seq))
        anchors = evs if isinstance(f, bool) else evs[:1]
        facts.append(implies(conj(*[lit[e.seq] for e in anchors]), as_z3(f)))
    s.add(*facts)
    if s.check(*lit.values()) != z3.unsat:
        return []
    return sorted(_minimise(s, s.unsat_core()))


def _minimise(s, lits) -> list[int]:
    """Deletion: drop each event whose fact is not needed for the conflict."""
    keep = list(lits)
    for lit in list(keep):
        trial = [x for x in keep if not x.eq(lit)]
        if s.check(*trial) == z3.unsat:
            core = {str(c) for c in s.unsat_core()}
            keep = [x for x in trial if str(x) in core]
    return [int(str(x)[1:]) for x in keep]


def conflicts(path: str, rule_id: str, seqs) -> bool:
    """Do the positions of exactly these events (the others free) contradict the rule? A reported core
    is a conflict, and dropping any one of its events leaves none: that is what minimal means."""
    from spec import rule_by_id

    header, events = _load(path)
    rule = rule_by_id(rule_id)
    universe = TraceUniverse(header, events)
    keep = set(seqs)
    s = z3.Solver()
    for f, evs in obligations(rule, universe):
        anchors = evs if isinstance(f, bool) else evs[:1]
        if all(e.seq in keep for e in anchors):
            s.add(as_z3(f))
    s.add(*[e.pos == e.seq for e in universe.events if e.seq in keep])
    return s.check() == z3.unsat


# ---- reports ---------------------------------------------------------------------------------------


def _brief(e: dict) -> str:
    keys = [
        k for k in ("batch", "rid", "obj", "slot", "value", "digest", "tokens", "pages") if k in e
    ]
    return f"#{e['seq']} {e['ev']}({','.join(f'{k}={e[k]}' for k in keys)}) on {e['thread']}"


def text_report(res: Z3Result) -> str:
    h = res.header
    name = f"{res.path} ({h.get('role')}, mode={h.get('mode', '-')})"
    nobs = sum(n for _, n in res.rules)
    stats = f"{res.events} events, {len(res.rules)} rules, {nobs} obligations, {res.windows} window(s), z3 {res.seconds:.2f} s"
    lines = []
    if res.status == "pass":
        lines.append(f"PASS {name}: {stats}")
        lines += [f"  {r.id:32s} {n:7d} obligations" for r, n in res.rules]
    elif res.status == "incomplete":
        lines.append(
            f"INCOMPLETE {name}: truncated at line {res.truncated}{ended_by(res)}; {stats}, none broken"
        )
        lines += [f"  {r.id:32s} {n:7d} obligations" for r, n in res.rules]
    elif res.status == "fail":
        lines.append(f"FAIL {name}: {len(res.cores)} rule(s) violated; {stats}")
        if res.truncated is not None:
            lines.append(f"  truncated at line {res.truncated}{ended_by(res)}")
        for rid in res.violated:
            c = res.cores[rid]
            lines.append(f"\n[{rid}] {c.rule.statement}")
            lines.append(f"  minimal conflict: rule {rid} + {len(c.events)} event(s)")
            lines += [f"    {_brief(e)}" for e in c.events]
            lines.append(f"  seed: {c.rule.design}")
    else:
        lines.append(f"UNKNOWN {name}: {stats}")
    if res.uncovered:
        lines.append("  not covered (UNKNOWN, not a pass):")
        lines += [f"    {u}" for u in res.uncovered]
    if res.not_encoded:
        lines.append(
            f"  rules of kinds without a z3 encoding (not checked): {', '.join(res.not_encoded)}"
        )
    lines += ignored_note(res.ignored) + truncation_lines(res)
    return "\n".join(lines)


def json_report(res: Z3Result) -> dict:
    return {
        "path": res.path,
        "ok": res.ok,
        "status": res.status,
        "engine": "z3",
        "events": res.events,
        "ignored": res.ignored,
        "truncated": res.truncated,
        "not_judged": res.not_judged,
        "end_reason": res.end_reason,
        "header": {k: res.header.get(k) for k in ("role", "mode", "version", "page_size")},
        "rules": [{"id": r.id, "obligations": n} for r, n in res.rules],
        "violations": [
            {"rule": rid, "statement": c.rule.statement, "seqs": [e["seq"] for e in c.events]}
            for rid, c in sorted(res.cores.items())
        ],
        "not_encoded": res.not_encoded,
        "uncovered": res.uncovered,
        "seconds": round(res.seconds, 3),
    }
