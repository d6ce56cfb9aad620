"""Running one case under one strategy, and judging it: the trace rules, the outputs against the
single-process reference, aborts (PD cases: only the documented ones) and leaks.

The engine's torch-heavy modules are imported where a case first runs: `pdo` loads the fuzz CLI,
and with it this harness, at every start-up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field

from checker.linear import check_file, check_files
from checker.refine import check_model
from engine import sync
from engine.decode.request import DecodeReq, ReqState
from engine.trace.tracer import Tracer
from spec import load_rules

from .cases import PDCase
from .controller import Controller
from .pressure import pd_run_stats, prefill_run_stats

CLIENT_ABORT = "client went away"
# failures are listed by kind, in this order (a rule violation first: it names the bug)
_FAILURE_ORDER = ("rule", "output", "leak", "engine", "schedule")

_GEN_CACHE: dict = {}
_RULES: list = []
# After uninstall, how long (wall seconds, all threads together) a run's threads get to exit
# before a survivor is reported: only a thread stuck outside the controller takes that long.
JOIN_TIMEOUT_S = 10.0
# Refinement (the third judge) costs a z3 query per trace, more than the run itself on small cases:
# a campaign judges it on every MODEL_EVERY-th schedule (by index, so any process judges the same
# ones); a replay judges it when the run that saved the case did.
MODEL_EVERY = 8
MODEL_TIMEOUT_MS = 20_000


@dataclass
class Outcome:
    failures: list[str]
    schedule: list[str]
    events: int
    trace: list[dict] = field(repr=False, default_factory=list)
    header: dict = field(repr=False, default_factory=dict)
    case: object = field(repr=False, default=None)
    # the run's memory counters (checker/fuzz/pressure.py), summed into the campaign statistics
    stats: dict = field(repr=False, default_factory=dict)
    model: bool = False  # whether refinement was judged (a saved case replays with the same judges)
    # what the judges judged: "rules" (traces checked), "outputs" (1: outputs compared with the
    # reference), "model_refines" / "model_drift" / "model_outside" (not judged: a run the model
    # leaves out) / "model_timeout" (not judged: z3 out of time) / "model_unknown" (a role with no
    # loop model): traces, by refinement verdict
    judged: dict = field(repr=False, default_factory=dict)
    _digest: str | None = field(repr=False, default=None)

    @property
    def digest(self) -> str:
        """A hash of the schedule and the trace's events without `t_ns`: equal for two runs that
        took the same steps and logged the same events."""
        if self._digest is None:
            events = [{k: v for k, v in e.items() if k != "t_ns"} for e in self.trace]
            blob = json.dumps([self.schedule, events], sort_keys=True, default=str)
            self._digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
        return self._digest

    def slim(self) -> Outcome:
        """The outcome without its trace (the digest kept): what a worker process sends back."""
        return dataclasses.replace(self, trace=[], header={}, _digest=self.digest)

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    @property
    def killed_by(self) -> str | None:
        return self.failures[0] if self.failures else None


def _sorted_failures(failures: list[str]) -> None:
    failures.sort(
        key=lambda f: next(
            (i for i, p in enumerate(_FAILURE_ORDER) if f.startswith(p)), len(_FAILURE_ORDER)
        )
    )


def _uninstall(ctl: Controller) -> list[str]:
    """Uninstall `ctl` and wait for every thread it started: one still alive (after an abort, a
    thread blocked outside the controller) is a failure of this schedule, never left to run into
    the next one."""
    ctl.uninstall()
    return [f"schedule: thread {n} did not exit" for n in ctl.join_all(JOIN_TIMEOUT_S)]


def _run_failures(ctl: Controller, error, survivors=()) -> list[str]:
    """The failures of the run itself: the schedule (deadlock, step limit, threads that did not
    exit) and an engine error."""
    failures = []
    if ctl.error is not None:
        failures.append(f"schedule: {ctl.error}")
    failures += survivors
    if error is not None:
        failures.append(f"engine error: {error!r}"[:300])
    return failures


def _leak_failure(leaks: dict) -> list[str]:
    return ["leak: " + ", ".join(f"{k}={v}" for k, v in leaks.items())] if leaks else []


def _rule_failures(results) -> list[str]:
    rule_ids = dict.fromkeys(v.rule.id for r in results for v in r.violations)
    return [f"rule {rid}" for rid in rule_ids]


def _model_failures(paths, judged: dict, timeout_ms: int = MODEL_TIMEOUT_MS) -> list[str]:
    """The third judge: each prefill trace a schedule of the loop model of its mode, the decode
    trace of a PD case one of the decode loop model (checker/refine.py; a decode run the model
    leaves out is not judged); a drift names the engine groups the conflict needs, a verdict that
    is the same in every process (the events of the conflict are one of several: `pdo check
    --model` on the trace shows them). Counts each trace's verdict into `judged`."""
    failures = []
    for path in paths:
        check = check_model(path, timeout_ms=timeout_ms)
        verdict = "refines" if check.ok else "drift" if check.judged else "unknown"
        if verdict == "unknown" and check.answer is not None:
            # z3 out of time ("canceled", "timeout") or a run the model leaves out (the reason)
            verdict = "timeout" if check.answer.reason in ("canceled", "timeout") else "outside"
        judged[f"model_{verdict}"] = judged.get(f"model_{verdict}", 0) + 1
        if check.judged and not check.ok:
            a = check.answer
            reason = f": {a.reason}" if a.reason else ""
            failures.append(f"model {'+'.join(a.groups) or 'E:emits'}{reason}")
    return failures


