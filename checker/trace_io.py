"""Reading pdo-trace files: a header line, then one JSON event per line, streamed.

Malformed input raises TraceFormatError with file, line and reason; the CLI prints it on one line
and exits 2.
"""

from __future__ import annotations

import io
import json
import os
from operator import attrgetter, itemgetter

from spec import load_events

from .json_values import strict_loads, suspect
from .trace_header import SUPPORTED_VERSIONS, TraceFormatError, read_header  # noqa: F401
from .trace_seq import DENSE_SINCE, gap_reason, seqs_ok
from .typed_decode import as_dict, as_structs, decode_block, make_kinds

# Events named with this prefix are an engine's own (docs/trace-format.md): skipped, and counted.
# Any other name outside the vocabulary is an error, so that a misspelt event never passes unseen.
PRIVATE_PREFIX = "x."
_TYPES = {"int": int, "str": str}
# Events about the trace itself, not the run (version 2): no rule sees them. `trace_end` is the last
# line of a whole trace; a trace of version 2 or later without it is truncated (the run was killed,
# or is still going).
MARKERS = ("trace_end", "stall")


def _check_type(value, typ: str) -> bool:
    if typ == "list[str]":
        return isinstance(value, list) and all(isinstance(x, str) for x in value)
    if typ == "list[int]":
        return isinstance(value, list) and all(type(x) is int for x in value)
    if typ == "bool":
        return type(value) is bool
    if typ == "str|null":
        return value is None or type(value) is str
    if typ == "object|null":
        return value is None or type(value) is dict
    if typ == "int|null":
        return value is None or (isinstance(value, int) and not isinstance(value, bool))
    if typ == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if typ == "int|str":  # an identity (`obj`): Python's id() or a name; 5 and "5" differ
        return type(value) is str or type(value) is int
    return isinstance(value, _TYPES[typ])


# The file is read in binary, a chunk of whole lines (about 256 KiB) at a time. The fast path decodes
# the chunk with msgspec into typed structs of the vocabulary (checker/typed_decode.py: types and
# integer ranges checked in C). A chunk it cannot vouch for (an extra field, an engine's own event)
# takes the second path: each line decoded by orjson (a maintained C parser) and validated with a
# compiled predicate per event kind. Without orjson, the chunk's lines are
# joined with "," into one JSON array and decoded by a single json.loads call; the newline kept in
# every separator means no string can run from one line into the next (a raw newline is invalid
# inside a JSON string), and the chunk is accepted only if it decodes to one object per line. A chunk
# with anything wrong — invalid UTF-8, a line that is not JSON, an event that fails validation — is
# redone line by line by the exact reference path below (standard json), so what is accepted and
# every error message (file:line: field reason) are the same whichever path runs.
_CHUNK_BYTES = 1 << 18

try:
    from orjson import loads as _orjson_loads
except ImportError:  # orjson is a declared dependency; the standard library still works without it
    _orjson_loads = None


def _compile_validator(spec: dict, optional: dict):
    """A fast predicate for one event kind: True when the base keys and every field of `spec` have
    the right type, and each field of `optional` present has. False sends the event to the exact
    (slow) path, which says what is wrong."""
    conds = ['type(e["seq"]) is int', 'type(e["t_ns"]) is int', 'type(e["thread"]) is str']
    conds += [
        f"({name!r} not in e or _check_type(e[{name!r}], {typ!r}))"
        for name, typ in optional.items()
    ]
    for name, typ in spec.items():
        v = f"e[{name!r}]"
        if typ == "int":
            conds.append(f"type({v}) is int")
        elif typ == "str":
            conds.append(f"type({v}) is str")
        elif typ == "list[str]":
            conds.append(f"type({v}) is list and all(type(x) is str for x in {v})")
        elif typ == "int|null":
            conds.append(f"({v} is None or type({v}) is int)")
        else:
            conds.append(f"_check_type({v}, {typ!r})")
    src = f"def valid(e, type=type, int=int, str=str, list=list, all=all):\n    try:\n        return {' and '.join(conds)}\n    except KeyError:\n        return False\n"
    scope = {"_check_type": _check_type}
    exec(src, scope)
    return scope["valid"]


