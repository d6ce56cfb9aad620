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
    __slots__ = ("name", "parked", "pred", "label", "ready", "wake")

    def __init__(self, name):
        self.name, self.parked, self.pred, self.label, self.ready = name, False, None, "start", False
        self.wake = 0.0  # virtual time a sleeping thread wakes up at


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
        self._exited: set[str] = set()

    # installation -----------------------------------------------------------------------------
    def install(self, name: str = "scheduler") -> "Controller":
        """Take over the calling thread under `name` (uninstall gives it its old name back)."""
        self._installer_name = threading.current_thread().name
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
        threading.current_thread().name = self._installer_name

    def manages_current(self) -> bool:
        return getattr(self._local, "name", None) in self.threads

    # threads ----------------------------------------------------------------------------------
    def group_of_current(self) -> str | None:
        return getattr(self._local, "group", None)

    def set_group(self, group: str | None) -> None:
        self._local.group = group

    def exited(self, name: str) -> bool:
        return name in self._exited

    def alone_pred(self):
        """A predicate: only the calling thread is left."""
        me = self._local.name
        return lambda: set(self.threads) == {me}

    def spawn(self, target, name: str, *, group: str | None = None) -> threading.Thread:
        group = group if group is not None else self.group_of_current()
        base = name
        name = f"{group}/{base}" if group else base
        first, k = name, 1
        while name in self.threads or name in self._exited:
            k += 1
            name = f"{first}#{k}"
        st = self.threads[name] = _T(name)

        def run():
            self._local.name = name
            self._local.group = group
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
        t.pdo_key = name
        t.start()
        with self.cv:  # handshake: the new thread is parked before its parent goes on
            while not st.ready:
                self.cv.wait()
        return t

    def _exit(self, name: str) -> None:
        with self.cv:
            self.threads.pop(name, None)
            self._exited.add(name)
            if self.running == name and not self.aborted:
                self._schedule()

    # schedule points --------------------------------------------------------------------------
    def point(self, label: str) -> None:
        self._park(None, label)

    def block_until(self, pred, label: str) -> None:
        self._park(pred, label)

    def sleep(self, seconds: float) -> None:
        if self.aborted:  # running free: time still passes, so timeouts still fire
            self.clock += seconds
            time.sleep(0)
            return
        self._park(None, "sleep", wake=self.clock + seconds)

    def _park(self, pred, label: str, wake: float = 0.0) -> None:
        name = getattr(self._local, "name", None)
        if name is None or name not in self.threads or self.aborted:
            return
        with self.cv:
            st = self.threads[name]
            st.parked, st.pred, st.label, st.wake = True, pred, label, wake
            self._schedule()
            while self.running != name and not self.aborted:
                self.cv.wait()
            st.parked = False

    def _schedule(self) -> None:
        enabled = sorted(n for n, t in self.threads.items() if t.parked and (t.pred is None or t.pred()))
        # A sleeping thread lets every other enabled thread go first (a poll loop must not starve
        # the threads it waits for, whatever the strategy's priorities say), and sleepers wake in
        # virtual-time order (two poll loops must not starve each other either).
        awake = [n for n in enabled if self.threads[n].label != "sleep"]
        if awake:
            enabled = awake
        elif enabled:
            # Only sleepers: virtual time jumps to the earliest wake-up; the strategy picks among ties.
            first = min(self.threads[n].wake for n in enabled)
            enabled = [n for n in enabled if self.threads[n].wake == first]
            self.clock = max(self.clock, first)
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
    case: object = field(repr=False, default=None)

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


def run_case(case, strategy, *, trace_path: str | None = None) -> Outcome:
    """Run one controlled schedule of `case` (a prefill Case or a PDCase) and judge it."""
    if isinstance(case, PDCase):
        return run_pd_case(case, strategy, trace_path=trace_path)
    import tempfile

    import torch

    from checker.linear import check_file
    from engine.run import run_prefill
    from engine.trace import Tracer

    cfg, wc = case.configs()
    tracer = Tracer()
    ctl = Controller(strategy)
    ctl.install("scheduler")
    try:
        summary = run_prefill(cfg, wc, tracer=tracer, keep_scheduler=True)
    finally:
        ctl.uninstall()
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
    return Outcome(failures, list(ctl.choices), len(tracer.events), tracer.events, tracer.header, case=case)


