"""Hand-written canonical prefill traces, one per mode, following each loop of the design step by step.

Scenario (page_size 16): request a (40 tokens) is chunked: 32 tokens in batch 0, 8 in batch 1;
request b reuses a 16-token cached prefix and computes 10 tokens in batch 1; request c (20 tokens)
is batch 2. Edits on these lists produce the violating traces of tests/checker/test_rules_violations.py.
"""

from __future__ import annotations

import json

REQS = {"a": ("oa", 0), "b": ("ob", 1), "c": ("oc", 2)}
BATCHES = [[("a", 0, 32, False)], [("a", 32, 8, True), ("b", 16, 10, True)], [("c", 0, 20, True)]]
NEW = {0: ["a"], 1: ["b"], 2: ["c"]}
PREFIX = {1: ["b"]}


def E(thread, ev, **f):
    return {"thread": thread, "ev": ev, **f}


def _admit(n):
    out = [E("scheduler", "alloc", rid=r, obj=REQS[r][0], slot=REQS[r][1]) for r in NEW[n]]
    out.append(
        E(
            "scheduler",
            "admit",
            batch=n,
            rids=[x[0] for x in BATCHES[n]],
            chunks={rid: [start, start + take] for rid, start, take, _ in BATCHES[n]},
        )
    )
    for rid, _, _, last in BATCHES[n]:
        if not last:
            out.append(E("scheduler", "chunk_inc", rid=rid, obj=REQS[rid][0], value=1))
    return out


def _prefix(n, thread):
    out = []
    for r in PREFIX.get(n, []):
        out.append(
            E(thread, "prefix_send", batch=n, rid=r, obj=REQS[r][0], tokens=16, pages=1, start=0)
        )
        out.append(_delivered(r, 0, 16))
    return out


def _delivered(rid, start, tokens):
    """The transfer thread's completion of a send (format version 2)."""
    return E("transfer", "kv_delivered", rid=rid, obj=REQS[rid][0], start=start, tokens=tokens)


def _run_batch(n, thread, *, early_send=True, stage=True):
    out = [E(thread, "fwd_begin", batch=n, digest=f"d{n}")]
    if early_send:
        out += _prefix(n, thread)
    if stage:
        out += [E(thread, "stage", batch=n), E("stream:schedule", "staged", batch=n)]
    out += [E(thread, "fwd_end", batch=n), E("stream:forward", "fwd_done", batch=n)]
    return out + [E(thread, "war_barrier", batch=n)]


def _process(n):
    out = [E("scheduler", "process_begin", batch=n)]
    for rid, start, take, last in BATCHES[n]:
        if not last:
            out.append(E("scheduler", "chunk_dec", rid=rid, obj=REQS[rid][0], value=0))
        out.append(
            E(
                "scheduler",
                "kv_send",
                rid=rid,
                obj=REQS[rid][0],
                tokens=take,
                pages=-(-take // 16),
                start=start,
            )
        )
        out.append(_delivered(rid, start, take))
    out.append(E("scheduler", "process_end", batch=n))
    for rid, _, _, last in BATCHES[n]:
        if last:  # its AttentionStore copy completes, its entry is retired, then it is released
            out.append(E("stream:copy", "store_copied", rid=rid))
            out.append(E("scheduler", "store_entry", rid=rid))
            out.append(E("scheduler", "release", rid=rid, obj=REQS[rid][0], slot=REQS[rid][1]))
    return out


def canonical(mode: str) -> list[dict]:
    nb = len(BATCHES)
    ev: list[dict] = []
    if mode == "normal":
        for n in range(nb):
            ev += _admit(n) + _run_batch(n, "scheduler") + _process(n)
    elif mode == "overlap":
        for n in range(nb):
            ev += _admit(n) + _run_batch(n, "scheduler")
            if n:
                ev += _process(n - 1)
            ev.append(E("scheduler", "sample", batch=n))
        ev += _process(nb - 1)
    elif mode == "thread":
        for n in range(nb):
            ev += _admit(n) + [
                E("scheduler", "snapshot", batch=n, digest=f"d{n}"),
                E("scheduler", "submit", batch=n),
            ]
            ev += _run_batch(n, "forward") + [
                E("forward", "batch_copy", batch=n),
                E("scheduler", "collect", batch=n),
            ]
            if n:
                ev += _process(n - 1)
            ev.append(E("scheduler", "sample", batch=n))
        ev += _process(nb - 1)
    elif mode == "ahead":
        for i in range(nb + 1):
            if i < nb:
                ev += _admit(i)
            if i:
                ev += [
                    E("scheduler", "collect", batch=i - 1),
                    E("scheduler", "sample", batch=i - 1),
                ]
            if i < nb:
                ev += [
                    E("scheduler", "snapshot", batch=i, digest=f"d{i}"),
                    E("scheduler", "stage", batch=i),
                    E("stream:schedule", "staged", batch=i),
                ]
                ev += _prefix(i, "scheduler") + [E("scheduler", "submit", batch=i)]
                ev += _run_batch(i, "forward", early_send=False, stage=False) + [
                    E("forward", "batch_copy", batch=i)
                ]
            if i:
                ev += _process(i - 1)
    else:
        raise ValueError(mode)
    return ev


def write(path, mode: str, events: list[dict], page_size: int = 16) -> str:
    with open(path, "w") as f:
        f.write(
            json.dumps(
                {
                    "format": "pdo-trace",
                    "version": 3,
                    "role": "prefill",
                    "mode": mode,
                    "page_size": page_size,
                }
            )
            + "\n"
        )
        for i, e in enumerate(events, 1):
            f.write(json.dumps({"seq": i, "t_ns": 1000 * i, **e}) + "\n")
        end = len(events) + 1  # a whole trace (format version 2): its last line says so
        f.write(
            json.dumps(
                {"seq": end, "t_ns": 1000 * end, "thread": "scheduler", "ev": "trace_end"}
                | {"events": len(events), "reason": "normal"}
            )
            + "\n"
        )
    return str(path)


# ---- edit helpers --------------------------------------------------------------------------------
def find(events, ev, batch=None, rid=None, nth=0):
    hits = [
        i
        for i, e in enumerate(events)
        if e["ev"] == ev
        and (batch is None or e.get("batch") == batch)
        and (rid is None or e.get("rid") == rid)
    ]
    return hits[nth]


def move(events, src, dst_after):
    """Move event at index src to just after index dst_after (indices before the move)."""
    e = events[src]
    events.insert(dst_after + 1, e)
    del events[src if src < dst_after else src + 1]
    return events


def move_before(events, src, dst):
    e = events.pop(src)
    events.insert(dst if dst < src else dst - 1, e)
    return events
