#!/usr/bin/env bash
# Set up .venv for pd-overlap. torch and Triton are installed first, pinned, so that the project's loose
# `torch>=2.4` / `triton>=3.2` requirements are already met and pip neither pulls a multi-GB CUDA build
# onto a CPU machine nor the newest Triton from the index.
#
#   Triton: 3.8.0 everywhere, so that the CPU tests (the kernels through the interpreter, and
#           tests/triton_kernels/test_triton_compile_sm90.py, which compiles them for sm_90 without a GPU) run the
#           Triton a GPU machine runs. Its wheel lies on this workplace's disk (a fresh set-up here
#           downloads nothing big).
#   CPU machine: torch 2.13.0+cpu, the CPU build: from wherever pip is configured to look (here, local
#           wheels), else from PyTorch's CPU wheel index (PyPI's torch 2.13.0 is the CUDA build, which
#           would also pin Triton 3.7.1). The CPU build requires no Triton; the kernels' tests pass
#           with 3.8.0 in the interpreter.
#   GPU machine: torch 2.14.1, PyPI's default Linux build (CUDA 13.0), which itself requires
#           triton~=3.8.0: the same Triton as on the CPU. (The CUDA build of torch 2.13.0 requires
#           triton==3.7.1 instead, hence the different torch versions.) CUDA 13 needs an NVIDIA driver
#           >= 580; with an older one, install the CUDA 12.x build of torch 2.14.1 from PyTorch's wheel
#           index (same Triton) into .venv, then re-run this script.
# The GPU branch fails, with one line, unless torch is a CUDA build that sees the GPU.
#
# `--test` also sets up what only the tests need: pytest (the `test` extra), the optional Ray extra
# (for --ray), and SGLang (for `pdo conform sglang`, docs/sglang.md) without its own dependency
# resolution. scripts/sglang-requirements.txt is the newest supported release and the exact set its
# scheduler modules import, and torchvision is the build that matches the torch above (0.28.0 for
# 2.13, 0.29.1 for 2.14). The oldest supported release goes beside it, in .sglang/<version>/
# (engine/sglang/versions.py: its wheel and the pins the shared set does not meet), so that the
# tests run both ends of the range. The engine, the checker and the main job need none of these.
#
# Idempotent: a second run, with pyproject.toml, the SGLang list and this script unchanged since the
# last complete run (stamps in .venv record them), installs nothing and only checks the versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TRITON=3.8.0 TORCH_CPU=2.13.0 TORCH_GPU=2.14.1 VISION_CPU=0.28.0 VISION_GPU=0.29.1

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpu=1 torch=$TORCH_GPU vision=$VISION_GPU
else
  gpu=0 torch=$TORCH_CPU vision=$VISION_CPU
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.pdo-setup
tests=$([[ "${1:-}" == --test ]] && echo 1 || echo 0)
key="gpu=$gpu $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$key" ]]; then
  if (( gpu )); then
    .venv/bin/pip install -q "torch==$torch" "triton==$TRITON"
  else   # the CPU build: from wherever pip finds it (here, local wheels), else from PyTorch's CPU index
    .venv/bin/pip install -q "torch==$torch+cpu" "triton==$TRITON" 2>/dev/null ||
      .venv/bin/pip install -q --extra-index-url https://download.pytorch.org/whl/cpu "torch==$torch+cpu" "triton==$TRITON"
  fi
  .venv/bin/pip install -q -e .
  echo "$key" >"$stamp"
fi
test_key="$key $(cat scripts/sglang-requirements.txt | sha256sum | cut -c1-16)"
if (( tests )) && [[ "$(cat "$stamp.test" 2>/dev/null)" != "$test_key" ]]; then
  .venv/bin/pip install -q -e ".[test,ray]"  # pytest and the optional extra (tests/checker/fuzz/test_ray.py)
  .venv/bin/pip install -q --no-deps -r scripts/sglang-requirements.txt "torchvision==$vision"
  .venv/bin/python -m engine.sglang.versions install --oldest
  echo "$test_key" >"$stamp.test"
fi
.venv/bin/python - "$gpu" "$torch" "$TRITON" <<'EOF'
import sys
import torch, triton, z3  # noqa: F401
gpu, want_torch, want_triton = sys.argv[1] == "1", sys.argv[2], sys.argv[3]
have = torch.__version__.split("+")[0]
if have != want_torch or triton.__version__ != want_triton:
    sys.exit(f"setup.sh: .venv has torch {torch.__version__}, triton {triton.__version__}; expected torch "
             f"{want_torch}, triton {want_triton} (remove .venv/.pdo-setup and re-run)")
if gpu and not (torch.version.cuda and torch.cuda.is_available()):
    sys.exit(f"setup.sh: a GPU is present but torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use it "
             "(a CPU build, or an NVIDIA driver too old for it)")
print(f"pd-overlap ready: torch {torch.__version__}, triton {triton.__version__}, cuda={torch.cuda.is_available()}")
EOF
