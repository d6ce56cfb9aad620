#!/usr/bin/env bash
# Set up .venv for pd-overlap. Installs torch first, so that the project's loose `torch>=2.4`
# requirement is already satisfied and pip never pulls a multi-GB CUDA build onto a CPU machine.
#   CPU machine: torch==2.13.0 (a CPU build where the machine provides one, as here; elsewhere set
#                PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index first).
#   GPU machine: the default torch build (CUDA), which also brings the matching triton.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    .venv/bin/pip install -q "torch>=2.4"
  else
    .venv/bin/pip install -q "torch==2.13.0"
  fi
fi
.venv/bin/pip install -q -e ".[test]"
.venv/bin/python -c "import torch, triton, z3; print(f'pd-overlap ready: torch {torch.__version__}, triton {triton.__version__}, cuda={torch.cuda.is_available()}')"
