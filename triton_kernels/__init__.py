"""Triton attention kernels for the pd-overlap engine's paged KV cache.

Public API:
    extend_attention  prefill/extend over a cached paged prefix plus the new tokens (causal)
    decode_attention  one query per request over its paged context (split-KV flash-decoding)
    write_kv          scatter new K/V rows into the paged pools
    interpreting()    True when kernels run under the Triton interpreter
                      (TRITON_INTERPRET=1 or no CUDA)

The kernel modules take what they share from triton_kernels.runtime (where the kernels run; each
kernel module imports it before decorating a kernel, since it may set TRITON_INTERPRET) and
triton_kernels.checks (the wrappers' input checks), never from this package.
"""

# runtime first: it picks the interpreter before triton is imported
from .runtime import interpreting  # noqa: I001

from .decode_attention import decode_attention
from .extend_attention import extend_attention
from .kv_write import write_kv

__all__ = ["extend_attention", "decode_attention", "write_kv", "interpreting"]
