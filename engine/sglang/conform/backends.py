"""Does the early cached-prefix send's wait event reach each KV backend's transfer worker?

Under the overlap prefill loop, `run_batch(N+1)` sends chunk N's KV as the continuing request's
cached prefix before forward N is known to have written it. SGLang records a CUDA event on the
forward stream and parks it on the sender (`CommonKVSender._early_send_wait_event`); the sender's
`send` hands it to the manager's `add_transfer_request(..., wait_event=...)`, whose transfer worker
must wait on it before it reads the source KV.

For each backend SGLang ships (`disaggregation/<name>/conn.py`), `check(name)` drives that backend's
REAL sender class (`send`, inherited from CommonKVSender), its REAL manager's `add_transfer_request`
and its REAL transfer worker loop, on a manager made with `__new__` and given only the attributes
those methods read (as the conformance scenarios make SGLang's objects). The stand-ins:

- the wait event (`RecordingEvent`): records `synchronize` / `wait` and the thread that called it;
- the chunk's source page indices (`RecordingIndices`, an int32 numpy array): records the first time
  the transfer worker's thread uses them (length, index, iteration). Every read of the source KV is
  addressed by these pages, so the worker reads nothing before that use;
- the destination (one transfer target of the room, the decode peer's registration): plain
  stand-ins holding the fields the worker reads before it addresses the pages; no RDMA engine is
  reached, so none is made.

The outcome per backend is one of:
  waits       the worker waited on the event (its own thread) before it used the source pages
  late        the worker waited, but only after using the source pages
  ignored     the chunk the worker dequeued carries the event, and the worker read without waiting
  dropped     the chunk the worker dequeued carries no event (the manager did not pass it on)
  unreached   the worker never reached the pages (the stand-ins are incomplete: no verdict)
  unavailable the backend's module cannot be imported here (a missing native package)
  no-event    the release's prefill scheduler parks no wait event on the sender (before 0.5.16:
              the early send has no event, bug S5, or there is no early send); nothing to carry

A missing native package is stubbed at its import only (`_NATIVE_STUBS`), never the logic under test.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import inspect
import sys
import threading
import time
import types
from collections import defaultdict

import numpy as np

from engine.sglang.conform import compat

BACKENDS = ("mooncake", "nixl", "mori", "ascend")
ROOM = 7
_SESSION = "127.0.0.1:30001"


@dataclasses.dataclass
class BackendOutcome:
    backend: str
    outcome: str  # waits, late, ignored, dropped, unreached, unavailable, no-event
    detail: str
    stubbed: tuple = ()  # native modules whose import was stubbed


class _Log:
    def __init__(self):
        self.lock = threading.Lock()
        self.entries: list[tuple[str, int]] = []  # (what, thread ident)
        self.done = threading.Event()

    def add(self, what: str) -> None:
        with self.lock:
            self.entries.append((what, threading.get_ident()))

    def first(self, what: str, thread: int | None) -> int | None:
        with self.lock:
            for i, (w, t) in enumerate(self.entries):
                if w == what and (thread is None or t == thread):
                    return i
        return None


class RecordingEvent:
    """The forward stream's CUDA event, as the worker sees it: complete, and records who waited."""

    def __init__(self, log: _Log):
        self.log = log

    def synchronize(self):
        self.log.add("wait")

    def wait(self, stream=None):
        self.log.add("wait")

    def query(self) -> bool:
        self.log.add("query")
        return True


class RecordingIndices(np.ndarray):
    """The chunk's source page indices: a use on the transfer worker's thread is recorded (`read`)."""

    log: _Log | None = None
    sender_thread: int | None = None

    def _seen(self):
        log = getattr(self, "log", None)
        if log is not None and threading.get_ident() != self.sender_thread:
            log.add("read")
            log.done.set()

    def __len__(self):
        self._seen()
        return super().__len__()

    def __getitem__(self, key):
        self._seen()
        return np.asarray(super().__getitem__(key))

    def __iter__(self):
        self._seen()
        return iter(np.asarray(self))

    def __array_finalize__(self, obj):
        self.log = getattr(obj, "log", None)
        self.sender_thread = getattr(obj, "sender_thread", None)


# ---- imports ---------------------------------------------------------------------------------------
class _AnyAttr(types.ModuleType):
    """A missing native module: every name it is asked for is an inert class."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


_NATIVE_STUBS = {"mori": ("mori", "mori.cpp", "mori.io")}


def _import(backend: str) -> tuple[types.ModuleType, tuple]:
    """The backend's conn module; a native package it needs that is not installed is stubbed at its
    import (and only there), and named in the outcome."""
    name = f"sglang.srt.disaggregation.{backend}.conn"
    stubbed = []
    for mod in _NATIVE_STUBS.get(backend, ()):
        try:
            importlib.import_module(mod)
        except ImportError:
            sys.modules[mod] = _AnyAttr(mod)
            stubbed.append(mod)
    return importlib.import_module(name), tuple(stubbed)


class _Stop(BaseException):
    """Raised at the worker's first use of the source pages: what follows is the transfer itself,
    which needs RDMA. A BaseException, so the workers' `except Exception` failure paths let it by."""


