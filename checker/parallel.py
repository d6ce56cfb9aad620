"""Where the independent tasks of a long job run: in this process, in worker processes of this
machine (`--jobs N`, WorkerPool), or on a Ray cluster (`--ray [ADDRESS]`, RayPool).

A task is a function of its arguments alone (a fuzz schedule of (seed, index), a conformance run of
(scenario, schedule), the check of one trace set), so where it runs cannot change its result.
`in_order` runs a sequence of tasks on any executor and yields their results in index order: every
executor gives the answers of one process, and closing it early cancels what has not run.

Ray is an optional extra (`pip install -e ".[ray]"`): it is imported only when a RayPool is made."""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor

from spec import domains as d
from spec.errors import BadInput, RunFailed

RAY_INSTALL = 'pip install -e ".[ray]"'
# What `--ray` means without an address: a Ray instance started on this machine for the command.
RAY_LOCAL = "local"
# How many times a task whose worker or node died is run again before the job fails.
RAY_RETRIES = 3


class WorkerPool:
    """The processes of `--jobs N` on this machine: spawned (a fork would copy the parent's threads
    and torch's state), each one runs whole tasks. A context manager."""

    retries = 0  # a dead process breaks the pool (BrokenProcessPool): nothing is run again

    def __init__(self, jobs: int):
        self.jobs = jobs
        ctx = multiprocessing.get_context("spawn")
        self._ex = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx)

    def submit(self, fn, *args):
        return self._ex.submit(fn, *args)

    def describe(self) -> str:
        return f"{self.jobs} worker processes"

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self._ex.shutdown(wait=True, cancel_futures=True)


class TaskLost(RunFailed):
    """A task whose worker or node died on every one of its RAY_RETRIES + 1 runs: the job cannot
    give its answer (`pdo` exits 1, a run that failed, in one line)."""


def _ray():
    try:
        import ray
    except ImportError:
        raise BadInput(f"--ray: Ray is not installed; install it with {RAY_INSTALL}") from None
    return ray


def _lost_worker_errors(ray) -> tuple:
    """What ray.get raises when the process or node that ran a task died (not the task's own
    exception, which is the job's answer): the task is run again."""
    e = ray.exceptions
    return (
        e.WorkerCrashedError,
        e.NodeDiedError,
        e.LocalRayletDiedError,
        e.ObjectLostError,
        e.OutOfMemoryError,
    )


def _ray_messages_to_stderr(ray) -> Callable[[], None]:
    """Ray's driver prints what its raylets report (such as "A worker died or was killed while
    executing a task") on stdout, which is the command's answer: send it to stderr. Returns what
    undoes it. Ray's printer is internal; a release without it is left as it is."""
    module = getattr(getattr(ray, "_private", None), "worker", None)
    original = getattr(module, "print_to_stdstream", None)
    if original is None:
        return lambda: None

    def to_stderr(data, ignore_prefix):
        return original({**data, "is_err": True}, ignore_prefix)

    module.print_to_stdstream = to_stderr

    def restore() -> None:
        module.print_to_stdstream = original

    return restore


class RayPool:
    """Tasks on a Ray cluster: the one at `address` (`ray start --head` prints it; "auto" finds the
    one this machine belongs to), or, for RAY_LOCAL, a Ray instance started here with `cpus` CPUs
    (default: this machine's) and shut down at the end. A process already connected to Ray (a
    script or a test that called ray.init) keeps its connection: the tasks run there, and it stays
    up. A context manager.

    Ray runs each task once (max_retries=0); when the worker or the node running it dies, `result`
    submits it again, up to RAY_RETRIES times, and counts it in `retries`. Done here rather than
    by Ray's own max_retries so that the count is known exactly: Ray reports its retries only
    through its dashboard's state API (ray[default]). A task is a function of its arguments, so a
    second run gives the answer the first would have."""

    def __init__(self, address: str = RAY_LOCAL, cpus: int | None = None):
        self._ray = ray = _ray()
        self.address, self.retries, self._remote = address, 0, {}
        self._lost = _lost_worker_errors(ray)
        # quiet: the command's output is its own, the same as without --ray
        opts = {"log_to_driver": False, "logging_level": logging.ERROR}
        self._own = not ray.is_initialized()
        try:
            if self._own and address == RAY_LOCAL:
                cpus = cpus or os.cpu_count() or 1
                ray.init(num_cpus=cpus, include_dashboard=False, **opts)
            elif self._own:
                ray.init(address=address, **opts)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            detail = " ".join(str(exc).split())[:300]
            raise BadInput(f"--ray {address}: cannot start or reach Ray: {detail}") from None
        self._restore = _ray_messages_to_stderr(ray)
        resources = ray.cluster_resources()
        self.jobs = max(1, int(resources.get("CPU", 1)))
        self.nodes = len([n for n in ray.nodes() if n.get("Alive")])

    def submit(self, fn, *args) -> RayTask:
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = self._ray.remote(max_retries=0)(fn)
        return RayTask(self, remote, args)

    def describe(self) -> str:
        where = "a local Ray instance" if self.address == RAY_LOCAL else f"Ray at {self.address}"
        return f"{where}: {self.nodes} node(s), {self.jobs} CPU(s)"

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc) -> None:
        if self._own:
            self._ray.shutdown()
        self._restore()


