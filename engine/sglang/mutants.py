"""Real-code mutations of SGLang 0.5.23's decode: the decode bug classes of the mutant suite, applied to
SGLang's own methods at run time (engine/sglang/mutate.py rewrites the method's source for the duration
of a `with` block; SGLang's files are never touched), so `pdo conform sglang --mutant NAME` shows that
the checks catch them. The prefill loop's mutant is in engine/sglang/conform_prefill.py (MUTANTS).
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses

from .mutate import mutation


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    cls: str          # "decode.DecodePreallocQueue": module attribute of the load() namespace, then class
    method: str
    transform: object  # ast.NodeTransformer subclass
    scenarios: tuple   # the scenarios where it is observable
    rules: tuple       # the rules expected to flag it


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


def _make(base, needle):
    return type(f"{base.__name__}[{needle}]", (base,), {"needle": needle})


class _KeepComprehensionAll(ast.NodeTransformer):
    """Drop the `if` filter of the room comprehension (every room, known or not)."""

    def visit_GeneratorExp(self, node):
        self.generic_visit(node)
        for gen in node.generators:
            gen.ifs = [c for c in gen.ifs if "_resolve_prefill_dp_rank" not in ast.unparse(c)]
        return node


Q = "decode.DecodePreallocQueue"
MUTANTS = {m.name: m for m in (
    Mutant("prefetch-use-mismatched-rooms", "the prefetched answer is used for rooms it was not asked for "
           "(the tail of a grown room set is never queried)", Q, "_resolve_pending_reqs",
           _make(_FalseIf, "remaining_rooms"), ("decode-arrivals/normal", "decode-rooms-grow/normal"),
           ("D-prefetch-match",)),
    Mutant("no-stale-cancel", "prefetched queries of addresses with no pending request are kept",
           Q, "prefetch_prefill_dp_rank_queries", _make(_DropFor, "set(queries) - set(addr_to_reqs)"),
           ("decode-two-addresses/normal", "decode-abort-after-prefetch/normal"), ("D-no-stale",)),
    Mutant("no-cancel-on-release", "release_memory_occupation leaves prefetched queries running",
           Q, "release_memory_occupation", _make(_DropCall, "_cancel_prefill_dp_rank_queries"),
           ("decode-release-pending/normal",), ("D-release-cancels",)),
    Mutant("double-prefetch", "a second query is submitted while one is in flight for the address",
           Q, "prefetch_prefill_dp_rank_queries", _make(_DropIf, "bootstrap_addr in queries"),
           ("decode-polling-interval/normal", "decode-polling-interval/overlap"), ("D-one-query-per-addr",)),
    Mutant("prefetch-before-published", "a query goes to a prefill that has not published its parallel info",
           Q, "prefetch_prefill_dp_rank_queries", _make(_DropIf, "prefill_info_table.get(bootstrap_addr) is None"),
           ("decode-two-addresses/normal",), ("D-published-first",)),
    Mutant("query-every-iteration", "rooms whose rank is already known are asked again",
           Q, "prefetch_prefill_dp_rank_queries", _KeepComprehensionAll,
           ("decode-single-rank/normal", "decode-arrivals/normal"), ("D-unknown-rooms-only",)),
)}


@contextlib.contextmanager
def applied(sgl, mutant: Mutant):
    """The class's method replaced by its mutated version inside the block (the hooks still wrap it)."""
    module, cls_name = mutant.cls.split(".")
    cls = getattr(getattr(sgl, module), cls_name)
    with mutation(cls, mutant.method, mutant.transform()):
        yield
