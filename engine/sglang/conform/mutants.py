"""Real-code mutations of SGLang 0.5.23, each a bug class of the mutant suite, so
`pdo conform sglang --mutant NAME` shows that the checks catch them. engine/sglang/mutate.py
rewrites the method's source for the duration of a `with` block; SGLang's files are never touched.

    DECODE_MUTANTS    mutations of the decode prealloc queue's methods, each observable in some
                      decode scenarios (decode_scenarios.py); applied(sgl, mutant) puts one in place
    PREFILL_MUTANTS   mutations of the real prefill loop, each run on one prefill scenario's
                      workload (PrefillMutant.run)
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import os
from collections.abc import Callable

from engine.sglang import mutate
from engine.sglang.conform.prefill_run import run_workload
from engine.sglang.conform.prefill_scenarios import SCENARIOS
from engine.sglang.conform.prefill_scheduler import SCENARIO_LOCK, sglang
from spec.registry import Registry


# ---- decode --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    cls: str  # "decode.DecodePreallocQueue": module attribute of the load() namespace, then class
    method: str
    transform: object  # ast.NodeTransformer subclass
    scenarios: tuple  # the scenarios where it is observable
    rules: tuple  # the rules expected to flag it


class _DropIf(ast.NodeTransformer):
    """Remove every `if` statement whose test's source contains `needle` (body included)."""

    needle = ""

    def visit_If(self, node):
        self.generic_visit(node)
        return None if self.needle in ast.unparse(node.test) else node


class _DropCall(ast.NodeTransformer):
    """Remove every expression statement calling `needle`."""

    needle = ""

    def visit_Expr(self, node):
        return None if self.needle in ast.unparse(node) else node


class _DropFor(ast.NodeTransformer):
    needle = ""

    def visit_For(self, node):
        return None if self.needle in ast.unparse(node.iter) else node


class _FalseIf(ast.NodeTransformer):
    """Make the test of `if <needle>:` False (its body never runs)."""

    needle = ""

    def visit_If(self, node):
        self.generic_visit(node)
        if ast.unparse(node.test) == self.needle:
            node.test = ast.Constant(False)
        return node


class _DropAugAssign(ast.NodeTransformer):
    """Remove every `x &= ...` / `x += ...` statement whose source contains `needle`."""

    needle = ""

    def visit_AugAssign(self, node):
        return None if self.needle in ast.unparse(node) else node


def _make(base, needle):
    return type(f"{base.__name__}[{needle}]", (base,), {"needle": needle})


class _KeepComprehensionAll(ast.NodeTransformer):
    """Drop the `if` filter of the room comprehension (every room, known or not)."""

    def visit_GeneratorExp(self, node):
        self.generic_visit(node)
        for gen in node.generators:
            gen.ifs = [c for c in gen.ifs if "_resolve_prefill_dp_rank" not in ast.unparse(c)]
        return node


_QUEUE = "decode.DecodePreallocQueue"
DECODE_MUTANTS: Registry[Mutant] = Registry("decode mutant")


def _register(mutant: Mutant) -> None:
    DECODE_MUTANTS.register(mutant.name)(mutant)


