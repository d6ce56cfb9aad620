"""Failing cases on disk: the case, its schedule and its failures as JSON, which
`pdo fuzz --replay` reads back."""

from __future__ import annotations

import dataclasses
import json

from spec.errors import BadInput

from .cases import Case, PDCase


def save_case(path: str, case, schedule: list[str], failures: list[str], **extra) -> None:
    with open(path, "w") as f:
        json.dump(
            {"case": dataclasses.asdict(case), "schedule": schedule, "failures": failures, **extra},
            f,
            indent=1,
        )


def _case_of(fields: dict):
    """The Case or PDCase a saved `case` object describes (JSON lists back to tuples)."""
    fields["inject"] = tuple(fields.get("inject", ()))
    fields["prompt_len"] = tuple(fields.get("prompt_len", (8, 40)))
    if fields.get("kind") == "pd":
        fields["aborts"] = tuple(tuple(a) for a in fields.get("aborts", ()))
        fields["release"] = tuple(fields.get("release", ()))
        return PDCase(**fields)
    return Case(**fields)


def load_case(path: str):
    """(case, schedule, the whole saved object) of a case file."""
    try:
        with open(path) as f:
            saved = json.load(f)
        return _case_of(saved["case"]), list(saved["schedule"]), saved
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{path}: not a pdo fuzz case file ({exc})") from None
