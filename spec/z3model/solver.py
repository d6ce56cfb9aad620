"""The solver of the model: one mode's universe, its engine groups and its rules in one incremental
z3 solver, each group behind a literal so that every query chooses what it assumes and unsat cores
name what a proof used; and the schedule a z3 model describes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction

import z3

from .. import load_rules
from .decode_loops import (
    DECODE_MODEL_MUTANTS,
    DECODE_MODES,
    DECODE_THREADS,
    DecodeUniverse,
    DecodeWorkload,
    decode_engine,
)
from .encoding import ENCODERS, rule_formula
from .logic import as_z3, conj, is_term
from .prefill_loops import engine_model
from .prefill_universe import ModelUniverse, Workload
from .universe import MODES, THREAD_IDS, Ev, distinct_compared, frame


def position(model, e: Ev):
    """The (real-valued) position of e in a z3 model, as a Fraction."""
    v = model.eval(e.pos, model_completion=True)
    if z3.is_rational_value(v):
        return Fraction(v.numerator_as_long(), v.denominator_as_long())
    return Fraction(v.as_long())


@dataclass
class Answer:
    status: str  # "sat" | "unsat" | "unknown"
    seconds: float
    model: object = None  # a z3 model when sat: a witness or counterexample schedule
    core: list = None  # group names when unsat
    reason: str = ""


class Model:
    """One mode with K batches: frame, engine groups and rules in one incremental solver, each group
    behind a literal so every query chooses what it assumes and cores name what a proof used."""

    def __init__(
        self,
        mode: str,
        k: int = 4,
        *,
        workload: Workload | DecodeWorkload | None = None,
        drop=(),
        mutants=(),
        timeout_ms: int = 60000,
        rlimit: int = 0,
        rules=None,
        page_size: int = 16,
        role: str = "prefill",
    ):
        t0 = time.perf_counter()
        if mode not in (DECODE_MODES if role == "decode" else MODES):
            raise ValueError(f"unknown {role} mode {mode!r}")
        self.mode, self.mutants, self.role = mode, tuple(mutants), role
        # U: the universe of events (a public attribute: tests and `pdo spec` read `model.universe`)
        if role == "decode":
            # a trace's workload (spec/z3model/decode_traces.py), else the canonical one
            decode_workload = workload if isinstance(workload, DecodeWorkload) else None
            unknown = set(mutants) - set(DECODE_MODEL_MUTANTS)
            if unknown:
                raise ValueError(f"unknown decode model mutant(s): {', '.join(sorted(unknown))}")
            decode_workload = decode_workload or DecodeWorkload(k, mutants=self.mutants)
            self.universe = DecodeUniverse(decode_workload, page_size)
        else:
            self.universe = ModelUniverse(workload or Workload.canonical(k), page_size)
        self.K = self.universe.K
        rules = load_rules() if rules is None else rules  # () : no rule, the engine groups only
        all_rules = [r for r in rules if r.role == role and r.applies(mode)]
        unknown = set(drop) - {r.id for r in all_rules}
        if unknown:
            raise ValueError(f"no rule {', '.join(sorted(unknown))} applies to mode {mode}")
        # rules that read events the loop model does not emit (spec/events.toml loop_model = false)
        self.not_modelled = [r.id for r in all_rules if not r.loop_model]
        self.rules = [r for r in all_rules if r.id not in drop and r.loop_model]
        self.not_encoded = [r.id for r in self.rules if r.kind not in ENCODERS]
        if role == "decode":
            engine = decode_engine(self.universe)
        else:
            lemmas = any(r.kind == "adjacent" for r in self.rules)
            engine = engine_model(self.universe, mode, mutants, lemmas=lemmas)
        self.groups = {
            r.id: rule_formula(r, self.universe) for r in self.rules if r.kind in ENCODERS
        }
        self.rule_ids = list(self.groups)
        self.groups.update({n: conj(*c) for n, c in engine.items()})
        self.engine_ids = list(engine)
        self.solver = z3.Solver()
        self.solver.set(timeout=timeout_ms)
        if rlimit:  # a deterministic budget (z3 resource units), for tests of the UNKNOWN path
            self.solver.set(rlimit=rlimit)
        self._distinct = set()  # compared pairs whose distinctness is asserted
        self.solver.add(*frame(self.universe, self._distinct))
        self.lit, self._by_lit, self._extra = {}, {}, {}
        for name, f in self.groups.items():
            lit = z3.Bool(f"[{name}]")
            self.solver.add(z3.Implies(lit, as_z3(f)))
            self.lit[name], self._by_lit[str(lit)] = lit, name
        self.build_seconds = time.perf_counter() - t0

    def _assume(self, f):
        f = as_z3(f)
        lit = self._extra.get(f.get_id())
        if lit is None:
            lit = self._extra[f.get_id()] = z3.Bool(f"[q{len(self._extra)}]")
            self.solver.add(z3.Implies(lit, f), *distinct_compared(self.universe, self._distinct))
        return lit

    def check(self, use, extra=True) -> Answer:
        lits = [self.lit[n] for n in use] + ([] if extra is True else [self._assume(extra)])
        t0 = time.perf_counter()
        r = self.solver.check(*lits)
        if r == z3.sat:
            return Answer("sat", time.perf_counter() - t0, model=self.solver.model())
        dt = time.perf_counter() - t0
        if r == z3.unsat:
            core = [
                self._by_lit[str(c)] for c in self.solver.unsat_core() if str(c) in self._by_lit
            ]
            return Answer("unsat", dt, core=core)
        return Answer("unknown", dt, reason=self.solver.reason_unknown())

    def minimal(self, use, extra=True):
        """A minimal subset of `use` with (subset ∧ extra) unsat: deletion from the unsat core
        and every rule, engine groups tried first so that rules are kept where they suffice
        (z3's first core may hold an engine group and no rule though a rule would do). None when
        not unsat."""
        a = self.check(use, extra)
        if a.status != "unsat":
            return None, a
        keep = [n for n in use if n in a.core or not n.startswith("E:")]
        spent = a.seconds
        for n in sorted(keep, key=lambda x: (not x.startswith("E:"), x)):
            if n not in keep:
                continue
            trial = [x for x in keep if x != n]
            b = self.check(trial, extra)
            spent += b.seconds
            if b.status == "unsat":
                # the core shrinks the engine groups only: which core z3 returns depends on its
                # state, and a core without a rule that would also do must not drop that rule
                keep = [x for x in trial if x in b.core or not x.startswith("E:")]
        return keep, Answer("unsat", spent, core=keep)

    # -- reading a schedule out of a z3 model
    def schedule(self, model, hidden=False) -> list[Ev]:
        evs = [
            e
            for e in self.universe.events
            if z3.is_true(model.eval(as_z3(e.exists), model_completion=True))
        ]
        if hidden:
            evs += self.universe.hidden
        return sorted(evs, key=lambda e: (position(model, e), str(e.key)))

    def thread_name(self, t: int) -> str:
        names = {v: k for k, v in (DECODE_THREADS if self.role == "decode" else THREAD_IDS).items()}
        return names.get(t, "device")

    def thread_of(self, model, e) -> int:
        if isinstance(e.thread, int):
            return e.thread
        return model.eval(e.thread, model_completion=True).as_long()

    def to_trace(self, model) -> tuple[dict, list[dict]]:
        """The schedule of a z3 model as a pdo-trace (header, events): objects, digests, slots,
        counter values and token counts read from the model. Used to test witnesses with the linear
        checker."""
        header = {
            "format": "pdo-trace",
            "version": 1,
            "role": self.role,
            "mode": self.mode,
            "page_size": self.universe.page_size,
            "source": "spec.z3model",
        }
        if self.role == "decode":
            header["prefetch"] = True

        def value(v):
            if not is_term(v):
                return v
            got = model.eval(v, model_completion=True)
            return z3.is_true(got) if z3.is_bool(got) else got.as_long()

        out = []
        for i, e in enumerate(self.schedule(model), 1):
            thread = self.thread_name(self.thread_of(model, e))
            d = {"seq": i, "t_ns": i * 1000, "thread": thread, "ev": e.name}
            for k, v in e.f.items():
                if is_term(v):
                    v = value(v)
                    v = f"o{v}" if k == "obj" else f"d{v}" if k == "digest" else v
                elif isinstance(v, dict):
                    v = {r: value(x) for r, x in v.items()}
                d[k] = list(v) if isinstance(v, tuple) else v
            if e.batch is not None:
                d["batch"] = e.batch
            out.append(d)
        return header, out
