"""The prefill engine model: what each prefill mode's loop code (engine/prefill/loops.py) does, over
the universe of prefill_universe.py.

The engine model says in which order and on which thread each event happens, and how the threads
synchronise (capacity-1 queues, stream events, the WAR barrier). It is a model of the code, not of
the rules, in named groups ("E:...") so that unsat cores say which part of the engine a proof
needed.

Written from engine/prefill/loops.py, scheduler.py and worker.py. One loop iteration either admits
batch n in the same iteration that finishes n-1 (`cont[n]`, the steady state) or, when no batch
was ready, after an iteration that only drains n-1 (`not cont[n]`). Idle iterations add no other
event than allocs and releases, so those float in windows between two hidden points of the
scheduler's program: every iteration begins with a top window (get_next_batch takes slots, and may
run out of pages so the request waits; idle iterations before it also release) and has an end
window (process_inflight_queue releases). An alloc falls in a top window before its request's
first admit; a release in any window after its last chunk's processing.
"""

from __future__ import annotations

from collections import defaultdict

import z3

from .logic import conj, disj, implies, lt, neg
from .prefill_encodings import running_count
from .prefill_universe import ModelUniverse, batch_groups
from .universe import FWD, SCHED, THREAD_MODES


class _Program:
    """A thread's program order: events in order, each under a guard (the loop branch that emits
    it). The same event may sit in two places under complementary guards."""

    def __init__(self, universe, name):
        self.universe, self.name, self.slots, self.windows, self.tops = universe, name, [], [], []

    def add(self, guard, *events):
        self.slots += [(guard, e) for e in events]

    def _window(self, name, guard):
        i = sum(1 for _, e in self.slots if e.name == name) // 2
        w = (
            guard,
            self.universe.hide((name, f"{i}<"), SCHED),
            self.universe.hide((name, f"{i}>"), SCHED),
        )
        self.add(guard, w[1], w[2])
        return w

    def top(self, guard):
        """The top of an iteration: loop top and get_next_batch up to its admit."""
        self.tops.append(self._window("iteration_top", guard))

    def window(self, guard):
        """process_inflight_queue."""
        self.windows.append(self._window("iteration_end", guard))

    def order(self, floating=()) -> list:
        """Each active slot comes after the previous active one: for each slot and each earlier slot
        that may be the previous active one (back to the last unconditional slot), a difference
        constraint guarded by both being active and the slots between being inactive. Floating
        events (allocs, releases) sit in windows, so never inside any other pair of neighbouring
        slots: an implied lemma, which spares z3 a case split over every window (see
        engine_model)."""
        out = []
        opens = {w[1] for w in self.windows + self.tops}
        active = [(g, e) for g, e in self.slots if g is not False]
        for j, (gj, ej) in enumerate(active):
            for i in range(j - 1, -1, -1):
                gi, ei = active[i]
                between = [g for g, _ in active[i + 1 : j]]
                if any(g is True or g is gj for g in between):
                    break  # a slot between is active whenever j is: nothing earlier is next to j
                if any(g is gi for g in between):
                    continue  # active with i: i is never right before j, an earlier slot may be
                self.universe.compared.add((ei, ej))
                guard = conj(gi, gj, *[neg(g) for g in between])
                out.append(implies(guard, ei.pos < ej.pos))
                if ei not in opens:
                    out += [implies(guard, neg(conj(lt(ei, z), lt(z, ej)))) for z in floating]
                if gi is True:
                    break
        return out


EMITTED = {  # batch events each loop emits (normal samples inline, without a `sample` event)
    "normal": {
        "admit",
        "stage",
        "fwd_begin",
        "fwd_end",
        "war_barrier",
        "process_begin",
        "process_end",
    },
    "overlap": {
        "admit",
        "stage",
        "fwd_begin",
        "fwd_end",
        "war_barrier",
        "sample",
        "process_begin",
        "process_end",
    },
    "thread": None,
    "ahead": None,  # all of them
}
WORKER_EVENTS = {
    "thread": {"fwd_begin", "prefix_send", "stage", "fwd_end", "war_barrier", "batch_copy"},
    "ahead": {"fwd_begin", "fwd_end", "war_barrier", "batch_copy"},
}
ENGINE_MUTANTS = {  # engine/runtime/inject.py mutants the loop model knows (ahead mode)
    "two-forwards": "input queue of capacity 2; collect(N) after submit(N+1)",
    "sample-before-collect": "sample(N) after submit(N+1)",
    "prefix-send-on-worker": "the worker sends the cached prefix inside run_batch",
    "no-war-barrier": "the WAR barrier does not make the schedule stream wait",
}


