"""Installing and removing the adapter's wrappers on SGLang's classes.

A wrapper observes: it may read SGLang's objects before and after the real call, and log events to the
active sink; it passes the arguments through unchanged and returns what the real function returned.
With no active sink, a wrapper is a plain call. `ran` records the qualified names of the real SGLang
functions that were called while a sink was active (the `sglang_functions` of `pdo conform --json`).
"""

from __future__ import annotations

import contextlib
import threading

import wrapt

from .sink import TraceSink

_active: TraceSink | None = None
_installed: list[tuple[object, str, object]] = []  # (owner, name, the attribute as it was)
ran: dict[str, int] = {}
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


def wrap(owner, name: str, around) -> None:
    """Replace owner.name by a wrapper calling around(sink, wrapped, instance, args, kwargs) when a
    sink is active; `around` must call `wrapped(*args, **kwargs)` once and return its result."""
    original = owner.__dict__[name]
    label = f"{owner.__module__}.{owner.__qualname__}.{name}"

    def wrapper(wrapped, instance, args, kwargs):
        sink = _active
        if sink is None:
            return wrapped(*args, **kwargs)
        ran[label] = ran.get(label, 0) + 1
        return around(sink, wrapped, instance, args, kwargs)

    wrapt.wrap_function_wrapper(owner, name, wrapper)
    _installed.append((owner, name, original))


def is_installed() -> bool:
    return bool(_installed)


def uninstall() -> None:
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
