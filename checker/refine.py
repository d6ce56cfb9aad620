"""The engine against its own model: is a prefill trace a schedule of spec/z3model's loop model of
its mode, a decode trace one of the decode loop model (`pdo check --model`)? When it is not, the
report names the engine groups (E:...) and the trace events the model cannot place together: the
step where the engine's loop and the model drifted apart. A truncated trace (its run did not reach
its end, checker/trace_io.py `truncation`) must be a prefix of a schedule: the verdict says so, and
is never a whole pass."""

from __future__ import annotations

from dataclasses import dataclass

from spec import load_events
from spec.z3model import DECODE_ENGINE_GROUPS, ENGINE_GROUPS, Refinement, refinement
from spec.z3model.decode_traces import TRACE_GROUPS, decode_refinement

from .trace_io import iter_events, truncation


@dataclass
class ModelCheck:
    path: str
    header: dict
    events: list
    answer: Refinement | None  # None: the role has no loop model to check against
    truncated: int | None = None  # the line a truncated trace stops at: judged as a prefix

    @property
    def ok(self) -> bool:
        return self.answer is not None and self.answer.status == "sat"

    @property
    def judged(self) -> bool:
        return self.answer is not None and self.answer.status in ("sat", "unsat")

    @property
    def complete(self) -> bool:
        """A verdict on the whole run: judged, on a trace that is not truncated."""
        return self.judged and self.truncated is None


def check_model(path: str, timeout_ms: int = 60000) -> ModelCheck:
    header: dict = {}
    status: dict = {}
    events = [e for _, e in iter_events(path, header_out=header, status=status)]
    cut = truncation(status)
    prefix = cut is not None
    if header.get("role") == "decode":
        end = status.get("end") or {}
        if header.get("memory_waits") is None and end.get("memory_waits") is not None:
            # a streamed trace (`pdo launch`): its header went out before the count was known
            header = {**header, "memory_waits": end["memory_waits"]}
        # the decode model chooses what it describes itself (spec/z3model/decode_traces.py DROPPED)
        events = [dict(e, seq=i, trace_seq=e["seq"]) for i, e in enumerate(events, 1)]
        answer = decode_refinement(header, events, timeout_ms, prefix=prefix)
        return ModelCheck(path, header, events, answer, cut)
    if header.get("role") != "prefill":
        return ModelCheck(path, header, events, None, cut)
    # the loop model places the events it emits; the completions it does not model (spec/events.toml
    # loop_model = false) are the delivery rules' to judge
    unmodelled = {
        ev for ev, spec in load_events()["prefill"].items() if not spec.get("loop_model", True)
    }
    if prefix:
        # a slot taken for a request whose admit the cut left out (its admission round, or a later
        # one after a postponement): the model knows a request by the batch that admits it
        admitted = {r for e in events if e["ev"] == "admit" for r in e["rids"]}
        events = [e for e in events if e["ev"] != "alloc" or e["rid"] in admitted]
    events = [
        dict(e, seq=i, trace_seq=e["seq"])
        for i, e in enumerate((e for e in events if e["ev"] not in unmodelled), 1)
    ]
    answer = refinement(header["mode"], header, events, timeout_ms, prefix=prefix)
    return ModelCheck(path, header, events, answer, cut)


def _event(e: dict) -> str:
    where = f" batch {e['batch']}" if "batch" in e else ""
    who = f" {e['rid']}" if "rid" in e else ""
    return f"seq {e['trace_seq']} {e['ev']}{where}{who} ({e['thread']})"


def text(check: ModelCheck) -> str:
    head = f"{check.path} ({check.header.get('role')}, mode={check.header.get('mode')})"
    a = check.answer
    if a is None:
        return f"NOT CHECKED {head}: no loop model of this role to refine against"
    cut = f"truncated at line {check.truncated}"
    if a.status == "sat" and check.truncated is not None:
        return (
            f"INCOMPLETE {head}: {cut}; a prefix of a schedule of the loop model "
            f"({len(check.events)} events, {a.seconds:.1f} s); whether the rest completes one "
            "is not judged"
        )
    if a.status == "sat":
        return f"REFINES {head}: a schedule of the loop model ({len(check.events)} events, {a.seconds:.1f} s)"
    if a.status == "unknown":
        trunc = f"; {cut}" if check.truncated is not None else ""
        return f"UNKNOWN {head}: not judged ({a.reason}){trunc}"
    lines = [f"DRIFT {head}: the loop model of {check.header['mode']} does not admit this trace"]
    if check.truncated is not None:
        lines[0] += f" ({cut}: not even as a prefix of a schedule)"
    decode = check.header.get("role") == "decode"
    groups = {**DECODE_ENGINE_GROUPS, **TRACE_GROUPS} if decode else ENGINE_GROUPS
    lines += [f"  {g}: {groups.get(g, '')}" for g in a.groups]
    if a.reason:
        lines.append(f"  {a.reason}")
    lines += [f"  {_event(check.events[s - 1])}" for s in a.seqs]
    lines += [f"  missing from the trace: {key}" for key in a.missing]
    return "\n".join(lines)


def json_report(check: ModelCheck) -> dict:
    a = check.answer
    return {
        "path": check.path,
        "role": check.header.get("role"),
        "mode": check.header.get("mode"),
        "status": "not-checked" if a is None else a.status,
        "truncated": check.truncated,
        "groups": [] if a is None else a.groups,
        "events": [] if a is None else [check.events[s - 1] for s in a.seqs],
        "missing": [] if a is None else [list(k) for k in a.missing],
        "seconds": None if a is None else round(a.seconds, 3),
    }