class _StopAtRead(RecordingIndices):
    def _seen(self):
        super()._seen()
        if threading.get_ident() != self.sender_thread:
            raise _Stop


# ---- the run ---------------------------------------------------------------------------------------
def _defined_subclass(conn, base):
    """The class of the backend's module (defined there, not imported) that subclasses `base`."""
    found = [
        c
        for c in vars(conn).values()
        if isinstance(c, type) and issubclass(c, base) and c.__module__ == conn.__name__
    ]
    if len(found) != 1:
        raise LookupError(f"{conn.__name__}: {len(found)} subclasses of {base.__name__}")
    return found[0]


class _Destination:
    """One transfer target of the room (the decode peer that asked for it), with the fields the
    workers read before they address the source pages."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class _No:
    """False as a field and as a method: `is_dummy` is a method of a transfer target in NIXL before
    0.5.20 and a field after (and in the other backends)."""

    def __bool__(self):
        return False

    def __call__(self):
        return False


def _queue(dequeued: list):
    """SGLang's FastQueue, recording whether each chunk the worker takes carries a wait event."""
    from sglang.srt.disaggregation.common.utils import FastQueue  # lazy: SGLang is optional

    class RecordingQueue(FastQueue):
        def get(self):
            item = super().get()
            if item is not None:
                dequeued.append(getattr(item, "wait_event", None) is not None)
            return item

    return RecordingQueue()


def _manager(mgr_cls, queue):
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    mgr = mgr_cls.__new__(mgr_cls)
    dst = _Destination(
        room=ROOM,
        endpoint="127.0.0.1",
        dst_port=30001,
        mooncake_session_id=_SESSION,
        agent_name=_SESSION,
        engine_key=_SESSION,
        dst_kv_indices=np.arange(4, dtype=np.int32),
        dst_device_kv_indices=None,
        dst_aux_index=0,
        dst_state_indices=[],
        required_dst_info_num=1,
        is_dummy=_No(),
        decode_prefix_len=0,
        staging=None,
    )
    peer = _Destination(
        requires_dcp_relayout=False,
        decode_tp_size=1,
        dst_attn_tp_size=1,
        dst_tp_rank=0,
        dst_kv_ptrs=[0],
        dst_kv_item_lens=[16],
        dst_state_data_ptrs=[],
        dst_aux_ptrs=[0],
        skip_kv=False,
    )
    attrs = dict(
        disaggregation_mode=DisaggregationMode.PREFILL,
        request_status={ROOM: KVPoll.WaitingForInput},
        transfer_infos={ROOM: {_SESSION: dst}},
        decode_kv_args_table={_SESSION: peer},
        transfer_queues=[queue],
        _transfer_queues=[queue],
        _num_shards=1,
        enable_staging=False,
        enable_trace=False,
        enable_deferred_decode_kv_release=False,
        _staging_outstanding=defaultdict(int),
        kv_shard_size=1,
        is_dummy_cp_rank=False,
        enable_all_cp_ranks_for_transfer=False,
        sender_trace_module=None,
        session_lock=threading.Lock(),
        transfer_lock=threading.Lock(),
        failure_lock=threading.Lock(),
        state_layout_rejections={},
        failed_sessions=set(),
        failed_session_probes={},
        is_mla_backend=False,
        is_hybrid_mla_backend=False,
        attn_tp_size=1,
        attn_tp_rank=0,
        attn_cp_size=1,
        attn_cp_rank=0,
        attn_dp_rank=0,
        # what the workers of releases before 0.5.23 read besides (the prefill's own bootstrap
        # port, named in their failure message; the deferred acks of 0.5.22)
        bootstrap_port=8998,
        _deferred_ack_targets={},
        _deferred_ack_poisoned_rooms=set(),
        pp_size=1,
        pp_rank=0,
        exceptions={},
        failure_records={},
        kv_args=types.SimpleNamespace(
            kv_data_ptrs=[1], kv_item_lens=[16], aux_data_ptrs=[1], state_data_ptrs=[]
        ),
    )
    for k, v in attrs.items():
        setattr(mgr, k, v)
    return mgr


def _sender(sender_cls, mgr, event):
    sender = sender_cls.__new__(sender_cls)
    from sglang.srt.disaggregation.base.conn import KVTransferMetric  # lazy: SGLang is optional
    from sglang.srt.observability.trace import TraceNullContext  # lazy: SGLang is optional

    sender.__dict__.update(
        kv_mgr=mgr,
        bootstrap_room=ROOM,
        aux_index=0,
        conclude_state=None,
        curr_idx=0,
        num_kv_indices=8,  # two chunks: this one is not the last (no aux data involved)
        _transfer_metric=KVTransferMetric(),
        _transfer_num_kv_indices=0,
        _transfer_num_state_indices=0,
        _transfer_start_time=None,
        _early_send_wait_event=event,
        trace_ctx=TraceNullContext(),
        # NIXL's own send before 0.5.23 (CommonKVSender's from 0.5.23)
        has_sent=False,
        chunk_id=0,
        _send_failed=False,
        _send_error=None,
    )
    return sender


