"""Shared helpers for the engine tests."""

from __future__ import annotations

from engine.oracle.reference import reference_generate
from engine.oracle.reference_prefill import reference_prefill as reference  # noqa: F401 - re-exported
from engine.runs.prefill_run import run_prefill
from engine.runs.spec import RunSpec, WorkloadConfig
from engine.runs.workload import make_workload
from engine.runtime.config import EngineConfig


def run_mode(mode: str, *, trace_path=None, inject=(), workload=None, verify=False, **cfg_kw):
    # A small token budget makes admission FIFO-paced (about one request per batch), so the first
    # request of each prefix group is released before its followers are admitted: cache hits
    # do not depend on timing.
    cfg_kw.setdefault("max_batch_tokens", 128)
    cfg = EngineConfig(mode=mode, inject=frozenset(inject), **cfg_kw)
    wc = workload or WorkloadConfig(requests=12, prompt_len=(20, 150), hit=0.6, seed=3)
    return run_prefill(RunSpec(cfg, wc, trace_path=trace_path, verify=verify), keep_error=True), cfg


_GEN: dict = {}


def assert_tokens_match_reference(s, cfg: EngineConfig, wc: WorkloadConfig) -> None:
    """Every token each finished request of a PD run generated equals the single-process reference's
    (engine/oracle/reference.py), position by position: judged here, apart from run_pd's own comparison."""
    reqs = {r.rid: r for r in make_workload(wc, cfg.model_config.vocab_size)}
    for rid, toks in s["outputs"].items():
        r = reqs[rid]
        bias = tuple(sorted((r.logit_bias or {}).items()))
        key = (cfg.model, cfg.seed, cfg.dtype, tuple(r.prompt), bias, r.max_new_tokens)
        if key not in _GEN:
            _GEN[key] = reference_generate(cfg, [r])[rid]
        ref = _GEN[key]
        assert len(toks) == r.max_new_tokens, f"{rid}: {len(toks)} tokens, not {r.max_new_tokens}"
        bad = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)
        assert bad is None, f"{rid} token {bad}: {toks[bad]} != reference {ref[bad]}"