# ---- the scheduler's and the worker's programs, one loop iteration at a time
# Each takes the batch n, `steady` (n admitted in the iteration that finishes n-1) and `drained`
# (n-1 drained by an iteration that admitted nothing); both are False for n = 0.


def _normal_iteration(sched, universe, n, steady, drained, mutants):
    admit, prefix, process = batch_groups(universe, n)
    b = universe.b
    run_batch = [b("fwd_begin", n), *prefix, b("stage", n), b("fwd_end", n), b("war_barrier", n)]
    sched.top(True)
    sched.add(True, *admit, *run_batch, *process)
    sched.window(True)


def _overlap_iteration(sched, universe, n, steady, drained, mutants, *, threaded=False):
    """The old overlap loop, and (threaded) the thread loop with AHEAD off: run_batch is a submit to
    the worker and a collect of its result."""
    admit, prefix, _ = batch_groups(universe, n)
    prev = batch_groups(universe, n - 1)[2] if n else []
    b, point = universe.b, universe.get
    if n:
        sched.top(drained)
        sched.add(drained, *prev)
        sched.window(drained)
    sched.top(True)
    if not threaded:
        sched.add(
            True,
            *admit,
            b("fwd_begin", n),
            *prefix,
            b("stage", n),
            b("fwd_end", n),
            b("war_barrier", n),
        )
    else:
        sched.add(
            True,
            *admit,
            b("snapshot", n),
            b("submit", n),
            point(("in_put", n)),
            point(("out_get", n)),
            b("collect", n),
        )
    if n:
        sched.add(steady, *prev)
    sched.window(True)
    sched.add(True, b("sample", n))


def _thread_iteration(sched, universe, n, steady, drained, mutants):
    _overlap_iteration(sched, universe, n, steady, drained, mutants, threaded=True)


def _ahead_iteration(sched, universe, n, steady, drained, mutants):
    """The thread loop with AHEAD on: batch n is built and submitted before n-1 is collected."""
    admit, prefix, _ = batch_groups(universe, n)
    prev = batch_groups(universe, n - 1)[2] if n else []
    b, point = universe.b, universe.get
    on_worker = "prefix-send-on-worker" in mutants
    two, late = "two-forwards" in mutants, "sample-before-collect" in mutants
    collect_prev = [point(("out_get", n - 1)), b("collect", n - 1)] if n else []
    sample_prev = [b("sample", n - 1)] if n else []
    if n:
        sched.top(drained)
        sched.add(drained, *collect_prev, *sample_prev, *prev)
        sched.window(drained)
    sched.top(True)
    sched.add(True, *admit)
    if not two:
        sched.add(steady, *collect_prev, *([] if late else sample_prev))
    sched.add(
        True,
        b("snapshot", n),
        b("stage", n),
        *([] if on_worker else prefix),
        b("submit", n),
        point(("in_put", n)),
    )
    if two:
        sched.add(steady, *collect_prev, *sample_prev)
    elif late:
        sched.add(steady, *sample_prev)
    sched.add(steady, *prev)
    sched.window(True)


ITERATIONS = {
    "normal": _normal_iteration,
    "overlap": _overlap_iteration,
    "thread": _thread_iteration,
    "ahead": _ahead_iteration,
}


def _worker_iteration(worker, universe, n, mode, mutants):
    """The worker's run_batch(n): take the input, forward, barrier, copy the batch, hand it back."""
    _, prefix, _ = batch_groups(universe, n)
    b, point = universe.b, universe.get
    if mode == "thread":
        inside = [*prefix, b("stage", n)]
    else:
        inside = prefix if "prefix-send-on-worker" in mutants else []
    worker.add(
        True,
        point(("in_get", n)),
        b("fwd_begin", n),
        *inside,
        b("fwd_end", n),
        b("war_barrier", n),
        b("batch_copy", n),
        point(("out_put", n)),
    )


