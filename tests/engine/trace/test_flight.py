"""The flight recorder: a streamed trace survives the run's end, however it ends (engine/trace/tracer.py
`stream`, engine/trace/recorder.py, engine/trace/watchdog.py), a killed run's binary log reads as a truncated
trace (checker/trace_log.py), and `pdo check` reads a cut trace as truncated, never as a pass
(checker/trace_io.py `truncation`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from checker.linear import check_file, check_files
from engine.cli import main as pdo
from engine.cli.exits import BAD_INPUT, FAILED, INCOMPLETE, OK
from engine.cli.flags import exit_on_sigterm
from engine.prefill.scheduler import PrefillScheduler
from engine.runs.prefill_run import run_prefill
from engine.runs.spec import RunSpec, WatchdogSpec, WorkloadConfig
from engine.runtime.config import EngineConfig
from engine.trace.tracer import Tracer
from engine.trace.watchdog import Watchdog
from spec import load_events, tracelog

# the loops' traces refine their models (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("refined")

ROOT = Path(__file__).resolve().parents[3]


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def _run(tmp_path, name="t.jsonl", mode="thread", requests=8, **kw):
    path = tmp_path / name
    cfg = EngineConfig(
        mode=mode, device="cpu", dtype="float32", inject=frozenset(kw.pop("inject", ()))
    )
    watchdog = kw.pop("watchdog", None)
    watchdog = watchdog and WatchdogSpec(**watchdog)
    spec = RunSpec(cfg, WorkloadConfig(requests=requests), trace_path=str(path), watchdog=watchdog)
    return path, run_prefill(spec, **kw).summary


def _slow_run(trace: Path) -> subprocess.Popen:
    """A `pdo run` of some seconds: requests arrive at 40/s."""
    cmd = [sys.executable, "-m", "engine.cli", "run", "--trace", str(trace), "--no-verify"]
    cmd += ["--arrival", "poisson", "--rate", "40", "--requests", "400"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _logged(path: Path) -> int:
    """Events in the binary log of the trace at `path` as a reader takes them (what a run has
    logged so far, up to a digest it has not computed yet)."""
    log = Path(str(path) + tracelog.SUFFIX)
    try:
        return len(tracelog.read_log(log.read_bytes()).finish(final=True))
    except (OSError, tracelog.BadLog):  # not there yet, or its head not yet written
        return 0


def _wait_for_events(path: Path, n: int, proc, timeout=60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _logged(path) > n:
            return
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    raise AssertionError(f"{path}: fewer than {n} events after {timeout} s")


def test_a_killed_run_leaves_a_truncated_prefix(tmp_path, capsys):
    """SIGKILL: the binary log holds every event logged, which `pdo check` reads as a trace it
    calls truncated, not a pass and not bad input."""
    trace = tmp_path / "kill.jsonl"
    proc = _slow_run(trace)
    try:
        _wait_for_events(trace, 40, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not trace.exists()  # only the log: the JSON Lines are made at the end
    logged = _logged(trace)
    assert pdo(["check", "--json", str(trace)]) == INCOMPLETE
    out = capsys.readouterr()
    report = json.loads(out.out)[0]
    assert report["truncated"] and "P-complete" in report["not_judged"] and report["ok"]
    assert report["events"] == logged > 40 and "no trace_end: truncated" in out.err
    assert b'"trace_end"' not in trace.read_bytes()  # made from the log by the check


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signalled_run_ends_its_trace_with_reason_signal(tmp_path, sig):
    """SIGINT and SIGTERM (with the handler `pdo run` installs): every event logged, then trace_end
    with reason signal; the check reads it as a run that did not end normally."""
    path = tmp_path / "t.jsonl"
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    exit_on_sigterm()
    # Python's own Ctrl-C: a test run started from a background shell inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def send():
        while _logged(path) < 40:
            time.sleep(0.02)
        os.kill(os.getpid(), sig)

    threading.Thread(target=send, daemon=True).start()
    cfg = EngineConfig(mode="thread", device="cpu", dtype="float32")
    # long enough (100 s of arrivals) that the signal ends it even when a loaded machine starves
    # the sending thread for seconds: a run that ended first would leave a whole trace of
    # thousands of events, which the `refined` fixture would then model-check
    wc = WorkloadConfig(requests=4000, arrival="poisson", rate=40.0)
    try:
        with pytest.raises((KeyboardInterrupt, SystemExit)):
            run_prefill(RunSpec(cfg, wc, trace_path=str(path), verify=False))
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
    lines = _lines(path)
    end = lines[-1]
    assert end["ev"] == "trace_end" and end["reason"] == "signal", end
    assert end["events"] == len(lines) - 2 == lines[-2]["seq"]  # every event logged is there
    result = check_file(str(path))
    assert result.truncated == len(lines) and result.ok and result.end_reason == "signal"


def test_an_exception_in_the_engine_ends_the_trace_with_reason_exception(tmp_path, monkeypatch):
    calls = []
    stage = PrefillScheduler.stage

    def failing(self, batch):
        calls.append(batch)
        if len(calls) == 3:
            raise RuntimeError("injected: stage fails")
        return stage(self, batch)

    monkeypatch.setattr(PrefillScheduler, "stage", failing)
    with pytest.raises(RuntimeError, match="injected"):
        _run(tmp_path)
    lines = _lines(tmp_path / "t.jsonl")
    assert lines[0]["format"] == "pdo-trace" and lines[-1]["ev"] == "trace_end"
    assert lines[-1]["reason"] == "exception" and lines[-1]["events"] == len(lines) - 2
    assert [e["seq"] for e in lines[1:-1]] == list(range(1, len(lines) - 1))
    assert pdo(["check", str(tmp_path / "t.jsonl")]) == INCOMPLETE


def test_a_normal_run_streams_what_write_writes(tmp_path):
    """The streamed file equals the whole-trace writer's, trace_end aside (its t_ns)."""
    path, s = _run(tmp_path, requests=6)
    streamed = _lines(path)
    assert streamed[-1] == {**streamed[-1], "ev": "trace_end", "reason": "normal"}
    assert streamed[-1]["events"] == s["events"] == len(streamed) - 2
    assert pdo(["check", str(path)]) == OK