class RayTask:
    """One task on Ray, as a concurrent.futures.Future is used here: result() and cancel()."""

    def __init__(self, pool: RayPool, remote, args: tuple):
        self.pool, self._remote, self._args = pool, remote, args
        self._ref = remote.remote(*args)

    def result(self):
        for attempt in range(RAY_RETRIES + 1):
            try:
                return self.pool._ray.get(self._ref)
            except self.pool._lost as exc:
                if attempt == RAY_RETRIES:
                    why = " ".join(str(exc).split())[:300]
                    raise TaskLost(
                        f"a Ray task's worker or node died {attempt + 1} time(s) in a row "
                        f"({type(exc).__name__}: {why})"
                    ) from None
                self.pool.retries += 1
                self._ref = self._remote.remote(*self._args)

    def cancel(self) -> None:
        """Drop the task: one not started never runs; one running ends with its worker process
        (force), so that no half-run schedule, interrupted in one of its threads, stays behind in
        a worker that runs the next task."""
        self.pool._ray.cancel(self._ref, force=True)


def add_ray_args(p, what: str) -> None:
    """`--ray [ADDRESS]` and `--ray-cpus N` on the parser `p`; `what` runs there."""
    p.add_argument(
        "--ray",
        nargs="?",
        const=RAY_LOCAL,
        default=None,
        type=d.text(),
        metavar="ADDRESS",
        help=f"run {what} as Ray tasks: on the cluster at ADDRESS (what `ray start --head` "
        f"prints, or 'auto'), or without one on a Ray instance started here (docs/scale.md; "
        f"needs {RAY_INSTALL})",
    )
    p.add_argument(
        "--ray-cpus",
        type=d.integer(1, 4096),
        default=None,
        metavar="N",
        help="with --ray and no address: the CPUs of the Ray instance started here (default: "
        "this machine's)",
    )


def executor(*, jobs: int = 1, ray: str | None = None, ray_cpus: int | None = None):
    """The executor of a command line: Ray when `--ray` was given, worker processes for
    `--jobs N` (N > 1), else none (this process)."""
    if ray_cpus is not None and ray != RAY_LOCAL:
        raise BadInput(
            "--ray-cpus sizes the Ray instance --ray starts here; "
            + ("it needs --ray" if ray is None else "a cluster's nodes say their own CPUs")
        )
    if ray is not None:
        if jobs > 1:
            raise BadInput("--jobs and --ray: give one (Ray runs a task on every CPU it has)")
        return RayPool(ray, ray_cpus)
    return WorkerPool(jobs) if jobs > 1 else contextlib.nullcontext()


def ray_summary(command: str, pool) -> None:
    """After a job on Ray, one line on stderr: where it ran and how many tasks were run again."""
    if isinstance(pool, RayPool):
        print(
            f"pdo {command}: ran on {pool.describe()}; {pool.retries} task(s) run again after "
            "their worker or node died",
            file=sys.stderr,
        )


def in_order(pool, fn: Callable, tasks: Iterable[tuple]) -> Iterator:
    """fn(*args) for each args of `tasks`, yielded in order. With `pool` (an executor) they run
    there, a window of 2 x pool.jobs ahead of the one yielded; closing the generator early cancels
    what has not been yielded."""
    if pool is None:
        for args in tasks:
            yield fn(*args)
        return
    window = 2 * pool.jobs
    pending: collections.deque = collections.deque()
    todo = iter(tasks)
    try:
        while True:
            while len(pending) < window:
                args = next(todo, None)
                if args is None:
                    break
                pending.append(pool.submit(fn, *args))
            if not pending:
                return
            yield pending.popleft().result()
    finally:
        for task in pending:
            task.cancel()


class Progress:
    """The progress line of a long job on stderr (when it is a terminal, or `enabled`): tasks done
    of `total`, events checked and their rate, failures so far."""

    def __init__(self, total: int, enabled: bool, unit: str = "schedules"):
        self.total, self.enabled, self.unit = total, enabled, unit
        self.t0, self.failures = time.perf_counter(), 0

    def __call__(self, done: int, events: int | None, failed: bool):
        """`events`: checked so far (None: the tasks do not count them)."""
        self.failures += int(failed)
        if not self.enabled:
            return
        width = 24
        fill = int(width * done / max(1, self.total))
        rate = (events or 0) / max(1e-9, time.perf_counter() - self.t0)
        checked = "" if events is None else f"{events} events checked ({rate:,.0f}/s), "
        sys.stderr.write(
            f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} {self.unit}, "
            f"{checked}violations: {self.failures}"
        )
        sys.stderr.flush()
        if done == self.total or failed:
            sys.stderr.write("\n")