def _last_iterations(sched, universe, mode):
    """The final drain (the last batch is still processed), then idle iterations until every
    request is released."""
    K, b, point = universe.K, universe.b, universe.get
    last = batch_groups(universe, K - 1)[2]
    if mode in ("overlap", "thread"):
        sched.top(True)
        sched.add(True, *last)
        sched.window(True)
    elif mode == "ahead":
        sched.top(True)
        sched.add(True, point(("out_get", K - 1)), b("collect", K - 1), b("sample", K - 1), *last)
        sched.window(True)
    sched.top(True)


def _loop_programs(universe, mode, cont, mutants):
    """The scheduler's (and the worker's) program for `mode`, as in engine/prefill/loops.py."""
    sched = _Program(universe, "scheduler")
    worker = _Program(universe, "worker") if mode in THREAD_MODES else None
    for n in range(universe.K):
        steady = cont[n] if n else False
        drained = neg(steady) if n else False
        ITERATIONS[mode](sched, universe, n, steady, drained, mutants)
        if worker is not None:
            _worker_iteration(worker, universe, n, mode, mutants)
    _last_iterations(sched, universe, mode)
    return sched, worker


# ---- the engine model's groups of constraints


def engine_model(universe: ModelUniverse, mode: str, mutants=(), lemmas: bool = False) -> dict:
    """The engine of `mode` as named groups of constraints (names start with "E:"). `lemmas` adds
    the implied program-order lemma for floating events: it speeds up proofs of an `adjacent` rule
    and slows down the others, so Model asks for it only when such a rule is in play."""
    unknown = set(mutants) - set(ENGINE_MUTANTS)
    if unknown:
        raise ValueError(f"the loop model does not know mutant(s) {', '.join(sorted(unknown))}")
    K = universe.K
    if mode in THREAD_MODES:
        for n in range(K):
            for name, thread in (
                ("in_put", SCHED),
                ("in_get", FWD),
                ("out_put", FWD),
                ("out_get", SCHED),
            ):
                universe.hide((name, n), thread)
    cont = [None] + [z3.Bool(f"steady:{n}") for n in range(1, K)]
    sched, worker = _loop_programs(universe, mode, cont, mutants)
    groups: dict[str, list] = defaultdict(list)
    _emits_and_threads(groups, universe, mode, mutants)
    _program_order(groups, universe, sched, worker, lemmas)
    if mode in THREAD_MODES:
        _queues(groups, universe, mutants)
    _streams(groups, universe, mutants)
    _objects(groups, universe, mode)
    return dict(groups)


def _emits_and_threads(groups, universe, mode, mutants):
    emitted = EMITTED[mode]
    for e in universe.events:
        if e.batch is not None and emitted is not None:
            groups["E:emits"].append(e.exists == (e.name in emitted))
        elif e.exists is not True:
            groups["E:emits"].append(e.exists)
    on_worker = WORKER_EVENTS.get(mode, set())
    if "prefix-send-on-worker" in mutants:
        on_worker = on_worker | {"prefix_send"}
    for e in universe.events:
        groups["E:threads"].append(e.thread == (FWD if e.name in on_worker else SCHED))


def _program_order(groups, universe, sched, worker, lemmas):
    """Each thread's program order; allocs in iteration tops, releases in any window after the
    request's last processing."""
    workload, b, r = universe.workload, universe.b, universe.r
    floating = (
        [r(name, rid) for rid in workload.requests() for name in ("alloc", "release")]
        if lemmas
        else []
    )
    groups["E:program-order"] += sched.order(floating) + (worker.order() if worker else [])

    def inside(e, windows):
        return disj(*[conj(guard, lt(lo, e), lt(e, hi)) for guard, lo, hi in windows])

    for rid in workload.requests():
        rel, alloc, first = r("release", rid), r("alloc", rid), workload.holding(rid)[0]
        groups["E:program-order"] += [
            lt(b("process_end", workload.holding(rid)[-1]), rel),
            inside(rel, sched.windows + sched.tops),
            lt(alloc, b("admit", first)),
            inside(alloc, sched.tops),
        ]


