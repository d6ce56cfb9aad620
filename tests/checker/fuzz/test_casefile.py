"""`pdo fuzz --replay` reads a case file whole before it runs anything: a field outside its domain is
one line naming the case file and the field (exit 2, never 70, never reported against a temporary
trace), and a schedule that does not fit the run is reported as diverged (exit 3), never replayed
silently as another run (issue 29, defect 6; docs/fuzzing.md, "Replay guarantees")."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checker.fuzz import Case, Default, PDCase, load_case, run_case, save_case
from engine.cli import build_parser, exits, main
from spec.errors import BadInput

PARSER = build_parser()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A clean prefill case and the schedule its run took, as `pdo fuzz` saves it."""
    case = Case(mode="ahead", requests=2, prompt_len=(8, 24))
    out = run_case(case, Default())
    assert not out.failures, out.failures
    path = tmp_path_factory.mktemp("case") / "clean.case.json"
    save_case(str(path), case, out.schedule, out.failures, model=False)
    return json.loads(path.read_text())


def _replay(path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["fuzz", "--replay", str(path)], parser=PARSER)
    return rc, out.getvalue(), err.getvalue()


def test_the_saved_case_replays_clean(saved, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(saved))
    rc, out, _ = _replay(path)
    assert rc == exits.OK and "no failure" in out and f"{len(saved['schedule'])} steps" in out


def _set(key, value):
    def change(saved):
        saved["case"][key] = value

    return change


CORRUPT = {
    "case null": (lambda s: s.__setitem__("case", None), "field case:"),
    "requests a string": (_set("requests", "1"), "field case.requests:"),
    "page_size a float": (_set("page_size", 4.5), "field case.page_size:"),
    "requests 0": (_set("requests", 0), "field case.requests:"),
    "unknown mutant": (_set("inject", ["no-such-mutant"]), "field case.inject:"),
    "prompt_len reversed": (_set("prompt_len", [40, 8]), "field case.prompt_len:"),
    "prompt_len one long": (_set("prompt_len", [8]), "field case.prompt_len:"),
    "seed 2^70": (_set("workload_seed", 2**70), "field case.workload_seed:"),
    "hit above 1": (_set("hit", 1.5), "field case.hit:"),
    "mode unknown": (_set("mode", "warp"), "field case.mode:"),
    "unknown field": (_set("speed", 3), "field case.speed:"),
    "chunk below page": (_set("chunk_size", 2), "field case.chunk_size:"),
    "schedule a string": (lambda s: s.__setitem__("schedule", "scheduler"), "field schedule:"),
    "schedule of ints": (lambda s: s.__setitem__("schedule", [1, 2]), "field schedule[0]:"),
    "no schedule": (lambda s: s.pop("schedule"), "schedule"),
    "model not a bool": (lambda s: s.__setitem__("model", "yes"), "field model:"),
}


@pytest.mark.parametrize("name", list(CORRUPT))
def test_a_corrupted_case_file_is_one_line_naming_file_and_field(saved, tmp_path, name):
    change, field = CORRUPT[name]
    data = json.loads(json.dumps(saved))
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    rc, out, err = _replay(path)
    lines = err.strip().splitlines()
    assert rc == exits.BAD_INPUT and not out, (rc, out, err)
    assert len(lines) == 1 and lines[0].startswith(f"pdo fuzz: error: {path}: "), err
    assert field in lines[0], err


def test_a_pd_case_with_a_bad_field_names_it(tmp_path):
    path = tmp_path / "pd.json"
    save_case(str(path), PDCase(), ["scheduler"], [])
    data = json.loads(path.read_text())
    data["case"]["aborts"] = [[2, "x"]]
    path.write_text(json.dumps(data))
    with pytest.raises(BadInput, match=r"pd\.json: field case\.aborts\[0\]\[1\]: expected `int`"):
        load_case(str(path))


@pytest.mark.parametrize("text", ["", "{", "[]", "null", '{"case": {}}', "\udcff"])
def test_what_is_not_a_case_file_is_bad_input(tmp_path, text):
    path = tmp_path / "x.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    rc, _, err = _replay(path)
    assert rc == exits.BAD_INPUT and err.startswith(f"pdo fuzz: error: {path}: "), err
    assert len(err.strip().splitlines()) == 1


def test_nesting_100000_deep_is_bad_input(tmp_path):
    for inner in ("[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000):
        path = tmp_path / "deep.json"
        path.write_text('{"note": ' + inner + ', "case": {}, "schedule": []}')
        rc, _, err = _replay(path)
        assert rc == exits.BAD_INPUT and "nested too deep" in err, err


@pytest.mark.parametrize(
    "schedule",
    [["bogus"], "first step renamed", "one step more"],
    ids=["bogus", "renamed", "longer"],
)
def test_a_schedule_that_does_not_fit_is_reported_as_diverged(saved, tmp_path, schedule):
    """Strict replay: the replay never runs something else than the saved run and calls it a
    verdict (it once said "no failure", exit 0)."""
    steps = list(saved["schedule"])
    if schedule == "first step renamed":
        steps[0] = "nobody"
    elif schedule == "one step more":
        steps.append(steps[-1])
    else:
        steps = schedule
    path = tmp_path / "d.json"
    path.write_text(json.dumps({**saved, "schedule": steps}))
    rc, out, _ = _replay(path)
    assert rc == exits.INCOMPLETE, out
    assert "DIVERGED at schedule step" in out and "no failure" not in out and "FAIL" not in out


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)  # JSON has neither
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(key=st.sampled_from([f.name for f in __import__("dataclasses").fields(PDCase)]), value=JSON)
def test_generated_field_values_load_or_are_refused_naming_the_field(saved, tmp_path, key, value):
    """Any JSON value in any field of a case: loaded as a case whose fields are in their domain,
    or refused with the file and the field; never another exception."""
    data = json.loads(json.dumps(saved))
    data["case"]["kind"] = "pd"
    data["case"][key] = value
    path = tmp_path / "g.json"
    path.write_text(json.dumps(data))
    try:
        case, _, _ = load_case(str(path))
    except BadInput as exc:
        assert str(exc).startswith(f"{path}: field case.") and "\n" not in str(exc), exc
        return
    assert isinstance(case, PDCase if data["case"]["kind"] == "pd" else Case)
    assert 1 <= case.requests <= 64 and case.prompt_len[0] <= case.prompt_len[1]
    assert all(type(x) is int and abs(x) < 2**63 for x in (case.workload_seed, case.fault_seed))
