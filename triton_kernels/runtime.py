"""Where the kernels run: compiled on a GPU, or under the Triton interpreter on the CPU.

Triton reads TRITON_INTERPRET when a function is *decorated* (``@triton.jit`` builds an
InterpretedFunction instead of a JITFunction), and triton's own library functions are decorated when
``triton`` is imported. So what matters is the environment at the moment triton is first imported;
every import of the kernel modules runs the package ``__init__`` first, which imports this module
before anything imports triton. A CPU-only torch build can never
launch compiled kernels, so there the interpreter is switched on here (setdefault: an explicit
TRITON_INTERPRET=0 is respected and the wrappers then fall back to the float64 torch reference for
CPU tensors).
"""

import os

import torch

# Before triton is first imported: triton's own library functions (tl.cdiv, the math helpers) are
# decorated when triton is imported, and an interpreted kernel cannot call a compiled one.
if torch.version.cuda is None and torch.version.hip is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402 (after the switch above)


def interpreting() -> bool:
    """True when Triton kernels are (or must be) interpreted on the CPU rather than compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available()


def _is_interpreted(kernel) -> bool:
    return isinstance(kernel, InterpretedFunction)


def _can_launch(kernel, device: torch.device) -> bool:
    """Compiled kernels need a GPU tensor; interpreted ones run on any device."""
    return _is_interpreted(kernel) or device.type == "cuda"


def _check_values(device: torch.device) -> bool:
    """Whether to run value-level input checks (they cost a device->host sync on GPU).

    Default: on for CPU / the interpreter (where a bad index can crash the process), off on CUDA
    where the engine calls these kernels once per layer. PDO_TRITON_CHECK=1/0 forces either way.
    """
    flag = os.environ.get("PDO_TRITON_CHECK", "")
    if flag in ("0", "1"):
        return flag == "1"
    return device.type != "cuda" or interpreting()
