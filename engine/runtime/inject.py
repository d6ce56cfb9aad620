"""Mutation switches: realistic bugs, each off by default, each turned on by name (`--inject NAME`).

Every use site is marked `# MUTANT:` in the engine and asks `on(active, name)` of its run's set
(EngineConfig.inject, handed to each component: no process-wide switch). `checker/fuzz/` runs the
engine with each one on and requires that a rule violation or a wrong output catches it."""

from __future__ import annotations

from engine.errors import ConfigError
from spec.errors import InternalError

MUTANTS = {
    "live-batch": "the forward worker reads the live batch, no snapshot",
    "deepcopy-chunked-req": "a chunked Req is deep-copied, so the middle-chunk decrement lands on a copy",
    "sample-before-collect": "deferred sampling of batch N is launched after submit(N+1), while forward N+1 runs",
    "prefix-send-on-worker": "ahead mode passes early_send_prefix=True: the worker sends the cached prefix",
    "no-war-barrier": "the next batch's staging write does not wait for forward N's reads",
    "two-forwards": "input queue of capacity 2: the next batch is submitted before the previous is collected",
    "non-idempotent-copy-for-forward": "copy_for_forward applied twice folds the logit bias twice",
    "floor-page-count": "the sender rounds the tail page count down",
    "free-slot-before-forward-done": "a finished request's slot and pages are freed while a forward still reads them",
    "send-before-forward-done": "a chunk's KV is sent before the forward that writes it has finished",
    "release-before-delivery": "a request is released once its last chunk is handed to the sender, before the transfer delivered it",
    "retire-before-copy": "an AttentionStore entry is written from its staging buffer before the copy into it completed",
    "copy-after-handoff": "the worker hands the result back before it makes batch.copy(), so collect races the copy",
}

# The rule(s) of spec/rules.toml that must flag each prefill mutant on a real engine trace (any one
# of them). Empty: no host-side rule can see it (a device race); only the outputs can.
MUTANT_RULES: dict[str, tuple[str, ...]] = {
    "live-batch": ("P-snapshot-isolation",),
    "deepcopy-chunked-req": ("P-chunk-counter",),
    "sample-before-collect": ("P-collect-before-sample", "P-sample-idle"),
    "prefix-send-on-worker": ("P-prefix-send-ahead",),
    "no-war-barrier": (),
    "two-forwards": ("P-queue-capacity",),
    "non-idempotent-copy-for-forward": ("P-snapshot-isolation",),
    "floor-page-count": ("P-page-count",),
    "free-slot-before-forward-done": ("P-release-after-done",),
    "send-before-forward-done": ("P-scheduler-thread", "P-send-after-forward"),
    "release-before-delivery": ("P-release-after-delivery",),
    "retire-before-copy": ("P-store-after-copy",),
    "copy-after-handoff": ("P-worker-copy",),
}


def checked(names) -> frozenset:
    """The mutants `names` (a run's EngineConfig.inject), each one a known mutant."""
    names = frozenset(names or ())
    unknown = names - set(MUTANTS) - set(DECODE_MUTANTS)
    if unknown:
        raise ConfigError(f"--inject: unknown mutant(s): {', '.join(sorted(unknown))}")
    return names


def on(active: frozenset, name: str) -> bool:
    """Whether the mutant `name` is among a run's `active` ones. Each component is handed its run's
    set (EngineConfig.inject): no process-wide switch, so two runs in one process never share one."""
    if name not in MUTANTS and name not in DECODE_MUTANTS:
        raise InternalError(f"engine/runtime/inject.py: no mutant named {name!r}")
    return name in active


DECODE_MUTANTS: dict[str, str] = {
    # engine/decode/prealloc.py; each is caught by the decode rule named after the dash
    "prefetch-use-mismatched-rooms": "resolve uses a prefetched answer whatever rooms it was asked for — D-prefetch-match",
    "no-stale-cancel": "futures of addresses with no pending request are never cancelled — D-no-stale",
    "no-cancel-on-release": "release_memory_occupation leaves prefetched futures running — D-release-cancels",
    "double-prefetch": "a second query is submitted while one is in flight for the address — D-one-query-per-addr",
    "prefetch-before-published": "the prefetch queries a prefill that has not published its info — D-published-first",
    "query-every-iteration": "the prefetch asks again for rooms whose rank is known — D-unknown-rooms-only",
}
