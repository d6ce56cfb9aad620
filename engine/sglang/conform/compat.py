"""What one SGLang release's classes accept, found by looking at the release itself.

The harnesses build SGLang's own objects (pools, queues, the weight updater) with the keyword
arguments of the newest release; `make` passes a class only those its constructor declares, so a
release that has not grown an argument yet is built all the same (and one that requires an argument
the harness does not know raises, naming it). The few names that moved between modules are in one
table, MOVED, newest place first.
"""

from __future__ import annotations

import importlib
import inspect

# name -> the modules that define it, newest release's first
MOVED: dict[str, tuple[str, ...]] = {
    "ComponentType": (
        "sglang.srt.mem_cache.unified_cache.components",  # 0.5.17 and later
        "sglang.srt.mem_cache.unified_cache_components",  # up to 0.5.16
    )
}


def lookup(name: str):
    """The class or function `name` from the first module of MOVED[name] this release has."""
    for module in MOVED[name]:
        try:
            return getattr(importlib.import_module(module), name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"{name}: none of {', '.join(MOVED[name])}")


def accepted(target, kwargs: dict) -> dict:
    """The entries of `kwargs` that `target` (a class or a function) declares as parameters."""
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def make(cls, **kwargs):
    """cls(**kwargs), less the keyword arguments this release's cls does not take."""
    return cls(**accepted(cls, kwargs))
