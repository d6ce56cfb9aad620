"""One (scenario, schedule) run of `pdo conform sglang` as a task: a function of its arguments
alone, run in this process or, with `--ray`, in a Ray worker (checker/parallel.py). A worker loads
SGLang and installs the hooks once, and refuses to run under another SGLang release than the
command's: every node of a cluster must have the same one."""

from __future__ import annotations

import functools
import os
import sys

from engine.sglang import versions
from engine.sglang.conform import driver, mutants


@functools.cache
def _session(release: str | None) -> tuple:
    """This process's SGLang (the release asked for, when none is imported yet) and its
    scenarios by name, loaded once."""
    if release is not None and "sglang" not in sys.modules:
        versions.use(release)
    sgl = driver.session()
    return sgl, dict(driver.all_scenarios(sgl))


def _scenarios(release: str | None, expected: str):
    sgl, scenarios = _session(release)
    if sgl.version != expected:
        raise versions.VersionError(
            f"a worker runs SGLang {sgl.version}, the command {expected}: every node needs the "
            "same release"
        )
    return sgl, scenarios


def run_one(
    release: str | None,
    expected: str,
    name: str,
    mutant: str | None,
    trace_dir: str,
    seed: int | None,
) -> dict:
    """driver.run_scenario for scenario `name` under schedule `seed` (None: the fixed one), with
    the decode mutant named `mutant` applied; its trace goes into `trace_dir` (on the worker's
    machine). `release`: --sglang-version, `expected`: the version the command loaded."""
    sgl, scenarios = _scenarios(release, expected)
    os.makedirs(trace_dir, exist_ok=True)
    applied = mutants.DECODE_MUTANTS[mutant] if mutant is not None else None
    return driver.run_scenario(sgl, name, scenarios[name], trace_dir, applied, seed)
