"""Schedules a second of one `pdo fuzz` campaign run in one process, in `--jobs 2` worker
processes, on a local Ray instance (`--ray --ray-cpus 2`) and on simulated Ray clusters of K
one-CPU nodes on this machine (ray.cluster_utils.Cluster): the wall time of the whole command, the
interpreter's and Ray's start-up included (a cluster's own start is timed apart: on a real cluster it
is already up). Each run's stdout is compared with the one process's (docs/scale.md).

    PYTHONPATH=. .venv/bin/python scripts/ray_scale.py --schedules 200 --nodes 1 2 4"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(argv: list[str]) -> tuple[float, str]:
    """(wall seconds, stdout) of `pdo argv` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", *argv], capture_output=True, text=True, env=env
    )
    seconds = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"pdo {' '.join(argv)}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return seconds, proc.stdout


def cluster_of(nodes: int):
    """A simulated cluster of `nodes` one-CPU nodes; (cluster, seconds to start it)."""
    from ray.cluster_utils import Cluster

    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return cluster, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--nodes", type=int, nargs="*", default=[1, 2, 4])
    a = p.parse_args()
    campaign = ["fuzz", "--mode", "ahead", "--schedules", str(a.schedules), "--seed", str(a.seed)]
    base_s, base_out = timed([*campaign, "--jobs", "1"])
    rows = [("--jobs 1", base_s, True, "")]
    for label, extra in (
        ("--jobs 2", ["--jobs", "2"]),
        ("--ray (local, 2 CPUs)", ["--ray", "--ray-cpus", "2"]),
    ):
        s, out = timed([*campaign, *extra])
        rows.append((label, s, out == base_out, ""))
    for k in a.nodes:
        cluster, start = cluster_of(k)
        try:
            s, out = timed([*campaign, "--ray", cluster.address])
        finally:
            cluster.shutdown()
        rows.append(
            (f"--ray, {k} node(s) x 1 CPU", s, out == base_out, f"cluster start {start:.1f} s")
        )
    print(f"pdo {' '.join(campaign)}  ({os.cpu_count()} CPUs here)")
    print(f"{'executor':28s} {'wall s':>7s} {'sched/s':>8s}  same output as --jobs 1")
    for label, s, same, note in rows:
        print(f"{label:28s} {s:7.1f} {a.schedules / s:8.2f}  {'yes' if same else 'NO'}  {note}")


if __name__ == "__main__":
    main()
