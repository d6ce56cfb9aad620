"""The fakes around SGLang 0.5.23's real prefill scheduler: what touches a GPU or the network.

The model forward (FakeModelWorker, FakeRunner), the device streams and events (FakeStream,
FakeEvent, FakeDeviceModule), the KV sender's transfer (ScriptedKVSender), the request intake from
the tokenizer's socket (FakeTokenizerSocket) and the sockets the output and metrics would go to
(FakeSocket). Each fake says what it stands for and why. What they decide in a real run (when a
handshake, a transfer or a device-to-host copy completes) comes from a Schedule; every call SGLang
makes into them is recorded in a CallLog.
"""

from __future__ import annotations

import dataclasses
import random
from array import array
from types import SimpleNamespace

import torch


# ---- the call log --------------------------------------------------------------------------------
class CallLog:
    """The calls SGLang makes into the fakes, in order: a run with hooks and one without must make
    the same calls (the hooks only observe)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, *call) -> None:
        self.calls.append(call)


@dataclasses.dataclass
class Schedule:
    """What the fakes decide: polls until a request's bootstrap handshake is done and until its KV
    transfer concludes, queries until a result's device-to-host copy is done."""

    seed: int | None = None

    def __post_init__(self):
        self._rng = random.Random(self.seed) if self.seed is not None else None

    def transfer_polls(self) -> int:
        return 1 if self._rng is None else self._rng.randint(0, 3)

    def bootstrap_polls(self) -> int:
        return 0 if self._rng is None else self._rng.randint(0, 2)

    def copy_queries(self) -> int:
        return 1 if self._rng is None else self._rng.randint(0, 2)


# ---- the device ----------------------------------------------------------------------------------
class FakeEvent:
    """A device event. Faked: CUDA events need a GPU, and torch.cpu.Event is always complete, so a
    result whose device-to-host copy is still running could not be shown. `query` answers False for
    the first `pending` queries (the copy is still in flight), then True; `synchronize` completes
    it."""

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
    """A device stream. Faked: the schedule, forward and copy streams are CUDA streams in a real
    run; the fake records the ordering calls SGLang makes on them (wait_event is the fine WAR
    barrier, wait_stream the coarse one and the forward's wait for the schedule stream)."""

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
    """`torch.cuda` as the scheduler uses it (`self.device_module`): Event() for the copy-done
    events, stream() contexts. Faked with the streams above; each copy-done event is pending for as
    many queries as the schedule says."""

    def __init__(self, log: CallLog, schedule: Schedule):
        self.log, self.schedule, self.made = log, schedule, 0

    def Event(self):  # noqa: N802 (torch's name)
        self.made += 1
        return FakeEvent(self.log, f"copy_done{self.made}", pending=self.schedule.copy_queries())

    def stream(self, s):
        return _StreamContext(self.log, s)


class FakeCudaEvents:
    """`torch.cuda.Event`, for the one place the prefill path makes a CUDA event itself:
    maybe_send_cached_prefix_chunk under the overlap loop records one on the forward stream, for the
    transfer to wait on the previous forward's writes. Faked: a CPU build of torch cannot make one.
    Swapped into torch.cuda for the run only (scenarios run one at a time)."""

    def __init__(self, log: CallLog):
        self.log, self.made = log, 0

    def __call__(self, *args, **kwargs):
        self.made += 1
        return FakeEvent(self.log, f"cuda_event{self.made}")


class _StreamContext:
    """`with torch.cuda.stream(s)`: reusable, as the scheduler keeps one per stream."""

    def __init__(self, log: CallLog, stream):
        self.log, self.stream = log, stream

    def __enter__(self):
        self.log("stream.enter", getattr(self.stream, "name", None))
        return self.stream

    def __exit__(self, *exc):
        self.log("stream.exit", getattr(self.stream, "name", None))
        return False


# ---- the model forward ---------------------------------------------------------------------------
class FakeRunner:
    """The model runner as the scheduler reads it. Faked: a real one loads weights and runs on the
    GPU. The scheduler reads the attention backend's tile size, the prefill-aware-SWA flag, and the
    WAR barrier's event (`shared_read_done_event`: set by each forward that publishes its
    shared-buffer reads; None makes SGLang's barrier fall back to the coarse whole-forward wait);
    the bootstrap queue reads the KV capacity and dtype."""

    def __init__(self, kv_tokens: int):
        self.attn_backend = SimpleNamespace(extend_attention_block_m=64)
        self.prefill_aware_swa = False
        self.shared_read_done_event = None
        self.war_fastpath_read_done_event = None
        self.sliding_window_size = None
        self.is_hybrid_swa = False
        self.effective_logical_max_total_num_tokens = kv_tokens
        self.effective_max_total_num_tokens = kv_tokens  # its name before 0.5.21
        self.max_token_pool_size = kv_tokens  # what the bootstrap queue reads before 0.5.16
        self.kv_cache_dtype_str = "auto"
        self.ngram_embedding_manager = None  # SGLang's own (disabled), set by build_scheduler


