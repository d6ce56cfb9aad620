"""Cost of the SGLang adapter on SGLang's scheduler thread, per hooked call and per event: SGLang's
real PD loops on CPU, run by the conformance harness (`pdo conform sglang`'s scenarios; --role
prefill: prefill_run.run_workload, SGLang's Scheduler on fakes only where a GPU or the network would
be; --role decode: decode_scenarios, the decode loops and prealloc queue, queries over loopback
HTTP), in four arms interleaved round by round:

    off      the adapter's hooks not installed (SGLang's functions as released)
    hooks    the role's hooks installed, into a sink that logs nothing (the hooks' own work)
    now      the hooks tracing into today's sink (engine/sglang/sink.py, on the flight recorder)
    BEFORE   the same hooks into the sink of commit BEFORE (default 87a74b3: a json.dumps, a write
             and a flush per event), imported from git with that commit's engine package

Each function the role's hooks wrap has an outer timer in every arm (the thread's CPU time, or
--clock wall): the time inside the outermost hooked call of its thread, and every hooked call
counted; the loops are timed apart (their time holds SGLang's unhooked work and the header too).
`added` is (arm - off) / events, paired within a round; events are read back from the trace. The
prefill runs are one schedule: the arms must make the same calls and log the same events, or the
script stops; decode runs race the prefetch pool's threads, and each logging arm divides by its
own events. Emit is timed in the arms with a sink (its timer in each: the sink's share of `added`
is an arm's less the hooks arm's); a trace's begin and close (the JSON Lines), once per trace.
One sink takes an arm's runs in a round, as one sink takes a server process's events; with
--sink-per run, one per run, as `pdo conform` makes.

    PYTHONPATH=. .venv/bin/python scripts/sglang_hook_cost.py [--role prefill|decode] [--rounds 9] \
        [--reps 3] [--scenario NAME ...] [--before 87a74b3] [--sink-per process|run] \
        [--clock cpu|wall] [--trace-dir D] [--json]

The output names the hooked functions called, those attached but never called, and the hooks on no
SGLang function (decode's iteration marker, a property: its iter_begin is in the loop's time). The
decode harness logs kv_done, req_done and req_abort itself: events whose cost is in the loop's time.
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
import threading
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path

from engine.sglang import decode as decode_hooks
from engine.sglang import hooks, load, mutate
from engine.sglang import prefill as prefill_hooks
from engine.sglang import sink as trace_sink
from engine.sglang.conform import decode_scenarios, prefill_run, prefill_scenarios
from engine.sglang.conform.prefill_fakes import scripted_sender_class
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
    bookkeeping, wrapt's calls), without an event's record. Never begun, its close does nothing."""

    def begin(self, *args, **kwargs) -> None:
        pass

    def obj(self, o: object) -> str:
        return ""

    def emit(self, ev: str, **fields) -> None:
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


def _timing(fn, spent_of, field: str):
    """`fn` with its time added to the `field` of spent_of()."""

    def timed(*args, **kwargs):
        t0 = CLOCK[0]()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = spent_of()
            setattr(spent, field, getattr(spent, field) + CLOCK[0]() - t0)

    return timed


def timed_sink(module: types.ModuleType, spent_of):
    """The module's TraceSink with begin, emit and close timed into the current arm's Spent (emit's
    timer in every arm with a sink: the sink's share is an arm's added cost less the hooks arm's);
    a `held` sink ignores the close of each run."""
    base = module.TraceSink

    class Timed(base):
        begin = _timing(base.begin, spent_of, "begin_ns")
        emit = _timing(base.emit, spent_of, "emit_ns")
        _close = _timing(base.close, spent_of, "close_ns")

        def __init__(self, path: str, held: bool = False):
            super().__init__(path)
            self.held = held  # a sink every run logs into: closed once, at the arm's end

        def close(self, *args, **kwargs):
            return None if self.held else self._close(*args, **kwargs)

    return Timed


def timed_logger(spent: Spent):
    """The recorder's Recorder.logger timed into `spent`: each recorder generates (compiles) the log
    call of an event kind at its first event of that kind, a cost per trace, not per event."""
    return mutate.swapped(Recorder, "logger", _timing(Recorder.logger, lambda: spent, "logger_ns"))


# ---- the roles: which hooks, which harness ------------------------------------------------------
@dataclasses.dataclass
class Role:
    name: str  # "prefill" or "decode"
    install: Callable  # the hooks' install(sgl)
    loops: tuple[str, ...]  # the scheduler loops' method names (timed apart)
    harness: types.ModuleType  # the harness module whose TraceSink the runs make
    runs: list[tuple[str, Callable]]  # (scenario, run(trace_path or None))
    # a context in which the harness installs no hook itself: the arm decides which are on
    no_install: Callable
    deterministic: bool  # one schedule: every arm makes the same calls and logs the same events
    # the harness logs events of its own (decode: the stand-in transfer's kv_done, req_done and
    # req_abort) into the active sink, so a run needs one: the off arm's logs nothing
    needs_sink: bool = False


