"""The layers of the code, as data: which package may import which (docs/architecture.md explains them).

A module belongs to the layer of the longest prefix that names it. An import whose target's layer is not
in the importer's allowed set is a back-edge; tests/test_layers.py fails on one, and on any import cycle.
"""

from __future__ import annotations

# layer: (packages, layers its modules may import besides their own). Each engine package is a layer of
# its own: the order below is the order of docs/architecture.md, lowest first. The vocabulary (loop
# modes, thread roles, event fields: spec/vocabulary.py) and the flight recorder's binary layout
# (spec/tracelog.py: one source for its writer, the engine, and its readers) are the parts of spec/
# the engine reads.
LOW = ("errors", "vocabulary", "format", "kernels")
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "errors": (("spec.errors", "engine.errors"), ()),
    "vocabulary": (("spec.vocabulary",), ("errors",)),
    "format": (("spec.tracelog",), ("errors",)),
    "kernels": (("triton_kernels",), ()),
    "spec": (("spec",), ("vocabulary", "format", "errors")),
    "checker": (("checker",), ("spec", "vocabulary", "format", "errors")),
    "sync": (("engine.sync",), LOW),
    "runtime": (("engine.runtime",), ("sync", *LOW)),
    "trace": (("engine.trace",), ("runtime", "sync", *LOW)),
    "bootstrap": (("engine.bootstrap",), ("sync", *LOW)),
    "kv": (("engine.kv",), ("bootstrap", "trace", "runtime", "sync", *LOW)),
    "oracle": (("engine.oracle",), ("runtime", "sync", *LOW)),
    "prefill": (("engine.prefill",), ("kv", "trace", "runtime", "sync", *LOW)),
    "decode": (("engine.decode",), ("kv", "bootstrap", "trace", "runtime", "sync", *LOW)),
    "runs": (
        ("engine.runs",),
        ("prefill", "decode", "oracle", "kv", "bootstrap", "trace", "runtime", "sync", *LOW),
    ),
    "sglang": (("engine.sglang",), ("bootstrap", "trace", "runtime", "sync", *LOW)),
}
ENGINE = tuple(name for name, (prefixes, _) in LAYERS.items() if prefixes[0].startswith("engine."))
LAYERS["harness"] = (("checker.fuzz", "engine.sglang.conform"), ("checker", "spec", *ENGINE, *LOW))
LAYERS["front"] = (
    (
        "engine.cli",
        "engine.bench",
        "spec.cli",
        "checker.bench",
        "checker.fuzz.cli",
        "engine.sglang.conform.cli",
    ),
    ("harness", "checker", "spec", *ENGINE, *LOW),
)


def layer_of(module: str) -> str | None:
    best, length = None, -1
    for layer, (prefixes, _) in LAYERS.items():
        for prefix in prefixes:
            hit = module == prefix or module.startswith(prefix + ".")
            if hit and len(prefix) > length:
                best, length = layer, len(prefix)
    return best


def back_edges(edges: dict[str, set[str]]) -> list[str]:
    """Each import that goes against the layers, as 'importer -> imported (layer -> layer)'."""
    found = []
    for source, targets in sorted(edges.items()):
        src = layer_of(source)
        if src is None:
            continue
        allowed = {src, *LAYERS[src][1]}
        for target in sorted(targets):
            dst = layer_of(target)
            if dst is not None and dst not in allowed:
                found.append(f"{source} -> {target} ({src} -> {dst})")
    return found
