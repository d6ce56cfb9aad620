"""The flight recorder's binary log: its layout, and its reading back into pdo-trace events.

One source of truth for the writer (engine/trace/recorder.py) and the readers (the engine at the
run's end, `pdo check` and `pdo trace` when only the log is left): docs/trace-format.md, "Binary
log", describes the same layout, record by record.

The log is a file of fixed-size slots (`SLOT` bytes), mapped into memory segment by segment
(`SEGMENT_SLOTS` slots each; the file grows by whole segments). Slot 0 is the file head; slot
i >= 1 holds one record, written with one `struct.pack_into` by the thread that logged it, whose
last field, `check`, is i itself. pack_into writes the fields in order, so a slot whose check is
not its index was cut mid-write (SIGKILL): a torn record, detected and dropped. A slot that is all
zeros was never written: past the last record, the log's free space; before it, a slot a thread had
taken but not yet filled when the process died.

A record's first field, `code`, says what it is (R_*, or an event's layout: a definition, which
comes before the records that use it, as every definition does); each struct below names its fields.
"""

from __future__ import annotations

import enum
import json
import os
import struct
from dataclasses import dataclass, field

import orjson

from spec.errors import BadInput, InternalError

MAGIC = b"PDOLOG\x00\x01"
VERSION = 1
SUFFIX = ".pdolog"  # the log of trace T.jsonl is T.jsonl.pdolog
SLOT = 96
SEGMENT_SLOTS = 1 << 12  # 384 KiB: a multiple of the page size, as mmap offsets must be
WORDS = 9  # value words of an event record
MAX_FIELDS = WORDS  # more fields than this: one JSON value holds them all (layout names "*")

HEAD = struct.Struct("<8sII")  # slot 0: magic, version, slot size


# The fields whose values are integers in every event that has them (spec/events.toml; a test
# checks): the writer stores their values as they are; any other field's value as a definition's
# id (a string, an identity, a JSON value). A field's kind is fixed by its name, so a record's mask
# is its layout's.
INT_FIELDS = frozenset(
    "batch dp_size events failed_rank first_token idle_ms iter lead_ns memory_waits pages rank "
    "room slot start tokens value wait_ns".split()
)
# The fields whose values are lists or objects in some event (spec/events.toml; a test checks):
# each value is a JSON definition, made without first looking it up as a string.
JSON_FIELDS = frozenset("chunks covered pending result rids rooms stacks".split())

# An event record of n values: head, t_ns, values..., check. The head is the 64-bit word
# code | mask << 16 | thread << 32, as WORD0 reads it: mask bit j set when value j is a definition's
# id, not the integer itself; thread, the thread's number in the log (a D_THREAD definition, logged
# at its first event, names it).
EVENT = [struct.Struct(f"<qq{n}q{8 * (WORDS - n)}xq") for n in range(WORDS + 1)]
DEF = struct.Struct("<HHIqq64sq")  # code, kind, 0, id, total length, first bytes, check
# the rest of a definition that does not fit in one slot, in slots its thread takes in order
DEF_MORE = struct.Struct("<HHIq72sq")  # code, 0, 0, id, next bytes, check
EDGE = struct.Struct("<HHIqqq56xq")  # code, op, thread, 0, channel, second channel, check
DIGEST = struct.Struct("<HHIqqq56xq")  # code, 0, 0, t_ns, stamp id, string id, check
END = struct.Struct("<HHIqqq56xq")  # code, 0, thread name (D_STR id), t_ns, reason, fields (JSON)
# a slot given up: an event whose value needed a definition after it took its slot (an int over 64
# bits) goes in a later one
VOID = struct.Struct("<HHI80xq")  # code, 0, 0, check
WORD0 = struct.Struct("<HHI")
CHECK = struct.Struct("<q")
for _s in (HEAD, DEF, DEF_MORE, EDGE, DIGEST, END, VOID, *EVENT):
    assert _s.size <= SLOT and (_s is HEAD or _s.size == SLOT), _s.format

