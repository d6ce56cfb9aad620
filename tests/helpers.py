"""Shared helpers for the engine tests."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.reference_prefill import reference_prefill as reference  # noqa: F401 - re-exported
from engine.run import run_prefill
from engine.workload import WorkloadConfig


def run_mode(mode: str, *, trace_path=None, inject=(), workload=None, verify=False, **cfg_kw):
    # A small token budget makes admission FIFO-paced (about one request per batch), so the first
    # request of each prefix group is released before its followers are admitted: cache hits
    # do not depend on timing.
    cfg_kw.setdefault("max_batch_tokens", 128)
    cfg = EngineConfig(mode=mode, inject=frozenset(inject), **cfg_kw)
    wc = workload or WorkloadConfig(requests=12, prompt_len=(20, 150), hit=0.6, seed=3)
    return run_prefill(cfg, wc, trace_path=trace_path, keep_scheduler=True, verify=verify), cfg
