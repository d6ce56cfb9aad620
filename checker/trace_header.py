"""A trace's header line (docs/trace-format.md, "Header"), and the headers of the traces of one PD
run checked together, which must agree."""

from __future__ import annotations

import json

from spec import modes_of
from spec.errors import BadInput

from .json_values import strict_loads

SUPPORTED_VERSIONS = (1, 2, 3, 4)  # an event with `since = N` (spec/events.toml) needs version >= N


class TraceFormatError(BadInput):
    def __init__(self, path: str, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


def read_header(path: str, f) -> dict:
    """The first line of `f` (opened in text or binary mode), validated."""
    first = f.readline()
    if not first:
        raise TraceFormatError(path, 1, "empty file: expected a pdo-trace header line")
    if isinstance(first, bytes):
        try:
            first = first.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceFormatError(path, 1, f"not UTF-8 text ({e.reason})") from None
    try:
        header = strict_loads(first)
    except json.JSONDecodeError as e:
        raise TraceFormatError(path, 1, f"header is not JSON ({e.msg})") from None
    except ValueError as e:
        raise TraceFormatError(path, 1, f"header: {e}") from None
    if not isinstance(header, dict) or header.get("format") != "pdo-trace":
        raise TraceFormatError(path, 1, "field 'format': expected \"pdo-trace\"")
    version = header.get("version")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:  # not true, not 1.0
        raise TraceFormatError(
            path,
            1,
            f"field 'version': unsupported version {version!r} "
            f"(this checker reads {', '.join(map(str, SUPPORTED_VERSIONS))})",
        )
    role = header.get("role")
    if role not in ("prefill", "decode"):
        raise TraceFormatError(
            path, 1, f'field \'role\': expected "prefill" or "decode", got {role!r}'
        )
    modes = modes_of(role)
    if (
        header.get("mode") not in modes
    ):  # the mode selects the rules: a wrong or missing one would check nothing
        raise TraceFormatError(
            path,
            1,
            f"field 'mode': expected one of {', '.join(modes)} for role {role}, "
            f"got {header.get('mode')!r}",
        )
    if not (
        type(header.get("page_size")) is int and header["page_size"] > 0
    ):  # both roles' page-count rules
        raise TraceFormatError(path, 1, "field 'page_size': expected a positive integer")
    for name, ok, what in _HEADER_OPTIONAL:
        if name in header and not ok(header[name]):
            raise TraceFormatError(
                path, 1, f"field '{name}': expected {what}, got {header[name]!r}"
            )
    if "dp_rank" in header and "dp_size" in header and header["dp_rank"] >= header["dp_size"]:
        raise TraceFormatError(
            path,
            1,
            f"field 'dp_rank': {header['dp_rank']} is not below dp_size {header['dp_size']}",
        )
    return header


# Header fields that rules read when present (the cross-process rules, the decode prefetch rules).
_HEADER_OPTIONAL = (
    ("dp_size", lambda v: type(v) is int and v > 0, "a positive integer"),
    ("dp_rank", lambda v: type(v) is int and v >= 0, "a non-negative integer"),
    ("prefetch", lambda v: type(v) is bool, "true or false"),
    ("chunk_ranges", lambda v: type(v) is bool, "true or false"),
    ("sampling", lambda v: v in ("inline", "deferred"), '"inline" or "deferred"'),
    ("memory_waits", lambda v: type(v) is int and v >= 0, "a non-negative integer"),
    ("hb", lambda v: type(v) is str, "a string"),
)


def check_set(headers: dict, prefills: list, decodes: list) -> None:
    """The traces of one PD run checked together (decode traces and the prefill traces that name
    their DP rank) must describe one layout: the same `dp_size` wherever it is given, and each DP
    rank's trace once. The cross-process rules would otherwise judge one run's decode against
    another run's ranks. Raises TraceFormatError at the header that disagrees."""
    members = [*decodes, *prefills]
    sized = [p for p in members if "dp_size" in headers[p]]
    if sized:
        ref = sized[0]  # a decode trace's when there is one: it is what the router used
        for p in sized[1:]:
            if headers[p]["dp_size"] != headers[ref]["dp_size"]:
                raise TraceFormatError(
                    p,
                    1,
                    f"field 'dp_size': {headers[p]['dp_size']}, but {ref} says "
                    f"{headers[ref]['dp_size']} (the traces of one PD run must agree)",
                )
    seen: dict = {}
    for p in prefills:
        rank = headers[p]["dp_rank"]
        if rank in seen:
            raise TraceFormatError(
                p,
                1,
                f"field 'dp_rank': {rank} is also the rank of {seen[rank]} (one trace per rank)",
            )
        seen[rank] = p
