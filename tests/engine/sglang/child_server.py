"""A stand-in for `sglang.launch_server` in tests: like SGLang, it runs its scheduler in a child process
started with the spawn method, and that child runs SGLang's real decode loop (a conformance scenario)
without tracing anything itself: the adapter must get there through PDO_SGLANG_TRACE_DIR alone."""

import multiprocessing
import sys

from engine.sglang import hooks, load
from engine.sglang.conform import decode_scenarios


def scheduler_process(mode: str) -> None:
    sgl = load()  # importing SGLang's scheduler is what installs the adapter in this process
    assert hooks.active() is not None, "the adapter is not active in the scheduler process"
    decode_scenarios.Harness(sgl, decode_scenarios.SCRIPTS["decode-arrivals"], mode).run(None)
    hooks.active().close()


if __name__ == "__main__":
    assert "sglang" not in sys.modules
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(
        target=scheduler_process, args=(sys.argv[1] if len(sys.argv) > 1 else "normal",)
    )
    child.start()
    child.join(120)
    sys.exit(child.exitcode)