class FakeModelWorker:
    """The TP model worker. Faked: its forward runs the model on the GPU. `forward_batch_generation`
    logs what it is given and returns SGLang's own GenerationBatchResult, sampled as the real worker
    samples: deferred (`delay_sample_func`, launched by `launch_batch_sample_if_needed`) under the
    overlap schedule with SGLANG_ENABLE_DELAY_SAMPLE or a grammar, else inside the forward."""

    def __init__(self, log: CallLog, *, kv_tokens: int, fine_barrier: bool, enable_overlap: bool):
        self.log = log
        self.model_runner = FakeRunner(kv_tokens)
        self.model_config = None  # the scheduler's ModelConfig, set by build_scheduler
        self.fine_barrier = fine_barrier
        self.enable_overlap = enable_overlap
        self.forwards = 0

    @property
    def last_shared_read_runner(self):
        return self.model_runner

    war_fastpath_runner = last_shared_read_runner  # its name up to 0.5.17

    def forward_batch_generation(self, batch, **kwargs):
        # lazy: SGLang is optional
        from sglang.srt.environ import envs
        from sglang.srt.managers.utils import GenerationBatchResult

        self.forwards += 1
        n = self.forwards
        self.log("forward", [str(r.rid) for r in batch.reqs], list(batch.extend_lens))
        if self.fine_barrier:
            event = FakeEvent(self.log, f"shared_read{n}")
            # the event's name up to 0.5.17 too: a release reads (and clears) only its own name
            self.model_runner.shared_read_done_event = event
            self.model_runner.war_fastpath_read_done_event = event
        result = GenerationBatchResult(logits_output=None, can_run_cuda_graph=False)
        tokens = torch.tensor(
            [(7 * n + i) % 200 + 3 for i in range(len(batch.reqs))], dtype=torch.int64
        )
        delay_sample = getattr(envs, "SGLANG_ENABLE_DELAY_SAMPLE", None)  # from 0.5.18
        deferred = self.enable_overlap and (
            batch.sampling_info.grammars is not None
            or (delay_sample is not None and delay_sample.get())
        )
        if deferred:

            def sample():
                self.log("sample", n)
                result.next_token_ids = tokens
                return result

            result.delay_sample_func = sample
        else:
            result.next_token_ids = tokens
        return result


# ---- the KV transfer -----------------------------------------------------------------------------
_SENDER: list = []


def scripted_sender_class():
    """ScriptedKVSender: SGLang's FakeKVSender (its warmup sender, which create_sender makes on the
    fake transfer backend) with a bootstrap handshake that takes `bootstrap_left` polls and a
    transfer that concludes `transfer_left` polls after the last page was handed over;
    FakeKVSender's are instant, so a request waiting in the bootstrap queue or in the inflight queue
    could not be shown. Faked: a real sender registers with the decode server and moves the KV over
    RDMA."""
    if _SENDER:
        return _SENDER[0]
    # lazy: SGLang is optional
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.fake.conn import FakeKVSender

    class ScriptedKVSender(FakeKVSender):
        def poll(self):
            if self.conclude_state is not None:
                state = self.conclude_state
            elif self.bootstrap_left > 0:
                self.bootstrap_left -= 1
                state = KVPoll.Bootstrapping
            elif self.total_pages is None or self.sent_pages < self.total_pages:
                state = KVPoll.WaitingForInput
            elif self.transfer_left > 0:
                self.transfer_left -= 1
                state = KVPoll.Transferring
            else:
                state = self.conclude_state = KVPoll.Success
            self.log("sender.poll", self.rid, int(state))
            return state

        def init(self, num_kv_indices, aux_index=None):
            self.log("sender.init", self.rid, int(num_kv_indices))
            self.total_pages = int(num_kv_indices)
            return super().init(num_kv_indices, aux_index)

        def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
            self.log(
                "sender.send",
                self.rid,
                [int(i) for i in kv_indices],
                num_kv_tokens,
                state_indices is not None,
            )
            self.sent_pages += len(kv_indices)
            if num_kv_tokens is None:  # FakeKVSender.send takes no token count before 0.5.17
                return super().send(kv_indices, state_indices)
            return super().send(kv_indices, state_indices, num_kv_tokens)

        def clear(self):
            self.log("sender.clear", self.rid)

    _SENDER.append(ScriptedKVSender)
    return ScriptedKVSender


