"""The prefill universe: K batches of a workload, every event a prefill mode could emit for it, with
symbolic position, thread, existence and fields."""

from __future__ import annotations

from dataclasses import dataclass

from .. import load_events
from .universe import STREAM, Ev, SymbolicUniverse


@dataclass(frozen=True)
class Chunk:
    rid: str
    middle: bool = (
        False  # not the request's last chunk: inflight_middle_chunks goes up at admission
    )
    prefix: bool = False  # the request's first chunk, with a cached prefix whose KV is sent early


@dataclass(frozen=True)
class Workload:
    """Which request chunks each batch holds, in batch order (continuing chunk first, as SGLang)."""

    batches: tuple

    @staticmethod
    def canonical(k: int) -> Workload:
        """Batch n holds the last chunk of r(n-1) and the first chunk of r(n), which has a cached
        prefix and is itself continued in batch n+1: every batch has a chunked request in flight
        across it, the case of the design's middle-chunk and cached-prefix hazards."""
        out = []
        for n in range(k):
            chunks = [Chunk(f"r{n - 1}")] if n else []
            chunks.append(Chunk(f"r{n}", middle=n < k - 1, prefix=True))
            out.append(tuple(chunks))
        return Workload(tuple(out))

    @property
    def K(self) -> int:
        return len(self.batches)

    def requests(self) -> list[str]:
        seen = []
        for chunks in self.batches:
            seen += [c.rid for c in chunks if c.rid not in seen]
        return seen

    def holding(self, rid) -> list[int]:
        return [n for n, chunks in enumerate(self.batches) if any(c.rid == rid for c in chunks)]

    def new_in(self, n) -> list[str]:
        return [c.rid for c in self.batches[n] if self.holding(c.rid)[0] == n]


def _vocab():
    return load_events()["prefill"]


def batch_event_names() -> list[str]:
    """Events that belong to a batch and not to a request, from spec/events.toml; not those the
    loop model does not emit (loop_model = false: the device's own, which it keeps hidden)."""
    return [
        ev
        for ev, spec in _vocab().items()
        if "batch" in spec["fields"]
        and "rid" not in spec["fields"]
        and spec.get("loop_model", True)
    ]


class ModelUniverse(SymbolicUniverse):
    """Every event a mode could emit for the workload, each with symbolic position, thread,
    existence and fields (objects, slots, counter values, digests, token and page counts)."""

    def __init__(self, workload: Workload, page_size: int = 16):
        super().__init__(page_size)
        self.workload, self.K = workload, workload.K
        vocab = _vocab()
        for n, chunks in enumerate(workload.batches):
            for name in batch_event_names():
                f = {"rids": tuple(c.rid for c in chunks)} if name == "admit" else {}
                self._make(name, n, (name, n), f, vocab, always=name == "admit")
        for rid in workload.requests():
            self._make("alloc", None, ("alloc", rid), {"rid": rid}, vocab)
            self._make("release", None, ("release", rid), {"rid": rid}, vocab)
        for n, chunks in enumerate(workload.batches):
            for c in chunks:
                if c.prefix:
                    self._make(
                        "prefix_send",
                        None,
                        ("prefix_send", c.rid, n),
                        {"rid": c.rid, "batch": n},
                        vocab,
                        extra=("tokens", "pages"),
                    )
                if c.middle:
                    self._make("chunk_inc", None, ("chunk_inc", c.rid, n), {"rid": c.rid}, vocab)
                    self._make("chunk_dec", None, ("chunk_dec", c.rid, n), {"rid": c.rid}, vocab)
                self._make("kv_send", None, ("kv_send", c.rid, n), {"rid": c.rid}, vocab)
        for n in range(self.K):  # device work: the staging write and the forward's buffer reads
            for name in ("dev_stage", "dev_forward"):
                self.hide((name, n), STREAM)

    def b(self, name, n) -> Ev:
        """The event `name` of batch n."""
        return self.by_key[(name, n)]

    def r(self, name, rid, n=None) -> Ev:
        """The event `name` of request rid (in batch n, for the per-chunk ones)."""
        return self.by_key[(name, rid) if n is None else (name, rid, n)]


def batch_groups(universe, n):
    """The events of batch n by step: building it (admit, middle-chunk increments), its
    cached-prefix sends, processing its result (process_begin .. process_end)."""
    workload, b, r = universe.workload, universe.b, universe.r
    admit = [b("admit", n)] + [r("chunk_inc", c.rid, n) for c in workload.batches[n] if c.middle]
    prefix = [r("prefix_send", c.rid, n) for c in workload.batches[n] if c.prefix]
    process = [b("process_begin", n)]
    for c in workload.batches[n]:
        process += ([r("chunk_dec", c.rid, n)] if c.middle else []) + [r("kv_send", c.rid, n)]
    process.append(b("process_end", n))
    return admit, prefix, process
