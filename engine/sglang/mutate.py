"""Mutations of SGLang's real code, made at run time: a function's own source, rewritten by an AST
transform and compiled into the function's module globals, swapped in for one scenario.

    mutated(func, transform)             the rewritten function (SGLang's files are never touched)
    swapped(owner, name, value)          a context manager: owner.name is `value` inside the block
    mutation(owner, name, transform)     both: the method rewritten and swapped in, under the adapter's
                                         wrapper when one is installed (so its hooks still log)
    MoveStatement(moved, anchor)         a transform: the statement whose source starts with `moved`
                                         goes just before (or after) the one starting with `anchor`

A mutant is a check on the checker: a reordering the rules forbid must be reported when SGLang's own
loop makes it.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import inspect
import textwrap

import wrapt

from spec.errors import InternalError

_FUTURE_FLAGS = 0
for _name in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _name).compiler_flag


class MutationError(InternalError):
    """The transform could not be applied (its target is not in the function's source)."""


def _innermost(func):
    return inspect.unwrap(func)


def mutated(func, transform: ast.NodeTransformer):
    """`func` compiled again from its source after `transform` rewrote it: same module globals, same
    closure values, same decorators (they are part of the source and applied again), same file and
    line numbers (tracebacks point into the real file). Raises MutationError when the transform
    leaves the function unchanged."""
    raw = _innermost(func)
    lines, first = inspect.getsourcelines(raw)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fdef = tree.body[0]
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise MutationError(f"{raw.__qualname__}: its source is not a function definition")
    before = ast.dump(fdef)
    fdef = transform.visit(fdef)
    if fdef is None or ast.dump(fdef) == before:
        raise MutationError(f"{type(transform).__name__} changed nothing in {raw.__qualname__}")
    # The function is defined inside a factory whose parameters are its free variables (the closure
    # cells, `__class__` for a zero-argument super()), so the new function closes over the same values.
    freevars = raw.__code__.co_freevars
    extra = {"type_params": []} if "type_params" in ast.FunctionDef._fields else {}
    factory = ast.FunctionDef(
        name="__pdo_mutant_factory__",
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg(arg=v) for v in freevars],
            vararg=None,
            kwonlyargs=[],
            kw_defaults=[],
            kwarg=None,
            defaults=[],
        ),
        body=[fdef, ast.Return(value=ast.Name(id=fdef.name, ctx=ast.Load()))],
        decorator_list=[],
        returns=None,
        **extra,
    )
    module = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(module)
    ast.increment_lineno(module, first - 1)
    flags = raw.__code__.co_flags & _FUTURE_FLAGS
    code = compile(
        module, inspect.getsourcefile(raw) or "<mutant>", "exec", flags=flags, dont_inherit=True
    )
    namespace: dict = {}
    exec(code, raw.__globals__, namespace)  # noqa: S102 (SGLang's own source, rewritten)
    cells = [c.cell_contents for c in (raw.__closure__ or ())]
    new = namespace["__pdo_mutant_factory__"](*cells)
    new.__qualname__ = getattr(func, "__qualname__", raw.__qualname__)
    new.__pdo_mutant_of__ = raw
    return new


@contextlib.contextmanager
def swapped(owner, name: str, value):
    """owner.name is `value` inside the block, and what it was (in owner's own __dict__, or inherited)
    afterwards."""
    missing = object()
    old = owner.__dict__.get(name, missing)
    setattr(owner, name, value)
    try:
        yield value
    finally:
        if old is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, old)


def mutation(owner, name: str, transform: ast.NodeTransformer):
    """A context manager running owner.name rewritten by `transform`. When the attribute is a wrapt
    wrapper (the adapter's hooks), the mutant goes under the same wrapper."""
    current = inspect.getattr_static(owner, name)
    target = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
    new = mutated(target, transform)
    if isinstance(current, wrapt.FunctionWrapper):
        new = wrapt.FunctionWrapper(new, current._self_wrapper)
    elif isinstance(current, staticmethod):
        new = staticmethod(new)
    elif isinstance(current, classmethod):
        new = classmethod(new)
    return swapped(owner, name, new)


def _source(stmt: ast.stmt) -> str:
    return ast.unparse(stmt).strip()


class MoveStatement(ast.NodeTransformer):
    """Move the first statement whose source starts with `moved` to just before (after=False) or after
    the first statement starting with `anchor` in the same block. Exactly one move is made; the
    number of moves is kept in `.moves`."""

    def __init__(self, moved: str, anchor: str, *, after: bool = False):
        self.moved, self.anchor, self.after = moved, anchor, after
        self.moves = 0

    def generic_visit(self, node):
        node = super().generic_visit(node)
        if self.moves:
            return node
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                self._move(block)
        return node

    def _move(self, block: list) -> None:
        i = next((k for k, s in enumerate(block) if _source(s).startswith(self.moved)), None)
        j = next((k for k, s in enumerate(block) if _source(s).startswith(self.anchor)), None)
        if i is None or j is None or i == j:
            return
        stmt = block.pop(i)
        j = next(k for k, s in enumerate(block) if _source(s).startswith(self.anchor))
        block.insert(j + 1 if self.after else j, stmt)
        self.moves += 1


__all__ = ["MutationError", "MoveStatement", "mutated", "mutation", "swapped"]
