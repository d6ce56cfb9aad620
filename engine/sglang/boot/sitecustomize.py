"""Installs the pdo adapter in every Python process of an SGLang server (docs/sglang.md).

`python -m engine.sglang.launch` puts this folder first on PYTHONPATH and sets PDO_SGLANG_TRACE_DIR, so
every process SGLang spawns (its schedulers run in child processes) runs this at start-up. It imports
nothing heavy: the hooks go in when SGLang's scheduler module is first imported. Any other
sitecustomize on the path still runs, after this one.
"""

import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("PDO_SGLANG_TRACE_DIR"):
    try:
        from engine.sglang import autoinstall

        autoinstall.when_sglang_imported(os.environ["PDO_SGLANG_TRACE_DIR"])
    except Exception as exc:  # noqa: BLE001 - never stop the server from starting
        print(
            f"pdo: the SGLang adapter was not installed: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here]
)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
