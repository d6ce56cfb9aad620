"""The benchmarks on tiny inputs: `pdo bench prefill` JSON fields and chart, the trace metrics
(busy times, overlap efficiency) on hand-made events, the tracing-overhead and checker-throughput
functions, the big-trace generator producing a valid trace, and progress lines."""

import io
import json

import pytest

from checker.bench import bench_checker, format_checker, make_big_trace
from checker.linear import check_file
from engine.bench.knobs import engine_workload
from engine.bench.prefill import DEFAULT_LAUNCH_COST_US, bench_prefill, run_one
from engine.bench.progress import Progress
from engine.bench.stats import pct
from engine.bench.trace_metrics import intersection, length, trace_metrics, union
from engine.bench.trace_overhead import bench_trace_overhead, emit_cost_ns, format_trace_overhead
from engine.cli import main


def _ev(seq, t_us, thread, ev, **f):
    return {"seq": seq, "t_ns": t_us * 1000, "thread": thread, "ev": ev, **f}


def test_intervals():
    u = union([(5, 7), (0, 2), (1, 3), (6, 9), (10, 10)])
    assert u == [(0, 3), (5, 9)] and length(u) == 7
    assert intersection(u, [(2, 6), (8, 20)]) == 1 + 1 + 1
    assert pct([1, 2, 3, 4], 50) == 2.5 and pct([7], 99) == 7


def test_trace_metrics_overlap_efficiency():
    # admission 0..100 overlaps fwd 50..150; processing 200..260 overlaps fwd 250..300 (us)
    evs = [
        _ev(1, 0, "scheduler", "process_end", batch=9),
        _ev(2, 50, "forward", "fwd_begin", batch=0, digest="d"),
        _ev(3, 100, "scheduler", "admit", batch=1, rids=["a"]),
        _ev(4, 150, "forward", "fwd_end", batch=0),
        _ev(5, 200, "scheduler", "process_begin", batch=0),
        _ev(6, 250, "forward", "fwd_begin", batch=1, digest="d"),
        _ev(7, 260, "scheduler", "process_end", batch=0),
        _ev(8, 300, "forward", "fwd_end", batch=1),
    ]
    m = trace_metrics(evs)
    assert m["sched_busy_ms"] == pytest.approx(0.160) and m["fwd_busy_ms"] == pytest.approx(0.150)
    assert m["admit_ms"] == pytest.approx(0.100) and m["process_ms"] == pytest.approx(0.060)
    assert m["hidden_ms"] == pytest.approx(0.060) and m["hideable_ms"] == pytest.approx(0.150)
    assert m["overlap_efficiency"] == pytest.approx(0.4) and m["batches"] == 2