# record codes
R_DEF, R_DEF_MORE, R_EDGE, R_DIGEST, R_END, R_VOID = 1, 2, 3, 4, 5, 6
FIRST_LAYOUT = 16
# A value flagged by the mask is a definition's id when positive and below INLINE; -N is the object
# identity oN (numbered in the order first logged: no definition); >= INLINE, a string of up to 7
# UTF-8 bytes, held in the low bytes (no definition).
INLINE = 1 << 62
# definition kinds
D_STR, D_JSON, D_STAMP, D_LAYOUT, D_HEADER, D_THREAD = 1, 2, 4, 5, 6, 7
# edge ops
SEND, RECV, RELAY, RECV_SEND = 1, 2, 3, 4


class BadLog(BadInput, ValueError):
    """Not a binary log of a version this reader knows."""


@dataclass
class Damage:
    """What a log left by a killed process lacks: torn slots (cut mid-write) and holes (taken, never
    written), and the events dropped from the first one whose late digest was never computed."""

    torn: int = 0
    holes: int = 0
    unresolved: int = 0


@dataclass
class LateDigest:
    """A late digest in an event: its value once a DIGEST record (or its stamp) gives it."""

    sid: int


@dataclass
class LogReader:
    """Reads a log's slots in order into events (`feed`), building each event's vector clock from
    the hand-off edges when the header has an `hb` tag. `stamps`: the late digests the log has no
    value for yet (the engine's own reader: its recorder's, which `trace_value()` computes)."""

    stamps: dict = field(default_factory=dict)  # stamp id -> its stamp
    header: dict | None = None
    _hb: str | None = None  # the header's `hb` tag: the events get clocks
    events: list = field(default_factory=list)  # dicts; late digests as LateDigest until resolved
    end: dict | None = None  # the END record: t_ns, thread, reason, fields
    damage: Damage = field(default_factory=Damage)
    slots: int = 1  # the next slot to read
    _defs: dict = field(default_factory=dict)  # id -> a str, a JSON value, a LateDigest
    _partial: dict = field(default_factory=dict)  # id -> [kind, length, bytearray]
    _layouts: dict = field(default_factory=dict)  # code -> (ev, names)
    _threads: dict = field(default_factory=dict)  # thread number -> its name
    _digests: dict = field(default_factory=dict)  # stamp id -> value
    _clock: dict = field(default_factory=dict)  # thread id -> {component: count}
    _raised: dict = field(default_factory=dict)  # thread -> what a join raised since its event
    _started: set = field(default_factory=set)  # the threads with an event so far
    _snap: dict = field(default_factory=dict)  # thread -> the copy of its clock its sends share
    _chan: dict = field(default_factory=dict)  # channel -> {sender key: clock}
    _tail_zero: int = 0  # zero slots seen since the last record

    def feed(self, buf, end: int, *, live: bool = False, base: int = 0) -> bool:
        """Read slots [self.slots, end) of `buf` (slot `base` at offset 0). Zero slots before a
        record are holes, at the end free space. `live` (the engine reading its own log): stop at
        the first slot not complete yet, and return False."""
        unpack_w0, unpack_check = WORD0.unpack_from, CHECK.unpack_from
        for i in range(self.slots, end):
            off = (i - base) * SLOT
            code, _, _ = unpack_w0(buf, off)
            (check,) = unpack_check(buf, off + SLOT - 8)
            if live and check != i:
                self.slots = i
                return False
            if code == 0 and check == 0:
                self._tail_zero += 1
                continue
            if check != i:
                self.damage.torn += 1
                continue
            self.damage.holes += self._tail_zero
            self._tail_zero = 0
            self._record(code, buf, off)
        self.slots = max(self.slots, end)
        return True

    def _record(self, code: int, buf, off: int) -> None:
        if code >= FIRST_LAYOUT:
            self._event(code, buf, off)
        elif code == R_DEF:
            _, kind, _, did, length, data, _ = DEF.unpack_from(buf, off)
            if length <= len(data):
                self._define(did, kind, data[:length])
            else:
                self._partial[did] = [kind, length, bytearray(data)]
        elif code == R_DEF_MORE:
            _, _, _, did, data, _ = DEF_MORE.unpack_from(buf, off)
            p = self._partial.get(did)
            if p is not None:
                p[2] += data
                if len(p[2]) >= p[1]:
                    del self._partial[did]
                    self._define(did, p[0], bytes(p[2][: p[1]]))
        elif code == R_EDGE:
            _, op, tid, _, a, b, _ = EDGE.unpack_from(buf, off)
            self._edge(op, tid, a, b)
        elif code == R_DIGEST:
            _, _, _, _, sid, value, _ = DIGEST.unpack_from(buf, off)
            self._digests[sid] = self._str(value)
        elif code == R_END:
            _, _, tid, t, reason, fields, _ = END.unpack_from(buf, off)
            self.end = {"t_ns": t, "thread": self._str(tid), "reason": self._str(reason)}
            self.end["fields"] = self._defs.get(fields) or {}  # 0: none, no definition's id
        elif code != R_VOID:
            raise BadLog(f"record code {code} unknown at offset {off}")

    def _str(self, v: int) -> str | None:
        return _inline(v) if v >= INLINE else self._defs.get(v)

    def _define(self, did: int, kind: int, data: bytes) -> None:
        if kind == D_STR:
            self._defs[did] = data.decode("utf-8", "surrogatepass")
        elif kind == D_JSON:
            self._defs[did] = json.loads(data)
        elif kind == D_STAMP:
            self._defs[did] = LateDigest(did)
        elif kind == D_LAYOUT:
            ev, names = json.loads(data)
            self._layouts[did] = (ev, tuple(names))
        elif kind == D_HEADER:
            self.header = json.loads(data)
            self._hb = self.header.get("hb")
        elif kind == D_THREAD:
            self._threads[did] = data.decode("utf-8", "surrogatepass")
        else:
            raise BadLog(f"definition {did}: unknown kind {kind}")

    def _event(self, code: int, buf, off: int) -> None:
        ev, names = self._layouts[code]
        n = len(names)
        rec = EVENT[n].unpack_from(buf, off)
        mask, tid = rec[0] >> 16 & 0xFFFF, rec[0] >> 32
        thread = self._threads[tid]
        e = {"seq": len(self.events) + 1, "t_ns": rec[1], "thread": thread, "ev": ev}
        defs = self._defs
        if names == ("*",):
            e.update(defs[rec[2]])
        elif mask:
            for j, (name, v) in enumerate(zip(names, rec[2 : 2 + n])):
                if mask >> j & 1:
                    v = _inline(v) if v >= INLINE else defs[v] if v > 0 else f"o{-v}"
                e[name] = v
        else:
            e.update(zip(names, rec[2 : 2 + n]))
        if self._hb is not None:
            e["vc"] = self._tick(tid, thread)
        self.events.append(e)

    # -- happens-before, offline (engine/sync/hb.py logs the edges)

    def _tick(self, tid: int, thread: str):
        """The event's `vc` in format 4: the whole clock at the thread's first event, else its own
        count alone, or with what a join raised since its previous event."""
        c = self._clock.setdefault(tid, {})
        k = self._hb + thread
        n = c[k] = c.get(k, 0) + 1
        self._snap.pop(tid, None)
        raised = self._raised.pop(tid, None)
        # components in name order: the order joins made them in can differ between two runs of
        # one schedule (a thread the schedule does not order), their values cannot
        if tid not in self._started:
            self._started.add(tid)
            return dict(sorted(c.items()))
        if raised:
            raised[k] = n
            return dict(sorted(raised.items()))
        return n

    def _edge(self, op: int, tid: int, a: int, b: int) -> None:
        if op == SEND:  # the sender's clock, a copy shared by its sends until it changes
            snap = self._snap.get(tid)
            if snap is None:
                snap = self._snap[tid] = dict(self._clock.setdefault(tid, {}))
            self._chan.setdefault(a, {})[tid] = snap
        elif op == RECV_SEND:
            self._edge(RECV, tid, a, 0)
            self._edge(SEND, tid, b, 0)
        elif op == RECV:
            c = self._clock.setdefault(tid, {})
            raised = self._raised.setdefault(tid, {})
            for other in self._chan.get(a, {}).values():
                if _join(c, other, raised):
                    self._snap.pop(tid, None)
        elif op == RELAY:
            into = self._chan.setdefault(b, {})
            for k, clock in self._chan.get(a, {}).items():
                key = k if k.__class__ is tuple else ("relay", k)
                merged = dict(into.get(key, {}))  # never changed in place: a sender's copy
                _join(merged, clock)
                into[key] = merged
        else:
            raise BadLog(f"edge: unknown op {op}")

    # -- the events, finished

    def finish(self, *, final: bool) -> list[dict]:
        """The events read, late digests resolved. With `final` (the log is complete, or all there
        is) events from the first digest still unknown on are dropped, counted as `unresolved`."""
        out = []
        for i, e in enumerate(self.events):
            d = e.get("digest")
            if d.__class__ is LateDigest:
                value = self._digests.get(d.sid)
                if value is None and (stamp := self.stamps.get(d.sid)) is not None:
                    value = stamp.trace_value()
                if value is None:
                    if final:
                        self.damage.unresolved = len(self.events) - i
                        break
                    return out
                e["digest"] = value
            out.append(e)
        return out

    def late(self, d):
        """A digest field as read: its value once logged, else its stamp (not computed)."""
        if d.__class__ is not LateDigest:
            return d
        return self._digests.get(d.sid) or self.stamps.get(d.sid)


