"""The adapter inside a real SGLang process: one trace file per process, written as it goes.

`when_sglang_imported(trace_dir)` registers a post-import hook: once SGLang's scheduler module is
imported, the version is checked, the hooks are installed and a process-wide sink is made active. The
file is `<trace_dir>/sglang-<pid>.jsonl`; its header (written when the process's scheduler loop starts)
names the role and the loop mode.
"""

from __future__ import annotations

import os
import sys

import wrapt

from engine.sglang import SGLangUnavailable, decode, hooks, load, prefill
from engine.sglang.sink import TraceSink

TRIGGER = "sglang.srt.managers.scheduler"


def trace_path(trace_dir: str, pid: int | None = None) -> str:
    return os.path.join(trace_dir, f"sglang-{pid or os.getpid()}.jsonl")


def install_now(trace_dir: str) -> TraceSink:
    sgl = load()
    if not hooks.is_installed():
        decode.install(sgl)
        prefill.install(sgl)
    sink = TraceSink(trace_path(trace_dir))
    hooks.activate(sink)
    return sink


def when_sglang_imported(trace_dir: str) -> None:
    def on_import(_module):
        try:
            install_now(trace_dir)
        except SGLangUnavailable as exc:
            print(f"pdo: {exc}; this process is not traced", file=sys.stderr)

    wrapt.register_post_import_hook(on_import, TRIGGER)
