"""The trace reader's fast path: a chunk of event lines decoded and validated in one msgspec call.

msgspec decodes into typed structs, one per event kind of the role and version (tagged by `ev`), so
that the field types, the integer range (signed 64 bits), finite numbers, valid Unicode and the
nesting bound are checked in C, not per value in Python. The structs are then turned into the
plain dicts every rule reads (`msgspec.to_builtins`, also in C).

The schema is strict on purpose: a field the vocabulary does not name, an engine's own `x.` event,
an object nested deeper than the schema, any value of a wrong type makes the whole chunk fail here,
and the caller redoes it on the paths that accept everything the format allows and word the reason
for what it does not (checker/trace_io.py). This path only ever accepts what those accept.
"""

from __future__ import annotations

from typing import Annotated, Union

from .json_values import INT64

try:
    import msgspec
except ImportError:  # a declared dependency; without it the reader takes its other paths
    msgspec = None

if msgspec is not None:
    _I64 = Annotated[int, msgspec.Meta(ge=INT64[0], le=INT64[1])]
    _SCALAR = _I64 | float | str | bool | None
    # An `object` field (admit's chunks, a query's result, a stall's stacks) two levels deep at most
    # here; a deeper one is valid but takes the caller's general path.
    _OBJECT = dict[str, _SCALAR | list[_SCALAR] | dict[str, _SCALAR]]
    _TYPES = {
        "int": _I64,
        "str": str,
        "bool": bool,
        "list[str]": list[str],
        "list[int]": list[_I64],
        "int|null": _I64 | None,
        "str|null": str | None,
        "object|null": _OBJECT | None,
        "int|str": _I64 | str,
    }
    _BASE = [("seq", _I64), ("t_ns", _I64), ("thread", str)]
    # the happens-before clock (docs/trace-format.md): own count, or changed components
    _VC = ("vc", _I64 | dict[str, _I64] | msgspec.UnsetType, msgspec.UNSET)


def _struct(ev: str, spec: dict):
    """The struct of one event kind: base keys, required fields, optional ones (absent stays
    absent: UNSET is left out of the dict), and `vc`."""
    fields = list(_BASE)
    fields += [(name, _TYPES[typ]) for name, typ in spec.get("fields", {}).items()]
    fields += [
        (name, _TYPES[typ] | msgspec.UnsetType, msgspec.UNSET)
        for name, typ in spec.get("optional", {}).items()
    ]
    fields.append(_VC)
    return msgspec.defstruct(
        "Event_" + "".join(c if c.isalnum() else "_" for c in ev),
        fields,
        tag_field="ev",
        tag=ev,
        forbid_unknown_fields=True,
        gc=False,  # short-lived, holds no cycles: not tracked by the cyclic collector
    )


def make_decoder(kinds: dict):
    """A decoder of event lines for `kinds` (ev -> its spec/events.toml entry), or None without
    msgspec or for a role with no kinds."""
    if msgspec is None or not kinds:
        return None
    structs = tuple(_struct(ev, spec) for ev, spec in kinds.items())
    return msgspec.json.Decoder(Union[structs])  # noqa: UP007 (a tuple of kinds)


def decode_chunk(decoder, raw: list) -> list | None:
    """The events of `raw` (lines of bytes; blank ones skipped) as dicts, or None when any line is
    not valid for the strict schema (the caller then takes its general path)."""
    try:
        return msgspec.to_builtins(decoder.decode_lines(b"".join(raw)))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # deep nesting: too
        return None
