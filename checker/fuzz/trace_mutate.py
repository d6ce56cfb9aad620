"""Mutated traces for fuzzing `pdo check` (tests/test_check_fuzz.py, scripts/fuzz_check.py).

`mutate(data, rng)` returns a damaged copy of a valid trace file's bytes: one to three mutations
drawn from MUTATIONS (byte flips, type swaps, field deletion and duplication, truncation at a byte
offset, huge numbers, reordered and duplicated lines, Unicode junk, header damage, deep nesting).
The checker must answer every one with a verdict (exit 0/1/3) or a one-line bad-input error (exit
2), never an internal error (70). Everything is drawn from `rng` (a seeded random.Random), so a case
is replayed from its seed alone.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

# Values of every JSON type, and the ones the checker cannot represent (bad input, not a crash).
ODD_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    -0.0,
    "",
    "x",
    "5",
    [],
    [1, "a"],
    {},
    {"a": [1]},
    2**31,
    2**53 + 1,
    2**63 - 1,
    -(2**63),
]
ODD_TEXT = [
    str(2**63),
    str(2**64),
    str(2**70),
    str(-(2**63) - 1),
    "1e400",
    "-1e400",
    "1e308",
    "NaN",
    "Infinity",
    "-Infinity",
    '"\\ud800"',
    '"\\udfff"',
    '"\\u0000"',
    '"\u202e\u0301\U0001f600"',
    "[" * 70 + "]" * 70,
    "[" * 2000 + "]" * 2000,
    "1" * 400,
]
JUNK = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00", b"\x1b[31m", "é€\U0001f600".encode(), b"\r"]


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def _join(lines: list[bytes]) -> bytes:
    return b"\n".join(lines)


def _event_line(lines: list[bytes], rng: random.Random, header: bool = False) -> int | None:
    idx = [i for i, line in enumerate(lines) if line.strip() and (header or i > 0)]
    return rng.choice(idx) if idx else None


def _edit_object(data: bytes, rng: random.Random, edit, header: bool = False) -> bytes:
    """Decode one line as a JSON object, edit it, write it back (as text: `edit` returns a str)."""
    lines = _lines(data)
    i = 0 if header else _event_line(lines, rng)
    if i is None or i >= len(lines):
        return data
    try:
        obj = json.loads(lines[i])
    except (ValueError, RecursionError):  # a line an earlier mutation already broke
        return data
    if not isinstance(obj, dict) or not obj:
        return data
    lines[i] = edit(obj, rng).encode("utf-8", "surrogatepass")
    return _join(lines)


def _dump(obj: dict, override: dict[str, str] | None = None, extra: str = "") -> str:
    parts = [
        f"{json.dumps(k)}: {override[k] if override and k in override else json.dumps(v)}"
        for k, v in obj.items()
    ]
    return "{" + ", ".join(parts) + extra + "}"


def byte_flip(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return data
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def type_swap(data: bytes, rng: random.Random) -> bytes:
    def edit(obj, rng):
        key = rng.choice(list(obj))
        return _dump(obj, {key: json.dumps(rng.choice(ODD_VALUES))})

    return _edit_object(data, rng, edit, header=rng.random() < 0.15)


def field_delete(data: bytes, rng: random.Random) -> bytes:
    def edit(obj, rng):
        del obj[rng.choice(list(obj))]
        return _dump(obj)

    return _edit_object(data, rng, edit, header=rng.random() < 0.15)


def field_duplicate(data: bytes, rng: random.Random) -> bytes:
    """The same key twice in one object (JSON decoders keep the last)."""

    def edit(obj, rng):
        key = rng.choice(list(obj))
        value = rng.choice([json.dumps(obj[key]), json.dumps(rng.choice(ODD_VALUES))])
        return _dump(obj, extra=f", {json.dumps(key)}: {value}")

    return _edit_object(data, rng, edit, header=rng.random() < 0.1)


def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data) + 1)]


def huge_number(data: bytes, rng: random.Random) -> bytes:
    def edit(obj, rng):
        key = rng.choice(list(obj))
        return _dump(obj, {key: rng.choice(ODD_TEXT)})

    return _edit_object(data, rng, edit, header=rng.random() < 0.15)


def reorder_lines(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    if len(lines) < 3:
        return data
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return _join(lines)


def duplicate_line(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    i = rng.randrange(len(lines))
    lines.insert(rng.randrange(len(lines) + 1), lines[i])
    return _join(lines)


def unicode_junk(data: bytes, rng: random.Random) -> bytes:
    at = rng.randrange(len(data) + 1)
    junk = rng.choice(JUNK) if rng.random() < 0.6 else rng.choice(ODD_TEXT).encode()
    return data[:at] + junk + data[at:]


def header_damage(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    choice = rng.randrange(6)
    if choice == 0:
        lines[0] = b""
    elif choice == 1:
        lines[0] = b"[" + lines[0] + b"]"
    elif choice == 2:
        lines = lines[1:]
    else:
        return (
            huge_number(type_swap(_join(lines), rng), rng)
            if choice == 3
            else _edit_object(
                _join(lines),
                rng,
                lambda obj, rng: _dump(
                    obj,
                    {
                        rng.choice(
                            ["version", "role", "mode", "page_size", "dp_rank", "dp_size"]
                        ): rng.choice(
                            ODD_TEXT
                            + [json.dumps(v) for v in ODD_VALUES]
                            + ['"decode"', '"prefill"', "3", "2"]
                        )
                    },
                ),
                header=True,
            )
        )
    return _join(lines)


def deep_nesting(data: bytes, rng: random.Random) -> bytes:
    depth = rng.choice([10, 63, 64, 65, 100, 1100, 5000])

    def edit(obj, rng):
        return _dump(obj, extra=', "x_deep": ' + "[" * depth + "]" * depth)

    return _edit_object(data, rng, edit)


MUTATIONS: dict[str, Callable[[bytes, random.Random], bytes]] = {
    "byte_flip": byte_flip,
    "type_swap": type_swap,
    "field_delete": field_delete,
    "field_duplicate": field_duplicate,
    "truncate": truncate,
    "huge_number": huge_number,
    "reorder_lines": reorder_lines,
    "duplicate_line": duplicate_line,
    "unicode_junk": unicode_junk,
    "header_damage": header_damage,
    "deep_nesting": deep_nesting,
}


def mutate(data: bytes, rng: random.Random) -> tuple[bytes, list[str]]:
    """A damaged copy of `data` and the names of the mutations applied, in order."""
    names = [rng.choice(list(MUTATIONS)) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    for name in names:
        data = MUTATIONS[name](data, rng)
    return data, names
