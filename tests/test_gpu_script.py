"""scripts/gpu-bench.sh, the one prepared script for a GPU machine, checked here on the CPU: every step
runs tiny (`--cpu-smoke`: the Triton kernels through the interpreter, torch attention in the
benchmarks), each trace passes `pdo check`, and every result file comes out. The GPU figures
themselves need a GPU (docs/benchmarks.md)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_bench_script_runs_every_step_on_cpu(tmp_path):
    # without TRITON_INTERPRET: on a CPU torch the kernels pick the interpreter themselves
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHON"] = sys.executable
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu-bench.sh"), "--cpu-smoke", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = (tmp_path / "summary.txt").read_text()
    assert r.returncode == 0, log[-4000:] + r.stderr[-2000:]
    assert "0 step(s) failed" in log and "skipped" not in log
    assert (
        log.count("== 1. check") == 4 and log.count("attention=triton") == 5
    )  # four loops + the larger run
    assert log.count("PASS ") == 5 + 4  # + the PD run's decode, two prefill and cross checks
    assert "pdo run --pd: dp=2" in log and "outputs vs single-process reference: identical" in log
    assert "leaks: none; traces: " in log and log.count("(cross, mode=overlap)") == 1
    for name in (
        "bench-prefill.json",
        "bench-prefill.png",
        "bench-prefill-big.json",
        "bench-prefill-big.png",
        "trace-overhead.json",
        "kernels.json",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    res = json.loads((tmp_path / "bench-prefill.json").read_text())
    assert (
        res["device"] == "cpu"
        and res["attention_backend"] == "torch"
        and res["modes"] == ["thread", "ahead"]
    )
    big = json.loads((tmp_path / "bench-prefill-big.json").read_text())
    assert big["engine"]["max_batch_tokens"] == 64
    assert not list(tmp_path.glob("*.jsonl"))  # checked traces are not kept
