"""The lifecycle x fault matrix (decode_life.py, prefill_life.py) on SGLang's real code: every cell
meets its expectation, and real-code mutations of the bug classes it exists for are flagged by it.

By default a slice runs (every state, with no fault and with one fault, under one loop); PDO_SLOW=1
runs every cell under both loops."""

from __future__ import annotations

import os

import pytest

sglang_adapter = pytest.importorskip("engine.sglang")
try:
    sglang_adapter.check_version()
except sglang_adapter.SGLangUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)

from engine.sglang.conform import decode_life, driver, faults, lifecycle, mutants, prefill_life  # noqa: E402

SLOW = os.environ.get("PDO_SLOW") == "1"
# a fault per state, rotating so that each fault is tried somewhere in the slice
_DECODE_SLICE = {
    f"{decode_life.Cell(state, fault).name}/{mode}"
    for i, state in enumerate(decode_life.State)
    for fault, mode in (
        (None, "normal"),
        (list(faults.Fault)[i % len(faults.Fault)], ("normal", "overlap")[i % 2]),
    )
}
_PREFILL_SLICE = {
    f"{prefill_life.PCell(state, fault).name}/{mode}"
    for i, state in enumerate(prefill_life.PState)
    for fault, mode in (
        (None, "overlap"),
        (list(faults.Fault)[(2 * i) % len(faults.Fault)], ("normal", "overlap")[i % 2]),
        (list(faults.Fault)[(2 * i + 1) % len(faults.Fault)], ("overlap", "normal")[i % 2]),
    )
}


@pytest.fixture(scope="module")
def sgl():
    return driver.session()


@pytest.fixture(scope="module")
def cells(sgl):
    return dict(decode_life.scenarios(sgl) + prefill_life.scenarios())


def _names():
    if SLOW:
        decode = [f"{c.name}/{m}" for c in decode_life.CELLS for m in ("normal", "overlap")]
        prefill = [f"{c.name}/{m}" for c in prefill_life.CELLS for m in ("normal", "overlap")]
        return decode + prefill
    return sorted(_DECODE_SLICE | _PREFILL_SLICE)


def test_the_matrix_covers_every_state_and_fault(sgl):
    names = {name for name, _ in driver.all_scenarios(sgl)}
    for state in decode_life.State:
        for fault in (None, *faults.Fault):
            assert f"{decode_life.Cell(state, fault).name}/overlap" in names
    for state in prefill_life.PState:
        for fault in (None, *faults.Fault):
            assert f"{prefill_life.PCell(state, fault).name}/normal" in names
    # the slice tries every fault on each side
    for side in (_DECODE_SLICE, _PREFILL_SLICE):
        assert {n.split("/")[2] for n in side} == {"none", *(f.value for f in faults.Fault)}


@pytest.mark.parametrize("name", _names())
def test_cell_meets_its_expectation(sgl, cells, tmp_path, name):
    result = driver.run_scenario(sgl, name, cells[name], str(tmp_path))
    assert result["error"] is None, result["error"]
    assert result["violations"] == {}
    assert driver.met(result), result


_LIFECYCLE_MUTANTS = [
    "abort-without-clear",
    "idle-ignores-prealloc",
    "failed-transfer-not-aborted",
    "prefill-failed-transfer-dropped",
    "idle-ignores-inflight",
]


@pytest.mark.parametrize("name", _LIFECYCLE_MUTANTS)
def test_the_matrix_flags_a_bug_class(sgl, cells, tmp_path, name):
    mutant = mutants.DECODE_MUTANTS[name]
    results = [
        driver.run_scenario(sgl, s, cells[s], str(tmp_path), mutant) for s in mutant.scenarios
    ]
    assert all(r["outcome"] == "flagged" for r in results), results
    # the oracle itself caught it, not only a rule or SGLang's own leak check
    assert all(any(k.startswith("oracle:") for k in r["rules"]) for r in results), results


def test_ledger_flags_double_end_double_free_and_use_after_clear():
    pools = type("Pools", (), {})()
    pools.req_to_token_pool = type("P", (), {"free_slots": [1, 2, 2]})()
    pools.token_to_kv_pool_allocator = type("A", (), {"free_pages": [5, 6]})()
    pools.req_to_metadata_buffer_idx_allocator = type("M", (), {"free_slots": [0, 1]})()

    class Endpoint:
        label, cleared, misuse = "room 9's receiver", 2, ["poll after clear"]

        def in_flight(self):
            return (1, [6], 0)  # slot 1, page 6, metadata 0: all three on the free lists

    ledger = lifecycle.Ledger(pools)
    ledger.admitted |= {"a", "b"}
    ledger.end("a")
    ledger.end("a")
    ledger.check([Endpoint()], idle=True, where="here")
    with pytest.raises(lifecycle.Violations) as info:
        ledger.finish([Endpoint()], {"slot": 2, "page": 2, "metadata": 2})
    found = info.value.found
    assert set(found) == {
        "ends-once",
        "freed-once",
        "cleared-once",
        "held-while-writing",
        "idle-right",
    }
    assert "b never ended" in found["ends-once"] and "a ended 2 times" in found["ends-once"]