def run_case(
    case,
    strategy,
    *,
    trace_path: str | None = None,
    model: bool = False,
    model_timeout_ms: int = MODEL_TIMEOUT_MS,
) -> Outcome:
    """Run one controlled schedule of `case` (a prefill Case or a PDCase) and judge it; `model`:
    also judge refinement of the loop model (the campaigns do on every MODEL_EVERY-th schedule),
    z3 given `model_timeout_ms` per trace (past it the trace is not judged)."""
    run = run_pd_case if isinstance(case, PDCase) else run_prefill_case
    return run(
        case, strategy, trace_path=trace_path, model=model, model_timeout_ms=model_timeout_ms
    )


# ---- one prefill case ----------------------------------------------------------------------------
def _prefill_output_failures(summary) -> list[str]:
    """Every output against the reference (engine/oracle/judge.py: first tokens, the KV the receiver got,
    AttentionStore entries, the prefix-cache pages requests matched); judged on every run, a rule
    violation or not."""
    return [f"output: {m}" for m in summary["verify"]["mismatches"]]


def run_prefill_case(
    case,
    strategy,
    *,
    trace_path: str | None = None,
    model: bool = True,
    model_timeout_ms: int = MODEL_TIMEOUT_MS,
) -> Outcome:
    """Run one controlled schedule of a prefill case and judge it: the trace against its rules, each
    request's output against the reference, and leaks."""
    from engine.runs.prefill_run import run_prefill  # lazy: imports torch

    tracer = Tracer()
    ctl = Controller(strategy)
    ctl.install("scheduler")
    try:
        run = run_prefill(case.spec(), tracer=tracer, keep_error=True)
        # Still under control: the worker, streams and transfer thread were told to stop; let them
        # exit as scheduled steps, so none runs on uncontrolled after uninstall. (A saved schedule
        # shorter than this replays these steps non-preemptively.)
        sync.quiesce("prefill.quiesce")
    finally:
        survivors = _uninstall(ctl)
    failures = _run_failures(ctl, run.error, survivors)
    if trace_path is None:
        fd, path = tempfile.mkstemp(suffix=".jsonl", prefix="pdo-fuzz-")
        os.close(fd)
    else:
        path = trace_path
    judged = {"rules": 1, "outputs": 1}
    try:
        tracer.write(path, extra_header={"schedule_steps": len(ctl.choices)})
        failures += _rule_failures([check_file(path)])
        if model:
            failures += _model_failures([path], judged, model_timeout_ms)
    finally:
        if trace_path is None:
            os.unlink(path)
    failures += _prefill_output_failures(run.summary)
    failures += _leak_failure({k: v for k, v in run.summary["leaks"].items() if v})
    _sorted_failures(failures)
    return Outcome(
        failures,
        list(ctl.choices),
        len(tracer.events),
        tracer.events,
        tracer.header,
        case=case,
        stats=prefill_run_stats(run.summary),
        model=model,
        judged=judged,
    )


# ---- one PD case: prefill DP ranks + bootstrap + decode, in one process --------------------------
def _rules():
    if not _RULES:
        _RULES.extend(load_rules())
    return _RULES


def _reference_tokens(cfg, req):
    key = (
        cfg.model,
        cfg.seed,
        cfg.dtype,
        tuple(req.prompt),
        tuple(sorted((req.logit_bias or {}).items())),
        req.max_new_tokens,
    )
    if key not in _GEN_CACHE:
        from engine.oracle.reference import reference_generate  # lazy: imports torch

        _GEN_CACHE[key] = reference_generate(cfg, [req])[req.rid]
    return _GEN_CACHE[key]


def _pd_hooks(case: PDCase):
    """The decode scheduler's hook after each prefetch: the case's client aborts and its memory
    release and resume."""
    aborts = sorted(case.aborts)
    release = tuple(case.release)
    state = {"seen": set(), "released_at": None}

    def after_prefetch(sched):
        for it, k in aborts:
            if it == sched.iter:
                unfinished = (
                    r
                    for r in sched.by_room.values()
                    if r.state is not ReqState.NEW and not r.state.over
                )
                live = list(sched.prealloc.pending) or sorted(unfinished, key=lambda r: r.room)
                for r in live if k < 0 else [live[k % len(live)]] if live else []:
                    sched.abort(r, CLIENT_ABORT)
        if release:
            nth, after = release
            state["seen"].update(p.qid for p in sched.prealloc._queries.values())
            if state["released_at"] is None and len(state["seen"]) >= nth:
                state["released_at"] = sched.iter
                sched.release_memory_occupation()
            elif state["released_at"] is not None and sched.iter == state["released_at"] + max(
                1, after
            ):
                sched.resume_memory_occupation()

    return {"after_prefetch": after_prefetch}


