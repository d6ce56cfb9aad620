"""`--ray` (checker/parallel.py, docs/scale.md): fuzz campaigns and trace-set checks as Ray tasks give
the answers of one process, on a local Ray instance and on a two-node cluster simulated here, also
when a node's worker is killed mid-campaign; without Ray installed, `--ray` is one line, exit 2.

Ray is an optional extra (`pip install -e ".[ray]"`): without it these tests skip, all but the
one about its absence. PDO_SLOW=1 adds the two-node cluster with a killed worker, and the fleet
check over 200 trace sets (the test set-up installs Ray: scripts/setup.sh --test)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.cli import main

ROOT = str(Path(__file__).resolve().parents[3])
RAY_CPUS = "2"  # a small instance: the suite shares this machine


@pytest.fixture
def ray():
    return pytest.importorskip("ray")


@pytest.fixture(scope="module")
def _shared_instance():
    yield
    ray = sys.modules.get("ray")  # set up before `ray` (a wider scope): Ray may be absent
    if ray is not None:
        ray.shutdown()


@pytest.fixture
def local_ray(ray, _shared_instance):
    """`ray.init(num_cpus=2)`, once for the tests that share it (`--ray` runs on the instance this
    process is connected to, and leaves it up)."""
    if not ray.is_initialized():
        ray.init(num_cpus=int(RAY_CPUS), include_dashboard=False, log_to_driver=False)
    return ray


def _run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _retries(err: str) -> int:
    found = re.search(r"; (\d+) task\(s\) run again after their worker or node died", err)
    assert found, err[-2000:]
    return int(found.group(1))


# ---- without Ray -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv", [["fuzz", "--schedules", "1", "--ray"], ["check", "--ray", "TRACES"]]
)
def test_ray_not_installed_is_one_line_naming_the_option_and_the_install(
    argv, tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    (tmp_path / "t.jsonl").write_text("{}\n")
    argv = [str(tmp_path) if a == "TRACES" else a for a in argv]
    rc, out, err = _run(argv)
    assert rc == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--ray" in lines[0] and 'pip install -e ".[ray]"' in lines[0], err


# ---- fuzz campaigns ----------------------------------------------------------------------------
def test_local_ray_gives_the_output_of_jobs_1(local_ray, tmp_path):
    """A mutant campaign on `ray.init(num_cpus=2)`: the same first failing index, failures, shrunk
    case and replay command as one process, every schedule accounted for."""
    args = ["fuzz", "--inject", "no-war-barrier", "--schedules", "8", "--out", str(tmp_path)]
    rc1, one, _ = _run([*args, "--jobs", "1"])
    rc2, two, err = _run([*args, "--ray"])
    assert rc1 == rc2 == 1 and one == two and "replay: pdo fuzz --replay" in one
    assert "a local Ray instance: 1 node(s), 2 CPU(s)" in err and _retries(err) == 0
    assert local_ray.is_initialized()  # not the command's: left up


def test_a_task_whose_worker_always_dies_runs_again_then_is_lost(local_ray):
    """A task that kills its own worker: run RAY_RETRIES more times, each counted, then TaskLost
    (`pdo` reports it as a run that failed, exit 1, one line)."""
    from checker.parallel import RAY_RETRIES, RayPool, TaskLost, in_order

    def exit_worker(code):  # pickled by value: the worker need not import this module
        os._exit(code)

    with RayPool() as pool:
        with pytest.raises(TaskLost, match=f"died {RAY_RETRIES + 1} time"):
            list(in_order(pool, exit_worker, [(3,)]))
        assert pool.retries == RAY_RETRIES


def _sglang_missing() -> str | None:
    from engine.sglang import SGLangUnavailable, check_version

    try:
        check_version()
    except SGLangUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("PDO_SLOW") != "1", reason="each worker loads SGLang: PDO_SLOW=1"
)
def test_conform_on_ray_gives_the_output_of_one_process(local_ray, tmp_path):
    """`pdo conform sglang --fuzz` on Ray: the stdout of one process; with --stop-at-first (under
    a mutant that the first scenario misses) the one run reported, the rest cancelled."""
    missing = _sglang_missing()
    if missing:
        pytest.skip(missing)
    base = ["conform", "sglang", "--trace-dir", str(tmp_path)]
    for extra in (
        ["--scenario", "decode-arrivals", "--fuzz", "2"],
        ["--mutant", "no-stale-cancel", "--fuzz", "3", "--stop-at-first"],
    ):
        rc1, one, _ = _run([*base, *extra])
        rc2, two, err = _run([*base, *extra, "--ray"])
        assert rc1 == rc2 and one == two and _retries(err) == 0, (one, two)
    assert rc1 == 1 and sum(line.startswith(("ok ", "BAD ")) for line in one.splitlines()) == 1


def _busy_workers(raylet_pid: int, task: str) -> list[int]:
    """The worker processes of the raylet running a task of function `task` (Ray titles a busy
    worker `ray::<function>`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == raylet_pid and title.startswith(f"ray::{task}"):
            pids.append(int(entry))
    return pids


def _kill_one_busy_worker(raylet_pid: int, task: str, done: threading.Event) -> list[int]:
    """SIGKILL the first worker of that raylet found running `task`; what was killed."""
    while not done.is_set():
        busy = _busy_workers(raylet_pid, task)
        if busy:
            os.kill(busy[0], signal.SIGKILL)
            return busy[:1]
        time.sleep(0.05)
    return []


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("PDO_SLOW") != "1", reason="two simulated nodes start: PDO_SLOW=1"
)
def test_a_two_node_cluster_survives_a_killed_worker_with_the_same_verdicts(ray, tmp_path):
    """Two nodes of one CPU (ray.cluster_utils.Cluster); a worker of the second is killed while it
    runs a schedule: its task runs again (counted), and the campaign's report, events and memory
    statistics included, is the one process's."""
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the shared local instance, if a test before this one started it

    args = ["fuzz", "--pd", "--schedules", "16", "--out", str(tmp_path)]
    rc1, one, _ = _run([*args, "--jobs", "1"])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        node = cluster.add_node(num_cpus=1)
        raylet = node.all_processes["raylet"][0].process.pid
        done, killed = threading.Event(), []
        killer = threading.Thread(
            target=lambda: killed.extend(_kill_one_busy_worker(raylet, "_run_drawn_slim", done))
        )
        killer.start()
        try:
            rc2, two, err = _run([*args, "--ray", cluster.address])
        finally:
            done.set()
            killer.join()
    finally:
        cluster.shutdown()
    assert killed, "no worker of the second node ran a schedule"
    assert "2 node(s), 2 CPU(s)" in err and _retries(err) >= 1
    assert rc1 == rc2 and one == two


