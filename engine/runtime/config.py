"""Configuration: model presets, engine knobs, and the loop-mode dispatch rules of the
design."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.errors import ConfigError
from engine.runtime import inject
from spec.vocabulary import PREFILL_LOOPS


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_context: int = 1024


MODEL_PRESETS = {
    # Small enough that CPU tests forward batches quickly.
    "tiny": ModelConfig(),
    # A GPU-sized model: big enough that the forward dominates host work, as in production.
    "large": ModelConfig(
        vocab_size=32000,
        hidden=2048,
        layers=16,
        heads=16,
        kv_heads=4,
        head_dim=128,
        intermediate=5632,
        max_context=16384,
    ),
}


@dataclass
class EngineConfig:
    mode: str = "ahead"
    model: str = "tiny"
    page_size: int = 16
    num_pages: int = 512
    max_slots: int = 64
    chunk_size: int = 128  # max tokens of one request in one batch (chunked prefill)
    max_batch_tokens: int = 256  # per-batch token budget
    max_batch_reqs: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "auto"  # auto | torch | triton
    # The model's forward with the torch backend: "script" (each layer one TorchScript call, run with
    # the GIL released), "eager" (op by op in Python), "auto" (PDO_FORWARD, else script). The Triton
    # backend is always eager. See engine/runtime/model.py.
    forward: str = "auto"
    seed: int = 0
    # Scheduler-side cost per admitted request, in microseconds of real host work (a stand-in for
    # SGLang's admission cost: tokenizer bookkeeping, radix matching on a big tree, grammar setup).
    admission_cost_us: float = 0.0
    # Host-side cost of launching one layer's kernels inside run_batch, in microseconds. Eager CUDA
    # prefill spends real host time here (SGLang: ~20 kernel launches per layer); on CPU the stream
    # thread computes, so without this the host path that the forward thread hides would be ~0.
    launch_cost_us: float = 0.0
    # Keep the objects alive before the loop starts (modules, weights, the scheduler) out of the
    # cyclic garbage collector while it runs (gc.freeze; undone after). A full collection in this
    # process scans every one of them: a stall in the middle of the loop, as SGLang's freeze_gc
    # (called after warm-up) avoids. The collector still runs for what the loop allocates.
    freeze_gc: bool = True
    inject: frozenset = field(
        default_factory=frozenset
    )  # mutation switches (see engine/runtime/inject.py)
    # Disaggregated-prefill dispatch conditions of the design. The engine is a disaggregated prefill
    # instance by default; the flags exist so dispatch can refuse what SGLang refuses.
    disaggregation_mode: str = "prefill"
    pp_size: int = 1
    enable_overlap: bool = True

    def __post_init__(self):
        if self.mode not in PREFILL_LOOPS:
            raise ConfigError(
                f"unknown mode {self.mode!r}; choose one of {', '.join(PREFILL_LOOPS)}"
            )
        self.inject = inject.checked(self.inject)
        if self.model not in MODEL_PRESETS:
            raise ConfigError(
                f"unknown model preset {self.model!r}; choose one of {', '.join(MODEL_PRESETS)}"
            )
        if self.forward not in ("auto", "script", "eager"):
            raise ConfigError(f"unknown forward {self.forward!r}; choose auto, script or eager")
        if self.page_size < 1 or self.chunk_size < self.page_size:
            raise ConfigError("page_size must be >= 1 and chunk_size >= page_size")
        # Non-final chunks end on a page boundary so that every KV send covers whole pages except the
        # request's very last one (SGLang aligns the chunked-prefill size to the page size likewise).
        self.chunk_size -= self.chunk_size % self.page_size
        self.max_batch_tokens = max(self.max_batch_tokens, self.chunk_size)

    @property
    def model_config(self) -> ModelConfig:
        return MODEL_PRESETS[self.model]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_SWITCHES = ("SGLANG_ENABLE_PREFILL_FWD_THREAD", "SGLANG_PREFILL_FWD_THREAD_AHEAD")


def mode_from_env(default: str = "ahead") -> str:
    """The design's two switches, under SGLang's names, read as SGLang reads them once either is set
    (both default off there): FWD_THREAD off -> the old overlap loop (AHEAD alone does nothing: it is
    read only inside the threaded loop); FWD_THREAD alone -> thread (validation mode); both -> ahead.
    With neither set, `default`: this project runs admit-ahead unless told otherwise."""
    if not any(os.environ.get(n, "").strip() for n in _SWITCHES):
        return default
    if not _env_flag("SGLANG_ENABLE_PREFILL_FWD_THREAD"):
        return "overlap"
    return "ahead" if _env_flag("SGLANG_PREFILL_FWD_THREAD_AHEAD") else "thread"


def check_dispatch(cfg: EngineConfig) -> None:
    """Refuse the configurations for which SGLang never enters these loops."""
    if cfg.mode == "normal":
        return
    if cfg.disaggregation_mode != "prefill":
        raise ConfigError(
            f"mode {cfg.mode!r} needs a disaggregated prefill instance "
            f"(disaggregation_mode=prefill), got {cfg.disaggregation_mode!r}"
        )
    if cfg.pp_size != 1:
        raise ConfigError(
            f"mode {cfg.mode!r} needs pipeline parallel size 1, got {cfg.pp_size} "
            "(PP>1 has its own loop in SGLang)"
        )
    if not cfg.enable_overlap:
        raise ConfigError(
            f"mode {cfg.mode!r} needs overlap scheduling enabled; use --mode normal instead"
        )