def prefill_role(wanted: list[str] | None) -> Role:
    available = dict(prefill_scenarios.scenarios())
    runs = []
    for name in wanted or list(available):
        if name not in available:
            raise ValueError(f"{name}: not a prefill scenario this release runs")
        workload = prefill_scenarios.SCENARIOS[name][0]
        runs.append((name, lambda path, w=workload: prefill_run.run_workload(w, path)))
    scripted_sender_class()  # the harness's sender class exists before install looks for senders
    return Role(
        "prefill",
        prefill_hooks.install,
        tuple(prefill_run.LOOPS.values()),
        prefill_run,
        runs,
        # run_workload installs the prefill hooks it does not find (it would not see them under
        # the timers)
        lambda: mutate.swapped(prefill_hooks, "install", lambda sgl: None),
        True,
    )


def decode_role(sgl, wanted: list[str] | None) -> Role:
    available = dict(decode_scenarios.scenarios(sgl))
    for name in wanted or ():
        if name not in available:
            raise ValueError(f"{name}: not a decode scenario this release runs")
    return Role(
        "decode",
        decode_hooks.install,
        tuple(decode_hooks.LOOPS),
        decode_scenarios,
        [(name, available[name]) for name in wanted or list(available)],
        # a run hooks its receiver class where the queue's _init_receiver is not hooked
        lambda: mutate.swapped(decode_hooks, "hook_receiver", lambda cls: None),
        # the prefetch pool's threads and the bootstrap servers' answers race the loop
        False,
        needs_sink=True,
    )


# ---- the timers on the hooked methods ------------------------------------------------------------
def hooked_targets(role: Role, sgl) -> tuple[list[tuple[object, str]], list[str]]:
    """(owner, name) of every function the role's hooks wrap, found by installing them once; and
    the hooks that are no function of SGLang's (a property the adapter adds), not timed."""
    hooks.uninstall()
    role.install(sgl)
    found, untimed = [], []
    for owner, name, original in hooks._installed:
        if callable(getattr(original, "__get__", None)) and callable(vars(owner)[name]):
            found.append((owner, name))
        else:
            untimed.append(_label(owner, name))
    hooks.uninstall()
    return found, untimed


def _label(owner, name: str) -> str:
    return f"{getattr(owner, '__qualname__', owner.__name__)}.{name}"


class _Bound:
    """A timed callable: `call(fn, args, kwargs)` around `fn`, which `__wrapped__` names (so that
    code reading the function under its wrappers, the harness's and the hooks' `unwrap`, finds it)."""

    __slots__ = ("__wrapped__", "_call")

    def __init__(self, fn, call):
        self.__wrapped__, self._call = fn, call

    def __call__(self, *args, **kwargs):
        return self._call(self.__wrapped__, args, kwargs)


class _Timed(_Bound):
    """A timed class attribute: bound as the attribute under it binds (a method, a staticmethod,
    a wrapt wrapper of either), for an instance's call and for a call through the class."""

    __slots__ = ()

    def __get__(self, instance, owner=None):
        return _Bound(self.__wrapped__.__get__(instance, owner), self._call)


