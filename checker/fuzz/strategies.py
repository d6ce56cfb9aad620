"""Strategies: how a schedule is drawn. Each has `choose(enabled, running, step)`, called by the
controller at every schedule point with the enabled thread names (sorted), the running thread and
the step number; it returns the thread that goes next."""

from __future__ import annotations

import random

from spec.errors import BadInput


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
    running thread drops to the lowest priority. Finds any bug of depth d with probability
    >= 1/(n k^(d-1))."""

    name = "pct"

    def __init__(self, seed: int, depth: int = 3, steps: int = 400):
        self.rng = random.Random(seed)
        self.prio: dict[str, float] = {}
        self.changes = sorted(self.rng.sample(range(1, steps), max(0, depth - 1)))
        self.low = 0.0

    def choose(self, enabled, running, step):
        for name in enabled:
            if name not in self.prio:
                self.prio[name] = 1.0 + self.rng.random()
        if self.changes and step >= self.changes[0] and running in self.prio:
            self.changes.pop(0)
            self.low -= 1.0
            self.prio[running] = self.low
        return max(enabled, key=lambda name: self.prio[name])


class ScheduleDiverged(RuntimeError):
    pass


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
                raise ScheduleDiverged(
                    f"schedule step {step}: {want} is not enabled (enabled: {', '.join(enabled)})"
                )
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


def make_strategy(name: str, seed: int, *, depth: int = 3, steps: int = 400):
    """The strategy `name` (random or pct) seeded with `seed`. `steps`: the run length PCT spreads
    its priority-change points over (about the schedule length)."""
    if name == "random":
        return RandomWalk(seed)
    if name == "pct":
        return PCT(seed, depth=depth, steps=steps)
    raise BadInput(f"unknown strategy {name!r}; choose pct, random or dfs")
