"""The flight recorder: each trace event one fixed-size binary record, written by the thread that
logs it into a memory-mapped log (layout: spec/tracelog.py, docs/trace-format.md "Binary log").

Logging is the only work the run does for its trace: no writer thread, no helper process, nothing
waited for. A log call (`logger`, generated per event kind) takes a slot from one `itertools.count`
(atomic under the GIL: no lock, whose holder could stall waiting for the GIL) and fills it with one
`struct.pack_into`: an int as itself, any other value as the id of a definition logged once (a
string, an object's identity oN in the order first seen, a late digest, a JSON value).

The log is anonymous memory until `to_file`; it grows by segments, kept until the recorder is
dropped, up to PDO_TRACE_MAX_MB, past which the trace reads as truncated (`_full`). A killed
process's log is read by `pdo check` and `pdo trace` (checker/trace_log.py).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import mmap
import os
import struct
import sys
import threading
import weakref
from keyword import iskeyword
from time import monotonic_ns

from engine import sync
from engine.sync import hb
from spec import tracelog as tl
from spec.errors import BadInput
from spec.tracelog import dumps

_SEG_BYTES = tl.SEGMENT_SLOTS * tl.SLOT
# A log call's code, compiled once per process: a recorder per short trace (the SGLang adapter's
# per run) spent more compiling its calls than logging. Layout ids, in the source, go by declaration.
_compile = functools.lru_cache(maxsize=4096)(compile)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's, absent from Python 3.11


def max_bytes() -> int:
    """The bound on a log's size (PDO_TRACE_MAX_MB, default 4096 MiB: ~44 million records)."""
    raw = os.environ.get("PDO_TRACE_MAX_MB", "").strip() or "4096"
    if not raw.isdigit() or not 1 <= int(raw) <= 1 << 30:
        raise BadInput(f"PDO_TRACE_MAX_MB: {raw!r} is not a whole number of MiB from 1 to 2^30")
    return int(raw) << 20


