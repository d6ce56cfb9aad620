"""The trace reader's fast path: a chunk of event lines decoded and validated in one msgspec call.

msgspec decodes into typed structs, one per event kind of the role and version (tagged by `ev`), so
that the field types, the integer range (signed 64 bits), finite numbers, valid Unicode and the
nesting bound are checked in C, not per value in Python. The linear checker reads those structs as
they are (attribute access, no dict built per event); every other reader gets plain dicts
(`msgspec.to_builtins`, also in C).

The schema is strict on purpose: a field the vocabulary does not name, an engine's own `x.` event,
an object nested deeper than the schema, any value of a wrong type makes the whole chunk fail here,
and the caller redoes it on the paths that accept everything the format allows and word the reason
for what it does not (checker/trace_io.py). This path only ever accepts what those accept. An
optional field that is absent reads as None (an explicit null is refused unless its type allows
it, as on the other paths).
"""

from __future__ import annotations

from functools import cached_property
from operator import attrgetter
from typing import Annotated, Any, Literal, Union

import msgspec

from .json_values import INT64

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
_BASE = {"seq": _I64, "t_ns": _I64, "thread": str}
# A trace names few threads, on every event: decoded against the names seen so far (a Literal), a
# `thread` is that name's one string, not a string allocated per event. An unknown name fails that
# decoder; the chunk is decoded again with `thread` as any string, and its names are learnt, up to
# this many (past it every chunk takes the plain decoder). The first chunk is the first lesson.
_NAMED_THREADS = 64
# the happens-before clock (docs/trace-format.md): own count, or changed components
_VC_TYPE = _I64 | dict[str, _I64]


_THREAD = attrgetter("thread")


class Event(msgspec.Struct, tag_field="ev", gc=False):
    """An event of the vocabulary: its fields are attributes (`e.seq`, `e.ev`, an absent
    optional one is None). `e["seq"]` reads the same attribute, for the reader's code that
    takes dicts and structs alike."""

    __getitem__ = object.__getattribute__


class Kinds:
    """The struct families of one role and version: `structs` and `dicts` decode event lines
    strictly (the vocabulary's types, no other field); an absent optional field is None in the
    first and left out of the dicts made from the second. `lenient` (the same kinds, any value,
    extra fields dropped) turns events already validated as dicts into structs. The linear checker
    needs only `structs`: the other two are built on first use (a few ms of every `pdo check`)."""

    def __init__(self, kinds: dict):
        self._kinds = kinds
        self.names = frozenset(kinds)
        self.structs = msgspec.json.Decoder(self._union(True, None))
        self.threads: frozenset = frozenset()  # the names learnt: none until a first decode
        self.named = None  # the decoder of `structs` with `thread` one of `threads`

    def _union(self, strict: bool, absent, thread=str):
        return Union[  # noqa: UP007
            tuple(_struct(ev, spec, strict, absent, thread) for ev, spec in self._kinds.items())
        ]

    def learn(self, threads) -> None:
        """Decode `thread` against these names too (none once there are too many)."""
        names = self.threads | frozenset(threads)
        if names == self.threads:
            return
        self.threads = names
        self.named = (
            msgspec.json.Decoder(self._union(True, None, Literal[tuple(sorted(names))]))
            if len(names) <= _NAMED_THREADS
            else None
        )

    def decode_structs(self, block: bytes) -> list:
        """`block`'s event lines as structs (raises msgspec's errors as `structs` does)."""
        if self.named is not None:
            try:
                return self.named.decode_lines(block)
            except msgspec.ValidationError:
                pass  # an unknown thread name, or an invalid line: the plain decoder tells
        events = self.structs.decode_lines(block)
        if len(self.threads) <= _NAMED_THREADS:  # past it, nothing more is learnt
            self.learn(set(map(_THREAD, events)))
        return events

    @cached_property
    def dicts(self):
        return msgspec.json.Decoder(self._union(True, msgspec.UNSET))

    @cached_property
    def lenient(self):
        return list[self._union(False, None)]


def _struct(ev: str, spec: dict, strict: bool, absent, thread=str):
    """The struct of one event kind: base keys, required fields, optional ones (`absent` when
    absent: None, or UNSET, which to_builtins leaves out), and `vc`. A lenient struct types
    nothing: it holds events another path validated."""

    def typ(t):
        if not strict:
            return Any
        return t | msgspec.UnsetType if absent is msgspec.UNSET else t

    fields = [(name, t if strict else Any) for name, t in (_BASE | {"thread": thread}).items()]
    fields += [(n, _TYPES[t] if strict else Any) for n, t in spec.get("fields", {}).items()]
    fields += [(n, typ(_TYPES[t]), absent) for n, t in spec.get("optional", {}).items()]
    fields.append(("vc", typ(_VC_TYPE), absent))
    return msgspec.defstruct(
        "Event_" + "".join(c if c.isalnum() else "_" for c in ev),
        fields,
        bases=(Event,),
        tag=ev,
        namespace={"ev": ev},
        forbid_unknown_fields=strict,
        gc=False,  # short-lived, holds no cycles: not tracked by the cyclic collector
    )


def make_kinds(kinds: dict) -> Kinds | None:
    """The struct families of `kinds` (ev -> its spec/events.toml entry), or None for a role with
    no kinds."""
    return Kinds(kinds) if kinds else None


def decode_chunk(kinds: Kinds, raw: list, structs: bool = False) -> list | None:
    """The events of `raw` (lines of bytes; blank ones skipped) as structs, or as dicts unless
    `structs`; None when any line is not valid for the strict schema (the caller then takes its
    general path)."""
    return decode_block(kinds, b"".join(raw), structs)


def decode_block(kinds: Kinds, block: bytes, structs: bool = False) -> list | None:
    """decode_chunk on the lines' bytes as read (one buffer: no list of lines to build)."""
    try:
        if structs:
            return kinds.decode_structs(block)
        return msgspec.to_builtins(kinds.dicts.decode_lines(block))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # deep nesting: too
        return None


def as_structs(kinds: Kinds, events: list) -> list:
    """Events validated as dicts (by the general path, or made by a caller) as structs; kinds
    outside `kinds` must have been dropped first."""
    return msgspec.convert(events, kinds.lenient)


def as_dict(e) -> dict:
    """One event, struct or dict, as a dict (for the few readers of a marker's fields)."""
    return e if type(e) is dict else msgspec.to_builtins(e)