def _queues(groups, universe, mutants):
    """queue.Queue(maxsize=cap): a get takes a put item; a put waits for room."""
    point = universe.get
    cap = 2 if "two-forwards" in mutants else 1
    for n in range(universe.K):
        groups["E:queues"] += [
            lt(point(("in_put", n)), point(("in_get", n))),
            lt(point(("out_put", n)), point(("out_get", n))),
        ]
        if n + cap < universe.K:
            groups["E:queues"] += [
                lt(point(("in_get", n)), point(("in_put", n + cap))),
                lt(point(("out_get", n)), point(("out_put", n + cap))),
            ]


def _streams(groups, universe, mutants):
    """Device work runs after it is enqueued, in enqueue order per stream; the forward waits for its
    staging (stage_event); the WAR barrier makes later schedule-stream work wait for the forward's
    reads (sched_stream.wait_event(war_event))."""
    b, point, K = universe.b, universe.get, universe.K
    for n in range(K):
        stage, forward = point(("dev_stage", n)), point(("dev_forward", n))
        groups["E:streams"] += [
            lt(b("stage", n), stage),
            lt(b("fwd_begin", n), forward),
            lt(stage, forward),
        ]
        for m in range(K):
            if m != n:
                stage_m, forward_m = point(("dev_stage", m)), point(("dev_forward", m))
                groups["E:streams"] += [
                    implies(lt(b("stage", n), b("stage", m)), lt(stage, stage_m)),
                    implies(lt(b("fwd_begin", n), b("fwd_begin", m)), lt(forward, forward_m)),
                ]
                if "no-war-barrier" not in mutants:
                    groups["E:streams"].append(
                        implies(lt(b("war_barrier", n), b("stage", m)), lt(forward, stage_m))
                    )


def _objects(groups, universe, mode):
    """What the events carry: Req objects shared by identity (the counter is the object's field as
    the code moves it), req_to_token slots, the snapshot's digest, the sender's page counts."""
    workload, b, r = universe.workload, universe.b, universe.r
    for i, rid in enumerate(workload.requests()):
        mine = [e for e in universe.events if e.rid == rid]
        groups["E:req-identity"] += [e.f["obj"] == 100 + i for e in mine]
        steps = [e for e in mine if e.name in ("chunk_inc", "chunk_dec")]
        for x in steps:
            run, _ = running_count(universe, x, steps, "chunk_inc", strict=False)
            groups["E:req-identity"].append(x.f["value"] == run)
    reqs = workload.requests()
    for rid in reqs:  # req_to_token slots: a free slot at alloc, the same one at release
        alloc, rel = r("alloc", rid), r("release", rid)
        groups["E:allocator"] += [alloc.f["slot"] >= 0, rel.f["slot"] == alloc.f["slot"]]
    for i, x in enumerate(reqs):
        for y in reqs[i + 1 :]:
            ax, rx, ay, ry = r("alloc", x), r("release", x), r("alloc", y), r("release", y)
            groups["E:allocator"].append(
                implies(ax.f["slot"] == ay.f["slot"], disj(lt(rx, ay), lt(ry, ax)))
            )
    if mode in THREAD_MODES:  # the worker's run_batch reads the snapshot it was handed
        groups["E:snapshot"] += [
            b("fwd_begin", n).f["digest"] == b("snapshot", n).f["digest"] for n in range(universe.K)
        ]
    page_size = universe.page_size  # the sender ships ceil(tokens / page_size) pages
    for e in universe.named("kv_send") + universe.named("prefix_send"):
        tokens, pages = e.f["tokens"], e.f["pages"]
        groups["E:sender"] += [
            tokens >= 1,
            pages * page_size >= tokens,
            (pages - 1) * page_size < tokens,
        ]


ENGINE_GROUPS = {
    "E:emits": "which events the loop emits",
    "E:threads": "which thread runs each event",
    "E:program-order": "program order of each thread's loop code; allocs at iteration tops, "
    "releases at iteration ends",
    "E:queues": "capacity-1 hand-off queues between scheduler and worker",
    "E:streams": "stream order, the forward's wait on staging, the WAR barrier's wait",
    "E:req-identity": "Req objects kept by identity; the counter as the code moves it",
    "E:allocator": "req_to_token slots: free at alloc, the same at release",
    "E:snapshot": "the worker's run_batch reads the snapshot it was handed",
    "E:sender": "the sender ships ceil(tokens / page_size) pages",
}
