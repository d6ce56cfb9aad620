"""Strict JSON values for the trace reader (checker/trace_io.py): what orjson and the standard
library would accept but the checker cannot hold (integers outside signed 64 bits, NaN, infinities,
lone surrogates, deep nesting) is refused with the reason, the same on both decoding paths."""

from __future__ import annotations

import json
import math
import re

# Values the checker cannot represent are bad input wherever they are in a line, on both paths:
# integers outside signed 64 bits (numpy, z3 and the rules' arithmetic hold int64), numbers that
# are not finite (NaN, Infinity, 1e400), strings with a lone surrogate (not Unicode: they cannot be
# printed), and more than MAX_DEPTH arrays or objects inside one another (the line's own object
# included).
INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_DEPTH = 64


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _int64(text: str) -> int:
    value = int(text)
    if not INT64[0] <= value <= INT64[1]:
        raise ValueError(
            f"integer {text[:24]}{'...' if len(text) > 24 else ''} is outside signed 64 bits"
        )
    return value


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:24]} is not finite")
    return value


def strict_loads(text):
    """Standard json, made to refuse what orjson refuses and what the checker cannot hold; raises
    ValueError with the reason (json.JSONDecodeError for syntax)."""
    try:
        value = json.loads(
            text, parse_constant=_reject_constant, parse_int=_int64, parse_float=_finite
        )
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    reason = bad_value(value, 0)
    if reason:
        raise ValueError(reason)
    return value


def bad_value(v, depth: int) -> str | None:
    """Why a decoded value cannot be checked, or None. `depth` is the number of arrays and objects
    around `v`: each array or object is one level, whichever kind, and a value that is neither adds
    none, so a line's own object is level 1 and at most MAX_DEPTH levels nest."""
    t = type(v)
    if t is int:
        return None if INT64[0] <= v <= INT64[1] else "integer outside signed 64 bits"
    if t is float:
        return None if math.isfinite(v) else "number is not finite"
    if t is str:
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return "string is not valid Unicode (a lone surrogate)"
        return None
    if t is not list and t is not dict:
        return None
    if depth >= MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels"
    if t is list:
        return next((r for x in v if (r := bad_value(x, depth + 1))), None)
    return next(
        (r for k, x in v.items() if (r := bad_value(k, depth + 1) or bad_value(x, depth + 1))), None
    )


# A chunk that may hold such a value goes to the exact path: a 19-digit number from 9e18 up or a
# longer one (orjson reads integers up to 2^64 - 1, and larger ones as floats), a \uD800-\uDBFF
# escape (the standard library accepts a lone one), NaN or Infinity (the same), and a line with
# more than MAX_DEPTH brackets (orjson nests to 1024).
_SUSPECT = re.compile(rb"9\d{18}|\d{20}|\\u[dD][89abAB]|NaN|Infinity")


def suspect(raw: list) -> bool:
    if _SUSPECT.search(b"".join(raw)):
        return True
    return any(line.count(b"[") + line.count(b"{") > MAX_DEPTH for line in raw)
