"""Every option of every `pdo` sub-command has a declared domain (spec/domains.py, or choices),
checked before anything runs: a value outside it is one line naming the option, exit 2, never an
internal error (70) and never a run without a bound. Hypothesis drives generated values through
every parser's options (issue 29, defect 5)."""

from __future__ import annotations

import argparse
import contextlib
import io
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checker.fuzz.cli
import checker.trace_cli
import engine.bench.decode
import engine.bench.prefill
import engine.bench.trace_overhead
import engine.bootstrap.server
import engine.cli.launch
import engine.runs.pd
import engine.runs.prefill_run
import spec.cli
from checker import bench as checker_bench
from engine.cli import build_parser, exits, main, walk_parsers
from spec.domains import Domain
from tests.trace_fixtures import canonical, write

PARSER = build_parser()
PARSERS = {p.pdo_path: p for p in walk_parsers(PARSER) if p.pdo_path}


class Ran(Exception):
    """Raised by every entry point that would start work: a test here must never reach one."""


@contextlib.contextmanager
def nothing_runs():
    def ran(*_a, **_k):
        raise Ran("a run started")

    targets = [
        (engine.runs.prefill_run, "run_prefill"),
        (engine.runs.pd, "run_pd"),
        (engine.cli.launch, "launch"),
        (engine.bootstrap.server, "serve_forever"),
        (checker.trace_cli, "plot"),
        (checker.trace_cli, "export"),
        (checker.fuzz.cli, "run_case"),
        (checker.fuzz.cli, "find_bug"),
        (engine.bench.decode, "bench_decode"),
        (engine.bench.prefill, "bench_prefill"),
        (engine.bench.trace_overhead, "bench_trace_overhead"),
        (checker_bench, "bench_checker"),
        (spec.cli, "prove_mode"),
        (spec.cli.unbounded_run, "run"),
    ]
    with contextlib.ExitStack() as stack:
        for module, name in targets:
            stack.enter_context(mock.patch.object(module, name, ran))
        yield


def _run(argv, **kw):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv, parser=PARSER, **kw)
        except SystemExit as e:  # argparse: a value outside its domain, --help
            rc = e.code
    return rc, err.getvalue()


def _takes_value(a: argparse.Action) -> bool:
    return a.nargs != 0 and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))


@pytest.mark.parametrize("path", list(PARSERS), ids=" ".join)
def test_every_option_has_a_declared_domain(path):
    loose = [
        a.option_strings[0] if a.option_strings else a.dest
        for a in PARSERS[path]._actions
        if _takes_value(a) and a.choices is None and not isinstance(a.type, Domain)
    ]
    assert not loose, f"pdo {' '.join(path)}: options without a declared domain: {loose}"


# issue 29's reproductions, and their neighbours: (command line, the option the error names)
BAD = [
    (["run", "--prompt-len", "50:10"], "--prompt-len"),
    (["run", "--hit", "nan"], "--hit"),
    (["run", "--hit", "1.5"], "--hit"),
    (["run", "--arrival", "poisson", "--rate", "0"], "--rate"),
    (["run", "--arrival", "poisson", "--rate", "1e-9"], "--rate"),
    (["run", "--rate", "nan"], "--rate"),
    (["run", "--rate", "-1"], "--rate"),
    (["run", "--requests", "-5"], "--requests"),
    (["run", "--dtype", "bogus"], "--dtype"),
    (["run", "--num-pages", "0"], "--num-pages"),
    (["run", "--watchdog-s", "0"], "--watchdog-s"),
    (["run", "--inject", "bogus"], "--inject"),
    (["run", "--prompt-len", "2000:2000"], "--prompt-len"),
    (["run", "--seed", str(2**70)], "--seed"),
    (["run", "--admission-cost-us", "1e308"], "--admission-cost-us"),
    (["run", "--pd", "--kill", "prefill5@0"], "--kill"),
    (["run", "--pd", "--dp", "2", "--kill", "decode@0"], "--kill"),
    (["launch", "--kill", "prefill9@0"], "--kill"),
    (["launch", "--dp", "0"], "--dp"),
    (["bootstrap", "--port", "70000"], "--port"),
    (["bootstrap", "--expected-ranks", "0"], "--expected-ranks"),
    (["bootstrap", "--failure-rate", "inf"], "--failure-rate"),
    (["trace", "plot", "t.jsonl", "-o", "x.png", "--width", "0"], "--width"),
    (["trace", "plot", "t.jsonl", "-o", "x.png", "--dpi", "0"], "--dpi"),
    (["trace", "plot", "t.jsonl", "-o", "x.txt"], "--output"),
    (["trace", "plot", "t.jsonl", "-o", "DIR"], "--output"),
    (["trace", "plot", "t.jsonl", "-o", "x.png", "--width", "100", "--dpi", "1200"], "--width"),
    (["trace", "plot", "t.jsonl", "-o", "x.png", "--batches", "5:2"], "--batches"),
    (["fuzz", "--jobs", "0"], "--jobs"),
    (["fuzz", "--ray-cpus", "0"], "--ray-cpus"),
    (["check", "--ray", "--ray-cpus", "0", "t.jsonl"], "--ray-cpus"),
    (["fuzz", "--hit", "-0.5"], "--hit"),
    (["bench", "prefill", "--modes", "bogus"], "--modes"),
    (["bench", "decode", "--rate", "1e-9"], "--rate"),
    (["bench", "checker", "--events", "-1"], "--events"),
    (["spec", "prove", "--batches", "100000"], "--batches"),
    (["spec", "prove", "--drop", "no-such-rule"], "--drop"),
]


