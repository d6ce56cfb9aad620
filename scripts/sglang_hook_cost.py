"""Cost of the SGLang adapter on SGLang's scheduler thread, per hooked call and per event: SGLang's
real PD prefill loops on CPU, driven by the conformance harness (`pdo conform sglang`'s prefill
scenarios through prefill_run.run_workload: SGLang's Scheduler, its loops and their callees, on fakes
only where a GPU or the network would be), in four arms interleaved round by round:

    off      the adapter's hooks not installed (SGLang's methods as released)
    hooks    the hooks installed, into a sink that logs nothing (the hooks' own work)
    now      the hooks tracing into today's sink (engine/sglang/sink.py, on the flight recorder)
    BEFORE   the same hooks tracing into the sink of commit BEFORE (default 87a74b3: a json.dumps, a
             write and a flush per event), imported from git with that commit's engine package

Every function the prefill hooks wrap is timed in every arm by an outer timer, the same code in all
arms: the time inside the outermost hooked call (a hooked method calls others) and the number of
hooked calls, nested ones included. The loops are timed apart: their time holds SGLang's unhooked
work and the trace's header too. `added` is (arm - off) / events, paired within a round; the events
are those the hooks logged, read back from the trace (header and trace_end aside), the same in both
logging arms or the script stops. The sink's emit is timed too, in the three arms with a sink (its
timer in each: the sink's share of `added` is an arm's less the hooks arm's). A trace's begin (its
header, its file) and close (the JSON Lines) happen once per trace: reported per trace. By default
one sink takes all of an arm's runs in a round, as one sink takes a server process's events
(--sink-per run: one sink per run, as `pdo conform` makes).

    PYTHONPATH=. .venv/bin/python scripts/sglang_hook_cost.py [--rounds 9] [--reps 3] \
        [--scenario NAME ...] [--before 87a74b3] [--sink-per process|run] [--clock cpu|wall] \
        [--trace-dir D] [--json]

Only the prefill hooks are driven: the decode hooks (engine/sglang/decode.py) are not installed. The
output names the hooked functions the scenarios called, and those attached but never called.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.abc
import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

from engine.sglang import hooks, mutate
from engine.sglang import prefill as prefill_hooks
from engine.sglang import sink as trace_sink
from engine.sglang.conform import prefill_run, prefill_scenarios
from engine.sglang.conform.prefill_fakes import scripted_sender_class
from engine.sglang.conform.prefill_scheduler import sglang
from engine.trace.recorder import Recorder

REPO = Path(__file__).resolve().parents[1]
# The timers' clock: the scheduler thread's CPU time (user and system: a write's syscall counts), which
# other processes on a shared machine do not inflate; --clock wall for elapsed time.
CLOCKS = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}
CLOCK = [CLOCKS["cpu"]]


# ---- the BEFORE arm's sink: a commit's engine package, imported from git ------------------------
class CommitEngine(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `<alias>.x.y` from `engine/x/y.py` (or its package) as it is in `commit`, so that a
    module's relative imports resolve within that commit's tree and nothing of today's `engine` is
    replaced."""

    def __init__(self, commit: str):
        self.commit = commit
        self.alias = f"pdo_engine_{commit}"
        out = subprocess.run(
            ["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", commit, "engine"],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0 or not out.stdout:
            raise ValueError(out.stderr.strip() or "no engine package in that commit")
        self.files = set(out.stdout.split())

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.alias and not fullname.startswith(self.alias + "."):
            return None
        rel = "engine" + fullname[len(self.alias) :].replace(".", "/")
        if f"{rel}/__init__.py" in self.files:
            spec = importlib.util.spec_from_loader(fullname, self, is_package=True)
            spec.loader_state = f"{rel}/__init__.py"
            return spec
        if f"{rel}.py" in self.files:
            spec = importlib.util.spec_from_loader(fullname, self)
            spec.loader_state = f"{rel}.py"
            return spec
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        path = module.__spec__.loader_state
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{self.commit}:{path}"],
            capture_output=True,
            check=True,
        ).stdout
        exec(compile(source, f"{self.commit}:{path}", "exec"), module.__dict__)

    def sink_module(self) -> types.ModuleType:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        return importlib.import_module(f"{self.alias}.sglang.sink")


