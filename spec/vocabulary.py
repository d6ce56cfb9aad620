"""The words the engine, both models of the loops, the checker and the CLI share: the loop modes, the
thread roles, and each trace event's fields in the order logged (spec/events.toml).

One source, read by all of them: the engine declares its events from here (engine/trace/tracer.py logs
them positionally, so the order of a `fields` table is the order of its call sites), the models and the checker
read the same modes and events, the CLI offers the same choices. Standard library only, and cheap to
import: the engine core imports it (tests/layers.py puts it in a layer of its own, below the engine),
and `pdo --help` must stay quick, so events.toml is read at the first question, not at import.
"""

from __future__ import annotations

import functools
import pathlib

from spec.errors import BadInput, InternalError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# ---- loops ---------------------------------------------------------------------------------------
# The prefill event loops of the design: SGLang's normal and overlap loops, and the forward-thread loop
# in its validation mode (thread) and with admission ahead of the forward (ahead).
PREFILL_LOOPS = ("normal", "overlap", "thread", "ahead")
THREAD_LOOPS = ("thread", "ahead")  # the prefill loops with a forward thread
DECODE_LOOPS = ("normal", "overlap")  # event_loop_{normal,overlap}_disagg_decode
# The loop modes a trace of each role may declare; a cross-process rule is a decode loop's.
LOOP_MODES = {"prefill": PREFILL_LOOPS, "decode": DECODE_LOOPS, "cross": DECODE_LOOPS}

# ---- thread roles (an event's `thread`) ----------------------------------------------------------
SCHEDULER = "scheduler"  # each role's event loop
FORWARD = "forward"  # the prefill forward thread (THREAD_LOOPS)
TRANSFER = "transfer"  # the KV transfer thread of a prefill rank
PREFETCH = "prefetch"  # decode's bootstrap-query pool: its threads are prefetch_0, prefetch_1, ...
THREADS = (SCHEDULER, FORWARD)  # the roles a rule may name (spec/__init__.py PARAMS "thread")

# ---- events --------------------------------------------------------------------------------------
EVENTS_FILE = pathlib.Path(__file__).with_name("events.toml")


@functools.cache
def events() -> dict[str, dict[str, dict]]:
    """role -> ev -> its entry of spec/events.toml, with `fields` split by the `?` mark: `fields`
    (name -> type, required), `optional` (name -> type) and `order` (every name, in the order
    logged). Read once: the file is part of the code."""
    return load(EVENTS_FILE)


def load(path: pathlib.Path) -> dict[str, dict[str, dict]]:
    """events(), from the file `path`."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    return {
        role: {ev: _entry(path, role, ev, entry) for ev, entry in kinds.items()}
        for role, kinds in raw.items()
    }


def _entry(path: pathlib.Path, role: str, ev: str, entry: dict) -> dict:
    names = entry.get("fields")
    if not isinstance(names, dict):
        raise BadInput(f"{path}: [{role}.{ev}]: 'fields' must be a table of field -> type")
    required = {n: typ for n, typ in names.items() if not n.endswith("?")}
    optional = {n[:-1]: typ for n, typ in names.items() if n.endswith("?")}
    order = tuple(n.rstrip("?") for n in names)
    return {**entry, "fields": required, "optional": optional, "order": order}


def declared(role: str, *names: str, without: dict | None = None) -> dict[str, tuple[str, ...]]:
    """ev -> its fields in the order logged, for a logger's `Tracer.events_for`: the events `names`
    of `role`, each less the optional fields `without[ev]` (those its logger never writes)."""
    out = {}
    for ev in names:
        entry, left_out = events()[role][ev], (without or {}).get(ev, ())
        if not set(left_out) <= set(entry["optional"]):
            raise InternalError(f"{EVENTS_FILE}: [{role}.{ev}]: {left_out} are not all optional")
        out[ev] = tuple(n for n in entry["order"] if n not in left_out)
    return out