def _inline(v: int) -> str:
    return (v - INLINE).to_bytes(7, "little").rstrip(b"\0").decode("utf-8", "surrogatepass")


def _join(into: dict, other: dict, noted: dict | None = None) -> bool:
    """Raise each component of `into` to `other`'s (noting what rose in `noted`); whether any did."""
    rose = False
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v
            rose = True
            if noted is not None:
                noted[k] = v
    return rose


def read_log(data) -> LogReader:
    """Every record of a log's bytes (a file's whole contents)."""
    if len(data) < SLOT or HEAD.unpack_from(data, 0)[0] != MAGIC:
        raise BadLog("not a pdo binary log (no magic)")
    _, version, slot = HEAD.unpack_from(data, 0)
    if (version, slot) != (VERSION, SLOT):
        raise BadLog(
            f"binary log version {version}, slot {slot}: this reader knows {VERSION}, {SLOT}"
        )
    r = LogReader()
    r.feed(data, len(data) // SLOT)
    if r.header is None:
        raise BadLog("no header record")
    return r


class NotJSON(InternalError, TypeError):
    """An event value the trace format cannot hold: the engine logged something it should not."""


def _plain(x):
    """The JSON of what orjson passes through: subclasses as their base, an enum as its value."""
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, str):
        return str.__str__(x)
    for base in (int, float, dict, list, tuple):
        if isinstance(x, base):
            return base(x)
    raise NotJSON(f"a value that is not JSON: {type(x).__name__}")


def dumps(x) -> bytes:
    """Compact JSON: orjson's, else (a lone surrogate, an int over 64 bits) the standard library's."""
    try:
        return orjson.dumps(x, default=_plain, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
    except TypeError as err:
        if isinstance(err.__cause__, NotJSON):
            raise err.__cause__ from None
        return json.dumps(x, separators=(",", ":"), default=_plain).encode()


def write_jsonl(r: LogReader, path: str) -> tuple[int, bool]:
    """The pdo-trace of a read log (trace_end if the run ended) written to `path` whole (a
    temporary file renamed): its number of lines, and whether the run ended, nothing missing."""
    events = r.finish(final=True)
    lines = [dumps(r.header), *map(dumps, events)]
    whole = r.end is not None and not (r.damage.torn or r.damage.holes or r.damage.unresolved)
    if whole:
        end = {"seq": len(events) + 1, "t_ns": r.end["t_ns"], "thread": r.end["thread"]}
        end |= {"ev": "trace_end", "events": len(events), "reason": r.end["reason"]}
        lines.append(dumps(end | r.end["fields"]))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    os.replace(tmp, path)
    return len(lines), whole
