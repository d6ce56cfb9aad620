"""The command-line knobs that `pdo bench prefill` and `pdo bench trace-overhead` share: the
engine and workload group, and turning it into EngineConfig / WorkloadConfig keyword arguments."""

from __future__ import annotations

import sys

from engine.bench.progress import Progress
from engine.runtime.config import MODEL_PRESETS
from spec import domains as d
from spec.errors import BadInput

MAX_CONTEXT = max(m.max_context for m in MODEL_PRESETS.values())
MAX_POOL_TOKENS = 1 << 20  # as `pdo run` (engine/cli/flags.py)
COST_US = d.number(0, 1e6)


def floats(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise BadInput(f"expected comma-separated numbers, got {s!r}") from None


def add_engine_knobs(p) -> None:
    g = p.add_argument_group("engine and workload")
    g.add_argument("--model", choices=list(MODEL_PRESETS), default="tiny")
    g.add_argument(
        "--device", type=d.device(), default=None, help="cpu or cuda (default: cuda if available)"
    )
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="model dtype (default: bfloat16 on cuda, float32 on cpu)",
    )
    g.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="auto: torch on cpu, the Triton kernels on cuda",
    )
    g.add_argument(
        "--num-pages",
        type=d.integer(2, MAX_POOL_TOKENS),
        default=512,
        help="KV pool pages (of --page-size tokens)",
    )
    g.add_argument("--page-size", type=d.integer(1, MAX_CONTEXT), default=16)
    g.add_argument("--max-batch-reqs", type=d.integer(1, 1024), default=16)
    g.add_argument(
        "--admission-cost-us",
        type=COST_US,
        default=0.0,
        help="extra host work per admitted request (a heavier scheduler)",
    )
    g.add_argument(
        "--launch-cost-us",
        type=COST_US,
        default=None,
        help="host time per layer launch inside run_batch (eager launch overhead); "
        "default: 0 for trace-overhead, 1000 for prefill on cpu, 0 on cuda "
        "(see docs/benchmarks.md)",
    )
    g.add_argument("--max-batch-tokens", type=d.integer(1, MAX_POOL_TOKENS), default=256)
    g.add_argument("--chunk-size", type=d.integer(1, MAX_CONTEXT), default=128)
    g.add_argument(
        "--prompt-len", type=d.span(1, MAX_CONTEXT), default="24:160", help="MIN:MAX prompt tokens"
    )
    g.add_argument("--groups", type=d.integer(1, 100_000), default=3)
    g.add_argument(
        "--switch-interval-us",
        type=d.number(0, 1e6, above=True),
        default=None,
        help="sys.setswitchinterval for the whole benchmark (default: Python's, 5000)",
    )


def engine_workload(a, default_launch: float) -> tuple[dict, dict]:
    """EngineConfig and WorkloadConfig keyword arguments from the knobs; `default_launch` is the
    launch cost on the CPU device when --launch-cost-us is not given."""
    import torch  # lazy: torch is slow to import, and every pdo command loads this module

    check_knobs(a)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(f"--device {device}: this torch ({torch.__version__}) sees no CUDA device")
    dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    # The emulated launch cost stands in for eager launches on the CPU device; a GPU has real ones.
    if a.launch_cost_us is not None:
        launch = a.launch_cost_us
    else:
        launch = 0.0 if device.startswith("cuda") else default_launch
    engine = {
        "model": a.model,
        "admission_cost_us": a.admission_cost_us,
        "launch_cost_us": launch,
        "max_batch_tokens": a.max_batch_tokens,
        "chunk_size": a.chunk_size,
        "device": device,
        "dtype": dtype,
        "attention_backend": a.attention_backend,
        "num_pages": a.num_pages,
        "page_size": a.page_size,
        "max_batch_reqs": a.max_batch_reqs,
    }
    workload = {"prompt_len": a.prompt_len, "groups": a.groups}
    return engine, workload


def check_knobs(a) -> None:
    """What spans the knobs: a prompt and a chunk fit the model's context, a bounded KV pool."""
    context = MODEL_PRESETS[a.model].max_context
    if a.prompt_len[1] >= context or a.chunk_size > context:
        raise BadInput(
            f"--prompt-len {a.prompt_len[1]} / --chunk-size {a.chunk_size}: the {a.model} model's "
            f"context is {context} tokens"
        )
    if a.num_pages * a.page_size > MAX_POOL_TOKENS:
        raise BadInput(
            f"--num-pages {a.num_pages} x --page-size {a.page_size}: a KV pool of more than "
            f"{MAX_POOL_TOKENS} tokens"
        )


def progress_of(a) -> Progress:
    return Progress(True if a.progress else None)


def apply_switch_interval(a) -> float:
    """Applies --switch-interval-us, if given; returns the GIL switch interval in µs."""
    if a.switch_interval_us:
        sys.setswitchinterval(a.switch_interval_us * 1e-6)
    return sys.getswitchinterval() * 1e6
