"""The engine end to end on the Triton kernels (through the interpreter on CPU): the same tokens and
KV as the unchunked torch reference in every mode, on a tiny workload."""
import pytest
import torch

from checker.linear import check_file
from engine.config import MODES
from engine.workload import WorkloadConfig

from .helpers import reference, run_mode


@pytest.mark.parametrize("mode", MODES)
def test_triton_backend_matches_reference(mode, tmp_path):
    trace = tmp_path / "t.jsonl"
    wc = WorkloadConfig(requests=4, prompt_len=(20, 70), hit=0.8, groups=1, seed=2)
    summary, cfg = run_mode(mode, trace_path=str(trace), workload=wc, attention_backend="triton",
                            max_batch_tokens=48, chunk_size=32, page_size=8)
    assert summary["_error"] is None, summary["_error"]
    assert summary["attention_backend"] == "triton"
    assert summary["cached_tokens"] > 0 and summary["batches"] >= 3
    sched = summary["_scheduler"]
    for req in summary["_requests"]:
        first, k_ref, v_ref = reference(cfg, req.prompt, req.logit_bias)
        assert req.output_token == first
        k, v = sched.receiver.kv(req.bootstrap_room)
        torch.testing.assert_close(k, k_ref, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(v, v_ref, atol=2e-4, rtol=1e-4)
    assert not any(summary["leaks"].values())
    assert check_file(str(trace)).ok
