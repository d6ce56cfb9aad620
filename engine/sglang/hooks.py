"""Installing and removing the adapter's wrappers on SGLang's classes.

A wrapper observes: it may read SGLang's objects before and after the real call, and log events to the
active sink; it passes the arguments through unchanged and returns what the real function returned.
With no active sink, a wrapper is a plain call. `ran` records the qualified names of the real SGLang
functions that were called while a sink was active (the `sglang_functions` of `pdo conform --json`).

A hook attaches only where its target exists, with the parameters the wrapper reads (`params`): SGLang
renames, splits and adds methods from release to release, and a wrapper on the wrong target would log
the wrong thing without saying so. `attached` records each hook's outcome; `report()` is its one line.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import wrapt

from engine.sglang.sink import TraceSink

_active: TraceSink | None = None
_installed: list[tuple[object, str, object]] = []  # (owner, name, the attribute as it was)
ran: dict[str, int] = {}
attached: dict[str, str] = {}  # "Owner.name" -> "attached" or why not ("absent", "signature (...)")
_local = threading.local()


def active() -> TraceSink | None:
    return _active


@contextlib.contextmanager
def tracing(sink: TraceSink):
    """Route the hooks' events to `sink` for the duration of the block."""
    global _active
    previous, _active = _active, sink
    try:
        yield sink
    finally:
        _active = previous
        sink.close()


def activate(sink: TraceSink | None) -> None:
    """Route the hooks' events to `sink` from now on, process-wide (a traced server process)."""
    global _active
    _active = sink


def qualname(fn) -> str:
    fn = getattr(fn, "__wrapped__", fn)
    return f"{fn.__module__}.{fn.__qualname__}"


def wrap(owner, name: str, around, params: tuple[str, ...] = ()) -> bool:
    """Replace owner.name by a wrapper calling around(sink, wrapped, instance, args, kwargs) when a
    sink is active; `around` must call `wrapped(*args, **kwargs)` once and return its result.
    `params`: the leading parameters (after self) the wrapper reads by position. Where owner defines
    no `name`, or its parameters differ, nothing is wrapped and `attached` says why; returns whether
    the hook attached."""
    key = f"{owner.__qualname__}.{name}"
    original = owner.__dict__.get(name, _ABSENT)
    why = "absent" if original is _ABSENT else _signature_mismatch(original, params)
    attached[key] = why or "attached"
    if why:
        return False
    label = f"{owner.__module__}.{owner.__qualname__}.{name}"

    def wrapper(wrapped, instance, args, kwargs):
        sink = _active
        if sink is None:
            return wrapped(*args, **kwargs)
        ran[label] = ran.get(label, 0) + 1
        return around(sink, wrapped, instance, args, kwargs)

    wrapt.wrap_function_wrapper(owner, name, wrapper)
    _installed.append((owner, name, original))
    return True


def _signature_mismatch(target, params: tuple[str, ...]) -> str | None:
    if not params:
        return None
    fn = getattr(target, "__func__", target)
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        return "signature (unreadable)"
    names = names[1:] if names and names[0] in ("self", "cls") else names
    have = tuple(names[: len(params)])
    return None if have == tuple(params) else f"signature ({', '.join(have)})"


def mark(key: str, why: str | None) -> None:
    """Record a hook that is not a method wrap (a property, a proxy): attached, or why not."""
    attached[key] = why or "attached"


def report() -> str:
    """One line: how many hooks attached, and each that did not, with why."""
    missing = [f"{k} ({v})" for k, v in attached.items() if v != "attached"]
    line = f"hooks: {len(attached) - len(missing)}/{len(attached)} attached"
    return line + (f"; not attached: {', '.join(missing)}" if missing else "")


def is_installed() -> bool:
    return bool(_installed)


def uninstall() -> None:
    attached.clear()
    while _installed:
        owner, name, original = _installed.pop()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def context() -> list[str]:
    """The adapter's stack of hooked SGLang methods on this thread (innermost last)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def inside(name: str):
    stack = context()
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def set_attribute(owner, name: str, value) -> None:
    """Set a class attribute the adapter needs (a property observing a read), undone by uninstall."""
    _installed.append((owner, name, owner.__dict__.get(name, _ABSENT)))
    setattr(owner, name, value)


_ABSENT = object()