@pytest.mark.parametrize("argv,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_value_outside_its_domain_is_one_line_naming_the_option(argv, option):
    with nothing_runs():
        rc, err = _run(argv)
    assert rc == exits.BAD_INPUT, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pdo {argv[0]}") and option in lines[0], err


def test_device_cuda_on_a_torch_without_cuda_is_bad_input():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    with nothing_runs():
        rc, err = _run(["run", "--device", "cuda"])
    assert rc == exits.BAD_INPUT and "--device cuda" in err and len(err.strip().splitlines()) == 1


def test_a_stuck_run_exits_1_not_70():
    """EngineError (a run that can never finish) is a failed run (README: 1), not a bug in pdo."""
    rc, err = _run(["run", "--requests", "2", "--prompt-len", "16:40", "--num-pages", "2"])
    assert rc == exits.FAILED, err
    assert len(err.strip().splitlines()) == 1 and "stuck" in err and "internal error" not in err


# ---- generated values over every option of every parser


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return write(tmp_path_factory.mktemp("t") / "t.jsonl", "ahead", canonical("ahead"))


def _required(path: tuple, trace: str) -> list[str]:
    """Valid values for what a sub-command requires, so that the option under test is reached."""
    return {
        ("check",): [trace],
        ("trace", "export"): [trace, "--perfetto", "out.json"],
        ("trace", "plot"): [trace, "-o", "out.png"],
        ("conform",): ["sglang"],
    }.get(path, [])


def _options(path) -> list[argparse.Action]:
    return [
        a
        for a in PARSERS[path]._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(["0", "1", "-1", "2", "65535", "65536", "1024", str(2**63), "1:0", "0:1"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
    st.sampled_from(["prefill0@0", "prefill1@3", "decode@1", "bootstrap@0", "a:b", ":", "1e-9"]),
)


@st.composite
def command_lines(draw):
    path = draw(st.sampled_from(sorted(PARSERS)))
    opts = _options(path)
    argv = []
    for action in draw(st.lists(st.sampled_from(opts), max_size=3)) if opts else []:
        name = action.option_strings[-1]
        if action.nargs == 0:
            argv.append(name)
            continue
        values = (
            VALUES if action.choices is None else st.sampled_from([str(c) for c in action.choices])
        )
        argv += [name, draw(st.one_of(values, VALUES))]
    return path, argv


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(command_lines())
def test_generated_values_never_give_an_internal_error(trace_path, command):
    """Parse and validate (everything that precedes a run): 0 or 2, never 70, a refusal in one
    line; nothing starts (an entry point that would run raises, and would show as 70)."""
    path, argv = command
    full = [*path, *_required(path, trace_path), *argv]
    with nothing_runs():
        rc, err = _run(full, validate_only=True)
    assert rc in (exits.OK, exits.BAD_INPUT), (full, rc, err)
    if rc == exits.BAD_INPUT:
        assert len(err.strip().splitlines()) == 1, (full, err)


@pytest.mark.parametrize("sub", ["export", "plot"])
def test_export_and_plot_agree_on_a_trace_with_no_events(tmp_path, sub):
    """Nothing to show is bad input for both (export once wrote an empty file and exited 0)."""
    path = write(tmp_path / "empty.jsonl", "ahead", [])
    out = tmp_path / ("o.json" if sub == "export" else "o.png")
    argv = [
        "trace",
        sub,
        path,
        *(["--perfetto", str(out)] if sub == "export" else ["-o", str(out)]),
    ]
    rc, err = _run(argv)
    lines = err.strip().splitlines()
    assert rc == exits.BAD_INPUT and len(lines) == 1, err
    assert lines[0].startswith(f"pdo trace: error: {path}: ") and "no events" in lines[0], err
    assert not out.exists()


def test_plot_reports_the_file_it_wrote(tmp_path, trace_path, capsys):
    """`-o` names the picture with its suffix: what is reported is what was written."""
    png = tmp_path / "t.svg"
    assert main(["trace", "plot", trace_path, "-o", str(png), "--title", "$x^$ 50%"]) == 0
    assert png.exists() and capsys.readouterr().out.startswith(f"pdo trace plot: {png}: ")
    assert [p.name for p in tmp_path.iterdir()] == ["t.svg"]
