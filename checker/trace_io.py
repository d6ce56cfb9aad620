"""Reading pdo-trace files: a header line, then one JSON event per line, streamed.

Malformed input raises TraceFormatError with file, line and reason; the CLI prints it on one line
and exits 2.
"""
from __future__ import annotations

import json

from spec import load_events

SUPPORTED_VERSIONS = (1,)
_TYPES = {"int": int, "str": str}


class TraceFormatError(Exception):
    def __init__(self, path: str, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


def _check_type(value, typ: str) -> bool:
    if typ == "list[str]":
        return isinstance(value, list) and all(isinstance(x, str) for x in value)
    if typ == "int|null":
        return value is None or (isinstance(value, int) and not isinstance(value, bool))
    if typ == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, _TYPES[typ])


def read_header(path: str, f) -> dict:
    first = f.readline()
    if not first:
        raise TraceFormatError(path, 1, "empty file: expected a pdo-trace header line")
    try:
        header = json.loads(first)
    except json.JSONDecodeError as e:
        raise TraceFormatError(path, 1, f"header is not JSON ({e.msg})") from None
    if not isinstance(header, dict) or header.get("format") != "pdo-trace":
        raise TraceFormatError(path, 1, "field 'format': expected \"pdo-trace\"")
    if header.get("version") not in SUPPORTED_VERSIONS:
        raise TraceFormatError(path, 1, f"field 'version': unsupported version {header.get('version')!r} "
                                        f"(this checker reads {', '.join(map(str, SUPPORTED_VERSIONS))})")
    role = header.get("role")
    if role not in ("prefill", "decode"):
        raise TraceFormatError(path, 1, f"field 'role': expected \"prefill\" or \"decode\", got {role!r}")
    if role == "prefill" and not (isinstance(header.get("page_size"), int) and header["page_size"] > 0):
        raise TraceFormatError(path, 1, "field 'page_size': expected a positive integer")
    return header


# Events are decoded a chunk of lines at a time: the chunk's lines (each keeps its "\n") are joined
# with "," into one JSON array and decoded by a single C call, about twice as fast as one json.loads
# per line. The newline kept in every separator means no string can run from one line into the next
# (a raw newline is invalid inside a JSON string), and the chunk is accepted only if it decodes to
# exactly one JSON object per line. Anything else — a line that is not JSON, an event that fails
# validation — is redone line by line by the exact reference path below, so error messages are the
# same as with per-line decoding: file:line: field reason.
_CHUNK_BYTES = 1 << 18   # lines per chunk: about 256 KiB of text


def _compile_validator(spec: dict):
    """A fast predicate for one event kind: True when the base keys and every field of `spec` have
    the right type. False sends the event to the exact (slow) path, which says what is wrong."""
    conds = ['type(e["seq"]) is int', 'type(e["t_ns"]) is int', 'type(e["thread"]) is str']
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
    src = f"def valid(e):\n    try:\n        return {' and '.join(conds)}\n    except KeyError:\n        return False\n"
    scope = {"_check_type": _check_type}
    exec(src, scope)
    return scope["valid"]


def _validate_slow(path: str, line_no: int, e, last_seq: int, fields_of: dict, role: str) -> None:
    """The reference validation of one decoded event: raises TraceFormatError with the reason."""
    if type(e) is not dict:
        raise TraceFormatError(path, line_no, "an event must be a JSON object")
    for key, typ in (("seq", int), ("t_ns", int), ("thread", str), ("ev", str)):
        if type(e.get(key)) is not typ:
            raise TraceFormatError(path, line_no, f"field '{key}': missing or not {typ.__name__}")
    if e["seq"] <= last_seq:
        raise TraceFormatError(path, line_no, f"field 'seq': {e['seq']} does not increase (previous {last_seq})")
    spec = fields_of.get(e["ev"])
    if spec is None:
        raise TraceFormatError(path, line_no, f"field 'ev': unknown event {e['ev']!r} for role {role}")
    for name, typ in spec.items():
        if name not in e or not _check_type(e[name], typ):
            raise TraceFormatError(path, line_no, f"field '{name}': missing or not {typ} in {e['ev']!r}")


def _decode_slow(path: str, line_no: int, line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, line_no, f"not JSON ({exc.msg} at column {exc.colno})") from None


def _unicode_error_line(path: str) -> tuple[int, str]:
    """Where the first invalid UTF-8 line is (text-mode reading only says which buffer)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return n, exc.reason
    return 1, "invalid UTF-8"


def iter_events(path: str, *, header_out: dict | None = None):
    """Yield (line_no, event) for every event of the file, validated against spec/events.toml.
    Streams: memory is one chunk of lines, whatever the file size."""
    vocab = load_events()
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            header = read_header(path, f)
        except UnicodeDecodeError as e:
            raise TraceFormatError(path, 1, f"not UTF-8 text ({e.reason})") from None
        if header_out is not None:
            header_out.update(header)
        role = header["role"]
        fields_of = {ev: spec.get("fields", {}) for ev, spec in vocab.get(role, {}).items()}
        valid = {ev: _compile_validator(spec) for ev, spec in fields_of.items()}
        loads = json.loads
        last_seq = 0
        line_no = 1
        while True:
            try:
                raw = f.readlines(_CHUNK_BYTES)
            except UnicodeDecodeError:
                n, reason = _unicode_error_line(path)
                raise TraceFormatError(path, n, f"not UTF-8 text ({reason})") from None
            if not raw:
                return
            nums, lines = [], []
            for line in raw:
                line_no += 1
                if line.strip():
                    nums.append(line_no)
                    lines.append(line if line.endswith("\n") else line + "\n")
            if not lines:
                continue
            try:
                events = loads("[" + ",".join(lines) + "]")
                ok = len(events) == len(lines)
            except json.JSONDecodeError:
                ok = False
            if ok:
                for n, e in zip(nums, events):
                    try:
                        ok = valid[e["ev"]](e) and e["seq"] > last_seq
                    except (KeyError, TypeError):   # not an object, no or unknown `ev`
                        ok = False
                    if ok:
                        last_seq = e["seq"]
                        yield n, e
                        continue
                    _validate_slow(path, n, e, last_seq, fields_of, role)  # raises, unless the fast check was too strict
                    last_seq = e["seq"]
                    yield n, e
            else:
                for n, line in zip(nums, lines):
                    e = _decode_slow(path, n, line)
                    _validate_slow(path, n, e, last_seq, fields_of, role)
                    last_seq = e["seq"]
                    yield n, e
