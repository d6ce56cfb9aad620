"""The summary of one PD run's decode side (`pdo run --pd`, `pdo launch`): outputs, aborts, the
DP-rank resolves' waits and leads, leaks, lost prefill ranks."""

from __future__ import annotations

from .decode.scheduler import DecodeScheduler


def summarize(decode: DecodeScheduler, wall: float) -> dict:
    res = [x for x in decode.prealloc.resolves]
    waits = sorted(x["wait_s"] for x in res)
    leads = [x["lead_s"] for x in res if x["source"] != "sync"]
    by_source: dict[str, int] = {}
    for x in res:
        by_source[x["source"]] = by_source.get(x["source"], 0) + 1
    return {
        "requests": decode.total,
        "finished": len(decode.done),
        "outputs": {r.rid: r.output for r in decode.done},
        "aborted": {r.rid: r.error for r in decode.aborted},
        "wall_s": wall,
        "decode_tokens": decode.stats["decode_tokens"],
        "decode_tok_per_s": decode.stats["decode_tokens"] / wall if wall else 0.0,
        "iterations": decode.iter,
        "batches": decode.stats["batches"],
        "resolve": {
            "count": len(res),
            "by_source": by_source,
            "samples": [
                {"source": x["source"], "wait_ms": 1e3 * x["wait_s"], "lead_ms": 1e3 * x["lead_s"]}
                for x in res
            ],
            "errors": sum(1 for x in res if x["error"]),
            "mean_wait_ms": 1e3 * sum(waits) / len(waits) if waits else 0.0,
            "p99_wait_ms": 1e3 * waits[min(len(waits) - 1, int(0.99 * len(waits)))]
            if waits
            else 0.0,
            "mean_lead_ms": 1e3 * sum(leads) / len(leads) if leads else 0.0,
        },
        "decode_leaks": decode.leak_report(),
        "decode_memory_waits": decode.stats["memory_waits"],
        "failed_ranks": [
            {"rank": k, "reason": why, "aborted": decode.failed_aborts.get(k, 0)}
            for k, why in sorted(decode.failed_ranks.items())
        ],
    }
