"""Failing cases on disk: the case, its schedule and its failures as JSON, which
`pdo fuzz --replay` reads back.

Reading one checks it whole before anything runs: every field of the case against its declared
domain (the annotations of Case and PDCase, checked by msgspec), what spans fields (check_case),
the mutant names, and the schedule's form. Anything else is bad input naming the case file and the
field, never an internal error nor a run of something else than what was saved."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec

from engine.runtime.inject import DECODE_MUTANTS, MUTANTS
from spec.errors import BadInput

from .cases import CONTEXT, Case, PDCase

MAX_SCHEDULE = 1_000_000  # steps: more than any run's step limit (checker/fuzz/controller.py)


class _Saved(msgspec.Struct):
    """The parts of a case file a replay reads; the others (strategy, seed, ...) are notes."""

    case: dict[str, Any]
    schedule: list[str]
    failures: list[str] = []
    model: bool = False


def save_case(path: str, case, schedule: list[str], failures: list[str], **extra) -> None:
    with open(path, "w") as f:
        json.dump(
            {"case": dataclasses.asdict(case), "schedule": schedule, "failures": failures, **extra},
            f,
            indent=1,
        )


def _field(exc: msgspec.ValidationError, prefix: str) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.case.requests`" as "field case.requests:
    expected `int`, got `str`"."""
    text = str(exc)
    what, sep, at = text.rpartition(" - at `")
    if not sep:
        return text
    name = prefix + at.rstrip("`").removeprefix("$").lstrip(".")
    return f"field {name or '(top level)'}: {what[:1].lower()}{what[1:]}"


def check_case(case) -> str | None:
    """What is wrong across the fields of a case whose fields are each in their domain, or None."""
    lo, hi = case.prompt_len
    if lo > hi:
        return f"field case.prompt_len: [{lo}, {hi}] is not MIN <= MAX"
    new = getattr(case, "max_new_tokens", 1)
    if hi + new > CONTEXT:
        return (
            f"field case.prompt_len: {hi} prompt and {new} new tokens exceed the context {CONTEXT}"
        )
    if case.chunk_size < case.page_size:
        return f"field case.chunk_size: {case.chunk_size} is less than page_size {case.page_size}"
    unknown = [m for m in case.inject if m not in MUTANTS and m not in DECODE_MUTANTS]
    if unknown:
        return (
            f"field case.inject: unknown mutant(s) {', '.join(unknown)} (pdo fuzz --list-mutants)"
        )
    if isinstance(case, PDCase) and len(case.release) not in (0, 2):
        return f"field case.release: expected [] or [k, n], got {list(case.release)}"
    return None


def _case_of(fields: dict):
    """The Case or PDCase a saved `case` object describes, every field in its domain; a message
    naming the field otherwise."""
    cls = PDCase if fields.get("kind") == "pd" else Case
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(k for k in fields if k not in names)
    if extra:
        return None, f"field case.{extra[0]}: not a field of a {cls.__name__}"
    try:
        case = msgspec.convert(fields, type=cls)
    except msgspec.ValidationError as exc:
        return None, _field(exc, "case.")
    return case, check_case(case)


def load_case(path: str):
    """(case, schedule, the whole saved object) of a case file; BadInput naming the file and the
    field for anything that is not a case this pdo can run as saved."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        saved = msgspec.json.decode(data, type=_Saved)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read the case file ({exc.strerror or exc})") from None
    except RecursionError:
        raise BadInput(f"{path}: not a pdo fuzz case file (nested too deep)") from None
    except msgspec.ValidationError as exc:
        raise BadInput(f"{path}: not a pdo fuzz case file ({_field(exc, '')})") from None
    except msgspec.DecodeError as exc:
        raise BadInput(f"{path}: not a pdo fuzz case file (not JSON: {exc})") from None
    case, why = _case_of(saved.case)
    if why is None and len(saved.schedule) > MAX_SCHEDULE:
        why = f"field schedule: more than {MAX_SCHEDULE} steps"
    if why:
        raise BadInput(f"{path}: {why}")
    return case, saved.schedule, msgspec.structs.asdict(saved)
