"""Unbounded proofs of the decode properties over the transition system of decode_transition.py:
for every number of iterations K at once.

The state is finite, so the prover computes the reachable states breadth first, one iteration
after the other, from the state before the first iteration: that set is closed under every
iteration (the strongest inductive invariant). A property holds for every K when no reachable
state is accepting (every arrived request served or aborted, E:env) with its monitor flagged; else
the shortest run to one is the counterexample, printed as a schedule (the scheduler's events, and
the environment's choices of each iteration). With `iterations` = K only the runs of exactly K
iterations count: the bounded model's question. An iteration that leaves the domain
(decode_transition: an event the bounded universe lacks) makes every verdict UNKNOWN. `confirm`
gives z3's second opinion: the iteration built on z3 terms from the same step, R ∧ T ⟹ R', no
move from R leaves the domain, and no state of R is bad.
"""

from __future__ import annotations

import time

import z3

from . import unbounded
from .decode_transition import AFTER_RELEASE, CANON, ONE_QUERY, ROOM_RANK, Step
from .logic import conj, disj
from .properties import DECODE_PROPERTIES
from .unbounded import Result

VARIANTS = {"prefetch": True, "no-prefetch": False}  # the loop calls the prefetch or not
PROPS = (ROOM_RANK, ONE_QUERY, AFTER_RELEASE)


def reach(step: Step, iterations: int | None = None, limit: int = 200000):
    """Breadth first from the state before the first iteration: (layers, domain exit or None,
    complete). Every iteration count (`iterations` None): one layer, each state reached with its
    parent (previous state, environment choice, events); else one layer per iteration, 0..K."""
    names = step.names
    start = tuple(step.initial()[v] for v in names)
    layers, exit_, memo = [{start: None}], None, {}
    frontier = [start]
    while frontier and (iterations is None or len(layers) <= iterations):
        seen = layers[0] if iterations is None else {}
        nxt = []
        for key in frontier:
            s = dict(zip(names, key))
            for e in step.choices(s):
                got = memo.get((key, tuple(e.values())))
                if got is None:
                    s2, events, domain = step.run(s, e)
                    k2 = None if any(d is True for d in domain) else tuple(s2[v] for v in names)
                    got = memo[(key, tuple(e.values()))] = (k2, events)
                k2, events = got
                if k2 is None:
                    exit_ = exit_ or (key, e)
                    continue
                if k2 not in seen:
                    seen[k2] = (key, e, events)
                    nxt.append(k2)
            if sum(map(len, layers)) + len(seen) > limit:
                return layers, exit_, False
        if iterations is not None:
            layers.append(seen)
        frontier = nxt
    return layers, exit_, True


def schedule(layers, key) -> list:
    """(lane, label) per environment choice and scheduler event of the run to `key` (in the last
    layer)."""
    runs, depth = [], len(layers) - 1
    while (entry := layers[depth].get(key)) is not None:
        key, e, events = entry
        runs.append((e, events))
        depth = max(depth - 1, 0)
    out = []
    for n, (e, events) in enumerate(reversed(runs), 1):
        env = [x.replace(":", " ") for x, v in e.items() if v and ":" in x]
        env += [x for x in ("poll", "release", "resume") if e.get(x)]
        out.append(("environment", f"iteration {n}: " + (", ".join(env) or "-")))
        out += [("scheduler", _label(k)) for k, c, _ in events if c is True]
    return out


def _label(key) -> str:
    name, *rest = key
    if name in ("prefetch_submit", "prefetch_cancel", "resolve", "query_begin"):
        a, tag, rooms, *more = rest
        what = "prefetched" if isinstance(tag, int) else tag
        extra = f"+{','.join(map(str, more[0]))}" if more else ""
        return f"{name}(addr{a} {what} [{','.join(map(str, rooms))}]{extra})"
    return f"{name}({','.join(map(str, rest))})" if rest else name


def timeline_lines(trace) -> list[str]:
    """A decode counterexample: the scheduler's steps beside the environment's moves."""
    return unbounded.timeline_lines(trace, width=44, lanes=("scheduler", "environment"))


def prove_variant(variant="prefetch", props=None, mutants=(), iterations=None) -> list[Result]:
    """Every decode property (or those in `props`) of a variant, for every K (or K = iterations)."""
    step = Step(VARIANTS[variant], mutants)
    ids = [p.id for p in DECODE_PROPERTIES if not props or p.id in props]
    t0 = time.perf_counter()
    layers, exit_, complete = reach(step, iterations)
    spent = time.perf_counter() - t0
    states = [dict(zip(step.names, k)) for k in layers[-1]]
    keys = list(layers[-1])
    mode = f"decode/{variant}"
    out = []
    for pid in ids:
        bad = [k for k, s in zip(keys, states) if step.accepting(s) and step.violated(s, pid)]
        if not complete or exit_ is not None:
            why = "state limit reached" if not complete else "left the encoding's domain"
            out.append(Result(pid, mode, "UNKNOWN", None, spent, why))
        elif bad:
            trace = schedule(layers, bad[0])
            n = sum(lane == "environment" for lane, _ in trace)
            out.append(Result(pid, mode, "REFUTED", n, spent, f"reachable, {n} iterations", trace))
        else:
            how = f"reachable set, {sum(map(len, layers))} states"
            out.append(Result(pid, mode, "PROVED", None, spent, how))
    return out


def prove_all(variants=tuple(VARIANTS), props=None, mutants=()) -> list[Result]:
    out = []
    for v in variants:
        out += prove_variant(v, props, mutants)
    return out


def confirm(step: Step, states, prop_ids, timeout_ms=120000) -> dict:
    """z3's second opinion on a search: with `states` as R, over the iteration built on z3 terms
    for each age, is R ∧ E ∧ T ⟹ R' valid, does no move from R leave the domain, and is no
    accepting state of R flagged, for each property? {"inductive", "domain", id: z3 result}
    ("unsat" = yes)."""
    names = step.names

    def var(v, tag):
        return z3.Int(f"{v}@{tag}") if v in ("mem", "age") else z3.Bool(f"{v}@{tag}")

    s = {v: var(v, "a") for v in names}

    def member(st, keys):
        return z3.Or(
            *[z3.And(*[st[v] == x for v, x in zip(names, key)]) for key in keys] or [False]
        )

    out = {"inductive": "unsat", "domain": "unsat"}
    for age in range(1, CANON + 1):
        mine = [k for k in states if k[names.index("age")] == age]
        if not mine:
            continue
        sa = {**s, "age": age}
        e = {x: z3.Bool(f"{x}@e") for x in step.env_names()}
        s2, _, domain = step.run(sa, e)
        sv = z3.Solver()
        sv.set(timeout=timeout_ms)
        sv.add(member(sa, mine), *step.env_ok(sa, e), *step.groups["E:loop"])
        succ = {v: z3.BoolVal(x) if isinstance(x, bool) else x for v, x in s2.items()}
        nxt = z3.Or(
            *[z3.And(*[succ[v] == x for v, x in zip(names, key)]) for key in states] or [False]
        )
        for what, goal in (("inductive", z3.Not(nxt)), ("domain", disj(*domain))):
            if out[what] != "unsat" or goal is False:
                continue
            sv.push()
            sv.add(goal)
            out[what] = str(sv.check())
            sv.pop()
    for pid in prop_ids:
        sv = z3.Solver()
        sv.set(timeout=timeout_ms)
        bad = conj(step.accepting(s), step.violated(s, pid))
        sv.add(member(s, states), bad if not isinstance(bad, bool) else z3.BoolVal(bad))
        out[pid] = str(sv.check())
    return out
