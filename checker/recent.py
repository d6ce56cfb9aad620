"""A table of facts about requests that are read soon after they are written.

A rule such as "every chunk_inc names an object allocated for its request" must remember every
request of the trace, though it reads a request's facts mostly within a chunk or two of writing
them. One dict of every request grows past the caches, and then each insert and each look-up
misses them: in the checker's streaming pass that, not the Python around it, is most of such a
rule's cost. `Generations` keeps the facts of the current chunk in a small dict (`young`, written
and read directly by the template's loop), and those of earlier chunks in one small dict per chunk,
read newest first. A look-up that reads past many of them runs up a debt; once the debt exceeds
the entries the old generations hold, they are merged into one table (`old`), so a trace that
reads old facts often (a damaged one) costs what one table would, and no look-up waits on more
generations than were merged.
"""

from __future__ import annotations

from collections.abc import Callable


class Generations:
    """key -> value facts in generations: `young` is the current one (the template writes it, one
    value per key: its first); `age()` ends it. `find(key, test)`: whether a value of the key in
    an earlier generation passes `test`. `merge(old, gen)` folds a generation into `old`, older
    generations first; it decides which values `old` keeps (those `find` can still pass)."""

    def __init__(self, merge: Callable[[dict, dict], object]):
        self.young: dict = {}
        self.old: dict = {}
        self._gens: list[dict] = []  # the generations since the last merge, oldest first
        self._merge = merge
        self._held = 0  # the entries of _gens
        self._debt = 0  # the generations read since the last merge

    def age(self) -> None:
        """The current generation is over (a chunk of the trace was read)."""
        if self.young:
            self._gens.append(self.young)
            self._held += len(self.young)
            self.young = {}

    def find(self, key, test: Callable[[object], bool]) -> bool:
        """Whether some value of `key` before the current generation passes `test`."""
        gens, found = self._gens, False
        for k in range(len(gens) - 1, -1, -1):
            v = gens[k].get(key)
            if v is not None and test(v):
                found = True
                break
        else:
            k = 0
            v = self.old.get(key)
            found = v is not None and test(v)
        self._debt += len(gens) - k
        if self._debt > self._held:
            for gen in gens:
                self._merge(self.old, gen)
            gens.clear()
            self._held = self._debt = 0
        return found