# ---- the arms ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Arm:
    name: str
    # the sink module traced into (its TraceSink, COMPLETIONS_OBSERVED); None: hooks not installed
    sink: types.ModuleType | types.SimpleNamespace | None
    logs: bool = True  # whether its trace holds the events


class NullSink(trace_sink.TraceSink):
    """A sink that logs nothing: the hooks' own work (their reads of SGLang's state, their
    bookkeeping, wrapt's calls), without an event's record."""

    def begin(self, *args, **kwargs) -> None:
        pass

    def obj(self, o: object) -> str:
        return ""

    def emit(self, ev: str, **fields) -> None:
        pass

    def close(self, reason: str | None = None) -> None:
        pass


HOOKS_ONLY = types.SimpleNamespace(TraceSink=NullSink, COMPLETIONS_OBSERVED=[False])


@dataclasses.dataclass
class Spent:
    """One arm's measures over one round."""

    hooked_ns: int = 0  # inside the outermost hooked calls
    calls: int = 0  # hooked calls, nested ones included
    loop_ns: int = 0  # inside the scheduler loops
    begin_ns: int = 0
    close_ns: int = 0
    emit_ns: int = 0  # inside the sink's emit
    logger_ns: int = 0  # the recorder's generation of an event kind's log call (today's sink)
    traces: int = 0
    events: int = 0  # logged by the hooks (header and trace_end aside)
    by_method: dict[str, int] = dataclasses.field(default_factory=dict)


def timed_sink(module: types.ModuleType, spent_of):
    """The module's TraceSink with begin, emit and close timed into the current arm's Spent (emit's
    timer in every arm with a sink: the sink's share is an arm's added cost less the hooks arm's);
    a `held` sink ignores the close of each run."""
    base = module.TraceSink

    class Timed(base):
        def __init__(self, path: str, held: bool = False):
            super().__init__(path)
            self.held = held  # a sink every run logs into: closed once, at the arm's end

        def begin(self, *args, **kwargs):
            t0 = CLOCK[0]()
            try:
                return base.begin(self, *args, **kwargs)
            finally:
                spent_of().begin_ns += CLOCK[0]() - t0

        def emit(self, ev: str, **fields) -> None:
            t0 = CLOCK[0]()
            try:
                base.emit(self, ev, **fields)
            finally:
                spent_of().emit_ns += CLOCK[0]() - t0

        def close(self, *args, **kwargs):
            if self.held:
                return None
            t0 = CLOCK[0]()
            try:
                return base.close(self, *args, **kwargs)
            finally:
                spent_of().close_ns += CLOCK[0]() - t0

    return Timed


def timed_logger(spent: Spent):
    """The recorder's Recorder.logger timed into `spent`: each recorder generates (compiles) the log
    call of an event kind at its first event of that kind, a cost per trace, not per event."""
    base = Recorder.logger

    def logger(self, *args, **kwargs):
        t0 = CLOCK[0]()
        try:
            return base(self, *args, **kwargs)
        finally:
            spent.logger_ns += CLOCK[0]() - t0

    return mutate.swapped(Recorder, "logger", logger)


# ---- the timers on the hooked methods ------------------------------------------------------------
def hooked_targets() -> list[tuple[object, str]]:
    """(owner, name) of every function the prefill hooks wrap, found by installing them once."""
    sgl = sglang()  # loads SGLang and installs the prefill hooks
    scripted_sender_class()  # the harness's sender class exists before install looks for senders
    hooks.uninstall()
    prefill_hooks.install(sgl)
    found = [(owner, name) for owner, name, _ in hooks._installed]
    hooks.uninstall()
    return found


