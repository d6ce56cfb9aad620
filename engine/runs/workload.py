"""A seeded workload: prompts with a controlled prefix-hit ratio, and an arrival pattern.

Requests are drawn from `groups` shared prefixes ("system prompts"); a fraction `hit` of each prompt is
its group's prefix, the rest is unique. With a warm cache, about `hit` of the input tokens are cached.
"""

from __future__ import annotations

import random

from engine.runs.spec import WorkloadConfig
from engine.runtime.request import Req


def make_workload(wc: WorkloadConfig, vocab: int) -> list[Req]:
    rng = random.Random(wc.seed)
    lo, hi = wc.prompt_len
    max_prefix = int(hi * wc.hit) + 1
    prefixes = [
        [rng.randrange(1, vocab) for _ in range(max_prefix)] for _ in range(max(1, wc.groups))
    ]
    reqs, t = [], 0.0
    for i in range(wc.requests):
        n = rng.randint(lo, hi)
        shared = int(round(n * wc.hit))
        prompt = prefixes[rng.randrange(len(prefixes))][:shared] + [
            rng.randrange(1, vocab) for _ in range(n - shared)
        ]
        bias = None
        if rng.random() < wc.logit_bias_frac:
            bias = {rng.randrange(vocab): rng.choice([-5.0, 5.0]) for _ in range(3)}
        if wc.arrival == "poisson":
            t += rng.expovariate(wc.rate)
        reqs.append(
            Req(
                rid=f"r{i}",
                prompt=prompt,
                bootstrap_room=1000 + i,
                arrival_s=t,
                max_new_tokens=wc.max_new_tokens,
                logit_bias=bias,
            )
        )
    return reqs
