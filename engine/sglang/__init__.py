"""The SGLang adapter: pdo-trace events from SGLang's own scheduler code (docs/sglang.md).

Hooks are installed on SGLang's real classes at run time (their methods wrapped, never their files
edited); each wrapper reads SGLang's state and logs the ordering point with the vocabulary of the
reference engine, so `pdo check` judges SGLang's traces with the same rules. The supported releases are
a declared range (versions.SUPPORTED); a release below it is refused, one above it runs with a
warning, and on every release each hook attaches only where its target exists with the parameters it
reads (hooks.attach; hooks.report() is the one line that says which did not).

    load()          import SGLang's scheduler modules (the CPU workaround below), check the version
    decode.install, prefill.install   attach the hooks
    versions        the supported range; several releases installed side by side
    boot/           installs the hooks in every process of a real server (PDO_SGLANG_TRACE_DIR)
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types

from spec.errors import BadInput

MODULES = (
    "sglang.srt.disaggregation.decode",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.common.conn",
    "sglang.srt.managers.scheduler",
    "sglang.srt.disaggregation.utils",
)
OPTIONAL_MODULES = ("sglang.srt.runtime_context",)  # from 0.5.17


class SGLangUnavailable(BadInput):
    """SGLang is not installed, or below the supported range (one line, for the user)."""


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version() -> str:
    from engine.sglang import (
        versions,  # lazy: `python -m engine.sglang.versions` runs it as __main__
    )

    version = installed_version()
    if version is None:
        raise SGLangUnavailable(
            "SGLang is not installed (bash scripts/setup.sh --test installs it; "
            "python -m engine.sglang.versions install V adds release V)"
        )
    if versions.position(version) == "below":
        raise SGLangUnavailable(
            f"SGLang {version} is below the supported range ({versions.range_text()})"
        )
    return version


def range_warning(version: str) -> str | None:
    """The warning for a release newer than the range: it runs, and the attach line says what held."""
    from engine.sglang import versions  # lazy: as in check_version

    if versions.position(version) != "above":
        return None
    return (
        f"SGLang {version} is newer than the supported range ({versions.range_text()}): "
        "hooks attach where their targets still exist"
    )


def _define_torchvision_ops() -> None:
    """PyPI's torchvision is built against CUDA torch: beside a CPU torch its C extension fails to load,
    and its import then registers fake kernels for two operators only that extension defines, which
    raises. Defining the two schemas (never their kernels) lets the import through; SGLang imports
    torchvision for image preprocessing, which the scheduler paths never run."""
    import torch  # lazy: `pdo` and the version check start without torch

    if hasattr(torch.ops, "torchvision") and hasattr(torch.ops.torchvision, "nms"):
        return
    try:
        import torchvision  # noqa: F401  (lazy: the probe itself; a working build: nothing to do)

        return
    except RuntimeError:
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(lib)  # a Library object undoes its definitions when collected
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]


_KEEP: list = []


def load() -> types.SimpleNamespace:
    """SGLang's scheduler modules, imported once: .decode, .prefill, .conn, .scheduler, .decode_utils
    (disaggregation.utils), .runtime_context (None before 0.5.17), .version."""
    version = check_version()
    _define_torchvision_ops()
    mods = [importlib.import_module(m) for m in MODULES]
    return types.SimpleNamespace(
        decode=mods[0],
        prefill=mods[1],
        conn=mods[2],
        scheduler=mods[3],
        decode_utils=mods[4],
        runtime_context=_optional(OPTIONAL_MODULES[0]),
        version=version,
    )


def _optional(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None
