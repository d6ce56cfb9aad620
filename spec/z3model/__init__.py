"""The formal model of the prefill loops (and of the decode prefetch), in z3.

The modules, in the order they build on each other:

- logic: formula builders that fold plain Python booleans away (traces) and make z3 terms (models).
- universe: events with a position, a thread, an existence flag and fields; the look-ups the
  encodings use; the frame every schedule satisfies.
- encoding, prefill_encodings, decode_encodings, receiver_encodings: one encoding per rule template
  `kind` of spec/rules.toml and spec/decode_rules.toml, in the registry ENCODERS. The same
  encodings serve the symbolic universes (proofs) and TraceUniverse (the z3 trace checker,
  checker/z3check.py), so that checker agreeing with the fast linear one (tests/checker/test_z3_checker.py)
  is evidence the proofs are about the same rules.
- prefill_universe, prefill_loops, decode_loops: the universes of K batches (prefill) and of a few
  iterations of the decode prefetch, and the engine model of each: what the loop code does, in which
  order, on which thread, in named groups ("E:...") so that unsat cores say which part of the
  engine a proof needed.
- properties: the design's safety claims as formulas, stated without the rules.
- solver: `Model`, one mode's frame, engine groups and rules in one incremental solver.
- queries: `prove`, `vacuity`, `conformance`, `mode_table`, `ahead_steady_table`, `timeline`: the
  answers `pdo spec` prints.
- traces: a concrete trace as a universe, its workload, and whether it is a schedule of the loop
  model; decode_workload, decode_traces: the decode model's workload, narrowed to a decode trace's,
  and whether that trace is a schedule of the decode loop model.
- transition, unbounded: the prefill loops as finite transition systems read off the loop model's
  step definitions, and the properties proved on them for every K; decode_transition,
  decode_unbounded: the same for the decode prefetch loop; unbounded_run: `pdo spec prove
  --unbounded` and the table of docs/spec.md.

This package re-exports the names other code uses, so `from spec.z3model import X` and
`spec.z3model.X` keep working.
"""

from __future__ import annotations

from .. import LOOP_MODES, load_events, load_rules
from . import decode_encodings, delivery_encodings, prefill_encodings, receiver_encodings  # noqa: F401  (fill ENCODERS)
from .decode_loops import (
    DECODE_ENGINE_GROUPS,
    DECODE_MODEL_MUTANTS,
    DECODE_MODES,
    DECODE_THREADS,
    FIRST_SUBMIT,
    DecodeUniverse,
    DecodeWorkload,
    decode_engine,
)
from .encoding import ENCODERS, obligations, rule_formula
from .logic import as_z3, conj, disj, eq, implies, is_term, lt, neg
from .prefill_loops import EMITTED, ENGINE_GROUPS, ENGINE_MUTANTS, WORKER_EVENTS, engine_model
from .prefill_universe import Chunk, ModelUniverse, Workload, batch_event_names, batch_groups
from .properties import DECODE_PROPERTIES, PROPERTIES, Property, properties
from .queries import (
    OLD_PIPELINE,
    ORDER_STEPS,
    PHASES,
    Proof,
    Query,
    admission_overlap,
    ahead_scenario,
    ahead_steady_table,
    conformance,
    mode_row,
    mode_table,
    outside_universe,
    prefetch_used,
    prefetch_used_later,
    prove,
    query_after_cancel,
    steady,
    timeline,
    vacuity,
    verdict,
)
from .solver import Answer, Model, position
from .traces import Refinement, TraceUniverse, fits_engine, refinement, workload_of
from .universe import (
    FWD,
    MODES,
    SCHED,
    STREAM,
    THREAD_IDS,
    THREAD_MODES,
    THREAD_NAMES,
    Ev,
    SymbolicUniverse,
    Universe,
    distinct_compared,
    frame,
    key_label,
)

__all__ = [
    "DECODE_ENGINE_GROUPS",
    "DECODE_MODEL_MUTANTS",
    "DECODE_MODES",
    "DECODE_PROPERTIES",
    "DECODE_THREADS",
    "EMITTED",
    "ENCODERS",
    "ENGINE_GROUPS",
    "ENGINE_MUTANTS",
    "FIRST_SUBMIT",
    "FWD",
    "LOOP_MODES",
    "MODES",
    "OLD_PIPELINE",
    "ORDER_STEPS",
    "PHASES",
    "PROPERTIES",
    "SCHED",
    "STREAM",
    "THREAD_IDS",
    "THREAD_MODES",
    "THREAD_NAMES",
    "WORKER_EVENTS",
    "Answer",
    "Chunk",
    "DecodeUniverse",
    "DecodeWorkload",
    "Ev",
    "Model",
    "ModelUniverse",
    "Proof",
    "Property",
    "Query",
    "SymbolicUniverse",
    "TraceUniverse",
    "Universe",
    "Workload",
    "admission_overlap",
    "ahead_scenario",
    "ahead_steady_table",
    "as_z3",
    "batch_event_names",
    "batch_groups",
    "conformance",
    "conj",
    "decode_engine",
    "disj",
    "distinct_compared",
    "engine_model",
    "eq",
    "fits_engine",
    "refinement",
    "Refinement",
    "frame",
    "implies",
    "is_term",
    "key_label",
    "load_events",
    "load_rules",
    "lt",
    "mode_row",
    "mode_table",
    "neg",
    "obligations",
    "outside_universe",
    "position",
    "prefetch_used",
    "prefetch_used_later",
    "properties",
    "prove",
    "query_after_cancel",
    "rule_formula",
    "steady",
    "timeline",
    "vacuity",
    "verdict",
    "workload_of",
]
