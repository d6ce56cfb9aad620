"""One encoding per rule template kind, in one registry: a rule of spec/rules.toml or
spec/decode_rules.toml becomes z3 obligations over a universe of events.

An encoder `(rule, universe)` yields (formula, events) obligations; a rule holds iff all its
obligations do. `events` are the events whose facts the obligation reads (the trace checker reports
them in unsat cores). The same encoders serve the symbolic universes of the proofs and the
TraceUniverse of the z3 trace checker (checker/z3check.py), so both read the rules through one
encoding. The encoders of prefill_encodings.py and decode_encodings.py register themselves here
with `@ENCODERS.register(kind)`; importing the package imports both.
"""

from __future__ import annotations

from ..registry import Registry
from .logic import conj

ENCODERS: Registry = Registry("z3 encoding")


def obligations(rule, universe, counts: dict | None = None):
    """The rule's obligations in the universe, trivially true ones left out (`counts[rule.id]` gets
    how many there were in all); None if its kind has no encoding."""
    if rule.kind not in ENCODERS:
        return None
    every = list(ENCODERS[rule.kind](rule, universe))
    if counts is not None:
        counts[rule.id] = len(every)
    return [(f, evs) for f, evs in every if f is not True]


def rule_formula(rule, universe):
    obs = obligations(rule, universe)
    return None if obs is None else conj(*[f for f, _ in obs])