def _validate_slow(
    path: str, line_no: int, e, last_seq: int, tables: tuple, role: str, header: dict
) -> None:
    """The reference validation of one decoded event: raises TraceFormatError with the reason."""
    fields_of, optional_of = tables[0], tables[1]
    if type(e) is not dict:
        raise TraceFormatError(path, line_no, "an event must be a JSON object")
    for key, typ in (("seq", int), ("t_ns", int), ("thread", str), ("ev", str)):
        if type(e.get(key)) is not typ:
            raise TraceFormatError(path, line_no, f"field '{key}': missing or not {typ.__name__}")
    if e["seq"] <= last_seq:
        raise TraceFormatError(
            path, line_no, f"field 'seq': {e['seq']} does not increase (previous {last_seq})"
        )
    if not seqs_ok([e["seq"]], last_seq, header["version"] >= DENSE_SINCE):
        raise TraceFormatError(
            path, line_no, gap_reason(path, line_no, last_seq, e["seq"], header.get("hb"))
        )
    spec = fields_of.get(e["ev"])
    if spec is None:
        if e["ev"].startswith(PRIVATE_PREFIX):  # an engine's own event: the base keys only
            return
        since = load_events().get(role, {}).get(e["ev"], {}).get("since")
        if since is not None:
            raise TraceFormatError(
                path,
                line_no,
                f"field 'ev': event {e['ev']!r} is new in version {since} of the format; "
                f"the header says an older version",
            )
        raise TraceFormatError(
            path,
            line_no,
            f"field 'ev': unknown event {e['ev']!r} for role {role} "
            f"(an engine's own events are named {PRIVATE_PREFIX}<name>)",
        )
    for name, typ in spec.items():
        if name not in e or not _check_type(e[name], typ):
            raise TraceFormatError(
                path, line_no, f"field '{name}': missing or not {typ} in {e['ev']!r}"
            )
    for name, typ in optional_of.get(e["ev"], {}).items():  # optional, but typed when present
        if name in e and not _check_type(e[name], typ):
            raise TraceFormatError(path, line_no, f"field '{name}': not {typ} in {e['ev']!r}")


def _decode_fast(raw: list) -> list | None:
    """Every non-blank line of `raw` (bytes, newline kept) decoded, or None if any line is not a
    single JSON value (or not UTF-8)."""
    if _orjson_loads is not None:
        try:
            return [_orjson_loads(line) for line in raw if not line.isspace()]
        except ValueError:  # orjson.JSONDecodeError is a ValueError
            return None
    lines = [line if line.endswith(b"\n") else line + b"\n" for line in raw if not line.isspace()]
    try:
        events = strict_loads(b"[" + b",".join(lines) + b"]")
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError and the value checks too
        return None
    return events if len(events) == len(lines) else None


def _valid_private(e) -> bool:
    """An event that is not in the vocabulary: valid only as an engine's own (`x.<name>`)."""
    return (
        type(e["seq"]) is int
        and type(e["t_ns"]) is int
        and type(e["thread"]) is str
        and type(e["ev"]) is str
        and e["ev"].startswith(PRIVATE_PREFIX)
    )


def _validate_fast(events: list, valid: dict, last_seq: int, dense: bool) -> bool:
    get = valid.get
    try:
        for e in events:
            if not get(e["ev"], _valid_private)(e):
                return False
    except (KeyError, TypeError):  # not an object, no `ev`, a field missing
        return False
    return seqs_ok(list(map(_SEQ, events)), last_seq, dense)