# ---- one PD case: prefill DP ranks + bootstrap + decode, in one process --------------------------
@dataclass
class PDCase(Case):
    """A whole PD run (engine/pd.py) under the controller: the prefill case's workload and engine
    knobs (`mode` is the prefill ranks' loop), plus the decode's knobs, client aborts, memory release,
    bootstrap latency and failures. Every thread (each rank's scheduler, forward worker, streams and
    KV transfer thread; the decode scheduler, its streams and prefetch workers) is a managed thread;
    the bootstrap server is served in-process."""
    kind: str = "pd"
    decode_loop: str = "overlap"
    prefetch: bool = True
    dp: int = 2
    max_new_tokens: int = 3
    polling_interval: int = 1         # the decode polls its prealloc/transfer queues every N iterations
    decode_slots: int = 64            # decode max_slots: few slots keep resolved requests pending
    unserved: int = 0                 # decode-only requests for rooms no prefill rank serves (never registered)
    aborts: tuple = ()                # ((iteration, k), ...): after that iteration's prefetch the client
                                      # aborts the k-th (mod n) pending request, else the k-th unfinished
                                      # one; k = -1: all of them (clients going away together)
    release: tuple = ()               # (k, n): release_memory_occupation right after the prefetch that
                                      # submitted the decode's k-th query (while it is in flight, the
                                      # case D-release-cancels is about); resume_memory n iterations later
    latency_ms: float = 0.0           # bootstrap latency (virtual time), on latency_scope
    latency_scope: str = "query_dp_ranks"
    failure_rate: float = 0.0         # fraction of query_dp_ranks answered 503 (seeded by fault_seed)
    fault_seed: int = 0
    prefill_delay_ms: float = 0.0     # prefill ranks register late: decode sees 503 until then

    def configs(self):
        from engine.decode.config import DecodeConfig

        cfg, wc = super().configs()
        wc = dataclasses.replace(wc, max_new_tokens=self.max_new_tokens)
        # Virtual time: the clock moves only when every thread sleeps, so the bounds are in idle time.
        dc = DecodeConfig(loop=self.decode_loop, prefetch=self.prefetch, polling_interval=self.polling_interval,
                          max_slots=self.decode_slots, num_pages=256, max_running=8, query_retries=0,
                          query_timeout_s=0.02, bootstrap_timeout_s=0.03, kv_timeout_s=1.0,
                          info_retry_interval_s=0.001)
        return cfg, wc, dc


CLIENT_ABORT = "client went away"
_GEN_CACHE: dict = {}
_MODELS: dict = {}
_RULES: list = []


def _model(cfg):
    """One TinyLlama per model config, shared by the runs (its weights are only read)."""
    key = (cfg.model, cfg.seed, cfg.dtype, cfg.device)
    if key not in _MODELS:
        import torch

        from engine.model import TinyLlama
        _MODELS[key] = TinyLlama(cfg.model_config, seed=cfg.seed, dtype=getattr(torch, cfg.dtype),
                                 device=torch.device(cfg.device))
    return _MODELS[key]


def _rules():
    if not _RULES:
        from spec import load_rules
        _RULES.extend(load_rules())
    return _RULES


def _reference_tokens(cfg, r):
    key = (cfg.model, cfg.seed, cfg.dtype, tuple(r.prompt), tuple(sorted((r.logit_bias or {}).items())),
           r.max_new_tokens)
    if key not in _GEN_CACHE:
        from engine.reference import reference_generate
        _GEN_CACHE[key] = reference_generate(cfg, [r], model=_model(cfg))[r.rid]
    return _GEN_CACHE[key]


def _pd_hooks(case: PDCase):
    aborts = sorted(case.aborts)
    release = tuple(case.release)
    state = {"seen": set(), "released_at": None}

    def after_prefetch(sched):
        for it, k in aborts:
            if it == sched.iter:
                live = list(sched.prealloc.pending) or sorted(
                    (r for r in sched.by_room.values() if r.state not in ("new", "done", "aborted")),
                    key=lambda r: r.room)
                for r in (live if k < 0 else [live[k % len(live)]] if live else []):
                    sched.abort(r, CLIENT_ABORT)
        if release:
            nth, after = release
            state["seen"].update(p.qid for p in sched.prealloc._queries.values())
            if state["released_at"] is None and len(state["seen"]) >= nth:
                state["released_at"] = sched.iter
                sched.release_memory_occupation()
            elif state["released_at"] is not None and sched.iter == state["released_at"] + max(1, after):
                sched.resume_memory_occupation()

    return {"after_prefetch": after_prefetch}


def _expected_abort(case: PDCase, dc, rid: str, reason: str) -> bool:
    """An abort is the documented outcome (docs/decode.md) of a client abort, of a room no prefill
    serves, and of bootstrap faults that last (queries failing or slower than their timeout);
    anything else is a failure."""
    if reason == CLIENT_ABORT or rid.startswith("x"):
        return True
    faulty = case.failure_rate > 0 or case.latency_ms / 1000.0 >= dc.query_timeout_s
    return faulty and any(k in reason for k in ("unknown to the bootstrap server", "DP-rank query",
                                                 "prefill parallel info"))


