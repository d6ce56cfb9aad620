"""The cases a schedule runs: a prefill case (one prefill engine) and a PD case (prefill DP ranks,
the bootstrap server and a decode, in one process), and the seeded draw of PD cases."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Annotated, Literal

from msgspec import Meta

from engine.decode.config import DecodeConfig
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from spec.vocabulary import DECODE_LOOPS, PREFILL_LOOPS

from .pressure import with_pressure

# The declared domain of each field (msgspec checks a case file against it, checker/fuzz/casefile.py;
# what spans fields, such as prompt_len's order, casefile.check_case). A case is a small run.
CONTEXT = 1024  # the tiny model's context: a request's prompt and new tokens fit in it
Count = Annotated[int, Meta(ge=1, le=64)]
Tokens = Annotated[int, Meta(ge=1, le=CONTEXT)]
Pages = Annotated[int, Meta(ge=2, le=65536)]
Slots = Annotated[int, Meta(ge=1, le=1024)]
Seed = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Ratio = Annotated[float, Meta(ge=0.0, le=1.0)]
Millis = Annotated[float, Meta(ge=0.0, le=60_000.0)]
Step = Annotated[int, Meta(ge=-1, le=1_000_000)]


@dataclass
class Case:
    mode: Literal[PREFILL_LOOPS] = "ahead"
    inject: tuple[str, ...] = ()
    requests: Count = 4
    prompt_len: tuple[Tokens, Tokens] = (8, 40)
    hit: Ratio = 0.5
    groups: Count = 1
    logit_bias_frac: Ratio = 0.5
    page_size: Tokens = 4
    chunk_size: Tokens = 16
    max_batch_tokens: Annotated[int, Meta(ge=1, le=65536)] = 24
    num_pages: Pages = 64
    max_slots: Slots = 16
    workload_seed: Seed = 0
    arrival: Literal["burst", "poisson"] = "burst"

    def spec(self) -> RunSpec:
        """The run of this case: every output verified (engine/oracle/judge.py)."""
        cfg = EngineConfig(
            mode=self.mode,
            page_size=self.page_size,
            chunk_size=self.chunk_size,
            max_batch_tokens=self.max_batch_tokens,
            num_pages=self.num_pages,
            max_batch_reqs=8,
            max_slots=self.max_slots,
            inject=frozenset(self.inject),
        )
        workload = WorkloadConfig(
            requests=self.requests,
            prompt_len=tuple(self.prompt_len),
            hit=self.hit,
            groups=self.groups,
            logit_bias_frac=self.logit_bias_frac,
            seed=self.workload_seed,
            arrival=self.arrival,
            rate=5000.0,
        )
        return RunSpec(cfg, workload)


@dataclass
class PDCase(Case):
    """A whole PD run (engine/runs/pd.py) under the controller: the prefill case's workload and engine
    knobs (`mode` is the prefill ranks' loop), plus the decode's knobs, client aborts, memory
    release, bootstrap latency and failures. Every thread (each rank's scheduler, forward worker,
    streams and KV transfer thread; the decode scheduler, its streams and prefetch workers) is a
    managed thread; the bootstrap server is served in-process."""

    kind: Literal["pd"] = "pd"
    decode_loop: Literal[DECODE_LOOPS] = "overlap"
    prefetch: bool = True
    dp: Annotated[int, Meta(ge=1, le=32)] = 2
    max_new_tokens: Tokens = 3
    # the decode polls its prealloc/transfer queues every N iterations
    polling_interval: Annotated[int, Meta(ge=1, le=1000)] = 1
    # decode max_slots: few slots keep resolved requests pending
    decode_slots: Slots = 64
    # decode-only requests for rooms no prefill rank serves (never registered)
    unserved: Annotated[int, Meta(ge=0, le=64)] = 0
    # ((iteration, k), ...): after that iteration's prefetch the client aborts the k-th (mod n)
    # pending request, else the k-th unfinished one; k = -1: all of them (clients going away
    # together)
    aborts: tuple[tuple[Step, Step], ...] = ()
    # (k, n): release_memory_occupation right after the prefetch that submitted the decode's k-th
    # query (while it is in flight, the case D-release-cancels is about); resume_memory n iterations
    # later
    release: tuple[Step, ...] = ()
    latency_ms: Millis = 0.0  # bootstrap latency (virtual time), on latency_scope
    latency_scope: Literal["all", "query_dp_ranks"] = "query_dp_ranks"
    # fraction of query_dp_ranks answered 503 (seeded by fault_seed)
    failure_rate: Ratio = 0.0
    fault_seed: Seed = 0
    prefill_delay_ms: Millis = 0.0  # prefill ranks register late: decode sees 503 until then
    decode_pages: Pages = 256  # the decode's KV pool (page 0 reserved)

    def spec(self) -> RunSpec:
        """The run of this case, judged by the harness (checker/fuzz/runs.py) rather than by
        run_pd's own verify; the bootstrap server in process (the run replays exactly)."""
        spec = super().spec()
        spec.workload.max_new_tokens = self.max_new_tokens
        spec.dp, spec.prefill_delay_s = self.dp, self.prefill_delay_ms / 1000.0
        spec.verify, spec.bootstrap = False, "inproc"
        # Virtual time: the clock moves only when every thread sleeps, so the bounds are in idle
        # time.
        spec.decode = DecodeConfig(
            loop=self.decode_loop,
            prefetch=self.prefetch,
            polling_interval=self.polling_interval,
            max_slots=self.decode_slots,
            num_pages=self.decode_pages,
            max_running=8,
            query_retries=0,
            query_timeout_s=0.02,
            bootstrap_timeout_s=0.03,
            kv_timeout_s=1.0,
            info_retry_interval_s=0.001,
        )
        return spec


def draw_pd_case(rng: random.Random, **fixed) -> PDCase:
    """A random PD case (the seeded counterpart of the Hypothesis strategy in
    tests/checker/fuzz/test_fuzz.py)."""
    ps = rng.choice([1, 4, 8])
    knobs = dict(
        mode=rng.choice(PREFILL_LOOPS),
        decode_loop=rng.choice(DECODE_LOOPS),
        dp=rng.choice([1, 2, 2, 3]),
        requests=rng.randint(2, 6),
        prompt_len=(8, rng.choice([16, 40])),
        hit=rng.choice([0.0, 0.5, 0.8]),
        max_new_tokens=rng.randint(1, 4),
        page_size=ps,
        chunk_size=4 * ps,
        max_batch_tokens=6 * ps,
        workload_seed=rng.randrange(1000),
        arrival=rng.choice(["burst", "poisson"]),
        polling_interval=rng.choice([1, 1, 2, 3]),
        decode_slots=rng.choice([1, 2, 64, 64]),
        unserved=rng.choice([0, 1, 1, 2]),
        aborts=tuple(
            (rng.randint(2, 8), rng.randrange(-1, 4)) for _ in range(rng.choice([0, 1, 2, 3]))
        ),
        release=(rng.randint(1, 4), rng.randint(1, 4)) if rng.random() < 0.4 else (),
        latency_ms=rng.choice([0.0, 0.0, 0.5, 3.0]),
        latency_scope=rng.choice(["query_dp_ranks", "all"]),
        failure_rate=rng.choice([0.0, 0.0, 0.3]),
        fault_seed=rng.randrange(100),
        prefill_delay_ms=rng.choice([0.0, 0.0, 1.0]),
    )
    knobs.update(fixed)
    # drawn last, so the knobs above stay what they were for every seed
    return with_pressure(PDCase(**knobs), rng, fixed)


@dataclass(frozen=True)
class PDDraws:
    """The case draw for PD campaigns: schedule i of seed s runs
    draw_pd_case(Random(s * 100003 + i), **fixed). A value, not a closure, so that a campaign's
    worker processes (`pdo fuzz --jobs`) draw exactly the cases one process would."""

    seed: int
    fixed: tuple = ()  # (name, value) pairs given to draw_pd_case

    def __call__(self, i: int) -> PDCase:
        return draw_pd_case(random.Random(self.seed * 100_003 + i), **dict(self.fixed))


def pd_draws(seed: int, **fixed) -> PDDraws:
    """The case draw for PD campaigns (see PDDraws)."""
    return PDDraws(seed, tuple(sorted(fixed.items())))


def pct_steps(case) -> int:
    return 1000 if isinstance(case, PDCase) else 400
