"""One command-line convention for every `pdo` sub-command: `--help` exits 0 and names the exit codes,
`--json` is a flag that prints (never an option that takes a file), bad input exits 2 in one line,
and anything else escaping a sub-command is reported as a bug in pdo (exit 70, traceback only with
--debug)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest

import engine.cli
import engine.cli.check
from engine.cli import build_parser, exits, main, walk_parsers
from tests.trace_fixtures import canonical, write

PARSERS = [p.pdo_path for p in walk_parsers(build_parser()) if p.pdo_path]


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: --help, usage errors
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def test_the_walk_reaches_nested_sub_commands():
    names = {" ".join(p) for p in PARSERS}
    assert {"check", "bench prefill", "bench decode", "spec prove", "trace plot"} <= names
    assert {name for name, _ in engine.cli.COMMANDS.items()} <= names


@pytest.mark.parametrize("path", PARSERS, ids=" ".join)
def test_help_exits_0_and_names_the_exit_codes(path):
    rc, out, _ = _run([*path, "--help"])
    assert rc == 0
    assert "exit codes" in out and "70 internal error" in out and "README" in out


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("path", PARSERS, ids=" ".join)
def test_an_argparse_error_is_one_line_exit_2(path):
    """An unknown option (and any value argparse refuses) is one line naming the sub-command, not
    a usage block."""
    rc, out, err = _run([*path, "--no-such-option"])
    assert rc == exits.BAD_INPUT and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pdo {path[0]}"), err
    assert "--no-such-option" in lines[0] or "required" in lines[0], err


@pytest.mark.parametrize("path", PARSERS, ids=" ".join)
def test_json_is_a_flag_wherever_it_exists(path):
    parser = next(p for p in walk_parsers(build_parser()) if p.pdo_path == path)
    opts = _options(parser)
    if "--json" in opts:
        assert opts["--json"].nargs == 0, f"pdo {' '.join(path)} --json takes an argument"
    for name, action in opts.items():  # a file is written by --json-out, never by --json
        if name.startswith("--json") and name != "--json":
            assert name == "--json-out" and action.nargs != 0


def test_bench_json_prints_and_json_out_writes(tmp_path, capsys):
    """The one bench form (`--json` on stdout, `--json-out FILE`), shown on `pdo bench checker`."""
    out = tmp_path / "c.json"
    argv = ["bench", "checker", "--events", "2000", "--reps", "1", "--no-memory"]
    assert main([*argv, "--json", "--json-out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and printed["events"] >= 2000
    rc, _, err = _run([*argv, "--json", str(out)])  # the old file form is refused
    assert rc == exits.BAD_INPUT and "unrecognized arguments" in err


def test_an_internal_error_is_one_line_exit_70(tmp_path, monkeypatch):
    def broken(args):
        raise KeyError("rule_table")

    monkeypatch.setattr(engine.cli.check, "cmd_check", broken)
    monkeypatch.delenv("PDO_DEBUG", raising=False)
    path = write(tmp_path / "t.jsonl", "ahead", canonical("ahead"))
    rc, _, err = _run(["check", path])
    assert rc == exits.INTERNAL == 70
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "bug in pdo" in err and "KeyError" in err and "rule_table" in err and "--debug" in err
    rc, _, err = _run(["--debug", "check", path])
    assert rc == 70 and "Traceback (most recent call last)" in err and "KeyError" in err
    monkeypatch.setenv("PDO_DEBUG", "1")
    rc, _, err = _run(["check", path])
    assert rc == 70 and "Traceback" in err


def test_bad_input_is_classified_explicitly_not_by_name(tmp_path, monkeypatch):
    """A ValueError from inside pdo is a bug (70); a BadInput is the user's (2); a PD run that
    failed is 1, one that cannot start as configured 2."""
    from checker.predict import NoClocks
    from engine.bootstrap.client import BootstrapUnavailable
    from engine.decode.config import PDError, PDStartupError
    from engine.errors import ConfigError, EngineError
    from engine.kv.transport import KVTransportError
    from engine.prefill.worker import WorkerError
    from engine.sglang.versions import VersionError
    from engine.sync import Deadlock
    from spec.errors import BadInput, InternalError

    path = write(tmp_path / "t.jsonl", "ahead", canonical("ahead"))
    cases = [
        (ValueError("inside"), 70),
        (TypeError("x"), 70),
        (RecursionError("deep"), 70),
        (BadInput("f: no"), 2),
        (PDError("decode failed"), 1),
        (PDStartupError("not reachable"), 2),
        (EngineError("stuck: 2 request(s) can never finish"), 1),  # README: a run that failed
        (WorkerError("forward worker failed"), 1),
        (ConfigError("--x: no"), 2),
        (BootstrapUnavailable("http://h:1", "refused"), 1),
        (KVTransportError("peer gone"), 1),
        (Deadlock("all threads wait"), 1),
        (NoClocks("no clocks"), 2),
        (VersionError("0.5.1 is below the range"), 2),
        (InternalError("a state never reached"), 70),
    ]
    for exc, want in cases:

        def raise_it(args, exc=exc):
            raise exc

        monkeypatch.setattr(engine.cli.check, "cmd_check", raise_it)
        rc, _, err = _run(["check", path])
        assert rc == want, (exc, err)
        assert len(err.strip().splitlines()) == 1


def test_every_public_error_class_is_in_the_one_tree():
    """Each exception class a package defines for others to catch descends from PdoError (so the
    CLI maps it by its base); only a declared ControlFlow signal, a module's private one (a leading
    underscore) or a harness's verdict carrier stays outside."""
    import importlib
    import inspect
    import pkgutil

    from spec.errors import ControlFlow, PdoError

    outside = []
    for top in ("spec", "engine", "checker"):
        pkg = importlib.import_module(top)
        for info in pkgutil.walk_packages(pkg.__path__, top + "."):
            if info.name.endswith("__main__") or info.name.startswith(
                ("engine.sglang.conform", "checker.fuzz")
            ):
                continue  # a program, or a harness (its exceptions carry verdicts it catches)
            try:
                mod = importlib.import_module(info.name)
            except ImportError:  # an optional dependency (SGLang, Ray) absent
                continue
            for name, cls in vars(mod).items():
                if (
                    inspect.isclass(cls)
                    and issubclass(cls, BaseException)
                    and cls.__module__ == info.name
                    and not name.startswith("_")
                    and not issubclass(cls, (PdoError, ControlFlow))
                ):
                    outside.append(f"{info.name}.{name}")
    assert outside == []