def run_pd_case(case: PDCase, strategy, *, trace_path: str | None = None) -> Outcome:
    """Run one controlled schedule of a PD case and judge it: every trace (decode, each prefill rank)
    against its rules plus the cross rules, every finished request's tokens against the reference,
    every abort (only the documented ones, `_expected_abort`), and leaks on both sides."""
    import os
    import shutil
    import tempfile

    from checker.linear import check_files
    from engine.decode.request import DecodeReq
    from engine.pd import run_pd

    cfg, wc, dc = case.configs()
    extra = [DecodeReq(f"x{i}", 5000 + i, None, [1 + (i + j) % 7 for j in range(5)], case.max_new_tokens)
             for i in range(case.unserved)]

    def faults(server):
        server.set_faults(latency_s=case.latency_ms / 1000.0, latency_scope=case.latency_scope,
                          failure_rate=case.failure_rate, seed=case.fault_seed)

    tmp = None if trace_path else tempfile.mkdtemp(prefix="pdo-fuzz-pd-")
    stem = trace_path or os.path.join(tmp, "t.jsonl")
    ctl = Controller(strategy, max_steps=60_000)
    ctl.install("main")
    summary, error = None, None
    try:
        summary = run_pd(cfg, wc, dc, dp=case.dp, trace_path=stem, hooks=_pd_hooks(case), extra_decode_reqs=extra,
                         prefill_delay_s=case.prefill_delay_ms / 1000.0, verify=False, server_hook=faults,
                         bootstrap="inproc", model=_model(cfg))
    except Exception as exc:  # noqa: BLE001 - judged below
        error = exc
    finally:
        ctl.uninstall()
    failures = []
    if ctl.error is not None:
        failures.append(f"schedule: {ctl.error}")
    if error is not None:
        failures.append(f"engine error: {error!r}"[:300])
    trace = []
    if summary is not None:
        results = check_files(summary["traces"], rules=_rules())
        for rid in dict.fromkeys(v.rule.id for r in results for v in r.violations):
            failures.append(f"rule {rid}")
        dreqs = {r.rid: r for r in extra}
        from engine.pd import decode_requests
        from engine.workload import make_workload
        for r in decode_requests(make_workload(wc, cfg.model_config.vocab_size), "-"):
            dreqs[r.rid] = r
        for rid, toks in summary["outputs"].items():
            if toks != _reference_tokens(cfg, dreqs[rid]):
                failures.append(f"output: {rid} tokens {toks} != reference {_reference_tokens(cfg, dreqs[rid])}")
        for rid, reason in summary["aborted"].items():
            if not _expected_abort(case, dc, rid, reason):
                failures.append(f"output: {rid} aborted: {reason}"[:300])
        leaks = {k: v for k, v in summary["decode_leaks"].items() if v}
        for i, p in enumerate(summary["prefill_leaks"]):
            leaks.update({f"prefill{i}.{k}": v for k, v in p.items() if v})
        if leaks:
            failures.append("leak: " + ", ".join(f"{k}={v}" for k, v in leaks.items()))
        for p in summary["traces"]:
            with open(p) as f:
                trace.extend(json.loads(line) for line in list(f)[1:])
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    order = ("rule", "output", "leak", "engine", "schedule")
    failures.sort(key=lambda f: next((i for i, p in enumerate(order) if f.startswith(p)), len(order)))
    return Outcome(failures, list(ctl.choices), len(trace), trace, {}, case=case)


def draw_pd_case(rng: random.Random, **fixed) -> PDCase:
    """A random PD case (the seeded counterpart of the Hypothesis strategy in tests/test_fuzz.py)."""
    ps = rng.choice([1, 4, 8])
    c = dict(
        mode=rng.choice(["normal", "overlap", "thread", "ahead"]), decode_loop=rng.choice(["normal", "overlap"]),
        dp=rng.choice([1, 2, 2, 3]), requests=rng.randint(2, 6), prompt_len=(8, rng.choice([16, 40])),
        hit=rng.choice([0.0, 0.5, 0.8]), max_new_tokens=rng.randint(1, 4), page_size=ps,
        chunk_size=4 * ps, max_batch_tokens=6 * ps, workload_seed=rng.randrange(1000),
        arrival=rng.choice(["burst", "poisson"]), polling_interval=rng.choice([1, 1, 2, 3]),
        decode_slots=rng.choice([1, 2, 64, 64]), unserved=rng.choice([0, 1, 1, 2]),
        aborts=tuple((rng.randint(2, 8), rng.randrange(-1, 4)) for _ in range(rng.choice([0, 1, 2, 3]))),
        release=(rng.randint(1, 4), rng.randint(1, 4)) if rng.random() < 0.4 else (),
        latency_ms=rng.choice([0.0, 0.0, 0.5, 3.0]), latency_scope=rng.choice(["query_dp_ranks", "all"]),
        failure_rate=rng.choice([0.0, 0.0, 0.3]), fault_seed=rng.randrange(100),
        prefill_delay_ms=rng.choice([0.0, 0.0, 1.0]))
    c.update(fixed)
    return PDCase(**c)


