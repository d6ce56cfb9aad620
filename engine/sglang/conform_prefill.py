"""Conformance scenarios for SGLang 0.5.23's PD prefill loops, run on CPU with the adapter's hooks.

Each scenario builds a real `Scheduler` with `Scheduler.__new__` (as SGLang's own unit tests do),
gives it SGLang's real components where they run on a CPU — the published server configuration,
the req_to_token pool, the paged KV allocator and pool, the radix cache, the schedule policy, the
metadata buffers and index allocator, the bootstrap queue's code, the future map, the batch result
processor, the output streamer, the invariant checker — and drives the real
`event_loop_normal_disagg_prefill` or `event_loop_overlap_disagg_prefill` until the work is done and
`gracefully_exit` ends the loop. Admission (`get_next_disagg_prefill_batch_to_run`, the PrefillAdder,
`ScheduleBatch.init_new` / `prepare_for_extend`, the slot and page allocation), `run_batch`, the WAR
barrier, deferred sampling, `process_batch_result_disagg_prefill`, `send_kv_chunk` and the inflight
queue are SGLang's own code. What is faked, and why, is listed on each fake below; in short, what
touches a GPU or the network: the model forward, the device streams and events, the KV sender's
transfer, the request intake from the tokenizer's socket, and the sockets the output and metrics
would go to.

    scenarios()    [(name, run(trace_dir, fuzz_schedule=None) -> {"trace", "functions", ...})]

`fuzz_schedule` (an int seed, or None for the fixed schedule) decides what the fakes decide in a real
run: after how many polls a KV transfer completes and a result's device-to-host copy is done.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import tempfile
import threading
from array import array
from types import SimpleNamespace

import torch

from . import hooks, load
from . import prefill as prefill_hooks
from .sink import TraceSink

_MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
          "rms_norm_eps": 1e-5, "torch_dtype": "float32", "eos_token_id": 2, "bos_token_id": 1}

_lock = threading.Lock()   # one scenario at a time: SGLang's configuration is process-wide
_sgl = None


def sglang():
    """SGLang's modules with the adapter's hooks installed (once per process)."""
    global _sgl
    if _sgl is None:
        sgl = load()
        if not hooks.is_installed():
            prefill_hooks.install(sgl)
        _sgl = sgl
    return _sgl


# ---- the call log ---------------------------------------------------------------------------------
class CallLog:
    """The calls SGLang makes into the fakes, in order: a run with hooks and one without must make the
    same calls (the hooks only observe)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, *call) -> None:
        self.calls.append(call)


@dataclasses.dataclass
class Schedule:
    """What the fakes decide: polls until a KV transfer concludes, queries until a copy is done."""
    seed: int | None = None

    def __post_init__(self):
        self._rng = random.Random(self.seed) if self.seed is not None else None

    def transfer_polls(self) -> int:
        return 1 if self._rng is None else self._rng.randint(0, 3)

    def copy_queries(self) -> int:
        return 1 if self._rng is None else self._rng.randint(0, 2)


# ---- the device ------------------------------------------------------------------------------------
class FakeEvent:
    """A device event. Faked: CUDA events need a GPU, and torch.cpu.Event is always complete, so a
    result whose device-to-host copy is still running could not be shown. `query` answers False for
    the first `pending` queries (the copy is still in flight), then True; `synchronize` completes it."""

    def __init__(self, log: CallLog, name: str, pending: int = 0):
        self.log, self.name, self.pending = log, name, pending

    def record(self, stream=None):
        self.log("event.record", self.name)

    def query(self) -> bool:
        done = self.pending <= 0
        self.pending -= 1
        self.log("event.query", self.name, done)
        return done

    def synchronize(self):
        self.pending = 0
        self.log("event.synchronize", self.name)

    def wait(self, stream=None):
        self.log("event.wait", self.name)