def _drop_unknown(events: list, nums: list | None, known: dict, ignored: dict | None):
    """An engine's own events (`x.<name>`, validated as such) are not the checker's: they are dropped
    here, before any rule sees them, and counted by kind in `ignored`."""
    skipped = [e["ev"] for e in events if e["ev"] not in known]
    if not skipped:  # the usual case: nothing built but an empty list
        return events, nums
    if ignored is not None:
        for ev in skipped:
            ignored[ev] = ignored.get(ev, 0) + 1
    keep = [i for i, e in enumerate(events) if e["ev"] in known]
    return [events[i] for i in keep], ([nums[i] for i in keep] if nums is not None else None)


def _chunk_slow(path: str, first_line: int, raw: list, last_seq: int, tables: tuple, header: dict):
    """The reference path for one chunk: yields (line_no, event); raises TraceFormatError at the
    first bad line."""
    for n, line in enumerate(raw, first_line):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceFormatError(path, n, f"not UTF-8 text ({exc.reason})") from None
        if not text.strip():
            continue
        try:
            e = strict_loads(text)
        except json.JSONDecodeError as exc:
            # some of json's messages end in "at" ("Invalid control character at")
            msg = exc.msg.removesuffix(" at")
            raise TraceFormatError(path, n, f"not JSON ({msg} at column {exc.colno})") from None
        except ValueError as exc:  # a value the checker cannot represent
            raise TraceFormatError(path, n, f"not a checkable value ({exc})") from None
        _validate_slow(path, n, e, last_seq, tables, header["role"], header)
        last_seq = e["seq"]
        yield n, e


_EV, _SEQ = itemgetter("ev"), itemgetter("seq")
_BATCH = itemgetter("batch")
_EV_ATTR, _SEQ_ATTR, _BATCH_ATTR = attrgetter("ev"), attrgetter("seq"), attrgetter("batch")
_TABLES: dict = {}  # (role, version) -> (the vocabulary they were built from, tables)


def _validators(fields_of: dict, optional_of: dict):
    """A function that returns the fast validator of each kind, compiled on its first call: only
    a chunk the typed decoder cannot vouch for needs them (most checks compile none)."""
    compiled: dict = {}

    def table() -> dict:
        if not compiled:
            compiled.update(
                (ev, _compile_validator(fields_of[ev], optional_of[ev])) for ev in fields_of
            )
        return compiled

    return table


def _role_tables(role: str, version: int) -> tuple[dict, dict, object, object]:
    """(required fields, optional fields) per event kind of `role` in `version` of the format (an
    event is in every version from its `since`, 1 when absent), the fast validators of those
    kinds (a function that returns them, compiled on first use), and their typed decoder
    (checker/typed_decode.py; None without msgspec)."""
    vocab = load_events()
    hit = _TABLES.get((role, version))
    if hit is None or hit[0] is not vocab:
        kinds = {
            ev: spec for ev, spec in vocab.get(role, {}).items() if spec.get("since", 1) <= version
        }
        fields_of = {ev: spec.get("fields", {}) for ev, spec in kinds.items()}
        optional_of = {ev: spec.get("optional", {}) for ev, spec in kinds.items()}
        hit = _TABLES[(role, version)] = (
            vocab,
            (fields_of, optional_of, _validators(fields_of, optional_of), make_kinds(kinds)),
        )
    return hit[1]


