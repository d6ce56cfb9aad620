"""The trace sink: a helper process that turns streamed events into JSON lines and writes them
(docs/trace-format.md, "Truncated traces").

Formatting a line costs several times what logging the event did, and in the engine's process that
work holds the GIL the scheduler and the forward worker need. So the engine's writer thread
(engine/trace/writer.py) only pickles the new events — in C, objects named, digests resolved — and
hands them to this process, which builds the lines on another core. One sink serves every trace of
an engine process, started at the first one.

This module is the sink's whole program and its wire format; it imports only the standard library
and orjson, so the process starts fast. The sink ignores SIGINT and SIGTERM and runs in its own
session: a Ctrl-C or a signal to the engine's process group reaches the engine, whose handlers end
the trace, while the sink goes on writing what it is sent. It exits at the end of its input — when
the engine exits, however it exits — after writing every frame it received whole, so a SIGKILL of
the engine loses only what its writer thread had not yet handed over.

Frames, engine to sink: HEAD (op, stream, payload length), then the payload.
- OPEN: the trace file's path (UTF-8); its header is already there (the engine wrote it).
- EVENTS: a pickle of (seq of the first event, [t_ns, thread, kind, values, t_ns, ...]), where a
  declared event's kind is (ev, field names) and its values a tuple, any other's kind is ev and its
  values a dict; an object identity is an `Ident`. The stream's pickles share one memo, as one
  pickler writes them all: what an earlier frame held (a kind, a thread's name, an identity) a
  later one names by its memo index, so the engine's writer reduces each only once.
- EVENTS_NEW: as EVENTS, the first frame of a new memo (the writer starts one now and then, so that
  neither side's memo grows with the trace).
- END: the trace_end line, written last; the file is closed and acknowledged.
- SYNC: acknowledged once everything before it is written.
Acknowledgements, sink to engine: ACK (stream, length of the error message), then the message:
empty when every event of the stream was written, else what stopped it (one line).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import struct
import sys
from itertools import count

import orjson

from spec.errors import InternalError

HEAD = struct.Struct("<BII")  # op, stream, payload length
ACK = struct.Struct("<II")  # stream, error message length
OPEN, EVENTS, END, SYNC, EVENTS_NEW = range(5)


class Ident(str):
    """An object identity (o1, o2, ...), the only place an object may stand in an event: `obj`."""

    __slots__ = ()


def value(v):
    """What an enum member logged in an event is read as: its value."""
    return v


class NotJSON(InternalError, TypeError):
    """An event value the trace format cannot hold: the engine logged something it should not."""


def _plain(x):
    """orjson's fallback for what it passes through: subclasses as their base, an identity outside
    `obj` (an object logged where a value belongs) refused."""
    if x.__class__ is Ident:
        raise NotJSON(f"object {x} logged in a field other than obj")
    if isinstance(x, str):
        return str.__str__(x)
    for base in (int, float, dict):
        if isinstance(x, base):
            return base(x)
    if isinstance(x, (list, tuple)):
        return list(x)
    raise NotJSON(f"a value that is not JSON: {type(x).__name__}")


def dumps(e: dict) -> bytes:
    try:
        return orjson.dumps(e, default=_plain, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
    except TypeError as err:
        if isinstance(err.__cause__, NotJSON):
            raise err.__cause__ from None
        # a value orjson does not take (an int over 64 bits): the standard library's encoder
        return json.dumps(e, separators=(",", ":"), default=_plain).encode()


def lines(first: int, flat: list) -> bytes:
    out = []
    for s, t, th, kind, values in zip(count(first), flat[0::4], flat[1::4], flat[2::4], flat[3::4]):
        if kind.__class__ is tuple:
            e = {"seq": s, "t_ns": t, "thread": th, "ev": kind[0]}
            e.update(zip(kind[1], values))
        else:
            e = {"seq": s, "t_ns": t, "thread": th, "ev": kind, **values}
        o = e.get("obj")
        if o.__class__ is Ident:
            e["obj"] = str(o)
        try:
            out.append(dumps(e) + b"\n")
        except NotJSON as err:
            raise NotJSON(f"event {s} ({e['ev']}): {err}") from None
    return b"".join(out)


class _Frames:
    """The file an Unpickler reads a stream's frames from: the frame at hand (`frame`)."""

    def __init__(self):
        self.frame = io.BytesIO()

    def read(self, n: int = -1) -> bytes:
        return self.frame.read(n)

    def readinto(self, b) -> int:
        return self.frame.readinto(b)

    def readline(self) -> bytes:
        return self.frame.readline()


class _Stream:
    def __init__(self, path: str):
        self.f = open(path, "ab")
        self.error = ""
        self.frames = _Frames()
        self.unpickler: pickle.Unpickler | None = None

    def events(self, payload: bytes, new: bool) -> None:
        """A frame of events, pickled with the memo the stream's earlier frames built (or a new
        one)."""
        if self.error:  # the memo is lost with the frame that failed
            return
        if new:
            self.unpickler = pickle.Unpickler(self.frames)
        elif self.unpickler is None:
            raise ValueError("events continue a memo that no frame started")
        self.frames.frame = io.BytesIO(payload)
        self.write(lines(*self.unpickler.load()))

    def write(self, data: bytes) -> None:
        if not self.error:
            self.f.write(data)
            self.f.flush()


def serve(inp, out) -> None:
    streams: dict[int, _Stream] = {}
    while True:
        head = inp.read(HEAD.size)
        if len(head) < HEAD.size:
            break
        op, sid, n = HEAD.unpack(head)
        payload = inp.read(n)
        if len(payload) < n:  # the engine died mid-frame: what came whole is written
            break
        if op == OPEN:
            streams[sid] = _Stream(payload.decode())
            continue
        s = streams[sid]
        if op in (EVENTS, EVENTS_NEW):
            try:
                s.events(payload, op == EVENTS_NEW)
            except Exception as err:  # noqa: BLE001 - reported to the engine, which raises it
                s.error = s.error or f"{type(err).__name__}: {err}"
        elif op == END:
            s.write(payload)
            s.f.close()
            del streams[sid]
        if op in (END, SYNC):
            msg = s.error.encode()
            out.write(ACK.pack(sid, len(msg)) + msg)
            out.flush()
    for s in streams.values():
        s.f.close()


def _background() -> None:
    """Run on what the engine leaves idle: a core it is not using, or the gaps while its threads
    wait. At an ordinary priority a sink that wakes up takes a core from an engine thread, often the
    one holding the GIL, which stalls every engine thread at once."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: the lowest ordinary priority instead
        try:
            os.nice(19)
        except OSError:
            pass


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _background()
    serve(sys.stdin.buffer, sys.stdout.buffer)