_register(
    Mutant(
        "prefetch-use-mismatched-rooms",
        "the prefetched answer is used for rooms it was not asked for "
        "(the tail of a grown room set is never queried)",
        _QUEUE,
        "_resolve_pending_reqs",
        _make(_FalseIf, "remaining_rooms"),
        ("decode-arrivals/normal", "decode-rooms-grow/normal"),
        ("D-prefetch-match",),
    )
)
_register(
    Mutant(
        "prefetch-never-used",
        "the consumption point cancels a prefetched query that covers its rooms and asks them "
        "again synchronously (the prefetch is never used)",
        _QUEUE,
        "_resolve_pending_reqs",
        _make(
            _FalseIf,
            "prefetched is not None and tuple(rooms[:len(prefetched_rooms)]) == prefetched_rooms",
        ),
        ("decode-arrivals/normal", "decode-rooms-grow/normal"),
        ("D-consume-answer",),
    )
)
_register(
    Mutant(
        "no-stale-cancel",
        "prefetched queries of addresses with no pending request are kept",
        _QUEUE,
        "prefetch_prefill_dp_rank_queries",
        _make(_DropFor, "set(queries) - set(addr_to_reqs)"),
        ("decode-two-addresses/normal", "decode-abort-after-prefetch/normal"),
        ("D-no-stale",),
    )
)
_register(
    Mutant(
        "no-cancel-on-release",
        "release_memory_occupation leaves prefetched queries running",
        _QUEUE,
        "release_memory_occupation",
        _make(_DropCall, "_cancel_prefill_dp_rank_queries"),
        ("decode-release-pending/normal",),
        ("D-release-cancels",),
    )
)
_register(
    Mutant(
        "double-prefetch",
        "a second query is submitted while one is in flight for the address",
        _QUEUE,
        "prefetch_prefill_dp_rank_queries",
        _make(_DropIf, "bootstrap_addr in queries"),
        ("decode-polling-interval/normal", "decode-polling-interval/overlap"),
        ("D-one-query-per-addr",),
    )
)
_register(
    Mutant(
        "prefetch-before-published",
        "a query goes to a prefill that has not published its parallel info",
        _QUEUE,
        "prefetch_prefill_dp_rank_queries",
        _make(_DropIf, "prefill_info_table.get(bootstrap_addr) is None"),
        ("decode-two-addresses/normal",),
        ("D-published-first",),
    )
)
_register(
    Mutant(
        "query-every-iteration",
        "rooms whose rank is already known are asked again",
        _QUEUE,
        "prefetch_prefill_dp_rank_queries",
        _KeepComprehensionAll,
        ("decode-single-rank/normal", "decode-arrivals/normal"),
        ("D-unknown-rooms-only",),
    )
)


# Bug classes of the lifecycle x fault matrix (decode_life.py), judged by its oracle.
_register(
    Mutant(
        "abort-without-clear",
        "pop_preallocated drops an aborted or failed request without kv_receiver.clear()",
        _QUEUE,
        "pop_preallocated",
        _make(_DropCall, "kv_receiver.clear()"),
        ("decode-life/handshake/client-abort/normal", "decode-life/dp-pending/poll-failed/normal"),
        ("oracle:cleared-once",),
    )
)
_register(
    Mutant(
        "idle-ignores-prealloc",
        "Scheduler.is_fully_idle ignores the prealloc queue",
        "scheduler.Scheduler",
        "is_fully_idle",
        _make(_DropAugAssign, "disagg_decode_prealloc_queue.queue"),
        ("decode-life/handshake/none/normal",),
        ("oracle:idle-right",),
    )
)
_register(
    Mutant(
        "failed-transfer-not-aborted",
        "pop_transferred drops a Failed transfer without aborting its request",
        "decode.DecodeTransferQueue",
        "pop_transferred",
        _make(_DropCall, "prepare_abort("),
        ("decode-life/transferring/poll-failed/normal",),
        ("oracle:ends-once", "D-request-ends"),
    )
)


_register(
    Mutant(
        "prefill-failed-transfer-dropped",
        "the prefill inflight queue drops a Failed transfer without handle_inflight_transfer_failure",
        "prefill.SchedulerDisaggregationPrefillMixin",
        "process_disagg_prefill_inflight_queue",
        _make(_DropCall, "self.handle_inflight_transfer_failure(req)"),
        ("prefill-life/inflight/poll-failed/normal", "prefill-life/inflight/timeout/overlap"),
        # the dropped request is never ended nor freed; the oracle that sees it first depends on
        # when the cell's checks run: the idleness report then disagrees with the ledger
        ("oracle:ends-once", "oracle:freed-once", "oracle:idle-right", "P-release-once"),
    )
)