def test_bench_prefill_tiny_json_and_chart(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert (
        main(
            [
                "bench",
                "prefill",
                "--reps",
                "1",
                "--requests",
                "6",
                "--hits",
                "0.8",
                "--json-out",
                str(out),
                "--png",
                str(png),
                "--launch-cost-us",
                "100",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "ahead / thread" in table and "overlap eff" in table
    res = json.loads(out.read_text())
    assert res["modes"] == ["normal", "overlap", "thread", "ahead"] and res["hits"] == [0.8]
    assert res["machine"]["cpus"] >= 1 and res["date"] and res["engine"]["launch_cost_us"] == 100
    by = {(e["hit"], e["mode"]): e for e in res["results"]}
    for mode in res["modes"]:
        e = by[(0.8, mode)]
        assert len(e["runs"]) == 1
        for key in (
            "uncached_tok_per_s",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "sched_busy_ms",
            "fwd_busy_ms",
            "overlap_efficiency",
            "hidden_ms",
            "collect_wait_ms",
        ):
            assert e["median"][key] == e["median"][key], (mode, key)  # not NaN
        assert 0.0 <= e["median"]["overlap_efficiency"] <= 1.0
        assert e["median"]["ttft_p50_ms"] <= e["median"]["ttft_p99_ms"]
    assert by[(0.8, "thread")]["ratio_vs_thread"]["median"] == 1.0
    for mode in (
        "normal",
        "overlap",
        "thread",
    ):  # admission never runs beside run_batch in these loops
        assert by[(0.8, mode)]["median"]["overlap_efficiency"] < 0.05
    assert by[(0.8, "ahead")]["median"]["hidden_ms"] > 0
    assert "0.8" in res["headline"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    # where it ran is said and recorded: the CPU here, torch attention (auto), float32
    assert "device: cpu, attention: torch" in table
    assert (
        res["device"] == "cpu"
        and res["attention_backend"] == "torch"
        and res["engine"]["dtype"] == "float32"
    )
    assert "gpu" in res["machine"]


def test_bench_prefill_device_knobs(capsys):
    """--device cuda without a GPU is a one-line error; a CUDA run's default launch cost is 0 (a GPU
    has real launches), the CPU's the emulated 1000 µs."""
    import argparse

    import torch

    a = argparse.Namespace(
        prompt_len=(24, 160),  # as its domain parses "24:160"
        device=None,
        dtype=None,
        launch_cost_us=None,
        model="tiny",
        admission_cost_us=0.0,
        max_batch_tokens=256,
        chunk_size=128,
        attention_backend="auto",
        num_pages=512,
        page_size=16,
        max_batch_reqs=16,
        groups=3,
    )
    engine, _ = engine_workload(a, DEFAULT_LAUNCH_COST_US)
    if torch.cuda.is_available():
        assert (
            engine["device"] == "cuda"
            and engine["launch_cost_us"] == 0
            and engine["dtype"] == "bfloat16"
        )
    else:
        assert (
            engine["device"] == "cpu"
            and engine["launch_cost_us"] == 1000
            and engine["dtype"] == "float32"
        )
        assert main(["bench", "prefill", "--device", "cuda", "--reps", "1", "--requests", "2"]) == 2
        err = capsys.readouterr().err.strip()
        assert "no CUDA device" in err and len(err.splitlines()) == 1


def test_bench_prefill_gil_free_device_what_if():
    """The what-if replaces the model's forward (the engine passes `out`): it runs and is labelled."""
    res = bench_prefill(
        modes=("thread", "ahead"),
        hits=(0.8,),
        reps=1,
        requests=8,
        warmup=False,
        gil_free_device_ms=1.0,
    )
    assert res["gil_free_device_ms"] == 1.0
    assert {e["mode"] for e in res["results"]} == {"thread", "ahead"}
    assert all(e["median"]["uncached_tok_per_s"] > 0 for e in res["results"])


def test_bench_prefill_rejects_bad_mode(capsys):
    assert (
        main(["bench", "prefill", "--modes", "thread,sideways", "--reps", "1", "--requests", "2"])
        == 2
    )
    assert "sideways" in capsys.readouterr().err


def test_trace_overhead_what_if_is_labelled(capsys):
    assert (
        main(
            ["bench", "trace-overhead", "--reps", "1", "--requests", "4", "--gil-free-device", "1"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("WHAT-IF") and "forward=a GIL-free wait (what-if)" in out


def test_trace_overhead_tiny():
    r = bench_trace_overhead(mode="thread", reps=1, requests=6)
    assert r["pairs"][0]["on"]["events"] > 0 and r["pairs"][0]["off"]["events"] == 0
    assert r["wall_ratio_median"] > 0 and r["emit_ns"] > 0 and r["write_ns"] > 0
    assert "per event" in format_trace_overhead(r)
    # the in-run accounting times every event, whether logged by a declared event or by emit
    assert all(a["events"] > 0 and a["calls"]["emit"] == a["events"] for a in r["accounted"])
    c = emit_cost_ns(1000)
    assert 0 < c["emit_ns"] < 1e6 and 0 < c["declared_ns"] < 1e6


def test_big_trace_is_valid_and_checker_bench_runs(tmp_path):
    base = tmp_path / "base.jsonl"
    assert main(["run", "--mode", "ahead", "--requests", "6", "--trace", str(base)]) == 0
    big = tmp_path / "big.jsonl"
    made = make_big_trace(str(big), 1500, base=str(base))
    assert made["events"] >= 1500 and made["copies"] >= 2
    r = check_file(str(big))
    assert r.ok and r.events == made["events"], [v.message for v in r.violations[:3]]
    assert r.complete  # it ends with a trace_end that counts its events: a whole trace
    res = bench_checker(trace=str(big), memory=True)
    assert res["ok"] and res["events"] == made["events"] and res["events_per_s"] > 0
    assert (
        res["parse_events_per_s"] >= res["events_per_s"] * 0.5 and res["tracemalloc_peak_mib"] > 0
    )
    assert "events/s" in format_checker(res)


def test_progress_lines():
    buf = io.StringIO()
    p = Progress(True, period=0.01, stream=buf)
    p.line("[1/2] hit=0.8 thread: 100 uncached tok/s")
    assert buf.getvalue().endswith("tok/s\n")  # not a TTY: whole lines, no carriage returns
    assert Progress(None, stream=io.StringIO()).enabled is False


def test_progress_counts_requests_and_tokens_from_the_running_trace():
    """The monitor reads the engine's events while it runs (names_and_fields: declared events named):
    its lines count released requests and sent tokens, so a run shows progress, not 0/N."""
    import re

    from engine.runs.spec import WorkloadConfig
    from engine.runtime.config import EngineConfig

    buf = io.StringIO()
    p = Progress(True, stream=buf)
    p.period = 0.002  # not a TTY: a line every 2 s at the most, longer than this run
    run_one(EngineConfig(mode="ahead"), WorkloadConfig(requests=60), progress=p, label="ahead")
    counts = [
        (int(a), int(b), float(c.replace(",", "")))
        for a, b, c in re.findall(
            r"ahead: (\d+)/(\d+) requests, ([\d,]+) uncached tok/s", buf.getvalue()
        )
    ]
    assert counts and all(total == 60 and done <= 60 for done, total, _ in counts)
    assert max(done for done, _, _ in counts) > 0 and max(tok for _, _, tok in counts) > 0


def test_bench_has_subcommands(capsys):
    assert main(["bench"]) == 2  # a sub-command is required
    assert "prefill" in capsys.readouterr().err


def test_bench_decode_tiny_run_has_the_documented_fields(capsys):
    """`pdo bench decode` at its smallest: one latency, one run per arm, two requests, two DP ranks
    (with one, decode asks no query at all, as SGLang), no modelled prefill or intake cost. The JSON has the documented fields (docs/benchmarks.md), zero
    errors, outputs identical to the reference; the table has a row per arm and the wait cut."""
    from engine.bench.decode import markdown

    assert (
        main(
            [
                "bench",
                "decode",
                "--latencies",
                "0.5",
                "--reps",
                "1",
                "--requests",
                "2",
                "--max-new-tokens",
                "3",
                "--rate",
                "1000",
                "--prompt-len",
                "16:32",
                "--prefill-launch-cost-us",
                "0",
                "--recv-wait-us",
                "0",
                "--dp",
                "2",
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["bench"] == "decode" and res["ok"] is True and res["cpus"] >= 1
    assert res["config"] == {
        "requests": 2,
        "max_new_tokens": 3,
        "rate": 1000.0,
        "prompt_len": [16, 32],
        "prefill_launch_cost_us": 0.0,
        "dp": 2,
        "prefill_mode": "normal",
        "decode_mode": "overlap",
        "polling_interval": 1,
        "recv_wait_us": 0.0,
        "latency_scope": "all",
        "reps": 1,
    }
    [row] = res["rows"]
    assert row["latency_ms"] == 0.5 and row["wait_cut"] > 0
    for arm in (row["prefetch"], row["no_prefetch"]):
        assert set(arm) == {
            "consumption_points",
            "by_source",
            "mean_wait_ms",
            "p99_wait_ms",
            "mean_lead_ms",
            "decode_tok_per_s",
            "errors",
            "aborted",
            "identical",
            "leaks",
        }
        assert (
            arm["errors"] == 0
            and arm["aborted"] == 0
            and arm["identical"] is True
            and arm["leaks"] is False
        )
        assert (
            arm["consumption_points"] >= 1
            and sum(arm["by_source"].values()) == arm["consumption_points"]
        )
        assert 0 < arm["mean_wait_ms"] <= arm["p99_wait_ms"] and arm["decode_tok_per_s"] > 0
    assert (
        set(row["no_prefetch"]["by_source"]) == {"sync"} and row["no_prefetch"]["mean_lead_ms"] == 0
    )
    table = markdown(res).splitlines()
    assert table[2].startswith(
        "| bootstrap latency | arm | consumption points | wait mean (ms) | wait p99 (ms) |"
    )
    assert [ln.split("|")[2].strip() for ln in table[4:]] == [
        "prefetch",
        "--no-prefetch",
        "**wait cut**",
    ]
    assert all(ln.endswith("| 0 | identical |") for ln in table[4:6])
