"""Small prefill batches for the request, digest and trace tests."""

from __future__ import annotations

import torch

from engine.runtime.request import Req, SamplingBatchInfo, ScheduleBatch


class Spec:
    """A stand-in spec_info, filtered in place with its batch."""

    def __init__(self, n):
        self.draft = list(range(n))

    def filter_(self, keep):
        self.draft = [self.draft[i] for i in keep]


def make_batch(n=3):
    reqs = [
        Req(rid=f"r{i}", prompt=[1, 2, 3], bootstrap_room=i, logit_bias={i: 1.0}) for i in range(n)
    ]
    return ScheduleBatch(
        bid=0,
        reqs=reqs,
        starts=[0] * n,
        extends=[3] * n,
        last_chunk=[True] * n,
        input_ids=torch.arange(3 * n),
        positions=torch.arange(3 * n),
        out_cache_loc=torch.arange(3 * n),
        sampling_info=SamplingBatchInfo.build(reqs, 8, "cpu"),
        spec_info=Spec(n),
    )