def scripted_sender(
    fake_sender, log: CallLog, rid: str, *, bootstrap_polls: int, transfer_polls: int
):
    """The FakeKVSender create_sender made for `rid`, as a ScriptedKVSender (its state carried
    over)."""
    cls = scripted_sender_class()
    sender = cls.__new__(cls)
    sender.__dict__.update(fake_sender.__dict__)
    sender.rid, sender.log = rid, log
    sender.bootstrap_left, sender.transfer_left = bootstrap_polls, transfer_polls
    sender.total_pages, sender.sent_pages = None, 0
    return sender


# ---- the request intake and the outputs ----------------------------------------------------------
@dataclasses.dataclass
class Arrival:
    rid: str
    length: int  # prompt tokens
    at: int  # intake call (loop iteration) at which the tokenizer's message arrives
    prefix_of: str | None = None  # shares its first `shared` tokens with this earlier request
    shared: int = 0


# The decode server's address in the requests: never contacted (the bootstrap queue runs SGLang's
# fake transfer backend). Not FAKE_BOOTSTRAP_HOST, which marks warmup requests (kept out of the
# radix cache).
DECODE_HOST = "decode.invalid"


class FakeTokenizerSocket:
    """The request receiver's side of the tokenizer's ZMQ socket. Faked: in a real server the
    TokenizerManager process sends each tokenized request over IPC. `recv_requests` hands the real
    scheduler SGLang's own TokenizedGenerateReqInput messages at the intake calls the workload
    names; the scheduler's real ingest_requests / process_input_requests / handle_generate_request
    turn them into Req objects and queue them in the bootstrap queue."""

    def __init__(self, arrivals: list[Arrival], vocab: int, log: CallLog):
        self.arrivals, self.vocab, self.log = sorted(arrivals, key=lambda a: a.at), vocab, log
        self.calls = 0
        self.prompts: dict[str, list[int]] = {}

    def prompt(self, a: Arrival) -> list[int]:
        rng = random.Random(a.rid)
        ids = [rng.randrange(3, self.vocab) for _ in range(a.length)]
        if a.prefix_of is not None:
            ids[: a.shared] = self.prompts[a.prefix_of][: a.shared]
        self.prompts[a.rid] = ids
        return ids

    def recv_requests(self, local_reqs=None):
        # lazy: SGLang is optional
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        n, self.calls = self.calls, self.calls + 1
        self.log("tokenizer.poll", n)
        out = list(local_reqs or [])
        for i, a in enumerate(self.arrivals):
            if a.at != n:
                continue
            params = SamplingParams(max_new_tokens=8, temperature=0.0)
            params.normalize(None)
            params.verify(self.vocab)
            out.append(
                TokenizedGenerateReqInput(
                    rid=a.rid,
                    input_text=None,
                    input_ids=array("q", self.prompt(a)),
                    input_embeds=None,
                    mm_inputs=None,
                    token_type_ids=None,
                    sampling_params=params,
                    return_logprob=False,
                    logprob_start_len=-1,
                    top_logprobs_num=0,
                    token_ids_logprob=None,
                    stream=False,
                    bootstrap_host=DECODE_HOST,
                    bootstrap_port=8998,
                    bootstrap_room=1000 + i,
                )
            )
            self.log("tokenizer.recv", a.rid)
        return out

    @property
    def pending(self) -> bool:
        return any(a.at >= self.calls for a in self.arrivals)


class FakeSocket:
    """A ZMQ socket the scheduler sends on (to the detokenizer, to the tokenizer). Faked: the
    receiving processes are not running; what is sent is recorded (finished requests' outputs)."""

    def __init__(self, log: CallLog, name: str):
        self.log, self.name, self.sent = log, name, []

    def send_output(self, obj, *args, **kwargs):
        self.sent.append(obj)
        rids = getattr(obj, "rids", None)
        self.log(
            "socket.send", self.name, type(obj).__name__, list(rids) if rids is not None else None
        )

    send_pyobj = send_output