def _label(owner, name: str) -> str:
    return f"{getattr(owner, '__qualname__', owner.__name__)}.{name}"


class Timers:
    """An outer timer on each hooked function, over whatever is there now (the adapter's wrapper,
    or SGLang's own function): the same code in every arm. Only the outermost hooked call's time is
    added (a hooked method calls others); every call is counted."""

    def __init__(self, targets, spent: Spent):
        self.spent = spent
        self.depth = [0]
        self.saved: list[tuple[object, str, object]] = []
        for owner, name in targets:
            current = vars(owner)[name]
            loop = name in prefill_run.LOOPS.values()
            self.saved.append((owner, name, current))
            setattr(owner, name, self._timer(owner, name, current, loop))

    def _timer(self, owner, name: str, current, loop: bool):
        spent, depth, label = self.spent, self.depth, _label(owner, name)
        by_method = spent.by_method
        clock = CLOCK[0]

        def call(fn, args, kwargs):
            by_method[label] = by_method.get(label, 0) + 1
            if loop:  # the loop: its time apart, the hooked calls inside it still outermost
                t0 = clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent.loop_ns += clock() - t0
            spent.calls += 1
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] = 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.hooked_ns += clock() - t0
                depth[0] = 0

        if not isinstance(owner, type):  # a module's function, called by its name
            return lambda *args, **kwargs: call(current, args, kwargs)

        def method(self, *args, **kwargs):
            # bound as `self.name` binds the class attribute (a wrapt wrapper binds itself)
            return call(current.__get__(self, type(self)), args, kwargs)

        return method

    def remove(self) -> None:
        while self.saved:
            owner, name, current = self.saved.pop()
            setattr(owner, name, current)


# ---- one arm, one round --------------------------------------------------------------------------
def read_events(path: str) -> list[str]:
    """The events the hooks logged, by kind, in order (header and trace_end aside)."""
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    if not lines or "ev" in lines[0]:
        raise SystemExit(f"sglang_hook_cost.py: {path}:1: no header")
    return [line["ev"] for line in lines[1:] if line["ev"] != "trace_end"]


def run_arm(
    arm: Arm, targets, workloads, reps: int, trace_dir: str, per_process: bool
) -> tuple[Spent, list[str]]:
    """The workloads `reps` times each under `arm`; the spent time and the events logged (one
    trace per run, or with `per_process` one for all the arm's runs)."""
    spent = Spent()
    sgl = sglang()
    hooks.uninstall()
    events: list[str] = []
    with contextlib.ExitStack() as stack:
        if arm.sink is None:
            # run_workload installs the hooks it finds missing: not in this arm
            stack.enter_context(mutate.swapped(prefill_hooks, "install", lambda sgl: None))
        else:
            prefill_hooks.install(sgl)
            arm.sink.COMPLETIONS_OBSERVED[0] = trace_sink.COMPLETIONS_OBSERVED[0]
            sink_cls = timed_sink(arm.sink, lambda: spent)
            if per_process:
                shared = sink_cls(os.path.join(trace_dir, f"{arm.name}.jsonl"), held=True)
                stack.callback(_close_shared, shared, events if arm.logs else None)
                sink_cls = lambda path: shared  # noqa: E731 (every run's sink)
            stack.enter_context(mutate.swapped(prefill_run, "TraceSink", sink_cls))
            if arm.sink is trace_sink:
                stack.enter_context(timed_logger(spent))
        stack.callback(hooks.uninstall)  # last: the timers come off first, then the hooks
        timers = Timers(targets, spent)
        stack.callback(timers.remove)
        gc.collect()
        for name, workload in workloads:
            path = None
            if arm.sink is not None:
                path = os.path.join(trace_dir, f"{arm.name}-{name.replace('/', '_')}.jsonl")
            for _ in range(reps):
                prefill_run.run_workload(workload, path)
                if path is not None and arm.logs and not per_process:
                    events += read_events(path)
                    spent.traces += 1
    spent.events = len(events)
    if per_process and arm.sink is not None:
        spent.traces = 1
    return spent, events


