"""The schedule controller: lets exactly one managed thread run at a time and, at every schedule
point (engine/sync/__init__.py), asks its strategy which enabled thread goes next."""

from __future__ import annotations

import threading
import time

from engine import sync


class ManagedThread:
    """The controller's view of one managed thread: parked (waiting for its turn) or running, the
    predicate it blocks on, the label of its schedule point."""

    __slots__ = ("name", "parked", "pred", "label", "ready", "wake")

    def __init__(self, name):
        self.name, self.parked, self.pred, self.label = name, False, None, "start"
        self.ready = False
        self.wake = 0.0  # virtual time a sleeping thread wakes up at


class StepLimit(RuntimeError):
    pass


class Controller:
    """Lets exactly one managed thread run at a time; the strategy picks among enabled threads."""

    def __init__(self, strategy, *, max_steps: int = 20_000):
        self.strategy = strategy
        self.max_steps = max_steps
        self.cv = threading.Condition()
        self.threads: dict[str, ManagedThread] = {}
        self.running: str | None = None
        self.clock = 0.0
        self.choices: list[str] = []
        self.error: BaseException | None = None
        self.aborted = False
        self._local = threading.local()
        self._exited: set[str] = set()
        # every thread this controller started, to wait for after uninstall (join_all)
        self._spawned: list[threading.Thread] = []

    # installation -----------------------------------------------------------------------------
    def install(self, name: str = "scheduler") -> Controller:
        """Take over the calling thread under `name` (uninstall gives it its old name back)."""
        self._installer_name = threading.current_thread().name
        threading.current_thread().name = name
        self._local.name = name
        self.threads[name] = ManagedThread(name)
        self.running = name
        sync.CONTROLLER = self
        return self

    def uninstall(self) -> None:
        with self.cv:
            self.aborted = True
            self.cv.notify_all()
        sync.CONTROLLER = None
        threading.current_thread().name = self._installer_name

    def join_all(self, timeout: float) -> list[str]:
        """After uninstall: wait up to `timeout` seconds in all for every thread this controller
        started; the schedule names of those still alive. A survivor would run on into the next
        schedule in this process, so the caller reports it as a failure of this one."""
        deadline = time.monotonic() + timeout
        for t in self._spawned:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.pdo_key for t in self._spawned if t.is_alive()]

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
        name = self._unique_name(f"{group}/{base}" if group else base)
        state = self.threads[name] = ManagedThread(name)

        def run():
            self._local.name = name
            self._local.group = group
            with self.cv:
                state.ready = state.parked = True
                self.cv.notify_all()
                while self.running != name and not self.aborted:
                    self.cv.wait()
                state.parked = False
            try:
                target()
            finally:
                self._exit(name)

        thread = threading.Thread(target=run, name=base, daemon=True)
        thread.pdo_key = name
        self._spawned.append(thread)
        thread.start()
        with self.cv:  # handshake: the new thread is parked before its parent goes on
            while not state.ready:
                self.cv.wait()
        return thread

    def _unique_name(self, first: str) -> str:
        """`first`, or `first#2`, `first#3`, ... if a live or exited thread already has it."""
        name, suffix = first, 1
        while name in self.threads or name in self._exited:
            suffix += 1
            name = f"{first}#{suffix}"
        return name

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
            state = self.threads[name]
            state.parked, state.pred, state.label, state.wake = True, pred, label, wake
            self._schedule()
            while self.running != name and not self.aborted:
                self.cv.wait()
            state.parked = False

    def _enabled(self) -> list[str]:
        """The threads that may go next, by name."""
        enabled = sorted(
            n for n, t in self.threads.items() if t.parked and (t.pred is None or t.pred())
        )
        # A sleeping thread lets every other enabled thread go first (a poll loop must not starve
        # the threads it waits for, whatever the strategy's priorities say), and sleepers wake in
        # virtual-time order (two poll loops must not starve each other either).
        awake = [n for n in enabled if self.threads[n].label != "sleep"]
        if awake:
            return awake
        if enabled:
            # Only sleepers: virtual time jumps to the earliest wake-up; the strategy picks among
            # ties.
            first = min(self.threads[n].wake for n in enabled)
            enabled = [n for n in enabled if self.threads[n].wake == first]
            self.clock = max(self.clock, first)
        return enabled

    def _schedule(self) -> None:
        enabled = self._enabled()
        if not enabled:
            blocked = ", ".join(f"{n} at {t.label}" for n, t in sorted(self.threads.items()))
            self._abort(sync.Deadlock(f"deadlock: no thread can proceed ({blocked})"))
            return
        if len(self.choices) >= self.max_steps:
            self._abort(StepLimit(f"more than {self.max_steps} schedule steps"))
            return
        try:
            pick = self.strategy.choose(enabled, self.running, len(self.choices))
        except Exception as exc:  # a strategy that cannot go on (a replay that diverged) ends the
            self._abort(exc)  # run for every thread; raised in one, it would strand the others
            return
        self.choices.append(pick)
        self.running = pick
        self.cv.notify_all()

    def _abort(self, exc) -> None:
        self.error = exc
        self.aborted = True
        self.cv.notify_all()
