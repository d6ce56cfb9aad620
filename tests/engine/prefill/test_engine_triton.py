"""The engine end to end on the Triton kernels (through the interpreter on CPU): the same tokens and
KV as the unchunked torch reference in every mode, on a tiny workload."""

import pytest
import torch

from checker.linear import check_file
from engine.runs.spec import RunSpec, WorkloadConfig
from spec.vocabulary import PREFILL_LOOPS
from tests.helpers import reference, run_mode

# the loops' traces refine their models (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("refined")


@pytest.mark.parametrize("mode", PREFILL_LOOPS)
def test_triton_backend_matches_reference(mode, tmp_path):
    trace = tmp_path / "t.jsonl"
    wc = WorkloadConfig(requests=4, prompt_len=(20, 70), hit=0.8, groups=1, seed=2)
    run, cfg = run_mode(
        mode,
        trace_path=str(trace),
        workload=wc,
        attention_backend="triton",
        max_batch_tokens=48,
        chunk_size=32,
        page_size=8,
    )
    assert run.error is None, run.error
    assert run.summary["attention_backend"] == "triton"
    assert run.summary["cached_tokens"] > 0 and run.summary["batches"] >= 3
    sched = run.scheduler
    for req in run.requests:
        first, k_ref, v_ref = reference(cfg, req.prompt, req.logit_bias)
        assert req.output_token == first
        k, v = sched.receiver.kv(req.bootstrap_room)
        torch.testing.assert_close(k, k_ref, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(v, v_ref, atol=2e-4, rtol=1e-4)
    assert not any(run.summary["leaks"].values())
    assert check_file(str(trace)).ok


@pytest.mark.parametrize("mode, loop, dp", [("ahead", "overlap", 2), ("thread", "normal", 1)])
def test_pd_decode_on_the_triton_backend_matches_reference(tmp_path, monkeypatch, mode, loop, dp):
    """A whole PD run (prefill ranks, bootstrap server, decode) with every attention call on the Triton
    kernels — prefill's extend and decode's paged decode attention — gives the tokens of the
    single-process reference (torch attention), leaks nothing, and its traces pass `pdo check`. Under
    the interpreter the prefill and decode forwards interpret kernels from two threads at once, which
    the backend serialises (triton_kernels/backend.py)."""
    from engine.decode.config import DecodeConfig
    from engine.runs.pd import run_pd
    from engine.runtime.config import EngineConfig
    from tests.engine.runs.test_pd import assert_clean, assert_traces_pass
    from triton_kernels.backend import TritonAttention

    calls = {"extend": 0, "decode": 0}
    for name in calls:

        def counted(self, *a, _name=name, _fn=getattr(TritonAttention, name), **k):  # noqa: B008 (binds the loop value)
            calls[_name] += 1
            return _fn(self, *a, **k)

        monkeypatch.setattr(TritonAttention, name, counted)
    wc = WorkloadConfig(
        requests=3, prompt_len=(20, 60), hit=0.8, groups=1, max_new_tokens=4, seed=2
    )
    cfg = EngineConfig(
        mode=mode, attention_backend="triton", page_size=8, chunk_size=32, max_batch_tokens=48
    )
    s = run_pd(
        RunSpec(cfg, wc, DecodeConfig(loop=loop), dp=dp, trace_path=str(tmp_path / "t.jsonl"))
    ).summary
    assert_clean(s)
    assert s["decode_tokens"] == wc.requests * (wc.max_new_tokens - 1)
    assert calls["extend"] > 0 and calls["decode"] > 0, calls
    assert_traces_pass(s["traces"])