_register(
    Mutant(
        "idle-ignores-inflight",
        "Scheduler.is_fully_idle ignores the prefill inflight queue",
        "scheduler.Scheduler",
        "is_fully_idle",
        _make(_DropAugAssign, "disagg_prefill_inflight_queue"),
        ("prefill-life/inflight/none/normal",),
        ("oracle:idle-right",),
    )
)


@contextlib.contextmanager
def applied(sgl, mutant: Mutant):
    """The class's method replaced by its mutated version inside the block (the hooks still wrap
    it)."""
    module, cls_name = mutant.cls.split(".")
    cls = getattr(getattr(sgl, module), cls_name)
    with mutate.mutation(cls, mutant.method, mutant.transform()):
        yield


# ---- prefill -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PrefillMutant:
    name: str
    scenario: str  # the prefill scenario whose workload it runs
    patch: Callable  # () -> the context manager rewriting SGLang's loop; its docstring says how
    rules: frozenset  # the rules that must report it

    @property
    def what(self) -> str:
        return self.patch.__doc__.strip().splitlines()[0]

    def run(self, trace_dir: str, fuzz_schedule=None) -> dict:
        """The scenario's workload with SGLang's loop rewritten: {"trace", "functions", "expect",
        ...}, `expect` naming the rules that must fail."""
        workload, _ = SCENARIOS[self.scenario]
        path = os.path.join(trace_dir, f"sglang-mutant-{self.name}.jsonl")
        with SCENARIO_LOCK:
            sglang()
            patch = self.patch()
        result = run_workload(workload, path, fuzz_schedule, patch=patch)
        result.update(name=self.name, expect=sorted(self.rules))
        return result


PREFILL_MUTANTS: Registry[PrefillMutant] = Registry("prefill mutant")


def _prefill_mutant(name: str, scenario: str, rules: set[str]):
    """Register the decorated patch as the mutant `name` of `scenario`, which `rules` must
    report."""

    def add(patch: Callable) -> Callable:
        PREFILL_MUTANTS.register(name)(PrefillMutant(name, scenario, patch, frozenset(rules)))
        return patch

    return add


@_prefill_mutant(
    "prefill-sample-before-process", "prefill-no-early-send/overlap", {"P-overlap-process-prev"}
)
def _sample_before_process():
    """event_loop_overlap_disagg_prefill with `self.launch_batch_sample_if_needed(batch_result, batch)`
    moved before `if self.last_batch:` (result processing of the previous batch): batch N is sampled
    before P(N-1) ran, which SGLang's own comment forbids (sampling depends on the previous batch's
    result, e.g. its grammar state)."""  # noqa: E501 (its first line is what --list prints)
    mixin = sglang().prefill.SchedulerDisaggregationPrefillMixin
    return mutate.mutation(
        mixin,
        "event_loop_overlap_disagg_prefill",
        mutate.MoveStatement(
            "self.launch_batch_sample_if_needed(batch_result, batch)", "if self.last_batch:"
        ),
    )


class _ReplaceTest(ast.NodeTransformer):
    """Replace the test of every `if` whose source is a key of `tests` by the parsed value."""

    tests: dict = {}

    def visit_If(self, node):
        self.generic_visit(node)
        new = self.tests.get(ast.unparse(node.test))
        if new is not None:
            node.test = ast.parse(new, mode="eval").body
        return node


class _TransferringIsDone(_ReplaceTest):
    tests = {
        "poll in [KVPoll.WaitingForInput, KVPoll.Transferring]": "poll == KVPoll.WaitingForInput",
        "poll == KVPoll.Success": "poll in (KVPoll.Success, KVPoll.Transferring)",
    }


@_prefill_mutant("release-before-delivery", "prefill-chunked/overlap", {"P-release-after-delivery"})
def _release_before_delivery():
    """process_disagg_prefill_inflight_queue treating a sender that polls KVPoll.Transferring as
    done: the request's KV pages are released while its transfer may still read them."""
    mixin = sglang().prefill.SchedulerDisaggregationPrefillMixin
    return mutate.mutation(mixin, "process_disagg_prefill_inflight_queue", _TransferringIsDone())
