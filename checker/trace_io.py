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


def iter_events(path: str, *, header_out: dict | None = None):
    """Yield (line_no, event) for every event of the file, validated against spec/events.toml."""
    vocab = load_events()
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            header = read_header(path, f)
        except UnicodeDecodeError as e:
            raise TraceFormatError(path, 1, f"not UTF-8 text ({e.reason})") from None
        if header_out is not None:
            header_out.update(header)
        fields_of = {ev: spec.get("fields", {}) for ev, spec in vocab.get(header["role"], {}).items()}
        last_seq = 0
        line_no = 1
        loads = json.loads
        try:
            for line in f:
                line_no += 1
                if not line.strip():
                    continue
                try:
                    e = loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceFormatError(path, line_no, f"not JSON ({exc.msg} at column {exc.colno})") from None
                if type(e) is not dict:
                    raise TraceFormatError(path, line_no, "an event must be a JSON object")
                for key, typ in (("seq", int), ("t_ns", int), ("thread", str), ("ev", str)):
                    if type(e.get(key)) is not typ:
                        raise TraceFormatError(path, line_no, f"field '{key}': missing or not {typ.__name__}")
                if e["seq"] <= last_seq:
                    raise TraceFormatError(path, line_no, f"field 'seq': {e['seq']} does not increase (previous {last_seq})")
                last_seq = e["seq"]
                spec = fields_of.get(e["ev"])
                if spec is None:
                    raise TraceFormatError(path, line_no, f"field 'ev': unknown event {e['ev']!r} for role {header['role']}")
                for name, typ in spec.items():
                    if name not in e or not _check_type(e[name], typ):
                        raise TraceFormatError(path, line_no, f"field '{name}': missing or not {typ} in {e['ev']!r}")
                yield line_no, e
        except UnicodeDecodeError as exc:
            raise TraceFormatError(path, line_no + 1, f"not UTF-8 text ({exc.reason})") from None