def test_unopenable_input_is_bad_input(tmp_path):
    rc, _, err = _run(["check", str(tmp_path / "absent.jsonl")])
    assert rc == exits.BAD_INPUT and "absent.jsonl" in err and len(err.strip().splitlines()) == 1
    rc, _, err = _run(["check", str(tmp_path)])  # a directory
    assert rc == exits.BAD_INPUT and len(err.strip().splitlines()) == 1


def _with_batch(tmp_path, value: str, engine: str):
    path = write(tmp_path / f"b-{engine}.jsonl", "ahead", canonical("ahead"))
    lines = open(path).read().splitlines()
    n = next(i for i, line in enumerate(lines) if '"ev": "admit"' in line or '"ev":"admit"' in line)
    e = json.loads(lines[n])
    lines[n] = json.dumps(e).replace(f'"batch": {e["batch"]}', f'"batch": {value}')
    open(path, "w").write("\n".join(lines) + "\n")
    return path, n + 1


@pytest.mark.parametrize("engine_name", ["linear", "z3"])
@pytest.mark.parametrize(
    "value", [str(2**70), str(2**63), str(-(2**63) - 1), "NaN", "1e400", "[" * 80 + "]" * 80]
)
def test_values_the_checker_cannot_represent_are_bad_input(tmp_path, value, engine_name):
    """A batch id of 2^70 once ended in 'Python int too large to convert to C long', no file, no line."""
    path, line = _with_batch(tmp_path, value, engine_name)
    rc, _, err = _run(["check", "--engine", engine_name, path])
    assert rc == exits.BAD_INPUT, err
    assert (
        err.startswith(f"pdo check: error: {path}:{line}: ") and len(err.strip().splitlines()) == 1
    )


def test_int64_bounds_themselves_are_read(tmp_path):
    path, _ = _with_batch(tmp_path, str(2**63 - 1), "linear")
    rc, _, err = _run(["check", path])
    assert rc in (exits.OK, exits.FAILED, exits.BAD_INPUT) and "64 bits" not in err


def test_both_decoding_paths_agree(tmp_path, monkeypatch):
    """orjson (fast) and the standard library (exact) give the same verdict and message."""
    from checker import trace_io

    cases = [str(2**64 - 1), str(2**63), "1e400", '"\\ud800"', "[" * 70 + "]" * 70, "-0.0", "7"]
    for i, value in enumerate(cases):
        path = write(tmp_path / f"p{i}.jsonl", "ahead", canonical("ahead"))
        lines = open(path).read().splitlines()
        lines[3] = lines[3][:-1] + f', "x_extra": {value}' + "}"
        open(path, "w").write("\n".join(lines) + "\n")
        fast = _run(["check", path])
        with monkeypatch.context() as m:
            m.setattr(trace_io, "_orjson_loads", None)
            no_orjson = _run(["check", path])
            m.setattr(trace_io, "suspect", lambda raw: True)  # every chunk on the exact path
            exact = _run(["check", path])
        assert fast[0] == no_orjson[0] == exact[0], (value, fast, no_orjson, exact)
        assert fast[2] == no_orjson[2] == exact[2], value


def test_obj_may_be_an_integer_and_int_and_string_differ(tmp_path):
    events = canonical("ahead")
    as_int = [{**e, "obj": 1000 + ord(e["obj"][-1])} if "obj" in e else e for e in events]
    path = write(tmp_path / "int.jsonl", "ahead", as_int)
    assert main(["check", path]) == exits.OK
    assert main(["check", "--engine", "z3", path]) == exits.OK
    # the same trace with one chunk_dec naming "1097" (a string): a different object
    k = next(i for i, e in enumerate(as_int) if e["ev"] == "chunk_dec")
    mixed = [*as_int[:k], {**as_int[k], "obj": str(as_int[k]["obj"])}, *as_int[k + 1 :]]
    for engine_name in ("linear", "z3"):
        path = write(tmp_path / f"mixed-{engine_name}.jsonl", "ahead", mixed)
        rc, out, _ = _run(["check", "--engine", engine_name, path])
        assert rc == exits.FAILED and "P-chunk-counter" in out
