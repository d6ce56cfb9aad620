"""RunSpec: its JSON round-trip, the refusal of bad input, and its record in a trace header."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.decode.config import DecodeConfig
from engine.runs.spec import Kill, RunSpec, WatchdogSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from spec.errors import BadInput

ROOT = Path(__file__).resolve().parents[3]
SPEC = RunSpec(
    EngineConfig(mode="thread", inject=frozenset({"live-batch", "two-forwards"})),
    WorkloadConfig(requests=5, prompt_len=(8, 40), arrival="poisson", seed=3),
    DecodeConfig(loop="normal", prefetch=False),
    dp=3,
    router="random",
    kill=Kill("prefill1", 2),
    trace_path="t.jsonl",
    watchdog=WatchdogSpec(0.5, "stop"),
    verify=False,
)


def test_json_round_trip_gives_the_same_spec():
    data = SPEC.to_json()
    assert RunSpec.from_json(data) == SPEC
    assert json.loads(data)["engine"]["inject"] == ["live-batch", "two-forwards"]  # sorted


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.update(dpp=2), "`dpp` - at `$`"),
        (lambda d: d["engine"].update(mod="ahead"), "`mod` - at `$.engine`"),
        (lambda d: d["kill"].update(at="2"), "got `str` - at `$.kill.at`"),
        (lambda d: d.update(router="nearest"), "at `$.router`"),
        (lambda d: d["workload"].update(prompt_len=[1, 2, 3]), "at `$.workload.prompt_len`"),
        (lambda d: d["engine"].update(mode="sideways"), "unknown mode 'sideways'"),
    ],
)
def test_a_bad_field_is_refused_on_one_line_naming_it(edit, field):
    d = json.loads(SPEC.to_json())
    edit(d)
    with pytest.raises(BadInput) as err:
        RunSpec.from_json(json.dumps(d), "s.json")
    assert str(err.value).startswith("s.json: ") and field in str(err.value)
    assert "\n" not in str(err.value)


def test_header_round_trip_gives_back_the_recorded_run():
    header = {"role": "decode", "dp_size": SPEC.dp, **SPEC.to_header(pd=True, unrecorded=["x"])}
    header = json.loads(json.dumps(header))  # as read back from the file
    assert header["pd_run"]["unrecorded"] == ["x"]
    back = RunSpec.from_header(header, "t.jsonl")
    # what a header records: everything but where the trace went, the checks and the time bound
    assert back == RunSpec(
        SPEC.engine, SPEC.workload, SPEC.decode, dp=3, router="random", kill=SPEC.kill
    )
    prefill_only = SPEC.to_header(pd=False)
    assert set(prefill_only) == {"config", "workload"}
    assert RunSpec.from_header(prefill_only, "p.jsonl").engine == SPEC.engine
    with pytest.raises(BadInput, match="lacks 'config'"):
        RunSpec.from_header({"role": "prefill"}, "p.jsonl")


def test_a_launch_process_refuses_a_bad_spec_file_with_exit_2(tmp_path):
    d = json.loads(SPEC.to_json())
    d["decode"]["loop"] = 3
    (tmp_path / "spec.json").write_text(json.dumps(d))
    argv = ["--spec", str(tmp_path / "spec.json"), "--bootstrap", "http://127.0.0.1:9"]
    r = subprocess.run(
        [sys.executable, "-m", "engine.runs.pd_process", "decode", *argv, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"decode: error: {tmp_path / 'spec.json'}: Expected `str`, got `int` - at `$.decode.loop`"
    ]
