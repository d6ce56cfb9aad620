"""The what-if of `--gil-free-device MS` (prefill and trace-overhead): a device that takes no host
CPU, as a GPU's."""

from __future__ import annotations

import time


class gil_free_device:
    """Context manager: the model's forward becomes a wait of MS ms per `max_batch_tokens` tokens
    (scaled by the batch's tokens) that releases the GIL, returning zero logits and writing no KV.
    On CPU the emulated device is a Python thread: between torch ops its forward holds the GIL, so
    it competes with the scheduler work that admit-ahead moves beside run_batch. A GPU does not;
    this isolates the loops' own effect. Outputs are not meaningful."""

    def __init__(self, ms_per_full_batch: float, full_batch_tokens: int):
        self.ms, self.full = ms_per_full_batch, full_batch_tokens
        self.orig = None

    def __enter__(self):
        # lazy: torch and the model (which imports it) are slow for every pdo start
        import torch

        from engine.runtime.model import TinyLlama

        ms, full = self.ms, self.full
        self.orig = TinyLlama.forward

        def forward(
            model,
            input_ids,
            positions,
            out_cache_loc,
            pool,
            backend,
            meta,
            logit_rows,
            *,
            decode=False,
            impl=None,
            out=None,
        ):
            time.sleep(ms * 1e-3 * input_ids.shape[0] / full)
            logits = torch.zeros(
                (logit_rows.shape[0], model.cfg.vocab_size), device=input_ids.device
            )
            if out is not None:
                out.copy_(logits)
            return logits

        TinyLlama.forward = forward
        return self

    def __exit__(self, *exc):
        from engine.runtime.model import TinyLlama  # lazy: as in __enter__ (already loaded by then)

        TinyLlama.forward = self.orig


def print_what_if(ms: float | None) -> None:
    if ms:
        print(
            f"WHAT-IF: the model's forward is a GIL-free wait of {ms:g} ms per full batch (no "
            "real compute, no host CPU taken, as a GPU's); these are not the engine's own "
            "numbers"
        )
