"""Every loop refines its model on a trace of each feature it has: the four prefill loops with chunked
prefill, prefix hits, memory pressure and Poisson arrival, and the two decode loops, with and without
the DP-rank prefetch, behind one and two prefill ranks (the loop tests also refine the traces they
write: the fixture `refined` of tests/conftest.py). A trace the model does not admit fails with the
step where the loop left it; one the model leaves out is not a pass (`judged` is asserted)."""

from __future__ import annotations

import pytest

from checker.refine import check_model, text
from engine.cli import main as pdo

PREFILL_FEATURES = {
    "chunked": ["--chunk-size", "32", "--prompt-len", "40:150"],
    "hits": ["--hit", "0.8", "--groups", "2"],
    "pressure": ["--num-pages", "48", "--page-size", "4", "--prompt-len", "20:60"],
    "poisson": ["--arrival", "poisson", "--rate", "400"],
}


def _run(tmp_path, name: str, args: list[str]) -> list[str]:
    path = tmp_path / f"{name}.jsonl"
    rc = pdo(["run", "--requests", "10", "--no-verify", "--trace", str(path), *args])
    assert rc == 0, (name, rc)
    return sorted(str(p) for p in tmp_path.glob(f"{name}*.jsonl"))


def _assert_refines(paths: list[str]) -> None:
    assert paths
    for path in paths:
        check = check_model(path, timeout_ms=60_000)
        assert check.judged and check.ok, f"{path}\n{text(check)}"


@pytest.mark.parametrize("feature", sorted(PREFILL_FEATURES))
@pytest.mark.parametrize("mode", ["normal", "overlap", "thread", "ahead"])
def test_each_prefill_loop_refines_its_model(tmp_path, mode, feature):
    _assert_refines(_run(tmp_path, "p", ["--mode", mode, *PREFILL_FEATURES[feature]]))


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_each_decode_loop_refines_its_model(tmp_path, loop, prefetch, dp):
    args = ["--pd", "--dp", str(dp), "--decode-mode", loop, "--max-new-tokens", "4"]
    _assert_refines(_run(tmp_path, "pd", args + ([] if prefetch else ["--no-prefetch"])))