def _worker(mgr, queue):
    """The backend's real transfer worker loop, on the queue the manager puts chunks on (mori's is
    `_transfer_worker(queue)`; mooncake's takes the executor its transfers run on)."""
    if hasattr(type(mgr), "_transfer_worker"):
        return lambda: mgr._transfer_worker(queue)
    if "executor" in inspect.signature(mgr.transfer_worker).parameters:
        pool = concurrent.futures.ThreadPoolExecutor(1)
        return lambda: mgr.transfer_worker(queue, pool)
    return lambda: mgr.transfer_worker(queue)


def parks_event() -> bool:
    """Whether this release's prefill scheduler parks the forward stream's event on the sender for
    the early cached-prefix send (0.5.16 on): only then has a backend an event to carry."""
    from sglang.srt.disaggregation import prefill  # lazy: SGLang is optional

    return "_early_send_wait_event" in inspect.getsource(prefill)


def check(backend: str, timeout_s: float = 10.0) -> BackendOutcome:
    """Drive `backend`'s sender, manager and transfer worker with one early-send chunk."""
    if not parks_event():
        return BackendOutcome(
            backend, "no-event", "the prefill scheduler parks no wait event on the sender"
        )
    try:
        conn, stubbed = _import(backend)
    except ImportError as exc:
        return BackendOutcome(backend, "unavailable", f"{type(exc).__name__}: {exc}")
    from sglang.srt.disaggregation.base.conn import BaseKVSender
    from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVSender

    log, dequeued = _Log(), []
    queue = _queue(dequeued)
    mgr = _manager(_defined_subclass(conn, CommonKVManager), queue)
    event = RecordingEvent(log)
    sender = _sender(_defined_subclass(conn, CommonKVSender), mgr, event)
    errors: list = []
    run = _worker(mgr, queue)

    def target():
        try:
            run()
        except _Stop:
            pass
        except Exception as exc:  # noqa: BLE001 (the verdict says what the worker raised)
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            log.done.set()

    worker = threading.Thread(target=target, name=f"{backend}-transfer-worker", daemon=True)
    worker.start()
    indices = np.arange(4, dtype=np.int32).view(_StopAtRead)
    indices.log, indices.sender_thread = log, threading.get_ident()
    try:
        # the token count where the release's sender interface has it (0.5.17 on); read off the
        # interface, as some backends' send is wrapped in a tracing decorator that takes anything
        sender.send(indices, **compat.accepted(BaseKVSender.send, {"num_kv_tokens": 16}))
    except Exception as exc:  # noqa: BLE001 (the verdict says what the sender raised)
        queue.put(None)
        return BackendOutcome(
            backend, "unreached", f"send raised {type(exc).__name__}: {exc}", stubbed
        )
    log.done.wait(timeout_s)
    time.sleep(0.05)
    queue.put(None)  # the teardown sentinel: the loops that know it stop, the others raise
    w = log.first("wait", worker.ident)
    r = log.first("read", worker.ident)
    carried = bool(dequeued) and dequeued[0]
    if r is None:
        why = errors[0] if errors else "the worker never used the source pages"
        return BackendOutcome(backend, "unreached", why, stubbed)
    waited_anywhere = log.first("wait", None) is not None
    if not carried:
        return BackendOutcome(
            backend,
            "dropped",
            "the chunk the worker dequeued carries no wait event, and the worker read the source "
            + ("pages" if not waited_anywhere else "pages (another thread waited)"),
            stubbed,
        )
    if w is None:
        return BackendOutcome(
            backend,
            "ignored",
            "the chunk carries the event; the worker read without waiting",
            stubbed,
        )
    if w > r:
        return BackendOutcome(
            backend, "late", "the worker read before waiting on the event", stubbed
        )
    return BackendOutcome(backend, "waits", "the worker waited on the event, then read", stubbed)


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.sglang.conform.backends [--sglang-version V]`: one line per backend."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m engine.sglang.conform.backends")
    parser.add_argument("--sglang-version", metavar="V", help="a release installed side by side")
    a = parser.parse_args(argv)
    from engine.sglang import SGLangUnavailable, load, versions

    try:
        if a.sglang_version is not None:
            versions.use(a.sglang_version)
        print(f"SGLang {load().version}")
    except (versions.VersionError, SGLangUnavailable) as exc:
        print(f"backends: {exc}", file=sys.stderr)
        return 2
    for name in BACKENDS:
        out = check(name)
        stub = f" (stubbed imports: {', '.join(out.stubbed)})" if out.stubbed else ""
        print(f"{name}: {out.outcome}: {out.detail}{stub}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