class Recorder:
    def __init__(self, header: dict, thread_name=None, limit: int | None = None):
        # a thread's name in the trace, read at its first event (the SGLang sink's: by ident)
        self._thread_name = thread_name or (lambda: threading.current_thread().name)
        self.path: str | None = None
        self._fd = -1
        self._segs: list = []  # memoryviews of the segments' mmaps
        self._lock = threading.Lock()  # mapping a segment
        self._slots = itertools.count(1)
        # the log's bound, in whole segments: past it nothing more is logged (`_full`)
        self._max_segs = max(1, (max_bytes() if limit is None else limit) // _SEG_BYTES)
        self.full = 0  # records not logged, the bound reached
        self.cur: list = [None]  # the last segment: (buffer, first slot past it, its first slot)
        tl.HEAD.pack_into(self._segment(0), 0, tl.MAGIC, tl.VERSION, tl.SLOT)
        # .tno: the thread's number in this log, at its first record; .t32: tno << 32, once its
        # name is logged at its first event (as it is named then: the main thread "scheduler")
        self._local = threading.local()
        self._tnos = itertools.count(1)
        self._ids = itertools.count(1)
        self._layouts = itertools.count(tl.FIRST_LAYOUT)
        self._strs: dict[str, int] = {}
        self._objs: dict[int, int] = {}  # id(object) -> -N, N its number (name oN)
        self._kept: list = []  # the objects named, kept alive
        self._names = itertools.count(1)  # an object's number
        self._proxy = weakref.proxy(self)
        self._new_string, self._new_obj = self._first_seen()
        self._stamps: dict[int, object] = {}  # late digests not logged yet: id -> stamp
        self._reader = tl.LogReader(stamps=self._stamps)
        self._consts: dict = {}  # (class, value) -> definition id: None, bools, numbers
        self._emitters: dict = {}  # (ev, field names) -> the logger of an event not declared
        self._me = weakref.ref(self)
        self.ended = False
        self.hand_offs = self._hand_offs()
        self.set_header(header)

    def set_header(self, header: dict) -> None:
        """Log the trace's header (again: the reader keeps the last one)."""
        self._define(tl.D_HEADER, dumps(header))

    # -- the log's memory

    def _segment(self, k: int) -> memoryview:
        """Segment k, mapped now: the last one (`cur`)."""
        # Populated now: a first write to a page would fault, dearer than the record on a VM; a
        # file's blocks reserved at once (fallocate), not one page per fault.
        if self._fd >= 0:
            try:
                os.posix_fallocate(self._fd, k * _SEG_BYTES, _SEG_BYTES)
            except (AttributeError, OSError):  # not Linux, or a file system without it
                os.ftruncate(self._fd, (k + 1) * _SEG_BYTES)
            flags = mmap.MAP_SHARED | _POPULATE
            buf = mmap.mmap(self._fd, _SEG_BYTES, flags=flags, offset=k * _SEG_BYTES)
        else:
            buf = mmap.mmap(-1, _SEG_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        with contextlib.suppress(OSError):  # Linux 5.14 on; before it, the pages fault once
            buf.madvise(_POPULATE_WRITE)
        view = memoryview(buf)  # pack_into takes a memoryview's buffer faster than the mmap's
        self._segs.append(view)
        self.cur[0] = (view, (k + 1) * tl.SEGMENT_SLOTS, k * tl.SEGMENT_SLOTS)
        return view

    def _grow(self, i: int):
        """The segment of slot i, mapped now if it is new (the log call that crossed into it)."""
        k = i // tl.SEGMENT_SLOTS
        if k >= self._max_segs:
            return self._full(i)
        with self._lock:
            while len(self._segs) <= k:
                self._segment(len(self._segs))
        return self._segs[k], (k + 1) * tl.SEGMENT_SLOTS, k * tl.SEGMENT_SLOTS

    def _full(self, i: int):
        """Slot i is past the bound: its record (END's too) goes to a scratch slot: truncated."""
        if not self.full:
            size = f"{self._max_segs * _SEG_BYTES >> 10:,} KiB, PDO_TRACE_MAX_MB"
            print(f"pdo: the trace log is full ({size}): the rest is not traced", file=sys.stderr)
        self.full += 1
        return memoryview(bytearray(tl.SLOT)), i + 1, i

    def _put(self, record: struct.Struct, *fields) -> int:
        """One record in a free slot: its fields, then its check (the slot's index)."""
        seg = self.cur[0]
        i = next(self._slots)
        if i >= seg[1]:
            seg = self._grow(i)
        record.pack_into(seg[0], (i - seg[2]) * tl.SLOT, *fields, i)
        return i

    def to_file(self, trace: str) -> None:
        """Keep the log in `<trace>.pdolog` (created anew) from now on, what is logged so far copied
        and an earlier run's `trace` removed; before the run's threads start logging."""
        with contextlib.suppress(FileNotFoundError):  # not this run's trace
            os.remove(trace)
        path = trace + tl.SUFFIX
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        old, self._segs, self._fd, self.path = self._segs, [], fd, path
        for k, view in enumerate(old):
            self._segment(k)[:] = view
            buf = view.obj
            view.release()
            buf.close()

    # -- definitions

    def _define(self, kind: int, data: bytes, did: int | None = None) -> int:
        """Log a definition (DEF, then DEF_MORE slots; no thread's) and return its id, which its
        users learn after it is logged."""
        did = next(self._ids) if did is None else did
        self._put(tl.DEF, tl.R_DEF, kind, 0, did, len(data), data[:64])
        for at in range(64, len(data), 72):
            self._put(tl.DEF_MORE, tl.R_DEF_MORE, 0, 0, did, data[at : at + 72])
        return did

    def _tno(self) -> int:
        """The calling thread's number in this log (its records' `thread`)."""
        tno = getattr(self._local, "tno", None)
        if tno is None:
            tno = self._local.tno = next(self._tnos)
        return tno

    def thread(self) -> int:
        """The calling thread's number, its name logged now if it has logged no event yet."""
        if not hasattr(self._local, "t32"):
            name = self._thread_name().encode("utf-8", "surrogatepass")
            self._local.t32 = self._define(tl.D_THREAD, name, self._tno()) << 32
        return self._local.t32 >> 32

    def string(self, s: str) -> int:
        return self._strs.get(s) or self._new_string(s)

    def _first_seen(self):
        """The ids of a string or object seen first: closures over the tables, reached in one call.
        A string's id is its bytes when they fit in 7 (no record), else its definition's."""
        strs, objs, kept, names, me = self._strs, self._objs, self._kept, self._names, self._proxy

        def new_string(s) -> int:
            if s.__class__ is not str:
                return me.value(s)
            b = s.encode("utf-8", "surrogatepass")
            short = len(b) <= 7 and b"\0" not in b
            did = strs[s] = (
                tl.INLINE | int.from_bytes(b, "little") if short else me._define(tl.D_STR, b)
            )
            return did

        def new_obj(x) -> int:
            if _kind(x.__class__) is not _OBJ:
                return me.value(x)
            kept.append(x)
            return objs.setdefault(id(x), -next(names))

        return new_string, new_obj

    def value(self, v) -> int:
        """The id that stands for a value not an int of 64 bits: a string, a late digest, a JSON
        value, else an object's identity."""
        c = v.__class__
        kind = _kind(c)
        if kind is _OBJ:
            return self._obj(v)
        if kind is _STR:
            return self.string(v)
        if kind is _STAMP:
            return self._stamp(v)
        if kind is _SCALAR:  # one definition per value
            did = self._consts.get((c, v))
            if did is None:
                did = self._consts[(c, v)] = self._define(tl.D_JSON, dumps(v))
            return did
        return self._define(tl.D_JSON, dumps(v))

    def _obj(self, x) -> int:
        """-N for an object named oN (no definition), named now if new and kept alive, so its id()
        is never another's; two threads naming it at once agree (setdefault is atomic)."""
        return self._objs.get(id(x)) or self._new_obj(x)

    def obj(self, x) -> str:
        return f"o{-self._obj(x)}"

    def _stamp(self, stamp) -> int:
        """A late digest (DigestStamp): its value if known, else an id a later DIGEST resolves."""
        sid = self._define(tl.D_STAMP, b"")
        value = stamp.subscribe(functools.partial(_digest, self._me, sid))
        if value is not None:
            return self.string(value)
        self._stamps[sid] = stamp
        return sid

    def _digest(self, sid: int, value: str) -> None:
        self._put(tl.DIGEST, tl.R_DIGEST, 0, 0, monotonic_ns(), sid, self.string(value))
        self._stamps.pop(sid, None)

    # -- records

    def logger(self, ev: str, names: tuple[str, ...]):
        """The log call of an event, its fields its parameters: an int field's value stored as it
        is (else pack_into refuses it: `_general`), any other's as a definition's id."""
        n, me = len(names), self._proxy  # the log call keeps no recorder alive: no cycle
        plain = all(x.isidentifier() and x[0] != "_" and not iskeyword(x) for x in names)
        if n > tl.MAX_FIELDS or not plain:  # not parameters: one JSON value holds them all
            star = self._layout(ev, ("*",))

            def log(*values):
                if len(values) != n:
                    raise arity_error(ev, names, values)
                me._general(star, (dict(zip(names, values)),))

            return log
        mask = sum(1 << j for j, name in enumerate(names) if name not in tl.INT_FIELDS)
        head = self._layout(ev, names) | mask << 16
        conv = "".join(  # an object seen before, a string seen before, else a definition made
            f"        _w{j} = _oget(_id({x})) or _newobj({x})\n"
            if x == "obj"
            else f"        _w{j} = _value({x})\n"
            if x in tl.JSON_FIELDS
            else f"        _w{j} = _sget({x}) or _newstr({x})\n"
            for j, x in enumerate(names)
            if mask >> j & 1
        )
        words = [f"_w{j}" if mask >> j & 1 else x for j, x in enumerate(names)]
        params = ", ".join(names)
        values = f"({params},)" if n else "()"
        src = (
            f"def log({params}):\n"
            "    try:\n"
            "        _t32 = _local.t32\n"
            "    except AttributeError:\n"
            "        _t32 = _thread() << 32\n"
            "    if _sync.CONTROLLER is not None or _sync.JITTER_US:\n"
            "        _sync.point(_ev)\n"
            + (
                f"    try:\n{conv}    except TypeError:  # unhashable: a list\n"
                f"        return _general({head}, {values})\n"
                if conv
                else ""
            )
            + "    _seg = _cur[0]\n"
            "    _i = _nxt()\n"
            "    if _i >= _seg[1]:\n"
            "        _seg = _grow(_i)\n"
            "    try:\n"
            f"        _pack(_seg[0], (_i - _seg[2]) * {tl.SLOT}, {head} | _t32, _now(), "
            + "".join(x + ", " for x in words)
            + "_i)\n"
            "    except _struct.error:  # not an int, or one over 64 bits: the slot given up\n"
            f"        _void(_seg[0], (_i - _seg[2]) * {tl.SLOT}, {tl.R_VOID}, 0, 0, _i)\n"
            f"        _general({head}, {values})\n"
        )
        scope = {
            "_local": self._local,
            "_thread": lambda: me.thread(),
            "_sync": sync,
            "_ev": ev,
            "_id": id,
            "_sget": self._strs.get,
            "_oget": self._objs.get,
            "_value": lambda v: me.value(v),
            "_newstr": self._new_string,
            "_newobj": self._new_obj,
            "_cur": self.cur,
            "_nxt": self._slots.__next__,
            "_grow": lambda i: me._grow(i),
            "_pack": tl.EVENT[n].pack_into,
            "_now": monotonic_ns,
            "_struct": struct,
            "_void": tl.VOID.pack_into,
            "_general": lambda head, values: me._general(head, values),
        }
        exec(_compile(src, f"<trace event {ev}>", "exec"), scope)  # noqa: S102 - code made above
        log = scope["log"]
        log.__qualname__ = log.__name__ = f"event {ev}({params})"
        return log

    def _layout(self, ev: str, names: tuple[str, ...]) -> int:
        return self._define(tl.D_LAYOUT, dumps([ev, list(names)]), next(self._layouts))

    def _general(self, head: int, values: tuple) -> None:
        """An event whose values do not fit its fields' kinds (None or an int over 64 bits in an int
        field, a list where a string goes): with the record's own mask."""
        m, words = 0, []
        for j, v in enumerate(values):
            if v.__class__ is int and -(1 << 63) <= v < 1 << 63:
                words.append(v)
            else:
                m |= 1 << j
                words.append(self.value(v))
        head = head & 0xFFFF | m << 16 | self.thread() << 32
        self._put(tl.EVENT[len(values)], head, monotonic_ns(), *words)

    def emit(self, ev: str, fields: dict) -> None:
        """An event not declared: its log call found (or made) by its event name and field names."""
        key = (ev, tuple(fields))
        log = self._emitters.get(key)
        if log is None:
            log = self._emitters[key] = self.logger(*key)
        log(*fields.values())

    def _hand_offs(self) -> hb.HandOffs:
        """The log calls of the hand-offs (engine/sync/hb.py): as lean as an event's, with no time
        (the reader orders edges by slot); a channel is the object's id()."""
        local, cur, nxt, pack = self._local, self.cur, self._slots.__next__, tl.EDGE.pack_into
        code, slot, me = tl.R_EDGE, tl.SLOT, self._proxy

        def edge(op: int):
            def log(obj) -> None:
                if obj is None:
                    return
                try:
                    tno = local.tno
                except AttributeError:
                    tno = me._tno()
                seg = cur[0]
                i = nxt()
                if i >= seg[1]:
                    seg = me._grow(i)
                pack(seg[0], (i - seg[2]) * slot, code, op, tno, 0, id(obj), 0, i)

            return log

        send, recv = edge(tl.SEND), edge(tl.RECV)

        def recv_send(a, b) -> None:  # RECV_SEND: read, not written
            recv(a)
            send(b)

        def relay(src, dst) -> None:
            if src is not None and dst is not None:
                me._put(tl.EDGE, code, tl.RELAY, me._tno(), 0, id(src), id(dst))

        return hb.HandOffs(send, recv, recv_send, relay)

    # -- reading back

    def read(self, *, final: bool = False) -> tl.LogReader:
        """The events logged so far, read on from the last call's end (not `final`: to the first
        slot still being written)."""
        r, size = self._reader, tl.SEGMENT_SLOTS
        upto = min(self._peek(), len(self._segs) * size)
        while r.slots < upto:
            k = r.slots // size
            if not r.feed(self._segs[k], min(upto, (k + 1) * size), live=not final, base=k * size):
                break  # a slot still being written
        return r

    def _peek(self) -> int:
        """The next slot index the counter will give, without taking it."""
        return self._slots.__reduce__()[1][0]

    def write_jsonl(self, out: str, reason: str | None, fields: dict) -> None:
        """The trace's JSON Lines, made from the log, written to `out` whole, after the END record
        (`reason`, `fields`; pending late digests computed first) unless the log has one or
        `reason` is None (a log cut short, as a killed process leaves it)."""
        if reason is not None and not self.ended:
            for sid, stamp in list(self._stamps.items()):
                self._digest(sid, stamp.trace_value())
            did = self._define(tl.D_JSON, dumps(fields)) if fields else 0
            why = self.string(reason)
            # a definition even when short: END's 32-bit field holds no inline string
            name = threading.current_thread().name.encode("utf-8", "surrogatepass")
            tid = self._define(tl.D_STR, name)
            self._put(tl.END, tl.R_END, 0, tid, monotonic_ns(), why, did)  # after what it names
            self.ended = True
        tl.write_jsonl(self.read(final=True), out)

    def remove_file(self) -> None:
        """Remove the log's file (its JSON Lines are written); its pages stay readable here."""
        if self._fd >= 0:
            os.close(self._fd)
            os.unlink(self.path)
            self._fd = -1


_OBJ, _STR, _STAMP, _SCALAR, _JSON = "obj", "str", "stamp", "scalar", "json"


@functools.cache  # a value's class picks its way once
def _kind(c: type) -> str:
    """How a value of class `c` is logged."""
    if c is str:
        return _STR
    if hasattr(c, "trace_value"):  # a late digest
        return _STAMP
    if c in (type(None), int, float, bool):
        return _SCALAR
    return _JSON if issubclass(c, (int, float, str, list, tuple, dict, enum.Enum)) else _OBJ


def _digest(me: weakref.ref, sid: int, value: str) -> None:
    """A late digest computed: logged if its recorder is still there (a stamp keeps none alive)."""
    rec = me()
    if rec is not None:
        rec._digest(sid, value)


def arity_error(ev: str, names: tuple[str, ...], values: tuple) -> TypeError:
    return TypeError(f"event {ev}: {len(values)} values logged for the fields {', '.join(names)}")