class Timers:
    """An outer timer on each hooked function, over whatever is there now (the adapter's wrapper,
    or SGLang's own function): the same code in every arm. Only the outermost hooked call's time is
    added (a hooked method calls others); every call is counted."""

    def __init__(self, targets, loops: tuple[str, ...], spent: Spent):
        self.spent = spent
        self.local = threading.local()  # .depth: hooked calls open on this thread
        self.lock = threading.Lock()  # the decode hooks run on the prefetch pool's threads too
        self.saved: list[tuple[object, str, object]] = []
        for owner, name in targets:
            current = vars(owner)[name]
            self.saved.append((owner, name, current))
            setattr(owner, name, self._timer(owner, name, current, name in loops))

    def _timer(self, owner, name: str, current, loop: bool):
        spent, local, lock, label = self.spent, self.local, self.lock, _label(owner, name)
        by_method = spent.by_method
        clock = CLOCK[0]  # a thread's own clock: read on the thread of the call

        def call(fn, args, kwargs):
            with lock:
                by_method[label] = by_method.get(label, 0) + 1
            if loop:  # the loop: its time apart, the hooked calls inside it still outermost
                t0 = clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    with lock:
                        spent.loop_ns += clock() - t0
            if getattr(local, "depth", 0):
                with lock:
                    spent.calls += 1
                return fn(*args, **kwargs)
            local.depth = 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = clock()
                local.depth = 0
                with lock:
                    spent.calls += 1
                    spent.hooked_ns += t1 - t0

        if not isinstance(owner, type):  # a module's function, called by its name
            return _Bound(current, call)
        return _Timed(current, call)

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
    role: Role, sgl, arm: Arm, targets, reps: int, trace_dir: str, per_process: bool
) -> tuple[Spent, list[str]]:
    """The role's runs `reps` times each under `arm`; the spent time and the events logged (one
    trace per run, or with `per_process` one for all the arm's runs)."""
    spent = Spent()
    hooks.uninstall()
    events: list[str] = []
    sink = arm.sink if arm.sink is not None or not role.needs_sink else HOOKS_ONLY
    with contextlib.ExitStack() as stack:
        if arm.sink is not None:
            role.install(sgl)
        if sink is not None:
            sink.COMPLETIONS_OBSERVED[0] = trace_sink.COMPLETIONS_OBSERVED[0]
            sink_cls = timed_sink(sink, lambda: spent)
            if per_process:
                shared = sink_cls(os.path.join(trace_dir, f"{arm.name}.jsonl"), held=True)
                stack.callback(_close_shared, shared, events if arm.logs else None)
                sink_cls = lambda path: shared  # noqa: E731 (every run's sink)
            stack.enter_context(mutate.swapped(role.harness, "TraceSink", sink_cls))
            if sink is trace_sink:
                stack.enter_context(timed_logger(spent))
        stack.enter_context(role.no_install())
        installed = len(hooks._installed)
        stack.callback(hooks.uninstall)  # last: the timers come off first, then the hooks
        timers = Timers(targets, role.loops, spent)
        stack.callback(timers.remove)
        gc.collect()
        for name, run in role.runs:
            path = None
            if sink is not None:
                path = os.path.join(trace_dir, f"{arm.name}-{name.replace('/', '_')}.jsonl")
            for _ in range(reps):
                run(path)
                if path is not None and arm.logs and not per_process:
                    events += read_events(path)
                    spent.traces += 1
                if len(hooks._installed) != installed:
                    raise SystemExit(f"sglang_hook_cost.py: {name} installed hooks of its own")
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
    ap.add_argument(
        "--role", choices=("prefill", "decode"), default="prefill", help="whose hooks and scenarios"
    )
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=3, help="runs of each scenario per arm per round")
    ap.add_argument(
        "--scenario", action="append", default=None, help="a scenario of the role (default: all)"
    )
    ap.add_argument("--before", default="87a74b3", help="the commit of the BEFORE arm's sink")
    ap.add_argument("--sink-per", choices=("process", "run"), default="process")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="cpu")
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
    sgl = load()
    try:
        role = prefill_role(a.scenario) if a.role == "prefill" else decode_role(sgl, a.scenario)
    except ValueError as exc:
        ap.error(f"--scenario {exc}")
    trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="pdo-hook-cost-")
    os.makedirs(trace_dir, exist_ok=True)

    targets, untimed = hooked_targets(role, sgl)
    CLOCK[0] = CLOCKS[a.clock]
    arms = [
        Arm("off", None, logs=False),
        Arm("hooks", HOOKS_ONLY, logs=False),
        Arm("now", trace_sink),
        Arm(a.before, before.sink_module()),
    ]
    per_process = a.sink_per == "process"
    for arm in arms:  # warm-up: imports, first-call caches
        run_arm(role, sgl, arm, targets, 1, trace_dir, per_process)

    rounds: list[dict[str, Spent]] = []
    for r in range(a.rounds):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        got, seen = {}, {}
        for arm in order:
            got[arm.name], seen[arm.name] = run_arm(
                role, sgl, arm, targets, a.reps, trace_dir, per_process
            )
        if not seen["now"] or not seen[a.before]:
            raise SystemExit("sglang_hook_cost.py: a logging arm logged no event")
        # one schedule: the arms ran the same code, the same hooked calls and the same events
        calls = {tuple(sorted(s.by_method.items())) for s in got.values()}
        if role.deterministic and (len(calls) > 1 or seen["now"] != seen[a.before]):
            raise SystemExit(
                "sglang_hook_cost.py: the arms made other calls or logged other events"
            )
        rounds.append(got)

    report = figures(rounds, arms, a, role, targets, untimed, trace_dir, sgl.version)
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 0