def _hang_in_stage(monkeypatch, seconds):
    stage, calls = PrefillScheduler.stage, []

    def hanging(self, batch):
        calls.append(batch)
        if len(calls) == 2:
            time.sleep(seconds)
        return stage(self, batch)

    monkeypatch.setattr(PrefillScheduler, "stage", hanging)


def test_the_watchdog_logs_each_threads_stack_when_a_thread_hangs(tmp_path, monkeypatch):
    path, _ = _run(tmp_path, "clean.jsonl", watchdog={"seconds": 0.3})
    assert not [e for e in _lines(path) if e.get("ev") == "stall"]  # a healthy run: no stall
    _hang_in_stage(monkeypatch, 1.0)
    path, _ = _run(tmp_path, "hang.jsonl", watchdog={"seconds": 0.3})
    stalls = [e for e in _lines(path) if e.get("ev") == "stall"]
    assert stalls and stalls[0]["pending"] > 0 and stalls[0]["idle_ms"] >= 300
    stacks = stalls[0]["stacks"]
    assert {"scheduler", "forward"} <= set(stacks)
    assert [t for t, s in stacks.items() if any("hanging" in f for f in s["frames"])] == ["forward"]
    assert all(len(s["frames"]) <= 6 for s in stacks.values())
    result = check_file(str(path))
    assert result.ok and result.stalls == len(stalls) and result.truncated is None


def test_pdo_run_pd_honours_the_watchdog_on_every_role(tmp_path, monkeypatch):
    _hang_in_stage(monkeypatch, 1.0)
    trace = tmp_path / "pd.jsonl"
    assert (
        pdo(["run", "--pd", "--requests", "6", "--trace", str(trace), "--watchdog-s", "0.3"]) == OK
    )
    stalls = [e for e in _lines(tmp_path / "pd.prefill0.jsonl") if e.get("ev") == "stall"]
    assert stalls and stalls[0]["pending"] > 0
    assert all(r.ok for r in check_files([str(p) for p in tmp_path.glob("pd.*.jsonl")]))


def test_the_watchdog_stops_the_run_with_reason_watchdog(tmp_path, monkeypatch):
    exits = []
    _hang_in_stage(monkeypatch, 1.0)
    monkeypatch.setitem(Watchdog.__init__.__kwdefaults__, "exit", exits.append)
    path, _ = _run(tmp_path, watchdog={"seconds": 0.3, "on_stall": "stop"})
    lines = _lines(path)
    assert exits == [FAILED] and lines[-1]["reason"] == "watchdog"
    assert lines[-2]["ev"] == "stall"