def _chunks(
    path: str,
    header_out: dict | None,
    with_lines: bool,
    ignored: dict | None = None,
    status: dict | None = None,
    own: bool = False,
    structs: bool = False,
    consecutive: bool = True,
):
    """Yield (line numbers or None, events) per chunk of the file, every event validated; events of
    an engine's own (`x.<name>`) are dropped (and counted by kind in `ignored`) unless `own`, and so
    are the markers (MARKERS), which `status` gets instead (`end_status`). The events are dicts, or
    with `structs` the vocabulary's structs (checker/typed_decode.py; not with `own`). Without
    `consecutive`, the admitted batch ids are the caller's to check (check_consecutive, once
    every chunk was read)."""
    status = {} if status is None else status
    with open(path, "rb") as f:
        header = read_header(path, f)
        if header_out is not None:
            header_out.update(header)
        tables = _role_tables(header["role"], header["version"])
        known = tables[0]  # the kinds of the vocabulary
        structs = structs and tables[3] is not None
        # seq increases; from version 2 on it counts the events (checker/trace_seq.py)
        last_seq = -1
        lines = _LineCount(f, f.tell(), eager=with_lines)
        admitted: set = set()
        version = header["version"]
        status.update(version=version, end=None, cut_line=None, last_line=1, stalls=0, count=0)
        while True:
            at = f.tell()
            block = f.read(_CHUNK_BYTES)
            if not block:
                _check_count(path, status)
                if version >= 2 and status["end"] is None and status["cut_line"] is None:
                    status["last_line"] = lines.last()  # truncation's line: counted only then
                if consecutive:  # both roles relate batch N to N±1 by id
                    check_consecutive(path, admitted)
                return
            if not block.endswith(b"\n"):
                block += f.readline()  # whole lines: up to the next newline (or the file's end)
            if not block.endswith(b"\n"):  # the file's last line, without its newline
                last = block[block.rfind(b"\n") + 1 :]
                if version >= 2 and _cut(last):
                    # cut mid-line (a killed writer): truncation, not bad JSON
                    status["cut_line"] = lines.at(at + len(block) - len(last))
                    block = block[: len(block) - len(last)]
                    if not block:
                        continue
            if status["end"] is not None:
                raise TraceFormatError(
                    path, _end_line(status), "field 'ev': trace_end is not the last event"
                )
            nums, events = _decode(path, lines, at, block, last_seq, tables, header, structs)
            typed = bool(events) and type(events[0]) is not dict
            ev_of = _EV_ATTR if typed else _EV
            # the chunk's kinds, in C: most chunks have no marker and no engine's own event
            kinds = set(map(ev_of, events))
            if events:
                status["count"] += len(events)
                last_seq = events[-1]["seq"]
                if version >= 2 and not kinds.isdisjoint(MARKERS):
                    events, nums = _take_markers(path, events, nums, status, lines, at, block)
            lines.passed(at + len(block), block)
            if events and not own:
                if not kinds <= known.keys():
                    events, nums = _drop_unknown(events, nums, known, ignored)
                if consecutive and "admit" in kinds:
                    admits = [e for e in events if ev_of(e) == "admit"]
                    admitted.update(map(_BATCH_ATTR if typed else _BATCH, admits))
            if events and structs and not typed:  # the general path's dicts
                events = as_structs(tables[3], events)
            if events:
                yield nums, events


class _LineCount:
    """The line number at a byte offset of the file, counted only when asked: a whole trace read
    without errors needs none; an error, a cut line or a truncated trace's end does. Counted from
    where the last count stopped, reading the file again (the offsets asked for only grow);
    `eager` (a reader that numbers every line) counts each chunk as it passes instead."""

    def __init__(self, f, start: int, eager: bool):
        self._fd, self.eager, self._start = f.fileno(), eager, start
        self._off, self._line = start, 2  # line 1 is the header

    def at(self, offset: int) -> int:
        """The number of the line that starts at `offset` (a line's first byte)."""
        if offset < self._off:  # not met by the readers here: count again from the start
            self._off, self._line = self._start, 2
        while self._off < offset:
            data = os.pread(self._fd, min(offset - self._off, 1 << 22), self._off)
            if not data:
                break
            self._line += data.count(b"\n")
            self._off += len(data)
        return self._line

    def passed(self, offset: int, block: bytes) -> None:
        """The chunk `block`, which ends at `offset`, was read: counted now when eager."""
        if self.eager and self._off == offset - len(block):
            self._line += block.count(b"\n")
            self._off = offset

    def last(self) -> int:
        """The number of the file's last line (the header's when no line follows it)."""
        size = os.fstat(self._fd).st_size
        if size <= self._start:
            return 1
        n = self.at(size)
        return n - 1 if os.pread(self._fd, 1, size - 1) == b"\n" else n


