"""The workload of the decode model: bootstrap addresses and their rooms over a number of loop
iterations, and the queries its universe holds (spec/z3model/decode_loops.py). The canonical one
serves `pdo spec prove`; a trace's (spec/z3model/decode_traces.py) narrows it to what the trace
logged."""

from __future__ import annotations

from dataclasses import dataclass

import z3

# The first iteration whose prefetch can submit: it needs the address's parallel info, which the
# consumption point fetches when a room of the address is pending, and a room still unknown, but
# that consumption resolved every room then pending: a room arriving later (intake of iteration 2 at
# the earliest) is first seen by the prefetch of the iteration after (3). Queries of earlier
# iterations are left out of the universe (outside_universe: the loop model cannot submit them).
FIRST_SUBMIT = 3

DECODE_MODEL_MUTANTS = {  # engine/runtime/inject.py decode mutants the decode loop model knows
    "double-prefetch": "the prefetch submits while a query of the address is in flight; the new "
    "future replaces the old one, which is never closed",
    "no-cancel-on-release": "the release_memory hook leaves the prefetched futures running",
}


@dataclass(frozen=True)
class DecodeWorkload:
    iterations: int
    rooms: tuple = (("127.0.0.1:8998", (1, 2, 3)), ("127.0.0.1:8999", (4,)))
    mutants: tuple = ()  # of DECODE_MODEL_MUTANTS

    def server_rank(self, room: int) -> int:
        return room % 2

    def room_sets(self, a: int) -> list[tuple]:
        """Every nonempty subset of the address's rooms, in arrival order."""
        rooms = self.rooms[a][1]
        return [
            tuple(r for n, r in enumerate(rooms) if mask >> n & 1)
            for mask in range(1, 1 << len(rooms))
        ]

    def submit_sets(self, a: int) -> list[tuple]:
        """The room sets a prefetch can ask for: without the address's first room, which the
        consumption that fetches the address's parallel info resolves (or which was aborted
        before it)."""
        return [asked for asked in self.room_sets(a) if self.rooms[a][1][0] not in asked]

    def all_rooms(self) -> list[tuple]:
        return [(a, r) for a, (_, rooms) in enumerate(self.rooms) for r in rooms]

    # What a trace's workload (spec/z3model/decode_traces.py) narrows down: the universe's
    # prefetched and synchronous queries, and where the loop may leave it.
    prefetching = True  # the loop calls the prefetch (off: SGLang without PR #35071)
    memory_bound = False  # receiver init may find no memory, which stops the pass (FIFO)
    exact = False  # the loop stays inside the universe (asserted, E:emits) rather than proved to
    partial = False  # the server may leave rooms it does not know yet out of an answer
    complete = True  # every arrived request is served within the iterations (a truncated
    # trace's run went on past them)

    def prefetch_keys(self, a: int) -> list[tuple]:
        """(iteration, room set) of every prefetched query of address a the universe holds."""
        return [
            (j, asked)
            for j in range(FIRST_SUBMIT, self.iterations + 1)
            for asked in self.submit_sets(a)
        ]

    def sync_tag(self, i: int):
        """What tells synchronous queries of one room set apart: nothing (a set is resolved at
        most once when every answer is complete)."""
        return "sync"

    def sync_keys(self, a: int) -> list[tuple]:
        return [("sync", room_set) for room_set in self.room_sets(a)]

    def single_rank(self, a: int) -> bool:
        """The prefill of address a has one DP rank: its rooms' rank is known without a query."""
        return False

    def environment(self) -> dict | None:
        """The environment's choices when they are known (a trace's): arrives and aborts per room,
        polls(i), release_at, resume_at; None: z3 chooses."""
        return None

    def info_available(self, a: int, i: int) -> bool:
        """Whether address a's prefill has published its parallel info by iteration i."""
        return True

    def abort_place(self, index: int, room=None) -> float:
        """Where in its iteration a pending request is aborted: after intake, in room order."""
        return 15 + index * self.room_step()

    def room_step(self) -> float:
        """The spacing of per-room steps of one iteration (intake, aborts)."""
        return 1 / 10

    def init_order(self, arrives, index):
        """Receiver init's offset in its iteration: arrival order, then room order (below 10)."""
        return (10 * z3.ToReal(arrives) + index) / 1000
