"""Schedule fuzzing: run the engine one thread at a time, with a strategy choosing who goes next at
every schedule point, and check each run (trace rules, outputs against the reference, leaks).

A schedule is the list of thread names chosen at each step, so it replays exactly (same workload,
same choices → same trace, timestamps aside) and stays valid across Python versions.
Strategies: `random` (uniform random walk), `pct` (probabilistic concurrency testing: random thread
priorities with d-1 priority-change points), `dfs` (bounded exhaustive search over preemptions).
"""
from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from dataclasses import dataclass, field

from engine import sync


# ---- the controller ----------------------------------------------------------------------------
class _T:
    __slots__ = ("name", "parked", "pred", "label", "ready")

    def __init__(self, name):
        self.name, self.parked, self.pred, self.label, self.ready = name, False, None, "start", False


class StepLimit(RuntimeError):
    pass


class Controller:
    """Lets exactly one managed thread run at a time; the strategy picks among enabled threads."""

    def __init__(self, strategy, *, max_steps: int = 20_000):
        self.strategy = strategy
        self.max_steps = max_steps
        self.cv = threading.Condition()
        self.threads: dict[str, _T] = {}
        self.running: str | None = None
        self.clock = 0.0
        self.choices: list[str] = []
        self.error: BaseException | None = None
        self.aborted = False
        self._local = threading.local()

    # installation -----------------------------------------------------------------------------
    def install(self, name: str = "scheduler") -> "Controller":
        threading.current_thread().name = name
        self._local.name = name
        self.threads[name] = _T(name)
        self.running = name
        sync.CONTROLLER = self
        return self

    def uninstall(self) -> None:
        with self.cv:
            self.aborted = True
            self.cv.notify_all()
        sync.CONTROLLER = None

    def manages_current(self) -> bool:
        return getattr(self._local, "name", None) in self.threads

    # threads ----------------------------------------------------------------------------------
    def spawn(self, target, name: str) -> threading.Thread:
        base, k = name, 1
        while name in self.threads:
            k += 1
            name = f"{base}#{k}"
        st = self.threads[name] = _T(name)

        def run():
            self._local.name = name
            with self.cv:
                st.ready = st.parked = True
                self.cv.notify_all()
                while self.running != name and not self.aborted:
                    self.cv.wait()
                st.parked = False
            try:
                target()
            finally:
                self._exit(name)

        t = threading.Thread(target=run, name=base, daemon=True)
        t.start()
        with self.cv:  # handshake: the new thread is parked before its parent goes on
            while not st.ready:
                self.cv.wait()
        return t

    def _exit(self, name: str) -> None:
        with self.cv:
            self.threads.pop(name, None)
            if self.running == name and not self.aborted:
                self._schedule()

    # schedule points --------------------------------------------------------------------------
    def point(self, label: str) -> None:
        self._park(None, label)

    def block_until(self, pred, label: str) -> None:
        self._park(pred, label)

    def _park(self, pred, label: str) -> None:
        name = getattr(self._local, "name", None)
        if name is None or name not in self.threads or self.aborted:
            return
        with self.cv:
            st = self.threads[name]
            st.parked, st.pred, st.label = True, pred, label
            self._schedule()
            while self.running != name and not self.aborted:
                self.cv.wait()
            st.parked = False

    def _schedule(self) -> None:
        enabled = sorted(n for n, t in self.threads.items() if t.parked and (t.pred is None or t.pred()))
        # A sleeping thread lets every other enabled thread go first (a poll loop must not starve
        # the threads it waits for, whatever the strategy's priorities say).
        awake = [n for n in enabled if self.threads[n].label != "sleep"]
        if awake:
            enabled = awake
        if not enabled:
            blocked = ", ".join(f"{n} at {t.label}" for n, t in sorted(self.threads.items()))
            self._abort(sync.Deadlock(f"deadlock: no thread can proceed ({blocked})"))
            return
        if len(self.choices) >= self.max_steps:
            self._abort(StepLimit(f"more than {self.max_steps} schedule steps"))
            return
        pick = self.strategy.choose(enabled, self.running, len(self.choices))
        self.choices.append(pick)
        self.running = pick
        self.cv.notify_all()

    def _abort(self, exc) -> None:
        self.error = exc
        self.aborted = True
        self.cv.notify_all()


# ---- strategies ----------------------------------------------------------------------------------
class Default:
    """Non-preemptive: keep the running thread while it is enabled, else the first by name."""

    def choose(self, enabled, running, step):
        return running if running in enabled else enabled[0]


class RandomWalk:
    name = "random"

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def choose(self, enabled, running, step):
        return self.rng.choice(enabled)


class PCT:
    """Burckhardt et al.'s PCT: threads get random distinct priorities; at d-1 random steps the
    running thread drops to the lowest priority. Finds any bug of depth d with probability >= 1/(n k^(d-1))."""
    name = "pct"

    def __init__(self, seed: int, depth: int = 3, steps: int = 400):
        self.rng = random.Random(seed)
        self.prio: dict[str, float] = {}
        self.changes = sorted(self.rng.sample(range(1, steps), max(0, depth - 1)))
        self.low = 0.0

    def choose(self, enabled, running, step):
        for n in enabled:
            if n not in self.prio:
                self.prio[n] = 1.0 + self.rng.random()
        if self.changes and step >= self.changes[0] and running in self.prio:
            self.changes.pop(0)
            self.low -= 1.0
            self.prio[running] = self.low
        return max(enabled, key=lambda n: self.prio[n])


