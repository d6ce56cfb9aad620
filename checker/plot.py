"""A static timeline of a pdo-trace: one lane per thread with the spans of checker/perfetto.py
(admit, fwd, collect, sample, process) as bars and KV sends as ticks. For docs and bug reports;
`pdo trace export --perfetto` is the interactive version."""

from __future__ import annotations

from spec.errors import BadInput
from spec.vocabulary import THREADS

from .perfetto import load

COLORS = {
    "admit": "#1e88e5",  # blue
    "fwd": "#fb8c00",  # orange
    "collect": "#bdbdbd",  # grey: waiting for the worker
    "sample": "#8e24aa",  # purple
    "process": "#43a047",  # green
}
OTHER = "#90a4ae"
LABELS = {
    "admit": "admit (loop top + admission)",
    "fwd": "fwd (host run_batch)",
    "collect": "collect (wait)",
    "sample": "sample",
    "process": "process result",
}


def _parse_range(s: str | None):
    if not s:
        return None, None
    lo, _, hi = s.partition(":")
    return (float(lo) if lo else None), (float(hi) if hi else None)


def _window(path: str, tl, spans, batches: str | None, time_ms: str | None) -> tuple[int, int]:
    """The time window drawn, in trace ns: the whole trace, or what `batches` and `time_ms` keep."""
    t0 = tl.t_first
    lo_ns, hi_ns = t0, tl.t_last
    if batches:
        a, b = _parse_range(batches)
        sel = [
            s
            for s in spans
            if s.batch is not None and (a is None or s.batch >= a) and (b is None or s.batch <= b)
        ]
        if not sel:
            raise BadInput(f"{path}: no spans of batches {batches}")
        lo_ns, hi_ns = min(s.t0 for s in sel), max(s.t1 for s in sel)
    if time_ms:
        a, b = _parse_range(time_ms)
        lo_ns = t0 + int(a * 1e6) if a is not None else lo_ns
        hi_ns = t0 + int(b * 1e6) if b is not None else hi_ns
    if hi_ns <= lo_ns:
        hi_ns = lo_ns + 1000
    return lo_ns, hi_ns


def _lane_order(threads) -> list[str]:
    """Scheduler first, then the forward worker, then the rest by name."""
    first = THREADS
    return sorted(threads, key=lambda n: (first.index(n) if n in first else 2, n))


def _draw_spans(ax, spans, lane_y: dict, ms, lo_ns: int, hi_ns: int) -> tuple[set, int]:
    """A bar per span in the window (a line for a zero-length one), the batch written on the wide
    fwd, admit and process bars; returns the span kinds drawn and how many spans."""
    used = set()
    drawn = 0
    for s in spans:
        if s.t1 < lo_ns or s.t0 > hi_ns:
            continue
        y = lane_y[s.thread]
        color = COLORS.get(s.kind, OTHER)
        dur = max(ms(s.t1) - ms(s.t0), 0.0)
        ax.broken_barh(
            [(ms(s.t0), dur)], (y - 0.32, 0.64), facecolors=color, edgecolor="white", linewidth=0.3
        )
        if dur == 0.0:
            ax.plot([ms(s.t0)] * 2, [y - 0.32, y + 0.32], color=color, lw=0.8)
        used.add(s.kind)
        drawn += 1
        wide = dur > (hi_ns - lo_ns) / 1e6 / 40
        if s.kind in ("fwd", "admit", "process") and s.batch is not None and wide:
            ax.text(
                ms(s.t0) + dur / 2,
                y,
                str(s.batch),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    return used, drawn


def _draw_kv_sends(ax, events, lane_y: dict, ms, lo_ns: int, hi_ns: int) -> list[dict]:
    """A tick above the lane per KV send in the window; returns those sends."""
    kv = [
        e for e in events if e["ev"] in ("kv_send", "prefix_send") and lo_ns <= e["t_ns"] <= hi_ns
    ]
    for e in kv:
        y = lane_y[e["thread"]]
        ax.plot([ms(e["t_ns"])] * 2, [y + 0.34, y + 0.46], color="#212121", lw=0.5)
    return kv


def _label_axes(ax, order: list[str], ms, lo_ns: int, hi_ns: int, title: str) -> None:
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels(list(reversed(order)), fontsize=8)
    ax.set_ylim(-0.6, len(order) - 0.4)
    ax.set_xlim(ms(lo_ns), ms(hi_ns))
    ax.set_xlabel("ms since the first event", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", lw=0.3, alpha=0.5)
    ax.set_title(title, fontsize=9)


def plot(
    path: str,
    out: str,
    *,
    batches: str | None = None,
    time_ms: str | None = None,
    title: str | None = None,
    width: float = 7.0,
    dpi: int = 120,
) -> dict:
    """Draw `path` into `out` (PNG, or anything matplotlib writes by extension).
    `batches="A:B"` keeps the time window from admission of batch A to the end of batch B's
    processing; `time_ms="A:B"` a window in ms from the first event. Returns what was drawn."""
    # lazy: matplotlib is slow to import and picks its backend on import; only drawing needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    header, tl, spans, events = load(path)
    if tl.t_first is None:
        raise BadInput(f"{path}: the trace has no events to draw")
    t0 = tl.t_first
    lo_ns, hi_ns = _window(path, tl, spans, batches, time_ms)
    order = _lane_order(tl.threads)
    lane_y = {name: len(order) - 1 - i for i, name in enumerate(order)}

    def ms(t):
        return (t - t0) / 1e6

    height = 1.2 + 0.45 * len(order)
    fig, ax = plt.subplots(figsize=(width, height), dpi=dpi)
    used, drawn = _draw_spans(ax, spans, lane_y, ms, lo_ns, hi_ns)
    kv = _draw_kv_sends(ax, events, lane_y, ms, lo_ns, hi_ns)
    mode = header.get("mode")
    default_title = f"{header.get('role', '')} mode={mode}" + (
        f", batches {batches}" if batches else ""
    )
    _label_axes(ax, order, ms, lo_ns, hi_ns, title or default_title)
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS if k in used]
    handles += [Patch(color=OTHER, label=k) for k in sorted(used - set(COLORS))]
    if kv:
        handles.append(Line2D([], [], color="#212121", lw=0.8, label="KV send"))
    fig.tight_layout()
    axes_h = ax.get_position().height * fig.get_figheight()  # inches
    ax.legend(
        handles=handles,
        fontsize=6.5,
        ncol=3 if len(handles) > 4 else len(handles),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.36 / axes_h),
        frameon=False,
        handlelength=1.2,
        columnspacing=1.0,
    )
    fig.savefig(out, bbox_inches="tight", pad_inches=0.04)
    plt.close(fig)
    return {
        "spans": drawn,
        "kv_sends": len(kv),
        "threads": order,
        "window_ms": (ms(lo_ns), ms(hi_ns)),
    }
