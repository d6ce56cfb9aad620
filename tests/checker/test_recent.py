"""checker/recent.py: facts kept in generations answer as one table of every fact would, and
look-ups of old facts cost no more than that table once they add up."""

from hypothesis import given, settings
from hypothesis import strategies as st

from checker.recent import Generations

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from("ab")),
        st.tuples(st.just("age")),
        st.tuples(st.just("find"), st.sampled_from("abc"), st.integers(0, 30)),
    ),
    max_size=60,
)


def _first_wins(old: dict, gen: dict) -> None:
    for k, v in gen.items():
        old.setdefault(k, v)


@settings(max_examples=400, deadline=None)
@given(_OPS)
def test_find_answers_as_every_earlier_fact_would(ops):
    """Values grow with time (as seqs do): `find(k, bound.__gt__)` is whether some value of k
    recorded before the current generation is below the bound, whatever the merges did."""
    g, earlier, current, clock = Generations(_first_wins), {}, {}, 0
    for op in ops:
        if op[0] == "add":
            clock += 1
            g.young.setdefault(op[1], clock)
            current.setdefault(op[1], clock)
        elif op[0] == "age":
            g.age()
            for k, v in current.items():
                earlier.setdefault(k, []).append(v)
            current = {}
        else:
            _, key, bound = op
            want = any(v < bound for v in earlier.get(key, ()))
            assert g.find(key, bound.__gt__) == want


def test_old_facts_read_often_are_merged_into_one_table():
    merged = []

    def merge(old, gen):
        merged.append(len(gen))
        _first_wins(old, gen)

    g = Generations(merge)
    for k in range(1000):  # a fact per generation
        g.young[k] = k
        g.age()
    assert not merged
    assert g.find(999, (999).__eq__)  # the newest: one generation read
    assert g.find(0, (0).__eq__)  # the oldest: all of them, as many as they hold facts
    assert g.find(10_000, bool) is False  # a miss reads all of them too: past the debt allowed
    assert sum(merged) == 1000  # ... so all were merged, once
    assert g.find(999, (999).__eq__) and g.find(0, (0).__eq__)
    assert sum(merged) == 1000  # and read from the merged table
