"""The SGLang adapter: pdo-trace events from SGLang's own scheduler code (docs/sglang.md).

Hooks are installed on SGLang's real classes at run time (their methods wrapped, never their files
edited); each wrapper reads SGLang's state and logs the ordering point with the vocabulary of the
reference engine, so `pdo check` judges SGLang's traces with the same rules. Only the SGLang versions
in KNOWN_VERSIONS are hooked: the hooks name methods and attributes of those versions, and on any
other version they would observe nothing, or the wrong thing, without saying so.

    load()          import SGLang's scheduler modules (the CPU workaround below), check the version
    hooks.install   wrap the methods (engine/sglang/decode.py, engine/sglang/prefill.py)
    boot/           installs the hooks in every process of a real server (PDO_SGLANG_TRACE_DIR)
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types

KNOWN_VERSIONS = ("0.5.23",)
MODULES = (
    "sglang.srt.disaggregation.decode",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.common.conn",
    "sglang.srt.managers.scheduler",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.runtime_context",
)


class SGLangUnavailable(Exception):
    """SGLang is not installed, or not a version the adapter knows (one line, for the user)."""


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version() -> str:
    version = installed_version()
    if version is None:
        raise SGLangUnavailable("SGLang is not installed (bash scripts/setup.sh installs 0.5.23)")
    if version not in KNOWN_VERSIONS:
        raise SGLangUnavailable(
            f"SGLang {version} is not a version the adapter knows "
            f"({', '.join(KNOWN_VERSIONS)}): its hooks name that version's methods"
        )
    return version


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
    (disaggregation.utils), .runtime_context, .version."""
    version = check_version()
    _define_torchvision_ops()
    mods = [importlib.import_module(m) for m in MODULES]
    return types.SimpleNamespace(
        decode=mods[0],
        prefill=mods[1],
        conn=mods[2],
        scheduler=mods[3],
        decode_utils=mods[4],
        runtime_context=mods[5],
        version=version,
    )