# ---- trace sets --------------------------------------------------------------------------------
def _write_sets(folder, n: int) -> None:
    """n runs of `pdo run` and `pdo run --pd` into `folder` (scripts/trace_fleet.py, a fresh
    process: the suite's refinement of every engine trace is not for these)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "trace_fleet.py"), str(folder), str(n)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _fleet_matches_check_of_each_set(folder, sets: int) -> dict:
    rc, out, err = _run(["check", "--ray", str(folder), "--ray-cpus", RAY_CPUS, "--json"])
    fleet = json.loads(out)
    assert len(fleet) == sets, [s["set"] for s in fleet]
    for s in fleet:
        one_rc, one_out, one_err = _run(["check", "--json", *s["traces"]])
        assert s["exit"] == one_rc, (s["set"], s["error"], one_err)
        if one_rc == 2:
            assert one_err.strip().endswith(s["error"]), (one_err, s["error"])
        else:
            assert s["reports"] == json.loads(one_out), s["set"]
    codes = [s["exit"] for s in fleet]
    assert rc == (1 if 1 in codes else 2 if 2 in codes else 3 if 3 in codes else 0)
    return {"codes": codes, "err": err, "fleet": fleet}


def test_check_ray_gives_each_trace_set_the_verdict_of_pdo_check(ray, tmp_path):
    """Trace sets written by `pdo run` and `pdo run --pd` (some under a mutant, one cut short, one
    not a trace), in two folders: `pdo check --ray DIR` finds every set, and each one's exit code
    and report are those of `pdo check` on its files."""
    runs = tmp_path / "fleet" / "day1"
    runs.mkdir(parents=True)
    _write_sets(runs, 6)
    extra = tmp_path / "fleet" / "day2"
    extra.mkdir()
    whole = (runs / "run000.jsonl").read_text().splitlines(keepends=True)
    (extra / "cut.jsonl").write_text("".join(whole[: len(whole) // 2]))  # no trace_end
    (extra / "junk.jsonl").write_text("not json\n")
    ray.shutdown()  # the command starts its own instance and shuts it down
    got = _fleet_matches_check_of_each_set(tmp_path / "fleet", 8)
    assert not ray.is_initialized()
    assert sorted(set(got["codes"])) == [0, 1, 2, 3], got["codes"]
    pd = next(s for s in got["fleet"] if s["set"].endswith("pd001"))
    assert [os.path.basename(t) for t in pd["traces"]] == [
        "pd001.decode.jsonl",
        "pd001.prefill0.jsonl",
    ]
    assert "events/s" in got["err"] and _retries(got["err"]) == 0


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PDO_SLOW") != "1", reason="200 runs: PDO_SLOW=1")
def test_check_ray_over_200_trace_sets(ray, tmp_path):
    _write_sets(tmp_path, 200)
    got = _fleet_matches_check_of_each_set(tmp_path, 200)
    assert 0 in got["codes"] and 1 in got["codes"]
    print(got["err"])