def _lines(block: bytes) -> list:
    """A chunk's lines, each with its newline (the last may lack it), as readlines splits them:
    only for the paths that go line by line."""
    return io.BytesIO(block).readlines()


def _decode(
    path: str,
    lines: _LineCount,
    at: int,
    block: bytes,
    last_seq: int,
    tables: tuple,
    header: dict,
    structs: bool = False,
):
    """(line numbers or None, events) of one chunk (`block`: whole lines, from byte `at`), every
    event validated; the line numbers when `lines` is eager. Three ways, each taken only when the
    one before cannot vouch for the chunk: the typed decoder (checker/typed_decode.py: the
    vocabulary's own fields, checked in C; structs when `structs`), orjson with a compiled
    predicate per event kind (any extra field, an engine's own events), and the exact path, which
    words the error. The last two give dicts."""
    dense = header["version"] >= DENSE_SINCE
    events = decode_block(tables[3], block, structs) if tables[3] is not None else None
    seq_of = _SEQ_ATTR if structs else _SEQ
    raw = None
    if events is None or not seqs_ok(list(map(seq_of, events)), last_seq, dense):
        raw = _lines(block)
        events = None if suspect(raw) else _decode_fast(raw)
        if events is not None and not _validate_fast(events, tables[2](), last_seq, dense):
            events = None
    if events is None:
        pairs = list(_chunk_slow(path, lines.at(at), raw, last_seq, tables, header))
        return [n for n, _ in pairs], [e for _, e in pairs]
    if not lines.eager:
        return None, events
    raw = raw or _lines(block)
    return [n for n, line in enumerate(raw, lines.at(at)) if not line.isspace()], events


def _check_count(path: str, status: dict) -> None:
    """A whole trace's `trace_end` counts the events before it: fewer read means lines lost."""
    end = status["end"]
    if end is None or end["events"] == status["count"] - 1:
        return
    raise TraceFormatError(
        path,
        _end_line(status),
        f"field 'events': trace_end says {end['events']} events, but {status['count'] - 1} "
        f"precede it; lost events: the trace is not whole",
    )


def _cut(line: bytes) -> bool:
    """A last line without its newline that is not one JSON value: written in part."""
    if line.isspace():
        return False
    try:
        json.loads(line)
    except RecursionError:  # whole, but nested too deep: the decoder says so
        return False
    except ValueError:
        return True
    return False


def _take_markers(
    path: str, events: list, nums: list | None, status: dict, lines: _LineCount, at: int, block
):
    """The chunk's events without the markers, which go to `status`: `end` (the trace_end event)
    and how to find its line (`_end_line`), `stalls` (how many)."""
    marks = [i for i, e in enumerate(events) if e["ev"] in MARKERS]
    if not marks:
        return events, nums
    for i in marks:
        e = events[i]
        if status["end"] is not None:  # a marker after trace_end
            raise TraceFormatError(
                path, _end_line(status), "field 'ev': trace_end is not the last event"
            )
        if e["ev"] == "trace_end":
            end = status["end"] = as_dict(e)
            if nums is not None:
                status["end_line"] = nums[i]
            else:  # found when asked, while the file is open; at once for a run cut short
                status.pop("end_line", None)
                status["end_line_of"] = lambda s=e["seq"]: _line_of(block, lines.at(at), s)
                if end.get("reason") != "normal":
                    _end_line(status)
            if i != len(events) - 1:
                raise TraceFormatError(
                    path, _end_line(status), "field 'ev': trace_end is not the last event"
                )
        else:
            status["stalls"] += 1
    keep = [i for i, e in enumerate(events) if e["ev"] not in MARKERS]
    return [events[i] for i in keep], ([nums[i] for i in keep] if nums is not None else None)


def _end_line(status: dict) -> int:
    """The line of the trace's trace_end (found now if it was not yet)."""
    if "end_line" not in status:
        status["end_line"] = status.pop("end_line_of")()
    return status["end_line"]


