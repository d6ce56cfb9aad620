"""`pdo check --predict --confirm`: run a predicted reordering under the schedule controller.

A prediction (checker/predict.py) says: event `second` could have run before event `first`. The
run is rebuilt from the trace's header (`config`, `workload`) and run under the controller with
`Delay`: the non-preemptive default, except that the thread of `first` is held at that event's
schedule point until `second` has been logged. The prediction is confirmed when the controlled
trace breaks the predicted rule. One that cannot be reached means the happens-before clocks missed
an order the engine enforces (a hand-off engine/hb.py does not see): a bug there.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections import Counter
from dataclasses import dataclass

from checker.linear import check_file
from checker.trace_io import iter_chunks
from engine import sync
from engine.config import EngineConfig
from engine.trace import Tracer
from engine.workload import WorkloadConfig

from .controller import Controller


@dataclass
class Confirmation:
    confirmed: bool
    line: str


class Delay:
    """Hold `thread` at schedule point `ev` while the trace has logged exactly `k` events `ev`
    (its next one would be the k-th, as in the original trace) and at most `k2` events `ev2`."""

    name = "delay"

    def __init__(self, tracer: Tracer, thread: str, ev: str, k: int, ev2: str, k2: int):
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

    def choose(self, enabled, running, step):
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
            self.forced = True  # nothing else can run: the predicted order is not reachable
        return running if running in enabled else enabled[0]


def _configs(header: dict, path: str):
    cfg_d, wl_d = header.get("config"), header.get("workload")
    if not isinstance(cfg_d, dict) or not isinstance(wl_d, dict):
        raise ValueError(f"{path}: header lacks 'config' or 'workload': cannot rebuild the run")
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    cfg_kw = {k: v for k, v in cfg_d.items() if k in names}
    cfg_kw["inject"] = frozenset(cfg_kw.get("inject", ()))
    wl_kw = {
        k: v for k, v in wl_d.items() if k in {f.name for f in dataclasses.fields(WorkloadConfig)}
    }
    if "prompt_len" in wl_kw:
        wl_kw["prompt_len"] = tuple(wl_kw["prompt_len"])
    return EngineConfig(**cfg_kw), WorkloadConfig(**wl_kw)


def confirm(path: str, header: dict, prediction) -> Confirmation:
    """Replay the run of `path` with `prediction.second` forced ahead of `prediction.first`."""
    from engine.run import run_prefill  # lazy: imports torch

    events = [e for chunk in iter_chunks(path) for e in chunk]

    if header.get("role") != "prefill":
        return Confirmation(False, "not confirmed: --confirm replays prefill runs only")
    cfg, wc = _configs(header, path)
    a, b = prediction.first, prediction.second
    k = sum(1 for e in events if e["ev"] == a["ev"] and e["seq"] < a["seq"])
    k2 = sum(1 for e in events if e["ev"] == b["ev"] and e["seq"] < b["seq"])
    tracer = Tracer()
    delay = Delay(tracer, a["thread"], a["ev"], k, b["ev"], k2)
    ctl = Controller(delay)
    ctl.install("scheduler")
    try:
        summary = run_prefill(cfg, wc, tracer=tracer, keep_scheduler=True)
        sync.quiesce("confirm.quiesce")
    finally:
        ctl.uninstall()
        ctl.join_all(10.0)
    fd, out = tempfile.mkstemp(suffix=".jsonl", prefix="pdo-confirm-")
    os.close(fd)
    try:
        tracer.write(out)
        result = check_file(out)
    finally:
        os.unlink(out)
    broken = sorted({v.rule.id for v in result.violations})
    rule = prediction.rule.id
    steps = f"{len(ctl.choices)} schedule steps"
    if rule in broken:
        return Confirmation(True, f"CONFIRMED {rule}: the engine breaks it when forced ({steps})")
    why = "the held thread was the only one able to run" if delay.forced else "no violation"
    err = summary.get("_error")
    extra = f"; broke {', '.join(broken)} instead" if broken else ""
    return Confirmation(
        False,
        f"NOT CONFIRMED {rule}: {why}{extra}{'; run error ' + repr(err) if err else ''} ({steps}): "
        "an order the happens-before clocks do not see",
    )