class Replay:
    """Follow a recorded schedule; past its end, the non-preemptive default."""
    name = "replay"

    def __init__(self, choices: list[str], *, strict: bool = True):
        self.choices, self.strict = choices, strict
        self.diverged_at = None

    def choose(self, enabled, running, step):
        if step < len(self.choices):
            want = self.choices[step]
            if want in enabled:
                return want
            if self.diverged_at is None:
                self.diverged_at = step
            if self.strict:
                raise ScheduleDiverged(f"schedule step {step}: {want} is not enabled (enabled: {', '.join(enabled)})")
        return Default().choose(enabled, running, step)


class Indices:
    """Hypothesis-driven: the i-th choice is enabled[ints[i] % len]; past the list, the default.
    Shrinking the list towards zeros and shorter lengths shrinks the schedule."""
    name = "hypothesis"

    def __init__(self, ints):
        self.ints = list(ints)

    def choose(self, enabled, running, step):
        if step < len(self.ints):
            return enabled[self.ints[step] % len(enabled)]
        return Default().choose(enabled, running, step)


class ScheduleDiverged(RuntimeError):
    pass


# ---- one case ------------------------------------------------------------------------------------
@dataclass
class Case:
    mode: str = "ahead"
    inject: tuple = ()
    requests: int = 4
    prompt_len: tuple = (8, 40)
    hit: float = 0.5
    groups: int = 1
    logit_bias_frac: float = 0.5
    page_size: int = 4
    chunk_size: int = 16
    max_batch_tokens: int = 24
    num_pages: int = 64
    workload_seed: int = 0
    arrival: str = "burst"

    def configs(self):
        from engine.config import EngineConfig
        from engine.workload import WorkloadConfig

        cfg = EngineConfig(mode=self.mode, page_size=self.page_size, chunk_size=self.chunk_size,
                           max_batch_tokens=self.max_batch_tokens, num_pages=self.num_pages,
                           max_batch_reqs=8, max_slots=16, inject=frozenset(self.inject))
        wc = WorkloadConfig(requests=self.requests, prompt_len=tuple(self.prompt_len), hit=self.hit,
                            groups=self.groups, logit_bias_frac=self.logit_bias_frac, seed=self.workload_seed,
                            arrival=self.arrival, rate=5000.0)
        return cfg, wc


