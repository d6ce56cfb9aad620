"""The four-mode table and the AHEAD steady state as markdown lines: what `pdo spec table` prints
and docs/spec.md shows."""

from __future__ import annotations

TABLE_HEAD = (
    "mode",
    "where run_batch runs",
    "can admission of the next batch overlap a run_batch that has not returned?",
    "result-processing order",
)
MODE_NAMES = {
    "normal": "normal loop, enable_overlap off",
    "overlap": "old overlap loop",
    "thread": "thread loop, AHEAD off",
    "ahead": "thread loop, AHEAD on",
}


def mode_table_lines(modes: dict) -> list[str]:
    """The rows of `mode_table` (mode -> row) as a markdown table."""
    out = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "---|" * len(TABLE_HEAD)]
    for mode, row in modes.items():
        overlaps = row["admission_overlaps_unreturned_run_batch"]
        yes = {True: "yes", False: "no", None: "unknown"}[overlaps]
        where = {"scheduler": "scheduler thread", "worker": "worker"}.get(
            row["run_batch_on"], row["run_batch_on"]
        )
        out.append(f"| {MODE_NAMES[mode]} | {where} | {yes} | {row['processing_order']} |")
    return out


def steady_lines(rows) -> list[str]:
    """The rows of `ahead_steady_table` (step, scheduler, worker) as a markdown table."""
    out = ["| step | scheduler thread | forward worker |", "|---|---|---|"]
    out += [f"| {i} | {s} | {w} |" for i, s, w in rows]
    return out