def _line_of(block: bytes, first: int, seq: int) -> int:
    """The line number of the event with `seq` in a chunk (only on the marker path). From the
    chunk's end: the marker of every whole trace, trace_end, is its last line (the seqs of a chunk
    that got here increase, so no other line has the same)."""
    lines = _lines(block)
    for n in range(len(lines) - 1, -1, -1):
        line = lines[n]
        if line.strip() and json.loads(line).get("seq") == seq:
            return first + n
    return first


def truncation(status: dict) -> int | None:
    """The line at which a version-2 trace stops short of its run's end, or None for a whole trace
    (and for every version-1 trace, which has no trace_end): the first missing or cut line, or the
    trace_end line of a run that did not end normally (an exception, a signal, the watchdog)."""
    if status.get("version", 1) < 2:
        return None
    if status.get("cut_line") is not None:
        return status["cut_line"]
    end = status.get("end")
    if end is None:
        return status.get("last_line", 1) + 1
    return None if end.get("reason") == "normal" else _end_line(status)


def check_consecutive(path: str, admitted: set) -> None:
    """The rules relate batch N to N-1 and N+1 by id, so admitted batch ids must be consecutive
    integers (in any order: admitting them out of order is a rule's to report, P-fifo). A gap would
    leave those rules nothing to compare: it is a malformed trace, reported at the admit after it."""
    if not admitted or max(admitted) - min(admitted) + 1 == len(admitted):
        return
    after = min(b for b in admitted if b - 1 not in admitted and b != min(admitted))
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if n > 1 and b'"admit"' in line:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("ev") == "admit" and e.get("batch") == after:
                    break
        else:
            n = 1
    below = max(b for b in admitted if b < after)
    gap = (
        f"batch {below + 1} was" if after - below == 2 else f"batches {below + 1}..{after - 1} were"
    )
    raise TraceFormatError(
        path,
        n,
        f"field 'batch': {gap} never admitted, but {below} and {after} were "
        f"(admitted batch ids must be consecutive)",
    )


def iter_chunks(
    path: str,
    *,
    header_out: dict | None = None,
    ignored: dict | None = None,
    status: dict | None = None,
    own: bool = False,
    structs: bool = False,
    consecutive: bool = True,
):
    """Yield lists of validated events, in file order (the checker's fast path: no per-event
    generator step). Memory is one chunk, whatever the file size. An engine's own events
    (`x.<name>`) are skipped, counted by kind in `ignored`, unless `own`; the markers (trace_end,
    stall) go to `status` (`truncation(status)` once read). The events are dicts, or with `structs`
    the vocabulary's structs (attributes; absent optional fields None): the linear checker's
    input. Without `consecutive`, the caller checks the admitted batch ids (check_consecutive)
    once every chunk was read: the linear checker keeps them anyway (no pass over each chunk for
    its admits)."""
    chunks = _chunks(
        path, header_out, False, ignored, status, own, structs and not own, consecutive
    )
    for _, events in chunks:
        yield events


def as_events(header: dict, events: list) -> list:
    """Validated events (dicts, or structs already) as the linear checker's structs; kinds outside
    the header's vocabulary (an engine's own) are left out, as the reader leaves them out."""
    kinds = _role_tables(header["role"], header.get("version", 1))[3]
    if kinds is None:
        return []
    if not events or type(events[0]) is not dict:
        return events
    known = kinds.names
    return as_structs(kinds, [e for e in events if e["ev"] in known])


def iter_events(
    path: str,
    *,
    header_out: dict | None = None,
    ignored: dict | None = None,
    status: dict | None = None,
):
    """Yield (line_no, event) for every event of the file, validated against spec/events.toml (an
    engine's own, `x.<name>`, skipped and counted in `ignored`; the markers go to `status`, as for
    iter_chunks). Streams: memory is one chunk of lines, whatever the file size."""
    for nums, events in _chunks(path, header_out, True, ignored, status):
        yield from zip(nums, events)