@dataclass
class Outcome:
    failures: list[str]
    schedule: list[str]
    events: int
    trace: list[dict] = field(repr=False, default_factory=list)
    header: dict = field(repr=False, default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    @property
    def killed_by(self) -> str | None:
        return self.failures[0] if self.failures else None


_REF_CACHE: dict = {}


def _reference(cfg, req):
    key = (cfg.model, cfg.seed, cfg.dtype, tuple(req.prompt), tuple(sorted((req.logit_bias or {}).items())))
    if key not in _REF_CACHE:
        from engine.reference_prefill import reference_prefill
        _REF_CACHE[key] = reference_prefill(cfg, req.prompt, req.logit_bias)
    return _REF_CACHE[key]


def run_case(case: Case, strategy, *, trace_path: str | None = None) -> Outcome:
    """Run one controlled schedule of `case` and judge it."""
    import tempfile

    import torch

    from checker.linear import check_file
    from engine.run import run_prefill
    from engine.trace import Tracer

    cfg, wc = case.configs()
    tracer = Tracer()
    ctl = Controller(strategy)
    prev = threading.current_thread().name
    ctl.install("scheduler")
    try:
        summary = run_prefill(cfg, wc, tracer=tracer, keep_scheduler=True)
    finally:
        ctl.uninstall()
        threading.current_thread().name = prev
    failures = []
    if ctl.error is not None:
        failures.append(f"schedule: {ctl.error}")
    if summary["_error"] is not None:
        failures.append(f"engine error: {summary['_error']!r}"[:300])
    path = trace_path or tempfile.mkstemp(suffix=".jsonl", prefix="pdo-fuzz-")[1]
    tracer.write(path, extra_header={"schedule_steps": len(ctl.choices)})
    result = check_file(path)
    for rid in dict.fromkeys(v.rule.id for v in result.violations):
        failures.append(f"rule {rid}")
    sched = summary["_scheduler"]
    if True:  # outputs are judged on every run, a rule violation or not
        for req in summary["_requests"]:
            first, k_ref, v_ref = _reference(cfg, req)
            if req.output_token != first:
                failures.append(f"output: {req.rid} first token {req.output_token} != reference {first}")
                continue
            room = sched.receiver.rooms.get(req.bootstrap_room)
            if room is None or room["meta"] is None:
                failures.append(f"output: {req.rid} KV never fully received")
                continue
            k, v = sched.receiver.kv(req.bootstrap_room)
            if k.shape != k_ref.shape or not (torch.allclose(k, k_ref, atol=1e-3) and torch.allclose(v, v_ref, atol=1e-3)):
                failures.append(f"output: {req.rid} received KV differs from the reference")
    leaks = {k: v for k, v in summary["leaks"].items() if v}
    if leaks:
        failures.append("leak: " + ", ".join(f"{k}={v}" for k, v in leaks.items()))
    if trace_path is None:
        import os
        os.unlink(path)
    order = ("rule", "output", "leak", "engine", "schedule")
    failures.sort(key=lambda f: next((i for i, p in enumerate(order) if f.startswith(p)), len(order)))
    return Outcome(failures, list(ctl.choices), len(tracer.events), tracer.events, tracer.header)


def make_strategy(name: str, seed: int, *, depth: int = 3):
    if name == "random":
        return RandomWalk(seed)
    if name == "pct":
        return PCT(seed, depth=depth)
    raise ValueError(f"unknown strategy {name!r}; choose pct, random or dfs")


# ---- search --------------------------------------------------------------------------------------
def dfs_schedules(case: Case, *, preemption_bound: int = 2, limit: int = 100):
    """Bounded exhaustive search: yields (schedule prefix, outcome) depth-first, each schedule
    differing from an earlier one by one more preemption, at most `preemption_bound` in all."""
    stack = [[]]
    seen = 0
    while stack and seen < limit:
        prefix = stack.pop()
        rec = _Recording(prefix)
        out = run_case(case, rec)
        seen += 1
        yield prefix, out
        # Branch at every step past the prefix where another thread was enabled.
        for i in range(len(rec.steps) - 1, len(prefix) - 1, -1):
            enabled, running, chosen = rec.steps[i]
            for alt in enabled:
                if alt == chosen:
                    continue
                branch = [s[2] for s in rec.steps[:i]] + [alt]
                if _preemptions(rec.steps[:i], alt, running) <= preemption_bound:
                    stack.append(branch)


class _Recording(Replay):
    def __init__(self, prefix):
        super().__init__(prefix, strict=False)
        self.steps = []

    def choose(self, enabled, running, step):
        pick = super().choose(enabled, running, step)
        self.steps.append((list(enabled), running, pick))
        return pick


def _preemptions(steps, alt, running) -> int:
    n = sum(1 for enabled, run, pick in steps if run in enabled and pick != run)
    return n + (1 if running is not None and alt != running else 0)


def shrink(case: Case, schedule: list[str], failures: list[str], *, budget: int = 40) -> tuple[Case, list[str], Outcome]:
    """Make a failing case smaller: fewer requests, then the shortest schedule prefix (the rest
    non-preemptive) that still fails with the same first failure kind."""
    kind = failures[0].split(":")[0].split(" ")[0]

    def fails(c, s):
        out = run_case(c, Replay(s, strict=False))
        return out if out.failed and out.failures[0].split(":")[0].split(" ")[0] == kind else None

    best_out = None
    tries = 0
    while case.requests > 1 and tries < budget:
        tries += 1
        smaller = dataclasses.replace(case, requests=case.requests - 1)
        out = fails(smaller, schedule)
        if out is None:
            break
        case, best_out = smaller, out
    lo, hi = 0, len(schedule)
    while lo < hi and tries < budget:  # binary search on the prefix length
        tries += 1
        mid = (lo + hi) // 2
        out = fails(case, schedule[:mid])
        if out is not None:
            hi, best_out = mid, out
        else:
            lo = mid + 1
    schedule = schedule[:hi]
    if best_out is None:
        best_out = run_case(case, Replay(schedule, strict=False))
    return case, best_out.schedule, best_out


def find_bug(case: Case, strategy: str, *, schedules: int, seed: int, on_progress=None):
    """Run up to `schedules` schedules; return (index, outcome) of the first failing one, or
    (None, events checked)."""
    if strategy == "dfs":
        runs = (out for _, out in dfs_schedules(case, limit=schedules))
    else:
        runs = (run_case(case, make_strategy(strategy, seed * 100_003 + i)) for i in range(schedules))
    events = 0
    for i, out in enumerate(runs):
        events += out.events
        if on_progress:
            on_progress(i + 1, events, out.failed)
        if out.failed:
            return i, out
    return None, events


def save_case(path: str, case: Case, schedule: list[str], failures: list[str], **extra) -> None:
    with open(path, "w") as f:
        json.dump({"case": dataclasses.asdict(case), "schedule": schedule, "failures": failures, **extra}, f, indent=1)


def load_case(path: str) -> tuple[Case, list[str], dict]:
    try:
        with open(path) as f:
            d = json.load(f)
        c = d["case"]
        c["inject"] = tuple(c.get("inject", ()))
        c["prompt_len"] = tuple(c.get("prompt_len", (8, 40)))
        return Case(**c), list(d["schedule"]), d
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a pdo fuzz case file ({exc})") from None


def timed(fn, *a, **k):
    t = time.perf_counter()
    r = fn(*a, **k)
    return r, time.perf_counter() - t