def _close_shared(sink, events: list[str] | None) -> None:
    sink.held = False
    sink.close()
    if events is not None:
        events += read_events(sink.path)


# ---- figures -------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def text(s: dict, unit: float = 1.0) -> str:
    return f"{s['median'] / unit:,.0f} [{s['min'] / unit:,.0f} .. {s['max'] / unit:,.0f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=3, help="runs of each scenario per arm per round")
    ap.add_argument(
        "--scenario", action="append", default=None, help="a prefill scenario (default: all)"
    )
    ap.add_argument("--before", default="87a74b3", help="the commit of the BEFORE arm's sink")
    ap.add_argument(
        "--sink-per",
        choices=("process", "run"),
        default="process",
        help="one sink for all of an arm's runs in a round, as a server process has (default), or "
        "one per run, as `pdo conform` makes (each trace's first event of a kind then costs more)",
    )
    ap.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="cpu",
        help="the timers' clock: the thread's CPU time (default) or elapsed time",
    )
    ap.add_argument("--trace-dir", default=None, help="keep each arm's last traces here")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    if a.rounds < 1 or a.reps < 1:
        ap.error("--rounds and --reps must be at least 1")
    try:
        before = CommitEngine(a.before)
    except ValueError as exc:
        ap.error(f"--before {a.before}: {exc}")
    logging.disable(logging.WARNING)  # SGLang's notes at every scheduler build
    warnings.simplefilter("ignore")  # SGLang's import-time "only CUDA supports ..." warnings
    available = dict(prefill_scenarios.scenarios())
    names = a.scenario or list(available)
    for name in names:
        if name not in available:
            ap.error(f"--scenario {name}: not a prefill scenario this release runs")
    workloads = [(name, prefill_scenarios.SCENARIOS[name][0]) for name in names]
    trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="pdo-hook-cost-")
    os.makedirs(trace_dir, exist_ok=True)

    targets = hooked_targets()
    CLOCK[0] = CLOCKS[a.clock]
    arms = [
        Arm("off", None),
        Arm("hooks", HOOKS_ONLY, logs=False),
        Arm("now", trace_sink),
        Arm(a.before, before.sink_module()),
    ]
    per_process = a.sink_per == "process"
    for arm in arms:  # warm-up: imports, first-call caches, the sender class
        run_arm(arm, targets, workloads, 1, trace_dir, per_process)

    rounds: list[dict[str, Spent]] = []
    for r in range(a.rounds):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        got, seen = {}, {}
        for arm in order:
            got[arm.name], seen[arm.name] = run_arm(
                arm, targets, workloads, a.reps, trace_dir, per_process
            )
        # the arms ran the same code: the same hooked calls, and both sinks the same events
        if len({tuple(sorted(s.by_method.items())) for s in got.values()}) != 1:
            raise SystemExit("sglang_hook_cost.py: the arms made different hooked calls")
        if seen["now"] != seen[a.before] or not seen["now"]:
            raise SystemExit(
                f"sglang_hook_cost.py: the arms now and {a.before} logged other events"
            )
        rounds.append(got)

    report = figures(rounds, arms, a, names, targets, trace_dir)
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 0


