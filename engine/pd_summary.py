"""The summary of one PD run's decode side (`pdo run --pd`, `pdo launch`): outputs, aborts, the
DP-rank resolves' waits and leads, leaks, lost prefill ranks."""

from __future__ import annotations

from .decode.scheduler import DecodeScheduler


def summarize(decode: DecodeScheduler, wall: float, routed: dict[str, int] | None = None) -> dict:
    """`routed`: the DP rank each request was routed to (the seeded router every role of the run
    agrees on), to count a failed rank's aborted requests whatever ended them."""
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
        "failed_ranks": failed_ranks(decode, routed),
    }


def failed_ranks(decode: DecodeScheduler, routed: dict[str, int] | None) -> list[dict]:
    """Each prefill rank the decode lost: `aborted`, its requests that were aborted (those in
    flight when it failed, `aborted_in_flight`, and those whose room it never registered, which end
    at the bootstrap timeout with a reason naming the failed rank); without `routed`, only the
    former are known."""
    gone = [r.rid for r in decode.aborted]
    out = []
    for rank, why in sorted(decode.failed_ranks.items()):
        in_flight = decode.failed_aborts.get(rank, 0)
        mine = in_flight if routed is None else sum(1 for rid in gone if routed.get(rid) == rank)
        out.append({"rank": rank, "reason": why, "aborted": mine, "aborted_in_flight": in_flight})
    return out
