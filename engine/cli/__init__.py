"""`pdo`: the command-line entry point. One registry of sub-commands (COMMANDS), each entry the
function that adds its parser(s) to `pdo`'s sub-parsers and sets `fn` on them. Errors print one line
and exit 2; never a traceback for bad input."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable

import checker.fuzz.cli
import checker.trace_cli
import engine.bench.cli
import engine.sglang.conform
import spec.cli
from checker.trace_io import TraceFormatError
from spec.registry import Registry

from . import bootstrap, check, launch, run

COMMANDS: Registry[Callable[[argparse._SubParsersAction], None]] = Registry("pdo sub-command")


# In this order in `pdo --help`.
COMMANDS.register("run")(run.register)
COMMANDS.register("check")(check.register)
COMMANDS.register("bootstrap")(bootstrap.register)
COMMANDS.register("bench")(engine.bench.cli.register)
COMMANDS.register("trace")(checker.trace_cli.register)
COMMANDS.register("launch")(launch.register)
COMMANDS.register("fuzz")(checker.fuzz.cli.register)
COMMANDS.register("spec")(spec.cli.register)  # table | prove | docs
COMMANDS.register("conform")(engine.sglang.conform.register)  # imports SGLang only when it runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdo", description="pd-overlap: run the instrumented engine, check its traces."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    for _name, add in COMMANDS.items():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if argv is None:
        argv = sys.argv[1:]
        # `pdo check t.jsonl | head` ends quietly, like any Unix tool
        if hasattr(signal, "SIGPIPE"):
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args, unrecognized = parser.parse_known_args(argv)
    if unrecognized:  # with the sub-command's own usage where it sets `error` (`pdo bootstrap`)
        getattr(args, "error", parser.error)(f"unrecognized arguments: {' '.join(unrecognized)}")
    # A sub-command may refuse a command line that parses (`pdo run`: PD-only flags without --pd).
    refuse = getattr(args, "refuse", None)
    reason = refuse(args, argv[1:]) if refuse is not None else None
    if reason:
        print(f"pdo {args.cmd}: error: {reason}", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, never a traceback, for anything the user can cause
        expected = (TraceFormatError, ValueError, OSError)
        if isinstance(exc, expected) or type(exc).__name__.endswith("Error"):
            print(f"pdo {args.cmd}: error: {exc}", file=sys.stderr)
            return 2
        raise
