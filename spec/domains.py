"""The declared domain of every `pdo` option: argparse `type=` callables that turn the text into a
value of the domain or refuse it, so that a bad value is one line naming the option, exit 2, before
anything runs (README, "Exit codes").

Every option of every sub-command takes either `choices=` or one of these (tests/test_cli_conventions.py
walks the parsers and checks it). Cross-option rules (a `--kill` role against `--dp`, a prompt that
must fit the model) are checked right after parsing, by the sub-command's `validate` (engine/cli).
It lives in spec/, as spec/errors.py does: the checker's and the front's parsers both use it."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from typing import Any

INT64_MAX = (1 << 63) - 1


class Domain:
    """An option's set of values, as an argparse type: `describe` says what it takes ("an integer
    in [1, 64]"), `parse` turns the text into the value or raises ValueError."""

    def __init__(self, describe: str, parse: Callable[[str], Any]):
        self.describe, self._parse = describe, parse
        self.__name__ = describe  # argparse names a type by its __name__

    def __call__(self, text: str):
        try:
            return self._parse(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected {self.describe}, got {text!r}") from None

    def __repr__(self) -> str:
        return f"Domain({self.describe})"


def _bounds(lo, hi) -> str:
    if hi is None:
        return f">= {lo:g}" if isinstance(lo, float) else f">= {lo}"
    return f"in [{lo:g}, {hi:g}]" if isinstance(lo, float) else f"in [{lo}, {hi}]"


def _int(text: str, lo: int, hi: int) -> int:
    value = int(text.strip())
    if not lo <= value <= hi:
        raise ValueError(text)
    return value


def integer(lo: int, hi: int = INT64_MAX) -> Domain:
    """A decimal integer in [lo, hi]."""
    return Domain(f"an integer {_bounds(lo, hi)}", lambda t: _int(t, lo, hi))


def seed() -> Domain:
    """A seed: an integer in [0, 2^63 - 1] (it goes into trace headers, which hold signed 64 bits)."""
    return integer(0)


def _float(text: str, lo: float, hi: float, above: bool) -> float:
    value = float(text)
    if not math.isfinite(value) or value < lo or value > hi or (above and value == lo):
        raise ValueError(text)
    return value


def number(lo: float, hi: float, *, above: bool = False) -> Domain:
    """A finite number in [lo, hi] (in (lo, hi] with `above`)."""
    lo, hi = float(lo), float(hi)
    what = f"in ({lo:g}, {hi:g}]" if above else _bounds(lo, hi)
    return Domain(f"a finite number {what}", lambda t: _float(t, lo, hi, above))


def ratio() -> Domain:
    return number(0.0, 1.0)


def span(lo: int, hi: int) -> Domain:
    """'A:B' (or 'A', meaning A:A): integers with lo <= A <= B <= hi, as a tuple."""

    def parse(text: str) -> tuple[int, int]:
        a, sep, b = text.partition(":")
        first = _int(a, lo, hi)
        last = _int(b, lo, hi) if sep else first
        if last < first:
            raise ValueError(text)
        return first, last

    return Domain(f"MIN:MAX with integers {lo} <= MIN <= MAX <= {hi}", parse)


def window(kind: type, lo: float = 0) -> Domain:
    """'A:B' where either end may be left out (an open end): numbers of `kind` (int or float),
    finite, >= lo, with A <= B; the text itself is kept (the command parses it)."""

    def end(t: str):
        if not t.strip():
            return None
        value = kind(t)
        if kind is float and not math.isfinite(value):
            raise ValueError(t)
        if value < lo or value > INT64_MAX:
            raise ValueError(t)
        return value

    def parse(text: str) -> str:
        a, sep, b = text.partition(":")
        first, last = end(a), end(b) if sep else None
        if not sep or (first is not None and last is not None and last < first):
            raise ValueError(text)
        return text

    name = "integers" if kind is int else "finite numbers"
    return Domain(f"A:B (either may be left out) with {name} {lo} <= A <= B", parse)


def listed(item: Domain) -> Domain:
    """A comma-separated, non-empty list of `item` values, as the text (the command splits it)."""

    def parse(text: str) -> str:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise ValueError(text)
        for p in parts:
            try:
                item(p.strip())
            except argparse.ArgumentTypeError:
                raise ValueError(text) from None
        return text

    return Domain(f"a comma-separated list, each {item.describe}", parse)


def one_of(names: Iterable[str], what: str) -> Domain:
    """A name from a fixed set (a registry's keys); the error lists them."""
    known = tuple(names)

    def parse(text: str) -> str:
        if text not in known:
            raise ValueError(text)
        return text

    return Domain(f"{what}: one of {', '.join(known)}", parse)


def named(names: Callable[[], Iterable[str]], what: str) -> Domain:
    """A name from a set that is read only when an option is given (the rule ids of spec/)."""

    def parse(text: str) -> str:
        if text not in set(names()):
            raise ValueError(text)
        return text

    return Domain(what, parse)


def _text(text: str, suffixes: tuple[str, ...], *, stripped: bool = True) -> str:
    if not text or "\0" in text or (stripped and text != text.strip()):
        raise ValueError(text)
    if suffixes and not text.lower().endswith(suffixes):
        raise ValueError(text)
    return text


def path(*suffixes: str) -> Domain:
    """A file path: non-empty, no NUL, no leading or trailing space; with `suffixes`, ending in one."""
    what = f"a path ending in {' or '.join(suffixes)}" if suffixes else "a non-empty path"
    return Domain(what, lambda t: _text(t, suffixes))


def text() -> Domain:
    """Free text, non-empty (a title, a host name, a rule or scenario name looked up later)."""
    return Domain("non-empty text", lambda t: _text(t, (), stripped=False))


def device() -> Domain:
    """A torch device: cpu, cuda or cuda:N (whether this torch has CUDA is checked after parsing)."""

    def parse(t: str) -> str:
        if t == "cpu" or t == "cuda" or (t.startswith("cuda:") and t[5:].isdigit()):
            return t
        raise ValueError(t)

    return Domain("cpu, cuda or cuda:N", parse)


def url() -> Domain:
    def parse(t: str) -> str:
        scheme, sep, rest = t.partition("://")
        if scheme not in ("http", "https") or not sep or not rest.strip("/") or " " in t:
            raise ValueError(t)
        return t

    return Domain("an http:// or https:// URL", parse)