def _expected_abort(case: PDCase, decode_cfg, rid: str, reason: str) -> bool:
    """An abort is the documented outcome (docs/decode.md) of a client abort, of a room no prefill
    serves, and of bootstrap faults that last (queries failing or slower than their timeout);
    anything else is a failure."""
    if reason == CLIENT_ABORT or rid.startswith("x"):
        return True
    faulty = case.failure_rate > 0 or case.latency_ms / 1000.0 >= decode_cfg.query_timeout_s
    return faulty and any(
        k in reason
        for k in ("unknown to the bootstrap server", "DP-rank query", "prefill parallel info")
    )


def _unserved_requests(case: PDCase) -> list:
    """Decode-only requests for rooms no prefill rank serves."""
    return [
        DecodeReq(f"x{i}", 5000 + i, None, [1 + (i + j) % 7 for j in range(5)], case.max_new_tokens)
        for i in range(case.unserved)
    ]


def _run_pd(case: PDCase, ctl: Controller, spec, extra):
    """engine/runs/pd.py's run_pd under `ctl`, with the case's hooks and bootstrap faults: (its
    PDResult, the failures of threads that did not exit)."""
    from engine.runs.pd import run_pd  # lazy: imports torch

    def faults(server):
        server.set_faults(
            latency_s=case.latency_ms / 1000.0,
            latency_scope=case.latency_scope,
            failure_rate=case.failure_rate,
            seed=case.fault_seed,
        )

    hooks = _pd_hooks(case)
    ctl.install("main")
    try:
        run = run_pd(
            spec, hooks=hooks, server_hook=faults, extra_decode_reqs=extra, keep_error=True
        )
    finally:
        survivors = _uninstall(ctl)
    return run, survivors


def _pd_output_failures(case, run) -> list[str]:
    """Every finished request's tokens against the reference; every abort not documented."""
    failures = []
    cfg = run.decode.cfg
    for r in run.decode.done:
        ref = _reference_tokens(cfg, r)
        if r.output != ref:
            failures.append(f"output: {r.rid} tokens {r.output} != reference {ref}")
    for rid, reason in run.summary["aborted"].items():
        if not _expected_abort(case, run.decode.dc, rid, reason):
            failures.append(f"output: {rid} aborted: {reason}"[:300])
    return failures


def _pd_leaks(summary) -> dict:
    leaks = {k: v for k, v in summary["decode_leaks"].items() if v}
    for i, p in enumerate(summary["prefill_leaks"]):
        leaks.update({f"prefill{i}.{k}": v for k, v in p.items() if v})
    return leaks


def _read_traces(paths) -> list[dict]:
    """The events of the trace files, one after the other (headers left out)."""
    trace = []
    for p in paths:
        with open(p) as f:
            trace.extend(json.loads(line) for line in list(f)[1:])
    return trace


def run_pd_case(
    case: PDCase,
    strategy,
    *,
    trace_path: str | None = None,
    model: bool = True,
    model_timeout_ms: int = MODEL_TIMEOUT_MS,
) -> Outcome:
    """Run one controlled schedule of a PD case and judge it: every trace (decode, each prefill
    rank) against its rules plus the cross rules, every finished request's tokens against the
    reference, every abort (only the documented ones, `_expected_abort`), and leaks on both
    sides."""
    spec = case.spec()
    tmp = None if trace_path else tempfile.mkdtemp(prefix="pdo-fuzz-pd-")
    spec.trace_path = trace_path or os.path.join(tmp, "t.jsonl")
    ctl = Controller(strategy, max_steps=60_000)
    run, survivors = _run_pd(case, ctl, spec, _unserved_requests(case))
    failures = _run_failures(ctl, run.error, survivors)
    trace, judged, summary = [], {}, run.summary
    if summary is not None:
        judged = {"rules": len(summary["traces"]), "outputs": 1}
        failures += _rule_failures(check_files(summary["traces"], rules=_rules()))
        if model:
            failures += _model_failures(summary["traces"], judged, model_timeout_ms)
        failures += _pd_output_failures(case, run)
        failures += _leak_failure(_pd_leaks(summary))
        trace = _read_traces(summary["traces"])
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    _sorted_failures(failures)
    stats = pd_run_stats(summary) if summary is not None else {}
    return Outcome(
        failures,
        list(ctl.choices),
        len(trace),
        trace,
        {},
        case=case,
        stats=stats,
        model=model,
        judged=judged,
    )
