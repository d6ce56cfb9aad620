"""A scenario whose trace did not reach its end is never counted as conforming: the rules that need
the end of the run (engine/sglang/conform/driver.py, `incomplete`) were not judged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.sglang import sink as trace_sink
from engine.sglang.conform import driver
from engine.sglang.sink import LoopExit, TraceSink

NAME = "prefill-chunked/normal"  # a scenario expected to conform on 0.5.23


@pytest.fixture(autouse=True)
def _poll_hook_attached(monkeypatch):
    monkeypatch.setattr(trace_sink, "COMPLETIONS_OBSERVED", [True])


def _scenario(end):
    """A run that writes a prefill trace with one batch, whose loop ends by `end`, and swallows it
    (as a harness may)."""

    def run(path, fuzz_seed=None):
        sink = TraceSink(path)
        sink.begin("prefill", "normal", 4)
        try:
            with sink.ends_with_loop():
                sink.emit("admit", batch=0, rids=["r"], chunks={"r": [0, 4]})
                raise end
        except BaseException:
            pass
        finally:
            sink.close()

    return run


def test_a_trace_cut_by_an_exception_is_not_a_pass(tmp_path):
    sgl = SimpleNamespace(version="0.5.23")
    result = driver.run_scenario(sgl, NAME, _scenario(RuntimeError("x")), str(tmp_path))
    assert result["outcome"] == "error", result
    assert "trace ended by exception" in result["error"] and "not judged" in result["error"]
    assert not driver.met(result)


def test_a_trace_ended_by_the_harness_loop_exit_is_judged_whole(tmp_path):
    sgl = SimpleNamespace(version="0.5.23")
    result = driver.run_scenario(sgl, NAME, _scenario(LoopExit()), str(tmp_path))
    assert result["error"] is None
    assert driver.incomplete(result["trace"]) is None
    # judged whole: the admitted request never sent nor released breaks the end-of-run rules
    assert result["outcome"] == "divergence" and result["rules"], result


def test_a_scenario_that_wrote_no_trace_is_not_a_pass(tmp_path):
    """Hooks that were not installed write nothing: nothing was judged."""
    sgl = SimpleNamespace(version="0.5.23")
    result = driver.run_scenario(sgl, NAME, lambda path, fuzz_seed=None: None, str(tmp_path))
    assert (result["outcome"], result["error"]) == ("error", "no trace was written")