def figures(rounds, arms, a, names, targets, trace_dir) -> dict:
    events = rounds[0]["now"].events
    calls = rounds[0]["off"].calls
    by_method = rounds[0]["off"].by_method
    out = {
        "sglang_version": sglang().version,
        "scenarios": names,
        "rounds": a.rounds,
        "reps": a.reps,
        "events_per_round": events,
        "hooked_calls_per_round": calls,
        "sink_per": a.sink_per,
        "clock": a.clock,
        "traces_per_round": rounds[0]["now"].traces,
        "trace_dir": trace_dir,
        "called": {k: v for k, v in sorted(by_method.items())},
        "not_called": sorted({_label(o, n) for o, n in targets} - set(by_method)),
        "arms": {},
    }
    for arm in arms:
        per = [r[arm.name] for r in rounds]
        off = [r["off"] for r in rounds]
        row = {
            "ns_per_call": spread([s.hooked_ns / s.calls for s in per]),
            "ns_per_event": spread([s.hooked_ns / events for s in per]),
            "loop_ns_per_event": spread([s.loop_ns / events for s in per]),
        }
        if arm.sink is not None:
            row["added_ns_per_event"] = spread(
                [(s.hooked_ns - o.hooked_ns) / events for s, o in zip(per, off)]
            )
            row["loop_added_ns_per_event"] = spread(
                [(s.loop_ns - o.loop_ns) / events for s, o in zip(per, off)]
            )
            row["emit_ns_per_event"] = spread([s.emit_ns / events for s in per])
        if arm.logs and arm.sink is not None:
            row["begin_ns_per_trace"] = spread([s.begin_ns / s.traces for s in per])
            row["close_ns_per_trace"] = spread([s.close_ns / s.traces for s in per])
        if arm.sink is trace_sink:
            before = [r[arms[-1].name] for r in rounds]
            row["minus_before_ns_per_event"] = spread(
                [(s.hooked_ns - b.hooked_ns) / events for s, b in zip(per, before)]
            )
            row["emit_steady_ns_per_event"] = spread(
                [(s.emit_ns - s.logger_ns) / events for s in per]
            )
            row["logger_ns_per_trace"] = spread([s.logger_ns / s.traces for s in per])
            # the added cost with the loggers' generation (once per kind and trace) taken out
            row["added_steady_ns_per_event"] = spread(
                [(s.hooked_ns - s.logger_ns - o.hooked_ns) / events for s, o in zip(per, off)]
            )
        out["arms"][arm.name] = row
    return out


def print_report(r: dict) -> None:
    print(
        f"SGLang {r['sglang_version']}, {len(r['scenarios'])} prefill scenarios x {r['reps']} per "
        f"arm and round, {r['rounds']} interleaved rounds; per round {r['events_per_round']:,} "
        f"events, {r['hooked_calls_per_round']:,} hooked calls (nested included), "
        f"{r['traces_per_round']} traces. Medians [min .. max] over the rounds, ns:"
    )
    for name, row in r["arms"].items():
        line = (
            f"  {name:>8}: per hooked call {text(row['ns_per_call'])}; "
            f"per event {text(row['ns_per_event'])}"
        )
        if "added_ns_per_event" in row:
            line += (
                f"; added per event {text(row['added_ns_per_event'])} "
                f"(whole loop: {text(row['loop_added_ns_per_event'])})"
            )
        if "emit_ns_per_event" in row:
            line += f"; inside emit per event {text(row['emit_ns_per_event'])}"
        if "logger_ns_per_trace" in row:
            line += (
                f"; without the recorder's generation of its loggers "
                f"({text(row['logger_ns_per_trace'], 1e3)} us per trace): added "
                f"{text(row['added_steady_ns_per_event'])}, inside emit "
                f"{text(row['emit_steady_ns_per_event'])}; added less the last arm's "
                f"{text(row['minus_before_ns_per_event'])}"
            )
        if "begin_ns_per_trace" in row:
            line += (
                f"; per trace: begin {text(row['begin_ns_per_trace'], 1e3)} us, close "
                f"{text(row['close_ns_per_trace'], 1e3)} us"
            )
        print(line)
    print(
        "hooked methods called (per round): "
        + ", ".join(f"{k} x{v}" for k, v in r["called"].items())
    )
    print("attached, never called by these scenarios: " + (", ".join(r["not_called"]) or "none"))
    print(f"traces of the last round: {r['trace_dir']}")


if __name__ == "__main__":
    sys.exit(main())