def make_strategy(name: str, seed: int, *, depth: int = 3, steps: int = 400):
    """`steps`: the run length PCT spreads its priority-change points over (about the schedule length)."""
    if name == "random":
        return RandomWalk(seed)
    if name == "pct":
        return PCT(seed, depth=depth, steps=steps)
    raise ValueError(f"unknown strategy {name!r}; choose pct, random or dfs")


def pct_steps(case) -> int:
    return 1000 if isinstance(case, PDCase) else 400


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


_PD_SIMPLER = (("unserved", 0), ("aborts", ()), ("release", ()), ("failure_rate", 0.0), ("latency_ms", 0.0),
               ("prefill_delay_ms", 0.0), ("decode_slots", 64), ("polling_interval", 1), ("dp", 1),
               ("max_new_tokens", 1), ("arrival", "burst"))


def _same_failure(a: str, b: str) -> bool:
    """A rule violation must stay the same rule; other failures the same kind (output, leak, ...)."""
    if a.startswith("rule ") or b.startswith("rule "):
        return a == b
    return a.split(":")[0].split(" ")[0] == b.split(":")[0].split(" ")[0]


def shrink(case, schedule: list[str], failures: list[str], *, budget: int = 40):
    """Make a failing case smaller: fewer requests, then (PD) no faults, aborts or other complications
    it does not need, then the shortest schedule prefix (the rest non-preemptive) that still fails
    the same way (the same rule, or the same kind of failure)."""
    first = failures[0]

    def fails(c, s):
        out = run_case(c, Replay(s, strict=False))
        return out if out.failed and _same_failure(out.failures[0], first) else None

    best_out = None
    tries = 0
    while case.requests > 1 and tries < budget:
        tries += 1
        smaller = dataclasses.replace(case, requests=case.requests - 1)
        out = fails(smaller, schedule)
        if out is None:
            break
        case, best_out = smaller, out
    if isinstance(case, PDCase):
        for name, simple in _PD_SIMPLER:
            if tries >= budget or getattr(case, name) == simple:
                continue
            tries += 1
            simpler = dataclasses.replace(case, **{name: simple})
            out = fails(simpler, schedule)
            if out is not None:
                case, best_out = simpler, out
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


def find_bug(case, strategy: str, *, schedules: int, seed: int, on_progress=None, draw=None):
    """Run up to `schedules` schedules; return (index, outcome) of the first failing one, or
    (None, events checked). `draw(i)`, if given, makes a fresh case for schedule i (the outcome
    carries it as `.case`)."""
    if strategy == "dfs":
        runs = (out for _, out in dfs_schedules(case, limit=schedules))
    else:
        def runs_():
            for i in range(schedules):
                c = draw(i) if draw is not None else case
                yield run_case(c, make_strategy(strategy, seed * 100_003 + i, steps=pct_steps(c)))
        runs = runs_()
    events = 0
    for i, out in enumerate(runs):
        events += out.events
        if on_progress:
            on_progress(i + 1, events, out.failed)
        if out.failed:
            return i, out
    return None, events


def pd_draws(seed: int, **fixed):
    """The case draw for PD campaigns: schedule i of seed s runs draw_pd_case(Random(s*100003+i))."""
    return lambda i: draw_pd_case(random.Random(seed * 100_003 + i), **fixed)


def save_case(path: str, case, schedule: list[str], failures: list[str], **extra) -> None:
    with open(path, "w") as f:
        json.dump({"case": dataclasses.asdict(case), "schedule": schedule, "failures": failures, **extra}, f, indent=1)


def load_case(path: str):
    try:
        with open(path) as f:
            d = json.load(f)
        c = d["case"]
        c["inject"] = tuple(c.get("inject", ()))
        c["prompt_len"] = tuple(c.get("prompt_len", (8, 40)))
        if c.get("kind") == "pd":
            c["aborts"] = tuple(tuple(a) for a in c.get("aborts", ()))
            c["release"] = tuple(c.get("release", ()))
            case = PDCase(**c)
        else:
            case = Case(**c)
        return case, list(d["schedule"]), d
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a pdo fuzz case file ({exc})") from None


def timed(fn, *a, **k):
    t = time.perf_counter()
    r = fn(*a, **k)
    return r, time.perf_counter() - t
