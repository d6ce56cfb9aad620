"""`pdo`: the command-line entry point. One registry of sub-commands (COMMANDS), each entry the
function that adds its parser(s) to `pdo`'s sub-parsers and sets `fn` on them.

Every option has a declared domain (spec/domains.py), checked as argparse parses it; then the
sub-command's `validate` (set with set_defaults) checks what spans options (a `--kill` role against
`--dp`, a prompt that must fit the model), before anything runs.

Exit codes (engine/cli/exits.py, README "Exit codes"), by the error tree of spec/errors.py: bad
input -- a BadInput (a TraceFormatError, an engine ConfigError, ...), an OSError (a file that cannot
be opened), an argparse error -- prints one line and exits 2; a run that failed (a RunFailed: an
EngineError, a PD role's PDError, a bootstrap server gone) one line and exit 1; any other exception
is a bug in pdo: one line saying so, exit 70, and the traceback only with `pdo --debug` (or
PDO_DEBUG=1)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Callable

try:  # Ctrl-C while pdo starts (these imports take a second): exit 130, no traceback
    import checker.fuzz.cli
    import checker.trace_cli
    import engine.bench.cli
    import engine.sglang.conform
    import spec.cli
    from engine.cli import bootstrap, check, exits, launch, run
    from spec.errors import BadInput, RunFailed
    from spec.registry import Registry
except KeyboardInterrupt:
    raise SystemExit(130) from None

# By base class (spec/errors.py): anything else escaping a sub-command is a bug in pdo. A file that
# cannot be opened (OSError) is bad input too.
BAD_INPUT_TYPES = (BadInput, OSError)
FAILED_RUN_TYPES = (RunFailed,)

EXIT_CODES_HELP = (
    "exit codes: 0 pass, 1 violation or failed run, 2 bad input, 3 no verdict (incomplete), "
    "70 internal error (a bug in pdo); README.md, 'Exit codes'"
)

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


class Parser(argparse.ArgumentParser):
    """argparse's own errors (an unknown option, a value outside its domain) in one line, exit 2;
    every sub-parser is one too (add_subparsers makes its parsers of the parent's class)."""

    def error(self, message: str):
        self.exit(
            exits.BAD_INPUT, f"{self.prog}: error: {_one_line(message)} ({self.prog} --help)\n"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pdo",
        description="pd-overlap: run the instrumented engine, check its traces.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="on an internal error (exit 70), print the traceback (also PDO_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    for _name, add in COMMANDS.items():
        add(sub)
    for p in walk_parsers(parser):  # every sub-command's --help names the exit codes
        if p is not parser:
            p.epilog = f"{p.epilog}\n\n{EXIT_CODES_HELP}" if p.epilog else EXIT_CODES_HELP
            # an unrecognized argument is reported by the sub-command that was given it
            p.set_defaults(error=p.error)
    return parser


def walk_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Yield `parser` and every sub-command parser below it (`pdo bench prefill`, `pdo spec
    prove`, ...); each carries its command words as `pdo_path`."""
    parser.pdo_path = path
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk_parsers(sub, (*path, name))


def main(
    argv: list[str] | None = None,
    *,
    parser: argparse.ArgumentParser | None = None,
    validate_only: bool = False,
) -> int:
    """`pdo argv...`; `parser` is build_parser()'s, for a caller that runs many commands.
    `validate_only`: parse and validate the command line (every check that precedes running), then
    return OK without running anything (what the tests of the option domains call). SIGINT anywhere
    in it (building the parser included) exits 130 without a traceback."""
    try:
        return _main(argv, parser, validate_only)
    except KeyboardInterrupt:
        return exits.INTERRUPTED


def _main(
    argv: list[str] | None, parser: argparse.ArgumentParser | None, validate_only: bool
) -> int:
    parser = parser or build_parser()
    if argv is None:
        argv = sys.argv[1:]
        # `pdo check t.jsonl | head` ends quietly, like any Unix tool
        if hasattr(signal, "SIGPIPE"):
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        args, unrecognized = parser.parse_known_args(argv)
        if unrecognized:  # by the innermost sub-command's parser (its `error`)
            getattr(args, "error", parser.error)(
                f"unrecognized arguments: {' '.join(unrecognized)}"
            )
    except SystemExit as exc:  # argparse: --help (0), or a value outside its domain (2, one line)
        return exc.code
    # A sub-command checks what spans options (`pdo run`: PD-only flags without --pd, a --kill
    # role against --dp): BadInput, before anything runs.
    validate = getattr(args, "validate", None)
    rest = argv[argv.index(args.cmd) + 1 :] if args.cmd in argv else argv[1:]
    try:
        if validate is not None:
            validate(args, rest)
        if validate_only:
            return exits.OK
        return args.fn(args)
    except BAD_INPUT_TYPES as exc:  # one line, never a traceback, for what the user can cause
        print(f"pdo {args.cmd}: error: {exc}", file=sys.stderr)
        return exits.BAD_INPUT
    except FAILED_RUN_TYPES as exc:  # a PD role or the engine failed, or timed out: the run failed
        print(f"pdo {args.cmd}: error: {_one_line(exc)}", file=sys.stderr)
        return exits.FAILED
    except Exception as exc:
        debug = args.debug or os.environ.get("PDO_DEBUG", "").strip() not in ("", "0")
        if debug:
            traceback.print_exc()
        print(
            f"pdo {args.cmd}: internal error (a bug in pdo, please report it): "
            f"{type(exc).__name__}: {_one_line(exc)}" + ("" if debug else " (--debug: traceback)"),
            file=sys.stderr,
        )
        return exits.INTERNAL


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