def test_a_truncated_trace_never_passes(tmp_path, capsys):
    """Cut after every line, and in the middle of it: `pdo check` says truncated (exit 3) on the
    clean engine's trace, judges the rules a prefix can break, and still catches a mutant's
    violation in a prefix (exit 1)."""
    path, _ = _run(tmp_path, requests=6)
    text = path.read_bytes().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    for k in range(2, len(text)):
        for part in (text[k - 1], text[k - 1][: len(text[k - 1]) // 2]):
            cut.write_bytes(b"".join(text[: k - 1]) + part)
            r = check_file(str(cut))
            assert r.truncated is not None and r.ok, (k, [v.message for v in r.violations])
            assert r.not_judged and not {rule.id for rule, _ in r.rules} & set(r.not_judged)
    assert pdo(["check", "--json", str(cut)]) == INCOMPLETE
    out = json.loads(capsys.readouterr().out)[0]
    assert out["truncated"] == len(text) - 1 and out["not_judged"]
    assert pdo(["check", str(cut)]) == INCOMPLETE
    assert f"truncated at line {len(text) - 1}" in capsys.readouterr().out
    bad, _ = _run(tmp_path, "bad.jsonl", requests=6, inject=("send-before-forward-done",))
    lines = bad.read_bytes().splitlines(keepends=True)
    cut.write_bytes(b"".join(lines[: len(lines) * 3 // 4]))
    r = check_file(str(cut))
    assert r.truncated is not None and not r.ok
    assert pdo(["check", str(cut)]) == FAILED


def test_a_version_1_trace_without_trace_end_is_whole(tmp_path):
    path, _ = _run(tmp_path, requests=4, mode="normal")
    lines = path.read_text().splitlines(keepends=True)
    header = json.loads(lines[0]) | {"version": 1}
    newer = {ev for ev, spec in load_events()["prefill"].items() if spec.get("since", 1) > 1}
    body = [ln for ln in lines[1:-1] if json.loads(ln)["ev"] not in newer]  # as version 1 had it
    v1 = tmp_path / "v1.jsonl"
    v1.write_text(json.dumps(header) + "\n" + "".join(body))
    assert check_file(str(v1)).truncated is None


class _Stamp:
    """A late digest, as engine.trace.digest.DigestStamp: `resolve` computes it, and tells the recorder
    that subscribed."""

    def __init__(self):
        self.on_value = None

    def subscribe(self, on_value):
        self.on_value = on_value

    def resolve(self):
        self.on_value("d1")

    def trace_value(self):
        return "d1"


def test_a_late_digest_is_a_record_of_its_own_and_a_log_without_it_stops_before_it(tmp_path):
    tr = Tracer({"role": "prefill"})
    path = tmp_path / "w.jsonl"
    tr.stream(str(path))
    log = tr.events_for(snapshot=("batch", "digest"), stage=("batch",))
    stamp, later = _Stamp(), _Stamp()
    log.snapshot(0, stamp)
    log.stage(0)
    stamp.resolve()  # by its thread, after the events
    log.snapshot(1, later)  # never computed before the "kill"
    log.stage(1)
    r = tracelog.read_log(Path(str(path) + tracelog.SUFFIX).read_bytes())
    events = r.finish(final=True)
    assert [(e["ev"], e.get("digest")) for e in events] == [("snapshot", "d1"), ("stage", None)]
    assert r.damage.unresolved == 2 and r.end is None
    tr.close()  # the end computes what is pending
    lines = _lines(path)
    assert [e.get("digest") for e in lines[1:-1]] == ["d1", None, "d1", None]
    assert lines[-1] == {**lines[-1], "ev": "trace_end", "events": 4, "reason": "normal"}
    assert not Path(str(path) + tracelog.SUFFIX).exists()  # the log goes once its lines are made


def test_a_torn_last_record_and_an_unwritten_slot_are_detected(tmp_path, capsys):
    """What SIGKILL can leave: a record cut mid-write (its check field not its slot's) and a slot
    taken but never written; both dropped and said, the rest read, the trace truncated."""
    tr = Tracer({"role": "prefill", "mode": "normal", "page_size": 16})
    path = tmp_path / "t.jsonl"
    tr.stream(str(path))
    log = tr.events_for(stage=("batch",))
    for b in range(5):
        log.stage(b)
    log_path = Path(str(path) + tracelog.SUFFIX)
    data = bytearray(log_path.read_bytes())
    slots = [i for i in range(1, len(data) // tracelog.SLOT) if any(data[i * 96 : i * 96 + 96])]
    third, last = slots[-3], slots[-1]
    data[third * 96 : third * 96 + 96] = bytes(96)  # taken, never written
    data[last * 96 + 88 : last * 96 + 96] = bytes(8)  # cut before its check field
    log_path.write_bytes(bytes(data))
    r = tracelog.read_log(bytes(data))
    assert (r.damage.torn, r.damage.holes) == (1, 1)
    assert [e["batch"] for e in r.finish(final=True)] == [0, 1, 3]
    assert pdo(["check", "--json", str(path)]) != OK  # these stages break rules: never a pass
    out = capsys.readouterr()
    assert json.loads(out.out)[0]["truncated"] == 5  # the line after the three events: no end
    assert "1 torn record(s) dropped" in out.err and "1 slot(s) taken but never written" in out.err


def test_an_event_after_trace_end_is_malformed(tmp_path, capsys):
    path, _ = _run(tmp_path, requests=4, mode="normal")
    lines = path.read_text().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    # the next seq after trace_end's: no gap, so what is wrong is the event's place alone
    last = json.loads(lines[-2]) | {"seq": json.loads(lines[-1])["seq"] + 1}
    bad.write_text("".join(lines) + json.dumps(last) + "\n")
    assert pdo(["check", str(bad)]) == BAD_INPUT
    assert f"bad.jsonl:{len(lines)}: field 'ev': trace_end is not the last event" in (
        capsys.readouterr().err
    )
