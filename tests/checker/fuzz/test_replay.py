"""Exact replay: a campaign's verdicts and traces depend on (case, seed, schedule index) only, in a
fresh process, after other campaigns in the same process, and split over worker processes
(`pdo fuzz --jobs`); the failing case's replay command reproduces the failure in a fresh process;
no thread of a schedule outlives it."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from checker.fuzz import Case, Controller, Default, Replay, run_case
from checker.fuzz import runs as fuzz_runs
from engine import sync
from engine.bootstrap import client as bootstrap_client
from engine.bootstrap.server import BootstrapServer
from engine.cli import main
from engine.runtime.device import CpuStream

ROOT = str(Path(__file__).resolve().parents[3])
# Race-dependent mutants: some schedules of these campaigns fail, others pass.
SETUP = {
    "prefill": {"mode": "ahead", "inject": ["no-war-barrier"], "requests": 5, "hit": 0.8},
    "prefill_schedules": 5,
    "pd_inject": "no-cancel-on-release",
    "pd_schedules": 4,
}

_CAMPAIGNS = """
import json, sys
from checker.fuzz import Case, campaign, pd_draws, save_case
warm, case_path, setup = sys.argv[1] == "warm", sys.argv[2], json.loads(sys.argv[3])
knobs = setup["prefill"]
case = Case(**{**knobs, "inject": tuple(knobs["inject"])})
if warm:  # other campaigns first, in this process: a clean prefill case, a PD case, and this very
    # case under another seed (whatever it leaves cached, the reference outputs, must not steer)
    list(campaign(Case(mode="overlap", requests=3), "random", schedules=2, seed=5))
    list(campaign(None, "pct", schedules=1, seed=3, draw=pd_draws(3)))
    list(campaign(case, "random", schedules=1, seed=7))
rows = {"prefill": [], "pd": []}
for i, out in enumerate(campaign(case, "pct", schedules=setup["prefill_schedules"], seed=0)):
    rows["prefill"].append([out.failures, out.digest])
    if out.failed and not rows.get("saved"):
        save_case(
            case_path, out.case, out.schedule, out.failures, strategy="pct", seed=0, index=i,
            model=out.model,
        )
        rows["saved"] = out.failures
draw = pd_draws(0, inject=(setup["pd_inject"],))
for out in campaign(None, "pct", schedules=setup["pd_schedules"], seed=0, draw=draw):
    rows["pd"].append([out.failures, out.digest])
