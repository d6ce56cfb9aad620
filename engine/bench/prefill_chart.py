"""How `pdo bench prefill` shows its results: the table printed, and the chart of `--png`
(ratios against thread with their intervals, overlap efficiency)."""

from __future__ import annotations

_COLORS = {"normal": "#9e9e9e", "overlap": "#64b5f6", "thread": "#ffb74d", "ahead": "#43a047"}


def format_prefill_table(res: dict) -> str:
    head = (
        f"{'hit':>4} {'mode':8} {'tok/s':>8} {'vs thread':>18} {'TTFT p50':>9} {'p99':>8} "
        f"{'sched busy':>10} {'fwd busy':>9} {'hidden':>8} {'overlap eff':>11}"
    )
    units = (
        f"{'':>4} {'':8} {'uncached':>8} {'median [95% CI]':>18} {'ms':>9} {'ms':>8} "
        f"{'ms':>10} {'ms':>9} {'ms':>8} {'':>11}"
    )
    lines = [head, units]
    for e in res["results"]:
        m = e["median"]
        r = e.get("ratio_vs_thread")
        ratio = f"{r['median']:.3f} [{r['ci95'][0]:.2f},{r['ci95'][1]:.2f}]" if r else "-"
        lines.append(
            f"{e['hit']:>4} {e['mode']:8} {m['uncached_tok_per_s']:8.0f} {ratio:>18} "
            f"{m['ttft_p50_ms']:9.1f} {m['ttft_p99_ms']:8.1f} {m['sched_busy_ms']:10.1f} "
            f"{m['fwd_busy_ms']:9.1f} {m['hidden_ms']:8.1f} "
            f"{m['overlap_efficiency']:11.2f}"
        )
    return "\n".join(lines)


def _bars(ax1, ax2, res: dict) -> None:
    """Per mode and hit: the ratio against thread (with its interval) and the overlap efficiency."""
    hits, modes = res["hits"], res["modes"]
    width = 0.8 / len(modes)
    by = {(e["hit"], e["mode"]): e for e in res["results"]}
    for i, m in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(hits))]
        rat = [by[(h, m)].get("ratio_vs_thread", {}).get("median", float("nan")) for h in hits]
        ci = [
            by[(h, m)].get("ratio_vs_thread", {}).get("ci95", [r, r])
            for h, r in zip(hits, rat, strict=False)
        ]
        lo = [r - c[0] for r, c in zip(rat, ci, strict=False)]
        hi = [c[1] - r for r, c in zip(rat, ci, strict=False)]
        ax1.bar(
            xs,
            rat,
            width,
            yerr=[lo, hi],
            capsize=2,
            color=_COLORS.get(m),
            label=m,
            error_kw={"lw": 0.8},
        )
        eff = [by[(h, m)]["median"]["overlap_efficiency"] for h in hits]
        ax2.bar(xs, eff, width, color=_COLORS.get(m), label=m)


def _title(res: dict) -> str:
    eng = res.get("engine", {})
    knobs = ", ".join(f"{k}={v:g}" for k, v in eng.items() if k.endswith("_us") and v)
    whatif = (
        f"WHAT-IF: GIL-free device, {res['gil_free_device_ms']:g} ms per full batch"
        if res.get("gil_free_device_ms")
        else ""
    )
    real_forward = res.get("forward") and not res.get("gil_free_device_ms")
    fwd = f"forward {res['forward']}" if real_forward else ""
    sub = "; ".join(x for x in (f"model {eng.get('model', 'tiny')}", fwd, knobs, whatif) if x)
    gpu = res["machine"].get("gpu")
    on_gpu = gpu and "cuda" in str(res.get("device", ""))
    where = gpu if on_gpu else f"{res['machine']['cpus']} CPUs"
    return (
        f"pdo bench prefill: {res['reps']} rounds x {res['requests']} requests, "
        f"{where}, attention {res.get('attention_backend', '?')}\n{sub}"
    )


def plot_prefill(res: dict, out: str) -> None:
    import matplotlib  # lazy: matplotlib is slow to import and only --png needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hits = res["hits"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=110)
    _bars(ax1, ax2, res)
    ax1.axhline(1.0, color="k", lw=0.6)
    seed = ax1.axhline(1.07, color="k", lw=0.7, ls=":", label="seed: ahead +7% (left)")
    goal = ax2.axhline(0.9, color="k", lw=0.7, ls="--", label="goal: efficiency 0.9 (right)")
    lows = [e.get("ratio_vs_thread", {}).get("ci95", [1.0, 1.0])[0] for e in res["results"]]
    highs = [e.get("ratio_vs_thread", {}).get("ci95", [1.0, 1.0])[1] for e in res["results"]]
    ax1.set_ylim(min(0.8, min(lows) - 0.05), max(1.2, max(highs) + 0.05))
    for ax, title in (
        (ax1, "uncached input tokens/s vs thread (95% CI)"),
        (ax2, "overlap efficiency"),
    ):
        ax.set_xticks(range(len(hits)))
        ax.set_xticklabels([f"hit {h}" for h in hits])
        ax.set_title(title, fontsize=10)
        ax.tick_params(labelsize=8)
    ax2.set_ylim(0, 1.05)
    handles, labels = ax1.get_legend_handles_labels()  # below both panels, where it hides no bar
    handles = [h for h in handles if h is not seed] + [seed, goal]
    fig.legend(
        handles,
        [h.get_label() for h in handles],
        loc="lower center",
        ncol=len(handles),
        fontsize=7.5,
        frameon=False,
    )
    fig.suptitle(_title(res), fontsize=8.5)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out)
    plt.close(fig)
