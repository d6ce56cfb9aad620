"""`pdo check --predict --confirm`: run a predicted reordering under the schedule controller.

A prediction (checker/predict.py) says: event `second` could have run before event `first`. The
run is rebuilt from the trace's header (`config`, `workload`) and run under the controller with
`Delay`: the non-preemptive default, except that the thread of `first` is held at that event's
schedule point until `second` has been logged. The prediction is confirmed when the controlled
trace breaks the predicted rule. One that cannot be reached means the happens-before clocks missed
an order the engine enforces (a hand-off engine/sync/hb.py does not see): a bug there.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from dataclasses import dataclass

from checker.linear import check_file
from checker.trace_io import iter_chunks
from engine import sync
from engine.runs.spec import RunSpec
from engine.trace.tracer import Tracer
from spec.errors import BadInput

from .controller import Controller

# a whole PD run at the non-preemptive default takes far fewer; a run past it ends as a run error
PD_MAX_STEPS = 2_000_000
# sleeping threads (poll loops) woken, one step each, while the held thread waits for the second
# event: past them the order is taken as unreachable
HOLD_SLEEPS = 500


@dataclass
class Confirmation:
    confirmed: bool
    line: str


class Delay:
    """Hold `thread` at schedule point `ev` while `tracer` has logged exactly `k` events `ev`
    (its next one would be the k-th, as in the original trace) and at most `k2` events `ev2`.
    `tracer` may be set once the run has built it (a PD run's role tracers, `run_pd`'s `tracers`
    hook); until then nothing is held."""

    name = "delay"

    def __init__(self, tracer: Tracer | None, thread: str, ev: str, k: int, ev2: str, k2: int):
        self.tracer, self.thread, self.ev, self.k, self.ev2, self.k2 = (
            tracer,
            thread,
            ev,
            k,
            ev2,
            k2,
        )
        self.seen = 0
        self.counts: Counter = Counter()
        self.held = self.forced = False
        self.slept = 0  # sleeping threads woken while the held one waits

    def choose(self, enabled, running, step):
        if self.tracer is not None:
            for ev, _ in self.tracer.names_and_fields(self.seen):
                self.counts[ev] += 1
                self.seen += 1
        ctl = sync.CONTROLLER
        waiting = self.counts[self.ev] == self.k and self.counts[self.ev2] <= self.k2
        if waiting and self.thread in enabled and ctl.threads[self.thread].label == self.ev:
            others = [n for n in enabled if n != self.thread]
            if others:
                self.held = True
                return running if running in others else others[0]
            sleeper = self._sleeper(ctl)
            if sleeper is not None:
                self.held = True
                return sleeper
            self.forced = True  # nothing else can run: the predicted order is not reachable
        return running if running in enabled else enabled[0]

    def _sleeper(self, ctl):
        """The sleeping thread to wake while the held one waits, virtual time moved to its wake-up
        (the controller offers sleepers only when no thread is awake, and the held one is): time
        passes while a thread is held, and a poll loop may be what would unblock the second
        event's thread. At most HOLD_SLEEPS of them, so a hold that nothing ends, ends."""
        asleep = [
            (t.wake, n)
            for n, t in ctl.threads.items()
            if n != self.thread and t.parked and t.label == "sleep"
        ]
        if not asleep or self.slept >= HOLD_SLEEPS:
            return None
        self.slept += 1
        wake, name = min(asleep)
        ctl.clock = max(ctl.clock, wake)
        return name


def confirm(path: str, header: dict, prediction) -> Confirmation:
    """Replay the run of `path` with `prediction.second` forced ahead of `prediction.first`."""
    events = [e for chunk in iter_chunks(path) for e in chunk]
    a, b = prediction.first, prediction.second
    k = sum(1 for e in events if e["ev"] == a["ev"] and e["seq"] < a["seq"])
    k2 = sum(1 for e in events if e["ev"] == b["ev"] and e["seq"] < b["seq"])
    if header.get("role") == "decode" or "dp_rank" in header:
        return _confirm_pd(path, header, prediction, k, k2)
    if header.get("role") != "prefill":
        return Confirmation(False, "not confirmed: --confirm replays prefill and PD runs only")
    return _confirm_prefill(path, header, prediction, k, k2)


