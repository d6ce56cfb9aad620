"""The failures a KV transfer layer can report, injected into a scripted KV receiver.

The receiver is SGLang's own fake transfer backend's receiver (`FakeKVReceiver`, what SGLang uses
for warmup requests) with a handshake and a transfer that take some polls, a prefill that writes the
request's metadata row when the transfer concludes, and a fault armed by the harness. It stands for
the transport only: every decision about the request is SGLang's.

    Fault          what the transport reports, and through which door
    receiver_class the scripted receiver class (made once, on SGLang's FakeKVReceiver)
"""

from __future__ import annotations

import enum


class Fault(enum.Enum):
    POLL_FAILED = "poll-failed"  # the next poll() answers Failed
    STATE_FAILED = "state-failed"  # the backend records Failed in the receiver's own conclude_state
    PEER_GONE = "peer-gone"  # the prefill disappears: its bootstrap server stops, polls fail
    CLIENT_ABORT = "client-abort"  # the client aborts: Scheduler.abort_request
    TIMEOUT = "timeout"  # the receiver's own deadline passes with no progress: polls turn Failed


class Phase(enum.Enum):
    """Where the transport is for one receiver."""

    CREATED = "created"  # made by add, no prefill rank yet
    BOOTSTRAPPING = "bootstrapping"  # init(rank) called, handshake not done
    WAITING = "waiting"  # handshake done, waiting for the decode side's metadata
    TRANSFERRING = "transferring"  # metadata sent, the prefill is writing the KV
    DONE = "done"  # concluded (Success or Failed)


TIMEOUT_POLLS = 2  # polls without progress before the receiver's own deadline passes
_CLASS: list = []


def receiver_class():
    """ScriptedKVReceiver, on SGLang's FakeKVReceiver (made once)."""
    if _CLASS:
        return _CLASS[0]
    # lazy: SGLang is optional
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.fake.conn import FakeKVReceiver

    class ScriptedKVReceiver(FakeKVReceiver):
        """plan: the harness's Plan for its room (handshake and transfer polls, the metadata row
        writer); each call after clear() is recorded as a misuse."""

        def __init__(self, mgr, bootstrap_addr, bootstrap_room=None, **_):
            super().__init__(mgr, bootstrap_addr, bootstrap_room)
            self.room, self.addr = bootstrap_room, bootstrap_addr
            # as CommonKVReceiver keeps them (the fake receiver of some releases does not; the
            # scheduler's abort reads the manager's deferred-release flag up to 0.5.19)
            self.bootstrap_room, self.kv_mgr = bootstrap_room, mgr
            self.phase, self.cleared, self.misuse = Phase.CREATED, 0, []
            self.unseen_failure = []  # what SGLang did to the room after a failure it never polled
            self.plan = mgr.plans[bootstrap_room]
            self.plan.receivers.append(self)
            self.handshake_left = self.plan.handshake_polls
            self.transfer_left = self.plan.transfer_polls
            self.metadata_index = None
            self.fail_next_poll = False
            self.deadline = None  # polls left before the receiver's own timeout
            self.fail_in_call = False  # STATE_FAILED: the next init/send_metadata fails inside
            if self.plan.arm_next is not None:  # a fault armed while the request had no receiver
                arm(self, self.plan.arm_next)
                self.plan.arm_next = None

        @property
        def label(self):
            return f"room {self.room}'s receiver"

        def in_flight(self):
            """What the prefill may still write: the metadata was sent, nothing concluded."""
            if self.phase is not Phase.TRANSFERRING or self.conclude_state is not None:
                return None
            req = self.plan.req
            # the request's KV fields are on req.kv from 0.5.17 (before, on the request itself)
            slot = getattr(getattr(req, "kv", req), "req_pool_idx", None)
            return (slot, self.plan.pages, self.metadata_index)

        def _use(self, what):
            if self.cleared:
                self.misuse.append(f"{what} after clear")

        def poll(self):
            self._use("poll")
            if self.conclude_state is not None:
                return self.conclude_state
            if self.fail_next_poll:
                return self._fail()
            if self.deadline is not None:
                self.deadline -= 1
                if self.deadline < 0:
                    return self._fail()
            if self.phase is Phase.BOOTSTRAPPING:
                if self.handshake_left > 0:
                    self.handshake_left -= 1
                    return KVPoll.Bootstrapping
                self.phase = Phase.WAITING
            if self.phase in (Phase.CREATED, Phase.BOOTSTRAPPING):
                return KVPoll.Bootstrapping
            if self.phase is Phase.WAITING:
                return KVPoll.WaitingForInput
            if self.transfer_left > 0:
                self.transfer_left -= 1
                return KVPoll.Transferring
            self.plan.write_metadata(self)
            self.phase, self.conclude_state = Phase.DONE, KVPoll.Success
            return KVPoll.Success

        def _fail(self):
            self.phase, self.conclude_state = Phase.DONE, KVPoll.Failed
            return KVPoll.Failed

        def init(self, prefill_dp_rank):
            self._use("init")
            self.rank = prefill_dp_rank
            if self.phase is Phase.CREATED:
                self.phase = Phase.BOOTSTRAPPING
            if self.fail_in_call:
                self._fail()

        def send_metadata(self, kv_indices, aux_index=None, state_indices=None, **kwargs):
            self._use("send_metadata")
            if self.fail_next_poll:  # the transport failed and SGLang has not polled since
                self.unseen_failure.append("metadata published after its transfer failed, unpolled")
            self.metadata_index = aux_index
            self.plan.pages = [int(p) for p in kv_indices]
            self.phase = Phase.TRANSFERRING
            if self.fail_in_call:
                self._fail()

        def abort(self):
            self._use("abort")
            self._fail()

        def clear(self):
            self.cleared += 1

        def failure_exception(self):
            raise RuntimeError(f"KV transfer of room {self.room} failed ({self.plan.fault_name})")

    _CLASS.append(ScriptedKVReceiver)
    return ScriptedKVReceiver


def arm(receiver, fault: Fault) -> None:
    """Make `receiver` report `fault` through its door (all but CLIENT_ABORT and PEER_GONE's server
    stop, which the harness does)."""
    if fault in (Fault.POLL_FAILED, Fault.PEER_GONE):
        receiver.fail_next_poll = True
    elif fault is Fault.TIMEOUT:
        receiver.deadline = TIMEOUT_POLLS
    elif fault is Fault.STATE_FAILED:
        if receiver.phase in (Phase.CREATED, Phase.WAITING):
            receiver.fail_in_call = True  # SGLang's next call into it (init, send_metadata) fails
        else:
            receiver._fail()  # a backend thread records it between two polls
