"""Static-or-symbolic logic: the formula builders every encoding, loop model and query uses.

In a trace most facts (thread, obj, slot) are plain Python values; in the model they are z3 terms.
These helpers fold Python booleans away so the trace encodings stay small, and build z3 terms
through the C API directly: the Python API's argument coercion is most of the time spent on a long
trace.
"""

from __future__ import annotations

import z3

_CTX = z3.main_ctx()


def is_term(x) -> bool:
    """x is a z3 term (not a plain Python value)."""
    return isinstance(x, z3.ExprRef)


def _bool(ast):
    return z3.BoolRef(ast, _CTX)


def _nary(mk, xs):
    return _bool(mk(_CTX.ref(), len(xs), (z3.Ast * len(xs))(*[x.as_ast() for x in xs])))


def conj(*xs):
    out = []
    for x in xs:
        if x is True:
            continue
        if x is False:
            return False
        out.append(x)
    return True if not out else out[0] if len(out) == 1 else _nary(z3.Z3_mk_and, out)


def disj(*xs):
    out = []
    for x in xs:
        if x is False:
            continue
        if x is True:
            return True
        out.append(x)
    return False if not out else out[0] if len(out) == 1 else _nary(z3.Z3_mk_or, out)


def neg(x):
    return (not x) if isinstance(x, bool) else _bool(z3.Z3_mk_not(_CTX.ref(), x.as_ast()))


def implies(a, b):
    if a is False or b is True:
        return True
    if a is True:
        return b
    if b is False:
        return neg(a)
    return _bool(z3.Z3_mk_implies(_CTX.ref(), a.as_ast(), b.as_ast()))


def eq(a, b):
    """Python == on plain values (a bool), z3 == as soon as one side is a term."""
    return a == b


def as_z3(x):
    return z3.BoolVal(x) if isinstance(x, bool) else x


def lt(a, b):
    """a happened before b: their positions compared (and the pair noted where the universe keeps
    the compared pairs, for the frame's distinctness)."""
    if a.cmp is not None:
        a.cmp.add((a, b))
    return _bool(z3.Z3_mk_lt(_CTX.ref(), a.pos.as_ast(), b.pos.as_ast()))