def _confirm_prefill(path: str, header: dict, prediction, k: int, k2: int) -> Confirmation:
    from engine.runs.prefill_run import run_prefill  # lazy: imports torch

    spec = RunSpec.from_header(header, path)
    spec.verify = False
    a, b = prediction.first, prediction.second
    tracer = Tracer()
    delay = Delay(tracer, a["thread"], a["ev"], k, b["ev"], k2)
    ctl = Controller(delay)
    ctl.install("scheduler")
    try:
        run = run_prefill(spec, tracer=tracer, keep_error=True)
        sync.quiesce("confirm.quiesce")
    finally:
        ctl.uninstall()
        ctl.join_all(10.0)
    return _verdict(tracer, prediction, ctl, delay, run.error)


def _confirm_pd(path: str, header: dict, prediction, k: int, k2: int) -> Confirmation:
    """A PD role's trace: the whole PD run rebuilt (every rank and the decode, one process, as
    `pdo run --pd`), the first event's thread held in that role."""
    from engine.runs.pd import run_pd  # lazy: imports torch

    spec = RunSpec.from_header(header, path)
    run = header.get("pd_run")
    if not isinstance(run, dict) or not isinstance(header.get("decode_config"), dict):
        raise BadInput(f"{path}: header lacks 'pd_run' or 'decode_config': cannot rebuild the run")
    if run.get("unrecorded"):
        return Confirmation(
            False,
            f"not confirmed: the run was given {', '.join(run['unrecorded'])}, which its header "
            "does not record: cannot rebuild it",
        )
    role = "decode" if header["role"] == "decode" else f"prefill{header['dp_rank']}"
    a, b = prediction.first, prediction.second
    # under the controller a role's threads are "<role>/<thread>" (engine/runs/pd.py, _run_roles)
    delay = Delay(None, f"{role}/{a['thread']}", a["ev"], k, b["ev"], k2)

    def tracers(by_role):
        delay.tracer = by_role[role]

    ctl = Controller(delay, max_steps=PD_MAX_STEPS)
    ctl.install("main")
    try:
        with tempfile.TemporaryDirectory(prefix="pdo-confirm-pd-") as d:
            # real tracers; the files are not read
            spec.trace_path, spec.verify, spec.bootstrap = (
                os.path.join(d, "t.jsonl"),
                False,
                "inproc",
            )
            error = run_pd(spec, hooks={"tracers": tracers}, keep_error=True).error
    finally:
        ctl.uninstall()
        ctl.join_all(10.0)
    if delay.tracer is None:
        return Confirmation(False, f"not confirmed: the PD run did not start ({error!r})")
    return _verdict(delay.tracer, prediction, ctl, delay, error)


def _verdict(tracer: Tracer, prediction, ctl: Controller, delay: Delay, err) -> Confirmation:
    """Whether the controlled run's trace breaks the predicted rule."""
    fd, out = tempfile.mkstemp(suffix=".jsonl", prefix="pdo-confirm-")
    os.close(fd)
    try:
        tracer.write(out, reason="exception" if err else "normal")
        result = check_file(out)
    finally:
        os.unlink(out)
    broken = sorted({v.rule.id for v in result.violations})
    rule = prediction.rule.id
    steps = f"{len(ctl.choices)} schedule steps"
    if rule in broken:
        return Confirmation(True, f"CONFIRMED {rule}: the engine breaks it when forced ({steps})")
    if delay.forced or delay.held:
        why = (
            f"nothing but the held thread could run ({delay.slept} wake-ups of sleeping threads "
            "included)"
            if delay.forced
            else "no violation"
        )
        tail = "an order the happens-before clocks do not see"
    else:
        why = "the first event's schedule point was never reached with those counts"
        tail = "the rebuilt run went another way than the trace's"
    extra = f"; broke {', '.join(broken)} instead" if broken else ""
    return Confirmation(
        False,
        f"NOT CONFIRMED {rule}: {why}{extra}{'; run error ' + repr(err) if err else ''} ({steps}): "
        + tail,
    )
