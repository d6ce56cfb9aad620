"""`pdo trace`: look at a trace.

pdo trace export TRACE --perfetto out.json   Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing)
pdo trace plot TRACE -o timeline.png         the same lanes as a static picture
"""

from __future__ import annotations

from spec import domains as d
from spec.errors import BadInput

from .perfetto import export
from .plot import plot
from .trace_io import iter_events
from .trace_log import materialize

# What `plot -o` writes, by its suffix (matplotlib's Agg backend): a path without one of these
# would be written under another name (DIR -> DIR.png), so it is refused.
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
MAX_PIXELS = 30_000  # --width x --dpi: matplotlib refuses images past 2^16 pixels a side


def _require_events(path: str, what: str) -> None:
    """BadInput for a trace with no event: nothing to draw or export (`plot` and `export` alike)."""
    if next(iter_events(path), None) is None:
        raise BadInput(f"{path}: the trace has no events to {what}")


def cmd_export(a) -> int:
    a.trace = materialize(a.trace)  # a killed run's binary log: its lines
    _require_events(a.trace, "export")
    counts = export(a.trace, a.perfetto)
    print(
        f"pdo trace export: {a.perfetto}: {counts['threads']} threads, {counts['spans']} spans, "
        f"{counts['instants']} instants, {counts['flows']} flows "
        "(open in ui.perfetto.dev or chrome://tracing)"
    )
    return 0


def validate_plot(a, _argv) -> None:
    if a.width * a.dpi > MAX_PIXELS:
        raise BadInput(
            f"--width {a.width:g} x --dpi {a.dpi}: an image wider than {MAX_PIXELS} pixels"
        )


def cmd_plot(a) -> int:
    a.trace = materialize(a.trace)
    _require_events(a.trace, "draw")
    info = plot(
        a.trace,
        a.output,
        batches=a.batches,
        time_ms=a.time_ms,
        # matplotlib would read a $...$ in a title as math text, and fail on what does not parse
        title=a.title.replace("$", r"\$") if a.title else None,
        width=a.width,
        dpi=a.dpi,
    )
    lo, hi = info["window_ms"]
    print(
        f"pdo trace plot: {a.output}: {len(info['threads'])} lanes, {info['spans']} spans, "
        f"{lo:.1f}..{hi:.1f} ms"
    )
    return 0


def register(sub) -> None:
    p = sub.add_parser("trace", help="export or plot a trace's timeline")
    tsub = p.add_subparsers(dest="trace_cmd", required=True)
    e = tsub.add_parser(
        "export", help="Chrome trace-event JSON for ui.perfetto.dev / chrome://tracing"
    )
    e.add_argument("trace", type=d.path(), metavar="TRACE")
    e.add_argument(
        "--perfetto", type=d.path(), metavar="OUT", required=True, help="output JSON file"
    )
    e.set_defaults(fn=cmd_export)
    q = tsub.add_parser("plot", help="a static timeline picture (PNG), one lane per thread")
    q.add_argument("trace", type=d.path(), metavar="TRACE")
    q.add_argument(
        "-o",
        "--output",
        type=d.path(*PLOT_SUFFIXES),
        metavar="PNG",
        required=True,
        help="the picture, by its suffix: " + ", ".join(PLOT_SUFFIXES),
    )
    q.add_argument(
        "--batches", type=d.window(int), metavar="A:B", help="only the window of batches A..B"
    )
    q.add_argument(
        "--time-ms",
        type=d.window(float),
        metavar="A:B",
        help="only this window, in ms from the first event",
    )
    q.add_argument("--title", type=d.text(), help="title above the lanes (default: role and mode)")
    q.add_argument("--width", type=d.number(0.5, 100), default=7.0, help="inches (default 7)")
    q.add_argument(
        "--dpi",
        type=d.integer(10, 1200),
        default=120,
        help=f"dots per inch (--width x --dpi at most {MAX_PIXELS} pixels)",
    )
    q.set_defaults(fn=cmd_plot, validate=validate_plot)
