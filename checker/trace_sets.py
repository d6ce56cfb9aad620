"""A fleet's traces as independent trace sets (`pdo check --ray DIR`).

A trace set is the files of one run, what one `pdo check` is given: `X.jsonl` of `pdo run --trace
X.jsonl`; `X.decode.jsonl` and `X.prefill<i>.jsonl` of `pdo run --pd --trace X.jsonl`;
`decode.jsonl` and `prefill<i>.jsonl` of `pdo launch` in one folder. Files are grouped by folder and
by their name less `.jsonl` and a trailing `decode` or `prefill<i>` part. Each set is checked as
`pdo check` checks the files given to it (checker.linear.check_files: each file, then each decode
trace with the prefill traces of its set), and gets the exit code `pdo check` would give it."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field

from spec.errors import BadInput

from . import report

# The part of a trace's name that says which process of the run wrote it.
_ROLE_PART = re.compile(r"(?:^|\.)(?:decode|prefill\d+)$")
OK, FAILED, BAD_INPUT, INCOMPLETE = 0, 1, 2, 3  # engine/cli/exits.py


@dataclass(frozen=True)
class TraceSet:
    name: str  # folder/stem: how the report names the set
    paths: tuple[str, ...]


@dataclass
class SetVerdict:
    """What `pdo check` on one set's files says: its exit code, the text it prints, its JSON
    reports, the events it read (each file once), the broken rules, or the bad input's line."""

    name: str
    paths: tuple[str, ...]
    code: int
    events: int = 0
    text: str = ""
    reports: list = field(default_factory=list)
    broken: dict = field(default_factory=dict)  # rule id -> violations
    error: str | None = None


def _set_key(path: str) -> tuple[str, str]:
    folder, name = os.path.split(path)
    return folder, _ROLE_PART.sub("", name[: -len(".jsonl")])


def _traces_under(root: str) -> list[str]:
    if os.path.isfile(root):
        return [root]
    if not os.path.isdir(root):
        raise BadInput(f"{root}: no such file or folder")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".jsonl")]
    return found


def trace_sets(roots: list[str]) -> list[TraceSet]:
    """Every trace set under the folders (and among the files) of `roots`, in name order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for root in roots:
        found = _traces_under(root)
        if not found:
            raise BadInput(f"{root}: no trace (*.jsonl) in it")
        for path in found:
            members = groups.setdefault(_set_key(path), [])
            if path not in members:
                members.append(path)
    return [
        TraceSet(os.path.join(folder, stem) if stem else folder + os.sep, tuple(sorted(paths)))
        for (folder, stem), paths in sorted(groups.items())
    ]


def verdict(results) -> int:
    """The exit code of `pdo check` (linear checker) for the results of its files."""
    if not all(r.ok for r in results):
        return FAILED
    return OK if all(r.complete for r in results) else INCOMPLETE


def check_set(ts: TraceSet) -> SetVerdict:
    """Check one trace set as `pdo check` checks its files (the task `pdo check --ray` runs)."""
    from .linear import check_files  # lazy: start-up time (numpy)

    try:
        results = check_files(list(ts.paths))
        text = "\n".join(report.text_report(r) for r in results)
        reports = [report.json_report(r) for r in results]
    except (BadInput, OSError) as exc:
        return SetVerdict(ts.name, ts.paths, BAD_INPUT, error=" ".join(str(exc).split()))
    broken = Counter(v.rule.id for r in results for v in r.violations)
    events = sum(r.events for r in results[: len(ts.paths)])  # cross results re-read a decode
    return SetVerdict(ts.name, ts.paths, verdict(results), events, text, reports, dict(broken))


def line(v: SetVerdict) -> str:
    """The set's one line in the fleet report."""
    if v.code == BAD_INPUT:
        return f"BAD  {v.name}: {v.error}"
    mark = {OK: "ok  ", FAILED: "FAIL", INCOMPLETE: "INCOMPLETE"}[v.code]
    rules = ", ".join(f"{k} x{n}" for k, n in sorted(v.broken.items()))
    return f"{mark} {v.name}: {len(v.paths)} trace(s), {v.events} events" + (
        f"; broken: {rules}" if rules else ""
    )


def fleet_code(verdicts: list[SetVerdict]) -> int:
    """The command's exit code: a violation anywhere first, then bad input, then no verdict."""
    codes = {v.code for v in verdicts}
    for code in (FAILED, BAD_INPUT, INCOMPLETE):
        if code in codes:
            return code
    return OK


def summary(verdicts: list[SetVerdict]) -> str:
    n = Counter(v.code for v in verdicts)
    files = sum(len(v.paths) for v in verdicts)
    events = sum(v.events for v in verdicts)
    return (
        f"pdo check: {len(verdicts)} trace set(s), {files} trace(s), {events} events: "
        f"{n[OK]} ok, {n[FAILED]} with a violation, {n[INCOMPLETE]} incomplete, "
        f"{n[BAD_INPUT]} bad input"
    )
