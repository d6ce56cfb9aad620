import os
import sys

# Interpreter mode for Triton kernels on CPU; must be set before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


import pytest  # noqa: E402

# The quick loop (README: `pytest -n auto -m "not heavy"`) leaves out what takes most of the suite's
# time and is about the edges, not the engine's core: SGLang's releases, the schedule-fuzz
# campaigns, the GPU script and the Triton compile, and the z3 model's proofs (bounded and
# unbounded).
HEAVY = (
    "tests/engine/sglang/",
    "tests/checker/fuzz/",
    "tests/test_gpu_script.py",
    "tests/triton_kernels/test_triton_compile_sm90.py",
    "tests/spec/test_unbounded.py",
    "tests/spec/test_decode_unbounded.py",
    "tests/spec/test_spec_model.py",
)


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath) + os.sep
    for item in items:
        if str(item.path).removeprefix(root).startswith(HEAVY):
            item.add_marker(pytest.mark.heavy)


# Refinement of the engine's traces (issue #19): the fixture `refined` checks each prefill or decode
# trace the engine writes during a test (Tracer.write, or streamed by Tracer.stream) against the
# loop model of its mode, or the decode loop model, when the test ends (a decode trace the model
# leaves out is UNKNOWN, not judged). The loop tests ask for it (`pytestmark`); tests/engine/
# test_refinement.py refines a trace of every loop and feature. A mutant's trace (header `inject`)
# may drift on purpose and is left to the tests about it; a trace the test deleted or rewrote is
# skipped.


@pytest.fixture
def refined(monkeypatch):
    from engine.trace.tracer import Tracer
    from tests.refinement import ROLES, drift

    written: list[str] = []

    def recorded(method):
        def wrapper(self, path, **kw):
            method(self, path, **kw)
            if self.header.get("role") in ROLES and not self.header.get("inject"):
                written.append(str(path))

        return wrapper

    # a whole trace at once, or streamed (the flight recorder): judged once the test is over
    monkeypatch.setattr(Tracer, "write", recorded(Tracer.write))
    monkeypatch.setattr(Tracer, "stream", recorded(Tracer.stream))
    yield written
    drifts = [d for d in (drift(p) for p in dict.fromkeys(written)) if d]
    assert not drifts, "refinement: the engine wrote a trace its loop model does not admit\n" + (
        "\n".join(drifts)
    )