class FakeStream:
    """A device stream. Faked: the schedule, forward and copy streams are CUDA streams in a real run;
    the fake records the ordering calls SGLang makes on them (wait_event is the fine WAR barrier,
    wait_stream the coarse one and the forward's wait for the schedule stream)."""

    def __init__(self, log: CallLog, name: str):
        self.log, self.name = log, name

    def wait_event(self, event):
        self.log("stream.wait_event", self.name, getattr(event, "name", None))

    def wait_stream(self, other):
        self.log("stream.wait_stream", self.name, getattr(other, "name", None))

    def record_event(self, event=None):
        self.log("stream.record_event", self.name)
        return event or FakeEvent(self.log, f"{self.name}.recorded")

    def synchronize(self):
        self.log("stream.synchronize", self.name)


class FakeDeviceModule:
    """`torch.cuda` as the scheduler uses it (`self.device_module`): Event() for the copy-done events,
    stream() contexts. Faked with the streams above; each copy-done event is pending for as many
    queries as the schedule says."""

    def __init__(self, log: CallLog, schedule: Schedule):
        self.log, self.schedule, self.n = log, schedule, 0

    def Event(self):   # noqa: N802 (torch's name)
        self.n += 1
        return FakeEvent(self.log, f"copy_done{self.n}", pending=self.schedule.copy_queries())

    def Stream(self):  # noqa: N802
        return FakeStream(self.log, "stream")

    @contextlib.contextmanager
    def stream(self, s):
        self.log("stream.enter", getattr(s, "name", None))
        yield


# ---- the model forward ----------------------------------------------------------------------------
class FakeRunner:
    """The model runner as the scheduler reads it. Faked: a real one loads weights and runs on the
    GPU. The scheduler reads the attention backend's tile size, the prefill-aware-SWA flag, and the
    WAR barrier's event (`shared_read_done_event`: set by each forward that publishes its shared-buffer
    reads; None makes SGLang's barrier fall back to the coarse whole-forward wait)."""

    def __init__(self):
        self.attn_backend = SimpleNamespace(extend_attention_block_m=64)
        self.prefill_aware_swa = False
        self.shared_read_done_event = None
        self.sliding_window_size = None
        self.is_hybrid_swa = False
        self.ngram_embedding_manager = SimpleNamespace(prepare_for_forward=lambda batch, chunked_req: batch)


class FakeModelWorker:
    """The TP model worker. Faked: its forward runs the model on the GPU. `forward_batch_generation`
    logs what it is given and returns SGLang's own GenerationBatchResult, sampled as the real worker
    samples: deferred (`delay_sample_func`, launched by `launch_batch_sample_if_needed`) under the
    overlap schedule with SGLANG_ENABLE_DELAY_SAMPLE or a grammar, else inside the forward."""

    def __init__(self, log: CallLog, *, fine_barrier: bool, enable_overlap: bool):
        self.log = log
        self.model_runner = FakeRunner()
        self.fine_barrier = fine_barrier
        self.enable_overlap = enable_overlap
        self.forwards = 0

    @property
    def last_shared_read_runner(self):
        return self.model_runner

    def forward_batch_generation(self, batch, **kwargs):
        from sglang.srt.environ import envs
        from sglang.srt.managers.utils import GenerationBatchResult

        self.forwards += 1
        n = self.forwards
        self.log("forward", [str(r.rid) for r in batch.reqs], list(batch.extend_lens))
        if self.fine_barrier:
            self.model_runner.shared_read_done_event = FakeEvent(self.log, f"shared_read{n}")
        result = GenerationBatchResult(logits_output=None, can_run_cuda_graph=False)
        tokens = torch.tensor([(7 * n + i) % 200 + 3 for i in range(len(batch.reqs))], dtype=torch.int64)
        deferred = self.enable_overlap and (batch.sampling_info.grammars is not None
                                            or envs.SGLANG_ENABLE_DELAY_SAMPLE.get())
        if deferred:
            def sample():
                self.log("sample", n)
                result.next_token_ids = tokens
                return result
            result.delay_sample_func = sample
        else:
            result.next_token_ids = tokens
        return result
