"""The decode side's view of a request, from arrival to its last token.

States (ReqState): new → pending (in the prealloc queue, rank maybe unknown) → transfer (receiver
initialised, KV arriving) → waiting (KV complete, first token known) → running → done; or aborted
from any state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine import sync


class ReqState(Enum):
    NEW = "new"
    PENDING = "pending"
    TRANSFER = "transfer"
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"
    ABORTED = "aborted"

    @property
    def over(self) -> bool:
        return self in (ReqState.DONE, ReqState.ABORTED)


class ReceiverInit(Enum):
    """What initialising a request's receiver came to."""

    OK = "ok"  # slot and pages allocated, KV pulled from its rank
    NO_MEMORY = "no_memory"  # stays pending, in FIFO order
    FAILED = "failed"  # aborted


@dataclass(eq=False)
class DecodeReq:
    rid: str
    room: int
    addr: str  # bootstrap address of the prefill cluster that serves the room
    prompt: list[int]
    max_new_tokens: int
    logit_bias: dict[int, float] | None = None
    arrival_s: float = 0.0
    state: ReqState = ReqState.NEW
    prefill_dp_rank: int | None = None
    t_add: float = 0.0  # now() when it entered the prealloc queue
    t_init: float = 0.0  # now() when its receiver was initialised
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    kv_tokens: int = 0  # prompt tokens whose KV arrived
    kv_pages: int = 0
    meta: dict | None = None  # from the last chunk: first_token, prompt_len, rid
    output: list[int] = field(default_factory=list)  # tokens known on the host
    n_gen: int = 0  # tokens generated, including those still on the device
    last_ref: int = 0  # next input: a token id (>= 0) or a future-map reference (< 0)
    seq_len: int = 0  # positions whose KV is (or is being) written
    inflight: int = 0  # decode batches holding it that are not processed yet
    abort_requested: str | None = None
    error: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def kv_need(self) -> int:
        """Positions ever written: the prompt, then every generated token but the last."""
        return self.prompt_len + self.max_new_tokens - 1


def now() -> float:
    """Monotonic seconds; virtual time under a schedule controller (engine/sync/__init__.py)."""
    return sync.now()