def figures(rounds, arms, a, role: Role, targets, untimed, trace_dir, version) -> dict:
    """Per arm, medians and spreads over the rounds. An arm that logs divides by its own events;
    the others by today's sink's (the same in every arm where the role is deterministic)."""
    by_method = rounds[0]["off"].by_method
    out = {
        "sglang_version": version,
        "role": role.name,
        "scenarios": [name for name, _ in role.runs],
        "rounds": a.rounds,
        "reps": a.reps,
        "sink_per": a.sink_per,
        "clock": a.clock,
        "hooked_calls_per_round": spread([r["off"].calls for r in rounds]),
        "traces_per_round": rounds[0]["now"].traces,
        "trace_dir": trace_dir,
        "called": {k: v for k, v in sorted(by_method.items())},
        "not_called": sorted({_label(o, n) for o, n in targets} - set(by_method)),
        "not_timed": untimed,
        "arms": {},
    }
    for arm in arms:
        per = [r[arm.name] for r in rounds]
        off = [r["off"] for r in rounds]
        ev = [
            (s if arm.logs and arm.sink is not None else r["now"]).events
            for s, r in zip(per, rounds)
        ]
        row = {
            "events_per_round": spread(ev),
            "ns_per_call": spread([s.hooked_ns / s.calls for s in per]),
            "ns_per_event": spread([s.hooked_ns / e for s, e in zip(per, ev)]),
            "loop_ns_per_event": spread([s.loop_ns / e for s, e in zip(per, ev)]),
        }
        if arm.sink is not None:
            row["added_ns_per_event"] = spread(
                [(s.hooked_ns - o.hooked_ns) / e for s, o, e in zip(per, off, ev)]
            )
            row["loop_added_ns_per_event"] = spread(
                [(s.loop_ns - o.loop_ns) / e for s, o, e in zip(per, off, ev)]
            )
            row["emit_ns_per_event"] = spread([s.emit_ns / e for s, e in zip(per, ev)])
        if arm.logs and arm.sink is not None:
            row["begin_ns_per_trace"] = spread([s.begin_ns / s.traces for s in per])
            row["close_ns_per_trace"] = spread([s.close_ns / s.traces for s in per])
        if arm.sink is trace_sink:
            before = [r[arms[-1].name] for r in rounds]
            row["logger_ns_per_trace"] = spread([s.logger_ns / s.traces for s in per])
            # the added cost and emit's with the loggers' generation (once per kind and trace) out
            row["added_steady_ns_per_event"] = spread(
                [(s.hooked_ns - s.logger_ns - o.hooked_ns) / e for s, o, e in zip(per, off, ev)]
            )
            row["emit_steady_ns_per_event"] = spread(
                [(s.emit_ns - s.logger_ns) / e for s, e in zip(per, ev)]
            )
            row["minus_before_ns_per_event"] = spread(
                [(s.hooked_ns - b.hooked_ns) / e for s, b, e in zip(per, before, ev)]
            )
        out["arms"][arm.name] = row
    return out


# what each figure of an arm's row is, in the text output (those in us: per trace)
LABELS = {
    "events_per_round": "events",
    "ns_per_call": "per hooked call",
    "ns_per_event": "per event",
    "loop_ns_per_event": "whole loop per event",
    "added_ns_per_event": "added per event",
    "loop_added_ns_per_event": "whole loop added per event",
    "emit_ns_per_event": "inside emit per event",
    "logger_ns_per_trace": "the recorder's generation of its loggers per trace (us)",
    "added_steady_ns_per_event": "without it: added",
    "emit_steady_ns_per_event": "inside emit",
    "minus_before_ns_per_event": "added less the last arm's",
    "begin_ns_per_trace": "begin per trace (us)",
    "close_ns_per_trace": "close per trace (us)",
}


def print_report(r: dict) -> None:
    print(
        f"SGLang {r['sglang_version']}, {len(r['scenarios'])} {r['role']} scenarios x {r['reps']} "
        f"per arm and round, {r['rounds']} interleaved rounds, {r['traces_per_round']} traces per "
        f"arm and round, hooked calls per round {text(r['hooked_calls_per_round'])}. Medians "
        "[min .. max] over the rounds, ns:"
    )
    for name, row in r["arms"].items():
        figures = [
            f"{LABELS[k]} {text(v, 1e3 if '(us)' in LABELS[k] else 1)}" for k, v in row.items()
        ]
        print(f"  {name:>8}: " + "; ".join(figures))
    print("called (per round): " + ", ".join(f"{k} x{v}" for k, v in r["called"].items()))
    print("attached, never called: " + (", ".join(r["not_called"]) or "none"))
    print("hooks not on an SGLang function, not timed: " + (", ".join(r["not_timed"]) or "none"))
    print(f"traces of the last round: {r['trace_dir']}")


if __name__ == "__main__":
    sys.exit(main())