print(json.dumps(rows))
"""


def _python(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


# Known defect, under investigation: in three whole-suite runs of 2026-12-02 (`pytest -n 2`) two
# fresh processes gave different traces at one schedule index (1, then 3); alone, beside its file,
# under busy loops or beside other heavy tests it passes. Something in a controlled prefill run still
# depends on timing. Until it is found this runs with PDO_SLOW=1, not in the default suite.
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PDO_SLOW") != "1", reason="timing-dependent: PDO_SLOW=1")
def test_a_race_dependent_campaign_replays_in_fresh_and_warm_processes(tmp_path):
    """The same campaigns twice in fresh processes and once after other campaigns: the same
    verdict and trace digest at every schedule index; the first failing prefill case, saved,
    fails the same way when `pdo fuzz --replay` runs it in another fresh process."""
    results = []
    for k, mode in enumerate(("fresh", "fresh", "warm")):
        proc = _python("-c", _CAMPAIGNS, mode, str(tmp_path / f"case{k}.json"), json.dumps(SETUP))
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first = results[0]
    for name, other in (("the second fresh process", results[1]), ("the warm one", results[2])):
        for side in ("prefill", "pd"):
            differ = [i for i, (a, b) in enumerate(zip(first[side], other[side])) if a != b]
            assert not differ, f"{name}: {side} schedules {differ} differ: {other[side][differ[0]]}"
        assert other == first, name
    for side in ("prefill", "pd"):  # race-dependent: some schedules fail, not all
        verdicts = [bool(f) for f, _ in first[side]]
        assert any(verdicts) and not all(verdicts), (side, first[side])
    proc = _python("-m", "engine.cli", "fuzz", "--replay", str(tmp_path / "case0.json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    fails = [ln.strip()[len("FAIL ") :] for ln in proc.stdout.splitlines() if "FAIL " in ln]
    assert fails == first["saved"]


def _fuzz(capsys, *args) -> str:
    assert main(["fuzz", *args]) == 1
    return capsys.readouterr().out


def test_jobs_2_gives_the_verdicts_and_replay_command_of_jobs_1(tmp_path, capsys):
    """`pdo fuzz --jobs 2` on a mutant campaign: the same first failing index, failures, shrunk
    case and replay command as one process."""
    args = ["--inject", "no-war-barrier", "--schedules", "8", "--out", str(tmp_path)]
    one = _fuzz(capsys, *args, "--jobs", "1")
    two = _fuzz(capsys, *args, "--jobs", "2")
    assert one == two and "replay: pdo fuzz --replay" in one


def test_bad_jobs_is_a_one_line_error(capsys):
    assert main(["fuzz", "--jobs", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pdo fuzz: error: argument --jobs: expected an integer in [1, 256], got '0' "
        "(pdo fuzz --help)"
    )


def test_a_replay_that_diverges_ends_the_run_with_a_failure():
    """A strategy that cannot go on (a saved schedule naming a thread that is not enabled) ends
    the run for every thread, reported as the run's failure; raised in one thread, it would leave
    the others parked for ever."""
    out = run_case(Case(mode="thread", requests=2), Replay(["scheduler", "nobody"]))
    assert out.failures and "nobody is not enabled" in out.failures[0], out.failures


# ---- no thread outlives its schedule -------------------------------------------------------------
def test_a_thread_the_controller_started_and_that_never_exits_is_reported():
    release = threading.Event()
    ctl = Controller(Default()).install("main")
    try:
        sync.start_thread(release.wait, "stuck")  # blocks outside the controller
        sync.point("go")
    finally:
        ctl.uninstall()
    assert ctl.join_all(0.2) == ["stuck"]
    release.set()
    assert ctl.join_all(5) == []


def test_a_stream_that_is_never_stopped_fails_its_schedule(monkeypatch):
    """A bug that leaves device streams running after the run: the quiesce under control sees a
    deadlock, and the threads, still alive after uninstall, are reported by name."""
    streams = []
    close = CpuStream.close
    init = CpuStream.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        streams.append(self)

    monkeypatch.setattr(CpuStream, "__init__", record)
    monkeypatch.setattr(CpuStream, "close", lambda self: None)
    monkeypatch.setattr(fuzz_runs, "JOIN_TIMEOUT_S", 0.3)
    try:
        out = run_case(Case(mode="normal", requests=2), Default())
    finally:
        for s in streams:  # let the leaked threads end
            close(s)
    assert any(f.startswith("schedule: deadlock") for f in out.failures), out.failures
    assert "schedule: thread stream:forward did not exit" in out.failures


def test_every_thread_of_a_prefill_run_exits_under_the_controller(monkeypatch):
    """When the controller is uninstalled only the installing thread is left: the worker, the
    streams and the transfer thread exited as scheduled steps, none runs on uncontrolled."""
    left = []
    uninstall = Controller.uninstall

    def spy(self):
        left.append(sorted(self.threads))
        uninstall(self)

    monkeypatch.setattr(Controller, "uninstall", spy)
    out = run_case(Case(mode="ahead", requests=3), Default())
    assert not out.failed, out.failures
    assert left == [["scheduler"]]


# ---- the in-process bootstrap server belongs to its run ------------------------------------------
def test_a_thread_of_another_run_cannot_reach_this_runs_bootstrap_server():
    ctl = Controller(Default()).install("main")
    try:
        server = BootstrapServer().start_inproc()
        assert bootstrap_client.health(server.url)  # this run's thread reaches it
        seen = {}
        outsider = threading.Thread(
            target=lambda: seen.update(ok=bootstrap_client.health(server.url))
        )
        outsider.start()
        outsider.join()
        assert seen == {"ok": False}  # a thread this controller does not manage does not
        # the name is free for another owner: an uncontrolled thread starts its own
        started = threading.Thread(target=lambda: seen.update(url=_start_and_stop()))
        started.start()
        started.join()
        assert seen["url"] == server.url == "inproc://bootstrap"
    finally:
        server.stop()
        ctl.uninstall()


def _start_and_stop() -> str:
    other = BootstrapServer().start_inproc()
    url = other.url
    other.stop()
    return url


@pytest.mark.parametrize("controlled", [True, False])
def test_the_room_ttl_reads_virtual_time_under_control(controlled):
    ctl = Controller(Default()).install("main") if controlled else None
    try:
        server = BootstrapServer(room_ttl_s=1.0)
        if controlled:
            server.start_inproc()
        server._do_register_dp_rank({"bootstrap_room": 7, "dp_rank": 0})
        if controlled:
            ctl.clock += 2.0  # two seconds of virtual time, none of wall time
        body = json.loads(server._do_query_dp_ranks({"bootstrap_rooms": [7]}).text)
        assert body == ({} if controlled else {"7": 0})
        server.stop()
    finally:
        if ctl is not None:
            ctl.uninstall()
