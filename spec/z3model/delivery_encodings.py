"""The encoding of the `delivered` rules (completions of asynchronous copies, format version 2): a
consumer comes after the completion it needs. Only traces carry these events (the loop model does
not emit them), so the encoding serves TraceUniverse; it reads the same rule data as the linear
template (checker/request_templates.py Delivered)."""

from __future__ import annotations

from .encoding import ENCODERS
from .logic import conj, disj, eq, implies, lt


def _matches(done, send) -> object:
    """A completion of this send: the same start where the send carries one."""
    start = send.f.get("start")
    return True if not isinstance(start, int) else eq(done.f["start"], start)


def _ended(send, failures, before=None) -> list:
    """The rid's failures that end `send`: after it (and before `before`, where given)."""
    mine = [f for f in failures if f.rid == send.rid]
    return [
        conj(f.exists, lt(send, f), *([lt(f, before)] if before is not None else [])) for f in mine
    ]


@ENCODERS.register("delivered")
def enc_delivered(rule, universe):
    dones = universe.named(rule["done"])
    consumers = universe.named(rule["consumer"])
    failures = universe.named(rule["failed"]) if rule.get("failed") else []
    sends = [s for name in rule.get("sends") or () for s in universe.named(name)]
    for c in consumers:
        mine = [d for d in dones if d.rid == c.rid]
        if not sends:  # a completion of the rid before the consumer
            ok = disj(*[conj(d.exists, lt(d, c)) for d in mine])
            yield implies(c.exists, ok), [c, *mine]
            continue
        fails = [f for f in failures if f.rid == c.rid]
        for s in (s for s in sends if s.rid == c.rid):
            ok = disj(
                *[conj(d.exists, lt(d, c), _matches(d, s)) for d in mine], *_ended(s, fails, c)
            )
            yield implies(conj(s.exists, c.exists, lt(s, c)), ok), [s, c, *mine, *fails]
    for s in sends:  # every send completes (or fails), by the end
        mine = [d for d in dones if d.rid == s.rid]
        fails = [f for f in failures if f.rid == s.rid]
        ok = disj(*[conj(d.exists, _matches(d, s)) for d in mine], *_ended(s, fails))
        yield implies(s.exists, ok), [s, *mine, *fails]
    for d in dones if sends else ():  # a completion completes an earlier send
        mine = [s for s in sends if s.rid == d.rid]
        yield (
            implies(d.exists, disj(*[conj(s.exists, lt(s, d), _matches(d, s)) for s in mine])),
            [d, *mine],
        )
