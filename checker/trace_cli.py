"""`pdo trace`: look at a trace.

pdo trace export TRACE --perfetto out.json   Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing)
pdo trace plot TRACE -o timeline.png         the same lanes as a static picture
"""

from __future__ import annotations

from .perfetto import export
from .plot import plot


def cmd_export(a) -> int:
    counts = export(a.trace, a.perfetto)
    print(
        f"pdo trace export: {a.perfetto}: {counts['threads']} threads, {counts['spans']} spans, "
        f"{counts['instants']} instants, {counts['flows']} flows "
        "(open in ui.perfetto.dev or chrome://tracing)"
    )
    return 0


def cmd_plot(a) -> int:
    info = plot(
        a.trace,
        a.output,
        batches=a.batches,
        time_ms=a.time_ms,
        title=a.title,
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
    e.add_argument("trace", metavar="TRACE")
    e.add_argument("--perfetto", metavar="OUT", required=True, help="output JSON file")
    e.set_defaults(fn=cmd_export)
    q = tsub.add_parser("plot", help="a static timeline picture (PNG), one lane per thread")
    q.add_argument("trace", metavar="TRACE")
    q.add_argument("-o", "--output", metavar="PNG", required=True)
    q.add_argument("--batches", metavar="A:B", help="only the window of batches A..B")
    q.add_argument("--time-ms", metavar="A:B", help="only this window, in ms from the first event")
    q.add_argument("--title", help="title above the lanes (default: role and mode)")
    q.add_argument("--width", type=float, default=7.0, help="inches (default 7)")
    q.add_argument("--dpi", type=int, default=120)
    q.set_defaults(fn=cmd_plot)
